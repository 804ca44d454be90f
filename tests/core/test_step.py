"""One step, one settings file: the controller and the simulator run the same function with the same knobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rayscale.cli import main
from rayscale.config import load_settings, settings_from_mapping
from rayscale.controller import loop
from rayscale.controller.loop import ControllerConfig
from rayscale.core import step as step_mod
from rayscale.core.act import CreateGang, Gang, GangPhase, SetReplicas
from rayscale.core.catalog import CatalogError
from rayscale.core.plan import bursts_last
from rayscale.core.settings import Settings
from rayscale.core.signals import Freshness, ModelSignals, RequestMix
from rayscale.core.step import ServeView, StepContext, StepState, step
from rayscale.sim import policies
from rayscale.sim.simulator import SimConfig

SHORT = RequestMix(prompt_mean=500, output_mean=100, prompt_p95=1500)


def test_controller_and_simulator_call_the_same_step_with_the_shipped_settings() -> None:
    assert loop.step is step_mod.step and policies.step is step_mod.step
    assert ControllerConfig().settings == SimConfig().settings == policies.RayscalePolicy().settings
    assert load_settings() == Settings()  # rayscale/data/settings.yaml is the shipped record, key for key
    shipped = Path(__file__).parents[2] / "rayscale" / "data" / "settings.yaml"
    import yaml

    raw = yaml.safe_load(shipped.read_text())
    assert set(raw) == set(Settings.__dataclass_fields__)  # every knob is written out, none unknown
    for section in ("estimate", "planner", "act", "feedback"):
        assert set(raw[section]) == set(type(getattr(Settings(), section)).__dataclass_fields__)


def _ctx(cat: object, now: float, gangs: tuple[Gang, ...], serve: ServeView | None, state: StepState,
         rate: float = 3.0) -> StepContext:
    sig = ModelSignals("mistral-7b", Freshness.FRESH, 0.0, rate, SHORT, waiting=0.0)
    return StepContext(now, cat, {"mistral-7b": sig}, gangs, serve, Settings(), state)  # type: ignore[arg-type]


def test_a_step_orders_whole_gangs_then_replicas_on_ready_ones_and_keeps_its_state() -> None:
    from rayscale.config import load_catalog

    cat = load_catalog().subset(["mistral-7b"], ["l40s"])
    first = step(_ctx(cat, 0.0, (), ServeView({}, {}), StepState()))
    creates = [a for a in first.actions if isinstance(a, CreateGang)]
    assert creates and not [a for a in first.actions if isinstance(a, SetReplicas)]
    assert first.state.rate_history["mistral-7b"] == (3.0,) and first.state.next_history_s == 60.0
    # The gangs came up: replicas go onto them, and nothing new is ordered for the same load.
    ready = tuple(Gang(c.name, c.model, c.flavor, c.capacity_type, c.zone, c.instance_type, c.nodes,
                       GangPhase.READY, 0.0) for c in creates)
    second = step(_ctx(cat, 5.0, ready, ServeView({}, {}), first.state))
    assert [a for a in second.actions if isinstance(a, SetReplicas)] == [
        SetReplicas("mistral-7b", "l40s", len(creates), f"{len(creates)} gang(s) ready for {len(creates)} planned")]
    assert not [a for a in second.actions if isinstance(a, CreateGang)]
    assert second.state.rate_history == first.state.rate_history  # the next sample is due at 60 s
    # Serve's state unknown: the plan is made, nothing is changed.
    blind = step(_ctx(cat, 10.0, ready, None, second.state))
    assert blind.actions == () and blind.plan.target()


def test_the_rate_history_takes_whole_windows_of_counted_arrivals_only() -> None:
    """Seconds after a start the counts cover part of a window: a rate over them is noise that a trend would
    extrapolate a start-up ahead (4.2 req/s over the first 5 s of a steady 6 req/s became a forecast of 21)."""
    from dataclasses import replace

    from rayscale.config import load_catalog

    cat = load_catalog().subset(["mistral-7b"], ["l40s"])

    def at(now: float, counts: tuple[float, ...], state: StepState) -> StepState:
        ctx = _ctx(cat, now, (), None, state, rate=4.2)
        sig = replace(ctx.signals["mistral-7b"], arrival_counts=counts, arrival_bin_s=5.0)
        return step(replace(ctx, signals={"mistral-7b": sig})).state

    first = at(5.0, (21.0,), StepState())
    assert "mistral-7b" not in first.rate_history  # one 5-s bin of a 60-s window
    second = at(65.0, (21.0,) + (30.0,) * 12, first)
    assert second.rate_history["mistral-7b"] == (6.0,)  # the last whole window: 12 bins of 30 arrivals


def test_a_failed_gang_is_replaced_in_another_zone_and_the_back_off_is_kept_in_the_state() -> None:
    from rayscale.config import load_catalog

    cat = load_catalog().subset(["mistral-7b"], ["l40s"])
    first = step(_ctx(cat, 0.0, (), ServeView({}, {}), StepState(), rate=0.5))
    c = next(a for a in first.actions if isinstance(a, CreateGang))
    failed = Gang(c.name, c.model, c.flavor, c.capacity_type, c.zone, c.instance_type, c.nodes, GangPhase.FAILED,
                  0.0, reason="insufficient capacity")
    second = step(_ctx(cat, 5.0, (failed,), ServeView({}, {}), first.state, rate=0.5))
    assert (c.flavor, c.zone, c.capacity_type) in second.state.unavailable
    again = [a for a in second.actions if isinstance(a, CreateGang)]
    assert again and all(a.zone != c.zone for a in again if a.capacity_type == c.capacity_type)


def test_settings_files_name_the_file_and_the_field(tmp_path: Path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text("planner:\n  downscale_delay_s: 30\n")
    s = load_settings(f)
    assert s.planner.downscale_delay_s == 30.0 and s.planner.solver == "greedy"  # the rest stays shipped
    for text, message in (("perod_s: 5\n", "perod_s: unknown setting"),
                          ("planner:\n  solver: fast\n", "PlannerSettings.solver must be auto, exact or greedy"),
                          ("estimate:\n  burst_floor: maybe\n", "estimate.burst_floor: Input should be a valid boolean"),
                          ("estimate:\n  target_utilization: 1.5\n",
                           "EstimateSettings.target_utilization must be in (0, 1]"),
                          ("act: 3\n", "act: must be a mapping")):
        f.write_text(text)
        with pytest.raises(CatalogError, match=str(f).replace(".", r"\.")) as e:
            load_settings(f)
        assert message in str(e.value)
    with pytest.raises(CatalogError, match=r"ControllerSpec\.settings: period_s: Input should be a valid number"):
        settings_from_mapping({"period_s": "fast"}, "ControllerSpec.settings")


def test_simulate_and_controller_read_the_settings_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("forecaster: crystal-ball\n")
    for cmd in (["controller"], ["simulate", "--trace", "gen:poisson:rate=1,hours=0.02"]):
        assert main([*cmd, "--settings", str(bad)]) == 2
        assert f"{bad}: (top level): Settings.forecaster must be one of" in capsys.readouterr().err
    trace = ["simulate", "--trace", "gen:bursty:base=1,burst=6,every_s=600,burst_s=120,hours=0.5", "--policy",
             "rayscale", "--json", "--no-progress"]
    slow = tmp_path / "slow.yaml"
    slow.write_text("estimate:\n  target_utilization: 0.3\n")
    assert main(trace) == 0
    shipped = json.loads(capsys.readouterr().out)
    assert main([*trace, "--settings", str(slow)]) == 0
    held = json.loads(capsys.readouterr().out)
    assert held["cost_usd"] > 1.5 * shipped["cost_usd"]  # replicas run at 30% instead of 80%: the file was read


@pytest.mark.parametrize(("history", "rising"), [((2.0, 2.2, 2.5, 2.6, 2.9, 3.0), True),
                                                 ((3.0, 2.9, 3.1, 3.0, 2.9, 3.0), False)])
def test_the_step_gives_a_rising_demand_the_rate_its_line_reaches_one_horizon_ahead(
        history: tuple[float, ...], rising: bool) -> None:
    from dataclasses import replace

    from rayscale.config import load_catalog

    cat = load_catalog().subset(["mistral-7b"], ["l40s"])
    state = StepState(rate_history={"mistral-7b": history}, next_history_s=60.0)
    ctx = _ctx(cat, 10.0, (), ServeView({}, {}), state)
    off = replace(ctx, settings=replace(Settings(), rise_window_s=0.0))
    assert step(off).demands["mistral-7b"].rise_rps == 0.0
    on = replace(ctx, settings=replace(Settings(), rise_window_s=360.0, forecast_horizon_s=600.0))
    d = step(on).demands["mistral-7b"]
    # Rising: about 0.19 req/s a window, 10 windows past the last one; flat: no rise above the demand.
    assert (d.rise_rps > 4.5) == rising and (d.rise_rps == 0.0) == (not rising)


@pytest.mark.parametrize(("counts", "smooth"), [
    # 3 req/s, then a level of 6 req/s for ten minutes: bursts last minutes (sharpness about 1).
    ((15.0,) * 600 + (30.0,) * 120, True),
    # 3 req/s with 10-s spikes of 30 req/s: bursts come and go within the minute.
    (tuple(150.0 if i % 60 in (0, 1) else 15.0 for i in range(720)), False)])
def test_a_model_whose_bursts_last_runs_hotter_once_its_slo_record_earned_it_while_not_ramping(
        counts: tuple[float, ...], smooth: bool) -> None:
    from dataclasses import replace

    from rayscale.config import load_catalog
    from rayscale.core.feedback import Delivered

    cat = load_catalog().subset(["mistral-7b"], ["l40s", "a10g"])
    sig = ModelSignals("mistral-7b", Freshness.FRESH, 0.0, 6.0, SHORT, waiting=0.0, arrival_counts=counts,
                       arrival_bin_s=5.0)
    est = replace(Settings().estimate, smooth_target_utilization=0.9)
    ctx = StepContext(7200.0, cat, {"mistral-7b": sig}, (), ServeView({}, {}),
                      replace(Settings(), estimate=est), StepState())
    flat = step(replace(ctx, settings=Settings())).demands["mistral-7b"]
    assert bursts_last(Settings().planner, flat) == smooth
    flat_history, ramp = (6.0,) * 12, tuple(4.0 + 0.2 * i for i in range(11))
    for factor, history, earned in ((1.0, flat_history, False), (0.9, flat_history, smooth), (0.9, ramp, False),
                                    (0.9, (), False)):
        record = {"mistral-7b": Delivered(6.0, 6.0, 1e5, 7195.0, factor, since_s=0.0)}
        state = StepState(delivered=record, rate_history={"mistral-7b": history}, next_history_s=7260.0)
        d = step(replace(ctx, state=state)).demands["mistral-7b"]
        for f, c in d.capacity.items():
            assert c.rps == pytest.approx(flat.capacity[f].rps * (0.9 / 0.8 if earned else 1.0))
        assert ("utilisation (bursts last, SLO met)" in d.reason) == earned  # the plan says why
        shipped = step(replace(ctx, state=state, settings=Settings())).demands["mistral-7b"]
        assert (d.rps, d.burst_rps) == (shipped.rps, shipped.burst_rps)  # the demand is not rescaled


@pytest.mark.parametrize("history", ["descent", "bursts", "split bursts"])
def test_a_burst_floor_follows_a_fallen_level_and_holds_a_burst_that_climbs_within_a_horizon(history: str) -> None:
    import math
    from dataclasses import replace

    from rayscale.config import load_catalog

    cat = load_catalog().subset(["mistral-7b"], ["l40s"])
    # The last hour at 5-s bins: 40 min at 12 req/s, then 20 min at 3 req/s.
    counts = (60.0,) * 480 + (15.0,) * 240
    rates = {"descent": tuple(3.0 + 0.15 * i for i in range(60)) + tuple(12.0 - 0.45 * i for i in range(21)),
             "bursts": (3.0,) * 50 + (12.0,) * 10 + (3.0,) * 21,
             # A minute at 12 req/s across two clock minutes: each window reads half of it.
             "split bursts": (3.0,) * 50 + (7.5, 7.5) + (3.0,) * 29}[history]
    sig = ModelSignals("mistral-7b", Freshness.FRESH, 0.0, 3.0, SHORT, waiting=0.0, arrival_counts=counts,
                       arrival_bin_s=5.0)
    state = StepState(rate_history={"mistral-7b": rates}, next_history_s=7260.0)
    ctx = StepContext(7200.0, cat, {"mistral-7b": sig}, (), ServeView({}, {}), Settings(), state)
    held = step(replace(ctx, settings=replace(Settings(), hold_rise_room=False))).demands["mistral-7b"]
    d = step(ctx).demands["mistral-7b"]
    assert held.burst_rps > 10.0  # the replay of the hour: about its busiest minute
    if history == "descent":  # 0.15 req/s a window for 15 windows over the 3 req/s arriving (and its noise)
        room = 3.0 + 2.0 * math.sqrt(3.0 / Settings().window_s) + 15 * 0.15
        assert d.burst_rps == pytest.approx(held.burst_rps * room / 12.0, rel=0.02)
    else:  # the burst climbed from the rate now within a window: it can be back before capacity starts
        assert d.burst_rps == held.burst_rps
