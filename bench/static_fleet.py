"""What meeting the SLO costs with a fixed fleet chosen in hindsight, against rayscale, on one trace.

    .venv/bin/python -m bench.static_fleet [--trace azure] [--flavor l40s] [--sizes 16,18,...,30]
        [--out bench/results/static_fleet.md]

A fixed fleet of N on-demand replicas of one flavor, live from t=0 (no start-up, no scaling, no spot), for
each N; then rayscale in steady state (the trace played twice, the second pass scored, as in
bench.simulate_policies) on the same trace in the same run. On load that swings within the minute, the
fleet that meets 99% is set by the bursts, not the rate: this is the reference the fluid oracle cannot be
(it scales per second with instant nodes and serves the Azure trace's bursts with capacity that no
fleet with real start-up has). Same simulator, engine and catalog as the other simulation benches.
"""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from bench.simulate_policies import CASES
from rayscale.config import load_catalog
from rayscale.sim.policies import Policy
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.sim.sources import load_spec
from rayscale.tables import format_table

if TYPE_CHECKING:
    from rayscale.sim.simulator import Simulation

MODEL = "mistral-7b"
TRACES = {"azure": 0, "diurnal": 1, "bursty": 2}  # index into bench.simulate_policies.CASES


class FixedFleet(Policy):
    """N on-demand replicas of one flavor, live from the start; never scales."""

    name = "fixed"

    def __init__(self, flavor: str, n: int) -> None:
        self.flavor, self.n = flavor, n

    def warm_start(self, sim: Simulation) -> None:
        for _ in range(self.n):
            sim.cluster.place_warm(self.flavor, "on-demand", 0.0)

    def control(self, now: float, sim: Simulation) -> None:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", choices=sorted(TRACES), default="azure")
    ap.add_argument("--flavor", default="l40s")
    ap.add_argument("--sizes", default="16,18,20,22,24,26,28,30")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/static_fleet.md")
    ap.add_argument("--plot", default="bench/results/static_fleet.png")
    args = ap.parse_args()
    title, spec, rate = CASES[TRACES[args.trace]]
    tr = load_spec(spec, seed=args.seed, rate_scale=rate)
    cat = load_catalog().subset([MODEL]).with_request_mix(MODEL, tr.request_mix())
    if args.flavor not in cat.models[MODEL].parallelism:
        raise SystemExit(f"--flavor: {MODEL} does not run on {args.flavor!r}; "
                         f"allowed: {sorted(cat.models[MODEL].parallelism)}")
    cfg = SimConfig(seed=args.seed)
    t0 = time.perf_counter()
    rows, pts = [], []
    for n in (int(x) for x in args.sizes.split(",")):
        r = simulate(cat, tr, FixedFleet(args.flavor, n), cfg)
        rows.append([f"{args.flavor} x {n} (fixed, on-demand)", f"{100 * r.slo_attainment:.2f}%", round(r.ttft_p95_s, 3),
                     round(r.tpot_p95_s, 3), round(r.accelerator_hours, 2), round(r.cost_usd, 2)])
        pts.append((r.cost_usd, 100 * r.slo_attainment, n))
        print(f"  {rows[-1]}", flush=True)
    tr2 = tr.repeat(2)
    cfg2 = replace(cfg, warmup_s=float(tr2.arrival_s[len(tr)]))
    ray = simulate(cat, tr2, "rayscale", cfg2)
    rows.append(["rayscale (steady state, second pass)", f"{100 * ray.slo_attainment:.2f}%",
                 round(ray.ttft_p95_s, 3), round(ray.tpot_p95_s, 3), round(ray.accelerator_hours, 2),
                 round(ray.cost_usd, 2)])
    wall = time.perf_counter() - t0
    meets = [p for p in pts if p[1] >= 99.0]
    cheapest = (f"the smallest fixed fleet meeting 99%: {meets[0][2]} x {args.flavor}, ${meets[0][0]:.2f}"
                if meets else "no fixed fleet of these sizes meets 99%")
    _plot(pts, ray.cost_usd, 100 * ray.slo_attainment, args.flavor, title, Path(args.plot))
    text = f"""# Fixed fleets in hindsight vs rayscale: {title}

{platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}; `python -m bench.static_fleet --trace {args.trace} --flavor {args.flavor} --sizes {args.sizes}` ({wall:.0f} s); model {MODEL}, shipped catalog, the trace's own request mix declared; simulator defaults.

{__doc__.split(chr(10) + chr(10), 2)[2]}
```
{format_table(["fleet", "SLO met", "TTFT p95 s", "TPOT p95 s", "accel h", "cost $"], rows)}
```

{cheapest}; rayscale {100 * ray.slo_attainment:.2f}% at ${ray.cost_usd:.2f} for {ray.accelerator_hours:.2f} accelerator-hours
(it runs spot for up to the flavor's spot_max_share, which a fixed on-demand fleet does not: compare
accelerator-hours for the fleet, dollars for the bill).

![SLO attainment against cost]({Path(args.plot).name})
"""
    Path(args.out).write_text(text)
    print(text)
    return 0


def _plot(pts: list[tuple[float, float, int]], ray_usd: float, ray_slo: float, flavor: str, title: str,
          path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color="tab:gray", label=f"fixed {flavor} fleets")
    for usd, slo, n in pts:
        ax.annotate(str(n), (usd, slo), textcoords="offset points", xytext=(3, -10), fontsize=7)
    ax.scatter([ray_usd], [ray_slo], marker="*", s=120, color="tab:red", label="rayscale (steady state)", zorder=3)
    ax.axhline(99.0, color="k", lw=0.6, ls="--")
    ax.set_xlabel("cost $")
    ax.set_ylabel("SLO attainment %")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
