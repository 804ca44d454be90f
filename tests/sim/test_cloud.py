"""The cloud model: gangs, capacity errors, spot notices."""

from __future__ import annotations

import numpy as np

from rayscale.config import load_catalog
from rayscale.sim.cloud import ActuatorConfig, CloudConfig, Cluster, GangState, Outage
from rayscale.sim.engine import Engine

CAT = load_catalog()


NO_ERRORS = CloudConfig(capacity_error_rate=0.0, spot_capacity_error_rate=0.0)
DEFAULT_ACT = ActuatorConfig()


def cluster(model="mistral-7b", flavors=("a10g",), cloud=NO_ERRORS, act=DEFAULT_ACT, seed=0):
    eng = Engine(np.array([0.0]), np.array([10]), np.array([10]))
    return Cluster(CAT, model, eng, list(flavors), np.random.default_rng(seed), cloud, act), eng


def run_until(cl, t_end, dt=1.0, t=0.0):
    while t <= t_end:
        cl.advance(t)
        t += dt
    return t


def test_gang_live_only_when_all_nodes_up():
    # qwen2-72b on a10g is TP4 x PP2: two g5.12xlarge nodes per replica.
    cl, eng = cluster("qwen2-72b", ("a10g",))
    assert cl.shape("a10g", "on-demand").nodes == 2
    cl.set_target("a10g", "on-demand", 1, 0.0)
    run_until(cl, 2.0)
    (g,) = cl.gangs.values()
    assert len(g.nodes) == 2
    ready = []
    t = 2.0
    while g.state != GangState.LIVE:
        cl.advance(t)
        n_ready = sum(n.t_ready is not None for n in g.nodes)
        if n_ready < 2:
            assert g.state == GangState.PROVISIONING and eng.nr == 0
        ready.append(n_ready)
        t += 1.0
        assert t < 5000
    assert 1 in ready or ready[0] == 2  # the nodes came up one after the other
    assert g.t_live >= max(n.t_ready for n in g.nodes) + 0.5 * CAT.profile("qwen2-72b", "a10g").startup_s * 0.3
    assert eng.nr == 1


def test_gpu_nodes_start_slower_than_cpu():
    cl, _ = cluster()
    cl.set_target("a10g", "on-demand", 20, 0.0)
    run_until(cl, 3000)
    gpu = [n.t_ready - n.t_launch for n in cl.nodes.values()]
    cl2, _ = cluster("tiny-qwen2", ("cpu",))
    cl2.set_target("cpu", "on-demand", 3, 0.0)
    run_until(cl2, 300)
    cpu = [n.t_ready - n.t_launch for n in cl2.nodes.values()]
    assert min(gpu) > max(cpu)
    assert 200 < np.mean(gpu) < 400  # around Flavor.node_startup_s = 300


def test_capacity_error_backs_off_zone_and_retries_elsewhere():
    out = CloudConfig(capacity_error_rate=0.0, outages=(Outage("a10g", 0, 10_000, zone="us-east-1a"),))
    cl, _ = cluster(cloud=out)
    cl.set_target("a10g", "on-demand", 1, 0.0)
    run_until(cl, 2000)
    assert cl.capacity_errors == 1
    assert ("a10g", "us-east-1a", "on-demand") in cl.unavailable
    (g,) = cl.gangs.values()
    assert g.state == GangState.LIVE and g.zone != "us-east-1a"


def test_capacity_errors_everywhere_drop_the_replica():
    out = CloudConfig(outages=(Outage("a10g", 0, 10_000),))
    cl, _ = cluster(cloud=out)
    cl.set_target("a10g", "on-demand", 1, 0.0)
    run_until(cl, 200)
    assert cl.capacity_errors == 3 and cl.count("a10g", "on-demand") == 0


def test_spot_interruption_notice_drains_then_kills():
    cloud = CloudConfig(capacity_error_rate=0.0, spot_capacity_error_rate=0.0, spot_interruptions_per_node_h=2.0)
    cl, eng = cluster(cloud=cloud, seed=3)
    cl.set_target("a10g", "spot", 1, 0.0)
    (g,) = cl.gangs.values()
    t, notice, live_before = 0.0, None, False
    while t < 20_000 and notice is None:
        cl.advance(t)
        live_before = live_before or g.state == GangState.LIVE
        if cl.spot_interruptions:
            notice = t
        t += 1.0
    assert notice is not None and g.nodes
    node = g.nodes[0]
    if live_before:
        # Stops taking requests at the notice (idle here, so it drains at once).
        assert g.state in (GangState.DRAINING, GangState.STOPPED) and eng.r_state[g.engine_rid] != 0
    assert cl.count("a10g", "spot") == 0  # the policy sees it gone and can replace it at once
    run_until(cl, notice + 125, t=t)
    assert node.t_end is not None and node.t_end - notice <= 120 + 1


def test_spot_is_cheaper_and_billing_stops_at_release():
    cl, _ = cluster()
    cl.set_target("a10g", "on-demand", 1, 0.0)
    cl.set_target("a10g", "spot", 1, 0.0)
    run_until(cl, 3600, dt=10.0)
    tot = cl.finish(3600.0)
    od = CAT.price("a10g", "g5.xlarge", "on-demand")
    assert tot.cost_usd < 2 * od and tot.cost_usd > od
    assert tot.node_hours <= 2.0


def test_named_gangs_pack_serve_replicas_fill_running_gangs_and_stop_starting_then_emptiest():
    # mistral-7b on h100: eight TP=1 replicas share one p5.48xlarge (a named gang of the provider path).
    cl, eng = cluster("mistral-7b", ("h100",))
    cl.create_named("g0", "h100", "on-demand", "us-east-1a", 0.0)
    t = run_until(cl, 3000, dt=10.0)
    g0 = cl.by_name["g0"]
    assert g0.state == GangState.READY and g0.shape.slots == 8
    cl.set_serve_target("h100", 3, t)
    t = run_until(cl, t + 3000, dt=10.0, t=t)
    assert cl.live_by_flavor() == {"h100": 3} and eng.nr == 3 and len(cl.nodes) == 1
    cl.create_named("g1", "h100", "on-demand", "us-east-1a", t)
    t = run_until(cl, t + 3000, dt=10.0, t=t)
    g1 = cl.by_name["g1"]
    cl.set_serve_target("h100", 10, t)  # the running gang's five free slots first, then the empty gang
    assert (len(g0.replicas), len(g1.replicas)) == (8, 2)
    cl.set_serve_target("h100", 7, t)  # Serve stops replicas still starting first, newest first
    assert (len(g0.replicas), len(g1.replicas)) == (7, 0)
    assert sum(r.state == GangState.LIVE for r in g0.replicas) == 3
    cl.delete_named("g1", t)  # nothing on it: its node goes at once
    assert cl.usd_per_h() == CAT.price("h100", "p5.48xlarge", "on-demand")
    t = run_until(cl, t + 3000, dt=10.0, t=t)
    assert cl.live_by_flavor() == {"h100": 7}
    cl.set_serve_target("h100", 0, t)  # live replicas drain (idle: at the next step), the gang stays held
    cl.advance(t + 1.0)
    assert g0.replicas == [] and cl.live_count() == 0 and g0.state == GangState.READY
    cl.delete_named("g0", t + 2.0)
    assert cl.usd_per_h() == 0.0 and all(n.t_end is not None for n in cl.nodes.values())


def test_deleting_a_packed_gang_drains_every_replica_before_its_node_goes():
    from rayscale.sim.provider import SimProvider

    cl, _ = cluster("mistral-7b", ("h100",))
    prov = SimProvider(cl, "mistral-7b")
    cl.create_named("g0", "h100", "on-demand", "us-east-1a", 0.0, warm=True)
    cl.set_serve_target("h100", 4, 0.0, instant=True)
    assert [g.serving for g in prov.gangs(0.0)] == [4]
    cl.delete_named("g0", 1.0)
    # Serve still runs the four draining replicas (counted until they finish); the node is still billed.
    assert prov.serve_view().running == {("mistral-7b", "h100"): 4} and prov.gangs(1.0) == []
    assert cl.usd_per_h() > 0
    cl.advance(2.0)  # idle: drained
    assert prov.serve_view().running == {} and cl.usd_per_h() == 0.0


def test_a_pool_reclaim_notices_every_spot_node_of_the_largest_pool_at_once_and_times_the_replacement():
    from collections import Counter

    from rayscale.sim.cloud import Reclaim

    cloud = CloudConfig(capacity_error_rate=0.0, spot_capacity_error_rate=0.0, spot_interruptions_per_node_h=0.0,
                        reclaims=(Reclaim(at_s=2000.0, largest=True),))
    cl, _ = cluster(flavors=("a10g", "l4"), cloud=cloud)
    cl.set_target("a10g", "spot", 3, 0.0)
    cl.set_target("l4", "spot", 1, 0.0)
    cl.set_target("a10g", "on-demand", 1, 0.0)
    t = run_until(cl, 1999.0)
    up = [n for n in cl.nodes.values() if n.t_end is None and n.t_ready is not None]
    assert len(up) == 5 and not cl.spot_interruptions
    t = run_until(cl, 2001.0, t=t)
    noticed = [n for n in cl.nodes.values() if n.noticed]
    # every noticed node is in one (flavor, zone) pool: the one with the most spot nodes, all of its nodes
    assert len({(n.flavor, n.zone, n.capacity_type) for n in noticed}) == 1
    (pool,) = {(n.flavor, n.zone) for n in noticed}
    in_pool = [n for n in up if n.capacity_type == "spot" and (n.flavor, n.zone) == pool]
    assert sorted(n.id for n in noticed) == sorted(n.id for n in in_pool) and cl.spot_interruptions == len(in_pool)
    sizes = Counter((n.flavor, n.zone) for n in up if n.capacity_type == "spot")
    assert len(in_pool) == max(sizes.values())
    # the policy re-asserts its targets: the lost replicas are replaced, each lag runs from the notice
    cl.set_target("a10g", "spot", 3, t)
    cl.set_target("l4", "spot", 1, t)
    run_until(cl, 4000.0, t=t)
    assert len(cl.replacement_lags_s) == len(in_pool)
    assert all(lag > 0 for lag in cl.replacement_lags_s)


def test_a_noticed_spot_gang_is_reported_failed_until_the_controller_deletes_it():
    """As a NodeClaim Karpenter deleted stays while it drains and terminates: a spot gang whose replica drained
    within a second of its notice must not vanish between two control periods, or the step never learns the
    interruption (rayscale.core.spot reads READY -> FAILED)."""
    from rayscale.core.act import GangPhase
    from rayscale.sim.cloud import Reclaim
    from rayscale.sim.provider import SimProvider

    cloud = CloudConfig(capacity_error_rate=0.0, spot_capacity_error_rate=0.0, spot_interruptions_per_node_h=0.0,
                        reclaims=(Reclaim(at_s=2000.0, flavor="a10g"),))
    cl, _ = cluster(cloud=cloud)
    prov = SimProvider(cl, "mistral-7b")
    cl.create_named("mistral-7b-a10g-spot-0", "a10g", "spot", "us-east-1a", 0.0)
    cl.set_serve_target("a10g", 1, 0.0)
    t = run_until(cl, 1999.0)
    (g,) = prov.gangs(t)
    assert g.phase == GangPhase.READY and g.serving == 1
    t = run_until(cl, 2300.0, t=t)  # past the notice, the idle replica's drain and the node's reclaim
    (g,) = prov.gangs(t)
    assert g.phase == GangPhase.FAILED and "spot interruption notice" in g.reason and g.serving == 0
    prov.delete_gang(g.name)
    assert prov.gangs(t) == []


def test_a_drained_gang_keeps_serving_until_its_replacement_runs_then_serve_stops_it():
    """Serve's migration (migrate_replicas_on_draining_nodes in ray/serve/_private/deployment_state.py): the
    replica on the drained gang serves on while a replacement starts on another gang of the flavor; once that
    one runs, the old one drains and its gang serves nothing."""
    from rayscale.sim.provider import SimProvider

    cl, _ = cluster("mistral-7b", ("a10g",))
    prov = SimProvider(cl, "mistral-7b")
    cl.create_named("spot", "a10g", "spot", "us-east-1a", 0.0, warm=True)
    cl.set_serve_target("a10g", 1, 0.0, instant=True)
    cl.create_named("od", "a10g", "on-demand", "us-east-1b", 0.0, warm=True)
    assert {g.name: g.serving for g in prov.gangs(0.0)} == {"spot": 1, "od": 0}
    prov.now = 1.0
    prov.drain_gang("spot")
    gangs = {g.name: g for g in prov.gangs(1.0)}
    assert gangs["spot"].draining and gangs["spot"].serving == 1 and gangs["od"].serving == 1
    assert prov.serve_view().serving == {("mistral-7b", "a10g"): 1}  # the old one serves, the new one starts
    t, lowest = 1.0, 1
    while {g.name: g.serving for g in prov.gangs(t)}["spot"] > 0:
        assert t < 3600, "the drained gang never emptied"
        t += 1.0
        cl.advance(t)
        lowest = min(lowest, prov.serve_view().serving.get(("mistral-7b", "a10g"), 0))
    assert lowest == 1  # never a moment without a serving replica
    cl.advance(t + 1.0)
    gangs = {g.name: g for g in prov.gangs(t + 1.0)}
    assert gangs["spot"].serving == 0 and gangs["od"].serving == 1 and cl.serve_target == {"a10g": 1}
    assert prov.serve_view().serving == {("mistral-7b", "a10g"): 1}
