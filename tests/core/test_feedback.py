"""SLO feedback: the attainment delivered moves a bounded factor on demand, slowly down and faster up."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rayscale.config import load_catalog
from rayscale.core.act import Gang, GangPhase
from rayscale.core.estimate import Demand, DemandState
from rayscale.core.feedback import Delivered, FeedbackSettings, _slack, delivered, next_factor
from rayscale.core.settings import Settings
from rayscale.core.signals import Freshness, ModelSignals, RequestMix
from rayscale.core.step import ServeView, StepContext, StepState, _with_feedback, _with_rise, step

FB = FeedbackSettings()
GOAL = 0.99
MIX = RequestMix(prompt_mean=500, output_mean=100, prompt_p95=1500)


def _sig(finished: float | None, met: float | None, rate: float = 3.0) -> ModelSignals:
    return ModelSignals("mistral-7b", Freshness.FRESH, 0.0, rate, MIX, waiting=0.0, finished=finished,
                        slo_met=met)


def _record(att: float, factor: float = 1.0, requests: float = 1e5, age_s: float = 7200.0) -> Delivered:
    return Delivered(10.0, 10.0 * att, requests, 0.0, factor, since_s=-age_s)


def test_the_factor_falls_slowly_when_every_request_meets_the_slo_and_stops_at_its_floor() -> None:
    quarter = next_factor(_record(1.0), 900.0, GOAL, FB)
    assert quarter == pytest.approx(1.0 - FB.relax_per_h / 4)
    assert next_factor(_record(1.0, factor=0.81), 3600.0, GOAL, FB) == FB.min_factor
    # In the dead band (between the goal and relax_above of the allowed misses) it stays where it is.
    assert next_factor(_record(0.992, factor=0.9), 3600.0, GOAL, FB) == 0.9


def test_the_factor_rises_with_the_shortfall_and_stops_at_its_ceiling() -> None:
    half = next_factor(_record(0.985), 180.0, GOAL, FB)  # half the allowed misses again: slack -0.5
    full = next_factor(_record(0.97), 180.0, GOAL, FB)  # slack -2, counted as -1
    assert half == pytest.approx(1.0 + 0.5 * FB.tighten_per_h / 20)
    assert full == pytest.approx(1.0 + FB.tighten_per_h / 20) and full > half
    assert next_factor(_record(0.5, factor=1.2), 3600.0, GOAL, FB) == FB.max_factor


def test_a_young_record_or_feedback_off_leaves_demand_alone() -> None:
    assert next_factor(_record(1.0, requests=10.0), 3600.0, GOAL, FB) == 1.0
    # Younger than relax_after_s it may tighten but not relax: it has not yet measured the budget it spends.
    young = FB.relax_after_s - 60.0
    assert next_factor(_record(1.0, factor=0.95, age_s=young), 600.0, GOAL, FB) == 0.95
    assert next_factor(_record(0.97, age_s=young), 600.0, GOAL, FB) > 1.0
    assert next_factor(_record(1.0, age_s=young), 600.0, GOAL, replace(FB, relax_after_s=0.0)) < 1.0
    assert next_factor(_record(1.0, factor=0.9), 3600.0, GOAL, replace(FB, enabled=False)) == 1.0


def test_the_record_weighs_windows_by_their_requests_and_ignores_windows_without_latency() -> None:
    rec = delivered(None, _sig(300.0, 1.0), 30.0, 0.0, GOAL, FB)
    assert rec is not None and rec.attainment == 1.0 and rec.requests == 300.0
    # A quiet perfect window then a busy one in which 4% missed: the busy one dominates.
    busy = delivered(rec, _sig(3000.0, 0.96), 30.0, FB.time_constant_s, GOAL, FB)
    assert busy is not None and busy.attainment is not None
    assert busy.attainment < 0.96 + 0.04 * 0.25
    assert delivered(busy, _sig(None, None), 30.0, 2 * FB.time_constant_s, GOAL, FB) is busy
    # After a night with nothing finished, the first window moves the factor by one window's worth only.
    perfect = replace(_record(1.0), at_s=0.0)
    morning = delivered(perfect, _sig(300.0, 1.0), 30.0, 8 * 3600.0, GOAL, FB)
    assert morning is not None and morning.factor == pytest.approx(1.0 - FB.relax_per_h * 30.0 / 3600.0)
    assert delivered(busy, _sig(0.0, None), 30.0, 2 * FB.time_constant_s, GOAL, FB) is busy


def _ctx(now: float, gangs: tuple[Gang, ...], state: StepState, sig: ModelSignals,
         cfg: Settings | None = None) -> StepContext:
    cat = load_catalog().subset(["mistral-7b"], ["l40s"])
    return StepContext(now, cat, {"mistral-7b": sig}, gangs, ServeView({}, {}), cfg or Settings(), state)


def test_the_step_scales_demand_by_the_factor_and_says_why() -> None:
    sig = _sig(300.0, 1.0, rate=20.0)
    cfg = Settings(feedback=replace(FB, floor_window_s=0.0))
    plain = step(_ctx(0.0, (), StepState(), sig, cfg)).demands["mistral-7b"]
    relaxed = step(_ctx(0.0, (), StepState(delivered={"mistral-7b": _record(1.0, factor=0.8)}), sig, cfg))
    d = relaxed.demands["mistral-7b"]
    assert d.rps == pytest.approx(0.8 * plain.rps)
    assert "x0.80" in d.reason and "100.00% of requests meeting the SLO" in d.reason
    assert sum(e.replicas for e in relaxed.plan.entries) < sum(e.replicas for e in step(
        _ctx(0.0, (), StepState(), sig, cfg)).plan.entries)


@pytest.mark.parametrize(("factor", "arriving", "floor", "want"), [
    (0.8, 9.0, True, 9.0), (0.8, 5.0, True, 8.0), (0.8, 12.0, True, 10.0), (0.8, 9.0, False, 8.0),
    (1.1, 9.0, True, 11.0)])
def test_a_relaxed_factor_never_counts_demand_below_the_arrivals(
    factor: float, arriving: float, floor: bool, want: float
) -> None:
    """A relaxed factor trims what the demand adds to the load arriving now (the forecast's growth, a
    backlog), not the utilisation headroom that load needs (FeedbackSettings.floor_window_s); nor does it
    raise a demand sized below the arrivals."""
    d = Demand("mistral-7b", DemandState.OK, 10.0, MIX)
    cfg = Settings(feedback=replace(FB, floor_window_s=300.0 if floor else 0.0))
    # The demand is the peak held from 10 min ago (not a rise); the last five minutes arrived at ``arriving``.
    sig = replace(_sig(300.0, 1.0, rate=arriving), rate_history=(10.0, *[arriving] * 5))
    got = _with_feedback({"mistral-7b": d}, {"mistral-7b": _record(1.0, factor)}, cfg, 0.0,
                         {"mistral-7b": sig})["mistral-7b"]
    assert got.rps == pytest.approx(want)
    assert ("req/s arriving" in got.reason) == (floor and factor < 1.0 and arriving > 8.0)


@pytest.mark.parametrize(("share", "arriving", "want"), [(0.9, 11.0, 9.9), (0.9, 8.0, 7.2), (0.5, 11.0, 5.5)])
def test_the_floor_is_its_share_of_the_arrivals(share: float, arriving: float, want: float) -> None:
    """``floor_share`` below 1 lets a relaxed factor trim part of the utilisation headroom too, never more."""
    d = Demand("mistral-7b", DemandState.OK, 12.0, MIX)
    cfg = Settings(feedback=replace(FB, floor_window_s=300.0, floor_share=share))
    sig = replace(_sig(300.0, 1.0, rate=arriving), rate_history=(12.0, *[arriving] * 5))
    got = _with_feedback({"mistral-7b": d}, {"mistral-7b": _record(1.0, 0.8)}, cfg, 0.0,
                         {"mistral-7b": sig})["mistral-7b"]
    assert got.rps == pytest.approx(max(want, 0.8 * 12.0))
    assert (f"{share:.0%} of the" in got.reason) == (share * arriving > 0.8 * 12.0)


def test_a_floor_share_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="floor_share"):
        FeedbackSettings(floor_share=0.0)
    with pytest.raises(ValueError, match="floor_share"):
        FeedbackSettings(floor_share=1.2)


@pytest.mark.parametrize(("history", "rise_above", "want"), [
    ((6.0, 7.0, 8.0), 0.2, 10.0), ((6.0, 7.0, 8.0), None, 8.0), ((6.0, 9.0, 8.0), 0.2, 8.0),
    ((6.0, 9.0, 8.0), 0.1, 10.0), ((12.0, 9.0, 8.0), 0.2, 8.0)])
def test_a_relaxed_factor_is_not_applied_while_demand_rises_above_the_level_held(
    history: tuple[float, ...], rise_above: float | None, want: float
) -> None:
    """The misses a relaxed factor spends were saved at the levels the fleet served; on a rise (a forecast,
    or a backlog, more than rise_above over every rate of the peak hold) the forecast's lead is what covers
    a replica's start-up, and the factor would cancel it. A fall under a held peak is relaxed as before."""
    d = Demand("mistral-7b", DemandState.OK, 10.0, MIX)
    cfg = Settings(feedback=replace(FB, floor_window_s=0.0, rise_above=rise_above, rise_needs_arrivals=False,
                                    rise_trims_held=False))
    sig = replace(_sig(300.0, 1.0, rate=history[-1]), rate_history=history)
    got = _with_feedback({"mistral-7b": d}, {"mistral-7b": _record(1.0, 0.8)}, cfg, 0.0,
                         {"mistral-7b": sig})["mistral-7b"]
    assert got.rps == pytest.approx(want)
    assert ("not applied: rising above" in got.reason) == (want == 10.0)
    assert got.slo_slack == (want != 10.0)  # slack is claimed on a level only
    tightened = _with_feedback({"mistral-7b": d}, {"mistral-7b": _record(0.95, 1.1)}, cfg, 0.0, {"mistral-7b": sig})
    assert tightened["mistral-7b"].rps == pytest.approx(11.0)  # a tightened factor applies on a rise too
    assert not tightened["mistral-7b"].slo_slack


@pytest.mark.parametrize(("history", "now", "want"), [
    ((6.0, 7.0, 8.0), 8.0, 8.4), ((6.0, 7.0, 8.0), 8.2, 8.36), ((6.0, 9.0, 8.0), 8.0, 8.0)])
def test_on_a_rise_a_relaxed_factor_trims_the_level_held_only(
    history: tuple[float, ...], now: float, want: float
) -> None:
    """The misses a relaxed factor spends were saved at the level the fleet served: on a rise it trims that
    level (10 - 8 x 0.2 = 8.4; with 8.2 req/s arriving now, 10 - 8.2 x 0.2) and the forecast's lead over it
    stays whole; no rise (10 is within 20% of the 9 held): the whole demand (10 x 0.8)."""
    d = Demand("mistral-7b", DemandState.OK, 10.0, MIX, burst_rps=6.0)
    cfg = Settings(feedback=replace(FB, floor_window_s=0.0, rise_trims_held=True))
    sig = replace(_sig(300.0, 1.0, rate=now), rate_history=history)
    got = _with_feedback({"mistral-7b": d}, {"mistral-7b": _record(1.0, 0.8)}, cfg, 0.0,
                         {"mistral-7b": sig})["mistral-7b"]
    assert got.rps == pytest.approx(want)
    rising = want != 8.0
    assert ("rising above it" in got.reason) == rising
    assert got.slo_slack == (not rising)
    assert got.burst_rps == pytest.approx(6.0 if rising else 6.0 * FB.burst_floor_min_factor)


@pytest.mark.parametrize(("history", "keeps", "want"), [
    ((6.0, 7.0, 8.0), True, 10.0), ((6.0, 7.0, 8.0), False, 0.0), ((6.0, 9.0, 8.0), True, 0.0)])
def test_on_a_rise_a_scale_down_keeps_capacity_for_the_demand_untrimmed(
    history: tuple[float, ...], keeps: bool, want: float
) -> None:
    """The trim spends slack earned at the level held; a scale-down on the trimmed figure would spend it
    again on a fleet the record never tried, while the load climbs: on a rise the untrimmed 10 req/s is
    what a scale-down keeps (Demand.rise_rps), the trimmed 8.4 what is ordered; on a level nothing is kept."""
    d = Demand("mistral-7b", DemandState.OK, 10.0, MIX)
    cfg = Settings(feedback=replace(FB, floor_window_s=0.0, rise_trims_held=True, rise_keeps_untrimmed=keeps))
    sig = replace(_sig(300.0, 1.0, rate=8.0), rate_history=history)
    got = _with_feedback({"mistral-7b": d}, {"mistral-7b": _record(1.0, 0.8)}, cfg, 0.0,
                         {"mistral-7b": sig})["mistral-7b"]
    assert got.rps == pytest.approx(8.4 if history[1] < 8.0 else 8.0)
    assert got.rise_rps == pytest.approx(want)
    # A recent line below what is kept does not lower it; one above raises it.
    flat = {"mistral-7b": replace(sig, rate_history=(8.0,) * 6)}
    cfg = replace(cfg, rise_window_s=360.0)
    assert _with_rise({"mistral-7b": got}, flat, cfg, 600.0)["mistral-7b"].rise_rps == pytest.approx(want)
    steep = {"mistral-7b": replace(sig, rate_history=(3.0, 4.0, 5.0, 6.0, 7.0, 8.0))}
    assert _with_rise({"mistral-7b": got}, steep, cfg, 600.0)["mistral-7b"].rise_rps == pytest.approx(18.0)


def test_the_step_keeps_a_rising_forecasts_lead_whole() -> None:
    """Under the shipped settings: on the trend of a rising history the relaxed factor takes 20% of the
    19 req/s held off the demand and no more; the forecast's lead over that level is what it sizes for."""
    assert Settings().feedback.rise_trims_held
    sig = _sig(300.0, 1.0, rate=19.0)
    history = {"mistral-7b": tuple(8.0 + i for i in range(12))}
    plain = step(_ctx(0.0, (), StepState(rate_history=history), sig))
    relaxed = step(_ctx(0.0, (), StepState(rate_history=history, delivered={"mistral-7b": _record(1.0, 0.8)}), sig))
    assert plain.demands["mistral-7b"].rps > 1.2 * 19.0
    assert relaxed.demands["mistral-7b"].rps == pytest.approx(plain.demands["mistral-7b"].rps - 0.2 * 19.0)
    assert sum(e.replicas for e in relaxed.plan.entries) <= sum(e.replicas for e in plain.plan.entries)


def test_the_floor_is_the_mean_of_the_rate_history_over_its_window() -> None:
    d = Demand("mistral-7b", DemandState.OK, 10.0, MIX)
    cfg = Settings(feedback=replace(FB, floor_window_s=180.0))  # three one-minute samples
    sig = replace(_sig(300.0, 1.0, rate=20.0), rate_history=(30.0, 6.0, 9.0, 12.0))
    got = _with_feedback({"mistral-7b": d}, {"mistral-7b": _record(1.0, 0.8)}, cfg, 0.0, {"mistral-7b": sig})
    assert got["mistral-7b"].rps == pytest.approx(9.0)  # (6 + 9 + 12) / 3: neither the older 30 nor the 20 now


def test_the_floor_is_no_higher_than_the_rate_arriving_now() -> None:
    """The last sample of a burst as long as the floor's window is the burst itself: once the arrivals have
    fallen back, a fleet ordered for it would land after the burst has gone."""
    d = Demand("mistral-7b", DemandState.OK, 10.0, MIX)
    cfg = Settings(feedback=replace(FB, floor_window_s=300.0))
    sig = replace(_sig(300.0, 1.0, rate=2.0), rate_history=(2.0, 12.0, 12.0, 12.0, 12.0, 12.0))
    got = _with_feedback({"mistral-7b": d}, {"mistral-7b": _record(1.0, 0.8)}, cfg, 0.0, {"mistral-7b": sig})
    assert got["mistral-7b"].rps == pytest.approx(8.0)  # the relaxed demand: the 12 req/s are not arriving
    assert "arriving" not in got["mistral-7b"].reason
    still = replace(sig, arrival_rate_rps=12.5)  # the burst goes on: the floor holds its mean
    got = _with_feedback({"mistral-7b": d}, {"mistral-7b": _record(1.0, 0.8)}, cfg, 0.0, {"mistral-7b": still})
    assert got["mistral-7b"].rps == pytest.approx(10.0)  # min(the 10 sized, the 12 sustained)


def test_the_step_keeps_a_relaxed_fleet_above_the_arrivals() -> None:
    """Under the shipped settings a relaxed record leaves the plan where the arrivals alone put it."""
    sig = _sig(300.0, 1.0, rate=20.0)
    plain = step(_ctx(0.0, (), StepState(), sig))
    relaxed = step(_ctx(0.0, (), StepState(delivered={"mistral-7b": _record(1.0, factor=0.8)}), sig))
    assert relaxed.demands["mistral-7b"].rps == pytest.approx(min(plain.demands["mistral-7b"].rps, 20.0))
    assert sum(e.replicas for e in relaxed.plan.entries) == sum(e.replicas for e in plain.plan.entries)


@pytest.mark.parametrize(("factor", "relax_floor", "age_s", "burst"), [
    (0.8, False, 7200.0, 50.0), (0.8, True, 1800.0, 50.0), (0.8, True, 3600.0, 40.0), (1.1, False, 0.0, 55.0),
    (0.75, True, 3600.0, 40.0)])  # demand trimmed to 0.75, the floor to burst_floor_min_factor (0.8)
def test_a_relaxed_factor_trims_the_burst_floor_only_once_its_record_spans_the_floors_hour(
    factor: float, relax_floor: bool, age_s: float, burst: float
) -> None:
    """The floor replays the last hour's arrivals against its own miss budget: a record of a calm half hour
    that relaxed the demand says nothing of the bursts it was sized for (FeedbackSettings.relax_burst_floor);
    a tightened factor raises the floor whatever the record's age. It trims the floor no lower than
    ``burst_floor_min_factor`` (0.8), the demand down to ``min_factor`` (0.75)."""
    d = Demand("mistral-7b", DemandState.OK, 10.0, MIX, burst_rps=50.0)
    cfg = Settings(feedback=replace(FB, relax_burst_floor=relax_floor))
    assert cfg.burst_history_s == 3600.0
    got = _with_feedback({"mistral-7b": d}, {"mistral-7b": _record(0.999, factor, age_s=0.0)}, cfg, age_s,
                         {})["mistral-7b"]
    assert got.rps == pytest.approx(10.0 * factor)
    assert got.burst_rps == pytest.approx(burst)


@pytest.mark.parametrize(("trim_below_goal", "burst"), [(True, 40.0), (False, 50.0)])
def test_a_record_below_the_goal_may_leave_the_burst_floor_whole(trim_below_goal: bool, burst: float) -> None:
    """A relaxed factor that a record of misses has not yet brought back to 1 trims the demand still, and the
    burst floor only with ``floor_trim_below_goal``: the misses that took the record under the goal were the
    bursts the trimmed floor let through."""
    d = Demand("mistral-7b", DemandState.OK, 10.0, MIX, burst_rps=50.0)
    cfg = Settings(feedback=replace(FB, floor_trim_below_goal=trim_below_goal))
    below = _with_feedback({"mistral-7b": d}, {"mistral-7b": _record(0.96, 0.8)}, cfg, 0.0, {})["mistral-7b"]
    assert below.rps == pytest.approx(8.0)
    assert below.burst_rps == pytest.approx(burst)
    assert ("burst floor whole" in below.reason) is (not trim_below_goal)  # the decision log says why
    at_goal = _with_feedback({"mistral-7b": d}, {"mistral-7b": _record(0.995, 0.8)}, cfg, 0.0, {})["mistral-7b"]
    assert at_goal.burst_rps == pytest.approx(40.0)


def test_the_record_keeps_when_it_started() -> None:
    first = delivered(None, _sig(300.0, 1.0), 30.0, 100.0, GOAL, FB)
    assert first is not None and first.age_s(100.0) == 0.0
    later = delivered(first, _sig(300.0, 1.0), 30.0, 400.0, GOAL, FB)
    assert later is not None and later.age_s(400.0) == 300.0


def test_the_record_starts_once_the_fleet_stands_as_planned() -> None:
    sig = _sig(300.0, 0.5)  # the misses of a cold start: nothing yet serves
    cold = step(_ctx(0.0, (), StepState(), sig))
    assert "mistral-7b" not in cold.state.delivered
    want = sum(e.replicas for e in cold.plan.entries)
    up = tuple(Gang(f"g{i}", "mistral-7b", "l40s", "on-demand", "z", "g6e.xlarge", 1, GangPhase.READY, 0.0,
                    serving=1) for i in range(want))
    pending = (*up[:-1], replace(up[-1], phase=GangPhase.PENDING, serving=0))
    assert "mistral-7b" not in step(_ctx(5.0, pending, cold.state, sig)).state.delivered
    standing = step(_ctx(5.0, up, cold.state, _sig(300.0, 1.0)))
    assert standing.state.delivered["mistral-7b"].attainment == 1.0


def test_misses_of_a_model_served_best_effort_do_not_move_its_record() -> None:
    from rayscale.core.chunk import pin_chunks

    full = pin_chunks(load_catalog()).subset(["mistral-7b"])
    cat = full.subset(["mistral-7b"], [f for f in full.models["mistral-7b"].parallelism if f != "h100"])
    long = RequestMix(12000, 340, 39000)  # no flavor left meets a 2 s TTFT for a 39k-token prompt
    sig = ModelSignals("mistral-7b", Freshness.FRESH, 0.0, 1.0, long, waiting=0.0, finished=300.0, slo_met=0.6)
    rec = _record(0.6)
    first = step(StepContext(0.0, cat, {"mistral-7b": sig}, (), ServeView({}, {}), Settings(),
                             StepState(delivered={"mistral-7b": rec})))
    assert first.demands["mistral-7b"].best_effort
    assert first.state.delivered["mistral-7b"] is rec


def test_a_capped_window_counts_at_most_its_share_of_misses_and_the_record_recovers_sooner() -> None:
    """A cold start's queue (a third of a window's requests met) held the record under the goal for two
    hours of perfect windows; counted as five times the allowed misses it is back above the goal within the
    hour. A sustained shortfall still tightens at the full rate (slack -1 is the rate's limit)."""
    uncapped, capped = replace(FB, window_miss_cap=None), replace(FB, window_miss_cap=5.0)
    for fb, hours in ((uncapped, 2.0), (capped, 1.0)):
        rec = delivered(None, _sig(300.0, 0.35), 30.0, 0.0, GOAL, fb)
        assert rec is not None and rec.attainment is not None
        assert rec.attainment == pytest.approx(0.35 if fb is uncapped else 1.0 - 5.0 * (1.0 - GOAL))
        t = 0.0
        while rec.attainment is not None and rec.attainment < GOAL:
            t += 30.0
            rec = delivered(rec, _sig(300.0, 1.0), 30.0, t, GOAL, fb)
            assert rec is not None
        assert (t > hours * 3600.0) == (fb is uncapped)
    short = _record(1.0 - 3.0 * (1.0 - GOAL))
    assert next_factor(short, 600.0, GOAL, capped) == next_factor(short, 600.0, GOAL, uncapped) > 1.0
    with pytest.raises(ValueError, match="window_miss_cap"):
        FeedbackSettings(window_miss_cap=0.5)


@pytest.mark.parametrize(("now", "want"), [(8.0, 10.0), (7.0, 10.0), (6.0, 8.0), (1.0, 8.0)])
def test_with_rise_needs_arrivals_a_spikes_trend_is_no_rise(now: float, want: float) -> None:
    """After a minute-long burst the forecast's trend climbs on while the arrivals are back at their base:
    the relaxed factor applies (want 8 = 10 x 0.8). Arrivals within rise_above of the level held are a rise,
    and the factor waits (want 10)."""
    d = Demand("mistral-7b", DemandState.OK, 10.0, MIX)
    cfg = Settings(feedback=replace(FB, floor_window_s=0.0, rise_needs_arrivals=True, rise_trims_held=False))
    sig = replace(_sig(300.0, 1.0, rate=now), rate_history=(2.0, 8.0, 3.0))
    got = _with_feedback({"mistral-7b": d}, {"mistral-7b": _record(1.0, 0.8)}, cfg, 0.0,
                         {"mistral-7b": sig})["mistral-7b"]
    assert got.rps == pytest.approx(want)
    plain = replace(cfg, feedback=replace(cfg.feedback, rise_needs_arrivals=False))
    assert _with_feedback({"mistral-7b": d}, {"mistral-7b": _record(1.0, 0.8)}, plain, 0.0,
                          {"mistral-7b": sig})["mistral-7b"].rps == pytest.approx(10.0)


def test_with_a_hold_the_factor_relaxes_only_once_slack_has_held_that_long() -> None:
    hold = replace(FB, relax_hold_s=1800.0)
    calm = replace(_record(1.0, factor=0.95), tight_at_s=-600.0)  # read tight 10 min ago
    assert next_factor(calm, 300.0, GOAL, hold) == 0.95
    # without a hold the record's age is all it asks
    assert next_factor(calm, 300.0, GOAL, replace(FB, relax_hold_s=None)) < 0.95
    assert next_factor(replace(calm, tight_at_s=-1800.0), 300.0, GOAL, hold) < 0.95
    assert next_factor(replace(calm, tight_at_s=None), 300.0, GOAL, hold) < 0.95  # never read tight
    with pytest.raises(ValueError, match="relax_hold_s"):
        FeedbackSettings(relax_hold_s=-1.0)


def test_the_record_notes_when_it_last_read_tight() -> None:
    first = delivered(None, _sig(600.0, 1.0), 30.0, 0.0, GOAL, FB)
    missed = delivered(first, _sig(600.0, 0.5), 30.0, 30.0, GOAL, FB)  # half the window missed
    assert missed is not None and missed.tight_at_s == 30.0
    after = missed
    for t in range(60, 7200, 30):  # every request met from here on: the smoothed share climbs back over the band
        after = delivered(after, _sig(600.0, 1.0), 30.0, float(t), GOAL, FB)
    assert after is not None and 30.0 < (after.tight_at_s or 0.0) < 7170.0
    assert _slack(after, GOAL) > FB.relax_above


def test_with_restore_below_a_relaxed_factor_returns_to_1_once_misses_pass_it() -> None:
    restore = replace(FB, restore_below=-0.5)
    relaxed = 0.8
    # Slack -1 (twice the allowed misses): past the threshold, so 1 and a step of tightening on top.
    short = _record(1.0 - 2.0 * (1.0 - GOAL), factor=relaxed)
    assert next_factor(short, 60.0, GOAL, restore) == pytest.approx(1.0 + FB.tighten_per_h / 60.0)
    assert next_factor(short, 60.0, GOAL, FB) == pytest.approx(relaxed + FB.tighten_per_h / 60.0)
    # Slack -0.25: a shortfall under the threshold only tightens.
    near = _record(1.0 - 1.25 * (1.0 - GOAL), factor=relaxed)
    assert next_factor(near, 60.0, GOAL, restore) == next_factor(near, 60.0, GOAL, FB) < 1.0
    # A factor already over 1 is never lowered by it.
    assert next_factor(replace(short, factor=1.05), 60.0, GOAL, restore) > 1.05
    with pytest.raises(ValueError, match="restore_below"):
        FeedbackSettings(restore_below=0.5)
