"""Forecasters the simulator explores (rayscale.core.forecast): season detection, horizon peak, peak hold."""

from __future__ import annotations

import numpy as np
import pytest

from rayscale.config import load_catalog
from rayscale.core.forecast import (
    FORECASTERS,
    Seasonal,
    TrendSeasonal,
    detect_season,
    line_ahead,
    rise_room,
    without_spikes,
)
from rayscale.core.settings import Settings
from rayscale.core.step import forecaster_for
from rayscale.sim.policies import RayscalePolicy
from rayscale.sim.simulator import SimConfig, Simulation
from rayscale.sim.sources import load_spec


def bursts(n: int, period: int = 30, start: int = 15, length: int = 5, base: float = 2.0, peak: float = 12.0,
           noise: float = 0.3, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    x = [peak if (i - start) % period < length and i >= start else base for i in range(n)]
    return [max(0.0, v + rng.normal(0, noise)) for v in x]


def old_trend(history: list[float], current: float, alpha: float = 0.5, beta: float = 0.2, horizon: int = 6) -> float:
    """Holt's linear trend over the completed windows, never below the current rate: TrendSeasonal without a
    season must stay exactly this (the live 'trend' forecaster)."""
    xs = list(history)
    if len(xs) < 3:
        return current
    level, trend = xs[0], xs[1] - xs[0]
    for x in xs[1:]:
        prev = level
        level = alpha * x + (1 - alpha) * (level + trend)
        trend = beta * (level - prev) + (1 - beta) * trend
    return max(current, level + horizon * trend)


def test_detect_season_needs_two_periods_and_ignores_trends_and_noise():
    assert detect_season(bursts(50)) == 0  # one burst seen: no pattern yet
    assert detect_season(bursts(62)) == 30  # two periods of differences
    assert detect_season(bursts(120, period=20, start=5)) == 20
    rng = np.random.default_rng(1)
    assert detect_season(list(5 + rng.normal(0, 1, 120))) == 0
    assert detect_season([1 + 0.1 * i + 0.05 * rng.normal() for i in range(120)]) == 0  # a ramp is no season
    assert detect_season([3.0] * 100) == 0


def test_trend_without_season_is_unchanged():
    rng = np.random.default_rng(2)
    for _ in range(50):
        h = list(np.abs(rng.normal(5, 2, int(rng.integers(0, 40)))))
        cur = float(abs(rng.normal(5, 2)))
        assert TrendSeasonal(horizon=10)(h, cur) == pytest.approx(old_trend(h, cur, horizon=10), rel=1e-12)


def test_seasonal_forecast_covers_every_window_of_the_horizon():
    h = bursts(100, noise=0.0)  # bursts at 15, 45, 75, 105: the next one is 5 windows after the history ends
    s = TrendSeasonal(season=30, horizon=10)
    assert s(h[:-1], h[-1]) > 9.0  # the burst in 5 windows is inside the horizon: keep capacity for it
    assert TrendSeasonal(season=30, horizon=2)(h[:-1], h[-1]) < 4.0  # beyond a short horizon: not yet
    auto = Seasonal(horizon=10)
    assert auto(h[:-1], h[-1]) == pytest.approx(s(h[:-1], h[-1]))


def test_a_spike_in_the_open_window_is_a_floor_not_a_trend():
    # A 1-min history near 10 req/s and a 30-s spike to 54: order for the spike, not for a line through it.
    h = [10.0, 9.0, 11.0, 10.0, 10.0, 9.5]
    assert TrendSeasonal(horizon=10)(h, 54.0) == 54.0
    assert Seasonal(horizon=10, peak_window=60)(h, 54.0) == 54.0
    # A ramp in the completed windows is still extrapolated.
    assert TrendSeasonal(horizon=10)([2.0, 4.0, 6.0, 8.0, 10.0], 11.0) > 20.0


def test_read_without_spikes_a_minute_burst_is_no_trend_and_a_ramp_still_is():
    # 1 req/s, and one window lifted by a 60-s burst: read as it came, Holt's trend carries the step a
    # horizon ahead; read without spikes (the lowest of each window and the two before), it is gone.
    h = [1.0] * 20 + [4.75, 1.0]
    assert TrendSeasonal(horizon=15)(h, 1.0) > 4.0
    assert TrendSeasonal(horizon=15, spike_windows=3)(h, 1.0) == pytest.approx(1.0)
    assert Seasonal(horizon=15, spike_windows=3, peak_window=30)(h, 1.0) == 4.75  # the peak hold still holds it
    # A ramp that lasts is still extrapolated, two windows late.
    ramp = [2.0 + 0.4 * i for i in range(20)]
    assert TrendSeasonal(horizon=15, spike_windows=3)(ramp[:-1], ramp[-1]) > ramp[-1] + 4.0
    assert without_spikes([1.0, 5.0, 1.0, 2.0, 3.0], 3) == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert without_spikes([1.0, 5.0, 1.0], 1) == [1.0, 5.0, 1.0]
    cat = load_catalog().subset(["mistral-7b"])
    assert forecaster_for(cat, Settings(spike_windows=3)).spike_windows == 3  # type: ignore[attr-defined]
    assert forecaster_for(cat, Settings()).spike_windows == 1  # type: ignore[attr-defined]  # shipped: as read
    with pytest.raises(ValueError, match=r"Settings\.spike_windows must be >= 1"):
        Settings(spike_windows=0)


def test_peak_hold_never_below_recent_peak():
    h = [2.0] * 20 + [12.0] * 3 + [2.0] * 10
    assert Seasonal(peak_window=15)(h, 2.0) == 12.0
    assert Seasonal(peak_window=5)(h, 2.0) < 3.0
    assert Seasonal(peak_window=15)([], 2.0) == 2.0
    assert set(FORECASTERS) >= {"last", "trend", "seasonal", "peak"}


def test_rise_room_is_the_largest_rise_within_the_windows_and_unbounded_before_the_history_spans_them():
    assert rise_room([1.0, 2.0, 3.0, 10.0, 2.0, 1.0, 1.0, 1.0], 3) == 9.0
    assert rise_room([1.0, 5.0, 9.0], 1) == 4.0  # 1 -> 9 spans two windows
    assert rise_room([20.0, 18.0, 15.0, 12.0, 9.0], 3) == 0.0  # a fall is no rise
    assert rise_room([5.0, 9.0], 3) == float("inf")  # too short a past to know


def test_the_peak_hold_follows_a_falling_level_one_horizons_rise_above_it_and_holds_a_bursts_peak():
    held = Seasonal(horizon=5, peak_window=30, hold_rise_room=True)
    descent = [2.0 + 0.5 * i for i in range(30)] + [16.5 - 0.5 * i for i in range(25)]  # a day's rise and fall
    now = descent[-1]
    assert Seasonal(horizon=5, peak_window=30)(descent, now) == 16.5  # the whole peak
    assert held(descent, now) == pytest.approx(now + 2.5)  # the rise of 5 windows, over the rate now
    h = bursts(120)  # 5-min bursts of 12 req/s over 2, every 30 min
    trough = h[-10:]
    assert max(trough) < 4.0
    assert held(h, 2.0) == pytest.approx(Seasonal(horizon=5, peak_window=30)(h, 2.0), rel=0.1)
    assert held(h, 2.0) > 11.0


def test_the_step_looks_as_far_ahead_as_capacity_takes_to_start():
    cat = load_catalog().subset(["mistral-7b"])
    tr = load_spec("gen:poisson:rate=1,hours=0.05", seed=0)
    sim = Simulation(cat, tr, RayscalePolicy(), SimConfig())
    for name in ("trend", "seasonal", "peak"):
        fc = forecaster_for(cat, Settings(forecaster=name, forecast_horizon_s=None))
        assert fc.horizon == round(sim.typical_startup_s() / 60)  # type: ignore[attr-defined]
    assert forecaster_for(cat, Settings()).horizon == 15  # type: ignore[attr-defined]  # shipped: 900 s
    assert forecaster_for(cat, Settings(forecaster="peak", forecast_horizon_s=120.0)).horizon == 2  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"Settings\.forecaster must be one of"):
        Settings(forecaster="nope")


def test_the_peak_forecaster_holds_the_highest_rate_of_peak_hold_s():
    cat = load_catalog().subset(["mistral-7b"])
    history = [2.0] * 5 + [9.0] + [2.0] * 40  # a burst 41 windows (minutes) ago, then quiet
    held = forecaster_for(cat, Settings(forecaster="peak", peak_hold_s=3600.0))
    short = forecaster_for(cat, Settings(forecaster="peak", peak_hold_s=1800.0))
    assert held(history, 2.0) == 9.0  # within the hour
    assert short(history, 2.0) < 3.0  # past 30 min: the trend on a flat history, about the rate
    assert short([2.0] * 20 + [9.0] + [2.0] * 9, 2.0) == 9.0
    assert held([9.0] + [2.0] * 40, 2.0) < 2.01  # a fall from 9 with no climb seen: a level, not a burst
    assert forecaster_for(cat, Settings(forecaster="seasonal", peak_hold_s=60.0))(history, 2.0) < 3.0  # no hold
    with pytest.raises(ValueError, match=r"Settings\.peak_hold_s must be > 0"):
        Settings(peak_hold_s=0)




def test_a_flat_trend_start_does_not_extrapolate_the_noise_of_the_first_windows():
    """Three windows of a steady 6 req/s and a 10-window horizon: the first difference's noise, extrapolated,
    often orders twice the fleet; a trend that starts flat stays near the rate and still follows a ramp."""
    rng = np.random.default_rng(0)
    draws = [list(rng.poisson(360, 3) / 60) for _ in range(400)]
    diff, flat = TrendSeasonal(horizon=10), TrendSeasonal(horizon=10, flat_start=True)
    assert np.percentile([diff(h, 6.0) for h in draws], 95) > 1.8 * 6
    assert np.percentile([flat(h, 6.0) for h in draws], 95) < 1.3 * 6
    ramp = [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0]
    assert flat(ramp, 16.0) > 30.0  # a ramp of 2 a window is still extrapolated
    cat = load_catalog().subset(["mistral-7b"])
    assert forecaster_for(cat, Settings(trend_start="flat")).flat_start  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"Settings\.trend_start must be one of"):
        Settings(trend_start="level")


def test_the_line_ahead_is_the_least_squares_line_extended_and_needs_three_points() -> None:
    assert line_ahead([1.0, 2.0], 5.0) == 0.0
    assert line_ahead([1.0, 2.0, 3.0, 4.0], 2.0) == pytest.approx(6.0)
    assert line_ahead([3.0, 3.0, 3.0], 10.0) == pytest.approx(3.0)
    # Noise around a flat rate moves it by the fitted slope only.
    assert line_ahead([3.0, 2.0, 4.0, 3.0], 0.0) == pytest.approx(3.3)
