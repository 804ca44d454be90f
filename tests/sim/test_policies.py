"""Policies behave as specified; determinism; the CLI."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np
import pytest

from rayscale.commands import simulate as simulate_cmd
from rayscale.config import load_catalog
from rayscale.core.settings import Settings
from rayscale.sim.policies import POLICIES, RayscalePolicy, StockConfig, StockPolicy
from rayscale.sim.simulator import SimConfig, Simulation, simulate
from rayscale.sim.sources import TraceSpecError, load_spec
from rayscale.sim.trace import Trace

CAT = load_catalog()


def cli_main(argv: list[str]) -> int:
    # The same parser `rayscale` builds, restricted to this command (works before cli.py lists it).
    parser = argparse.ArgumentParser(prog="rayscale")
    simulate_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)
TRACE = load_spec("gen:bursty:base=2,burst=8,every_s=1200,burst_s=240,hours=0.5", seed=1)


@pytest.fixture(scope="module")
def results():
    return {p: simulate(CAT, TRACE, p, SimConfig(seed=1)) for p in ("rayscale", "stock", "static-peak", "oracle")}


def test_stock_never_leaves_one_flavor(results):
    r = results["stock"]
    flavor = r.extra["stock_flavor"]  # its best single flavor (configured from the catalog)
    assert set(r.timeline["replicas"]) == {flavor}
    sim = Simulation(CAT, TRACE, StockPolicy(StockConfig(flavor="a10g")), SimConfig(seed=1))
    sim.run()
    assert {n.flavor for n in sim.cluster.nodes.values()} == {"a10g"}
    assert {n.capacity_type for n in sim.cluster.nodes.values()} == {"on-demand"}
    assert {n.instance_type for n in sim.cluster.nodes.values()} == {"g5.xlarge"}  # cheapest that fits


def test_oracle_cost_is_a_lower_bound(results):
    o = results["oracle"].cost_usd
    for name, r in results.items():
        assert o <= r.cost_usd + 1e-9, name
    assert results["oracle"].slo_attainment >= 0.99


def test_static_peak_meets_slo_and_never_scales(results):
    r = results["static-peak"]
    assert r.slo_attainment >= 0.99 and r.scale_up_events == 0


def test_summary_keys_and_sanity(results):
    keys = {"policy", "requests", "slo_attainment", "ttft_p95_s", "tpot_p95_s", "cost_usd", "accelerator_hours",
            "idle_node_hours", "failed_requests", "scale_up_events", "wall_s"}
    for r in results.values():
        s = r.summary()
        assert keys <= set(s)
        assert s["requests"] == len(TRACE) and 0 <= s["slo_attainment"] <= 1 and s["cost_usd"] > 0


def test_stock_uses_rays_default_policy_on_the_simulated_clock():
    pol = StockPolicy(StockConfig(target_ongoing_requests=2.0))
    sim = Simulation(CAT, TRACE, pol, SimConfig())
    pol.warm_start(sim)
    pol.target = 2
    # 20 ongoing at target 2 per replica wants 10 replicas, but only after upscale_delay_s (30 s).
    assert pol.decide(1000.0, 20.0, 2) == 2
    assert pol.decide(1015.0, 20.0, 2) == 2
    assert pol.decide(1030.0, 20.0, 2) == 10


def test_deterministic_with_a_seed():
    short = TRACE.window(600, 1200)  # includes a burst
    a = simulate(CAT, short, "rayscale", SimConfig(seed=7)).summary()
    b = simulate(CAT, short, "rayscale", SimConfig(seed=7)).summary()
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b


def test_bad_inputs_name_the_problem(tmp_path):
    with pytest.raises(TraceSpecError, match="unknown generator 'nope'"):
        load_spec("gen:nope")
    with pytest.raises(TraceSpecError, match="'rate'"):
        load_spec("gen:poisson:rate=fast")
    bad = tmp_path / "t.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,abc,3\n")
    with pytest.raises(ValueError, match=r"t\.csv"):
        load_spec(str(bad))
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(CAT, TRACE, "magic")


def test_cli_json_keys(capsys):
    rc = cli_main(["simulate", "--trace", "gen:poisson:rate=2,hours=0.1", "--policy", "all", "--json",
                   "--no-progress"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["policy"] for r in rows] == list(POLICIES)
    for r in rows:
        assert {"policy", "requests", "slo_attainment", "ttft_p95_s", "tpot_p95_s", "cost_usd", "accelerator_hours",
                "idle_node_hours", "failed_requests", "scale_up_events", "wall_s"} <= set(r)


def test_cli_runs_each_policy_named(capsys):
    """--policy repeats: each named policy runs once, in the order given (argparse's default kept only the last)."""
    rc = cli_main(["simulate", "--trace", "gen:poisson:rate=2,hours=0.05", "--policy", "static-best", "--policy",
                   "rayscale", "--policy", "static-best", "--json", "--no-progress"])
    assert rc == 0
    assert [json.loads(line)["policy"] for line in capsys.readouterr().out.splitlines()] == ["static-best", "rayscale"]


def test_cli_says_loudly_when_requests_are_rejected(capsys, tmp_path):
    """A prompt over the model's context is refused as vLLM refuses it: counted apart, in a column and a warning."""
    rows = "".join(f"{2.0 * i},{40000 if i % 10 == 0 else 600},100\n" for i in range(300))
    (tmp_path / "t.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    assert cli_main(["simulate", "--trace", str(tmp_path / "t.csv"), "--model", "mistral-7b", "--policy",
                     "rayscale", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "WARNING: 30 of 300 scored requests (10.0%) were rejected" in out
    assert " rejected " in out.splitlines()[1]
    assert cli_main(["simulate", "--trace", "gen:poisson:rate=2,hours=0.05", "--policy", "rayscale",
                     "--no-progress"]) == 0
    assert "WARNING" not in capsys.readouterr().out


def test_cli_errors(capsys, tmp_path):
    assert cli_main(["simulate", "--trace", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv" in capsys.readouterr().err
    assert cli_main(["simulate", "--trace", "gen:poisson", "--model", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


def test_signals_count_completions_and_prefill_time_per_flavor():
    sim = Simulation(CAT, TRACE.window(0, 900), StockPolicy(), SimConfig(seed=1))
    sim.run()
    now = max(t for t, _ in sim._done)
    done = np.concatenate([d for t, d in sim._done if t >= now - sim.cfg.signal_window_s])
    eng = sim.engine
    obs = sim.signals(now).per_flavor
    assert obs
    for f, o in obs.items():
        sel = done[eng.flavor_of[done] == sim.flavors.index(f)]
        assert o.completed == len(sel)
        prefill = eng.ttft[sel] - eng.queue_s[sel]  # TTFT without the wait for a replica
        assert o.prefill_mean_s == pytest.approx(float(prefill.mean()), rel=1e-6)
        assert (prefill > 0).all() and (eng.queue_s[sel] >= 0).all()
    # What the fleet delivered over the window, as the controller reads it from the TTFT and TPOT histograms
    # (a request missing both counts twice): never above the share the result counts.
    sig, slo = sim.signals(now), sim.spec.slo
    ttft_ok, tpot_ok = eng.ttft[done] <= slo.ttft_p95_s, (sim.output[done] <= 1) | (eng.tpot[done] <= slo.tpot_p95_s)
    assert sig.finished == len(done)
    assert sig.slo_met == pytest.approx(max(ttft_ok.mean() - (1 - tpot_ok.mean()), 0.0))
    assert sig.slo_met is not None and sig.slo_met <= (ttft_ok & tpot_ok).mean() + 1e-12


def test_signals_report_each_flavors_kv_cache_in_use():
    """Mid-run, a flavor's KV usage is the whole prompt + answer of every request in flight on its live
    replicas over their caches (the engine reserves both at admission)."""
    sim = Simulation(CAT, TRACE.window(0, 900), StockPolicy(), SimConfig(seed=1))
    sim.begin()
    while sim.now < 300.0:
        sim.tick()
    eng, obs = sim.engine, sim.signals(sim.now).per_flavor
    assert obs
    for f, o in obs.items():
        i = sim.flavors.index(f)
        alive = np.flatnonzero(eng.p_tfirst[: eng.m] != np.inf)
        mine = alive[eng.r_flavor[eng.p_rep[alive]] == i]
        live = (eng.r_flavor[: eng.nr] == i) & (eng.r_state[: eng.nr] != 2)
        held = (sim.prompt[eng.p_req[mine]] + sim.output[eng.p_req[mine]]).sum()
        assert held > 0
        assert o.kv_usage == pytest.approx(held / eng.r_kvcap[: eng.nr][live].sum())


def test_warmup_scores_only_later_requests_and_later_cost(results):
    # static-peak runs one fleet from t=0 to the end: cost after the warm-up is that fleet for the rest.
    full = results["static-peak"]
    w = 600.0
    r = simulate(CAT, TRACE, "static-peak", SimConfig(seed=1, warmup_s=w))
    assert r.requests == int((TRACE.arrival_s >= w).sum()) < len(TRACE)
    assert r.extra["requests_warmup"] == int((TRACE.arrival_s < w).sum())
    assert r.cost_usd == pytest.approx(full.cost_usd * (r.sim_s - w) / r.sim_s, rel=0.02)
    assert r.scale_up_events == 0
    # The oracle's bound and its integer plan both count from the warm-up on.
    o = simulate(CAT, TRACE, "oracle", SimConfig(seed=1, warmup_s=w))
    assert o.cost_usd < results["oracle"].cost_usd
    assert o.extra["integer_cost_usd"] < results["oracle"].extra["integer_cost_usd"]
    assert o.extra["warmup_s"] == w
    with pytest.raises(ValueError, match="warmup_s 1e"):
        simulate(CAT, TRACE, "static-peak", SimConfig(warmup_s=1e6))


def test_cli_warmup_pass_scores_the_second_pass(capsys):
    argv = ["simulate", "--trace", "gen:poisson:rate=2,hours=0.1", "--policy", "static-peak", "--json",
            "--no-progress"]
    assert cli_main(argv) == 0
    one = json.loads(capsys.readouterr().out)
    assert cli_main([*argv, "--repeat", "2", "--warmup", "pass"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["requests"] == one["requests"] == two["requests_warmup"]
    assert cli_main([*argv, "--warmup", "pass"]) == 2
    assert "--warmup pass needs --repeat" in capsys.readouterr().err
    assert cli_main([*argv, "--warmup", "soon"]) == 2
    assert "--warmup: expected seconds or 'pass', got 'soon'" in capsys.readouterr().err


def test_the_mix_reaches_back_to_enough_requests_and_no_further():
    """At 2 req/s a 30 s window holds ~60 requests, too few for the tail quantiles the estimator reads:
    prompts come from the last k arrivals and outputs from the last k to finish, within mix_max_s."""
    k = 200
    seen: list[tuple[float, float, int, int]] = []  # (prompt mean wide, narrow, window lo, hi)

    class Probe(StockPolicy):
        def control(self, now: float, sim: Simulation) -> None:
            super().control(now, sim)
            if seen or now < 600:
                return
            lo, hi = sim._count(now - 30, now)
            assert 0 < hi - lo < k
            mix = sim.signals(now).mix
            assert mix is not None
            assert mix.prompt_mean == pytest.approx(sim.prompt[hi - k:hi].mean())
            finished = np.concatenate([d for _, d in sim._done])[-k:]
            assert len(finished) == k
            assert mix.output_mean == pytest.approx(max(float(sim.output[finished].mean()), 1.0))
            # Never past mix_max_s: 30 s back it is the window's own requests again, as with k = 0.
            cfg = sim.cfg
            sim.cfg = replace(cfg, settings=replace(cfg.settings, mix_max_s=30.0))
            short = sim.signals(now).mix
            sim.cfg = replace(cfg, settings=replace(cfg.settings, mix_min_requests=0))
            narrow = sim.signals(now).mix
            sim.cfg = cfg
            assert short is not None and narrow is not None
            assert short.prompt_mean == narrow.prompt_mean == pytest.approx(sim.prompt[lo:hi].mean())
            seen.append((mix.prompt_mean, narrow.prompt_mean, lo, hi))

    Simulation(CAT, TRACE.window(0, 900), Probe(), SimConfig(seed=1, settings=Settings(mix_min_requests=k, mix_max_s=600))).run()
    assert seen and seen[0][0] != seen[0][1]


def test_each_policy_runs_the_prefill_chunk_it_would_deploy(capsys: pytest.CaptureFixture[str]) -> None:
    """rayscale's replicas run the chunk it picks for the declared mix, and so does the stock stack unless
    configured with vLLM's default."""
    from rayscale.core.catalog import RequestMixSpec
    from rayscale.core.chunk import choose_chunks
    from rayscale.sim.policies import make_policy

    code = CAT.with_request_mix("mistral-7b", RequestMixSpec(prompt_mean=2048, output_mean=28, prompt_p95=7305))
    chosen = choose_chunks(code.subset(["mistral-7b"]))
    assert chosen[("mistral-7b", "l40s")] < 2048
    tr = load_spec("gen:poisson:rate=6,hours=0.05", seed=0)
    for name in ("rayscale", "stock", "stock-untuned"):
        pol = StockPolicy(StockConfig(tuned_chunk=False)) if name == "stock-untuned" else make_policy(name)
        sim = Simulation(code, tr, pol, SimConfig())
        sim.run()
        eng = sim.engine
        assert eng.nr > 0
        for r in range(eng.nr):
            flavor = sim.flavors[int(eng.r_flavor[r])]
            want = 2048 if name == "stock-untuned" else chosen[("mistral-7b", flavor)]
            assert eng.r_chunk[r] == want, (name, flavor)
    # The CLI declares the mix: 'trace' or numbers; a bad value names the flag and changes nothing.
    spec = "gen:poisson:rate=1,hours=0.01"
    assert simulate_cmd_main(["simulate", "--trace", spec, "--request-mix", "100,x"]) == 2
    assert "--request-mix: expected 'trace' or PROMPT_MEAN,OUTPUT_MEAN[,PROMPT_P95]" in capsys.readouterr().err
    assert simulate_cmd_main(["simulate", "--trace", spec, "--request-mix", "100,-2"]) == 2
    assert "output_mean: Input should be greater than 0" in capsys.readouterr().err
    assert simulate_cmd_main(["simulate", "--trace", spec, "--request-mix", "trace", "--policy", "rayscale",
                              "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["policy"] == "rayscale"


def simulate_cmd_main(argv: list[str]) -> int:
    from rayscale.cli import main

    return main(argv)


def test_signals_carry_arrivals_per_period_over_the_last_hour():
    tr = load_spec("gen:poisson:rate=3,hours=1.5", seed=2)
    sim = Simulation(CAT, tr, StockPolicy(), SimConfig())
    now = 4000.0  # the counts end at the last whole minute, 3,960 s
    counts = sim.arrival_counts(now)
    assert len(counts) == 720 and sim.signals(now).arrival_bin_s == 5.0
    lo, hi = sim.count_arrivals(3960.0 - 3600.0, 3960.0)
    assert sum(counts) == hi - lo
    assert counts[-1] == np.diff(sim.count_arrivals(3955.0, 3960.0))[0]
    assert sim.arrival_counts(4019.0) is counts and sim.arrival_counts(4020.0) != counts
    assert len(sim.arrival_counts(130.0)) == 24  # no bins before t=0


def test_the_burst_floor_holds_capacity_for_bursts_within_the_minute(capsys, tmp_path):
    # 10-s bursts at 40 req/s every 2 min over 1 req/s: each is over before capacity could start for it.
    # SLO feedback off in both runs: a factor that rises faster buys back part of what the floor holds, and this
    # is the floor's own effect.
    no_feedback = tmp_path / "settings.yaml"
    no_feedback.write_text("feedback:\n  enabled: false\n")
    argv = ["simulate", "--trace", "gen:bursty:base=1,burst=40,every_s=120,burst_s=10,hours=0.5", "--repeat", "2",
            "--warmup", "pass", "--request-mix", "trace", "--policy", "rayscale", "--json", "--no-progress",
            "--settings", str(no_feedback)]
    runs = {}
    for flag in ("--burst-floor", "--no-burst-floor"):
        assert cli_main([*argv, flag]) == 0
        runs[flag] = json.loads(capsys.readouterr().out)
    on, off = runs["--burst-floor"], runs["--no-burst-floor"]
    # 99.26% at $2.99 with it, 98.19% at $4.40 without: the SLO met only with the floor, and for less (without
    # it the fleet chases each burst with replicas that start after it).
    assert on["slo_attainment"] >= 0.99 > off["slo_attainment"]
    assert on["ttft_p95_s"] < off["ttft_p95_s"]
    assert on["cost_usd"] < off["cost_usd"]


def test_a_restarted_controller_keeps_the_fleet_serving_and_reads_its_checkpoint_back():
    """A restart never loses the cluster: the fleet it reads back keeps serving. With the checkpoint lost the
    step's state (rate history, SLO feedback's record) starts again; read back, it goes on where it was."""
    tr = load_spec("gen:poisson:rate=4,hours=1", seed=3)
    plain = RayscalePolicy()
    blind = RayscalePolicy(restart_at_s=1800.0, checkpoint_every_s=None)
    restored = RayscalePolicy(restart_at_s=1800.0)
    a = simulate(CAT, tr, plain, SimConfig(seed=3))
    b = simulate(CAT, tr, blind, SimConfig(seed=3))
    c = simulate(CAT, tr, restored, SimConfig(seed=3))
    assert blind.restart_at_s is None and restored.restart_at_s is None  # both did restart
    assert b.failed_requests == 0 and b.slo_attainment > 0.98
    after = b.timeline["sample_t_s"] > 1800.0
    assert sum(v[after] for v in b.timeline["replicas"].values()).min() > 0
    model = SimConfig().model
    assert blind.state.delivered[model].requests < 0.6 * plain.state.delivered[model].requests
    assert len(blind.state.rate_history[model]) < 0.6 * len(plain.state.rate_history[model])
    assert abs(b.cost_usd - a.cost_usd) < 0.1 * a.cost_usd
    # the checkpoint of its last period: the record and the history carry on
    assert restored.state.delivered[model].requests > 0.95 * plain.state.delivered[model].requests
    assert len(restored.state.rate_history[model]) >= len(plain.state.rate_history[model]) - 1
    assert (c.slo_attainment, c.cost_usd) == pytest.approx((a.slo_attainment, a.cost_usd), rel=0.01)


@pytest.mark.parametrize("fast_window_s", [None, 10.0])
def test_the_simulator_reads_the_arrival_rate_as_the_controller_does(fast_window_s):
    """A step from 0.5 to 3 req/s: the simulated signals' rate is what rayscale.signals.window.aggregate
    reads from counters scraped once a period over the same arrivals (with the fast window, the step shows
    within its 10 s; without, diluted over the 30 s window)."""
    from rayscale.core.signals import Freshness
    from rayscale.signals.window import Scrape, aggregate
    from tests.signals.test_window import _rep

    arrivals = np.concatenate([np.arange(0.0, 60.0, 2.0), 60.0 + np.arange(0.0, 30.0, 1 / 3)])
    n = len(arrivals)
    tr = Trace.from_arrays(arrivals, np.full(n, 100), np.full(n, 10))
    settings = replace(Settings(), fast_window_s=fast_window_s)
    sim = Simulation(CAT, tr, StockPolicy(), SimConfig(settings=settings))
    for now in (65.0, 70.0, 80.0, 90.0):
        ts = np.arange(now - settings.window_s, now + 1e-9, settings.period_s)
        scrapes = [Scrape(t, _rep("mistral-7b", "a10g", "r1", t, (c := float(np.searchsorted(arrivals, t))), c, 0, {}))
                   for t in ts]
        read = aggregate(scrapes, now, settings.window_s, settings.stale_after_s,
                         fast_window_s=settings.fast_window_s)["mistral-7b"]
        assert read.freshness == Freshness.FRESH
        assert sim.signals(now).arrival_rate_rps == pytest.approx(read.arrival_rate_rps), now
    # the step 10 s in: the fast window reads the new rate, the whole window a third of the way there
    expected = 3.0 if fast_window_s else (3.0 * 10 + 0.5 * 20) / 30
    assert sim.signals(70.0).arrival_rate_rps == pytest.approx(expected, rel=0.05)


def _inf2_share(routing: str) -> tuple[float, float]:
    """(share of requests an inf2 served beside an L40S, that share by the ingress's weights) for 2,000-token
    prompts at 2 req/s on a fixed fleet of one each."""
    from rayscale.sim.baselines import FleetPolicy, on_demand_only
    from rayscale.sim.engine import DONE, EngineConfig

    cat = on_demand_only(CAT.subset(["qwen2-7b"]))
    tr = load_spec("gen:poisson:rate=2,hours=0.25,prompt=2000,output=150", seed=0)
    fleet = {("l40s", "on-demand"): 1, ("inf2", "on-demand"): 1}
    sim = Simulation(cat, tr, FleetPolicy(fleet), SimConfig(model="qwen2-7b", engine=EngineConfig(routing=routing)))
    sim.run()
    done = sim.engine.status == DONE
    cap = sim.guessed_capacity()
    served = float(np.mean(sim.engine.flavor_of[done] == sim.flavors.index("inf2")))
    return served, cap["inf2"] / (cap["inf2"] + cap["l40s"])


def test_a_mixed_fleet_is_routed_by_the_ingress_weights():
    # rayscale's ingress draws a flavor by its weight (replicas serving x per-replica capacity), so the inf2
    # serves its capacity's share; one queue to the least-loaded replica of any flavor hands it far more.
    served, weighted = _inf2_share("flavor-weights")
    assert abs(served - weighted) < 0.04
    least_loaded, _ = _inf2_share("least-loaded")
    assert least_loaded > weighted + 0.1


def test_the_product_routes_by_its_own_weights_in_simulation():
    from rayscale.core.route import flavor_weights

    policy = RayscalePolicy()
    sim = Simulation(CAT, load_spec("gen:poisson:rate=3,hours=0.25", seed=2), policy, SimConfig(seed=2))
    sim.run()
    assert policy.last is not None and sim.engine.flavor_w is not None
    serving = {(sim.model, f): n for f, n in sim.cluster.live_by_flavor().items()}
    want = flavor_weights(serving, dict(policy.last.demands))[sim.model]
    assert sum(want.values()) > 0
    assert sim.engine.flavor_w.tolist() == [want.get(f, 0.0) for f in sim.flavors]
