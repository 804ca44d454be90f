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
    fit_prefill_seq,
    fit_profile_params,
    fit_quadratic,
    prefill_batch_iteration,
    steady_itl,
)

OVERHEAD, RATE, ALPHA, BETA = 0.004, 16_000.0, 0.003, 0.0001
Q, SEQ, N_BATCH = 2e-8, 0.0013, 64  # s/token^2, s per prompt in an iteration, tokens per batched prompt
KS = (1, 2, 4, 8, 16)
LENS = (16, 64, 128, 256, 512, 1024)
BATCHES = (1, 2, 4, 8, 16, 32)
LIMITS = EngineLimits(max_num_seqs=64, max_num_batched_tokens=2048, chunked_prefill=True, block_size=128,
                      kv_blocks=512)  # fmt: skip


def ttft_model(p: float) -> float:
    return OVERHEAD + p / RATE + Q * p * p


def iteration_model(k: int, seq: float = SEQ, pit: float = 0.0) -> float:
    """The simulator's iteration: the blocker's decode plus k fresh prompts of N_BATCH tokens."""
    return ALPHA + BETA + pit + k * (seq + N_BATCH / RATE + Q * N_BATCH**2)


def synthetic(noise: float = 0.02, seed: int = 0, reps: int = 5):
    """Samples from the known model with multiplicative noise."""
    rng = np.random.default_rng(seed)
    ttft = [(p, ttft_model(p) * (1 + noise * rng.standard_normal())) for p in LENS for _ in range(reps)]
    itl = [(b, (ALPHA + BETA * b) * (1 + noise * rng.standard_normal())) for b in BATCHES for _ in range(reps)]
    return ttft, itl


def batch_samples(noise: float = 0.0, seed: int = 0, reps: int = 5, seq: float = SEQ, pit: float = 0.0):
    rng = np.random.default_rng(seed + 100)
    return [(k, iteration_model(k, seq, pit) * (1 + noise * rng.standard_normal())) for k in KS
            for _ in range(reps)]


def test_fit_recovers_known_parameters_exactly_without_noise():
    cal = fit_profile_params(*synthetic(noise=0.0))
    assert cal.overhead_s == pytest.approx(OVERHEAD, rel=1e-9)
    assert cal.prefill_tokens_per_s == pytest.approx(RATE, rel=1e-9)
    assert cal.itl_alpha_s == pytest.approx(ALPHA, rel=1e-9)
    assert cal.itl_beta_s == pytest.approx(BETA, rel=1e-9)
    assert cal.prefill_quadratic_s == pytest.approx(Q, rel=1e-7)
    assert cal.ttft_fit.r2 == pytest.approx(1.0) and cal.itl_fit.r2 == pytest.approx(1.0)
    assert np.allclose(cal.ttft_fit.residuals, 0.0, atol=1e-12)
    assert cal.ttft_fit.x == tuple(float(p) for p in LENS)
    assert not cal.ttft_fit.constrained
    # Without prefill-batch samples (raw files from before them) there is no per-prompt cost.
    assert cal.prefill_seq_s == 0.0 and cal.batch_fit is None and cal.prefill_seq_raw_s is None


@pytest.mark.parametrize("seed", range(5))
def test_fit_recovers_known_parameters_with_noise(seed):
    cal = fit_profile_params(*synthetic(noise=0.02, seed=seed))
    # Three coefficients from six medians with 2% noise: each is loose, the TTFT they give is not.
    assert cal.prefill_tokens_per_s == pytest.approx(RATE, rel=0.10)
    assert cal.prefill_quadratic_s == pytest.approx(Q, rel=0.35)
    assert cal.overhead_s == pytest.approx(OVERHEAD, rel=0.10)
    assert all(cal.ttft_fit(p) == pytest.approx(ttft_model(p), rel=0.05) for p in LENS)
    assert cal.itl_alpha_s == pytest.approx(ALPHA, rel=0.05)
    assert cal.itl_beta_s == pytest.approx(BETA, rel=0.10)
    assert cal.ttft_fit.r2 > 0.99 and cal.itl_fit.r2 > 0.95


def test_one_slow_sample_does_not_tilt_the_line():
    ttft, itl = synthetic(noise=0.0)
    cal = fit_profile_params([*ttft, (1024, 5.0)], [*itl, (32, 1.0)])  # a 5 s hiccup, a 1 s one
    assert cal.prefill_tokens_per_s == pytest.approx(RATE, rel=1e-7)
    assert cal.itl_beta_s == pytest.approx(BETA, rel=1e-9)


def test_too_few_points_fail_loudly():
    ttft, itl = synthetic()
    two_lens = [s for s in ttft if s[0] in (16, 512)]
    with pytest.raises(CalibrationError, match=r"TTFT vs prompt tokens: need samples at >= 3 distinct x values "
                                               r"to fit a quadratic, got 2"):
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


def test_convex_prefill_is_fitted_exactly_where_a_line_went_below_zero():
    # Attention makes long prompts cost more than linearly: a line's free intercept would be negative.
    q = 0.01 / 900.0**2
    ttft = [(p, p / RATE + q * p * p) for p in LENS]
    free = fit_line([p for p, _ in ttft], [t for _, t in ttft], "x")
    assert free.intercept < 0 and not free.constrained
    cal = fit_profile_params(ttft, synthetic(noise=0.0)[1])
    assert cal.prefill_quadratic_s == pytest.approx(q, rel=1e-6)
    assert cal.prefill_tokens_per_s == pytest.approx(RATE, rel=1e-6)
    assert cal.overhead_s == pytest.approx(0.0, abs=1e-12)
    assert np.allclose(cal.ttft_fit.residuals, 0.0, atol=1e-12)


def assert_constrained_optimum(f):
    """KKT for least squares with intercept >= 0, quad >= 0: the residuals are orthogonal to every free
    column, and raising a coefficient held at 0 would not reduce them (residuals . column <= 0)."""
    xs = np.asarray(f.x)
    r = np.asarray(f.residuals)
    for name, col in (("intercept", np.ones_like(xs)), ("slope", xs), ("quad", xs**2)):
        g = float(r @ col) / float(np.linalg.norm(col) * np.linalg.norm(f.y))
        if name in f.held_at_zero:
            assert getattr(f, name) == 0.0 and g <= 1e-12, (name, g)
        else:
            assert abs(g) < 1e-12, (name, g)


def test_quadratic_fit_holds_a_negative_intercept_at_zero():
    # Free fit: intercept -1 ms. Constrained: overhead 0, still convex and close.
    x = [16, 64, 128, 256, 512, 1024]
    y = [-0.001 + p / RATE + Q * p * p for p in x]
    f = fit_quadratic(x, y, "x")
    assert f.held_at_zero == ("intercept",) and f.constrained and f.intercept == 0.0
    assert f.quad > 0 and f.slope > 0
    assert_constrained_optimum(f)


def test_quadratic_fit_holds_a_concave_curve_to_a_line():
    # Concave data (q < 0 fits best): the constrained fit is the plain least-squares line.
    x = [16, 64, 128, 256, 512, 1024]
    y = [OVERHEAD + p / RATE - 1e-9 * p * p for p in x]
    f = fit_quadratic(x, y, "x")
    line = fit_line(x, y, "x")
    assert f.held_at_zero == ("quad",) and f.quad == 0.0
    assert (f.intercept, f.slope) == pytest.approx((line.intercept, line.slope), rel=1e-9)
    assert f.r2 == pytest.approx(line.r2)
    assert_constrained_optimum(f)
    # Both negative when free: the best feasible fit among the held subsets, still the constrained optimum.
    f2 = fit_quadratic(x, [-0.01 + p / RATE - 1e-9 * p * p for p in x], "x")
    assert f2.intercept == 0.0 and "intercept" in f2.held_at_zero
    assert_constrained_optimum(f2)


def test_quadratic_fit_keeps_a_prefill_rate_on_a_hockey_stick():
    # TTFT flat for short prompts, then convex (a tiny model on a busy CPU, as measured in CI): the free
    # quadratic's linear term is negative, which leaves no prefill rate; the line is the best fit with one.
    x = [16, 32, 64, 128, 256, 512, 1024]
    y = [0.007 - 1e-6 * p + 1.2e-8 * p * p for p in x]  # 7.0 ms at 16 tokens, 7.4 at 256, 18.6 at 1024
    f = fit_quadratic(x, y, "x")
    line = fit_line(x, y, "x")
    assert f.slope > 0 and f.held_at_zero == ("quad",) and f.quad == 0.0
    assert (f.intercept, f.slope) == pytest.approx((line.intercept, line.slope), rel=1e-9)
    cal = fit_profile_params(list(zip(x, y, strict=True)), synthetic(noise=0.0)[1])
    assert cal.prefill_tokens_per_s == pytest.approx(1 / line.slope)
    # TTFT falling with the prompt has no prefill rate at all: refused, naming the fit.
    with pytest.raises(CalibrationError, match=r"TTFT vs prompt tokens: slope .* is not positive"):
        fit_profile_params([(p, 0.02 - 1e-5 * p) for p in x], synthetic(noise=0.0)[1])


def test_three_prompt_lengths_fit_a_quadratic_exactly():
    x = [16, 128, 384]
    f = fit_quadratic(x, [ttft_model(p) for p in x], "x")
    assert (f.intercept, 1 / f.slope, f.quad) == pytest.approx((OVERHEAD, RATE, Q), rel=1e-6)


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


# --- per-prompt cost from the prefill batch ----------------------------------------------------------


def test_prefill_batch_recovers_the_per_prompt_cost_exactly_without_noise():
    ttft, itl = synthetic(noise=0.0)
    cal = fit_profile_params(ttft, itl, batch_samples(), batch_prompt_tokens=N_BATCH)
    assert cal.prefill_seq_s == pytest.approx(SEQ, rel=1e-6) and cal.prefill_seq_clip == ""
    assert cal.prefill_seq_raw_s == pytest.approx(SEQ, rel=1e-6)
    assert cal.batch_fit is not None and cal.batch_prompt_tokens == N_BATCH
    # The iteration's base is one decode's: no per-iteration prefill cost.
    assert cal.batch_fit.intercept == pytest.approx(cal.itl_fit(1), rel=1e-9)
    assert cal.prefill_iteration_s == pytest.approx(0.0, abs=1e-12)
    p = calibrated_profile(cal, LIMITS, "measured: synthetic")
    assert p.prefill_seq_s == pytest.approx(SEQ, abs=1e-6) and p.prefill_quadratic_s == pytest.approx(Q, rel=1e-3)
    # The profile's engine time per prompt is the slope of the measured iterations.
    assert p.prefill_engine_s(N_BATCH) == pytest.approx(cal.batch_fit.slope, rel=1e-3)


@pytest.mark.parametrize("seed", range(5))
def test_prefill_batch_recovers_the_per_prompt_cost_with_noise(seed):
    ttft, itl = synthetic(noise=0.02, seed=seed)
    cal = fit_profile_params(ttft, itl, batch_samples(noise=0.02, seed=seed), batch_prompt_tokens=N_BATCH)
    assert cal.prefill_seq_s == pytest.approx(SEQ, abs=0.25e-3)


def test_prefill_seq_is_clipped_into_zero_to_overhead():
    ttft, itl = synthetic(noise=0.0)
    low = fit_profile_params(ttft, itl, batch_samples(seq=-0.0005), batch_prompt_tokens=N_BATCH)
    assert low.prefill_seq_s == 0.0 and low.prefill_seq_clip == "raised to 0"
    assert low.prefill_seq_raw_s == pytest.approx(-0.0005, rel=1e-6)
    high = fit_profile_params(ttft, itl, batch_samples(seq=2 * OVERHEAD), batch_prompt_tokens=N_BATCH)
    assert high.prefill_seq_s == pytest.approx(OVERHEAD) and high.prefill_seq_clip == "capped at overhead_s"
    p = calibrated_profile(high, LIMITS, "measured: synthetic")
    assert p.prefill_seq_s == p.overhead_s  # rounding keeps Profile's invariant


def test_prefill_batch_fit_fails_loudly():
    ttft, itl = synthetic(noise=0.0)
    with pytest.raises(CalibrationError, match="no samples"):
        fit_profile_params(ttft, itl, [])
    with pytest.raises(CalibrationError, match=r"prefill iteration vs prompts: need samples at >= 3 distinct"):
        fit_profile_params(ttft, itl, [s for s in batch_samples() if s[0] in (1, 16)])
    with pytest.raises(CalibrationError, match=r"prefill iteration vs prompts: slope .* is not positive"):
        fit_profile_params(ttft, itl, [(k, 0.02 - 0.0001 * k) for k in KS])
    tf = fit_profile_params(ttft, itl).ttft_fit
    with pytest.raises(CalibrationError, match="prompt_tokens must be >= 1"):
        fit_prefill_seq(batch_samples(), 0, tf)


def test_prefill_batch_round_is_the_iteration_after_the_blockers_prefill():
    # Blocker's first token at 20 ms; the 4 prompts' first tokens and the blocker's second ~30 ms later.
    assert prefill_batch_iteration(0.020, 0.0505, (0.0500, 0.0502, 0.0503, 0.0506)) == pytest.approx(0.03025)
    assert prefill_batch_iteration(0.020, 0.050, (0.050,)) == pytest.approx(0.030)


@pytest.mark.parametrize(("blocker", "firsts", "why"), [
    # One prompt reached the engine with the blocker and was prefilled with it.
    ((0.020, 0.050), (0.020, 0.050, 0.050), "spread over iterations"),
    # The lone prompt joined the blocker's prefill: done with it, the blocker's decode came later.
    ((0.020, 0.030), (0.0201,), "decode token apart"),
    ((0.020, 0.030), (0.020,), "done with the blocker's prefill"),
    # Too late: the last prompt missed the iteration and went into the next one.
    ((0.020, 0.050), (0.050, 0.050, 0.080), "spread over iterations"),
    # All k too late (one iteration after the blocker's decode).
    ((0.020, 0.050), (0.075, 0.075), "decode token apart"),
    # The engine did not report its timestamps (0.0: vLLM's unset value).
    ((0.020, 0.050), (0.0, 0.050), "timestamps missing"),
])  # fmt: skip
def test_prefill_batch_rounds_that_broke_the_assumption_are_dropped(blocker, firsts, why):
    r = prefill_batch_iteration(blocker[0], blocker[1], firsts)
    assert isinstance(r, str) and why in r


def test_profile_takes_the_engine_limits_and_validates():
    cal = fit_profile_params(*synthetic(noise=0.0))
    p = calibrated_profile(cal, LIMITS, "measured: synthetic")
    assert isinstance(p, Profile)
    assert (p.max_num_seqs, p.kv_tokens) == (64, 512 * 128)
    assert p.itl_s(8) == pytest.approx(ALPHA + 8 * BETA, rel=1e-3)
    assert p.ttft_s(512) == pytest.approx(ttft_model(512), rel=1e-3)
    with pytest.raises(CalibrationError, match="KV cache size"):
        calibrated_profile(cal, EngineLimits(64, 2048, True, 128, None), "measured: x")
    with pytest.raises(ValueError, match="must start with one of"):
        calibrated_profile(cal, LIMITS, "guess: x")


def test_plan_rejects_too_short_outputs_and_bad_prefill_batches():
    with pytest.raises(ValueError, match="itl_output_tokens"):
        CalibrationPlan(itl_output_tokens=4)
    with pytest.raises(ValueError, match="prefill_batch_sizes"):
        CalibrationPlan(prefill_batch_sizes=(0, 2))
    with pytest.raises(ValueError, match="max_spread"):
        CalibrationPlan(prefill_batch_max_spread=1.0)


# --- on the real engine ------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.timeout(240)
def test_measure_on_real_vllm_cpu_gives_a_valid_profile(rayscale_cache_dir: Path):
    """Tiny sizes: a few seconds of measurement after the engine start (~20-40 s on two busy cores)."""
    from rayscale.engines.calibrate import measure, start_engine, tiny_engine_args

    assert os.environ["RAYSCALE_CACHE_DIR"] == str(rayscale_cache_dir)  # the model goes into the test's dir
    # Prompts up to 1024 tokens: TTFT is nearly flat below ~64 tokens on CPU, and with prompts only up to 384
    # (3 rounds) the quadratic's linear coefficient came out <= 0 in ~5% of resamplings of measured TTFTs.
    # Batches far apart, the largest at max_num_seqs, three rounds each: the ITL slope (~0.02 ms per sequence
    # here) must stand out of a busy machine's noise (1 / 8 / 32, two rounds: a negative slope under load).
    # Prefill batches of 128-token prompts: ~0.6 ms a prompt; with 32-token ones (~0.2 ms) a busy CI machine
    # measured 3.6 / 3.7 / 3.5 ms for 1 / 4 / 8 prompts, a slope of nothing.
    plan = CalibrationPlan(prompt_lens=(16, 32, 64, 128, 256, 512, 1024), prefill_repeats=5, batch_sizes=(1, 16, 64),
                           itl_output_tokens=32, itl_repeats=3, itl_min_samples=8, warmup_requests=2,
                           prefill_batch_sizes=(1, 4, 8), prefill_batch_prompt_tokens=128, prefill_batch_repeats=3,
                           request_timeout_s=30.0)  # fmt: skip

    async def run():
        engine = start_engine(tiny_engine_args())
        try:
            return await asyncio.wait_for(measure(engine, plan), 90)
        finally:
            engine.shutdown()

    samples = asyncio.run(run())
    assert {p for p, _ in samples.ttft} == set(plan.prompt_lens)
    assert {b for b, _ in samples.itl} == {1, 16, 64}
    assert all(t > 0 for _, t in samples.ttft + samples.itl + samples.prefill_batch)
    # Most rounds show one iteration for the k prompts (a busy machine may break a few).
    assert {k for k, _ in samples.prefill_batch} == {1, 4, 8}, samples.prefill_batch_dropped
    assert len(samples.prefill_batch_dropped) <= 3, samples.prefill_batch_dropped
    lim = samples.limits
    assert lim is not None and lim.max_num_seqs == 64 and lim.kv_tokens and lim.kv_tokens >= 512
    cal = fit_profile_params(samples.ttft, samples.itl, samples.prefill_batch, plan.prefill_batch_prompt_tokens)
    assert cal.prefill_tokens_per_s > 0 and cal.overhead_s >= 0 and cal.prefill_quadratic_s >= 0
    assert cal.itl_alpha_s > 0 and cal.itl_beta_s > 0
    p = calibrated_profile(cal, lim, "measured: test")
    assert Profile.model_validate(p.model_dump()) == p
    assert p.kv_tokens == lim.kv_tokens
    assert 0.0 <= p.prefill_seq_s <= p.overhead_s


def test_prefill_iteration_cost_is_the_batch_base_over_one_decode():
    ttft, itl = synthetic(noise=0.0)
    cal = fit_profile_params(ttft, itl, batch_samples(pit=0.0009), batch_prompt_tokens=N_BATCH)
    assert cal.prefill_iteration_s == pytest.approx(0.0009, rel=1e-6)
    assert cal.prefill_seq_s == pytest.approx(SEQ, rel=1e-6)  # the per-prompt slope is untouched
    assert calibrated_profile(cal, LIMITS, "measured: synthetic").prefill_iteration_s == pytest.approx(0.0009)
    # A base below one decode's (noise) is not a negative cost.
    low = fit_profile_params(ttft, itl, batch_samples(pit=-0.0005), batch_prompt_tokens=N_BATCH)
    assert low.prefill_iteration_s == 0.0
