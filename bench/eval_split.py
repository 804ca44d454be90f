"""The product on traffic it was not tuned on, against baselines an operator would run and a lead-time bound.

    .venv/bin/python -m bench.eval_split [--seeds 0,1,2,3,4] [--jobs 2] [--split both|dev|held-out|shapes|models]
                                         [--case TEXT] [--flavor F] [--engine fluid|iteration] [--policy P]
                                         [--mode both|steady|cold] [--draws 1] [--out bench/results/eval_split.md]

Every policy runs in the same simulator, on the same cloud draws, start-up times and prefill-chunk rules:

- ``rayscale``: the shipped product (``rayscale.core.step.step`` with rayscale/data/settings.yaml);
- ``stock``: Ray Serve's own autoscaling policy on the model's best single flavor, configured as an operator
  would (rayscale.sim.policies.StockPolicy documents the procedure);
- ``static-best``: the cheapest fixed fleet that reaches the SLO goal, found by replaying the scored traffic
  (hindsight: a bound on what a fixed fleet can do, not a policy one could run);
- ``clairvoyant``: knows the future arrivals, orders capacity its start-up time ahead, billed from launch,
  and reaches the same SLO goal by replay: the bound rayscale is measured against;
- ``fluid-bound``: fractional replicas on instant nodes (cost only; no SLO claim).

No hindsight for the product: no request mix is declared (it is learned online; ``rayscale+mix`` is the
product with a ``request_mix`` declared from another draw of the same traffic, as an operator would write
it from yesterday's logs, which also picks each flavor's prefill chunk), seeds draw new arrivals
(trace files are resampled per seed, ``Trace.resample``), and steady state warms up on another draw of the
same traffic (seed + 1000; with ``--draws N``, N draws, rayscale.sim.sources.with_warmup_draw) before the
scored one. On-demand capacity only (spot is reported apart).
``rayscale, restarted`` (steady state only): the product whose controller restarted 30 min before scoring,
the cluster unchanged; as the controller does, it reads back the checkpoint it saved in its last period
(rate history, corrections, SLO feedback's record; rayscale.core.checkpoint). ``rayscale, restarted blind``:
the same restart with the checkpoint lost.

Splits: ``dev`` is the traffic the shipped settings were tuned on (bench/results/sim_policies.md,
burst_floor.md, scale_down_moves.md, tune*.md); ``held-out`` is traffic no setting was ever tried on. The two
generated chat cases (4 to 8 req/s, 1,000-token prompts, 250-token answers) joined dev when they showed SLO
feedback sizing a slow ramp at its full modelled capacity (bench/results/tune_floor.md, tune_young.md). The
generated fast ramp (2 to 16 req/s over an hour, 800-token prompts, 150-token answers) joined dev after the
held-out fast day rejected a floor the dev split had chosen (bench/results/eval_split_floor_sharp.md): it was
made, and first run, after the held-out fast day showed the trend's lag from cold, so it resembles that day.
The generated long-prompt day (1 to 6 req/s over 90 min, 4,000-token prompts, 500-token answers) joined dev
from ``shapes`` after it showed SLO feedback cancelling the forecast's lead on a rise (bench/results/tune_rise.md).
The generated minute bursts (45-s bursts of 10 req/s over 1.5 every 10 min, 2,000-token prompts, 400-token
answers) joined dev after the held-out spiky traffic's timeline showed Holt's trend carrying each minute-long
burst a horizon ahead (bench/results/tune_spikes.md): made, and first run, after that timeline was read, so it
resembles that traffic.
``shapes`` (not in ``both``; ``--split shapes --out bench/results/eval_shapes.md``) are plain generated loads a
user would try first (constant rates from 0.2 to 30 req/s, needle bursts, long answers): made and first run
after the shipped settings were chosen, never tuned on; the tune's dev split does not include them.
``models`` (not in ``both``; ``--split models --out bench/results/eval_models.md``) serve the catalog's other
models, one at a time: the 72B (a multi-GPU replica, minutes-long start-ups, few replicas) on a rising day and
a morning, qwen2-7b on 2-min bursts and on a level load one L40S just carries. Made and first run after the
shipped settings were chosen, never tuned on.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import ROOT, machine, span
from rayscale.config import load_catalog
from rayscale.core.catalog import Catalog
from rayscale.sim.baselines import on_demand_only
from rayscale.sim.engine import EngineConfig
from rayscale.sim.policies import POLICIES, RayscalePolicy
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.sim.sources import WARMUP_SEED_OFFSET, load_spec, with_warmup_draw
from rayscale.sim.trace import Trace

MODEL = "mistral-7b"
DECLARED = "rayscale+mix"  # the product with a request_mix declared from another draw of the traffic
RESTARTED = "rayscale, restarted"  # steady state only: the controller restarted 30 min before scoring
BLIND = "rayscale, restarted blind"  # ... and its checkpoint was lost
RESTART_BEFORE_S = 1800.0  # the restarted controller's state is lost this long before scoring
TRACES = ROOT.parent / "shared" / "traces"
# (split, label, trace spec, time scale, rate scale)
CASES: list[tuple[str, str, str, float, float]] = [
    ("dev", "Azure code x3", str(TRACES / "azure_llm_2023_code.csv"), 1.0, 3.0),
    ("dev", "diurnal 6 h", "gen:diurnal:base=1,peak=12,hours=6,period_h=6", 1.0, 1.0),
    ("dev", "bursty 4 h", "gen:bursty:base=2,burst=12,every_s=1800,burst_s=300,hours=4", 1.0, 1.0),
    ("dev", "chat 1 h", "gen:diurnal:base=4,peak=8,hours=1,period_h=2,prompt=1000,output=250", 1.0, 1.0),
    ("dev", "chat ramp 2 h", "gen:diurnal:base=4,peak=8,hours=2,period_h=4,prompt=1000,output=250", 1.0, 1.0),
    ("dev", "fast ramp 2 h", "gen:diurnal:base=2,peak=16,hours=2,period_h=2,prompt=800,output=150", 1.0, 1.0),
    ("dev", "long prompts day 3 h",
     "gen:diurnal:base=1,peak=6,hours=3,period_h=3,prompt=4000,output=500", 1.0, 1.0),
    ("dev", "minute bursts 2 h",
     "gen:bursty:base=1.5,burst=10,every_s=600,burst_s=45,hours=2,prompt=2000,output=400", 1.0, 1.0),
    ("held-out", "Mooncake 1 h (long prompts)", str(TRACES / "mooncake_synthetic.jsonl"), 3.5, 1.0),
    ("held-out", "spiky 2 h, long answers",
     "gen:bursty:base=1,burst=8,every_s=420,burst_s=60,hours=2,prompt=3000,output=300", 1.0, 1.0),
    ("held-out", "fast day 3 h", "gen:diurnal:base=2,peak=20,hours=3,period_h=1.5,prompt=600,output=200", 1.0, 1.0),
    ("shapes", "steady 3 req/s 2 h", "gen:poisson:rate=3,hours=2", 1.0, 1.0),
    ("shapes", "steady 30 req/s 1 h", "gen:poisson:rate=30,hours=1", 1.0, 1.0),
    ("shapes", "trickle 0.2 req/s 2 h", "gen:poisson:rate=0.2,hours=2", 1.0, 1.0),
    ("shapes", "needle bursts 2 h", "gen:bursty:base=3,burst=30,every_s=600,burst_s=20,hours=2", 1.0, 1.0),
    ("shapes", "long answers 2 h", "gen:poisson:rate=4,hours=2,prompt=500,output=1000", 1.0, 1.0),
    ("models", "72B day 2 h", "gen:diurnal:base=0.3,peak=2,hours=2,period_h=2,prompt=1500,output=300", 1.0, 1.0),
    ("models", "72B morning 1 h", "gen:diurnal:base=0.2,peak=1,hours=1,period_h=2,prompt=1000,output=300", 1.0, 1.0),
    ("models", "qwen2-7b 2-min bursts 2 h",
     "gen:bursty:base=3,burst=10,every_s=900,burst_s=120,hours=2,prompt=1200,output=200", 1.0, 1.0),
    ("models", "qwen2-7b steady 2 req/s 1 h", "gen:poisson:rate=2,hours=1,prompt=2000,output=150", 1.0, 1.0),
]
# The catalog model a case serves, where it is not MODEL.
CASE_MODELS = {"72B day 2 h": "qwen2-72b", "72B morning 1 h": "qwen2-72b", "qwen2-7b 2-min bursts 2 h": "qwen2-7b",
               "qwen2-7b steady 2 req/s 1 h": "qwen2-7b"}


def model_of(case: int) -> str:
    return CASE_MODELS.get(CASES[case][1], MODEL)


def case_run(case: int, seed: int, steady: bool, flavors: tuple[str, ...] = (),
             draws: int = 1) -> tuple[Catalog, Trace, float]:
    """The catalog (restricted to ``flavors`` where any are named), the ``seed``-th draw of a case's traffic
    and its unscored warm-up (steady state: after ``draws`` other draws of the same traffic; from cold: none)."""
    _, _, spec, ts, rs = CASES[case]
    cat = on_demand_only(load_catalog().subset([model_of(case)], list(flavors) or None))
    if steady:
        trace, warm = with_warmup_draw(spec, seed, ts, rs, draws=draws)
        return cat, trace, warm
    return cat, load_spec(spec, seed, ts, rs, resample=True), 0.0


def one(case: int, seed: int, steady: bool, flavors: tuple[str, ...] = (), engine: str = "fluid",
        only: tuple[str, ...] = (), draws: int = 1) -> list[dict[str, Any]]:
    """Every policy (or those named in ``only``) on one draw of a case, on the ``engine`` model; steady state
    warmed up on ``draws`` other draws."""
    _, label, spec, ts, rs = CASES[case]
    model = model_of(case)
    cat, trace, warm = case_run(case, seed, steady, flavors, draws)
    cfg = SimConfig(model=model, seed=seed, warmup_s=warm, same_start=not steady, engine=EngineConfig(model=engine))
    # What an operator could declare before this traffic: the request shape of another day (another draw).
    prior = load_spec(spec, seed + 2 * WARMUP_SEED_OFFSET, ts, rs, resample=True).request_mix()
    runs: list[tuple[str, Catalog, str | RayscalePolicy]] = [(name, cat, name) for name in POLICIES]
    runs.append((DECLARED, cat.with_request_mix(model, prior), "rayscale"))
    if steady:  # reading back its checkpoint, and with it lost; the cluster unchanged
        runs.append((RESTARTED, cat, RayscalePolicy(restart_at_s=warm - RESTART_BEFORE_S)))
        runs.append((BLIND, cat, RayscalePolicy(restart_at_s=warm - RESTART_BEFORE_S, checkpoint_every_s=None)))
    runs = [r for r in runs if not only or r[0] in only]
    out: list[dict[str, Any]] = []
    for name, catalog, policy in runs:
        t0 = time.perf_counter()
        r = simulate(catalog, trace, policy, cfg)
        out.append({"case": case, "seed": seed, "steady": steady, "policy": name, "slo": r.slo_attainment,
                    "usd": r.cost_usd, "rejected": r.rejected_requests, "requests": r.requests,
                    "ups": r.scale_up_events, "wall": time.perf_counter() - t0,
                    "reached": r.extra.get("reached_goal")})
    by_policy: dict[str, dict[str, Any]] = {r["policy"]: r for r in out}
    print(f"  {label} seed={seed} {'steady' if steady else 'cold'}: " + ", ".join(
        f"{p} {100 * r['slo']:.2f}% ${r['usd']:.2f}" for p, r in by_policy.items()), flush=True)
    return out


def table(rows: list[dict[str, Any]], steady: bool) -> str:
    from rayscale.tables import format_table

    out: list[list[Any]] = []
    for case, (split, label, *_rest) in enumerate(CASES):
        sel = [r for r in rows if r["case"] == case and r["steady"] == steady]
        if not sel:
            continue
        cv = {r["seed"]: r["usd"] for r in sel if r["policy"] == "clairvoyant"}
        sb = {r["seed"]: r["usd"] for r in sel if r["policy"] == "static-best"}
        for p in (*POLICIES, DECLARED, RESTARTED, BLIND):
            pr = [r for r in sel if r["policy"] == p]
            if not pr:
                continue
            vs_cv = [r["usd"] / cv[r["seed"]] for r in pr if cv.get(r["seed"])]
            vs_sb = [r["usd"] / sb[r["seed"]] for r in pr if sb.get(r["seed"])]
            out.append([split, label, p, len(pr), span([r["slo"] for r in pr], True), span([r["usd"] for r in pr], False),
                        f"{statistics.mean(vs_cv):.2f}x" if vs_cv and p != "fluid-bound" else "-",
                        f"{statistics.mean(vs_sb):.2f}x" if vs_sb and p != "fluid-bound" else "-",
                        round(statistics.mean(r["rejected"] for r in pr))])
    return format_table(["split", "traffic", "policy", "seeds", "SLO min/mean/max", "$ min/mean/max",
                         "$ vs clairvoyant", "$ vs static-best", "rejected"], out)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({r["case"] for r in rows})
    fig, axes = plt.subplots(2, len(cases), figsize=(3.6 * len(cases), 6.6), squeeze=False)
    colors = {"rayscale": "tab:red", DECLARED: "tab:orange", RESTARTED: "tab:purple", BLIND: "violet", "stock": "tab:blue", "static-best": "tab:gray", "clairvoyant": "k",
              "fluid-bound": "tab:green"}
    for j, case in enumerate(cases):
        for i, steady in enumerate((False, True)):
            ax = axes[i][j]
            for p, c in colors.items():
                sel = [r for r in rows if r["case"] == case and r["steady"] == steady and r["policy"] == p]
                if p == "fluid-bound":
                    for r in sel:
                        ax.axvline(r["usd"], color=c, lw=0.5, alpha=0.5)
                    continue
                ax.scatter([r["usd"] for r in sel], [100 * r["slo"] for r in sel], s=18, color=c, label=p)
            ax.axhline(99.0, color="k", lw=0.5, ls="--")
            ax.set_title(f"{CASES[case][1]} ({'steady' if steady else 'cold'})", fontsize=8)
            ax.set_xlabel("cost $", fontsize=8)
            ax.set_ylabel("SLO attainment %", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--split", choices=["both", "dev", "held-out", "shapes", "models"], default="both")
    ap.add_argument("--case", default="", help="only the split's cases whose label holds this text")
    ap.add_argument("--flavor", action="append", default=[], help="restrict the catalog to this flavor (repeatable)")
    ap.add_argument("--engine", choices=["fluid", "iteration"], default="fluid",
                    help="the simulator's engine model (iteration: vLLM V1's scheduler one iteration at a time)")
    ap.add_argument("--policy", action="append", default=[], choices=[*POLICIES, DECLARED, RESTARTED, BLIND],
                    help="run only this policy (repeatable)")
    ap.add_argument("--mode", choices=["both", "steady", "cold"], default="both")
    ap.add_argument("--draws", type=int, default=1, help="draws of the traffic the steady state warms up on")
    ap.add_argument("--out", default="bench/results/eval_split.md")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    cases = [i for i, c in enumerate(CASES) if (c[0] == args.split or (args.split == "both" and c[0] in ("dev", "held-out")))
             and args.case in c[1]]
    modes = {"both": (False, True), "steady": (True,), "cold": (False,)}[args.mode]
    jobs = [(c, s, st, tuple(args.flavor), args.engine, tuple(args.policy), args.draws) for c in cases
            for s in seeds for st in modes]
    print(f"{len(jobs)} runs of {len(args.policy) or len(POLICIES)} policies on {args.jobs} processes", flush=True)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = [r for part in pool.map(one, *zip(*jobs, strict=True)) for r in part]
    wall = time.perf_counter() - t0
    out = Path(args.out)
    plot(rows, out.with_suffix(".png"))
    only = ("".join(f" --flavor {f}" for f in args.flavor) + (f" --case '{args.case}'" if args.case else "")
            + (f" --engine {args.engine}" if args.engine != "fluid" else "")
            + "".join(f" --policy {p}" for p in args.policy) + (f" --mode {args.mode}" if args.mode != "both" else "")
            + (f" --draws {args.draws}" if args.draws != 1 else ""))
    text = (f"# Evaluation: the shipped product on dev and held-out traffic\n\n{machine()}; "
            f"`python -m bench.eval_split --seeds {args.seeds} --split {args.split}{only}` ({wall:.0f} s on {args.jobs} "
            f"processes); model {', '.join(sorted({model_of(c) for c in cases}))}, shipped catalog"
            f"{' (only ' + ', '.join(args.flavor) + ')' if args.flavor else ''}, on-demand only, {args.engine} engine.\n\n"
            + __doc__.split("\n\n", 2)[2] + f"\n## Steady state (warmed up on {args.draws} other draw{'s' if args.draws > 1 else ''})\n\n```\n"
            + table(rows, True) + "\n```\n\n## From cold (every policy starts from the same fleet: what the "
            "shipped step orders for the first 30 s)\n\nA bound that cannot reach the goal from there reports its best-attaining configuration "
            "(its cost is then no bound).\n\n"
            "```\n" + table(rows, False) + f"\n```\n\n![cost vs SLO per seed]({out.with_suffix('.png').name})\n")
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
