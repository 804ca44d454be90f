"""Planner time per reconcile for 1, 10, 100, 1,000 models x 20 flavors, and the exact-vs-greedy cost gap.

    .venv/bin/python -m bench.planner [--out bench/results/planner.md] [--against REV]

Synthetic catalogs: 20 flavors (prices and speeds spread like the shipped ones, half with spot at a 50%
share cap, device limits that bind at 1,000 models), every model allowed on 8-20 of them, demand
0.5-40 req/s. Time is estimate + plan from scratch (no current replicas), median of repeated runs; then
whole control steps (bench.step_timing), and with ``--against REV`` the same steps with git REV's rayscale,
timed and (with valgrind installed) counted in instructions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import scipy

from bench.common import machine
from bench.step_timing import time_step
from rayscale.core.catalog import (
    SLO,
    CapacityType,
    Catalog,
    Flavor,
    FlavorLimits,
    InstanceType,
    ModelSpec,
    Parallelism,
    Profile,
    profile_key,
)
from rayscale.core.estimate import estimate
from rayscale.core.plan import PlannerSettings, plan
from rayscale.core.signals import Freshness, ModelSignals, RequestMix
from rayscale.tables import format_table


def synthetic(n_models: int, n_flavors: int = 20, seed: int = 0, rate_scale: float = 1.0,
              device_limit: int = 400) -> tuple[Catalog, dict[str, ModelSignals]]:
    """``rate_scale`` x the demand and ``device_limit`` devices a flavor: 3 and 1,200 make 1,000 models
    converge to ~10,000 nodes."""
    rnd = random.Random(seed)
    flavors, profiles, models, signals = {}, {}, {}, {}
    for i in range(n_flavors):
        speed = rnd.uniform(0.5, 4.0)
        spot = i % 2 == 0
        flavors[f"f{i}"] = Flavor(
            name=f"f{i}", accelerator="synthetic", kind="gpu", resource_name="nvidia.com/gpu",
            instance_types=[
                InstanceType(name=f"x{i}.1", devices=1, device_memory_gib=24, vcpu=4, memory_gib=16,
                             on_demand_usd_per_h=round(0.8 * speed * rnd.uniform(0.8, 1.3), 3),
                             price_source="nominal: synthetic"),
                InstanceType(name=f"x{i}.4", devices=4, device_memory_gib=24, vcpu=48, memory_gib=192,
                             on_demand_usd_per_h=round(3.4 * speed * rnd.uniform(0.8, 1.3), 3),
                             price_source="nominal: synthetic"),
            ],
            capacity_types=[CapacityType.ON_DEMAND, CapacityType.SPOT] if spot else [CapacityType.ON_DEMAND],
            spot_max_share=0.5 if spot else 0.0,
            limits=FlavorLimits(devices=device_limit),
        )
        for m in range(n_models):
            profiles[profile_key(f"m{m}", f"f{i}")] = Profile(
                model=f"m{m}", flavor=f"f{i}", prefill_tokens_per_s=4000 * speed, itl_alpha_s=0.035 / speed ** 0.5,
                itl_beta_s=0.0005 / speed, kv_tokens=int(50000 * speed), startup_s=270, source="estimate: synthetic")
    for m in range(n_models):
        allowed = sorted(rnd.sample(range(n_flavors), rnd.randint(8, n_flavors)))
        tp = rnd.choice([1, 1, 1, 2, 4])
        models[f"m{m}"] = ModelSpec(name=f"m{m}", model=f"m{m}", slo=SLO(ttft_p95_s=2.0, tpot_p95_s=0.1),
                                    parallelism={f"f{i}": Parallelism(tp=tp) for i in allowed},
                                    priority=rnd.randint(0, 5), max_replicas=64)
        mix = RequestMix(rnd.uniform(200, 2000), rnd.uniform(50, 400), 0)
        mix = RequestMix(mix.prompt_mean, mix.output_mean, mix.prompt_mean * 3)
        signals[f"m{m}"] = ModelSignals(f"m{m}", Freshness.FRESH, 1.0, rate_scale * rnd.uniform(0.5, 40.0), mix)
    prof = {k: v for k, v in profiles.items() if k.split("/")[0] in models}
    return Catalog(models=models, flavors=flavors, profiles=prof), signals


def time_plan(cat: Catalog, sig: dict[str, ModelSignals], solver: str, repeat: int) -> tuple[float, float, int]:
    times = []
    cost, short = 0.0, 0
    for _ in range(repeat):
        t = time.perf_counter()
        p, _ = plan(cat, estimate(cat, sig), settings=PlannerSettings(solver=solver))
        times.append(time.perf_counter() - t)
        cost, short = p.usd_per_h, len(p.shortfalls)
    return statistics.median(times) * 1000, cost, short


def plan_table(sizes: list[int]) -> str:
    """Estimate + plan from scratch per catalog size: each solver's median time, cost and shortfalls."""
    rows = []
    for n in sizes:
        cat, sig = synthetic(n)
        repeat = 7 if n <= 100 else 3
        auto_ms, _, _ = time_plan(cat, sig, "auto", repeat)
        g_ms, g_cost, g_short = time_plan(cat, sig, "greedy", repeat)
        e_ms, e_cost, e_short = time_plan(cat, sig, "exact", 1 if n >= 1000 else repeat)
        gap = (g_cost - e_cost) / e_cost * 100 if e_cost else 0.0
        p, _ = plan(cat, estimate(cat, sig))
        rows.append([n, 20, p.method, round(auto_ms, 1), round(e_ms, 1), round(g_ms, 1), round(e_cost, 2),
                     round(g_cost, 2), f"{gap:+.2f}%", f"{e_short}/{g_short}"])
        print(f"{n} models done", flush=True)
    return format_table(["models", "flavors", "auto uses", "auto ms", "exact ms", "greedy ms", "exact $/h",
                         "greedy $/h", "greedy gap", "shortfalls e/g"], rows)


def step_table(sizes: list[int]) -> str:
    """One whole step with the shipped settings, first and later, per catalog size of 100 models or more."""
    step_rows = []
    for n in [x for x in sizes if x >= 100]:
        for scale, limit in [(1.0, 400)] + ([(3.0, 1200)] if n >= 1000 else []):
            cat, sig = synthetic(n, rate_scale=scale, device_limit=limit)
            for observed in (False, True):
                first, later, nodes = time_step(cat, sig, 5, observed)
                _, later_default_gc, _ = time_step(cat, sig, 5, observed, default_gc=True)
                step_rows.append([n, 20, f"{scale:g}x", limit, nodes, "observed" if observed else "fixed",
                                  round(first, 1), round(later, 1), round(later_default_gc, 1)])
    return format_table(["models", "flavors", "demand", "devices/flavor", "nodes in view", "signals",
                         "first step ms", "later steps ms", "later, default GC"], step_rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,10,100,1000")
    ap.add_argument("--out")
    ap.add_argument("--against", metavar="REV",
                    help="also time later steps with the rayscale of git revision REV, alternating with this checkout's")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    table = plan_table(sizes)
    print(table)
    steps = step_table(sizes)
    print(steps)
    against = against_table(args.against) if args.against else ""
    print(against)
    counted = instructions_table(args.against) if args.against else ""
    print(counted)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report(table, steps, args.against, against, counted))


def report(table: str, steps: str, rev: str | None, against: str, counted: str) -> str:
    """The markdown record of one run."""
    text = ("# Planner benchmark\n\n"
            f"Command: `.venv/bin/python -m bench.planner {' '.join(sys.argv[1:])}`\n\n"
            f"Machine: {machine()}; Python {platform.python_version()}, SciPy {scipy.__version__} (HiGHS).\n\n"
            "Time is one reconcile (estimate + plan) from scratch, median. Goal: 100 x 20 <= 50 ms, "
            "1,000 x 20 <= 200 ms.\n\n```\n" + table + "\n```\n")
    text += ("\nOne `rayscale.core.step.step` (history, corrections, estimate, plan, act decisions) with the "
             "shipped settings: first on an empty cluster, then on the cluster its plan asked for (every "
             "replica a ready gang) an hour later (every model past its scale-down wait, so a steady model's "
             "move is checked), carrying the state of the step before; median of 5 later steps. "
             "Signals `fixed`: the same every period; `observed`: new every period as a running fleet "
             "reports them (prompts drifting 0.5% a period, prefix-cache hit rates 0.1-0.5 read over 30 s, "
             "every running flavor's latency, so corrections update; `bench.planner.Observed`). The "
             "process's collector is set up as `rayscale controller` does "
             "(`rayscale.controller.heap.settle_heap`); `later, default GC` is the same steps with "
             "CPython's thresholds. Goal: 1,000 x 20 with ~10,000 nodes in the view <= 200 ms.\n\n```\n"
             + steps + "\n```\n")
    if against:
        text += (f"\nThe same later steps (1,000 x 20, 3x demand) with the rayscale of git {rev} and "
                 "with this checkout's, each in a process of its own, alternating (`--against "
                 f"{rev}`; `bench/step_timing.py`):\n\n```\n" + against + "\n```\n")
        text += ("\nWall time on a shared 2-core host can move by a third from one run to the next: the "
                 "alternating rounds, their fastest, and the instruction counts below compare code; a single "
                 "figure above describes the host at that moment as much as the step.\n")
    if counted:
        text += ("\nInstructions per later step of the same two, counted by valgrind's callgrind over 2 steps "
                 "(`bench.planner.instructions_table`): exact and repeatable where the wall time of a shared "
                 "host is not, blind to memory stalls (the collector's scans among them).\n\n```\n"
                 + counted + "\n```\n")
    return text


ROOT = Path(__file__).resolve().parent.parent
TIMING = str(ROOT / "bench" / "step_timing.py")


def _timing_code(where: str, *args: str) -> str:
    """Python code running bench/step_timing.py with ``args`` on the checkout at ``where``: its rayscale first on
    the path, before step_timing imports any."""
    return (f"import sys, runpy; sys.path.insert(0, {where!r}); sys.argv = ['', {where!r}, *{list(args)!r}]; "
            f"runpy.run_path({TIMING!r}, run_name='__main__')")


def against_table(rev: str, rounds: int = 3) -> str:
    """Median ms of later steps per kind of signals: git ``rev``'s rayscale against this checkout's, ``rounds``
    times alternating (a checkout of ``rev`` in a temporary git worktree), then each one's fastest round (on a
    shared host other tenants only ever add time)."""
    runs: dict[str, list[dict[str, float]]] = {rev: [], "this checkout": []}
    with _worktree(rev) as other:
        for _ in range(rounds):
            for name, where in ((rev, other), ("this checkout", str(ROOT))):
                out = subprocess.run([sys.executable, "-c", _timing_code(where, "5")], check=True,
                                     capture_output=True, text=True, timeout=900)
                runs[name].append(json.loads(out.stdout))
                print(f"{name}: {runs[name][-1]}", flush=True)
    rows = [[kind] + [" / ".join(f"{r[kind]:.1f}" for r in runs[name]) + f" (min {min(r[kind] for r in runs[name]):.1f})"
                      for name in runs] for kind in ("fixed", "observed")]
    return format_table(["signals", f"{rev} ms", "this checkout ms"], rows)


def instructions_table(rev: str, steps: int = 2) -> str:
    """Instructions per later step (1,000 x 20, 3x demand), counted by valgrind's callgrind: git ``rev``'s
    rayscale and this checkout's, per kind of signals. Exact and the same on every run, where wall time on a
    shared host moves by a third; it does not see memory stalls, so it ranks changes to the code, not hosts.
    Empty without valgrind."""
    if shutil.which("valgrind") is None:
        return ""
    cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
           "--callgrind-out-file=/dev/null"]
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # set iteration orders, so the count repeats exactly
    jobs = [(name, kind) for name in (rev, "this checkout") for kind in ("fixed", "observed")]
    with _worktree(rev) as other, ThreadPoolExecutor(2) as pool:
        def count(job: tuple[str, str]) -> float:
            where = other if job[0] == rev else str(ROOT)
            out = subprocess.run([*cmd, sys.executable, "-c", _timing_code(where, str(steps), job[1])], env=env,
                                 check=True, capture_output=True, text=True, timeout=3600)
            return int(re.findall(r"Collected : (\d+)", out.stderr)[-1]) / steps
        got = dict(zip(jobs, pool.map(count, jobs), strict=True))
    rows = [[kind, f"{got[(rev, kind)] / 1e6:,.0f} M", f"{got[('this checkout', kind)] / 1e6:,.0f} M",
             f"{got[('this checkout', kind)] / got[(rev, kind)] - 1:+.1%}"] for kind in ("fixed", "observed")]
    return format_table(["signals", f"{rev}", "this checkout", "change"], rows)


@contextlib.contextmanager
def _worktree(rev: str) -> Iterator[str]:
    """A checkout of git ``rev`` in a temporary worktree."""
    with tempfile.TemporaryDirectory() as tmp:
        other = str(Path(tmp) / "checkout")
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", other, rev], check=True,
                       capture_output=True)
        try:
            yield other
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", other], check=False)


if __name__ == "__main__":
    main()
