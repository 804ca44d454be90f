"""One control step's time, in a form that also runs against another checkout's rayscale (``bench.planner
--against REV``): it imports only what every version since the step was shared has (rayscale.core.step, the
signals, the gangs) and `bench.planner.synthetic` from the checkout it measures."""

from __future__ import annotations

import functools
import gc
import json
import math
import random
import statistics
import sys
import time
from dataclasses import replace

from rayscale.core.act import Gang, GangPhase
from rayscale.core.catalog import Catalog
from rayscale.core.gangs import gang_shape
from rayscale.core.settings import Settings
from rayscale.core.signals import FlavorObservation, ModelSignals, RequestMix
from rayscale.core.step import ServeView, StepContext, StepState, step

DEFAULT_GC = gc.get_threshold()
# Later steps start this long after the first: every model past its scale-down wait and dwell, as in a fleet
# that has run a while, so the checks a settled fleet gets (a steady model's move) are timed too.
LATER_S = 3600.0


def settle_heap() -> None:
    """The controller's own process set-up (rayscale.controller.heap); where the checkout has none, what its
    controller did then: freeze what is loaded."""
    try:
        from rayscale.controller.heap import settle_heap as settle
    except ImportError:
        gc.collect()
        gc.freeze()
        return
    settle()


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


class Observed:
    """Signals as a running fleet reports them, new every period: each model's prompts drift (a random walk,
    0.5% a period: the mix spans its last 1,000 requests), its prefix-cache hit rate is read over the 30 s
    window (0.1-0.5, moving 0.02 a period), and every flavor it runs reports its latency (TPOT and prefill
    within 10% of a fixed reading), so the corrections are updated for every running pair."""

    def __init__(self, signals: dict[str, ModelSignals], seed: int = 0) -> None:
        self.base, self.rnd = signals, random.Random(seed)
        self.prompt = dict.fromkeys(signals, 1.0)
        self.hit = {m: self.rnd.uniform(0.1, 0.5) for m in signals}

    def next(self, gangs: tuple[Gang, ...]) -> dict[str, ModelSignals]:
        rnd, replicas = self.rnd, dict[str, dict[str, int]]()
        for g in gangs:
            per = replicas.setdefault(g.model, {})
            per[g.flavor] = per.get(g.flavor, 0) + g.serving
        out = {}
        for m, s in self.base.items():
            assert s.mix is not None
            self.prompt[m] *= math.exp(rnd.gauss(0.0, 0.005))
            self.hit[m] = min(max(self.hit[m] + rnd.gauss(0.0, 0.02), 0.1), 0.5)
            k = self.prompt[m]
            mix = RequestMix(s.mix.prompt_mean * k, s.mix.output_mean, s.mix.prompt_p95 * k)
            per_flavor = {f: FlavorObservation(replicas=n, running_per_replica=4.0, completed=50.0,
                                               tpot_p95_s=0.05 * rnd.uniform(0.9, 1.1), prompt_mean=mix.prompt_mean,
                                               prefill_mean_s=0.2 * rnd.uniform(0.9, 1.1))
                          for f, n in replicas.get(m, {}).items()}
            out[m] = replace(s, mix=mix, waiting=0.0, per_flavor=per_flavor, prefix_hit_rate=self.hit[m])
        return out


def time_step(cat: Catalog, sig: dict[str, ModelSignals], repeat: int, observed: bool = False,
              default_gc: bool = False) -> tuple[float, float, int]:
    """(first step ms, median ms of the steps after it, nodes in the view): the whole control period with
    the shipped settings, on an empty cluster, then on the cluster its plan asked for (later steps carry the
    state of the one before: the estimator's searches start at the last answer). ``observed``: the later
    steps read new signals every period (Observed), made before the clock starts. The process is set up as
    `rayscale controller` sets up its own first (settle_heap); ``default_gc``: with CPython's collector
    settings instead (the catalog frozen all the same), the baseline for settle_heap's."""
    settle_heap()
    if default_gc:
        gc.set_threshold(*DEFAULT_GC)
    t = time.perf_counter()
    first = step(StepContext(0.0, cat, sig, (), ServeView({}, {}), Settings(), StepState()))
    first_ms = (time.perf_counter() - t) * 1000
    gangs, serve = cluster_view(cat, first.plan.target())
    state, times, feed = first.state, [], Observed(sig)
    for i in range(repeat):
        now_sig = feed.next(gangs) if observed else sig
        t = time.perf_counter()
        state = step(StepContext(LATER_S + 5 * i, cat, now_sig, gangs, serve, Settings(), state)).state
        times.append(time.perf_counter() - t)
    return first_ms, statistics.median(times) * 1000, sum(g.nodes for g in gangs)


def later_steps_json(root: str, repeat: int) -> str:
    """Median ms of later steps per kind of signals, 1,000 models x 20 flavors at 3x demand, with the rayscale
    and bench.planner of the checkout at ``root``: run in a process of its own whose path starts there
    (bench.planner.against_table)."""
    assert sys.path[0] == root, "the checkout's rayscale must be imported before this module's"
    from bench.planner import synthetic

    cat, sig = synthetic(1000, rate_scale=3.0, device_limit=1200)
    return json.dumps({kind: time_step(cat, sig, repeat, kind == "observed")[1] for kind in ("fixed", "observed")})


def later_steps_reduced(root: str, steps: int, observed: bool) -> None:
    """``steps`` later steps (1,000 x 20, 3x demand) run inside one ``functools.reduce`` call and nothing else
    there, after a step that warms the state: what ``valgrind --tool=callgrind --toggle-collect=functools_reduce``
    counts (bench.planner.instructions_table). Signals and cluster view are made before it."""
    assert sys.path[0] == root, "the checkout's rayscale must be imported before this module's"
    from bench.planner import synthetic

    cat, sig = synthetic(1000, rate_scale=3.0, device_limit=1200)
    settle_heap()
    first = step(StepContext(0.0, cat, sig, (), ServeView({}, {}), Settings(), StepState()))
    gangs, serve = cluster_view(cat, first.plan.target())
    feed = Observed(sig)
    feeds = [feed.next(gangs) if observed else sig for _ in range(steps + 1)]
    warm = step(StepContext(LATER_S, cat, feeds[0], gangs, serve, Settings(), first.state)).state

    def later(state: StepState, i: int) -> StepState:
        return step(StepContext(LATER_S + 5.0 * (i + 1), cat, feeds[i + 1], gangs, serve, Settings(), state)).state

    functools.reduce(later, range(steps), warm)


if __name__ == "__main__":
    if len(sys.argv) > 3:
        later_steps_reduced(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "observed")
    else:
        print(later_steps_json(sys.argv[1], int(sys.argv[2])))
