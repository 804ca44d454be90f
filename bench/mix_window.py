"""How many requests the request mix spans: rayscale on the policy bench's traces, per seed, with the mix
taken from the 30 s signal window only against a mix reaching back to at least K requests (up to 900 s).

    .venv/bin/python -m bench.mix_window [--k 0,1000] [--seeds 0,1,2] [--jobs 2] [--out bench/results/mix_window.md]

Each (K, seed) replays the three traces cold and in steady state (played twice, the second pass scored),
as `bench.simulate_policies` does; SimConfig(mix_min_requests=K) is the only difference. The controller
reads the same setting (ControllerConfig.mix_min_requests) from its scrapes.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from bench.simulate_policies import CASES, SHORT
from rayscale.config import load_catalog
from rayscale.core.settings import Settings
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.sim.sources import load_spec
from rayscale.tables import format_table


def one(k: int, seed: int) -> list[tuple[str, float, float, float, float, float]]:
    """(trace, SLO cold, $ cold, SLO steady, $ steady, wall s) per trace for one K and seed."""
    cat = load_catalog()
    cfg = SimConfig(seed=seed, settings=replace(Settings(), mix_min_requests=k))
    out = []
    for name, (_, spec, rate) in zip(SHORT, CASES, strict=True):
        t0 = time.perf_counter()
        tr = load_spec(spec, seed=seed, rate_scale=rate)
        cold = simulate(cat, tr, "rayscale", cfg)
        tr2 = tr.repeat(2)
        steady = simulate(cat, tr2, "rayscale", replace(cfg, warmup_s=float(tr2.arrival_s[len(tr)])))
        out.append((name, cold.slo_attainment, cold.cost_usd, steady.slo_attainment, steady.cost_usd,
                    time.perf_counter() - t0))
        print(f"  K={k} seed={seed} {name}: cold {100 * cold.slo_attainment:.2f}% ${cold.cost_usd:.2f}, "
              f"steady {100 * steady.slo_attainment:.2f}% ${steady.cost_usd:.2f}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", default="0,1000", help="mix_min_requests values; the first is the baseline")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="bench/results/mix_window.md")
    args = ap.parse_args()
    ks = [int(x) for x in args.k.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        futs = {(k, s): pool.submit(one, k, s) for k in ks for s in seeds}
        res = {key: f.result() for key, f in futs.items()}
    base = ks[0]
    rows = []
    for s in seeds:
        for i, name in enumerate(SHORT):
            b = res[(base, s)][i]
            for k in ks:
                r = res[(k, s)][i]
                rows.append([name, s, k, f"{100 * r[1]:.2f}%", round(r[2], 2), f"{100 * r[3]:.2f}%", round(r[4], 2),
                             "" if k == base else f"{100 * (r[2] / b[2] - 1):+.1f}%",
                             "" if k == base else f"{100 * (r[4] / b[4] - 1):+.1f}%"])
    summary = []
    for k in ks[1:]:
        for i, name in enumerate(SHORT):
            dc = [res[(k, s)][i][2] / res[(base, s)][i][2] - 1 for s in seeds]
            ds = [res[(k, s)][i][4] / res[(base, s)][i][4] - 1 for s in seeds]
            slo_c = [100 * (res[(k, s)][i][1] - res[(base, s)][i][1]) for s in seeds]
            slo = [100 * (res[(k, s)][i][3] - res[(base, s)][i][3]) for s in seeds]
            summary.append([name, k, f"{100 * statistics.median(dc):+.1f}%", f"{100 * statistics.median(ds):+.1f}%",
                            f"{min(slo_c):+.2f} .. {max(slo_c):+.2f} pp", f"{min(slo):+.2f} .. {max(slo):+.2f} pp"])
    text = (f"# Request mix window: rayscale with the mix over the 30 s window vs over >= K requests\n\n"
            f"`python -m bench.mix_window --k {args.k} --seeds {args.seeds}` on {platform.node() or 'this machine'} "
            f"({platform.machine()}), {time.perf_counter() - t0:.0f} s wall, {args.jobs} processes.\n\n"
            "The estimator sizes replicas from the mix's tail quantiles (prompt and output lengths at "
            "0.5-0.995). A 30 s window at a few requests a second holds ~60 requests, so those quantiles, and "
            "with them a replica's capacity, swing between control periods (bursty trace: the L40S estimate "
            "swung 2.65-5.06 req/s between bursts, and the 10% scale-down headroom never let the fleet drop a "
            "replica). K = the fewest requests the mix spans, reaching back up to 900 s (0: the window only).\n\n"
            "```\n" + format_table(["trace", "seed", "K", "SLO cold", "$ cold", "SLO steady", "$ steady",
                                    "d$ cold", "d$ steady"], rows) + "\n```\n\n"
            "Median cost change against K = " + str(base) + " over the seeds (the median: one window-only run "
            "can go far astray), and the range of the change in SLO attainment:\n\n```\n"
            + format_table(["trace", "K", "d$ cold", "d$ steady", "d SLO cold", "d SLO steady"], summary) + "\n```\n")
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
