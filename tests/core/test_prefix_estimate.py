"""The estimator discounts prefill by the observed prefix-cache hit rate, and only when one is observed."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from rayscale.config import load_catalog
from rayscale.core.catalog import Catalog, profile_key
from rayscale.core.estimate import (
    MAX_PREFIX_DISCOUNT,
    estimate,
    prefix_scales,
    scaled_profile,
    update_corrections,
)
from rayscale.core.signals import FlavorObservation, Freshness, ModelSignals, RequestMix

CAT = load_catalog()
MODEL = "mistral-7b"
# Prefill-bound: long prompts, short answers (Mooncake-like conversation turns).
MIX = RequestMix(prompt_mean=8000.0, output_mean=30.0, prompt_p95=16000.0)
SIG = ModelSignals(MODEL, Freshness.FRESH, 0.0, arrival_rate_rps=6.0, mix=MIX, waiting=0.0)


def replicas_needed(sig: ModelSignals) -> dict[str, int]:
    d = estimate(CAT, {MODEL: sig})[MODEL]
    return {f: math.ceil(d.rps / c.rps) for f, c in d.capacity.items() if c.feasible}


def test_half_the_prompt_cached_plans_less_capacity() -> None:
    none = replicas_needed(SIG)
    half = replicas_needed(replace(SIG, prefix_hit_rate=0.5))
    assert none, "some flavor meets the SLO for the mix"
    assert set(none) <= set(half)  # no flavor becomes infeasible with less prefill
    assert all(half[f] <= n for f, n in none.items())
    assert sum(half[f] for f in none) < sum(none.values())
    d0 = estimate(CAT, {MODEL: SIG})[MODEL]
    d5 = estimate(CAT, {MODEL: replace(SIG, prefix_hit_rate=0.5)})[MODEL]
    for f, c in d0.capacity.items():
        if c.feasible:
            assert d5.capacity[f].rps > 1.2 * c.rps  # prefill-bound: about twice the prompts per replica
            assert d5.capacity[f].ttft_floor_s < c.ttft_floor_s
    assert d5.rps == pytest.approx(d0.rps)  # demand is requests; only what a replica serves changes


def test_no_observed_hit_rate_no_discount() -> None:
    base = estimate(CAT, {MODEL: SIG})[MODEL]
    for h in (None, 0.0):
        d = estimate(CAT, {MODEL: replace(SIG, prefix_hit_rate=h)})[MODEL]
        assert {f: c.rps for f, c in d.capacity.items()} == {f: c.rps for f, c in base.capacity.items()}
    assert prefix_scales(CAT, {MODEL: SIG}) == {}
    # Stale signals carry no usable rate: the profiles stay as published.
    stale = replace(SIG, freshness=Freshness.STALE, prefix_hit_rate=0.5)
    assert prefix_scales(CAT, {MODEL: stale}) == {}


def test_discount_is_bounded_and_only_prefill() -> None:
    other = next(m for m in CAT.models if m != MODEL)
    scales = prefix_scales(CAT, {MODEL: replace(SIG, prefix_hit_rate=0.99), other: replace(SIG, model=other)})
    assert scales == {MODEL: pytest.approx(1 / (1 - MAX_PREFIX_DISCOUNT))}  # no hit rate, no discount
    for f in CAT.models[MODEL].parallelism:
        old = CAT.profile(MODEL, f)
        new = scaled_profile(old, scales[MODEL])
        assert new.prefill_tokens_per_s == pytest.approx(old.prefill_tokens_per_s / (1 - MAX_PREFIX_DISCOUNT))
        assert new.kv_tokens == old.kv_tokens and new.itl_alpha_s == old.itl_alpha_s


def _discounted(cat: Catalog, model: str, scale: float) -> Catalog:
    profiles = dict(cat.profiles)
    for f in cat.models[model].parallelism:
        profiles[profile_key(model, f)] = scaled_profile(profiles[profile_key(model, f)], scale)
    return cat.model_copy(update={"profiles": profiles})


@pytest.mark.parametrize("hit_rate", [0.1, 0.3])
def test_the_discount_is_the_scaled_profiles_exactly(hit_rate: float) -> None:
    """The estimator discounts prefill in its columns, not in copies of the profiles: every capacity (the
    infeasible flavors' reasons and the best-effort fallbacks too) and every correction are what the
    profiles with their prefill scaled give, to the last bit."""
    f = next(iter(CAT.models[MODEL].parallelism))
    obs = FlavorObservation(replicas=2, running_per_replica=3.0, prompt_mean=MIX.prompt_mean, completed=50,
                            prefill_mean_s=0.4, tpot_p95_s=0.03)
    hit = replace(SIG, per_flavor={f: obs}, prefix_hit_rate=hit_rate)
    scaled = _discounted(CAT, MODEL, prefix_scales(CAT, {MODEL: hit})[MODEL])
    plain = replace(hit, prefix_hit_rate=None)
    got, want = estimate(CAT, {MODEL: hit})[MODEL], estimate(scaled, {MODEL: plain})[MODEL]
    assert got.capacity == want.capacity and got.fallback == want.fallback
    assert any(not c.feasible for c in got.capacity.values())  # the reasons are compared too
    assert update_corrections(CAT, {MODEL: hit}, {}, smoothing=1.0) == update_corrections(
        scaled, {MODEL: plain}, {}, smoothing=1.0)


def test_corrections_compare_with_the_discounted_prefill() -> None:
    # Prefill observed exactly as fast as the profile predicts for half the prompt cached: no correction.
    f = next(iter(CAT.models[MODEL].parallelism))
    prof = CAT.profile(MODEL, f)
    half = prof.model_copy(update={"prefill_tokens_per_s": 2 * prof.prefill_tokens_per_s})
    obs = FlavorObservation(replicas=1, running_per_replica=1.0, prompt_mean=MIX.prompt_mean, completed=50,
                            prefill_mean_s=half.ttft_s(MIX.prompt_mean))
    sig = replace(SIG, per_flavor={f: obs}, prefix_hit_rate=0.5)
    assert update_corrections(CAT, {MODEL: sig}, {}, smoothing=1.0)[(MODEL, f)].ttft == pytest.approx(1.0, abs=0.02)
    # Without the hit rate the same window reads as a flavor twice as fast as its profile.
    plain = update_corrections(CAT, {MODEL: replace(sig, prefix_hit_rate=None)}, {}, smoothing=1.0)
    assert plain[(MODEL, f)].ttft < 0.9
