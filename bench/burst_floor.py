"""Sizing for bursts within the minute: rayscale's burst floor against the one it replaced and none.

    .venv/bin/python -m bench.burst_floor [--seeds 0,1,2,3,4] [--jobs 2] [--out bench/results/burst_floor.md]

Three rayscale variants, same simulator, same traces as bench.simulate_policies (each declares its own
request mix), cold and in steady state (played twice, the second pass scored), per seed:

- closed: the forecaster alone (trend fitted on completed 1-min windows, the open window's rate only a
  floor, peak hold), no burst floor;
- windows: closed plus the burst floor as of 2026-11-24 (``window_quantile_rate``, reproduced here): the
  largest, over windows of 5 s to 1 min, of the request-weighted 99% quantile of the window's rate times
  w / (w + T), its drain counted in the last minutes' request mix;
- rayscale: closed plus the burst floor now (rayscale.core.burst): the smallest drain rate at which a fluid
  FIFO queue replaying the last hour's arrivals keeps all but half the miss budget within the TTFT target,
  its drain counted in the model's declared request mix.

Seeds change the generated traces and the cloud's draws; the Azure trace is one file, so its seeds change
only the cloud (start-up times, capacity errors, interruptions).
"""

from __future__ import annotations

import argparse
import functools
import platform
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

import rayscale.core.estimate as estimate_mod
import rayscale.core.plan as plan_mod
from bench.common import span
from bench.simulate_policies import CASES, SHORT
from rayscale.config import load_catalog
from rayscale.core.burst import BURST_BUDGET_SHARE
from rayscale.sim.policies import RayscalePolicy
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.sim.sources import load_spec
from rayscale.tables import format_table

MODEL = "mistral-7b"
MODES = ("closed", "windows", "rayscale")
_WINDOWS = (1, 2, 3, 4, 6, 12)  # bins of 5 s


def window_quantile_rate(counts: Sequence[float], bin_s: float, ttft_s: float, attainment: float) -> float:
    """The burst floor of 2026-11-24: max over window lengths w of the request-weighted ``attainment``
    quantile of the window rate, times w / (w + T)."""
    c = np.asarray(counts, dtype=float)
    n = c.size
    ks = [k for k in _WINDOWS if k <= n]
    if not ks or c.sum() <= 0:
        return 0.0
    cum = np.concatenate([[0.0], np.cumsum(c)])
    rate, weight = np.zeros((len(ks), n)), np.zeros((len(ks), n))
    for i, k in enumerate(ks):
        rate[i, k - 1:] = (cum[k:] - cum[:-k]) / (k * bin_s)
        weight[i, k - 1:] = c[k - 1:]
    order = np.argsort(rate, axis=1)
    rate = np.take_along_axis(rate, order, axis=1)
    cw = np.cumsum(np.take_along_axis(weight, order, axis=1), axis=1)
    at = np.minimum((cw < attainment * cw[:, -1:]).sum(axis=1), n - 1)
    q = rate[np.arange(len(ks)), at]
    w = np.asarray(ks, dtype=float) * bin_s
    return float(np.max(q * w / (w + ttft_s)))


@functools.lru_cache(maxsize=16)
def _windows_rate(counts: tuple[float, ...], bin_s: float, ttft_s: float, attainment: float) -> float:
    # The core asks for the floor at 1 - BURST_BUDGET_SHARE x (1 - SLO attainment); the old floor spent it all.
    return window_quantile_rate(counts, bin_s, ttft_s, 1.0 - (1.0 - attainment) / BURST_BUDGET_SHARE)


@contextmanager
def _old_floor() -> Iterator[None]:
    """The core's estimate and plan, with the 2026-11-24 floor and its drain in the observed mix."""
    rate, mix = estimate_mod._burst_rate, plan_mod._floor_mix
    estimate_mod._burst_rate = _windows_rate
    plan_mod._floor_mix = lambda catalog, model, d: d.mix
    try:
        yield
    finally:
        estimate_mod._burst_rate, plan_mod._floor_mix = rate, mix


def policy(mode: str, cfg: SimConfig) -> RayscalePolicy:
    s = cfg.settings
    return RayscalePolicy(replace(s, estimate=replace(s.estimate, burst_floor=mode != "closed")))


def one(i: int, seed: int, mode: str) -> dict[str, Any]:
    _, spec, rate = CASES[i]
    tr = load_spec(spec, seed=seed, rate_scale=rate)
    cat = load_catalog().subset([MODEL]).with_request_mix(MODEL, tr.request_mix())
    cfg = SimConfig(seed=seed)
    tr2 = tr.repeat(2)
    cfg2 = replace(cfg, warmup_s=float(tr2.arrival_s[len(tr)]))
    with _old_floor() if mode == "windows" else nullcontext():
        cold = simulate(cat, tr, policy(mode, cfg), cfg)
        steady = simulate(cat, tr2, policy(mode, cfg2), cfg2)
    out = {"case": i, "seed": seed, "mode": mode}
    for tag, r in (("cold", cold), ("steady", steady)):
        out |= {f"{tag}_slo": r.slo_attainment, f"{tag}_usd": r.cost_usd, f"{tag}_ttft95": r.ttft_p95_s,
                f"{tag}_tpot95": r.tpot_p95_s, f"{tag}_ups": r.scale_up_events}
    print(f"  {SHORT[i]} seed={seed} {mode}: cold {100 * cold.slo_attainment:.2f}% ${cold.cost_usd:.2f}, "
          f"steady {100 * steady.slo_attainment:.2f}% ${steady.cost_usd:.2f}", flush=True)
    return out


def plot(res: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHORT), figsize=(4.2 * len(SHORT), 3.8))
    marks = {"closed": ("s", "tab:blue"), "windows": ("o", "tab:gray"), "rayscale": ("*", "tab:red")}
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
                            span([r["steady_slo"] for r in rows], True), span([r["steady_usd"] for r in rows], False),
                            span([r["cold_slo"] for r in rows], True), span([r["cold_usd"] for r in rows], False)])
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
