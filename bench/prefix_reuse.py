"""Prefix reuse: one hour of Mooncake conversation traffic, rayscale and static-best, prefix caching on and off.

    .venv/bin/python -m bench.prefix_reuse [--seeds 0 1 2] [--write]

The Mooncake synthetic trace (shared prefixes as ``hash_ids``, 512 tokens a block) time-scaled x3.5 to about an
hour, one resampled draw per seed (Trace.resample keeps each request's block hashes). "on": each simulated
replica keeps vLLM's prefix cache (rayscale.sim.prefix: block reuse, LRU within its KV capacity, routing as
Serve routes, without affinity), and rayscale's estimator discounts prefill by the hit rate the engines report
(vllm:prefix_cache_hits / queries); "off": ``EngineConfig(prefix_caching=False)``, no cache and no metric.
static-best is the cheapest fixed fleet that meets the SLO on the replay itself (its search replays the same
engine, cache included). Hit rate: prompt tokens found cached over prompt tokens looked up, whole run. Each
cell: min / mean / max over the seeds; replay s is the scored run's wall time, total s adds static-best's
search (the replays of candidate fleets it runs first), cpu s is the CPU time of total s (the wall time on an
otherwise idle core; the 2 cores here are shared, so wall time varies with others' load).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench.common import ROOT, machine, span
from rayscale.config import load_catalog
from rayscale.core.catalog import Catalog
from rayscale.sim.engine import EngineConfig
from rayscale.sim.prefix import PrefixCaches
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.sim.sources import load_spec
from rayscale.tables import format_table

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic.jsonl"
POLICIES = ("rayscale", "static-best")
TIME_SCALE = 3.5


@dataclass(frozen=True)
class Run:
    policy: str
    caching: bool
    seed: int
    slo: float
    cost_usd: float
    hit_rate: float  # NaN with caching off
    replay_s: float  # the scored replay alone
    total_s: float  # with static-best's search (its replays of candidate fleets)
    cpu_s: float  # this process's CPU time for total_s: what wall time is on an idle core
    rejected: int


def one(cat: Catalog, policy: str, caching: bool, seed: int) -> Run:
    tr = load_spec(str(TRACE), seed=seed, time_scale=TIME_SCALE, resample=True)
    cfg = SimConfig(seed=seed, engine=replace(EngineConfig(), prefix_caching=caching))
    t0, c0 = time.perf_counter(), time.process_time()
    r = simulate(cat, tr, policy, cfg)
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    hit = float(r.extra.get("prefix_hit_rate", float("nan")))
    search = float(r.extra.get("search_wall_s", 0.0))
    return Run(policy, caching, seed, r.slo_attainment, r.cost_usd, hit, total - search, total, cpu,
               r.rejected_requests)


def one_cache_hit_rate(seed: int) -> float:
    """The hit rate of one replica with unbounded KV serving the whole draw in arrival order: what no fleet beats."""
    tr = load_spec(str(TRACE), seed=seed, time_scale=TIME_SCALE, resample=True)
    assert tr.hash_ids is not None
    pc = PrefixCaches(tr.hash_ids, tr.prompt_tokens, tr.hash_block_tokens)
    pc.add_replica(2**62)
    for q in range(len(tr)):
        pc.admit(q, 0)
    return pc.total_hits / pc.total_queries


def table(runs: list[Run]) -> str:
    rows = []
    for policy in POLICIES:
        for caching in (False, True):
            rs = [r for r in runs if r.policy == policy and r.caching == caching]
            hits = [r.hit_rate for r in rs]
            rows.append([policy, "on" if caching else "off", span([r.slo for r in rs], True),
                         span([r.cost_usd for r in rs], False), span(hits, True) if caching else "-",
                         f"{statistics.mean(r.replay_s for r in rs):.1f}", f"{max(r.total_s for r in rs):.1f}",
                         f"{max(r.cpu_s for r in rs):.1f}",
                         " / ".join(str(r.rejected) for r in rs)])
    return format_table(["policy", "prefix cache", "SLO", "cost $", "hit rate", "replay s (mean)",
                         "total s (max)", "cpu s (max)", "rejected per seed"], rows)


def savings(runs: list[Run]) -> str:
    lines = []
    for policy in POLICIES:
        off = statistics.mean(r.cost_usd for r in runs if r.policy == policy and not r.caching)
        on = statistics.mean(r.cost_usd for r in runs if r.policy == policy and r.caching)
        lines.append(f"- {policy}: ${off:.2f} without the cache, ${on:.2f} with it ({100 * (on - off) / off:+.1f}%).")
    return "\n".join(lines)


NOTES = """Each replica has its own cache and Serve routes without prefix affinity, so a fleet of more (or
smaller-KV) replicas finds less of each prompt than one large replica: the hit rate is the fleet's, and falls
as a policy scales out or moves replicas to another flavor (a new replica starts with an empty cache). The
estimator's discount follows the hit rate the engines report, so it shrinks with it."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--write", action="store_true", help="write bench/results/prefix_reuse.md")
    args = ap.parse_args()
    cat = load_catalog()
    runs = []
    for seed in args.seeds:
        for policy in POLICIES:
            for caching in (False, True):
                r = one(cat, policy, caching, seed)
                runs.append(r)
                print(r, flush=True)
    tr = load_spec(str(TRACE), seed=args.seeds[0], time_scale=TIME_SCALE, resample=True)
    text = (f"# Prefix reuse: rayscale and static-best, prefix caching on and off\n\n{machine()}; "
            f"`python -m bench.prefix_reuse --seeds {' '.join(map(str, args.seeds))}`; about {len(tr)} requests over "
            f"{tr.duration_s:.0f} s per draw, mistral-7b, shipped catalog and settings, fluid engine.\n\n"
            + __doc__.split("\n\n")[2] + "\n\n```\n" + table(runs) + "\n```\n\nMean cost:\n\n" + savings(runs)
            + f"\n\nOne cache with unbounded KV serving every request of a draw would find "
            f"{span([one_cache_hit_rate(s) for s in args.seeds], True)} of the prompt tokens (min / mean / max).\n\n"
            + NOTES + "\n")
    if args.write:
        Path(ROOT / "bench" / "results" / "prefix_reuse.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
