"""What the controller remembers between periods: the last request mix, and the scrapes the next reads."""

from __future__ import annotations

from typing import Any

from rayscale.config import load_catalog
from rayscale.controller.loop import Controller, ControllerConfig
from rayscale.core.burst import BURST_BUDGET_SHARE, burst_rate
from rayscale.core.estimate import EstimateSettings, estimate
from rayscale.core.settings import Settings
from rayscale.core.signals import Freshness, ModelSignals, RequestMix
from rayscale.core.step import StepContext, StepState, step
from rayscale.signals.window import RUNNING, TTFT, Scrape, labels

SHORT = RequestMix(prompt_mean=100, output_mean=32, prompt_p95=200)


def _step(cat: Any, sig: ModelSignals, state: StepState, now: float) -> Any:
    return step(StepContext(now, cat, {sig.model: sig}, (), None, Settings(), state))


def test_a_window_without_finished_requests_keeps_the_last_mix_not_the_default() -> None:
    cat = load_catalog().subset(["mistral-7b"], ["a10g"])
    seen = _step(cat, ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0, SHORT), StepState(), 0.0)
    blind = _step(cat, ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0, None), seen.state, 60.0)
    assert seen.signals["mistral-7b"].mix == SHORT and blind.signals["mistral-7b"].mix == SHORT
    assert blind.signals["mistral-7b"].rate_history == (2.0,)  # one sample per history window
    assert blind.state.rate_history["mistral-7b"] == (2.0, 2.0)
    blind = blind.signals["mistral-7b"]
    # The default mix (long outputs) would make one replica look several times smaller.
    d_last = estimate(cat, {"mistral-7b": blind})["mistral-7b"]
    d_default = estimate(cat, {"mistral-7b": ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0, None)})["mistral-7b"]
    assert d_last.capacity["a10g"].rps > 2 * d_default.capacity["a10g"].rps
    # A model never seen finishing a request still gets the default (and says nothing was remembered).
    other = _step(cat, ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0), StepState(), 0.0)
    assert other.signals["mistral-7b"].mix is None


def test_scrapes_are_kept_whole_for_the_window_and_trimmed_for_the_mix() -> None:
    """The mix may reach back mix_max_s; only its series are kept that long (memory stays a fraction)."""
    cat = load_catalog().subset(["mistral-7b"], ["a10g"])
    none: Any = None
    cfg = ControllerConfig(Settings(window_s=30.0, mix_min_requests=1000, mix_max_s=300.0))
    ctl = Controller(cat, none, none, none, cfg)
    lb = labels(model="mistral-7b", flavor="a10g", ReplicaId="r1")
    kept: list[Scrape] = []
    for t in range(0, 1001, 5):
        kept = ctl._remember(Scrape(float(t), {(TTFT + "_count", lb): 2.0 * t, (RUNNING, lb): 1.0}), float(t))
    assert [s.t for s in kept] == [float(t) for t in range(700, 1001, 5)]
    whole = [s for s in kept if (RUNNING, lb) in s.series]
    assert whole[0].t == 1000 - 4 * 30 and all((TTFT + "_count", lb) in s.series for s in kept)
    # Without a count to reach, nothing older than the window's margin is kept.
    plain = Controller(cat, none, none, none, ControllerConfig(Settings(window_s=30.0, mix_min_requests=0)))
    for t in range(0, 1001, 5):
        kept = plain._remember(Scrape(float(t), {(RUNNING, lb): 1.0}), float(t))
    assert kept[0].t == 1000 - 4 * 30


def test_mix_settings_are_checked_and_the_clis_name_their_flag(capsys: Any) -> None:
    import pytest

    from rayscale.cli import main

    for bad in ({"mix_min_requests": -1}, {"mix_max_s": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Settings(**bad)  # type: ignore[arg-type]
    for cmd in (["controller"], ["simulate", "--trace", "gen:poisson:rate=1,hours=0.01"]):
        assert main([*cmd, "--mix-min-requests", "-5"]) == 2
        err = capsys.readouterr().err
        assert "--mix-min-requests: (top level): Settings.mix_min_requests must be >= 0, got -5" in err


def test_arrivals_are_counted_per_period_for_the_burst_floor() -> None:
    cat = load_catalog().subset(["mistral-7b"], ["a10g"])
    none: Any = None
    ctl = Controller(cat, none, none, none, ControllerConfig(Settings(period_s=5.0, burst_history_s=60.0)))
    lb = labels(model="mistral-7b", flavor="a10g", ReplicaId="r1")
    started = 0.0
    for t in range(0, 101, 5):
        started += 50.0 if t == 50 else 5.0  # one period with a burst of 50 requests
        ok = t != 80  # one failed scrape: its interval is read at its rate, not as a period of no load
        ctl._remember(Scrape(float(t), {(TTFT + "_count", lb): started} if ok else {}, ok=ok), float(t))
    counts = ctl._with_arrivals(ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0, SHORT)).arrival_counts
    assert len(counts) == 12  # 60 s of 5-s periods (the failed scrape's 10-s interval is one bin)
    assert max(counts) == 50.0 and counts.count(5.0) == 11
    # With the burst floor on, the estimator reads them (the planner then holds replicas that drain it).
    sig = ctl._with_arrivals(ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0, SHORT))
    assert estimate(cat, {"mistral-7b": sig})["mistral-7b"].burst_rps == 0.0
    on = estimate(cat, {"mistral-7b": sig}, settings=EstimateSettings(burst_floor=True))["mistral-7b"]
    assert on.burst_rps == burst_rate(sig.arrival_counts, 5.0, cat.models["mistral-7b"].slo.ttft_p95_s,
                                      1 - BURST_BUDGET_SHARE * 0.01) > 2.0
