"""Scale-downs that start replicas elsewhere: rayscale with and without the move margin, side by side.

    .venv/bin/python -m bench.scale_down_moves [--seeds 0,1,2] [--savings 0,0.15] [--jobs 2]
        [--out bench/results/scale_down_moves.md]

A scale-down re-plans the model's fleet; it may start replicas on offerings the model does not run (a
cheaper flavor, spot) for the smaller demand. ``PlannerSettings.scale_down_move_saving`` lets it do so only
when that costs at least that share less than dropping running replicas alone; 0 moves whenever it is
cheaper at all (the planner before 2026-11-25). Same simulator, traces and settings as
bench.simulate_policies (each trace declares its own request mix), cold and in steady state (played
twice, the second pass scored), per seed.
"""

from __future__ import annotations

import argparse
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import span
from bench.simulate_policies import CASES, SHORT
from rayscale.config import load_catalog
from rayscale.sim.policies import RayscalePolicy
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.sim.sources import load_spec
from rayscale.tables import format_table

MODEL = "mistral-7b"


def policy(cfg: SimConfig, saving: float) -> RayscalePolicy:
    s = cfg.settings
    return RayscalePolicy(replace(s, planner=replace(s.planner, scale_down_move_saving=saving)))


def one(i: int, saving: float, seed: int) -> dict[str, Any]:
    _, spec, rate = CASES[i]
    tr = load_spec(spec, seed=seed, rate_scale=rate)
    cat = load_catalog().subset([MODEL]).with_request_mix(MODEL, tr.request_mix())
    cfg = SimConfig(seed=seed)
    cold = simulate(cat, tr, policy(cfg, saving), cfg)
    tr2 = tr.repeat(2)
    cfg2 = replace(cfg, warmup_s=float(tr2.arrival_s[len(tr)]))
    steady = simulate(cat, tr2, policy(cfg2, saving), cfg2)
    print(f"  {SHORT[i]} seed={seed} saving={saving:g}: cold {100 * cold.slo_attainment:.2f}% ${cold.cost_usd:.2f}, "
          f"steady {100 * steady.slo_attainment:.2f}% ${steady.cost_usd:.2f}", flush=True)
    return {"case": i, "seed": seed, "saving": saving,
            **{f"{tag}_{k}": v for tag, r in (("cold", cold), ("steady", steady))
               for k, v in (("slo", r.slo_attainment), ("usd", r.cost_usd), ("ups", r.scale_up_events))}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--savings", default="0,0.15")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="bench/results/scale_down_moves.md")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    savings = [float(x) for x in args.savings.split(",")]
    t0 = time.perf_counter()
    jobs = [(i, v, s) for i in range(len(CASES)) for s in seeds for v in savings]
    with ProcessPoolExecutor(args.jobs) as pool:
        res = list(pool.map(one, *zip(*jobs, strict=True)))
    wall = time.perf_counter() - t0
    summary, detail = [], []
    for i in range(len(CASES)):
        for v in savings:
            rows = [r for r in res if r["case"] == i and r["saving"] == v]
            summary.append([SHORT[i], f"{v:g}", len(rows), span([r["steady_slo"] for r in rows], True),
                            span([r["steady_usd"] for r in rows], False), span([r["cold_slo"] for r in rows], True),
                            span([r["cold_usd"] for r in rows], False)])
            detail += [[SHORT[i], r["seed"], f"{v:g}", f"{100 * r['steady_slo']:.2f}%", round(r["steady_usd"], 2),
                        r["steady_ups"], f"{100 * r['cold_slo']:.2f}%", round(r["cold_usd"], 2), r["cold_ups"]]
                       for r in rows]
    text = f"""# Scale-downs that move: the move margin

{platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}; `python -m bench.scale_down_moves --seeds {args.seeds} --savings {args.savings}` ({wall:.0f} s on {args.jobs} processes); model {MODEL}, shipped catalog; simulator defaults otherwise.

{__doc__.split(chr(10) + chr(10), 2)[2]}
Min / mean / max over seeds:

```
{format_table(["trace", "move saving", "seeds", "SLO steady", "$ steady", "SLO cold", "$ cold"], summary)}
```

Per seed (scale-ups counted in the scored pass):

```
{format_table(["trace", "seed", "move saving", "SLO", "$", "ups", "SLO cold", "$ cold", "ups cold"], detail)}
```
"""
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
