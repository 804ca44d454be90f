"""Every policy on the Azure code trace and generated diurnal and bursty traces; writes a markdown table.

    .venv/bin/python -m bench.simulate_policies [--out bench/results/sim_policies.md] [--plots]

The same runs as `rayscale simulate --policy all --trace ... --json`, one call per trace (commands in the
output). Goals for rayscale (issue 6): SLO attainment >= 99%, cost <= 1.10x oracle and <= 0.60x stock.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from rayscale.commands.simulate import render_table
from rayscale.config import load_catalog
from rayscale.sim.policies import POLICIES
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.sim.sources import load_spec

AZURE = str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023_code.csv")
CASES = [
    # (label, trace spec, rate scale): the Azure code trace at 3x its rate needs ~4-8 7B replicas.
    ("Azure code 2023, 1 h, rate x3", AZURE, 3.0),
    ("generated diurnal, 6 h day, 1-12 req/s", "gen:diurnal:base=1,peak=12,hours=6,period_h=6", 1.0),
    ("generated bursty, 4 h, 2 req/s + 12 req/s bursts (5 min every 30 min)",
     "gen:bursty:base=2,burst=12,every_s=1800,burst_s=300,hours=4", 1.0),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results/sim_policies.md")
    ap.add_argument("--plots", action="store_true", help="also write bench/results/sim_<case>.png")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cat = load_catalog()
    out = [f"# Simulated policies (seed {args.seed})\n",
           f"{platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}; model mistral-7b, shipped catalog; "
           "engine = emulated-engine latency model, tick 0.25 s; control period 5 s; planner solver greedy.\n"]
    for i, (label, spec, rate) in enumerate(CASES):
        tr = load_spec(spec, seed=args.seed, rate_scale=rate)
        results = [simulate(cat, tr, p, SimConfig(seed=args.seed)) for p in POLICIES]
        cmd = f"rayscale simulate --trace {spec} --policy all --seed {args.seed}"
        if rate != 1.0:
            cmd += f" --rate-scale {rate:g}"
        st = tr.stats()
        out.append(f"\n## {label}\n\n`{cmd}`\n\n{st.requests:,} requests over {st.duration_s / 3600:.2f} h, "
                   f"mean {st.rate_per_s:.2f} req/s, prompt mean {st.prompt_tokens_mean:.0f} / p95 "
                   f"{st.prompt_tokens_p95:.0f}, output mean {st.output_tokens_mean:.0f} tokens.\n\n```\n"
                   f"{render_table(results, tr.name)}\n```\n")
        o = next(r for r in results if r.policy == "oracle")
        out.append(f"oracle: fluid lower bound ${o.cost_usd:.2f}; its integer plan with instant nodes cost "
                   f"${o.extra['integer_cost_usd']:.2f}.\n")
        print("\n".join(out[-2:]), flush=True)
        if args.plots:
            from rayscale.sim.plots import plot_results

            plot_results([r for r in results if r.policy in ("rayscale", "stock", "oracle")],
                         str(Path(args.out).parent / f"sim_case{i + 1}.png"), title=label)
    Path(args.out).write_text("\n".join(out))


if __name__ == "__main__":
    main()
