"""Planner time per reconcile for 1, 10, 100, 1,000 models x 20 flavors, and the exact-vs-greedy cost gap.

    .venv/bin/python -m bench.planner [--out bench/results/planner.md]

Synthetic catalogs: 20 flavors (prices and speeds spread like the shipped ones, half with spot at a 50%
share cap, device limits that bind at 1,000 models), every model allowed on 8-20 of them, demand
0.5-40 req/s. Time is estimate + plan from scratch (no current replicas), median of repeated runs.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import time

import scipy

from rayscale.core.act import Gang, GangPhase
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
from rayscale.core.gangs import gang_shape
from rayscale.core.plan import PlannerSettings, plan
from rayscale.core.settings import Settings
from rayscale.core.signals import Freshness, ModelSignals, RequestMix
from rayscale.core.step import ServeView, StepContext, StepState, step
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


def cluster_view(cat: Catalog, target: dict[tuple[str, str, str], int]) -> tuple[tuple[Gang, ...], ServeView]:
    """The cluster a plan converged to: ready gangs serving every replica of ``target``, packed ``slots`` a node."""
    gangs, serve = [], dict[tuple[str, str], int]()
    for (m, f, ct), n in sorted(target.items()):
        shape = gang_shape(cat, m, f)
        for i in range(-(-n // shape.slots)):
            on = min(shape.slots, n - i * shape.slots)
            gangs.append(Gang(f"{m}-{f}-{ct}-{i}", m, f, ct, cat.flavors[f].zones[i % len(cat.flavors[f].zones)],
                              shape.instance_type, shape.nodes, GangPhase.READY, 0.0, serving=on))
        serve[(m, f)] = serve.get((m, f), 0) + n
    return tuple(gangs), ServeView(serve, dict(serve))


def time_step(cat: Catalog, sig: dict[str, ModelSignals], repeat: int) -> tuple[float, float, int]:
    """(first step ms, median ms of the steps after it, nodes in the view): the whole control period with
    the shipped settings, on an empty cluster, then on the cluster its plan asked for (later steps carry the
    state of the one before: the estimator's searches start at the last answer). The catalog is frozen out
    of the garbage collector's reach first, as `rayscale controller` does after loading it."""
    gc.collect()
    gc.freeze()
    t = time.perf_counter()
    first = step(StepContext(0.0, cat, sig, (), ServeView({}, {}), Settings(), StepState()))
    first_ms = (time.perf_counter() - t) * 1000
    gangs, serve = cluster_view(cat, first.plan.target())
    state, times = first.state, []
    for i in range(repeat):
        t = time.perf_counter()
        state = step(StepContext(float(5 * (i + 1)), cat, sig, gangs, serve, Settings(), state)).state
        times.append(time.perf_counter() - t)
    return first_ms, statistics.median(times) * 1000, sum(g.nodes for g in gangs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,10,100,1000")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
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
    table = format_table(["models", "flavors", "auto uses", "auto ms", "exact ms", "greedy ms", "exact $/h",
                          "greedy $/h", "greedy gap", "shortfalls e/g"], rows)
    print(table)
    step_rows = []
    for n in [int(x) for x in args.sizes.split(",") if int(x) >= 100]:
        for scale, limit in [(1.0, 400)] + ([(3.0, 1200)] if n >= 1000 else []):
            cat, sig = synthetic(n, rate_scale=scale, device_limit=limit)
            first, later, nodes = time_step(cat, sig, 3)
            step_rows.append([n, 20, f"{scale:g}x", limit, nodes, round(first, 1), round(later, 1)])
    step_table = format_table(["models", "flavors", "demand", "devices/flavor", "nodes in view", "first step ms",
                               "later steps ms"], step_rows)
    print(step_table)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Planner benchmark\n\n")
            f.write("Command: `.venv/bin/python -m bench.planner --out bench/results/planner.md`\n\n")
            f.write(f"Machine: {platform.machine()}, {platform.processor() or 'cpu'}, 2 cores; Python "
                    f"{platform.python_version()}, SciPy {scipy.__version__} (HiGHS).\n\n")
            f.write("Time is one reconcile (estimate + plan) from scratch, median. Goal: 100 x 20 <= 50 ms, "
                    "1,000 x 20 <= 200 ms.\n\n```\n" + table + "\n```\n")
            f.write("\nOne `rayscale.core.step.step` (history, corrections, estimate, plan, act decisions) with the "
                    "shipped settings: first on an empty cluster, then on the cluster its plan asked for (every "
                    "replica a ready gang), carrying the state of the step before. Goal: 1,000 x 20 with ~10,000 "
                    "nodes in the view <= 200 ms.\n\n```\n" + step_table + "\n```\n")


if __name__ == "__main__":
    main()
