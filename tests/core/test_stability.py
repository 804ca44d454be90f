"""Stability: scale up at once, hold inside the band, scale down only after a delay and dwell."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rayscale.config import load_catalog
from rayscale.core.estimate import estimate
from rayscale.core.plan import PlannerMemory, PlannerSettings, plan
from rayscale.core.signals import Freshness, ModelSignals, RequestMix

MIX = RequestMix(900, 180, 2700)
CAT = load_catalog().subset(["mistral-7b"], ["a10g"])
SET = PlannerSettings(hysteresis_band=0.25, downscale_delay_s=120, min_dwell_s=60, dwell_covers_startup=False)


def _step(rate: float | None, current: dict, now: float, mem: PlannerMemory):  # type: ignore[no-untyped-def]
    sig = (ModelSignals("mistral-7b", Freshness.FRESH, 1.0, rate, MIX) if rate is not None
           else ModelSignals("mistral-7b", Freshness.STALE, 60.0))
    p, mem = plan(CAT, estimate(CAT, {"mistral-7b": sig}), current, now=now, memory=mem, settings=SET)
    return p, p.target(), mem


def test_scale_up_is_immediate_and_keeps_running_replicas() -> None:
    cur = {("mistral-7b", "a10g", "on-demand"): 2}
    p, tgt, mem = _step(20.0, cur, 0.0, PlannerMemory())
    assert p.replicas("mistral-7b") > 2
    assert tgt[("mistral-7b", "a10g", "on-demand")] >= 2  # only adds
    assert all("scale up" in e.reason for e in p.entries)
    assert mem.last_change_s["mistral-7b"] == 0.0


@pytest.mark.parametrize(("over", "tolerance", "up"), [
    (0.03, 0.0, True), (0.03, 0.05, False), (0.08, 0.05, True)])
def test_a_demand_within_the_scale_up_tolerance_keeps_the_fleet(over: float, tolerance: float, up: bool) -> None:
    """Demand a few percent above what runs (capacity estimates move that much window to window) orders
    nothing inside the tolerance, reports no shortfall, and says why; beyond it, the model scales up."""
    cur = {("mistral-7b", "a10g", "on-demand"): 3}
    sig = ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 1.0, MIX)
    d = estimate(CAT, {"mistral-7b": sig})["mistral-7b"]
    have = 3 * d.capacity["a10g"].rps
    d = replace(d, rps=have * (1 + over))
    settings = replace(SET, scale_up_tolerance=tolerance)
    p, _ = plan(CAT, {"mistral-7b": d}, cur, now=0.0, memory=PlannerMemory(), settings=settings)
    assert (p.replicas("mistral-7b") > 3) == up
    assert p.replicas("mistral-7b") >= 3
    if not up:
        assert not p.shortfalls and "scale-up tolerance" in p.entries[0].reason


@pytest.mark.parametrize(("over", "slack", "line", "up"), [
    (0.05, False, 0.0, True), (0.05, True, 0.0, False), (0.05, True, 1.08, False), (0.05, True, 1.2, True),
    (0.15, True, 0.0, True)])
def test_a_fleet_with_slo_slack_scales_up_only_past_its_own_tolerance(over: float, slack: bool, line: float,
                                                                      up: bool) -> None:
    """A fleet whose SLO feedback trims its demand on a level (Demand.slo_slack: it delivered the SLO with
    slack) buys no replica for a crossing within slack_scale_up_tolerance; without that record, past the
    tolerance, or where the arrivals' recent line (Demand.rise_rps, ``line`` x what runs) outgrows the
    tolerance within a horizon, it scales up at once."""
    cur = {("mistral-7b", "a10g", "on-demand"): 3}
    sig = ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 1.0, MIX)
    d = estimate(CAT, {"mistral-7b": sig})["mistral-7b"]
    have = 3 * d.capacity["a10g"].rps
    d = replace(d, rps=have * (1 + over), slo_slack=slack, rise_rps=have * line)
    settings = replace(SET, slack_scale_up_tolerance=0.1)
    p, _ = plan(CAT, {"mistral-7b": d}, cur, now=0.0, memory=PlannerMemory(), settings=settings)
    assert (p.replicas("mistral-7b") > 3) == up
    assert ("10% scale-up tolerance" in p.entries[0].reason) == (not up)


def test_band_holds_then_downscale_waits_for_delay_and_dwell() -> None:
    _, cur, mem = _step(10.0, {}, 0.0, PlannerMemory())
    n = sum(cur.values())
    # A small dip inside the band changes nothing.
    p, tgt, mem = _step(9.0, cur, 10.0, mem)
    assert tgt == cur and "steady" in p.entries[0].reason
    # A deep dip: nothing happens until downscale_delay_s has passed.
    for t in (20.0, 60.0, 130.0):
        p, tgt, mem = _step(2.0, cur, t, mem)
        assert tgt == cur, t
        assert "scale-down waits" in p.entries[0].reason
    p, tgt, mem = _step(2.0, cur, 141.0, mem)
    assert sum(tgt.values()) < n and "scale down" in p.entries[0].reason
    # Load returning resets the timer.
    _, cur2, mem2 = _step(10.0, {}, 0.0, PlannerMemory())
    _step(2.0, cur2, 20.0, mem2)
    _, _, mem3 = _step(10.0, cur2, 30.0, mem2)
    assert "mistral-7b" not in mem3.below_since_s
    _, tgt4, _ = _step(2.0, cur2, 145.0, mem3)
    assert tgt4 == cur2


def test_min_dwell_blocks_downscale_right_after_a_change() -> None:
    _, cur, mem = _step(10.0, {}, 0.0, PlannerMemory())
    mem = PlannerMemory(last_change_s={"mistral-7b": 500.0}, below_since_s={"mistral-7b": 0.0})
    _, tgt, _ = _step(1.0, cur, 520.0, mem)
    assert tgt == cur
    _, tgt, _ = _step(1.0, cur, 561.0, mem)
    assert sum(tgt.values()) < sum(cur.values())


def test_stale_signals_never_scale_down() -> None:
    cur = {("mistral-7b", "a10g", "on-demand"): 5}
    mem = PlannerMemory(below_since_s={"mistral-7b": 0.0})
    for t in (0.0, 500.0, 5000.0):
        p, tgt, mem = _step(None, cur, t, mem)
        assert tgt == cur
        assert "stale" in p.entries[0].reason


def test_capacity_is_never_cancelled_before_it_could_serve() -> None:
    startup = CAT.flavors["a10g"].node_startup_s + CAT.profile("mistral-7b", "a10g").startup_s
    cur = {("mistral-7b", "a10g", "on-demand"): 6}
    mem = PlannerMemory(last_change_s={"mistral-7b": 0.0}, below_since_s={"mistral-7b": 0.0})
    s = PlannerSettings(hysteresis_band=0.25, downscale_delay_s=120, min_dwell_s=60)
    sig = {"mistral-7b": ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 1.0, MIX)}
    p, _ = plan(CAT, estimate(CAT, sig), cur, now=startup - 1, memory=mem, settings=s)
    assert p.target() == cur and f"{startup:.0f}s after the last change" in p.entries[0].reason
    p, _ = plan(CAT, estimate(CAT, sig), cur, now=startup + 1, memory=mem, settings=s)
    assert sum(p.target().values()) < 6


def test_a_decision_holds_while_the_world_converges() -> None:
    """After a scale-down the gangs drain for a while; re-planning against them must not undo it."""
    world = {("mistral-7b", "a10g", "on-demand"): 6}
    mem = PlannerMemory(below_since_s={"mistral-7b": 0.0})
    _, t1, mem = _step(1.0, world, 1000.0, mem)
    n = sum(t1.values())
    assert n < 6
    for t in (1002.0, 1004.0, 1010.0):  # the world still shows 6 (draining), demand unchanged
        _, tgt, mem = _step(1.0, world, t, mem)
        assert sum(tgt.values()) == n, t
    # A restart (no memory) starts from the world again.
    _, tgt, _ = _step(1.0, world, 1012.0, PlannerMemory())
    assert sum(tgt.values()) == 6


def test_scale_down_keeps_headroom_so_a_small_rise_does_not_order_a_replica_back() -> None:
    rate = 2.0
    cap = estimate(CAT, {"mistral-7b": ModelSignals("mistral-7b", Freshness.FRESH, 1.0, rate, MIX)}
                   )["mistral-7b"].capacity["a10g"].rps
    k = 4
    low = 0.97 * k * cap  # k replicas cover it exactly; k + 1 with 10% headroom
    up = {("mistral-7b", "a10g", "on-demand"): 8}
    mem = PlannerMemory(last_change_s={"mistral-7b": -1e9}, below_since_s={"mistral-7b": -1e9})
    for headroom, after_down in ((0.0, k), (0.1, k + 1)):
        settings = PlannerSettings(hysteresis_band=0.25, downscale_headroom=headroom, downscale_delay_s=120,
                                   min_dwell_s=60, dwell_covers_startup=False)
        sig = ModelSignals("mistral-7b", Freshness.FRESH, 1.0, low, MIX)
        p, m = plan(CAT, estimate(CAT, {"mistral-7b": sig}), up, now=0.0, memory=mem, settings=settings)
        assert p.replicas("mistral-7b") == after_down, headroom
        assert "scale down" in p.entries[0].reason and not p.shortfalls
        assert ("headroom" in p.entries[0].reason) == (headroom > 0)
        # 5% more load, the next period: cut to exactly the demand, the fleet orders a replica back.
        sig = ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 1.05 * low, MIX)
        p2, _ = plan(CAT, estimate(CAT, {"mistral-7b": sig}), p.target(), now=5.0, memory=m, settings=settings)
        assert (p2.replicas("mistral-7b") > after_down) == (headroom == 0), headroom


@pytest.mark.parametrize("solver", ["exact", "greedy"])
def test_a_scale_down_moves_to_other_offerings_only_when_that_saves_enough(solver: str) -> None:
    # 3 on-demand L40S for a demand that 2 L40S plus a cheaper replica (spot, inf2) would serve: dropping
    # running replicas alone cannot go below 3; starting others saves about 40%.
    cat = load_catalog().subset(["mistral-7b"], ["l40s", "inf2"])
    mix = RequestMix(1571, 149, 5200)
    run = {("mistral-7b", "l40s", "on-demand"): 3}
    demand = estimate(cat, {"mistral-7b": ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 7.0, mix)})
    mem = PlannerMemory(last_change_s={"mistral-7b": -1e9}, below_since_s={"mistral-7b": -1e9})
    plans = {}
    for saving in (0.0, 0.3, 0.5, 0.99):
        plans[saving], _ = plan(cat, demand, run, now=0.0, memory=mem,
                                settings=PlannerSettings(scale_down_move_saving=saving, solver=solver))
        assert not plans[saving].shortfalls
    moved, kept = plans[0.0], plans[0.99]
    assert kept.target() == run and "dropping running replicas only" in kept.entries[0].reason
    assert set(moved.target()) - set(run)  # replicas on offerings that do not run now
    s = 1 - moved.usd_per_h / kept.usd_per_h
    assert 0.3 < s < 0.5
    assert plans[0.3].target() == moved.target()  # saves more than asked: moves
    assert plans[0.5].target() == run  # saves less than asked: drops nothing, as nothing can be dropped
    assert f"would save {s:.0%}, under 50%" in plans[0.5].entries[0].reason


def test_a_scale_down_moves_when_staying_would_starve_another_model() -> None:
    # Four L40S devices in all: mistral runs 3 and could serve its smaller demand on inf2; qwen runs only on
    # L40S and needs a second one. Staying put saves mistral a move but leaves qwen short: move anyway.
    cat = load_catalog().subset(["mistral-7b", "qwen2-7b"], ["l40s", "inf2"])
    l40s, qwen = cat.flavors["l40s"], cat.models["qwen2-7b"]
    cat = cat.model_copy(update={
        "flavors": {**cat.flavors, "l40s": l40s.model_copy(update={"limits": l40s.limits.model_copy(
            update={"devices": 4})})},
        "models": {**cat.models, "qwen2-7b": qwen.model_copy(update={"parallelism": {"l40s": qwen.parallelism["l40s"]}})}})
    mix = RequestMix(1571, 149, 5200)
    sig = {"mistral-7b": ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 7.0, mix),
           "qwen2-7b": ModelSignals("qwen2-7b", Freshness.FRESH, 1.0, 5.0, mix)}
    run = {("mistral-7b", "l40s", "on-demand"): 3, ("qwen2-7b", "l40s", "on-demand"): 1}
    mem = PlannerMemory(last_change_s={"mistral-7b": -1e9, "qwen2-7b": -1e9}, below_since_s={"mistral-7b": -1e9})
    p, _ = plan(cat, estimate(cat, sig), run, now=0.0, memory=mem,
                settings=PlannerSettings(scale_down_move_saving=0.99, solver="exact"))
    assert not p.shortfalls
    assert p.replicas("qwen2-7b") >= 2 and any(e.flavor == "inf2" for e in p.entries if e.model == "mistral-7b")


def test_planner_settings_name_the_bad_field() -> None:
    for kw, msg in (({"hysteresis_band": 1.0}, "hysteresis_band must be < 1"),
                    ({"downscale_delay_s": -1.0}, "downscale_delay_s must be >= 0"),
                    ({"hysteresis_band": 0.0, "downscale_headroom": 0.1}, "downscale_headroom 0.1 must be <="),
                    ({"solver": "fast"}, "solver must be auto, exact or greedy"),
                    ({"scale_down_move_saving": 1.0}, "scale_down_move_saving must be < 1")):
        with pytest.raises(ValueError, match=msg):
            PlannerSettings(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("sharpness", "scaled_down"), [(1.0, True), (2.5, False)])
def test_a_narrower_band_applies_where_bursts_last_a_minute_or_more(sharpness: float, scaled_down: bool) -> None:
    from dataclasses import replace

    narrow = replace(SET, smooth_hysteresis_band=0.1)
    sig = ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 10.0, MIX)
    demand = estimate(CAT, {"mistral-7b": sig})
    cur = plan(CAT, demand, {}, settings=narrow)[0].target()
    # A need of 76% of the fleet's capacity: outside a 0.1 band, inside 0.25.
    have = sum(n * demand["mistral-7b"].capacity[f].rps for (_, f, _), n in cur.items())
    dip = {m: replace(d, rps=0.76 * have, burst_sharpness=sharpness) for m, d in demand.items()}
    mem = PlannerMemory()
    for t in (0.0, 200.0):
        p, mem = plan(CAT, dip, cur, now=t, memory=mem, settings=narrow)
    assert (sum(p.target().values()) < sum(cur.values())) == scaled_down
    with pytest.raises(ValueError, match="smooth_hysteresis_band"):
        PlannerSettings(smooth_hysteresis_band=1.0)


def test_a_scale_down_keeps_capacity_for_the_rise_the_rate_is_on_and_not_for_a_flat_rate() -> None:
    """At the foot of a ramp the forecast is about the rate now: a scale-down to it is bought back a start-up
    later, into a queue. Demand.rise_rps (the rate's recent line, one start-up ahead) is what it keeps, and
    nothing is ordered for it: a rise above what runs is no shortfall."""
    sig = ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0, MIX)
    d = estimate(CAT, {"mistral-7b": sig})["mistral-7b"]
    cap = d.capacity["a10g"].rps
    up = {("mistral-7b", "a10g", "on-demand"): 6}
    mem = PlannerMemory(last_change_s={"mistral-7b": -1e9}, below_since_s={"mistral-7b": -1e9})
    settings = replace(SET, downscale_headroom=0.0)
    flat, _ = plan(CAT, {"mistral-7b": replace(d, rps=2 * cap)}, up, now=0.0, memory=mem, settings=settings)
    rising, _ = plan(CAT, {"mistral-7b": replace(d, rps=2 * cap, rise_rps=3.5 * cap)}, up, now=0.0, memory=mem,
                     settings=settings)
    assert flat.replicas("mistral-7b") == 2
    assert rising.replicas("mistral-7b") == 4 and not rising.shortfalls
    assert "req/s for the rise (the rate's recent line" in rising.entries[0].reason
    # A rise beyond what runs keeps what runs, and orders nothing.
    steep, _ = plan(CAT, {"mistral-7b": replace(d, rps=2 * cap, rise_rps=9 * cap)}, up, now=0.0, memory=mem,
                    settings=settings)
    assert steep.replicas("mistral-7b") == 6 and not steep.shortfalls


def _steady_on_h100(now: float, settings: PlannerSettings, last_change: float | None = -1e9,
                    unavailable: dict | None = None, last_plan: float | None = None,
                    load: float = 0.9):  # type: ignore[no-untyped-def]
    """Four mistral replicas on one 8-GPU p5.48xlarge (bought while L40S was backed off), for a demand of
    ``load`` x what the four serve: inside the hysteresis band at 0.9, a steady model."""
    cat = load_catalog().subset(["mistral-7b"], ["l40s", "h100"])
    run = {("mistral-7b", "h100", "on-demand"): 4}
    d = estimate(cat, {"mistral-7b": ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 1.0, MIX)})["mistral-7b"]
    d = replace(d, rps=load * 4 * d.capacity["h100"].rps)
    mem = PlannerMemory(last_change_s={} if last_change is None else {"mistral-7b": last_change}, at_s=last_plan)
    return plan(cat, {"mistral-7b": d}, run, now=now, memory=mem, settings=settings, unavailable=unavailable)[0]


@pytest.mark.parametrize(("solver", "load"), [("exact", 0.9), ("greedy", 0.9), ("greedy", 0.6)])
def test_a_steady_fleet_on_a_dearer_flavor_moves_to_the_cheaper_cover(solver: str, load: float) -> None:
    """In the band, and below it while the scale-down waits (a need that crosses the band back and forth
    resets that wait each time): the running capacity, on the flavor that covers it for less."""
    settings = PlannerSettings(solver=solver)
    p = _steady_on_h100(0.0, settings, load=load)
    assert p.replicas("mistral-7b", "h100") == 0 and p.replicas("mistral-7b", "l40s") > 0
    assert not p.shortfalls and "re-pricing" in p.entries[0].reason
    assert sum(e.rps_capacity for e in p.entries) >= 4 * p.replica_rps()[("mistral-7b", "h100")] - 1e-6
    kept = _steady_on_h100(0.0, replace(settings, steady_moves=False), load=load)
    assert kept.target() == {("mistral-7b", "h100", "on-demand"): 4}
    assert ("steady" if load == 0.9 else "over-provisioned") in kept.entries[0].reason
    assert p.usd_per_h <= (1 - settings.scale_down_move_saving) * kept.usd_per_h


def test_a_steady_fleet_moves_only_once_it_settled_and_onto_capacity_it_can_get() -> None:
    """Not within the scale-down's wait after its last change, nor when that change is unknown (a
    restart), nor while the cheaper flavor is backed off in every zone."""
    settings = PlannerSettings(downscale_delay_s=600.0)
    run = {("mistral-7b", "h100", "on-demand"): 4}
    assert _steady_on_h100(500.0, settings, last_change=0.0).target() == run
    assert _steady_on_h100(0.0, settings, last_change=None).target() == run
    zones = load_catalog().flavors["l40s"].zones
    backed_off = {("l40s", z, "on-demand"): 1e9 for z in zones}
    assert _steady_on_h100(0.0, settings, unavailable=backed_off).target() == run
    assert _steady_on_h100(2000.0, settings, last_change=0.0).replicas("mistral-7b", "h100") == 0


def test_a_steady_fleet_is_checked_for_a_move_once_every_downscale_delay() -> None:
    """From its last change: at 1,000 models, checking each steady model every period cost 15-20 ms a step."""
    settings = PlannerSettings(downscale_delay_s=600.0)
    run = {("mistral-7b", "h100", "on-demand"): 4}
    assert _steady_on_h100(2000.0, settings, last_change=0.0, last_plan=1995.0).target() == run
    assert _steady_on_h100(2400.0, settings, last_change=0.0, last_plan=2395.0).replicas("mistral-7b", "h100") == 0
    _, mem = plan(load_catalog().subset(["mistral-7b"], ["l40s"]), {}, {}, now=42.0)
    assert mem.at_s == 42.0
