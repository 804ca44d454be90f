"""One hour of long-prompt traffic, every policy: wall time and result (goal: each policy <= 10 s).

    .venv/bin/python -m bench.long_prompts [--out bench/results/long_prompts.md]

The Mooncake synthetic trace (mean prompt 15k tokens, p95 49k, shared prefixes) time-scaled x3.5 to about
an hour; prompts beyond mistral-7b's max_model_len (32,768) are rejected as vLLM rejects them and counted
apart. Wall time is the replay; ``search`` is the replays the static-best and clairvoyant baselines run
first to find the cheapest plan that meets the SLO.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import ROOT, machine
from rayscale.config import load_catalog
from rayscale.sim.policies import POLICIES
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.sim.sources import load_spec
from rayscale.tables import format_table

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/long_prompts.md")
    args = ap.parse_args()
    cat = load_catalog()
    tr = load_spec(str(TRACE), time_scale=3.5)
    rows = []
    for name in POLICIES:
        t0 = time.perf_counter()
        r = simulate(cat, tr, name, SimConfig())
        total = time.perf_counter() - t0
        search = float(r.extra.get("search_wall_s", 0.0))
        rows.append([name, r.requests, r.rejected_requests, f"{100 * r.slo_attainment:.2f}%", round(r.cost_usd, 2),
                     round(r.wall_s, 1), round(search, 1), round(total, 1), "met" if total <= 10 else "missed"])
    table = format_table(["policy", "served", "rejected", "SLO", "cost $", "replay s", "search s", "total s",
                          "<= 10 s"], rows)
    text = (f"# One hour of long prompts, every policy\n\n{machine()}; `python -m bench.long_prompts`; "
            f"{len(tr)} requests over {tr.duration_s:.0f} s, mistral-7b, shipped catalog and settings, fluid "
            f"engine.\n\n" + __doc__.split("\n\n")[2] + "\n\n```\n" + table + "\n```\n")
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
