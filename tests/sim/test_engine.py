"""The engine model against closed-form cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rayscale.config import load_catalog
from rayscale.sim.engine import DONE, FAILED, Engine, EngineConfig

CAT = load_catalog()
PROF = CAT.profile("mistral-7b", "a10g")
DEFAULT = EngineConfig()
INDEPENDENT = EngineConfig(prefill_contention=False)  # the emulated engine's prefill: every request at full rate


def run(arr, prompt, output, replicas=1, cfg=DEFAULT, profile=PROF, until=None, slot_cap=None):
    e = Engine(np.asarray(arr, float), np.asarray(prompt), np.asarray(output), cfg)
    for _ in range(replicas):
        e.add_replica(profile, 0, slot_cap)
    t, end = 0.0, until if until is not None else max(arr) + 300
    while t < end and (e.in_flight or e.q_head < len(arr)):
        e.step(t, cfg.tick_s)
        t += cfg.tick_s
    return e


@pytest.mark.parametrize("contention", [False, True])
@pytest.mark.parametrize("prompt,output,arrival", [(500, 50, 0.1), (4000, 200, 3.37), (10, 2, 0.0)])
def test_single_request_matches_profile_formula(contention, prompt, output, arrival):
    e = run([arrival], [prompt], [output], cfg=EngineConfig(prefill_contention=contention))
    assert e.status[0] == DONE
    assert e.ttft[0] == pytest.approx(PROF.ttft_s(prompt), rel=1e-5)
    assert e.tpot[0] == pytest.approx(PROF.itl_s(1), rel=1e-5)


def test_default_is_chunked_prefill():
    assert EngineConfig().prefill_contention


def test_batch_latency_grows_with_beta():
    n = 20  # all arrive together: TPOT = alpha + beta * 20 while the whole batch decodes
    e = run([0.0] * n, [100] * n, [100] * n, cfg=INDEPENDENT)
    assert np.allclose(e.ttft, PROF.ttft_s(100), rtol=1e-5)
    assert np.allclose(e.tpot, PROF.itl_s(n), rtol=1e-4)
    steeper = PROF.model_copy(update={"itl_beta_s": PROF.itl_beta_s * 4})
    e2 = run([0.0] * n, [100] * n, [100] * n, profile=steeper, cfg=INDEPENDENT)
    assert np.allclose(e2.tpot, steeper.itl_s(n), rtol=1e-4)
    assert e2.tpot.mean() > e.tpot.mean()


def test_kv_capacity_makes_requests_wait():
    small = PROF.model_copy(update={"kv_tokens": 2000})
    # Each request reserves 1000 + 100 KV tokens: only one fits at a time.
    e = run([0.0, 0.0, 0.0], [1000, 1000, 1000], [100, 100, 100], profile=small)
    ttft = np.sort(e.ttft)
    service = PROF.ttft_s(1000) + 99 * PROF.itl_s(1)
    assert ttft[0] == pytest.approx(PROF.ttft_s(1000), rel=1e-4)
    # The next one waits for the first to finish (admission at the next tick boundary).
    assert ttft[1] >= service + PROF.ttft_s(1000) - 1e-6
    assert ttft[1] <= service + PROF.ttft_s(1000) + EngineConfig().tick_s + 1e-6
    assert ttft[2] > ttft[1] + service - 1e-6
    assert np.allclose(e.tpot, PROF.itl_s(1), rtol=1e-4)  # never batched together


def test_prefill_is_shared_with_contention():
    n = 20  # all arrive together, nothing decodes yet: prompts prefill one after another at the full rate
    e = run([0.0] * n, [100] * n, [100] * n)
    ttft = np.sort(e.ttft)
    expected = PROF.overhead_s + np.arange(1, n + 1) * 100 / PROF.prefill_tokens_per_s
    tick = EngineConfig().tick_s
    first = expected - PROF.overhead_s <= tick  # done in the first tick, before anything decodes
    assert 0 < first.sum() < n
    assert np.allclose(ttft[first], expected[first], rtol=1e-4)
    # Then the first ones decode, and every iteration carries them beside a chunk of the rest: those prompts
    # wait for the prefill work ahead of them plus one decode step per chunk of it, no more.
    assert np.all(np.diff(ttft) > 0)
    later = ~first
    steps = (expected[later] - PROF.overhead_s - tick) * PROF.prefill_tokens_per_s / 2048 * PROF.itl_s(n)
    assert np.all(ttft[later] > expected[later] + 1e-6)
    assert np.all(ttft[later] <= expected[later] + steps + 1e-6)


def test_long_prompt_chunks_slow_running_decodes():
    # One short request decoding; a long prompt arrives: its chunks ride in the short one's iterations.
    alone = run([0.0], [100], [60])
    shared = run([0.0, 0.5], [100, 8000], [60, 2])
    assert alone.tpot[0] == pytest.approx(PROF.itl_s(1), rel=1e-5)
    assert shared.tpot[0] > alone.tpot[0] + 8000 / PROF.prefill_tokens_per_s / 59 * 0.9
    assert run([0.0, 0.5], [100, 8000], [60, 2], cfg=INDEPENDENT).tpot[0] < shared.tpot[0]


def test_slot_cap_limits_batch_and_spreads_over_replicas():
    e = run([0.0] * 10, [100] * 10, [50] * 10, replicas=2, slot_cap=5, cfg=INDEPENDENT)
    assert np.allclose(e.tpot, PROF.itl_s(5), rtol=1e-4)  # 5 + 5 on two replicas
    e = run([0.0] * 10, [100] * 10, [50] * 10, replicas=1, slot_cap=5, cfg=INDEPENDENT)
    assert (e.ttft > PROF.ttft_s(100) + 49 * PROF.itl_s(5) - 1e-6).sum() == 5  # second five wait


def test_request_that_never_fits_fails_instead_of_blocking():
    e = Engine(np.array([0.0, 0.1]), np.array([100_000, 100]), np.array([10, 10]), max_kv_tokens=PROF.kv_tokens)
    e.add_replica(PROF, 0)
    t = 0.0
    while t < 10:
        e.step(t, 0.25)
        t += 0.25
    assert e.status.tolist() == [2, DONE]


def test_kill_fails_in_flight():
    e = Engine(np.array([0.0, 0.0]), np.array([100, 100]), np.array([1000, 1000]))
    r = e.add_replica(PROF, 0)
    e.step(0.0, 0.25)
    assert e.in_flight == 2
    assert e.kill(r, 0.25) == 2
    assert e.in_flight == 0 and (e.status == 2).all()


def _reference_admission(arr, kv, never, run, kv_used, slots, kvcap, live, T1):
    """FIFO, least loaded (running, then index) live replica with a slot and KV room; head-of-line blocking."""
    run, kv_used = list(run), list(kv_used)
    out, failed, i = [], [], 0
    while i < len(arr) and arr[i] < T1:
        if never is not None and kv[i] > never:
            if not any(live[r] and run[r] < slots[r] for r in range(len(run))):
                break
            failed.append(i)
            i += 1
            continue
        room = sorted((run[r], r) for r in range(len(run)) if live[r] and run[r] < slots[r])
        if not room:
            break
        pick = next((r for _, r in room if kv_used[r] + kv[i] <= kvcap[r]), None)
        if pick is None:
            break
        run[pick] += 1
        kv_used[pick] += kv[i]
        out.append(pick)
        i += 1
    return out, failed, i


@pytest.mark.parametrize("routing", ["least-loaded", "flavor-weights"])
@pytest.mark.parametrize("seed", range(40))
def test_admission_matches_reference(seed, routing):
    """The compiled scans in Engine._admit (engine._route, and engine._route_weighted over one flavor) hand
    out requests exactly like the plain FIFO rule."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 200))
    arr = np.sort(rng.uniform(0, 1, n))
    prompt = rng.integers(1, 3000, n)
    output = rng.integers(1, 500, n)
    never = int(rng.choice([3000, 10**6]))
    e = Engine(arr, prompt, output, EngineConfig(routing=routing), max_kv_tokens=never)
    nrep = int(rng.integers(1, 8))
    for _ in range(nrep):
        prof = PROF.model_copy(update={"kv_tokens": int(rng.integers(2000, 40000)),
                                       "max_num_seqs": int(rng.integers(1, 20))})
        e.add_replica(prof, 0)
    e.r_run[:nrep] = [int(rng.integers(0, e.r_slots[r] + 1)) for r in range(nrep)]
    e.r_kv[:nrep] = rng.integers(0, 3000, nrep)
    for r in range(nrep):
        if rng.random() < 0.2:
            e.drain(r)
    want_rep, want_failed, want_head = _reference_admission(
        arr.tolist(), (prompt + np.maximum(output, 1)).tolist(), never, e.r_run[:nrep].tolist(),
        e.r_kv[:nrep].tolist(), e.r_slots[:nrep].tolist(), e.r_kvcap[:nrep].tolist(),
        (e.r_state[:nrep] == 0).tolist(), 1.0)
    e._admit(0.0, 1.0)
    assert e.q_head == want_head
    assert e.p_rep[: e.m].tolist() == want_rep
    assert np.flatnonzero(e.status == 2).tolist() == want_failed


def test_p95_is_numpy_percentile_bit_for_bit():
    from rayscale.sim.engine import p95

    rng = np.random.default_rng(0)
    for n in [*range(1, 60), 257, 1000, 4099]:
        for x in (rng.lognormal(0, 1, n), rng.lognormal(0, 1, n).astype(np.float32), rng.integers(0, 4000, n),
                  (rng.integers(0, 5, n) * 0.1).astype(np.float32)):
            assert p95(x) == float(np.percentile(x, 95))
    x = rng.random(50)
    x[7] = np.nan
    assert np.isnan(p95(x))


def test_queue_lasts_until_a_prompts_prefill_starts_as_vllm_counts_it():
    """Two 4,000-token prompts arrive together on one idle replica: the second waits in the replica's
    prefill FIFO for the first, and vLLM counts that wait as queue (request_queue_time), not prefill
    (request_prefill_time): ttft - queue_s is each prompt's own prefill."""
    e = run([0.0, 0.0], [4000, 4000], [50, 50])
    own = 4000 / PROF.prefill_tokens_per_s
    assert e.queue_s[0] == pytest.approx(0.0, abs=1e-6)
    assert e.queue_s[1] == pytest.approx(own, rel=0.05)  # behind the first prompt's tokens
    assert e.ttft[0] - e.queue_s[0] == pytest.approx(PROF.ttft_s(4000), rel=1e-4)
    # The second prefills while the first decodes: its chunks share iterations with that decode, each one
    # a decode step longer than the chunk alone.
    own_shared = e.ttft[1] - e.queue_s[1]
    assert PROF.ttft_s(4000) < own_shared <= PROF.ttft_s(4000) + math.ceil(4000 / 2048) * PROF.itl_s(2) + 1e-6
    # Independent prefill: both start at once, nothing queues.
    free = run([0.0, 0.0], [4000, 4000], [50, 50], cfg=INDEPENDENT)
    assert np.allclose(free.queue_s, 0.0)


@pytest.mark.parametrize("chunk", [512, 2048])
def test_a_decode_step_waits_at_most_one_chunk_of_its_replica(chunk: int) -> None:
    """A short answer decoding while a long prompt prefills: every step carries a chunk of it beside the
    decode, so the answer's TPOT is bounded by one decode step plus that replica's chunk, and the prompt's
    prefill takes a decode step more per chunk."""
    prof = CAT.profile("mistral-7b", "l40s").model_copy(update={"max_num_batched_tokens": chunk})
    e = run([0.0, 0.5], [100, 8000], [200, 2], profile=prof)  # the answer outlasts the prompt's prefill
    bound = prof.itl_s(1) + chunk / prof.prefill_tokens_per_s  # one sequence decodes; the prompt waits
    assert prof.itl_s(1) < e.tpot[0] <= bound + 1e-6
    alone = run([0.5], [8000], [2], profile=prof)
    extra = float(e.ttft[1] - alone.ttft[0])  # the decode steps its chunks shared
    assert extra == pytest.approx(8000 / chunk * prof.itl_s(1), rel=1e-3)


def test_a_short_answer_arriving_with_a_long_prompt_is_not_stalled_for_all_of_it() -> None:
    """Both reach an idle replica together: the short prompt is done in the first iteration, and from then on
    every iteration carries its decode beside one chunk of the long prompt, not the tick's whole prefill."""
    prof = CAT.profile("mistral-7b", "l40s").model_copy(update={"max_num_batched_tokens": 512})
    e = run([0.0, 0.0], [100, 8000], [3, 2], profile=prof)
    assert e.ttft[0] == pytest.approx(prof.ttft_s(100), rel=1e-4)
    assert e.tpot[0] <= prof.itl_s(1) + 512 / prof.prefill_tokens_per_s + 1e-6


WEIGHTED = EngineConfig(routing="flavor-weights")
SLOW = CAT.profile("mistral-7b", "inf2")


def _weighted(arr, weights, flavors=(0, 1), slot_cap=None, until=60.0, prompt=100, output=20, seed=0,
              cfg=WEIGHTED, slot_caps=None):
    """An engine routing by flavor weights over one replica per flavor index in ``flavors``."""
    n = len(arr)
    e = Engine(np.asarray(arr, float), np.full(n, prompt), np.full(n, output), cfg, seed=seed)
    for f in flavors:
        e.add_replica(PROF if f == 0 else SLOW, f, slot_caps[f] if slot_caps else slot_cap)
    e.set_flavor_weights(weights)
    t = 0.0
    while t < until and (e.in_flight or e.waiting or e.arrived < n):
        e.step(t, cfg.tick_s)
        t += cfg.tick_s
    return e


def test_two_choices_send_less_to_a_flavor_whose_queue_has_built():
    # Flavor 1 runs one request at a time and its queue builds: the weighted draw (the ingress's pick_route)
    # still sends it half; two choices, a candidate the ingress does not ship, send it less as its requests
    # in flight pile up.
    arr = np.arange(300) * 0.2
    share = {cfg.routing: np.mean(_weighted(arr, [1.0, 1.0], until=900.0, output=200, cfg=cfg,
                                            slot_caps={0: None, 1: 1}).flavor_of == 1)
             for cfg in (WEIGHTED, EngineConfig(routing="flavor-two-choices"))}
    assert 0.4 < share["flavor-weights"] < 0.6
    assert share["flavor-two-choices"] < 0.3


def test_weighted_routing_splits_by_weight_not_by_load():
    # Least-loaded routing would give the slower replica about as many running requests as the fast one;
    # the ingress draws a flavor by weight whatever the replicas run.
    arr = np.arange(2000) * 0.05
    e = _weighted(arr, [3.0, 1.0], until=300.0)
    share = np.mean(e.flavor_of[e.status == DONE] == 1)
    assert (e.status == DONE).all()
    assert 0.22 < share < 0.28
    assert (_weighted(arr, [1.0, 0.0], until=300.0).flavor_of == 0).all()


def test_weighted_routing_draws_only_among_flavors_with_a_live_replica():
    # Flavor 1's weight is high, but it has no replica yet: as the ingress's readiness gate, nothing waits for it.
    e = _weighted(np.arange(50) * 0.1, [1.0, 9.0], flavors=(0,))
    assert (e.status == DONE).all() and (e.flavor_of == 0).all()
    # No flavor weighs anything: uniform over the live ones.
    e = _weighted(np.arange(2000) * 0.05, [0.0, 0.0], until=300.0)
    assert 0.4 < np.mean(e.flavor_of == 1) < 0.6


def test_a_full_flavor_queues_its_own_requests_only():
    # Flavor 1's replica takes one request at a time; the requests that drew it wait for it, and must not
    # hold back those that drew flavor 0 (Serve queues behind each deployment, not one queue for all).
    e = Engine(np.zeros(40), np.full(40, 100), np.full(40, 200), WEIGHTED)
    e.add_replica(PROF, 0)
    e.add_replica(SLOW, 1, 1)
    e.set_flavor_weights([1.0, 1.0])
    for k in range(8):
        e.step(k * 0.25, 0.25)
    drew = np.asarray(e._req_flavor)
    assert 10 < (drew == 1).sum() < 30
    assert e.running(0) == (drew == 0).sum() and e.running(1) == 1
    assert e.waiting == (drew == 1).sum() - 1


@pytest.mark.parametrize("routing", ["flavor-weights", "flavor-two-choices"])
def test_weighted_routing_is_the_central_queue_for_one_flavor(routing):
    arr = np.sort(np.random.default_rng(3).uniform(0, 30, 300))
    a = _weighted(arr, [1.0], flavors=(0,), until=120.0, cfg=EngineConfig(routing=routing))
    b = run(arr, [100] * 300, [20] * 300, until=120.0)
    assert np.array_equal(a.ttft, b.ttft) and np.array_equal(a.tpot, b.tpot)


def test_weighted_routing_needs_a_weight_per_flavor():
    e = Engine(np.zeros(2), np.full(2, 100), np.full(2, 10), WEIGHTED)
    e.add_replica(PROF, 0)
    e.add_replica(SLOW, 1)
    e.set_flavor_weights([1.0])
    with pytest.raises(ValueError, match="1 weights for flavor index 1"):
        e.step(0.0, 0.25)
    with pytest.raises(ValueError, match="non-negative"):
        e.set_flavor_weights([1.0, -1.0])
    with pytest.raises(ValueError, match=r"engine\.routing"):
        EngineConfig(routing="round-robin")


def _two_slots(output: list[int], slotted: bool, slot_cap: int = 1) -> Engine:
    """Two replicas of one flavor, each taking ``slot_cap`` requests at a time; requests arriving together
    at 0, the ties of a slot choice going to the first replica; run until all finish."""
    n = len(output)
    e = Engine(np.zeros(n), np.full(n, 100), np.asarray(output), WEIGHTED)
    e.add_replica(PROF, 0, slot_cap)
    e.add_replica(PROF, 0, slot_cap)
    e.set_flavor_weights([1.0], slotted=[slotted])
    e._u_slot[:] = 0.0
    t = 0.0
    while t < 600 and (e.in_flight or e.waiting or e.arrived < n):
        e.step(t, 0.25)
        t += 0.25
    return e


def test_a_gang_slot_flavor_queues_each_request_behind_the_slot_it_took():
    # A multi-node flavor's replicas are one Serve deployment per gang slot: the ingress sends each request
    # to the slot it has fewest requests on (rayscale.serve.weights.pick_route) and Serve queues it behind
    # that slot's replica, even once the other slot has room; least-loaded routing within one deployment
    # would hand it to whichever replica frees first. A long answer, then three short ones: the first short
    # one takes the idle slot, the next two split evenly, one behind the long answer.
    output = [2000, 5, 5, 5]
    slots = _two_slots(output, slotted=True)
    assert (slots.status == DONE).all()
    took = np.asarray(slots._req_rep)
    assert list(took) == [0, 1, 0, 1]
    assert slots.ttft[2] > 0.9 * (slots.t_fin[0] - 0)  # behind the long answer, though slot 1 idled
    one_queue = _two_slots(output, slotted=False)
    assert one_queue.ttft[2] < 0.1 * one_queue.t_fin[0]
    # Many requests at once spread evenly, and each slot serves those that took it.
    even = _two_slots([50] * 40, slotted=True, slot_cap=4)
    assert (even.status == DONE).all() and (np.asarray(even._req_rep) == 0).sum() == 20


def test_a_request_whose_slot_is_gone_takes_another_and_is_not_lost():
    n = 12
    e = Engine(np.zeros(n), np.full(n, 100), np.full(n, 200), WEIGHTED)
    e.add_replica(PROF, 0, 2)
    e.add_replica(PROF, 0, 2)
    e.set_flavor_weights([1.0], slotted=[True])
    e.step(0.0, 0.25)
    assert e.running(0) == 2 and e.running(1) == 2 and e.waiting == 8
    assert e.kill(1, 0.25) == 2  # its running requests fail with it
    t = 0.25
    while t < 600 and (e.in_flight or e.waiting):
        e.step(t, 0.25)
        t += 0.25
    done = e.status == DONE
    assert done.sum() == 10 and (e.status == FAILED).sum() == 2
    assert (np.asarray(e._req_rep)[done] == 0).all()
