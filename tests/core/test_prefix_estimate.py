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
    # Without a per-flavor view the model's rate counts for each of its flavors; no hit rate, no discount.
    assert scales == {(MODEL, f): pytest.approx(1 / (1 - MAX_PREFIX_DISCOUNT)) for f in CAT.models[MODEL].parallelism}
    for f in CAT.models[MODEL].parallelism:
        old = CAT.profile(MODEL, f)
        new = scaled_profile(old, scales[(MODEL, f)])
        assert new.prefill_tokens_per_s == pytest.approx(old.prefill_tokens_per_s / (1 - MAX_PREFIX_DISCOUNT))
        assert new.kv_tokens == old.kv_tokens and new.itl_alpha_s == old.itl_alpha_s


def _discounted(cat: Catalog, scales: dict[tuple[str, str], float]) -> Catalog:
    profiles = dict(cat.profiles)
    for (m, f), scale in scales.items():
        profiles[profile_key(m, f)] = scaled_profile(profiles[profile_key(m, f)], scale)
    return cat.model_copy(update={"profiles": profiles})


def _obs(hit_rate: float | None) -> FlavorObservation:
    return FlavorObservation(replicas=2, running_per_replica=3.0, prompt_mean=MIX.prompt_mean, completed=50,
                             prefill_mean_s=0.4, tpot_p95_s=0.03, prefix_hit_rate=hit_rate)


def test_a_flavor_is_discounted_by_its_own_hit_rate_only() -> None:
    """What a prompt finds cached depends on the flavor's KV cache and on how many replicas split the prefixes:
    the rate seen on H100s sizes H100s, never L40S replicas that have not served."""
    h100, l40s = "h100", "l40s"
    sig = replace(SIG, per_flavor={h100: _obs(0.6)}, prefix_hit_rate=0.6)
    assert prefix_scales(CAT, {MODEL: sig}) == {(MODEL, h100): pytest.approx(2.5)}
    plain = estimate(CAT, {MODEL: replace(SIG, per_flavor={h100: _obs(None)})})[MODEL]
    got = estimate(CAT, {MODEL: sig})[MODEL]
    assert got.capacity[l40s] == plain.capacity[l40s]
    assert got.capacity[h100].rps > 1.2 * plain.capacity[h100].rps
    # Two flavors serving, each with its own rate; the model's rate (their blend) is not used.
    both = replace(SIG, per_flavor={h100: _obs(0.6), l40s: _obs(0.2)}, prefix_hit_rate=0.5)
    assert prefix_scales(CAT, {MODEL: both}) == {(MODEL, h100): pytest.approx(2.5),
                                                 (MODEL, l40s): pytest.approx(1.25)}
    # A source with the model's rate only: it counts for the flavors serving, not for the others.
    blended = replace(SIG, per_flavor={h100: _obs(None)}, prefix_hit_rate=0.5)
    assert prefix_scales(CAT, {MODEL: blended}) == {(MODEL, h100): pytest.approx(2.0)}


@pytest.mark.parametrize("hit_rate", [0.1, 0.3])
def test_the_discount_is_the_scaled_profiles_exactly(hit_rate: float) -> None:
    """The estimator discounts prefill in its columns, not in copies of the profiles: every capacity (the
    infeasible flavors' reasons and the best-effort fallbacks too) and every correction are what the
    profiles with their prefill scaled give, to the last bit."""
    f, g = list(CAT.models[MODEL].parallelism)[:2]
    hit = replace(SIG, per_flavor={f: _obs(hit_rate), g: _obs(hit_rate / 2)}, prefix_hit_rate=hit_rate)
    scaled = _discounted(CAT, prefix_scales(CAT, {MODEL: hit}))
    plain = replace(hit, per_flavor={f: _obs(None), g: _obs(None)}, prefix_hit_rate=None)
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
