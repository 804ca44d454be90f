"""A controller restart: what the checkpoint it reads back is worth, and how old it may be.

    .venv/bin/python -m bench.restart [--seeds 0,1,2] [--out bench/results/restart.md]

The dev traffic of bench.eval_split in steady state (warmed up on another draw), the shipped product, its
controller restarted 30 min before scoring, the cluster unchanged (rayscale.sim.policies.RayscalePolicy).
Side by side in the same run: no restart; the restart reading back the checkpoint of its last period (what
ships, rayscale.core.checkpoint.CHECKPOINT_EVERY_S); one saved a minute before; and with the checkpoint lost
(blind: no rate history, corrections, SLO feedback's record or planner timers). Dev traffic only: the
checkpoint interval is chosen here.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from bench.common import emit, machine
from bench.eval_split import CASES, MODEL, RESTART_BEFORE_S, case_run
from rayscale.sim.policies import RayscalePolicy
from rayscale.sim.simulator import SimConfig, simulate

# label -> checkpoint_every_s (None: the checkpoint is lost); "no restart" runs unbroken
RUNS: dict[str, float | None] = {"no restart": 0.0, "checkpoint of the last period (shipped)": 0.0,
                                 "checkpoint a minute old": 60.0, "blind (checkpoint lost)": None}


def one(case: int, seed: int, label: str) -> dict[str, Any]:
    cat, trace, warm = case_run(case, seed, True)
    restart = None if label == "no restart" else warm - RESTART_BEFORE_S
    r = simulate(cat, trace, RayscalePolicy(restart_at_s=restart, checkpoint_every_s=RUNS[label]),
                 SimConfig(model=MODEL, seed=seed, warmup_s=warm))
    print(f"  {CASES[case][1]} seed={seed} {label}: {100 * r.slo_attainment:.2f}% ${r.cost_usd:.2f}", flush=True)
    return {"case": case, "seed": seed, "run": label, "slo": r.slo_attainment, "usd": r.cost_usd}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the markdown record here")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    cases = [i for i, c in enumerate(CASES) if c[0] == "dev"]
    jobs = [(c, s, label) for c in cases for s in seeds for label in RUNS]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as ex:
        rows = list(ex.map(one, *zip(*jobs, strict=True)))
    out = ["| traffic | run | seeds | SLO % min / mean / max | $ mean | $ vs no restart |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
    for c in cases:
        base = statistics.mean(r["usd"] for r in rows if (r["case"], r["run"]) == (c, "no restart"))
        for label in RUNS:
            rs = [r for r in rows if (r["case"], r["run"]) == (c, label)]
            slo = [100 * r["slo"] for r in rs]
            usd = statistics.mean(r["usd"] for r in rs)
            out.append(f"| {CASES[c][1]} | {label} | {len(rs)} | {min(slo):.2f} / {statistics.mean(slo):.2f} / "
                       f"{max(slo):.2f} | {usd:.2f} | {usd / base:.3f}x |")
    lines = ["# A controller restart and the checkpoint it reads back", "",
             f"- command: `python -m bench.restart --seeds {args.seeds}`",
             f"- machine: {machine()}; wall {time.perf_counter() - t0:.0f} s",
             f"- model {MODEL}, shipped settings, on-demand only, dev traffic of bench.eval_split, steady state "
             "(warm-up on another draw); the controller restarts 30 min before scoring", "", *out, ""]
    return emit("\n".join(lines), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
