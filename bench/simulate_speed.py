"""Simulator speed: one hour of the Azure code trace, and a 24-hour generated trace at 100 requests/s.

    .venv/bin/python -m bench.simulate_speed [--hours 24] [--rate 100] [--policy rayscale]
        [--engine fluid|iteration] [--out FILE]

Goals (issue 6): the Azure hour in <= 10 s wall per policy, 24 h x 100 req/s (8.64 M requests) in
<= 120 s. Records wall time, simulated requests/s and engine ticks/s.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from rayscale.config import load_catalog
from rayscale.sim.engine import EngineConfig
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.sim.trace import LengthDist, load_trace, poisson

AZURE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023_code.csv"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--policy", default="rayscale")
    ap.add_argument("--skip-azure", action="store_true")
    ap.add_argument("--engine", choices=["fluid", "iteration"], default="fluid", help="engine model")
    ap.add_argument("--out", help="append a markdown section to this file")
    args = ap.parse_args()
    cfg = SimConfig(engine=EngineConfig(model=args.engine))
    cat = load_catalog()
    # 100 req/s of chat-sized requests needs more replicas than the shipped max_replicas (32) allows.
    spec = cat.models["mistral-7b"].model_copy(update={"max_replicas": 256})
    big = cat.model_copy(update={"models": {**cat.models, "mistral-7b": spec}})
    lines = []
    if not args.skip_azure and AZURE.exists():
        tr = load_trace(AZURE)
        for pol in ("rayscale", "stock", "static-peak", "oracle"):
            r = simulate(cat, tr, pol, cfg)
            lines.append(f"| azure code 1 h ({len(tr):,} req) | {pol} | {args.engine} | {r.wall_s:.2f} | {len(tr) / r.wall_s:,.0f} | "
                         f"{r.ticks / r.wall_s:,.0f} |")
            print(lines[-1], flush=True)
    t = time.perf_counter()
    tr = poisson(args.rate, args.hours * 3600, seed=0, prompt=LengthDist(300, 0.8, 8, 4000),
                 output=LengthDist(60, 0.8, 1, 1000))
    gen_s = time.perf_counter() - t
    r = simulate(big, tr, args.policy, cfg, progress=True)
    lines.append(f"| poisson {args.rate:g}/s x {args.hours:g} h ({len(tr):,} req) | {args.policy} | {args.engine} | "
                 f"{r.wall_s:.1f} | "
                 f"{len(tr) / r.wall_s:,.0f} | {r.ticks / r.wall_s:,.0f} |")
    print(lines[-1], f"(trace generation {gen_s:.1f}s, slo {r.slo_attainment:.4f}, cost {r.cost_usd:.0f})")
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')}\n\n")
            f.write("| run | policy | engine | wall s | requests/s | ticks/s |\n| --- | --- | --- | --- | --- | --- |\n")
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
