"""The iteration-level engine model (rayscale.sim.iteration) against closed forms and a plain reference."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from rayscale.config import load_catalog
from rayscale.core.catalog import Profile
from rayscale.sim.engine import DONE, FAILED, STOPPED, EngineConfig, make_engine
from rayscale.sim.iteration import IterationEngine
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.sim.trace import Trace

GPU = load_catalog().profile("mistral-7b", "a10g")
# A CPU-like profile with every term of the model: convex prefill, a per-prompt cost, output latency.
CPU = Profile(model="tiny", flavor="cpu", prefill_tokens_per_s=40000, overhead_s=0.008, itl_alpha_s=0.004,
              itl_beta_s=0.0001, prefill_quadratic_s=2e-8, prefill_seq_s=0.0012, prefill_iteration_s=0.0009,
              max_num_seqs=8, kv_tokens=10**6,
              startup_s=1, source="estimate: test")
CPU_FLAT = CPU.model_copy(update={"prefill_quadratic_s": 0.0})
CFG = EngineConfig(model="iteration")


def run(arr, prompt, output, profile=CPU, tick=0.25, replicas=1, budget=2048, until=None):
    cfg = EngineConfig(model="iteration", tick_s=tick, max_num_batched_tokens=budget)
    e = make_engine(np.asarray(arr, float), np.asarray(prompt), np.asarray(output), cfg)
    assert isinstance(e, IterationEngine)
    for _ in range(replicas):
        e.add_replica(profile, 0)
    t, end = 0.0, until if until is not None else max(arr) + 300
    while t < end and (e.in_flight or e.q_head < len(arr)):
        e.step(t, tick)
        t += tick
    return e


def costs(p: Profile):
    b0 = min(p.itl_alpha_s + p.prefill_iteration_s, p.overhead_s - p.prefill_seq_s)
    return b0, p.overhead_s - p.prefill_seq_s - b0


@pytest.mark.parametrize("profile", [CPU, GPU])
@pytest.mark.parametrize("prompt,output,arrival", [(500, 50, 0.1), (2000, 200, 3.37), (10, 2, 0.0), (7, 1, 1.0)])
def test_lone_request_matches_profile_formula(profile, prompt, output, arrival):
    e = run([arrival], [prompt], [output], profile=profile)
    assert e.status[0] == DONE
    assert e.ttft[0] == pytest.approx(profile.ttft_s(prompt), rel=1e-5)
    # Each decode also reads its context, P + 1 + j tokens in its j-th iteration: P + O/2 on average.
    decode = profile.itl_s(1) + 2 * profile.prefill_quadratic_s * (prompt + output / 2)
    assert e.tpot[0] == pytest.approx(decode if output > 1 else 0.0, rel=1e-5)
    assert e.queue_s[0] == pytest.approx(0.0, abs=1e-9)


def test_a_prompt_longer_than_the_budget_pays_one_iteration_base_per_chunk():
    e = run([0.0], [5000], [2], profile=GPU)  # chunks 2048 + 2048 + 904
    b0, front = costs(GPU)
    assert e.ttft[0] == pytest.approx(3 * b0 + 3 * GPU.prefill_seq_s + 5000 / GPU.prefill_tokens_per_s + front, rel=1e-6)


def test_prompts_that_arrive_together_share_one_iteration():
    n = 8  # 8 x 200 tokens fit the 2,048-token budget: one iteration, every first token at its end
    e = run([0.0] * n, [200] * n, [10] * n)
    b0, front = costs(CPU)
    it = b0 + n * CPU.prefill_engine_s(200)
    assert np.allclose(e.ttft, it + front, rtol=1e-6)
    # Then they decode together: itl_s(8) per token, plus attention over all 8 contexts (200 + 10/2 on average).
    assert np.allclose(e.tpot, CPU.itl_s(n) + 2 * CPU.prefill_quadratic_s * n * (200 + 10 / 2), rtol=1e-5)


def test_the_budget_chunks_the_last_prompt_and_decodes_take_a_token_each():
    p = CPU.model_copy(update={"max_num_seqs": 64})
    n = 30  # 3,000 tokens: 20 prompts and 48 tokens of the 21st, then the rest alongside the 20 new decodes
    e = run([0.0] * n, [100] * n, [50] * n, profile=p)
    b0, front = costs(p)
    q, seq, inv_r = p.prefill_quadratic_s, p.prefill_seq_s, 1 / p.prefill_tokens_per_s
    it1 = b0 + 20 * p.prefill_engine_s(100) + seq + 48 * inv_r + q * 48 * 48
    assert np.allclose(e.ttft[:20], it1 + front, rtol=1e-6)
    # Iteration 2: 20 decodes, the 21st's last 52 tokens (48 already computed), then 9 prompts of 100 tokens
    # (2,048 - 20 - 52 = 1,976 tokens of budget: all of them).
    it2 = p.itl_s(20) + 2 * q * 20 * 101 + p.prefill_iteration_s + seq + 52 * inv_r + q * (52 * 52 + 2 * 52 * 48) + 9 * p.prefill_engine_s(100)
    assert np.allclose(e.ttft[20:], it1 + it2 + front, rtol=1e-6)
    assert np.allclose(e.queue_s[:21], 0.0) and np.allclose(e.queue_s[21:], it1, rtol=1e-6)


def test_an_arrival_waits_for_the_iteration_in_flight():
    flat = CPU_FLAT  # decode iterations of equal length: no decode attention
    s1 = flat.itl_s(1)
    t_first = flat.ttft_s(100)  # request 0's first token reaches the client; its iterations end at t_first - front + k s1
    _, front = costs(flat)
    arrive = t_first - front + 10.4 * s1  # in the middle of its 11th decode iteration
    e = run([0.0, arrive], [100, 500], [200, 2], profile=flat)
    boundary = t_first - front + 11 * s1
    assert e.queue_s[1] == pytest.approx(boundary - arrive, rel=1e-6)
    prefill = flat.prefill_iteration_s + flat.prefill_engine_s(500)  # what the prompt adds to that iteration
    assert e.ttft[1] == pytest.approx(boundary - arrive + s1 + prefill + front, rel=1e-6)
    # Request 0's 199 iterations after its first token: one also carried the prompt, the next also decoded it.
    assert e.tpot[0] == pytest.approx(s1 + (prefill + flat.itl_beta_s) / 199, rel=1e-5)


def reference(arr, prompt, output, p: Profile, budget=2048):
    """vLLM V1's scheduler one iteration at a time, plainly: running sequences first (a decode takes one
    token, a partial prompt the rest it needs), then waiting requests FIFO while the budget and max_num_seqs
    allow; arrivals join at the next iteration. Returns (ttft, tpot, queue time)."""
    n = len(arr)
    b0, front = costs(p)
    first, fin, sched = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    t, i, waiting, running = 0.0, 0, deque(), []  # running: [request, prompt left, computed, outputs left]
    while i < n or waiting or running:
        while i < n and arr[i] <= t:
            waiting.append(i)
            i += 1
        if not waiting and not running:
            t = arr[i]
            continue
        left, cost, d, started, ctx = budget, 0.0, 0, [], 0
        for r in running:
            if r[1] == 0:
                d += 1
                left -= 1
                ctx += r[2] + int(output[r[0]]) - r[3]  # prompt + tokens generated so far
        for r in running:
            if r[1] and left > 0:
                started.append((r, min(r[1], left)))
                left -= started[-1][1]
        while waiting and left > 0 and len(running) < p.max_num_seqs:
            q = waiting.popleft()
            r = [q, int(prompt[q]), 0, int(output[q])]
            running.append(r)
            sched[q] = t
            started.append((r, min(r[1], left)))
            left -= started[-1][1]
        cost = p.itl_s(d) + 2 * p.prefill_quadratic_s * ctx + (p.prefill_iteration_s if started else 0.0) if d else b0
        for r, k in started:
            cost += p.prefill_seq_s + k / p.prefill_tokens_per_s + p.prefill_quadratic_s * (k * k + 2 * k * r[2])
        t += cost
        for r in running:
            if r[1] == 0:
                r[3] -= 1
                if r[3] == 0:
                    fin[r[0]] = t
        for r, k in started:
            r[1] -= k
            r[2] += k
            if r[1] == 0:
                first[r[0]] = t
                r[3] -= 1
                if r[3] == 0:
                    fin[r[0]] = t
        running = [r for r in running if r[3] > 0]
    out = np.asarray(output)
    return first + front - arr, (fin - first) / np.maximum(out - 1, 1), sched - arr


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_plain_reference_whatever_the_tick(seed):
    """Bursty arrivals that overflow max_num_seqs (8): freed slots are refilled when they free, not per tick."""
    rng = np.random.default_rng(seed)
    n = 300
    gaps = np.where(rng.random(n) < 0.4, 0.0, rng.exponential(0.05, n))  # clusters of simultaneous arrivals
    arr = np.cumsum(gaps)
    prompt = rng.integers(1, 1500, n)
    output = rng.integers(1, 60, n)
    ttft, tpot, queue = reference(arr, prompt, output, CPU)
    for tick in (0.003, 0.25, 2.0):
        e = run(arr, prompt, output, tick=tick)
        assert (e.status == DONE).all()
        assert np.allclose(e.ttft, ttft, rtol=1e-4, atol=1e-6), tick
        assert np.allclose(e.tpot, np.where(output > 1, tpot, 0.0), rtol=1e-4, atol=1e-6), tick
        assert np.allclose(e.queue_s, queue, rtol=1e-4, atol=1e-6), tick


def test_kill_fails_in_flight_and_drain_finishes_them():
    arr = [0.0] * 6
    e = make_engine(np.asarray(arr), np.full(6, 100), np.full(6, 500), CFG)
    a, b = e.add_replica(GPU, 0, 3), e.add_replica(GPU, 1, 3)
    e.step(0.0, 0.25)
    assert e.running(a) == 3 and e.running(b) == 3
    assert e.kill(a, 0.25) == 3
    assert e.in_flight == 3 and e.failed == 3
    assert (e.status == FAILED).sum() == 3
    e.drain(b)
    t = 0.25
    while e.in_flight and t < 100:
        e.step(t, 0.25)
        t += 0.25
    assert (e.status == DONE).sum() == 3 and e.r_state[b] == STOPPED
    assert set(e.flavor_of[e.status == DONE].tolist()) == {1}


def test_simulator_runs_a_policy_on_the_iteration_engine():
    rng = np.random.default_rng(0)
    n = 3000
    arr = np.sort(rng.uniform(0, 1800, n))
    tr = Trace.from_arrays(arr, rng.integers(100, 1000, n), rng.integers(10, 200, n), "uniform")
    cat = load_catalog()
    res = {m: simulate(cat, tr, "rayscale", SimConfig(engine=EngineConfig(model=m))) for m in ("fluid", "iteration")}
    for r in res.values():
        assert r.requests == n and r.failed_requests == 0
    # Same policy, same load: the two engine models agree on what it costs within a few percent.
    f, it = res["fluid"], res["iteration"]
    assert it.cost_usd == pytest.approx(f.cost_usd, rel=0.1)
    assert it.slo_attainment > 0.9


def test_the_iteration_model_has_no_independent_prefill():
    with pytest.raises(ValueError, match=r"engine\.prefill_contention"):
        EngineConfig(model="iteration", prefill_contention=False)
    with pytest.raises(ValueError, match=r"engine\.model must be one of fluid, iteration"):
        EngineConfig(model="exact")
