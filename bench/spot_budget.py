"""Choosing the spot outage budget (PlannerSettings.spot_outage_budget) on generated dev traffic.

    .venv/bin/python -m bench.spot_budget [--seeds 0,1,2,3,4] [--jobs 2] [--out bench/results/spot_budget.md]

The shipped product with spot allowed (the catalog's ``spot_max_share``), in steady state (warmed up on
another draw of the same traffic), at 0.1 and 1 interruption notices per spot node-hour, with each budget
and with none (``off``: spot is discounted by its average availability only). Traffic: the dev split's
diurnal day and chat ramp (bench.eval_split), small fleets where one spot replica is a large share.

Rule: the budget whose worst mean SLO over (traffic, rate) is highest ships: spot is stress here, and the
SLO comes before its savings.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from bench.common import emit, machine, span
from rayscale.config import load_catalog
from rayscale.core.settings import Settings
from rayscale.sim.policies import RayscalePolicy
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.sim.sources import with_warmup_draw
from rayscale.tables import format_table

MODEL = "mistral-7b"
CASES = {"diurnal 6 h (dev)": "gen:diurnal:base=1,peak=12,hours=6,period_h=6",
         "chat ramp 2 h (dev)": "gen:diurnal:base=4,peak=8,hours=2,period_h=4,prompt=1000,output=250"}
RATES = (0.1, 1.0)
OFF = 1e9  # a budget no risk reaches


def one(case: str, seed: int, rate: float, budget: float) -> tuple[str, int, float, float, float, float]:
    s = Settings()
    s = replace(s, planner=replace(s.planner, spot_outage_budget=budget))
    trace, warm = with_warmup_draw(CASES[case], seed, 1.0, 1.0)
    cfg = SimConfig(model=MODEL, seed=seed, warmup_s=warm, settings=s)
    cfg = replace(cfg, cloud=replace(cfg.cloud, spot_interruptions_per_node_h=rate))
    r = simulate(load_catalog().subset([MODEL]), trace, RayscalePolicy(s), cfg)
    name = "off" if budget >= OFF else f"{budget:g}"
    print(f"  {case} seed={seed} {rate:g}/node-h budget {name}: {100 * r.slo_attainment:.2f}% ${r.cost_usd:.2f}",
          flush=True)
    return case, seed, rate, budget, r.slo_attainment, r.cost_usd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--budgets", default="0.005,0.01,0.02")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the markdown record here")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    budgets = [float(b) for b in args.budgets.split(",")] + [OFF]
    jobs = [(c, s, r, b) for c in CASES for r in RATES for b in budgets for s in seeds]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as ex:
        runs = list(ex.map(one, *zip(*jobs, strict=True)))
    rows: list[list[str]] = []
    worst: dict[float, float] = {}
    for b in budgets:
        for c in CASES:
            for r in RATES:
                sel = [x for x in runs if x[0] == c and x[2] == r and x[3] == b]
                slo = [x[4] for x in sel]
                worst[b] = min(worst.get(b, 1.0), statistics.mean(slo))
                rows.append(["off" if b >= OFF else f"{b:g}", c, f"{r:g}", span(slo, True),
                             span([x[5] for x in sel], False)])
    chosen = max(budgets, key=lambda b: worst[b])
    text = "\n".join([
        "# Spot outage budget", "",
        f"{machine()}; `python -m bench.spot_budget --seeds {args.seeds} --budgets {args.budgets}` "
        f"({time.perf_counter() - t0:.0f} s on {args.jobs} processes); model {MODEL}, steady state.", "",
        (__doc__ or "").split("\n\n", 2)[2].strip(), "",
        f"**Chosen: {'off' if chosen >= OFF else f'{chosen:g}'}** (worst mean SLO "
        f"{100 * worst[chosen]:.2f}%).", "", "```",
        format_table(["budget", "traffic", "notices per node-h", "SLO min/mean/max", "$ min/mean/max"], rows),
        "```", ""])
    return emit(text, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
