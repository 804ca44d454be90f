"""Run every benchmark and rewrite its results under bench/results/ (`make bench`; four hours or more on 2 cores, the dev split alone about 100 min)."""

from __future__ import annotations

import subprocess
import sys

BENCHES = [
    ["bench.eval_split", "--seeds", "0,1,2,3,4", "--split", "dev", "--out", "bench/results/eval_dev.md"],
    ["bench.eval_split", "--seeds", "0,1,2,3,4", "--split", "held-out", "--out", "bench/results/eval_held_out.md"],
    ["bench.eval_split", "--seeds", "0,1,2,3,4", "--split", "models", "--out", "bench/results/eval_models.md"],
    ["bench.eval_split", "--seeds", "0,1,2,3,4", "--split", "shapes", "--out", "bench/results/eval_shapes.md"],
    ["bench.multi_model", "--seeds", "0,1,2,3,4", "--jobs", "2", "--write"],
    ["bench.prefix_reuse", "--seeds", "0", "1", "2", "--write"],
    ["bench.startup", "--seeds", "0,1,2", "--totals", "120,300,600", "--write"],
    ["bench.spot_budget", "--out", "bench/results/spot_budget.md"],
    ["bench.spot_stress", "--out", "bench/results/spot_stress.md"],
    ["bench.spot_zombies", "--out", "bench/results/spot_zombies.md"],
    ["bench.restart", "--out", "bench/results/restart.md"],
    ["bench.checkpoint_size", "--out", "bench/results/checkpoint_size.md"],
    ["bench.long_prompts", "--out", "bench/results/long_prompts.md"],
    # The step before its 1,000-model speed-ups, timed beside this checkout (bench/README.md).
    ["bench.planner", "--out", "bench/results/planner.md", "--against", "be997ea"],
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
