"""Spot gangs kept but counted for nothing: how long they run beside the on-demand capacity that replaced them.

    .venv/bin/python -m bench.spot_zombies [--seeds 0,1,2,3,4] [--out bench/results/spot_zombies.md]

``bench.spot_stress``'s cases at one notice per node-hour, the shipped product with spot allowed, steady state.
Once a flavor's learned interruption rate puts more than ``planner.spot_outage_budget`` of the requests at risk,
the plan orders no new spot gang of it and counts the running ones at nothing (rayscale.core.plan._counted), so
on-demand capacity comes up beside them. They keep serving: ``act._release`` releases only gangs that serve no
replica, and spot and on-demand replicas of a flavor share one Serve deployment. Where one interruption puts
``plan.SPOT_DROP_OVER_BUDGET`` times the budget at risk and the ready rest covers the need, the plan drops them
and ``act._drains`` moves their replicas (a drain Serve migrates). This bench measures the time they are kept
(READY spot gang-hours while the plan says the running ones count for nothing) beside all spot and on-demand
gang-hours, over the scored part of each run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from bench.common import emit, machine
from bench.spot_stress import CASES, MODEL, _cloud
from rayscale.config import load_catalog
from rayscale.core.act import GangPhase
from rayscale.core.catalog import CapacityType
from rayscale.sim.policies import RayscalePolicy
from rayscale.sim.simulator import SimConfig, Simulation, simulate
from rayscale.sim.sources import with_warmup_draw

# The plan's own words for a flavor's spot gangs over the outage budget (rayscale.core.plan._add_offers).
KEPT_FOR_NOTHING = "no new spot {flavor}, and the running ones count for nothing"


class _Counting(RayscalePolicy):
    """The shipped product, adding up gang-seconds by kind after each of its steps once scoring has begun."""

    def __init__(self, scored_from_s: float) -> None:
        super().__init__()
        self.scored_from_s = scored_from_s
        self.at_s: float | None = None
        self.seconds = {"kept for nothing": 0.0, "spot": 0.0, "on-demand": 0.0}

    def control(self, now: float, sim: Simulation) -> None:
        super().control(now, sim)
        if now < self.scored_from_s or self.provider is None or self.last is None:
            return
        dt, self.at_s = (0.0 if self.at_s is None else now - self.at_s), now
        why = " ".join(e.reason for e in self.last.plan.entries)
        for g in self.provider.gangs(now):
            if g.phase != GangPhase.READY:
                continue
            spot = g.capacity_type == CapacityType.SPOT.value
            self.seconds["spot" if spot else "on-demand"] += dt
            if spot and g.serving and KEPT_FOR_NOTHING.format(flavor=g.flavor) in why:
                self.seconds["kept for nothing"] += dt


def one(case: int, seed: int) -> dict[str, Any]:
    label, spec, ts, rs = CASES[case]
    trace, warm = with_warmup_draw(spec, seed, ts, rs)
    mid = warm + (float(trace.arrival_s[-1]) - warm) / 2
    policy = _Counting(warm)
    r = simulate(load_catalog().subset([MODEL]), trace, policy,
                 SimConfig(model=MODEL, seed=seed, warmup_s=warm, cloud=_cloud("1/node-h", mid)))
    hours = {k: v / 3600 for k, v in policy.seconds.items()}
    print(f"  {label} seed={seed}: {100 * r.slo_attainment:.2f}% ${r.cost_usd:.2f}, "
          + ", ".join(f"{k} {v:.2f} gang-h" for k, v in hours.items()), flush=True)
    return {"case": label, "seed": seed, "slo": r.slo_attainment, "usd": r.cost_usd, **hours}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the markdown record here")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as ex:
        rows = list(ex.map(one, *zip(*[(c, s) for c in range(len(CASES)) for s in seeds], strict=True)))
    out = ["| traffic | seeds | SLO % (mean) | $ (mean) | spot kept for nothing, gang-h (mean [min, max]) | spot gang-h "
           "| on-demand gang-h |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, *_ in CASES:
        rs = [r for r in rows if r["case"] == label]
        k = [r["kept for nothing"] for r in rs]
        out.append(f"| {label} | {len(rs)} | {100 * statistics.mean(r['slo'] for r in rs):.2f} | "
                   f"{statistics.mean(r['usd'] for r in rs):.2f} | {statistics.mean(k):.2f} [{min(k):.2f}, {max(k):.2f}] | "
                   f"{statistics.mean(r['spot'] for r in rs):.2f} | {statistics.mean(r['on-demand'] for r in rs):.2f} |")
    lines = ["# Spot gangs kept for nothing", "", f"- command: `python -m bench.spot_zombies --seeds {args.seeds}`",
             f"- machine: {machine()}; wall {time.perf_counter() - t0:.0f} s",
             f"- model {MODEL}, shipped settings, spot allowed, 1 notice per node-hour, steady state (warm-up on "
             "another draw); gang-hours over the scored part", "", *out, ""]
    return emit("\n".join(lines), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
