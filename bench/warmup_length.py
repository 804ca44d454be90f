"""How much of a steady-state result is the warm-up's own past: the shipped product warmed up on one draw of
the same traffic (what bench.eval_split scores as steady state) and on two, side by side.

    .venv/bin/python -m bench.warmup_length [--seeds 0,1,2,3,4] [--jobs 2] [--split dev|held-out|both]
        [--case TEXT] [--draws 1,2] [--settings FILE] [--out F]

SLO feedback's record (rayscale.core.feedback) is smoothed over half an hour, and its factor falls at most
``relax_per_h`` an hour: the misses of the warm-up's own first minutes (the first bursts, met before the burst
floor has seen any) can hold the factor at its bound into the scored draw. A deployment that has served the
traffic for days carries no such past. With two draws the scored one starts a whole draw further from the
cold start. The columns give the factor as scoring starts, and what the longer past costs or buys.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from bench.common import emit, machine, span
from bench.eval_split import CASES, case_run, model_of
from rayscale.config import load_settings
from rayscale.core.settings import Settings
from rayscale.sim.policies import RayscalePolicy
from rayscale.sim.simulator import SimConfig, Simulation, simulate
from rayscale.tables import format_table


class _Watched(RayscalePolicy):
    """The product, noting SLO feedback's factor at the first control step of the scored draw."""

    def __init__(self, scoring_s: float, settings: Settings | None = None) -> None:
        super().__init__(settings)
        self.scoring_s = scoring_s
        self.factor_at_scoring: float | None = None

    def control(self, now: float, sim: Simulation) -> None:
        super().control(now, sim)
        if self.factor_at_scoring is None and now >= self.scoring_s:
            rec = self.state.delivered.get(sim.model)
            self.factor_at_scoring = rec.factor if rec is not None else 1.0


def one(case: int, seed: int, draws: int, settings_file: str | None = None) -> dict[str, Any]:
    """The product (with the shipped settings, or the file's) on the ``seed``-th draw of a case, warmed up on
    ``draws`` other draws."""
    label, model = CASES[case][1], model_of(case)
    cat, trace, warm = case_run(case, seed, True, draws=draws)
    settings = load_settings(settings_file)
    policy = _Watched(warm, settings)
    r = simulate(cat, trace, policy, SimConfig(model=model, seed=seed, warmup_s=warm, settings=settings))
    out = {"case": case, "seed": seed, "draws": draws, "slo": r.slo_attainment, "usd": r.cost_usd,
           "factor": policy.factor_at_scoring, "warm_h": warm / 3600.0}
    print(f"  {label} seed={seed} warm-up {draws} draw(s): {100 * r.slo_attainment:.2f}% ${r.cost_usd:.2f}, "
          f"factor at scoring {out['factor']}", flush=True)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """One row per case and warm-up: SLO, $ and the factor at scoring over seeds; $ against the fewest draws."""
    out = []
    for case in sorted({r["case"] for r in rows}):
        split, label = CASES[case][0], CASES[case][1]
        fewest = min(r["draws"] for r in rows if r["case"] == case)
        base = statistics.mean(r["usd"] for r in rows if r["case"] == case and r["draws"] == fewest) or 1.0
        for draws in sorted({r["draws"] for r in rows if r["case"] == case}):
            rs = [r for r in rows if r["case"] == case and r["draws"] == draws]
            usd = statistics.mean(r["usd"] for r in rs)
            out.append([split, label, draws, f"{statistics.mean(r['warm_h'] for r in rs):.1f}", len(rs),
                        span([r["slo"] for r in rs], True), span([r["usd"] for r in rs], False),
                        span([r["factor"] for r in rs], False), f"{usd / base:.2f}x"])
    return format_table(["split", "traffic", "warm-up draws", "warm-up h", "seeds", "SLO min/mean/max",
                         "$ min/mean/max", "factor at scoring", "$ vs fewest draws"], out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--split", choices=["both", "dev", "held-out"], default="both")
    ap.add_argument("--case", default="", help="only the split's cases whose label holds this text")
    ap.add_argument("--draws", default="1,2", help="warm-up lengths, in draws of the traffic")
    ap.add_argument("--settings", default=None, help="the product's settings file (default: the shipped one)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    draws = [int(x) for x in args.draws.split(",")]
    splits = ("dev", "held-out") if args.split == "both" else (args.split,)
    cases = [i for i, c in enumerate(CASES) if c[0] in splits and args.case in c[1]]
    jobs = [(c, s, d, args.settings) for c in cases for s in seeds for d in draws]
    print(f"{len(jobs)} runs on {args.jobs} processes", flush=True)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(one, *zip(*jobs, strict=True)))
    wall = time.perf_counter() - t0
    flags = (f" --case {args.case!r}" if args.case else "") + (f" --settings {args.settings}" if args.settings else "")
    text = (f"# Steady state and the warm-up's length\n\n{machine()}; `python -m bench.warmup_length --seeds "
            f"{args.seeds} --split {args.split}{flags} --draws {args.draws}` ({wall:.0f} s on {args.jobs} processes); "
            f"{'settings ' + args.settings if args.settings else 'shipped settings'}, shipped catalog, on-demand "
            "only, fluid engine, no request mix declared.\n\n"
            + __doc__.split("\n\n", 2)[2] + "\n```\n" + table(rows) + "\n```\n")
    return emit(text, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
