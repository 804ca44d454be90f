"""Every knob of the control loop in one record: what ships is what the controller and the simulator run.

``rayscale controller --settings F`` and ``rayscale simulate --settings F`` read the same file
(``rayscale.config.load_settings``); ``rayscale/data/settings.yaml`` holds the shipped values. The
defaults below are the shipped product, chosen on the simulator's dev traces (bench/results/tune.md):
the seasonal forecaster with a 30-min peak hold, a 600 s scale-down delay (about one replica start-up),
the greedy solver (the exact MILP costs 20-120 ms a call and does not scale to a thousand models), the
burst floor, and, where bursts last a minute or more, a narrower hysteresis band (0.15) and a target
utilisation of 0.85 once the SLO record earned it (bench/results/tune_smooth_utilization.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayscale.core.act import ActSettings
from rayscale.core.estimate import EstimateSettings
from rayscale.core.feedback import FeedbackSettings
from rayscale.core.forecast import FORECASTERS
from rayscale.core.plan import PlannerSettings
from rayscale.core.spot import SpotSettings

MIX_MIN_REQUESTS = 1000
MIX_MAX_S = 900.0
TREND_STARTS = ("difference", "flat")


def shipped_planner() -> PlannerSettings:
    return PlannerSettings(downscale_delay_s=600.0, solver="greedy", smooth_hysteresis_band=0.15)


def shipped_estimate() -> EstimateSettings:
    return EstimateSettings(burst_floor=True, smooth_target_utilization=0.85)


@dataclass(frozen=True)
class Settings:
    period_s: float = 5.0  # one step per period
    window_s: float = 30.0  # arrival rate, mix and latency percentiles are read over this window
    # A rise in arrivals counts over this shorter tail of the window too (fast up, slow down); None: off.
    # Off: at 3 req/s a 10-s count varies by 18% (one Poisson sd), and reading its highs as rises orders
    # replicas for noise (bench/results/tune_fast_window.md). The local demo's settings turn it on.
    fast_window_s: float | None = None
    stale_after_s: float = 20.0  # signals older than this are stale, never zero
    # The request mix spans at least this many finished requests, reaching back up to mix_max_s when the
    # window holds fewer: its tail quantiles size replicas (0: the window only).
    mix_min_requests: int = MIX_MIN_REQUESTS
    mix_max_s: float = MIX_MAX_S
    forecaster: str = "peak"
    # The peak forecaster never forecasts below the highest rate of this long a past (its peak hold): load
    # that comes and goes faster than capacity starts is held for, not chased (rayscale.core.forecast).
    peak_hold_s: float = 1800.0
    # The peak hold and the burst floor hold at most the rate arriving plus the largest rise the rate history
    # shows within one forecast horizon (rayscale.core.forecast.rise_room): a level that falls cannot be back
    # before capacity ordered now starts; a burst climbs from its base within the horizon and stays held.
    hold_rise_room: bool = True
    # The forecaster sees one arrival rate per history window, up to history_len of them: two hours, so a
    # pattern repeating every 30 min is seen twice before it is trusted (rayscale.core.forecast).
    history_window_s: float = 60.0
    history_len: int = 120
    # How far ahead the forecaster looks. None: the median start-up (node + model load) of the catalog's
    # offerings, as long as ordered capacity takes to serve; 660 s on the shipped catalog, which ordered a
    # first rise one or two nodes at a time and missed 99% on the dev Azure code trace. 15 min met it
    # there at 4.9% more over dev (bench/results/tune_horizon.md).
    forecast_horizon_s: float | None = 900.0
    # Where the trend of the trend forecasters starts: "difference" of the first two windows (Holt's
    # textbook start), or "flat", earned window by window (rayscale.core.forecast.TrendSeasonal).
    trend_start: str = "difference"
    # The trend forecasters fit their level and trend on each history window's rate as the lowest of it and
    # the spike_windows - 1 before it (rayscale.core.forecast.without_spikes; 1: as read): a burst shorter
    # than that is the burst floor's and the peak hold's, not a trend to extrapolate a horizon ahead. Ships 1:
    # at 3, dev cost 4.5% less, but Azure code x3 met 98.48% (its clustered spikes' trend holds capacity for
    # the next) and the fast ramp from cold 97.51% (bench/results/tune_spikes.md).
    spike_windows: int = 1
    # Arrivals per period are kept this long for the burst floor (rayscale.core.burst).
    burst_history_s: float = 3600.0
    # A scale-down keeps capacity for the rate that the least-squares line through the last this-long of
    # rate history reaches one forecast horizon ahead (Demand.rise_rps; 0: off). Holt's trend (alpha 0.5,
    # beta 0.2) follows a ramp's start late: at the foot of a rise it forecasts about the rate now, and a
    # scale-down there is bought back a start-up later, into a queue (bench/results/tune_rise_down.md: 10 min
    # met 98.48% from cold on the dev fast ramp, 0 met 97.71%, at 0.1% more in steady state).
    rise_window_s: float = 600.0
    estimate: EstimateSettings = field(default_factory=shipped_estimate)
    planner: PlannerSettings = field(default_factory=shipped_planner)
    act: ActSettings = field(default_factory=ActSettings)
    # The attainment delivered scales each model's demand (rayscale.core.feedback).
    feedback: FeedbackSettings = field(default_factory=FeedbackSettings)
    # Spot replicas count for the share of time interruptions leave them serving (rayscale.core.spot).
    spot: SpotSettings = field(default_factory=SpotSettings)

    def __post_init__(self) -> None:
        for name in ("period_s", "window_s", "stale_after_s", "history_window_s", "burst_history_s", "peak_hold_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Settings.{name} must be > 0, got {getattr(self, name)}")
        if not self.rise_window_s >= 0:
            raise ValueError(f"Settings.rise_window_s must be >= 0, got {self.rise_window_s}")
        if self.fast_window_s is not None and not 0 < self.fast_window_s <= self.window_s:
            raise ValueError(f"Settings.fast_window_s must be in (0, window_s={self.window_s}], "
                             f"got {self.fast_window_s}")
        if self.forecaster not in FORECASTERS:
            raise ValueError(f"Settings.forecaster must be one of {sorted(FORECASTERS)}, got {self.forecaster!r}")
        if self.trend_start not in TREND_STARTS:
            raise ValueError(f"Settings.trend_start must be one of {list(TREND_STARTS)}, got {self.trend_start!r}")
        if self.spike_windows < 1:
            raise ValueError(f"Settings.spike_windows must be >= 1, got {self.spike_windows}")
        if self.history_len < 1:
            raise ValueError(f"Settings.history_len must be >= 1, got {self.history_len}")
        if self.forecast_horizon_s is not None and not self.forecast_horizon_s >= 0:
            raise ValueError(f"Settings.forecast_horizon_s must be >= 0, got {self.forecast_horizon_s}")
        if self.mix_min_requests < 0:
            raise ValueError(f"Settings.mix_min_requests must be >= 0, got {self.mix_min_requests}")
        if self.mix_min_requests and self.mix_max_s < self.window_s:
            raise ValueError(f"Settings.mix_max_s ({self.mix_max_s}) must be >= window_s ({self.window_s}) "
                             f"when mix_min_requests > 0")
