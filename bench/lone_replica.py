"""Why one replica alone serves less than a replica in a pool: SLO attainment, TTFT p95 and TPOT p95 of the
simulated engine at the same rate per replica, for one replica alone and a ~2,048-sequence pool.

    .venv/bin/python -m bench.lone_replica [--model mistral-7b] [--case 0] [--flavors a100,l40s]
        [--rates 0.5,0.8,1.2,1.8,2.2] [--out bench/results/lone_replica.md]

The estimator (rayscale.core.attainment) models a replica in a pool behind Serve's power-of-two router,
and a replica alone (``alone``: a flavor deployment of one replica, which takes every prompt). The table
gives both capacities at full utilisation and, per rate, the misses split by target as the engine scores
them (TTFT: over its target or not finished; TPOT: in time, but over its TPOT target) beside the tail
model's at the same rate per replica (``model``: pooled for the pool, alone for the replica alone).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from bench.common import machine
from bench.simulate_policies import CASES, SHORT
from rayscale.config import load_catalog
from rayscale.core import attainment
from rayscale.core.estimate import Correction, replica_capacity, rows_of
from rayscale.sim.capacity import CapacitySettings, Probe
from rayscale.sim.engine import EngineConfig
from rayscale.sim.policies import window_mix
from rayscale.sim.sources import load_spec
from rayscale.tables import format_table

POOLS = (1, 2048)  # concurrent sequences: one replica alone, and the capacity bench's pool


def model_misses(rows: attainment.Rows, rps: float, alone: bool) -> tuple[float, float]:
    """(TTFT, TPOT) miss shares of the tail model at ``rps`` per replica: at the load whose Little's-law rate
    is ``rps``, by bisection in log load."""
    lo, hi = attainment.LOAD_FLOOR, 1e4
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if attainment.rate_at(rows, np.array([mid]))[0][0] < rps else (lo, mid)
    load = attainment.at_load(rows, np.array([lo]), alone)
    return float(load.ttft_miss[0]), float(load.tpot_miss[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="mistral-7b")
    ap.add_argument("--case", type=int, default=0, help="index into bench.simulate_policies.CASES")
    ap.add_argument("--flavors", default="a100,l40s")
    ap.add_argument("--rates", default="0.5,0.8,1.2,1.8,2.2", help="req/s per replica")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/lone_replica.md")
    args = ap.parse_args()
    cat = load_catalog()
    spec = cat.models[args.model]
    label, trace_spec, scale = CASES[args.case]
    tr = load_spec(trace_spec, seed=args.seed, rate_scale=scale)
    output = np.maximum(tr.output_tokens, 1)
    mix = window_mix(tr.prompt_tokens, output)
    assert mix is not None
    rates = [float(x) for x in args.rates.split(",")]
    rows: list[list[object]] = []
    for f in args.flavors.split(","):
        prof = cat.profile(args.model, f)
        tail_rows = rows_of([prof], [spec.slo], [mix], [Correction()])
        pooled = replica_capacity(prof, spec.slo, mix, target_utilization=1.0).rps
        alone = replica_capacity(prof, spec.slo, mix, target_utilization=1.0, alone=True).rps
        for pool in POOLS:
            probe = Probe(prof, spec.slo, tr.prompt_tokens, output, EngineConfig(),
                          CapacitySettings(pool_sequences=pool), args.seed)
            for r in rates:
                got = probe.run(r)
                m_ttft, m_tpot = model_misses(tail_rows, r, probe.replicas == 1)
                rows.append([f, round(pooled, 2), round(alone, 2), probe.replicas, r, f"{got.attainment:.2%}",
                             f"{got.ttft_miss:.2%}", f"{m_ttft:.2%}", f"{got.tpot_miss:.2%}", f"{m_tpot:.2%}",
                             round(got.ttft_p95_s, 2), round(got.tpot_p95_s * 1000)])
                print(f"  {f} pool {pool} ({probe.replicas} replicas) at {r} req/s: {got.attainment:.2%} met",
                      flush=True)
    head = ["flavor", "estimate req/s", "estimate alone", "replicas", "req/s per replica", "met SLO",
            "TTFT miss", "model", "TPOT miss", "model", "TTFT p95 s", "TPOT p95 ms"]
    text = (f"# One replica alone against a pool ({args.model}, {SHORT[args.case]})\n\n{machine()}; "
            f"`python -m bench.lone_replica --model {args.model} --case {args.case} --flavors {args.flavors} "
            f"--rates {args.rates}`; fluid engine model; SLO TTFT {spec.slo.ttft_p95_s} s, TPOT "
            f"{spec.slo.tpot_p95_s} s, 99% of requests within both. Trace: {label}; mix: prompt mean "
            f"{mix.prompt_mean:.0f} / p95 {mix.prompt_p95:.0f}, output mean {mix.output_mean:.0f} tokens.\n\n"
            f"{__doc__.split(chr(10) * 2, 2)[2]}\n```\n{format_table(head, rows)}\n```\n")
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
