"""Packing: replicas that need fewer devices than a node has share it (eight TP=1 replicas on one p5.48xlarge,
two TP=4), priced as their share of the node; the plan pays for whole nodes, act fills running gangs before
ordering new ones, and a scale-down empties whole gangs (Serve stops replicas on the emptiest node first)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rayscale.cluster.actuator import apply_actions
from rayscale.config import load_catalog
from rayscale.core.act import CreateGang, DeleteGang, Gang, GangPhase, SetReplicas, decide
from rayscale.core.catalog import CapacityType, Catalog, FlavorLimits
from rayscale.core.chunk import pin_chunks
from rayscale.core.estimate import estimate
from rayscale.core.gangs import gang_shape
from rayscale.core.plan import plan
from rayscale.core.signals import Freshness, ModelSignals, RequestMix
from rayscale.core.solver import ModelNeed, Offering, Problem, solve_exact, solve_greedy
from rayscale.sim.cloud import CloudConfig, Cluster
from rayscale.sim.engine import Engine
from rayscale.sim.provider import SimProvider

ROOT = Path(__file__).resolve().parents[2]
CAT = pin_chunks(load_catalog())
H100 = CAT.subset(None, ["h100"])
P5_USD = CAT.price("h100", "p5.48xlarge", CapacityType.ON_DEMAND)
MIX = RequestMix(900, 180, 3000)  # examples/load.yaml's mistral-7b mix
OD = "on-demand"


def _demand(cat: Catalog, rates: dict[str, float]) -> dict[str, ModelSignals]:
    return {m: ModelSignals(m, Freshness.FRESH, 0.0, r, MIX) for m, r in rates.items()}


def _limit(cat: Catalog, flavor: str, devices: int) -> Catalog:
    fl = cat.flavors[flavor].model_copy(update={"limits": FlavorLimits(devices=devices)})
    return cat.model_copy(update={"flavors": {**cat.flavors, flavor: fl}})


def test_gang_shapes_carry_the_replicas_a_node_holds() -> None:
    assert gang_shape(CAT, "mistral-7b", "h100").slots == 8  # tp=1 on an 8-GPU p5.48xlarge
    assert gang_shape(CAT, "qwen2-72b", "h100").slots == 2  # tp=4
    assert gang_shape(CAT, "qwen2-72b", "a100").slots == 1  # tp=8 fills the node
    a10g = gang_shape(CAT, "qwen2-72b", "a10g")  # tp=4 x pp=2 spans two nodes: one replica per gang
    assert (a10g.nodes, a10g.slots) == (2, 1)
    # Where a small instance exists it stays the cheapest per replica: no 8-GPU node for one replica.
    assert gang_shape(CAT, "mistral-7b", "a10g").instance_type == "g5.xlarge"
    assert gang_shape(CAT, "mistral-7b", "trn1").instance_type == "trn1.2xlarge"  # a tie per replica: the smaller
    assert [gang_shape(CAT, "mistral-7b", "h100").gangs_for(n) for n in (0, 1, 8, 9, 16)] == [0, 1, 1, 2, 2]


def test_twenty_req_s_on_h100_orders_one_p5_for_up_to_eight_tp1_replicas() -> None:
    p, _ = plan(H100.subset(["mistral-7b"]), estimate(H100, _demand(H100, {"mistral-7b": 20.0})))
    (e,) = p.entries
    assert 1 < e.replicas <= 8 and e.rps_capacity >= 20.0
    assert (e.gangs, e.nodes) == (1, 1)
    assert e.usd_per_h == pytest.approx(P5_USD) and p.usd_per_h == pytest.approx(P5_USD)
    assert p.to_dict()["entries"][0]["nodes"] == 1
    # Past eight replicas a second node, still billed whole.
    big, _ = plan(H100.subset(["mistral-7b"]), estimate(H100, _demand(H100, {"mistral-7b": 100.0})))
    (e,) = big.entries
    assert e.replicas > 8 and e.nodes == -(-e.replicas // 8)
    assert big.usd_per_h == pytest.approx(e.nodes * P5_USD)


def test_mixed_tp_two_tp4_replicas_per_8_gpu_node() -> None:
    models = ["mistral-7b", "qwen2-72b"]
    cat = H100.subset(models)
    p, _ = plan(cat, estimate(cat, _demand(cat, {"mistral-7b": 20.0, "qwen2-72b": 12.0})))
    tp4 = next(e for e in p.entries if e.model == "qwen2-72b")
    tp1 = next(e for e in p.entries if e.model == "mistral-7b")
    assert tp4.gang.slots == 2 and tp4.replicas >= 3
    assert tp4.nodes == -(-tp4.replicas // 2) and tp1.nodes == 1
    assert p.usd_per_h == pytest.approx((tp4.nodes + tp1.nodes) * P5_USD)
    # The order is valued at the whole nodes it takes: three TP=4 replicas cost two nodes.
    assert f"${tp4.nodes * P5_USD / tp4.replicas:.2f}/h each" in tp4.reason


def test_a_small_demand_is_not_sold_a_share_of_an_empty_8_gpu_node() -> None:
    # At full packing an H100 replica costs $6.88/h, but two of them cost the whole $55/h node: a demand
    # that L40S serves for less stays on L40S.
    cat = CAT.subset(["mistral-7b"], ["h100", "l40s"])
    p, _ = plan(cat, estimate(cat, _demand(cat, {"mistral-7b": 6.0})))
    assert p.replicas("mistral-7b", "h100") == 0 and p.replicas("mistral-7b", "l40s") > 0
    assert p.usd_per_h < P5_USD


def test_a_scale_up_fills_free_slots_of_a_running_node_first() -> None:
    # One p5.48xlarge runs two replicas; more demand goes onto its six free GPUs (no cost), not onto L40S.
    cat = CAT.subset(["mistral-7b"], ["h100", "l40s"])
    running = {("mistral-7b", "h100", OD): 2}
    d = estimate(cat, _demand(cat, {"mistral-7b": 40.0}))
    p, _ = plan(cat, d, running)
    (e,) = [e for e in p.entries if e.flavor == "h100"]
    assert 2 < e.replicas <= 8 and e.nodes == 1 and p.replicas("mistral-7b", "l40s") == 0
    assert p.usd_per_h == pytest.approx(P5_USD)


def test_limits_count_whole_nodes_in_the_exact_solver() -> None:
    # 16 devices = two p5.48xlarge. Three TP=1 replicas take one node (3 of its 8 devices), three TP=4
    # replicas two more: counted by replicas' devices (3 + 12 = 15) they fit, by whole nodes (3) they do not.
    offs = [Offering("a", "h100", CapacityType.ON_DEMAND, P5_USD / 8, 1.0, 8, 1, slots=8),
            Offering("b", "h100", CapacityType.ON_DEMAND, P5_USD / 2, 1.0, 8, 1, slots=2)]
    needs = [ModelNeed("a", 3.0, 0, 100, 2), ModelNeed("b", 3.0, 0, 100, 1)]
    sol = solve_exact(Problem(needs, offs, device_limits={"h100": 16}))
    assert sol.counts == {0: 3, 1: 2} and sol.unmet_rps == {"b": pytest.approx(1.0)}
    # Without the limit both are met; the greedy solver counts a replica's share of its node.
    assert solve_exact(Problem(needs, offs)).counts == {0: 3, 1: 3}
    assert solve_greedy(Problem(needs, offs, device_limits={"h100": 32})).counts == {0: 3, 1: 3}


def test_the_shipped_h100_limit_holds_thirty_two_tp1_replicas() -> None:
    cat = _limit(H100.subset(["mistral-7b"]), "h100", 32)
    p, _ = plan(cat, estimate(cat, _demand(cat, {"mistral-7b": 1000.0})))
    (e,) = p.entries
    assert e.replicas == 32 and e.nodes == 4


K = ("mistral-7b", "h100", OD)
MF = K[:2]


def _gang(i: int, phase: GangPhase = GangPhase.READY, serving: int = 0, created: float = 0.0) -> Gang:
    return Gang(f"mistral-7b-h100-od-{i}", *K, "us-east-1a", "p5.48xlarge", 1, phase, created, serving)


def test_act_fills_running_gangs_before_ordering_and_serves_slots_per_gang() -> None:
    creates = [a for a in decide(CAT, {K: 3}, [], {}, {}, {}, now=0.0) if isinstance(a, CreateGang)]
    assert [(c.name, c.instance_type) for c in creates] == [("mistral-7b-h100-od-0", "p5.48xlarge")]
    # One ready gang holds the three replicas; nothing more is ordered.
    acts = decide(CAT, {K: 3}, [_gang(0)], {}, {}, {}, now=600.0)
    assert acts == [SetReplicas(*MF, 3, "1 gang(s) ready (8 slots) for 3 planned")]
    # Eight more fill the free five slots first: one new gang for the remaining three.
    acts = decide(CAT, {K: 11}, [_gang(0, serving=3)], {MF: 3}, {MF: 3}, {}, now=700.0)
    assert [a.name for a in acts if isinstance(a, CreateGang)] == ["mistral-7b-h100-od-1"]
    assert SetReplicas(*MF, 8, "1 gang(s) ready (8 slots) for 11 planned") in acts


def test_scale_down_releases_a_gang_only_once_serve_emptied_it() -> None:
    world = [_gang(0, serving=8), _gang(1, serving=2, created=5.0)]
    acts = decide(CAT, {K: 5}, world, {MF: 10}, {MF: 10}, {}, now=100.0)
    assert acts == [SetReplicas(*MF, 5, "drain to 5: plan wants 5")]
    # Serve stopped replicas on the emptiest node first: gang 1 serves nothing and goes.
    world = [_gang(0, serving=5), _gang(1, serving=0, created=5.0)]
    acts = decide(CAT, {K: 5}, world, {MF: 5}, {MF: 5}, {}, now=110.0)
    assert acts == [DeleteGang("mistral-7b-h100-od-1", "plan wants 5 x on-demand; drained")]
    # Both still serving: a surplus gang is never released under its replicas.
    world = [_gang(0, serving=3), _gang(1, serving=2, created=5.0)]
    assert decide(CAT, {K: 5}, world, {MF: 5}, {MF: 5}, {}, now=120.0) == []


def _sim(cat: Catalog) -> tuple[Cluster, SimProvider]:
    eng = Engine(np.array([0.0]), np.array([10]), np.array([10]))
    cl = Cluster(cat, "mistral-7b", eng, ["h100"], np.random.default_rng(0),
                 CloudConfig(capacity_error_rate=0.0, spot_capacity_error_rate=0.0))
    return cl, SimProvider(cl, "mistral-7b")


def test_a_scale_down_through_the_simulated_serve_empties_the_emptiest_gang_and_decide_releases_it() -> None:
    cl, prov = _sim(CAT)
    for i in range(2):
        cl.create_named(f"mistral-7b-h100-od-{i}", "h100", OD, "us-east-1a", 0.0, warm=True)
    cl.set_serve_target("h100", 10, 0.0, instant=True)
    assert sorted(g.serving for g in prov.gangs(0.0)) == [2, 8]  # the first gang filled, then the second
    assert cl.live_by_flavor() == {"h100": 10}
    # The plan wants 5: decide lowers Serve's target; Serve stops the two on the emptier gang, then three more.
    acts = decide(CAT, {K: 5}, prov.gangs(1.0), dict(prov.serve_view().target), dict(prov.serve_view().running),
                  {}, now=1.0)
    prov.now = 1.0
    apply_actions(acts, prov, prov.set_replicas, 1.0)
    cl.advance(2.0)  # idle replicas finish draining
    assert sorted(g.serving for g in prov.gangs(2.0)) == [0, 5]
    view = prov.serve_view()
    acts = decide(CAT, {K: 5}, prov.gangs(2.0), dict(view.target), dict(view.running), {}, now=2.0)
    (delete,) = [a for a in acts if isinstance(a, DeleteGang)]
    empty = next(g.name for g in prov.gangs(2.0) if g.serving == 0)
    assert delete.name == empty
    prov.now = 2.0
    apply_actions(acts, prov, prov.set_replicas, 2.0)
    cl.advance(3.0)
    assert [g.serving for g in prov.gangs(3.0)] == [5] and cl.usd_per_h() == pytest.approx(P5_USD)


def _plan_cli(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    load = tmp_path / "load.yaml"
    load.write_text("now_s: 1000\nmodels:\n  mistral-7b: {rate_rps: 20, prompt_mean: 900, output_mean: 180, "
                    "prompt_p95: 3000}\n")
    return subprocess.run([sys.executable, "-m", "rayscale.cli", "plan", "--load", str(load), "--flavor", "h100",
                           "--model", "mistral-7b", *extra], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_plan_on_h100_orders_one_p5_and_shows_its_fill(tmp_path: Path) -> None:
    t = _plan_cli(tmp_path)
    assert t.returncode == 0, t.stderr
    out = json.loads(_plan_cli(tmp_path, "--json").stdout)
    (e,) = out["entries"]
    assert (e["gangs"], e["nodes"], e["gang"]["slots"]) == (1, 1, 8) and 1 < e["replicas"] <= 8
    assert out["usd_per_h"] == pytest.approx(P5_USD)
    assert f"1x 1xp5.48xlarge ({e['replicas']}/8 replicas)" in t.stdout
    assert f"total ${P5_USD:.2f}/h" in t.stdout


def test_an_order_is_valued_at_the_new_nodes_it_takes() -> None:
    from rayscale.core.plan import _order_values

    share = P5_USD / 8 / 10.0  # $/h per req/s of one H100 replica at full packing (10 req/s each)
    offers = [(share, 10.0, "h100"), (0.5, 4.0, "l40s")]
    # Two replicas from nothing take a whole node: four times the share each.
    (h, _, _), l40s = _order_values(offers, 20.0, {"h100": 8}, {})
    assert h == pytest.approx(4 * share) and l40s == offers[1]
    # Three running on a node: five more fit its free GPUs and cost nothing new; a sixth opens a node.
    assert _order_values(offers, 50.0, {"h100": 8}, {"h100": 3})[0][0] == 0.0
    assert _order_values(offers, 60.0, {"h100": 8}, {"h100": 3})[0][0] == pytest.approx(8 * share / 6)
