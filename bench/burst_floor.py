"""Sizing for bursts within the minute: rayscale with the burst floor against what it ran before.

    .venv/bin/python -m bench.burst_floor [--seeds 0,1,2,3,4] [--jobs 2] [--out bench/results/burst_floor.md]

Three rayscale variants, same simulator, same traces as bench.simulate_policies (each declares its own
request mix), cold and in steady state (played twice, the second pass scored), per seed:

- previous: the forecaster before 2026-11-24, whose trend took the open 30-s window's rate as its last
  point (``OpenWindow``, reproduced here), and no burst floor;
- closed: the trend fitted on completed 1-min windows, the open window's rate only a floor (the core's
  forecaster now), no burst floor;
- rayscale: closed plus the burst floor (rayscale.core.burst, SimConfig.burst_floor: the new default).

Seeds change the generated traces and the cloud's draws; the Azure trace is one file, so its seeds change
only the cloud (start-up times, capacity errors, interruptions).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.simulate_policies import CASES, SHORT
from rayscale.config import load_catalog
from rayscale.core.estimate import EstimateSettings
from rayscale.core.forecast import Seasonal
from rayscale.sim.policies import RayscalePolicy
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.sim.sources import load_spec
from rayscale.tables import format_table

MODEL = "mistral-7b"
MODES = ("previous", "closed", "rayscale")


@dataclass(frozen=True)
class OpenWindow(Seasonal):
    """The peak forecaster as it was: the open window's rate is the trend's last data point."""

    def __call__(self, history: Sequence[float], current: float) -> float:
        return super().__call__((*history, current), current)


def policy(mode: str, cfg: SimConfig) -> RayscalePolicy:
    fc = OpenWindow(peak_window=60) if mode == "previous" else cfg.forecaster
    planner = replace(cfg.planner, downscale_delay_s=cfg.rayscale_downscale_delay_s or cfg.planner.downscale_delay_s)
    return RayscalePolicy(forecaster=fc, planner=planner,
                          est=EstimateSettings(burst_floor=mode == "rayscale" and cfg.burst_floor))


def one(i: int, seed: int, mode: str) -> dict[str, Any]:
    _, spec, rate = CASES[i]
    tr = load_spec(spec, seed=seed, rate_scale=rate)
    cat = load_catalog().subset([MODEL]).with_request_mix(MODEL, tr.request_mix())
    cfg = SimConfig(seed=seed)
    cold = simulate(cat, tr, policy(mode, cfg), cfg)
    tr2 = tr.repeat(2)
    cfg2 = replace(cfg, warmup_s=float(tr2.arrival_s[len(tr)]))
    steady = simulate(cat, tr2, policy(mode, cfg2), cfg2)
    out = {"case": i, "seed": seed, "mode": mode}
    for tag, r in (("cold", cold), ("steady", steady)):
        out |= {f"{tag}_slo": r.slo_attainment, f"{tag}_usd": r.cost_usd, f"{tag}_ttft95": r.ttft_p95_s,
                f"{tag}_tpot95": r.tpot_p95_s, f"{tag}_ups": r.scale_up_events}
    print(f"  {SHORT[i]} seed={seed} {mode}: cold {100 * cold.slo_attainment:.2f}% ${cold.cost_usd:.2f}, "
          f"steady {100 * steady.slo_attainment:.2f}% ${steady.cost_usd:.2f}", flush=True)
    return out


def _span(xs: list[float], pct: bool) -> str:
    f = (lambda x: f"{100 * x:.2f}%") if pct else (lambda x: f"{x:.2f}")
    return f"{f(min(xs))} / {f(statistics.mean(xs))} / {f(max(xs))}"


def plot(res: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHORT), figsize=(4.2 * len(SHORT), 3.8))
    marks = {"previous": ("o", "tab:gray"), "closed": ("s", "tab:blue"), "rayscale": ("*", "tab:red")}
    for i, ax in enumerate(axes):
        for mode in MODES:
            rows = [r for r in res if r["case"] == i and r["mode"] == mode]
            m, c = marks[mode]
            ax.scatter([r["steady_usd"] for r in rows], [100 * r["steady_slo"] for r in rows], marker=m, color=c,
                       s=60 if m == "*" else 30, label=mode)
        ax.axhline(99.0, color="k", lw=0.6, ls="--")
        ax.set_title(f"{SHORT[i]} (steady state, one point per seed)", fontsize=9)
        ax.set_xlabel("cost $")
        ax.set_ylabel("SLO attainment %")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4", help="Azure x3 seeds; the generated traces take the first 3")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="bench/results/burst_floor.md")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    t0 = time.perf_counter()
    jobs = [(i, s, m) for i in range(len(CASES)) for s in (seeds if i == 0 else seeds[:3]) for m in MODES]
    print(f"{len(jobs)} runs (cold + steady each) on {args.jobs} processes", flush=True)
    with ProcessPoolExecutor(args.jobs) as pool:
        res = list(pool.map(one, *zip(*jobs, strict=True)))
    wall = time.perf_counter() - t0
    summary, detail = [], []
    for i in range(len(CASES)):
        for mode in MODES:
            rows = [r for r in res if r["case"] == i and r["mode"] == mode]
            summary.append([SHORT[i], mode, len(rows),
                            _span([r["steady_slo"] for r in rows], True), _span([r["steady_usd"] for r in rows], False),
                            _span([r["cold_slo"] for r in rows], True), _span([r["cold_usd"] for r in rows], False)])
            for r in rows:
                detail.append([SHORT[i], r["seed"], mode, f"{100 * r['steady_slo']:.2f}%", round(r["steady_usd"], 2),
                               round(r["steady_ttft95"], 3), round(r["steady_tpot95"], 3), r["steady_ups"],
                               f"{100 * r['cold_slo']:.2f}%", round(r["cold_usd"], 2), r["cold_ups"]])
    out = Path(args.out)
    png = out.with_suffix(".png")
    plot(res, png)
    text = f"""# Burst floor: sizing for load that swings within the minute

{platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}; `python -m bench.burst_floor --seeds {args.seeds}`
({wall:.0f} s on {args.jobs} processes); model {MODEL}, shipped catalog, each trace declaring its own request mix;
simulator defaults (fluid engine, 5 s control period, greedy planner, 600 s scale-down delay).

{__doc__.split(chr(10) + chr(10), 1)[1]}
Min / mean / max over seeds:

```
{format_table(["trace", "variant", "seeds", "SLO steady", "$ steady", "SLO cold", "$ cold"], summary)}
```

![steady-state SLO attainment against cost, per seed]({png.name})

Per seed (steady state: TTFT/TPOT p95 in seconds, scale-ups in the scored pass; cold: from an empty history):

```
{format_table(["trace", "seed", "variant", "SLO", "$", "TTFT p95", "TPOT p95", "ups", "SLO cold", "$ cold",
               "ups cold"], detail)}
```
"""
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
