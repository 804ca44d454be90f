"""The estimator's per-replica capacity against what the simulated engine sustains at the SLO, per flavor.

    .venv/bin/python -m bench.capacity_error [--out bench/results/capacity_error.md] [--pools 256,2048]

For each of the policy bench's traces (bench.simulate_policies.CASES) and each flavor of the model:

- predicted: rayscale.core.estimate.replica_capacity at full utilisation, uncorrected (what the planner
  prices flavors by before any observation); ``predicted alone``: the same for a replica that is its flavor
  deployment's only one (``alone``), which the ``over`` column of a one-replica pool compares with;
- measured: rayscale.sim.capacity.measure_capacity, the oracle's yardstick: the largest Poisson rate per
  replica at which a pool of the same engine model serves 99% of the trace's own requests within both SLO
  targets. Pools of two sizes (concurrent sequences): a small fleet queues more than a large one.

Then $ per req/s-hour (on-demand gang price / capacity) by each, and which flavor each calls cheapest: where
they disagree, the planner buys the wrong flavor, and per-flavor latency corrections observed at light load
(below the latency knee) cannot tell it so.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.common import machine
from bench.simulate_policies import CASES, SHORT
from rayscale.config import load_catalog
from rayscale.core.catalog import CapacityType
from rayscale.core.estimate import replica_capacity
from rayscale.core.gangs import gang_shape_for
from rayscale.sim.capacity import CapacitySettings, measure_capacity
from rayscale.sim.engine import EngineConfig
from rayscale.sim.policies import window_mix
from rayscale.sim.sources import load_spec
from rayscale.tables import format_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results/capacity_error.md")
    ap.add_argument("--model", default="mistral-7b")
    ap.add_argument("--pools", default="256,2048", help="pool sizes in concurrent sequences, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    pools = [int(x) for x in args.pools.split(",")]
    cat = load_catalog()
    spec = cat.models[args.model]
    engine = EngineConfig()
    out = [f"# Estimator capacity vs measured capacity at the SLO ({args.model})\n",
           f"{machine()}; `python -m bench.capacity_error --model {args.model} --pools "
           f"{args.pools}`; engine = fluid engine model (chunked prefill, {engine.max_num_batched_tokens} "
           f"tokens per iteration); SLO TTFT {spec.slo.ttft_p95_s} s, TPOT {spec.slo.tpot_p95_s} s, 99% of "
           f"requests within both.\n", __doc__.split("\n\n", 2)[2]]
    for i, (label, trace_spec, rate) in enumerate(CASES):
        tr = load_spec(trace_spec, seed=args.seed, rate_scale=rate)
        output = np.maximum(tr.output_tokens, 1)
        mix = window_mix(tr.prompt_tokens, output)
        assert mix is not None
        rows = []
        cheapest: dict[str, tuple[float, str]] = {}
        for f in sorted(spec.parallelism):
            prof = cat.profile(args.model, f)
            shape = gang_shape_for(cat, f, spec.parallelism[f])
            usd = shape.nodes * cat.price(f, shape.instance_type, CapacityType.ON_DEMAND)
            pred = replica_capacity(prof, spec.slo, mix, target_utilization=1.0).rps
            alone = replica_capacity(prof, spec.slo, mix, target_utilization=1.0, alone=True).rps
            row: list[object] = [f, round(usd, 2), round(pred, 2), round(alone, 2)]
            for pool in pools:
                m = measure_capacity(prof, spec.slo, tr.prompt_tokens, output, engine,
                                     CapacitySettings(pool_sequences=pool), args.seed, guess_rps=max(pred, 0.1))
                # One replica alone is compared with the estimate for a replica alone.
                p = alone if m.replicas == 1 else pred
                row += [round(m.rps, 2), f"{p / m.rps:.2f}x" if m.rps > 0 else "-",
                        round(usd / m.rps, 2) if m.rps > 0 else "-"]
                if m.rps > 0:
                    cheapest[str(pool)] = min(cheapest.get(str(pool), (np.inf, "")), (usd / m.rps, f))
                print(f"  {SHORT[i]} {f} pool {pool}: measured {m.rps:.2f} req/s, predicted {pred:.2f}", flush=True)
            row.append(round(usd / pred, 2) if pred > 0 else "-")
            if pred > 0:
                cheapest["predicted"] = min(cheapest.get("predicted", (np.inf, "")), (usd / pred, f))
            rows.append(row)
        head = ["flavor", "$/h", "predicted req/s", "predicted alone"]
        for pool in pools:
            head += [f"measured ({pool} seq)", "over", "$/req/s-h"]
        head.append("$/req/s-h predicted")
        picks = "; ".join(f"{k}: {v[1]}" for k, v in cheapest.items())
        out.append(f"\n## {label}\n\nmix: prompt mean {mix.prompt_mean:.0f} / p95 {mix.prompt_p95:.0f}, output mean "
                   f"{mix.output_mean:.0f} tokens. Cheapest per request by each: {picks}.\n\n```\n"
                   f"{format_table(head, rows)}\n```\n")
        print(out[-1], flush=True)
    Path(args.out).write_text("\n".join(out))


if __name__ == "__main__":
    main()
