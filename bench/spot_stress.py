"""Spot under stress: what spot saves, and what interruptions cost, with the shipped controller.

    .venv/bin/python -m bench.spot_stress [--seeds 0,1,2] [--jobs 2] [--out bench/results/spot_stress.md]

Every run is the shipped product (rayscale/data/settings.yaml) in steady state (warmed up on another draw of
the same traffic), on the same cloud draws, with these interruption regimes:

- ``0.1/node-h`` and ``1/node-h``: every spot node gets a 2-minute notice as a Poisson process (AWS's
  advisor puts GPU spot under 5% a month, about 0.0001 per node-hour: both are stress, not forecasts);
- ``pool reclaim``: 0.1/node-h, plus at half time the spot pool (flavor, zone) holding the most nodes is
  reclaimed whole: every node in it gets its notice at once.

Policies: ``rayscale`` with spot allowed (the catalog's ``spot_max_share``), ``rayscale (on-demand)`` and
``static-best (on-demand)`` (the cheapest fixed on-demand fleet that reaches the SLO goal, by replay: hindsight).
The replacement lag is notice -> the next replica live: at most 120 s means no serving replica was lost.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from bench.common import ROOT, emit, machine
from rayscale.config import load_catalog
from rayscale.sim.baselines import on_demand_only
from rayscale.sim.cloud import CloudConfig, Reclaim
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.sim.sources import with_warmup_draw

MODEL = "mistral-7b"
TRACES = ROOT.parent / "shared" / "traces"
# (label, trace spec, time scale, rate scale)
CASES: list[tuple[str, str, float, float]] = [
    ("Azure code x3 (dev)", str(TRACES / "azure_llm_2023_code.csv"), 1.0, 3.0),
    ("fast day 3 h (held-out)", "gen:diurnal:base=2,peak=20,hours=3,period_h=1.5,prompt=600,output=200", 1.0, 1.0),
]
REGIMES = ["0.1/node-h", "1/node-h", "pool reclaim"]
POLICIES = ["rayscale", "rayscale (on-demand)", "static-best (on-demand)"]


def _cloud(regime: str, mid_s: float) -> CloudConfig:
    if regime == "1/node-h":
        return CloudConfig(spot_interruptions_per_node_h=1.0)
    reclaims = (Reclaim(at_s=mid_s, largest=True),) if regime == "pool reclaim" else ()
    return CloudConfig(spot_interruptions_per_node_h=0.1, reclaims=reclaims)


def one(case: int, seed: int, regime: str) -> list[dict[str, Any]]:
    label, spec, ts, rs = CASES[case]
    trace, warm = with_warmup_draw(spec, seed, ts, rs)
    mid = warm + (float(trace.arrival_s[-1]) - warm) / 2
    cfg = SimConfig(model=MODEL, seed=seed, warmup_s=warm, cloud=_cloud(regime, mid))
    full = load_catalog().subset([MODEL])
    runs = [("rayscale", full, "rayscale"), ("rayscale (on-demand)", on_demand_only(full), "rayscale"),
            ("static-best (on-demand)", on_demand_only(full), "static-best")]
    out = []
    for name, cat, policy in runs:
        t0 = time.perf_counter()
        r = simulate(cat, trace, policy, replace(cfg))
        out.append({"case": case, "seed": seed, "regime": regime, "policy": name, "slo": r.slo_attainment,
                    "usd": r.cost_usd, "failed": r.failed_requests, "interruptions": r.spot_interruptions,
                    "lag_p50": r.extra.get("replacement_lag_p50_s", math.nan),
                    "lag_max": r.extra.get("replacement_lag_max_s", math.nan), "wall": time.perf_counter() - t0})
    print(f"  {label} seed={seed} {regime}: " + ", ".join(
        f"{o['policy']} {100 * o['slo']:.2f}% ${o['usd']:.2f} int={o['interruptions']}" for o in out), flush=True)
    return out


def _cell(rows: list[dict[str, Any]], key: str, fmt: str) -> str:
    vals = [r[key] for r in rows if not (isinstance(r[key], float) and math.isnan(r[key]))]
    if not vals:
        return "-"
    xs = [float(v) for v in vals]
    return f"{statistics.mean(xs):{fmt}} [{min(xs):{fmt}}, {max(xs):{fmt}}]"


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| traffic | regime | policy | SLO % | $ | failed requests | interruptions | lag p50 s | lag max s |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c, (label, *_rest) in enumerate(CASES):
        for regime in REGIMES:
            for pol in POLICIES:
                rs = [r for r in rows if r["case"] == c and r["regime"] == regime and r["policy"] == pol]
                if not rs:
                    continue
                slo = [dict(r, slo=100 * r["slo"]) for r in rs]
                out.append(f"| {label} | {regime} | {pol} | {_cell(slo, 'slo', '.2f')} | {_cell(rs, 'usd', '.2f')} | "
                           f"{_cell(rs, 'failed', '.0f')} | {_cell(rs, 'interruptions', '.0f')} | "
                           f"{_cell(rs, 'lag_p50', '.0f')} | {_cell(rs, 'lag_max', '.0f')} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the markdown record here")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(c, s, g) for c in range(len(CASES)) for g in REGIMES for s in seeds]
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(args.jobs) as ex:
        for res in ex.map(one, *zip(*jobs, strict=True)):
            rows += res
    lines = ["# Spot under stress", "",
             f"- command: `python -m bench.spot_stress --seeds {args.seeds}`",
             f"- machine: {machine()}; wall {time.perf_counter() - t0:.0f} s",
             f"- model {MODEL}, shipped settings, steady state (warm-up on another draw), seeds {args.seeds}: "
             "mean with [min, max] over seeds", "", *table(rows), ""]
    text = "\n".join(lines)
    return emit(text, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
