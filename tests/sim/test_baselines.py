"""Baselines an operator would run: stock configured for the model, static-best, clairvoyant, fluid-bound."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from rayscale.commands import simulate as simulate_cmd
from rayscale.config import load_catalog
from rayscale.core.catalog import CapacityType
from rayscale.core.estimate import EstimateSettings, estimate, prior_mix
from rayscale.core.forecast import FORECASTERS
from rayscale.core.signals import Freshness, ModelSignals
from rayscale.sim.baselines import ClairvoyantPolicy, FleetPolicy, StaticBestPolicy, on_demand_only, replay
from rayscale.sim.policies import POLICIES, StockConfig, StockPolicy, replica_usd_per_h
from rayscale.sim.simulator import SimConfig, Simulation, simulate
from rayscale.sim.sources import load_spec

MODEL = "mistral-7b"
CAT = on_demand_only(load_catalog())
# One 4-minute burst at 12 req/s over 1 req/s, 15 minutes in: later than the start-up lead time.
BURSTY = load_spec("gen:bursty:base=1,burst=12,every_s=1800,burst_s=240,hours=0.5", seed=0)
STEADY = load_spec("gen:poisson:rate=6,hours=0.25", seed=0)


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rayscale")
    simulate_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


def _with_mix(trace):
    return CAT.with_request_mix(MODEL, trace.request_mix())


@pytest.fixture(scope="module")
def bursty():
    cat = _with_mix(BURSTY)
    out = {}
    for pol in (StaticBestPolicy(), ClairvoyantPolicy()):
        sim = Simulation(cat, BURSTY, pol, SimConfig())
        out[pol.name] = (pol, sim, sim.run())
    return out


def test_on_demand_only_view_buys_no_spot():
    assert all(f.capacity_types == [CapacityType.ON_DEMAND] and f.spot_max_share == 0 for f in CAT.flavors.values())
    sim = Simulation(_with_mix(BURSTY), BURSTY, StaticBestPolicy(), SimConfig())
    sim.run()
    assert {n.capacity_type for n in sim.cluster.nodes.values()} == {"on-demand"}


def test_static_best_reaches_the_goal_and_one_replica_fewer_does_not():
    cat = _with_mix(STEADY)
    pol = StaticBestPolicy(mix_flavors=0)
    sim = Simulation(cat, STEADY, pol, SimConfig())
    r = sim.run()
    assert r.extra["reached_goal"] and r.slo_attainment >= 0.99
    assert r.scale_up_events == 0
    ((flavor, ct), n), = pol.fleet.items()
    assert ct == "on-demand" and n >= 2  # 6 req/s needs more than one replica of any flavor
    assert pol.best is not None and r.slo_attainment == pytest.approx(pol.best.attainment)  # search's replay
    fewer = replay(sim, FleetPolicy({(flavor, ct): n - 1}))
    assert fewer.slo_attainment < 0.99
    # No other single flavor reaches the goal for less: each one's cheapest passing fleet costs more.
    best = pol.best
    for label, t in pol.trials.items():
        if t.meets(0.99):
            assert t.cost_usd >= best.cost_usd - 1e-9, label


def test_clairvoyant_reaches_the_goal_ordering_a_lead_time_ahead(bursty):
    pol, _sim, r = bursty["clairvoyant"]
    assert r.extra["reached_goal"] and r.slo_attainment >= 0.99
    assert r.slo_attainment == pytest.approx(pol._best.attainment)  # the search's replay, repeated
    assert r.extra["lead_s"] >= 600  # at least the mean node boot + model load of any GPU flavor
    plan = pol.plan
    needs, lead = plan.needs, plan.lead_s
    rises = [m for m in range(1, len(needs)) if needs[m] > needs[m - 1]]
    assert rises, "the burst needs more replicas than the base load"
    for m in rises:
        first = min(t for t, n in plan.orders if n >= needs[m] and t <= 60 * m)
        assert first <= 60 * m - lead + 1e-9, (m, first, lead)
    # The burst starts at 900 s: its replicas were ordered, and are serving, before it.
    burst_minute = 15
    assert needs[burst_minute] > needs[burst_minute - 2]
    tl = r.timeline
    k = int(np.searchsorted(tl["sample_t_s"], 900.0))
    assert sum(v[k] for v in tl["replicas"].values()) >= needs[burst_minute]
    assert any(t < 900 - lead + 60 and n >= needs[burst_minute] for t, n in plan.orders)


def test_clairvoyant_is_billed_from_launch_and_costs_less_than_static_best(bursty):
    static, clair = bursty["static-best"][2], bursty["clairvoyant"][2]
    assert static.extra["reached_goal"] and static.slo_attainment >= 0.99
    assert clair.cost_usd < static.cost_usd
    # Its nodes are paid for while they boot: node hours exceed the hours replicas served.
    assert clair.idle_node_hours > 0.05
    assert clair.node_hours > clair.accelerator_hours - 1e-9


def test_stock_is_configured_from_the_catalog():
    cat = _with_mix(STEADY)
    pol = StockPolicy()
    r = Simulation(cat, STEADY, pol, SimConfig()).run()
    s = pol.setup
    assert s is not None
    mix = prior_mix(cat, MODEL)
    d = estimate(cat.subset([MODEL]), {MODEL: ModelSignals(MODEL, Freshness.FRESH, 0.0, 1.0, mix)}, None,
                 FORECASTERS["last"], EstimateSettings(target_utilization=1.0))[MODEL]
    per = {f: replica_usd_per_h(cat, MODEL, f, CapacityType.ON_DEMAND) / c.rps
           for f, c in d.capacity.items() if c.rps > 0}
    assert s.flavor == min(per, key=lambda f: per[f])
    assert s.target_ongoing_requests == pytest.approx(0.75 * d.capacity[s.flavor].batch)
    assert s.max_ongoing_requests >= 2 * s.target_ongoing_requests
    assert pol.slot_cap == s.max_ongoing_requests
    assert r.extra["stock_peak_replicas"] < s.max_replicas  # max_replicas never binds here
    assert s.max_replicas >= cat.models[MODEL].max_replicas
    # --stock-target overrides the target, max_ongoing_requests follows at 2x.
    pol2 = StockPolicy(StockConfig(target_ongoing_requests=5.0))
    pol2.configure(cat, MODEL)
    assert pol2.setup is not None and pol2.setup.target_ongoing_requests == 5.0
    assert pol2.setup.max_ongoing_requests == 10


def test_cli_all_prints_the_five_policies(capsys):
    rc = cli_main(["simulate", "--trace", "gen:poisson:rate=2,hours=0.25", "--policy", "all", "--json",
                   "--on-demand-only", "--request-mix", "trace", "--no-progress", "--stock-target", "8"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["policy"] for r in rows] == ["rayscale", "stock", "static-best", "clairvoyant", "fluid-bound"]
    assert list(POLICIES) == [r["policy"] for r in rows]
    by = {r["policy"]: r for r in rows}
    assert by["stock"]["stock_target_ongoing_requests"] == 8.0
    for name in ("static-best", "clairvoyant"):
        assert by[name]["reached_goal"] is True and by[name]["slo_attainment"] >= 0.99
    assert "integer_cost_usd" in by["fluid-bound"] and by["fluid-bound"]["cost_usd"] <= by["clairvoyant"]["cost_usd"]
    for r in rows:
        assert r["requests"] > 0 and r["cost_usd"] > 0 and math.isfinite(r["cost_usd"])


def test_cli_from_cold_starts_every_policy_from_the_same_fleet_unless_told_not_to(capsys):
    """From cold, the bounds obey the same physics as the product: they too start from the shipped step's
    first fleet and wait out a start-up for anything more (--no-same-start: each from its own fleet)."""
    argv = ["simulate", "--trace", "gen:diurnal:base=2,peak=6,hours=0.25,period_h=0.25", "--policy", "static-best",
            "--on-demand-only", "--no-progress"]
    assert cli_main([*argv, "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert cli_main([*argv, "--json", "--no-same-start"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert same["start_fleet"] and "start_fleet" not in own
    # Sized for the first window of a rising load, the shared start is smaller than the fleet static-best
    # holds: it orders the rest at t=0 and waits for it. Its own start has that fleet live at t=0.
    assert same["start_fleet"] != same["fleet"]
    assert same["scale_up_events"] >= 1 and own["scale_up_events"] == 0
    assert cli_main(argv) == 0
    assert f"every policy starts from the same on-demand fleet ({same['start_fleet']})" in capsys.readouterr().out


def test_oracle_is_an_alias_of_fluid_bound():
    tr = load_spec("gen:poisson:rate=1,hours=0.05", seed=0)
    assert simulate(CAT, tr, "oracle").policy == "fluid-bound"
