"""Run every benchmark and rewrite its results under bench/results/ (`make bench`; tens of minutes)."""

from __future__ import annotations

import subprocess
import sys

BENCHES = [
    ["bench.eval_split", "--out", "bench/results/eval_split.md"],
    ["bench.long_prompts", "--out", "bench/results/long_prompts.md"],
    ["bench.planner", "--out", "bench/results/planner.md"],
    ["bench.simulate_speed"],
    ["bench.simulate_policies", "--out", "bench/results/sim_policies.md", "--plots"],
    ["bench.burst_floor", "--out", "bench/results/burst_floor.md"],
    ["bench.static_fleet", "--out", "bench/results/static_fleet.md"],
    ["bench.scale_down_moves", "--out", "bench/results/scale_down_moves.md"],
    ["bench.mix_window", "--out", "bench/results/mix_window.md"],
    ["bench.chunk_choice", "--out", "bench/results/chunk_choice.md"],
    ["bench.capacity_error", "--out", "bench/results/capacity_error.md"],
    ["bench.serving_overhead", "--write"],
    ["bench.controller_vs_serve", "--out", "bench/results/controller_vs_serve.md"],
    ["bench.fidelity", "--out", "bench/results/fidelity.md", "--plot", "bench/results/fidelity.png"],
]


def main() -> int:
    failed = []
    for b in BENCHES:
        print(f"== {' '.join(b)}", flush=True)
        if subprocess.run([sys.executable, "-m", *b], check=False).returncode != 0:
            failed.append(b[0])
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
