"""Several models in one simulation: one step for all, shared NodePool limits, priorities, per-model books."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from rayscale.commands import simulate as simulate_cmd
from rayscale.commands.simulate_multi import parse_model_traces
from rayscale.config import load_catalog
from rayscale.core.catalog import Catalog, FlavorLimits
from rayscale.core.settings import Settings
from rayscale.sim.multi import MultiConfig, MultiSimulation, simulate_models
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.sim.sources import load_spec

CAT = load_catalog()
CFG = MultiConfig(SimConfig(seed=1))


def _traces(rates: dict[str, float], hours: float = 0.1) -> dict:
    return {m: load_spec(f"gen:poisson:rate={r},hours={hours}", seed=i + 1) for i, (m, r) in enumerate(rates.items())}


def _limited(models: list[str], flavor: str, devices: int, priorities: dict[str, int] | None = None) -> Catalog:
    """The catalog on one flavor whose NodePool holds ``devices``, with the priorities given."""
    cat = CAT.subset(models, [flavor])
    fl = cat.flavors[flavor].model_copy(update={"limits": FlavorLimits(devices=devices)})
    specs = {m: s.model_copy(update={"priority": (priorities or {}).get(m, s.priority)})
             for m, s in cat.models.items()}
    return cat.model_copy(update={"flavors": {flavor: fl}, "models": specs})


def test_three_models_together_the_72b_on_a_two_node_gang() -> None:
    # On A10G the 72B runs TP=4 x PP=2: each replica is a gang of two g5.12xlarge nodes.
    cat = CAT.subset(["mistral-7b", "qwen2-7b", "qwen2-72b"], ["a10g", "l4"])
    ms = MultiSimulation(cat, _traces({"mistral-7b": 2.0, "qwen2-7b": 1.0, "qwen2-72b": 0.3}), "rayscale", CFG)
    res = ms.run()
    assert ms.controller is not None
    big = [a for a in ms.controller.created if a.model == "qwen2-72b"]
    assert big and all(a.nodes == 2 and a.instance_type == "g5.12xlarge" for a in big)
    nodes = [n for n in ms.sims["qwen2-72b"].cluster.nodes.values()]
    assert len(nodes) >= 2 and {n.instance_type for n in nodes} == {"g5.12xlarge"}
    for m, r in res.per_model.items():
        assert r.requests > 0 and r.failed_requests == 0, m
        assert r.slo_attainment >= 0.9, (m, r.slo_attainment)
    # Gangs live in their own model's cloud only.
    assert {n.instance_type for n in ms.sims["mistral-7b"].cluster.nodes.values()} <= {"g5.xlarge", "g6.xlarge"}


@pytest.mark.parametrize("first", ["mistral-7b", "qwen2-7b"])
def test_when_limits_bind_the_higher_priority_model_is_served_first(first: str) -> None:
    # Two like 7B models on one flavor whose limit holds about one model's need: whichever has the higher
    # priority keeps its SLO, the other gets what is left.
    other = "qwen2-7b" if first == "mistral-7b" else "mistral-7b"
    cat = _limited(["mistral-7b", "qwen2-7b"], "l4", 8, {first: 5, other: 3})
    res = simulate_models(cat, _traces({"mistral-7b": 2.0, "qwen2-7b": 2.0}), "rayscale", CFG)
    hi, lo = res.per_model[first], res.per_model[other]
    assert hi.slo_attainment >= 0.95 and hi.slo_attainment > lo.slo_attainment + 0.3, (hi.slo_attainment,
                                                                                        lo.slo_attainment)
    (use,) = res.usage
    assert use.flavor == "l4" and use.binds and not use.exceeded  # the plan shares the limit, never overruns it
    assert [d["limits_bind"] for d in res.summaries()] == [["l4"], ["l4"]]
    assert lo.extra["shortfall_periods"] > 0


def test_fleets_sized_per_model_that_overrun_a_shared_limit_are_named() -> None:
    cat = _limited(["mistral-7b", "qwen2-7b"], "l4", 4)
    res = simulate_models(cat, _traces({"mistral-7b": 3.0, "qwen2-7b": 3.0}, hours=0.05), "stock", CFG)
    (use,) = res.usage
    assert use.exceeded and use.peak_devices > 4
    assert all(d["limits_exceeded"] == ["l4"] for d in res.summaries())


@pytest.mark.parametrize("policy", ["rayscale", "stock"])
def test_per_model_costs_sum_to_the_total_and_to_the_clouds_bills(policy: str) -> None:
    traces = _traces({"mistral-7b": 2.0, "qwen2-7b": 1.0, "qwen2-72b": 0.2}, hours=0.05)
    ms = MultiSimulation(CAT, traces, policy, CFG)
    res = ms.run()
    costs = [r.cost_usd for r in res.per_model.values()]
    assert all(c > 0 for c in costs)
    assert sum(costs) == pytest.approx(res.cost_usd)
    # Every node any model's cloud launched, billed from launch to release, adds up to the same total.
    billed = sum((n.t_end - n.t_launch) / 3600.0 * n.usd_per_h
                 for s in ms.sims.values() for n in s.cluster.nodes.values() if n.t_end is not None)
    assert billed == pytest.approx(res.cost_usd, rel=1e-9)
    assert all(d["run_cost_usd"] == pytest.approx(res.cost_usd, abs=1e-6) for d in res.summaries())
    ends = {r.sim_s for r in res.per_model.values()}
    assert len(ends) == 1  # one clock: every model's books close together


def test_one_model_alone_runs_exactly_as_the_single_model_simulation() -> None:
    # The fleet controller calls the same step with the same signals and acts through the same provider.
    tr = load_spec("gen:bursty:base=2,burst=6,every_s=600,burst_s=120,hours=0.2", seed=1)
    one = simulate(CAT, tr, "rayscale", SimConfig(seed=1)).summary()
    multi = simulate_models(CAT, {"mistral-7b": tr}, "rayscale", CFG).per_model["mistral-7b"].summary()
    for k in ("wall_s", "shortfall_periods", "priority"):
        one.pop(k, None)
        multi.pop(k, None)
    assert multi == one


def test_model_traces_split_only_at_model_names() -> None:
    models = sorted(CAT.models)
    got = parse_model_traces("mistral-7b=gen:bursty:base=1,burst=4,hours=0.1,qwen2-72b=t.csv", models)
    assert got == {"mistral-7b": "gen:bursty:base=1,burst=4,hours=0.1", "qwen2-72b": "t.csv"}
    with pytest.raises(ValueError, match="MODEL one of"):
        parse_model_traces("llama=gen:poisson", models)
    with pytest.raises(ValueError, match="named twice"):
        parse_model_traces("qwen2-7b=a.csv,qwen2-7b=b.csv", models)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rayscale")
    simulate_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


def test_cli_prints_one_object_per_policy_and_model(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    spec = tmp_path / "models.yaml"
    spec.write_text("mistral-7b: gen:poisson:rate=1,hours=0.03\nqwen2-72b: gen:poisson:rate=0.2,hours=0.03\n")
    assert _cli(["simulate", "--model-traces", str(spec), "--policy", "all", "--json", "--seed", "3"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["policy"], r["model"]) for r in rows] == [
        (p, m) for p in ("rayscale", "stock", "static-best") for m in ("mistral-7b", "qwen2-72b")]
    for r in rows:
        assert {"slo_attainment", "requests", "failed_requests", "rejected_requests", "cost_usd",
                "run_cost_usd", "limits_bind"} <= set(r)
    assert _cli(["simulate", "--model-traces", str(spec), "--policy", "rayscale"]) == 0
    out = capsys.readouterr().out
    assert "qwen2-72b" in out and "total" in out and "no NodePool limit reached" in out
    assert _cli(["simulate", "--model-traces", str(spec), "--policy", "clairvoyant"]) == 2
    assert "one model at a time" in capsys.readouterr().err
    assert _cli(["simulate", "--policy", "rayscale"]) == 2
    assert "either --trace" in capsys.readouterr().err


def test_from_cold_every_policy_starts_each_model_from_the_same_fleet() -> None:
    from rayscale.sim.baselines import on_demand_only

    cat = on_demand_only(CAT)
    traces = _traces({"mistral-7b": 3.0, "qwen2-7b": 1.0}, hours=0.05)
    # Settings of its own would have rayscale start from a larger fleet: the shared start overrides them.
    own = Settings(estimate=replace(Settings().estimate, target_utilization=0.4))
    cfg = MultiConfig(SimConfig(seed=1, same_start=True, settings=own))
    first: dict[str, dict[str, dict[str, int]]] = {}
    for policy in ("rayscale", "stock", "static-best"):
        res = simulate_models(cat, traces, policy, cfg)
        # The replicas live at the first timeline sample are the start fleet the result names.
        first[policy] = {m: {f: int(v[0]) for f, v in r.timeline["replicas"].items() if v[0]}
                         for m, r in res.per_model.items()}
        for m, r in res.per_model.items():
            assert first[policy][m]
            assert r.extra["start_fleet"] == "+".join(f"{f}:{n}" for f, n in sorted(first[policy][m].items()))
    assert first["rayscale"] == first["stock"] == first["static-best"]
