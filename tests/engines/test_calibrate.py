"""Calibration of the latency profile: the pure fit against known parameters, then once on real vLLM CPU."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from rayscale.core.catalog import Profile
from rayscale.engines.calibrate import (
    CalibrationError,
    CalibrationPlan,
    EngineLimits,
    calibrated_profile,
    fit_line,
    fit_profile_params,
    steady_itl,
)

OVERHEAD, RATE, ALPHA, BETA = 0.004, 16_000.0, 0.003, 0.0001
LENS = (16, 64, 128, 256, 512, 1024)
BATCHES = (1, 2, 4, 8, 16, 32)
LIMITS = EngineLimits(max_num_seqs=64, max_num_batched_tokens=2048, chunked_prefill=True, block_size=128,
                      kv_blocks=512)  # fmt: skip


def synthetic(noise: float = 0.02, seed: int = 0, reps: int = 5):
    """Samples from known lines with multiplicative noise."""
    rng = np.random.default_rng(seed)
    ttft = [(p, (OVERHEAD + p / RATE) * (1 + noise * rng.standard_normal())) for p in LENS for _ in range(reps)]
    itl = [(b, (ALPHA + BETA * b) * (1 + noise * rng.standard_normal())) for b in BATCHES for _ in range(reps)]
    return ttft, itl


def test_fit_recovers_known_parameters_exactly_without_noise():
    cal = fit_profile_params(*synthetic(noise=0.0))
    assert cal.overhead_s == pytest.approx(OVERHEAD, rel=1e-9)
    assert cal.prefill_tokens_per_s == pytest.approx(RATE, rel=1e-9)
    assert cal.itl_alpha_s == pytest.approx(ALPHA, rel=1e-9)
    assert cal.itl_beta_s == pytest.approx(BETA, rel=1e-9)
    assert cal.ttft_fit.r2 == pytest.approx(1.0) and cal.itl_fit.r2 == pytest.approx(1.0)
    assert np.allclose(cal.ttft_fit.residuals, 0.0, atol=1e-12)
    assert cal.ttft_fit.x == tuple(float(p) for p in LENS)


@pytest.mark.parametrize("seed", range(5))
def test_fit_recovers_known_parameters_with_noise(seed):
    cal = fit_profile_params(*synthetic(noise=0.02, seed=seed))
    assert cal.prefill_tokens_per_s == pytest.approx(RATE, rel=0.05)
    assert cal.overhead_s == pytest.approx(OVERHEAD, rel=0.25)
    assert cal.itl_alpha_s == pytest.approx(ALPHA, rel=0.05)
    assert cal.itl_beta_s == pytest.approx(BETA, rel=0.10)
    assert cal.ttft_fit.r2 > 0.99 and cal.itl_fit.r2 > 0.95


def test_one_slow_sample_does_not_tilt_the_line():
    ttft, itl = synthetic(noise=0.0)
    cal = fit_profile_params([*ttft, (1024, 5.0)], [*itl, (32, 1.0)])  # a 5 s hiccup, a 1 s one
    assert cal.prefill_tokens_per_s == pytest.approx(RATE, rel=1e-9)
    assert cal.itl_beta_s == pytest.approx(BETA, rel=1e-9)


def test_too_few_points_fail_loudly():
    ttft, itl = synthetic()
    two_lens = [s for s in ttft if s[0] in (16, 512)]
    with pytest.raises(CalibrationError, match=r"TTFT vs prompt tokens: need samples at >= 3 distinct x values"):
        fit_profile_params(two_lens, itl)
    with pytest.raises(CalibrationError, match=r"ITL vs batch: need samples at >= 3 distinct x values to fit a line, got 1"):
        fit_profile_params(ttft, [s for s in itl if s[0] == 4])
    with pytest.raises(CalibrationError, match="need both"):
        fit_profile_params(ttft, [])


def test_non_positive_slopes_fail_loudly():
    ttft, itl = synthetic(noise=0.0)
    falling = [(p, 0.2 - p / RATE) for p, _ in ttft]
    with pytest.raises(CalibrationError, match=r"TTFT vs prompt tokens: slope .* is not positive"):
        fit_profile_params(falling, itl)
    flat = [(b, ALPHA) for b, _ in itl]
    with pytest.raises(CalibrationError, match=r"ITL vs batch: slope .* is not positive"):
        fit_profile_params(ttft, flat)
    through_zero = [(b, BETA * (b - 2)) for b, _ in itl]
    with pytest.raises(CalibrationError, match=r"intercept .* must be positive"):
        fit_profile_params(ttft, through_zero)


def test_convex_prefill_gives_zero_overhead_not_a_negative_one():
    # Attention makes long prompts cost more than linearly: the free intercept would be negative.
    ttft = [(p, p / RATE + (p / 900.0) ** 2 * 0.01) for p in LENS]
    free = fit_line([p for p, _ in ttft], [t for _, t in ttft], "x")
    assert free.intercept < 0 and not free.constrained
    cal = fit_profile_params(ttft, synthetic(noise=0.0)[1])
    assert cal.ttft_fit.constrained and cal.overhead_s == 0.0 and cal.prefill_tokens_per_s > 0


def test_non_finite_samples_are_rejected():
    ttft, itl = synthetic()
    with pytest.raises(CalibrationError, match="finite"):
        fit_profile_params([*ttft, (64, float("nan"))], itl)


def test_steady_itl_uses_only_the_window_where_the_whole_batch_decodes():
    # Request a decodes alone from t=0 at 1 token / 10 ms, b joins at t=0.1; both then run at 1 / 20 ms.
    a = [(0.01 * i, i + 1) for i in range(10)] + [(0.1 + 0.02 * i, 11 + i) for i in range(1, 11)]
    b = [(0.1 + 0.02 * i, 1 + i) for i in range(0, 12)]
    assert steady_itl([a, b]) == pytest.approx([0.02, 0.02])
    # An output carrying several tokens counts as that many.
    c = [(0.0, 1), (0.05, 6), (0.1, 11)]
    assert steady_itl([c]) == pytest.approx([0.01])


def test_profile_takes_the_engine_limits_and_validates():
    cal = fit_profile_params(*synthetic(noise=0.0))
    p = calibrated_profile(cal, LIMITS, "measured: synthetic")
    assert isinstance(p, Profile)
    assert (p.max_num_seqs, p.kv_tokens) == (64, 512 * 128)
    assert p.itl_s(8) == pytest.approx(ALPHA + 8 * BETA, rel=1e-3)
    assert p.ttft_s(512) == pytest.approx(OVERHEAD + 512 / RATE, rel=1e-3)
    with pytest.raises(CalibrationError, match="KV cache size"):
        calibrated_profile(cal, EngineLimits(64, 2048, True, 128, None), "measured: x")
    with pytest.raises(ValueError, match="must start with one of"):
        calibrated_profile(cal, LIMITS, "guess: x")


def test_plan_rejects_too_short_outputs():
    with pytest.raises(ValueError, match="itl_output_tokens"):
        CalibrationPlan(itl_output_tokens=4)


# --- on the real engine ------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.timeout(240)
def test_measure_on_real_vllm_cpu_gives_a_valid_profile(rayscale_cache_dir: Path):
    """Tiny sizes: a few seconds of measurement after the engine start (~20-40 s on two busy cores)."""
    from rayscale.engines.calibrate import measure, start_engine, tiny_engine_args

    assert os.environ["RAYSCALE_CACHE_DIR"] == str(rayscale_cache_dir)  # the model goes into the test's dir
    # Batches far apart: the ITL slope (~0.05 ms per sequence here) must stand out of a busy machine's noise.
    plan = CalibrationPlan(prompt_lens=(16, 128, 384), prefill_repeats=3, batch_sizes=(1, 8, 32),
                           itl_output_tokens=32, itl_repeats=2, itl_min_samples=8, warmup_requests=2,
                           request_timeout_s=30.0)  # fmt: skip

    async def run():
        engine = start_engine(tiny_engine_args(max_model_len=512))
        try:
            return await asyncio.wait_for(measure(engine, plan), 90)
        finally:
            engine.shutdown()

    samples = asyncio.run(run())
    assert {p for p, _ in samples.ttft} == {16, 128, 384}
    assert {b for b, _ in samples.itl} == {1, 8, 32}
    assert all(t > 0 for _, t in samples.ttft + samples.itl)
    lim = samples.limits
    assert lim is not None and lim.max_num_seqs == 64 and lim.kv_tokens and lim.kv_tokens >= 512
    cal = fit_profile_params(samples.ttft, samples.itl)
    assert cal.prefill_tokens_per_s > 0 and cal.overhead_s >= 0
    assert cal.itl_alpha_s > 0 and cal.itl_beta_s > 0
    p = calibrated_profile(cal, lim, "measured: test")
    assert Profile.model_validate(p.model_dump()) == p
    assert p.kv_tokens == lim.kv_tokens
