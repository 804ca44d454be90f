"""The simulator's prefix caches: vLLM's block reuse (cached prompt tokens are not prefilled), LRU eviction within
the replica's KV capacity, the hit-rate counters, and hash ids carried through trace loading and reshaping."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rayscale.config import load_catalog
from rayscale.sim.engine import DONE, Engine, EngineConfig, make_engine
from rayscale.sim.policies import make_policy
from rayscale.sim.prefix import PrefixCaches
from rayscale.sim.simulator import SimConfig, Simulation
from rayscale.sim.trace import Trace, hash_array, load_trace

PROF = load_catalog().profile("mistral-7b", "a10g")
BS = 512
FLUID = EngineConfig()
ITERATION = EngineConfig(model="iteration")


def run(arr, prompt, output, hashes, cfg=FLUID, profile=PROF) -> Engine:
    e = make_engine(np.asarray(arr, float), np.asarray(prompt), np.asarray(output), cfg,
                    hash_ids=hash_array(hashes), block_tokens=BS)
    e.add_replica(profile, 0)
    t = 0.0
    while e.in_flight or e.q_head < len(arr):
        e.step(t, cfg.tick_s)
        t += cfg.tick_s
    assert (e.status == DONE).all()
    return e


def hashes(tr: Trace) -> list[tuple[int, ...]]:
    assert tr.hash_ids is not None
    return list(tr.hash_ids.tolist())


def alone(prompt: int, cfg: EngineConfig) -> float:
    """TTFT of one request with nothing cached."""
    return float(run([0.0], [prompt], [4], [()], cfg).ttft[0])


@pytest.mark.parametrize("cfg", [FLUID, ITERATION], ids=["fluid", "iteration"])
def test_cached_prefix_is_not_prefilled(cfg: EngineConfig) -> None:
    # The second request shares its first 6 blocks with the first, which finished long before.
    first = tuple(range(8))
    second = (*range(6), 100, 101)
    e = run([0.0, 60.0], [8 * BS, 8 * BS], [4, 4], [first, second], cfg)
    assert e.Pf[1] == 2 * BS  # 6 x 512 tokens found cached: 1,024 prefilled
    assert e.ttft[1] == pytest.approx(alone(2 * BS, cfg), rel=1e-4)
    assert e.ttft[1] < 0.5 * e.ttft[0]
    assert e.prefix is not None
    assert (e.prefix.queries[0], e.prefix.hits[0]) == (16 * BS, 6 * BS)


def test_same_prompt_again_recomputes_its_last_block() -> None:
    # vLLM hits at most prompt - 1 tokens: the last token is computed for the first token's logits, and
    # with block-aligned hits that is the whole last block.
    e = run([0.0, 60.0], [4 * BS, 4 * BS], [4, 4], [(1, 2, 3, 4), (1, 2, 3, 4)])
    assert e.Pf[1] == BS
    # A partial last block is never cached: 3 full blocks of a 3.5-block prompt, all of them hit.
    e = run([0.0, 60.0], [4 * BS - 256, 4 * BS - 256], [4, 4], [(1, 2, 3, 4), (1, 2, 3, 4)])
    assert e.Pf[1] == BS - 256


def test_no_reuse_without_caching_or_across_replicas() -> None:
    hashes = [tuple(range(8)), tuple(range(8))]
    off = run([0.0, 60.0], [8 * BS] * 2, [4, 4], hashes, EngineConfig(prefix_caching=False))
    assert off.prefix is None
    assert off.ttft[1] == pytest.approx(off.ttft[0], rel=1e-6)
    assert off.prefix_hit_rate(100.0, 30.0) is None  # caching off: no metric, not a hit rate of 0
    # Two replicas, both requests at once: least-loaded routing puts them on different replicas, whose
    # caches are their own.
    e = make_engine(np.array([0.0, 0.0]), np.array([8 * BS] * 2), np.array([4, 4]), FLUID,
                    hash_ids=hash_array(hashes), block_tokens=BS)
    e.add_replica(PROF, 0)
    e.add_replica(PROF, 0)
    for k in range(400):
        e.step(k * 0.25, 0.25)
    assert (e.status == DONE).all()
    assert e.prefix is not None and e.prefix.total_hits == 0


def test_lru_evicts_when_kv_is_full_prefix_last() -> None:
    pc = PrefixCaches(hash_array([(1, 2, 3), (4, 5), (1, 2, 3), (6, 7, 8, 9), (4, 5)]),
                      np.array([3 * BS + 1, 2 * BS + 1, 3 * BS + 1, 4 * BS + 1, 2 * BS + 1]), BS)
    pc.add_replica(4 * BS)  # room for 4 blocks
    assert pc.admit(0, 0) == 0
    assert pc.admit(1, 0) == 0  # 5 blocks: the least recently used goes, the first request's tail block
    assert list(pc.caches[0]) == [2, 1, 5, 4]
    assert pc.admit(2, 0) == 2 * BS  # its prefix survived its tail
    assert pc.admit(3, 0) == 0  # 4 new blocks fill the cache: everything older is evicted
    assert pc.admit(4, 0) == 0
    assert len(pc.caches[0]) == 4
    assert pc.total_queries == 14 * BS + 5 and pc.total_hits == 2 * BS


def test_engine_cache_capacity_is_the_replicas_kv() -> None:
    # A replica whose KV holds 10 blocks: the second conversation's 7 full blocks push 4 of the first's out,
    # its tail first, so the first 3 blocks are still found.
    small = PROF.model_copy(update={"kv_tokens": 10 * BS})
    a, b = tuple(range(8)), tuple(range(100, 108))
    e = run([0.0, 60.0, 120.0], [8 * BS - 100] * 3, [4, 4, 4], [a, b, a], FLUID, small)
    assert e.Pf[2] == 8 * BS - 100 - 3 * BS
    big = run([0.0, 60.0, 120.0], [8 * BS - 100] * 3, [4, 4, 4], [a, b, a])
    assert big.Pf[2] == BS - 100  # with room, 7 full blocks are found


def test_hit_rate_over_the_window() -> None:
    e = make_engine(np.array([0.0, 60.0]), np.array([8 * BS] * 2), np.array([4, 4]), FLUID,
                    hash_ids=hash_array([tuple(range(8))] * 2), block_tokens=BS)
    e.add_replica(PROF, 0)
    seen = {}
    for k in range(800):  # 200 s, read every 10 s as the simulator's control loop reads its signals
        if k % 40 == 0:
            seen[k // 4] = e.prefix_hit_rate(k * 0.25, 30.0)
        e.step(k * 0.25, 0.25)
    assert seen[0] is None  # nothing looked up yet
    assert seen[30] == 0.0  # the first request looked up, found nothing
    assert seen[70] == pytest.approx(7 / 8)  # the window holds the second alone: 7 of its 8 blocks found
    assert seen[120] is None  # nothing looked up in the window: not observed


def test_hit_rate_per_flavor() -> None:
    """Each flavor's replicas count their own lookups (vLLM's counters carry the replica's flavor): a rate seen
    on one flavor is not another's."""
    e = make_engine(np.array([0.0, 60.0, 120.0]), np.array([8 * BS] * 3), np.array([4] * 3), FLUID,
                    hash_ids=hash_array([tuple(range(8))] * 3), block_tokens=BS)
    e.add_replica(PROF, 0)
    seen = {}
    for k in range(800):
        t = k * 0.25
        if k == 400:  # at 100 s the flavor-0 replica is let go and one of flavor 1 takes the traffic
            e.drain(0)
            e.add_replica(PROF, 1)
        if k % 40 == 0:
            seen[int(t)] = (e.prefix_hit_rate(t, 30.0), e.prefix_hit_rate(t, 30.0, 0), e.prefix_hit_rate(t, 30.0, 1))
        e.step(t, 0.25)
    assert seen[70] == (pytest.approx(7 / 8), pytest.approx(7 / 8), None)  # flavor 1 has looked nothing up
    # The third request finds nothing on the new flavor's empty cache; flavor 0 saw no lookup in the window.
    assert seen[130] == (0.0, None, 0.0)
    assert e.prefix_hit_rate(130.0, 30.0, 5) is None  # a flavor index with no replica


def test_trace_keeps_hash_ids(tmp_path: Path) -> None:
    lines = [{"timestamp": 2000, "input_length": 1100, "output_length": 3, "hash_ids": [7, 8, 9]},
             {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [7, 10]},
             {"timestamp": 1000, "input_length": 50, "output_length": 1}]
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines))
    tr = load_trace(p)
    assert hashes(tr) == [(7, 10), (), (7, 8, 9)]  # sorted with their requests
    assert tr[2].hash_ids == (7, 8, 9)
    assert hashes(tr.time_scale(2.0)) == hashes(tr)
    assert hashes(tr.window(0.5, 3.0)) == [(), (7, 8, 9)]
    rep = hashes(tr.repeat(2))
    assert rep[:3] == hashes(tr)
    assert not set(rep[3]) & {7, 8, 9, 10}  # a second pass is new traffic, not the same prompts
    assert len(hashes(tr.then(tr))) == 6
    for seed in range(3):
        r = tr.resample(seed, bin_s=1.0)
        got = {(int(x), h) for x, h in zip(r.prompt_tokens, hashes(r), strict=True)}
        assert got <= {(600, (7, 10)), (50, ()), (1100, (7, 8, 9))}
    scaled = tr.rate_scale(3.0, seed=1)
    assert len(scaled) == 9 and len({h for h in hashes(scaled) if h}) == 6  # copies: ids of their own
    assert Trace.from_arrays([0.0], [10], [1]).hash_ids is None
    with pytest.raises(ValueError, match="hash_ids"):
        Trace(np.zeros(2), np.ones(2, dtype=np.int64), np.ones(2, dtype=np.int64), "t", hash_array([()]))


def test_engine_without_hashes_is_unchanged() -> None:
    e = Engine(np.array([0.0, 1.0]), np.array([4000, 4000]), np.array([10, 10]))
    assert e.prefix is None and e.Pf is e.P


@pytest.mark.parametrize("caching", [True, False])
def test_simulation_signals_carry_the_hit_rate(caching: bool) -> None:
    # One request a second, each 8 blocks: a 6-block shared system prompt, then 2 blocks of its own.
    n = 300
    hashes = [(*range(6), 1000 + 2 * i, 1001 + 2 * i) for i in range(n)]
    tr = Trace.from_arrays(np.arange(n, dtype=float), np.full(n, 8 * BS), np.full(n, 50), "shared-prefix", hashes)
    cfg = SimConfig(engine=EngineConfig(prefix_caching=caching))
    sim = Simulation(load_catalog(), tr, make_policy("rayscale", cfg.settings), cfg)
    sim.begin()
    while sim.now < 240.0:
        sim.tick()
    sig = sim.signals(sim.now)
    if caching:
        # Replicas already serving find the system prompt: up to 6 of 8 blocks, less on a new replica.
        assert sig.prefix_hit_rate is not None and 0.4 < sig.prefix_hit_rate <= 0.75
        rates = {f: o.prefix_hit_rate for f, o in sig.per_flavor.items()}
        assert rates and all(r is not None and 0.4 < r <= 0.75 for r in rates.values())
        if len(rates) == 1:
            assert next(iter(rates.values())) == pytest.approx(sig.prefix_hit_rate)
    else:
        assert sig.prefix_hit_rate is None
        assert all(o.prefix_hit_rate is None for o in sig.per_flavor.values())
