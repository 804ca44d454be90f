"""The engine model against closed-form cases."""

from __future__ import annotations

import numpy as np
import pytest

from rayscale.config import load_catalog
from rayscale.sim.engine import DONE, Engine, EngineConfig

CAT = load_catalog()
PROF = CAT.profile("mistral-7b", "a10g")
DEFAULT = EngineConfig()


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


def test_batch_latency_grows_with_beta():
    n = 20  # all arrive together: TPOT = alpha + beta * 20 while the whole batch decodes
    e = run([0.0] * n, [100] * n, [100] * n)
    assert np.allclose(e.ttft, PROF.ttft_s(100), rtol=1e-5)
    assert np.allclose(e.tpot, PROF.itl_s(n), rtol=1e-4)
    steeper = PROF.model_copy(update={"itl_beta_s": PROF.itl_beta_s * 4})
    e2 = run([0.0] * n, [100] * n, [100] * n, profile=steeper)
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


def test_slot_cap_limits_batch_and_spreads_over_replicas():
    e = run([0.0] * 10, [100] * 10, [50] * 10, replicas=2, slot_cap=5)
    assert np.allclose(e.tpot, PROF.itl_s(5), rtol=1e-4)  # 5 + 5 on two replicas
    e = run([0.0] * 10, [100] * 10, [50] * 10, replicas=1, slot_cap=5)
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
