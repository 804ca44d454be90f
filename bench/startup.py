"""How much the start-up time matters, and what the fast-start choices are worth.

    .venv/bin/python -m bench.startup [--seeds 0,1,2] [--totals 120,300,600] [--jobs 2] [--write]

Every start-up part (node boot, image pull, weight load, engine start; rayscale/data/*.yaml, docs/startup.md)
is scaled by one factor so the median cold start-up of the catalog's offerings is the given total
(``Catalog.with_startup_total``); then the run is repeated with the fast-start choices on
(``FastStart``: every node's data volume restored from a snapshot holding the serving image, weights streamed
from S3 by vLLM's Run:ai streamer), which replace the pull and weight-load parts by their published fast
variants (``rayscale.core.catalog.startup_parts``). The planner, the launch timeout and the simulator all read
the start-up the choices imply. A replica on a node that served before skips the pull in every run.

Policies (public entry points, as bench.eval_split runs them): ``rayscale`` (the shipped product),
``static-best`` (the cheapest fixed fleet that reaches the SLO goal by replay of the scored traffic) and
``clairvoyant`` (knows future arrivals, orders capacity its start-up ahead, billed from launch). On-demand only,
model mistral-7b on the shipped catalog. Scenarios: ``bursty`` (steady state: warmed up on another draw of the
same traffic) and ``from cold`` (a ramp from a low rate to a peak, no warm-up: every policy starts from the
fleet it has at t=0).
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from bench.common import ROOT, machine, span
from rayscale.config import load_catalog
from rayscale.core.catalog import AcceleratorKind, Catalog, FastStart, WeightSource
from rayscale.sim.baselines import on_demand_only
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.sim.sources import load_spec, with_warmup_draw

MODEL = "mistral-7b"
POLICIES = ("rayscale", "static-best", "clairvoyant")
# (label, trace spec, steady: warmed up on another draw)
SCENARIOS: list[tuple[str, str, bool]] = [
    ("bursty", "gen:bursty:base=2,burst=12,every_s=1800,burst_s=300,hours=2", True),
    ("from cold", "gen:diurnal:base=0.5,peak=12,hours=1.5,period_h=3", False),
]
# The deployment's fast-start choices; the ids only name what `rayscale render` would write.
FAST = FastStart(image_snapshots={AcceleratorKind.GPU: "snap-0123456789abcdef0",
                                  AcceleratorKind.NEURON: "snap-0123456789abcdef1"},
                 weights=WeightSource.STREAM, weights_uri="s3://rayscale-weights/models")


def catalog_for(total_s: float, fast: bool) -> Catalog:
    cat = on_demand_only(load_catalog().subset([MODEL])).with_startup_total(total_s)
    return cat.with_fast_start(FAST) if fast else cat


def effective_start_s(cat: Catalog) -> float:
    """The median launch-to-serving time of the model's offerings under the catalog's choices."""
    return statistics.median(cat.startup(MODEL, f).total_s for f in cat.models[MODEL].parallelism)


def one(scenario: int, total_s: float, fast: bool, seed: int) -> list[dict[str, Any]]:
    label, spec, steady = SCENARIOS[scenario]
    cat = catalog_for(total_s, fast)
    if steady:
        trace, warm = with_warmup_draw(spec, seed)
    else:
        trace, warm = load_spec(spec, seed, resample=True), 0.0
    cfg = SimConfig(model=MODEL, seed=seed, warmup_s=warm)
    out: list[dict[str, Any]] = []
    for policy in POLICIES:
        t0 = time.perf_counter()
        r = simulate(cat, trace, policy, cfg)
        out.append({"scenario": scenario, "total": total_s, "fast": fast, "seed": seed, "policy": policy,
                    "slo": r.slo_attainment, "usd": r.cost_usd, "start": effective_start_s(cat),
                    "wall": time.perf_counter() - t0})
    print(f"  {label} {total_s:g}s fast={'on' if fast else 'off'} seed={seed}: " + ", ".join(
        f"{r['policy']} {100 * r['slo']:.2f}% ${r['usd']:.2f}" for r in out), flush=True)
    return out


def _ranking(sel: list[dict[str, Any]]) -> str:
    """Policies by mean cost among those whose mean SLO is within a point of the best, then the rest."""
    mean = {p: (statistics.mean(r["slo"] for r in sel if r["policy"] == p),
                statistics.mean(r["usd"] for r in sel if r["policy"] == p)) for p in POLICIES}
    best = max(s for s, _ in mean.values())
    ok = sorted((p for p in POLICIES if mean[p][0] >= best - 0.01), key=lambda p: mean[p][1])
    return " < ".join(ok) + ("; short: " + ", ".join(p for p in POLICIES if p not in ok) if len(ok) < 3 else "")


def table(rows: list[dict[str, Any]], scenario: int) -> str:
    from rayscale.tables import format_table

    out: list[list[Any]] = []
    for total in sorted({r["total"] for r in rows}):
        for fast in (False, True):
            sel = [r for r in rows if r["scenario"] == scenario and r["total"] == total and r["fast"] == fast]
            if not sel:
                continue
            cv = {r["seed"]: r for r in sel if r["policy"] == "clairvoyant"}
            for p in POLICIES:
                pr = [r for r in sel if r["policy"] == p]
                ratio = [r["usd"] / cv[r["seed"]]["usd"] for r in pr if cv[r["seed"]]["usd"] > 0]
                gap = [100 * (r["slo"] - cv[r["seed"]]["slo"]) for r in pr]
                out.append([f"{total:g}", "on" if fast else "off", f"{pr[0]['start']:.0f}", p, len(pr),
                            span([r["slo"] for r in pr], True), span([r["usd"] for r in pr], False),
                            f"{statistics.mean(ratio):.2f}x", f"{statistics.mean(gap):+.2f}"])
            out.append(["", "", "", "ranking", "", _ranking(sel), "", "", ""])
    return format_table(["total s", "fast", "start s", "policy", "seeds", "SLO min/mean/max", "$ min/mean/max",
                         "$ vs clairvoyant", "SLO pts vs clairvoyant"], out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--totals", default="120,300,600")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="write bench/results/startup.md")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    totals = [float(x) for x in args.totals.split(",")]
    jobs = [(s, t, f, seed) for s in range(len(SCENARIOS)) for t in totals for f in (False, True) for seed in seeds]
    print(f"{len(jobs)} runs of {len(POLICIES)} policies on {args.jobs} processes", flush=True)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = [r for part in pool.map(one, *zip(*jobs, strict=True)) for r in part]
    wall = time.perf_counter() - t0
    parts = catalog_for(660.0, False).startup(MODEL, "a10g"), catalog_for(660.0, True).startup(MODEL, "a10g")
    text = (f"# Start-up time: how the ranking depends on it, and the fast-start choices\n\n{machine()}; "
            f"`python -m bench.startup --seeds {args.seeds} --totals {args.totals} --write` ({wall:.0f} s on "
            f"{args.jobs} processes).\n\n" + __doc__.split("\n\n", 2)[2]
            + f"\nShipped parts for {MODEL} on a10g (s): off {parts[0]}, on {parts[1]} (docs/startup.md has the "
            "sources). `total s`: the median cold start-up the parts are scaled to; `start s`: the median "
            "launch-to-serving time the run's choices imply; SLO and $ over the scored part, mean and spread "
            "over seeds; `ranking`: by mean cost among the policies within one SLO point of the best.\n")
    for i, (label, spec, steady) in enumerate(SCENARIOS):
        text += (f"\n## {label} (`{spec}`, {'steady state' if steady else 'from cold'})\n\n```\n"
                 + table(rows, i) + "\n```\n")
    print(text)
    if args.write:
        (ROOT / "bench" / "results" / "startup.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
