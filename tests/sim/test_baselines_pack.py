"""Baselines act through the same act step as rayscale: replicas pack onto nodes, fleets are priced packed."""

from __future__ import annotations

import numpy as np
import pytest

from rayscale.config import load_catalog
from rayscale.core.catalog import CapacityType
from rayscale.sim.baselines import ClairvoyantPolicy, FleetPolicy, StaticBestPolicy, _parse, on_demand_only
from rayscale.sim.cloud import CloudConfig, Reclaim
from rayscale.sim.fleet_act import FleetActor, fleet_usd_per_h, share_usd_per_h
from rayscale.sim.multi import MultiConfig, simulate_models
from rayscale.sim.policies import OraclePolicy
from rayscale.sim.simulator import SimConfig, Simulation
from rayscale.sim.sources import load_spec

MODEL = "mistral-7b"
OD, SPOT = CapacityType.ON_DEMAND.value, CapacityType.SPOT.value
CAT = on_demand_only(load_catalog())
H100 = CAT.subset([MODEL], ["h100"])  # p5.48xlarge: eight H100s, so eight TP=1 replicas a node
NODE_USD_H = CAT.price("h100", "p5.48xlarge", CapacityType.ON_DEMAND)
STEADY = load_spec("gen:poisson:rate=6,hours=0.25", seed=0)
# 4 req/s with a 4-minute burst at 30 req/s: the burst needs several H100 replicas, the base one.
BURSTY = load_spec("gen:bursty:base=4,burst=30,every_s=900,burst_s=240,hours=0.5", seed=0)


def _run(cat, trace, policy, cfg: SimConfig | None = None):
    sim = Simulation(cat.with_request_mix(MODEL, trace.request_mix()), trace, policy, cfg or SimConfig())
    return sim, sim.run()


def test_a_fleet_is_priced_as_whole_packed_nodes():
    l4 = CAT.price("l4", "g6.xlarge", CapacityType.ON_DEMAND)
    assert fleet_usd_per_h(CAT, MODEL, {("h100", OD): 1}) == pytest.approx(NODE_USD_H)
    assert fleet_usd_per_h(CAT, MODEL, {("h100", OD): 8}) == pytest.approx(NODE_USD_H)
    assert fleet_usd_per_h(CAT, MODEL, {("h100", OD): 9}) == pytest.approx(2 * NODE_USD_H)
    assert fleet_usd_per_h(CAT, MODEL, {("h100", OD): 8, ("l4", OD): 3}) == pytest.approx(NODE_USD_H + 3 * l4)
    assert share_usd_per_h(CAT, MODEL, "h100", OD) == pytest.approx(NODE_USD_H / 8)
    assert share_usd_per_h(CAT, MODEL, "l4", OD) == pytest.approx(l4)


@pytest.mark.parametrize(("replicas", "nodes"), [(8, 1), (9, 2)])
def test_a_static_fleet_of_tp1_replicas_fills_8_gpu_nodes_before_adding_one(replicas: int, nodes: int):
    sim, r = _run(CAT, STEADY, FleetPolicy({("h100", OD): replicas}))
    launched = list(sim.cluster.nodes.values())
    assert len(launched) == nodes and {n.instance_type for n in launched} == {"p5.48xlarge"}
    assert r.timeline["replicas"]["h100"][0] == replicas  # all live from t=0, warm
    assert r.node_hours == pytest.approx(nodes * r.sim_s / 3600)
    assert r.cost_usd == pytest.approx(fleet_usd_per_h(CAT, MODEL, {("h100", OD): replicas}) * r.sim_s / 3600)
    assert r.scale_up_events == 0 and r.slo_attainment >= 0.99


def test_clairvoyant_scales_replicas_up_and_down_inside_one_node():
    sim, r = _run(H100, BURSTY, pol := ClairvoyantPolicy())
    assert pol.plan is not None and pol.plan.needs.max() >= 3  # one gang per replica would take 3+ nodes
    assert r.extra["reached_goal"] and r.slo_attainment >= 0.99
    live = r.timeline["replicas"]["h100"]
    assert live.max() >= pol.plan.needs.max() and live.min() < live.max()  # it did follow the burst
    assert len(sim.cluster.nodes) == 1  # the burst's replicas went onto the node's free devices
    assert r.cost_usd == pytest.approx(NODE_USD_H * r.sim_s / 3600)


def test_static_best_prices_its_fleets_packed_and_is_billed_that_price():
    sim, r = _run(H100, BURSTY, pol := StaticBestPolicy())
    assert pol.best is not None and r.extra["reached_goal"]
    ((flavor, ct), n), = pol.fleet.items()
    assert (flavor, ct) == ("h100", OD) and n >= 2  # the burst needs more than one replica
    for label, t in pol.trials.items():  # every fleet the search weighed, priced as it packs
        assert t.usd_per_h == pytest.approx(fleet_usd_per_h(H100, MODEL, _parse(label))), label
    assert pol.best.usd_per_h == pytest.approx(NODE_USD_H * -(-n // 8))
    assert r.cost_usd == pytest.approx(pol.best.usd_per_h * r.sim_s / 3600)  # what it pays is what it priced
    assert len(sim.cluster.nodes) == -(-n // 8)


def test_a_lost_spot_gang_is_replaced_by_the_act_step():
    # Both spot nodes of the fleet get their notice at once; decide deletes the failed gangs, backs their zones
    # off and orders new gangs elsewhere, which come up and serve again.
    cloud = CloudConfig(spot_capacity_error_rate=0.0, spot_interruptions_per_node_h=0.0,
                        reclaims=(Reclaim(at_s=120.0, flavor="l4"),))
    cat = load_catalog()
    sim, r = _run(cat, STEADY, FleetPolicy({("l4", SPOT): 2, ("l4", OD): 2}), SimConfig(cloud=cloud))
    assert r.spot_interruptions == 2
    spot = [n for n in sim.cluster.nodes.values() if n.capacity_type == SPOT]
    assert len(spot) == 4 and sum(n.t_launch > 120.0 for n in spot) == 2
    assert r.scale_up_events == 1
    assert r.timeline["replicas"]["l4"][-1] == 4  # whole again


def test_instant_nodes_serve_in_the_period_they_are_ordered():
    # The fluid bound's integer plan has instant nodes: its gangs and replicas are up in the same period.
    sim = Simulation(CAT, STEADY, OraclePolicy(), SimConfig())
    FleetActor(sim).act({("l4", OD): 3}, 30.0)
    assert sim.cluster.live_by_flavor() == {"l4": 3}
    # A baseline with real start-up only ordered them.
    sim2 = Simulation(CAT, STEADY, FleetPolicy({}), SimConfig())
    FleetActor(sim2).act({("l4", OD): 3}, 30.0)
    assert sim2.cluster.live_by_flavor() == {} and len(sim2.cluster.named()) == 3


def test_multi_model_static_best_packs_each_models_fleet():
    traces = {m: load_spec(f"gen:poisson:rate={x},hours=0.1", seed=i + 1)
              for i, (m, x) in enumerate({"mistral-7b": 12.0, "qwen2-7b": 12.0}.items())}
    cat = CAT.subset(list(traces), ["h100"])
    res = simulate_models(cat, traces, "static-best", MultiConfig(SimConfig(seed=1)))
    for m, r in res.per_model.items():
        n = int(r.extra["fleet"].rsplit(":", 1)[1])
        assert n >= 2 and r.slo_attainment >= 0.99, m
        assert r.node_hours == pytest.approx(r.sim_s / 3600), m  # one node for all its replicas
    (use,) = res.usage
    assert use.peak_nodes == 2 and use.peak_devices == 16
    assert np.isclose(res.cost_usd, 2 * NODE_USD_H * next(iter(res.per_model.values())).sim_s / 3600)


def test_from_the_same_start_every_policy_begins_with_the_first_fleet_then_moves_it():
    """SimConfig.same_start: whatever a policy would start with, t=0 runs the shared first fleet (what the
    shipped step orders for the first window); a fixed fleet elsewhere then replaces it, making before breaking."""
    from rayscale.sim.fleet_act import first_fleet
    from rayscale.sim.policies import RayscalePolicy, StockConfig, StockPolicy

    cat = CAT.subset([MODEL]).with_request_mix(MODEL, STEADY.request_mix())
    cfg = SimConfig(same_start=True)
    first = first_fleet(Simulation(cat, STEADY, RayscalePolicy(), cfg))
    assert first and all(ct == OD for _, ct in first)
    ((start_flavor, _), _n), = first.items()
    other = next(f for f in sorted(cat.flavors) if f != start_flavor and f in cat.models[MODEL].parallelism)
    stock = StockPolicy(StockConfig(flavor=other))  # on another flavor: it retires the start fleet too
    runs = {}
    for policy in (RayscalePolicy(), stock, FleetPolicy({(other, OD): 4}), ClairvoyantPolicy()):
        r = runs[policy.name] = Simulation(cat, STEADY, policy, cfg).run()
        at_start = {f: int(v[0]) for f, v in r.timeline["replicas"].items() if v[0] > 0}
        assert at_start == {f: n for (f, _), n in first.items()}, policy.name
    fixed = Simulation(cat, STEADY, FleetPolicy({(other, OD): 4}), cfg).run()
    assert fixed.timeline["replicas"][other][-1] == 4 and fixed.timeline["replicas"][start_flavor][-1] == 0
    assert min(fixed.timeline["replicas"][other] + fixed.timeline["replicas"][start_flavor]) >= 1  # never empty
    assert runs["stock"].timeline["replicas"][start_flavor][-1] == 0  # retired once stock's own served


def test_clairvoyant_prices_its_plan_as_it_packs_so_a_few_replicas_do_not_buy_an_8_gpu_node():
    """Per replica an H100 on a full p5.48xlarge is cheap; a plan of a few replicas still pays the whole node.
    The bound picks the flavor whose per-minute plan costs least as packed, measuring both kinds of candidate."""
    cat = CAT.subset([MODEL], ["h100", "l40s"])
    _, r = _run(cat, STEADY, pol := ClairvoyantPolicy())
    assert pol.flavor == "l40s" and r.extra["reached_goal"]
    assert r.cost_usd < NODE_USD_H * r.sim_s / 3600  # less than one p5.48xlarge over the run


def test_on_a_trickle_the_bound_takes_the_cheapest_replica_not_the_cheapest_per_request():
    """At 0.2 req/s every minute needs one replica: per request an L40S is cheapest, but one inf2 costs less
    than one L40S and meets the SLO at that rate. The bound must find it, or a fixed fleet beats the bound."""
    cat = CAT.subset([MODEL], ["inf2", "l40s"])
    trickle = load_spec("gen:poisson:rate=0.2,hours=0.5", seed=0)
    _, r = _run(cat, trickle, pol := ClairvoyantPolicy())
    _, fixed = _run(cat, trickle, StaticBestPolicy())
    assert pol.flavor == "inf2" and r.extra["reached_goal"]
    assert r.cost_usd <= fixed.cost_usd * 1.001
