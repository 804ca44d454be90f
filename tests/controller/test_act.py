"""Act decisions: whole gangs up first, replicas only on ready gangs, drain before release, rollback."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rayscale.config import load_catalog
from rayscale.core.act import (
    ActSettings,
    BackOff,
    CreateGang,
    DeleteGang,
    DrainGang,
    Gang,
    GangPhase,
    SetReplicas,
    decide,
)

CAT = load_catalog()
K = ("qwen2-72b", "a10g", "on-demand")  # TP4 x PP2: a gang of two g5.12xlarge


def _gang(i: int, phase: GangPhase, serving: int = 0, created: float = 0.0, zone: str = "us-east-1a") -> Gang:
    return Gang(f"qwen2-72b-a10g-od-{i}", *K, zone, "g5.12xlarge", 2, phase, created, serving)


def test_scale_up_creates_whole_gangs_then_replicas_only_when_ready() -> None:
    acts = decide(CAT, {K: 2}, [], {}, {}, {}, now=0.0)
    creates = [a for a in acts if isinstance(a, CreateGang)]
    assert [c.name for c in creates] == ["qwen2-72b-a10g-od-0", "qwen2-72b-a10g-od-1"]
    assert all(c.nodes == 2 and c.instance_type == "g5.12xlarge" for c in creates)
    assert {c.zone for c in creates} == {"us-east-1a", "us-east-1b"}  # spread, each gang in one zone
    assert not [a for a in acts if isinstance(a, SetReplicas)]
    # Same world after a restart (gangs pending): no duplicates, still no replicas.
    world = [_gang(0, GangPhase.PENDING), _gang(1, GangPhase.PENDING, zone="us-east-1b")]
    assert decide(CAT, {K: 2}, world, {}, {}, {}, now=10.0) == []
    world[0] = _gang(0, GangPhase.READY)
    acts = decide(CAT, {K: 2}, world, {}, {}, {}, now=20.0)
    assert acts == [SetReplicas("qwen2-72b", "a10g", 1, "1 gang(s) ready for 2 planned")]


def test_partial_gang_times_out_is_deleted_whole_and_backed_off() -> None:
    world = [_gang(0, GangPhase.PENDING, created=0.0)]
    timeout = 3.0 * CAT.flavors["a10g"].node_startup_s
    assert decide(CAT, {K: 1}, world, {}, {}, {}, now=timeout - 1) == []
    acts = decide(CAT, {K: 1}, world, {}, {}, {}, now=timeout + 1)
    assert any(isinstance(a, DeleteGang) and a.name == world[0].name for a in acts)
    bo = [a for a in acts if isinstance(a, BackOff)]
    assert bo and (bo[0].flavor, bo[0].zone) == ("a10g", "us-east-1a")
    # The replacement goes to another zone right away.
    new = [a for a in acts if isinstance(a, CreateGang)]
    assert new and new[0].zone == "us-east-1b"


def test_launch_timeout_runs_from_when_the_gang_went_pending_not_from_creation() -> None:
    """A gang that was ready for an hour and lost a worker pod is waited for, not deleted at once."""
    from dataclasses import replace

    timeout = 3.0 * CAT.flavors["a10g"].node_startup_s
    again = replace(_gang(0, GangPhase.PENDING, serving=1, created=0.0), since_s=3600.0)
    assert decide(CAT, {K: 1}, [again], {("qwen2-72b", "a10g"): 1}, {}, {}, now=3600.0 + timeout - 1) == []
    acts = decide(CAT, {K: 1}, [again], {("qwen2-72b", "a10g"): 1}, {}, {}, now=3600.0 + timeout + 1)
    assert any(isinstance(a, DeleteGang) and f"not up after {timeout + 1:.0f}s" in a.reason for a in acts)


def test_capacity_error_fails_gang_and_every_zone_backed_off_creates_nothing() -> None:
    failed = Gang("qwen2-72b-a10g-od-0", *K, "us-east-1a", "g5.12xlarge", 2, GangPhase.FAILED, 0.0,
                  reason="InsufficientCapacityError")
    blocked = {("a10g", z, "on-demand"): 1e9 for z in ("us-east-1b", "us-east-1c")}
    acts = decide(CAT, {K: 1}, [failed], {}, {}, blocked, now=5.0)
    assert any(isinstance(a, DeleteGang) and "InsufficientCapacityError" in a.reason for a in acts)
    assert not [a for a in acts if isinstance(a, CreateGang)]


def test_scale_down_drains_first_then_releases_idle_gangs() -> None:
    world = [_gang(0, GangPhase.READY, serving=1, created=0), _gang(1, GangPhase.READY, serving=1, created=5)]
    mf = ("qwen2-72b", "a10g")
    # Step 1: lower Serve replicas; no gang deleted while two replicas still run.
    acts = decide(CAT, {K: 1}, world, {mf: 2}, {mf: 2}, {}, now=100.0)
    assert acts == [SetReplicas("qwen2-72b", "a10g", 1, "drain to 1: plan wants 1")]
    # Step 2: Serve stopped the replica on gang 1: that idle gang goes, the serving one stays.
    world[1] = _gang(1, GangPhase.READY, serving=0, created=5)
    acts = decide(CAT, {K: 1}, world, {mf: 1}, {mf: 1}, {}, now=110.0)
    assert acts == [DeleteGang("qwen2-72b-a10g-od-1", "plan wants 1 x on-demand; drained")]


def test_make_before_break_when_moving_flavor() -> None:
    mf_old, new_key = ("qwen2-72b", "a10g"), ("qwen2-72b", "l40s", "on-demand")
    world = [_gang(0, GangPhase.READY, serving=1)]
    acts = decide(CAT, {new_key: 1}, world, {mf_old: 1}, {mf_old: 1}, {}, now=0.0)
    assert any(isinstance(a, CreateGang) and a.flavor == "l40s" for a in acts)
    assert not [a for a in acts if isinstance(a, SetReplicas | DeleteGang)]  # old keeps serving
    new_ready = Gang("qwen2-72b-l40s-od-0", *new_key, "us-east-1a", "g6e.12xlarge", 1, GangPhase.READY, 1.0)
    acts = decide(CAT, {new_key: 1}, [*world, new_ready], {mf_old: 1}, {mf_old: 1}, {}, now=400.0)
    assert acts == [SetReplicas("qwen2-72b", "l40s", 1, "1 gang(s) ready for 1 planned")]
    # the new gang is up but its replica is still loading the model: the old one keeps serving
    mf_new = ("qwen2-72b", "l40s")
    serve_target = {mf_old: 1, mf_new: 1}
    acts = decide(CAT, {new_key: 1}, [*world, new_ready], serve_target, {mf_old: 1, mf_new: 0}, {}, now=700.0)
    assert acts == []
    # placed but still starting: it exists (Serve's "running" count) and serves nothing yet
    acts = decide(CAT, {new_key: 1}, [*world, new_ready], serve_target, {mf_old: 1, mf_new: 1}, {}, now=750.0,
                  serve_serving={mf_old: 1, mf_new: 0})
    assert acts == []
    # the new replica serves: now the old drains, and its gang goes only once it serves nothing
    acts = decide(CAT, {new_key: 1}, [*world, new_ready], serve_target, {mf_old: 1, mf_new: 1}, {}, now=800.0)
    assert acts == [SetReplicas("qwen2-72b", "a10g", 0, "drain to 0: plan wants 0")]


def test_deployments_of_other_models_are_left_alone() -> None:
    # Serve also runs the tiny model (another app): the controller owns only its catalog's deployments.
    acts = decide(CAT.subset(["qwen2-72b"], ["a10g"]), {K: 0}, [], {("tiny-qwen2", "cpu"): 1,
                                                                   ("qwen2-72b", "l40s"): 1}, {}, {}, now=0.0)
    assert acts == []


def test_act_settings_reject_a_nonpositive_launch_timeout_and_the_cli_names_its_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="launch_timeout_factor must be > 0"):
        ActSettings(launch_timeout_factor=0)
    from rayscale.cli import main

    assert main(["controller", "--launch-timeout-factor", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--launch-timeout-factor" in err and "launch_timeout_factor must be > 0" in err


def test_serve_places_per_flavor_so_an_idle_gang_of_another_capacity_type_goes_and_is_not_reordered() -> None:
    """Serve put its two replicas on both on-demand gangs where the plan wanted one on-demand and one spot:
    the idle spot gang is released (the flavor holds more gangs than replicas), and no gang is ordered
    for the spot shortfall while the flavor already holds as many gangs as the plan's replicas."""
    spot = (K[0], K[1], "spot")
    world = [_gang(0, GangPhase.READY, serving=1), _gang(1, GangPhase.READY, serving=1, created=5),
             Gang("qwen2-72b-a10g-spot-0", *spot, "us-east-1a", "g5.12xlarge", 2, GangPhase.READY, 10, 0)]
    mf = (K[0], K[1])
    acts = decide(CAT, {K: 1, spot: 1}, world, {mf: 2}, {mf: 2}, {}, now=100.0)
    assert acts == [DeleteGang("qwen2-72b-a10g-spot-0", "plan wants 1 x spot; drained")]
    acts = decide(CAT, {K: 1, spot: 1}, world[:2], {mf: 2}, {mf: 2}, {}, now=105.0)
    assert acts == []
    # A real shortfall of the flavor still orders, on the short capacity type.
    acts = decide(CAT, {K: 1, spot: 2}, world[:2], {mf: 2}, {mf: 2}, {}, now=110.0)
    assert [(a.name, a.capacity_type) for a in acts if isinstance(a, CreateGang)] == [("qwen2-72b-a10g-spot-0", "spot")]


def test_make_before_break_holds_only_what_the_incoming_capacity_replaces() -> None:
    """Seven 7B replicas on L40S, the plan wants two there and one slow inf2 replica: while the inf2 starts,
    one L40S replica more than planned covers it, not all seven, and the idle gangs go."""
    m = "mistral-7b"
    l40s, inf2 = (m, "l40s", "on-demand"), (m, "inf2", "on-demand")
    world = [Gang(f"{m}-l40s-od-{i}", *l40s, "us-east-1a", "g6e.xlarge", 1, GangPhase.READY, 0.0, 1)
             for i in range(7)]
    world.append(Gang(f"{m}-inf2-od-0", *inf2, "us-east-1a", "inf2.xlarge", 1, GangPhase.PENDING, 10.0))
    mf = (m, "l40s")
    target = {l40s: 2, inf2: 1}
    rps = {mf: 3.7, (m, "inf2"): 0.85}
    acts = decide(CAT, target, world, {mf: 7}, {mf: 7}, {}, now=20.0, replica_rps=rps)
    assert acts == [SetReplicas(m, "l40s", 3, "drain to 3: plan wants 2, 1 held while the model's capacity "
                                                 "elsewhere comes up")]
    # Without the replicas' req/s the drain holds them all, as before.
    assert decide(CAT, target, world, {mf: 7}, {mf: 7}, {}, now=20.0) == []
    # Serve stopped four: their gangs go, the three that serve stay until the inf2 replica serves.
    drained = [replace(g, serving=0) if i >= 3 else g for i, g in enumerate(world[:7])] + world[7:]
    acts = decide(CAT, target, drained, {mf: 3}, {mf: 3}, {}, now=30.0, replica_rps=rps)
    assert sorted(a.name for a in acts if isinstance(a, DeleteGang)) == [f"{m}-l40s-od-{i}" for i in range(3, 7)]
    assert not [a for a in acts if isinstance(a, SetReplicas)]
    # A slower replica coming up in place of a faster one is covered in full: 4 x 0.85 needs one L40S.
    acts = decide(CAT, {l40s: 2, inf2: 4}, world, {mf: 7}, {mf: 7}, {}, now=20.0, replica_rps=rps)
    assert [a.replicas for a in acts if isinstance(a, SetReplicas)] == [3]
    # Where the one coming up is worth five of these, all seven stay.
    big = {mf: 0.85, (m, "inf2"): 3.7}
    assert not [a for a in decide(CAT, target, world, {mf: 7}, {mf: 7}, {}, now=20.0, replica_rps=big)
                if isinstance(a, SetReplicas | DeleteGang)]


M = ("mistral-7b", "l40s")  # one replica per g6e.xlarge node: a replica can move to any gang of the flavor
OD, SPOT = (*M, "on-demand"), (*M, "spot")


def _node(name: str, key: tuple[str, str, str], serving: int, draining: bool = False) -> Gang:
    return Gang(name, *key, "us-east-1a", "g6e.xlarge", 1, GangPhase.READY, 0.0, serving, draining=draining)


def test_a_drainable_spot_gang_the_plan_dropped_moves_onto_idle_on_demand_before_it_goes() -> None:
    """The plan wants two on-demand replicas and no spot; Serve runs them on the spot gangs while the two
    on-demand gangs stand idle. A provider that drains: the spot gangs are drained (Serve moves each replica
    before it stops the old one) and the idle on-demand gangs are kept for them. One that cannot: the idle
    on-demand gangs go and the spot ones keep serving, as before."""
    world = [_node("s0", SPOT, 1), _node("s1", SPOT, 1), _node("o0", OD, 0), _node("o1", OD, 0)]
    view = ({M: 2}, {M: 2}, {}, 100.0)
    acts = decide(CAT, {OD: 2}, world, *view, can_drain=True)
    assert sorted(a.name for a in acts if isinstance(a, DrainGang)) == ["s0", "s1"]
    assert not [a for a in acts if isinstance(a, DeleteGang | SetReplicas | CreateGang)]
    old = decide(CAT, {OD: 2}, world, *view)
    assert sorted(a.name for a in old if isinstance(a, DeleteGang)) == ["o0", "o1"]
    assert not [a for a in old if isinstance(a, DrainGang)]
    # Draining: the spot gangs count for nothing (no room, no Serve slot); released once they serve none.
    world = [_node("s0", SPOT, 1, True), _node("s1", SPOT, 0, True), _node("o0", OD, 1), _node("o1", OD, 0)]
    acts = decide(CAT, {OD: 2}, world, {M: 2}, {M: 3}, {}, 105.0, can_drain=True)
    assert acts == [DeleteGang("s1", "drained: its replicas moved")]


def test_a_drain_waits_for_a_free_slot_and_a_lower_target_moves_nothing_itself() -> None:
    # No free on-demand slot yet (the replacement is still coming up): nothing moves.
    world = [_node("s0", SPOT, 1), _node("o0", OD, 1), Gang("o1", *OD, "us-east-1b", "g6e.xlarge", 1,
                                                            GangPhase.PENDING, 0.0, 0)]
    assert not [a for a in decide(CAT, {OD: 2}, world, {M: 2}, {M: 2}, {}, 10.0, can_drain=True)
                if isinstance(a, DrainGang)]
    # A scale-down only lowers Serve's target: Serve stops the replica it picks.
    world = [_node("s0", SPOT, 1), _node("o0", OD, 1), _node("o1", OD, 1)]
    acts = decide(CAT, {OD: 2}, world, {M: 3}, {M: 3}, {}, 20.0, can_drain=True)
    assert acts == [SetReplicas(*M, 2, "drain to 2: plan wants 2")]
    # It picked an on-demand one: that gang is kept for the spot replica, which is drained onto it.
    world = [_node("s0", SPOT, 1), _node("o0", OD, 1), _node("o1", OD, 0)]
    acts = decide(CAT, {OD: 2}, world, {M: 2}, {M: 2}, {}, 25.0, can_drain=True)
    assert [(type(a).__name__, a.name) for a in acts] == [("DrainGang", "s0")]  # type: ignore[union-attr]
