"""Estimation: replica capacity from profiles and SLOs, corrections, and missing data held, never zero."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from rayscale.config import load_catalog
from rayscale.core.attainment import RTOL, at_load
from rayscale.core.catalog import SLO, Profile
from rayscale.core.estimate import (
    Correction,
    DemandState,
    estimate,
    replica_capacity,
    rows_of,
    tpot_at,
    tpot_p95_at,
    update_corrections,
)
from rayscale.core.forecast import TrendSeasonal, last_value
from rayscale.core.signals import FlavorObservation, Freshness, ModelSignals, RequestMix

PROF = Profile(model="m", flavor="f", prefill_tokens_per_s=5000, overhead_s=0.03, itl_alpha_s=0.03,
               itl_beta_s=0.0005, max_num_seqs=256, kv_tokens=60000, startup_s=60, source="estimate: test")
MIX = RequestMix(prompt_mean=1000, output_mean=200, prompt_p95=3000)


def test_capacity_is_the_largest_load_within_the_attainment() -> None:
    slo = SLO(ttft_p95_s=2.0, tpot_p95_s=0.1)
    cap = replica_capacity(PROF, slo, MIX, target_utilization=1.0)
    assert cap.feasible
    rows = rows_of([PROF], [slo], [MIX], [Correction()])
    at = at_load(rows, np.array([cap.batch]))
    assert at.miss[0] <= 0.01 + 1e-12  # 99% of requests within both targets at the capacity
    assert at_load(rows, np.array([cap.batch * 1.03])).miss[0] > 0.01  # and not 3% further (KV allows 50)
    assert cap.batch < 60000 // 1200
    # The mean request meets TPOT with room to spare: the tail binds, not the mean.
    assert tpot_at(PROF, cap.batch, MIX) < slo.tpot_p95_s
    # Little's law: rps = batch / (output tokens x TPOT of the mean request).
    assert cap.rps == pytest.approx(cap.batch / (MIX.output_mean * cap.tpot_s))
    # A looser attainment allows more load; utilisation scales the rate.
    assert replica_capacity(PROF, slo, MIX, target_utilization=1.0, attainment=0.95).rps > cap.rps
    assert replica_capacity(PROF, slo, MIX, target_utilization=0.5).rps == pytest.approx(cap.rps / 2)


def test_kv_cache_bounds_the_batch() -> None:
    small = PROF.model_copy(update={"kv_tokens": 3 * 1200})
    cap = replica_capacity(small, SLO(ttft_p95_s=2.0, tpot_p95_s=0.1), MIX, target_utilization=1.0)
    assert cap.batch == 3.0


def test_the_kv_tokens_running_sequences_hold_bound_the_batch() -> None:
    """In flight, long answers outnumber their share of requests: sequences that hold 1.5x the mean request's
    tokens fit two thirds as many in the cache (Correction.kv), never fewer than one, and a request too big
    for the cache still rules the flavor out."""
    slo = SLO(ttft_p95_s=2.0, tpot_p95_s=0.1)
    small = PROF.model_copy(update={"kv_tokens": 15 * 1200})
    assert replica_capacity(small, slo, MIX, target_utilization=1.0).batch == 15.0
    held = replica_capacity(small, slo, MIX, Correction(kv=1.5), target_utilization=1.0)
    assert held.batch == 10.0
    assert replica_capacity(small, slo, MIX, Correction(kv=100.0), target_utilization=1.0).batch == 1.0
    tiny = PROF.model_copy(update={"kv_tokens": 1000})
    assert not replica_capacity(tiny, slo, MIX, Correction(kv=0.5)).feasible


def test_the_kv_correction_follows_the_tokens_a_running_sequence_holds() -> None:
    """vLLM's KV usage x the cache over the running sequences, against the mix's prompt + output mean;
    a window with few sequences running (a few long ones would read as the mix) or no KV gauge keeps it."""
    cat = load_catalog()
    prof = cat.profile("mistral-7b", "a10g")

    def sig(running: float, usage: float | None) -> ModelSignals:
        return ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 0.1, MIX, per_flavor={
            "a10g": FlavorObservation(replicas=2, running_per_replica=running, kv_usage=usage)})

    usage = 20 * 1.5 * 1200 / prof.kv_tokens  # 20 sequences of 1,800 tokens each
    c = update_corrections(cat, {"mistral-7b": sig(20, usage)}, {})
    assert c[("mistral-7b", "a10g")].kv == pytest.approx(0.7 + 0.3 * 1.5)
    for _ in range(50):
        c = update_corrections(cat, {"mistral-7b": sig(20, usage)}, c)
    assert c[("mistral-7b", "a10g")].kv == pytest.approx(1.5, rel=1e-3)
    assert update_corrections(cat, {"mistral-7b": sig(3, usage)}, {})[("mistral-7b", "a10g")].kv == 1.0
    assert update_corrections(cat, {"mistral-7b": sig(20, None)}, {})[("mistral-7b", "a10g")].kv == 1.0


def test_looser_slo_and_faster_profile_give_more_capacity() -> None:
    tight = replica_capacity(PROF, SLO(ttft_p95_s=2, tpot_p95_s=0.06), MIX)
    loose = replica_capacity(PROF, SLO(ttft_p95_s=2, tpot_p95_s=0.12), MIX)
    assert loose.rps > tight.rps > 0
    slow = replica_capacity(PROF, SLO(ttft_p95_s=2, tpot_p95_s=0.1), MIX, Correction(tpot=1.5))
    assert slow.rps < replica_capacity(PROF, SLO(ttft_p95_s=2, tpot_p95_s=0.1), MIX).rps


def test_infeasible_flavors_say_why() -> None:
    c = replica_capacity(PROF, SLO(ttft_p95_s=0.2, tpot_p95_s=0.1), MIX)
    assert not c.feasible and "TTFT SLO" in c.reason
    c = replica_capacity(PROF, SLO(ttft_p95_s=2, tpot_p95_s=0.02), MIX)
    assert not c.feasible and "TPOT SLO" in c.reason
    small_kv = PROF.model_copy(update={"kv_tokens": 500})
    c = replica_capacity(small_kv, SLO(ttft_p95_s=2, tpot_p95_s=0.1), MIX)
    assert not c.feasible and "KV" in c.reason


@pytest.mark.parametrize("fresh", [Freshness.STALE, Freshness.MISSING])
def test_stale_or_missing_signals_hold_never_zero(fresh: Freshness) -> None:
    cat = load_catalog()
    sig = {"mistral-7b": ModelSignals("mistral-7b", fresh, age_s=90.0 if fresh == Freshness.STALE else None)}
    d = estimate(cat, sig)
    assert d["mistral-7b"].state == DemandState.HOLD
    assert fresh.value in d["mistral-7b"].reason
    # A model with no signals at all is held as well.
    assert d["qwen2-7b"].state == DemandState.HOLD


def test_backlog_adds_to_demand_and_forecast_never_below_current() -> None:
    cat = load_catalog()
    base = ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 4.0, MIX)
    queued = ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 4.0, MIX, waiting=60)
    assert estimate(cat, {"mistral-7b": queued})["mistral-7b"].rps > estimate(cat, {"mistral-7b": base})["mistral-7b"].rps
    rising = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert TrendSeasonal()(rising, 6.0) > 6.0
    assert TrendSeasonal()([6.0, 5.0, 4.0, 3.0], 2.0) == 2.0
    assert last_value(rising, 6.0) == 6.0
    seasonal = TrendSeasonal(season=4, horizon=1)
    hist = [1.0, 5.0, 1.0, 5.0] * 4
    assert seasonal(hist[:-1], hist[-1]) >= hist[-1]


def test_correction_tracks_observed_over_predicted_and_is_clamped() -> None:
    cat = load_catalog()
    prof = cat.profile("mistral-7b", "a10g")
    pred = tpot_p95_at(prof, cat.models["mistral-7b"].slo, MIX, 10)
    sig = ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 0.1, MIX,
                       per_flavor={"a10g": FlavorObservation(replicas=2, running_per_replica=10,
                                                            tpot_p95_s=2 * pred)})
    c = update_corrections(cat, {"mistral-7b": sig}, {})
    assert c[("mistral-7b", "a10g")].tpot == pytest.approx(0.7 + 0.3 * 2.0)
    for _ in range(50):
        c = update_corrections(cat, {"mistral-7b": sig}, c)
    assert c[("mistral-7b", "a10g")].tpot == pytest.approx(2.0, rel=1e-3)
    wild = ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 0.1, MIX,
                        per_flavor={"a10g": FlavorObservation(replicas=2, running_per_replica=10,
                                                             tpot_p95_s=100 * pred)})
    c = {}
    for _ in range(50):
        c = update_corrections(cat, {"mistral-7b": wild}, c)
    assert c[("mistral-7b", "a10g")].tpot <= 3.0


def test_a_handful_of_requests_does_not_move_the_correction() -> None:
    cat = load_catalog()
    pred = tpot_p95_at(cat.profile("mistral-7b", "a10g"), cat.models["mistral-7b"].slo, MIX, 10)

    def sig(completed: float | None) -> ModelSignals:
        return ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 0.1, MIX, per_flavor={
            "a10g": FlavorObservation(replicas=1, running_per_replica=10, tpot_p95_s=3 * pred, completed=completed)})

    assert update_corrections(cat, {"mistral-7b": sig(2)}, {}) == {}  # 2 requests: keep the profile
    assert ("mistral-7b", "a10g") in update_corrections(cat, {"mistral-7b": sig(20)}, {})
    assert ("mistral-7b", "a10g") in update_corrections(cat, {"mistral-7b": sig(None)}, {})  # count unknown


def test_batch_for_the_correction_follows_littles_law_not_the_instant_gauge() -> None:
    """A gauge read between bursts says 0 running; the window ran ~40: compare with the window's batch."""
    cat = load_catalog()
    prof = cat.profile("mistral-7b", "a10g")
    busy = 40.0
    obs_tpot = tpot_p95_at(prof, cat.models["mistral-7b"].slo, MIX, busy)  # exactly the profile at that batch
    rate = busy / (MIX.output_mean * obs_tpot)  # arrivals that keep 40 sequences running on one replica
    sig = ModelSignals("mistral-7b", Freshness.FRESH, 1.0, rate, MIX,
                       per_flavor={"a10g": FlavorObservation(replicas=1, running_per_replica=0.0,
                                                            tpot_p95_s=obs_tpot)})
    c = update_corrections(cat, {"mistral-7b": sig}, {})
    assert c[("mistral-7b", "a10g")].tpot == pytest.approx(1.0, abs=0.02)


def test_the_batch_for_the_correction_takes_the_flavors_share_of_requests_not_of_replicas() -> None:
    """One a10g beside one l40s that takes twice its requests (the ingress weighs flavors by capacity): each
    ran at its own batch, so a profile that is exact there reads a correction of 1 on both; counted by
    replicas (half each) the a10g's batch would read 1.5x what it ran, and its TPOT as faster than the
    profile's."""
    cat = load_catalog()
    slo = cat.models["mistral-7b"].slo
    rate, runs = 6.0, {"a10g": 1.0 / 3, "l40s": 2.0 / 3}
    obs = {}
    for flavor, share in runs.items():
        prof = cat.profile("mistral-7b", flavor)
        batch = 10.0  # a fixed point: the batch Little's law gives at the TPOT p95 the profile predicts there
        for _ in range(50):
            batch = rate * share * MIX.output_mean * tpot_p95_at(prof, slo, MIX, batch)
        obs[flavor] = FlavorObservation(replicas=1, running_per_replica=0.0, completed=60 * share,
                                        tpot_p95_s=tpot_p95_at(prof, slo, MIX, batch))
    sig = ModelSignals("mistral-7b", Freshness.FRESH, 1.0, rate, MIX, per_flavor=obs)
    c = update_corrections(cat, {"mistral-7b": sig}, {}, smoothing=1.0)
    assert c[("mistral-7b", "a10g")].tpot == pytest.approx(1.0, abs=0.02)
    assert c[("mistral-7b", "l40s")].tpot == pytest.approx(1.0, abs=0.02)
    unknown = {f: replace(o, completed=None) for f, o in obs.items()}  # no counts: by replicas, as before
    by_replicas = update_corrections(cat, {"mistral-7b": replace(sig, per_flavor=unknown)}, {}, smoothing=1.0)
    assert by_replicas[("mistral-7b", "a10g")].tpot < 0.97


def test_a_pessimistic_correction_never_zeroes_a_feasible_flavor() -> None:
    slo = SLO(ttft_p95_s=2, tpot_p95_s=0.1)
    assert replica_capacity(PROF, slo, MIX).feasible
    c = replica_capacity(PROF, slo, MIX, Correction(tpot=4.0))  # 4 x 30 ms alpha alone exceeds 100 ms
    assert c.feasible and c.batch == 1
    from rayscale.core.estimate import replica_capacities

    [v] = replica_capacities([PROF], [slo], [MIX], [Correction(tpot=4.0)])
    assert v == c


def test_a_backlog_does_not_read_as_slow_prefill() -> None:
    """TTFT p95 in a backlog is queueing: the TTFT correction comes from the engine's prefill time
    (scheduled -> first token) when reported, is held in a backlogged window when not, and follows TTFT
    p95 only when nothing waits."""
    cat = load_catalog()
    prof = cat.profile("mistral-7b", "a10g")
    queued_p95 = 10 * prof.ttft_s(MIX.prompt_p95)

    def sig(waiting: float | None, prefill_mean_s: float | None, ttft_p95_s: float) -> ModelSignals:
        return ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0, MIX, waiting=waiting, per_flavor={
            "a10g": FlavorObservation(replicas=1, running_per_replica=10, ttft_p95_s=ttft_p95_s,
                                      prefill_mean_s=prefill_mean_s, completed=50)})

    def ttft_corr(s: ModelSignals) -> float:
        return update_corrections(cat, {"mistral-7b": s}, {})[("mistral-7b", "a10g")].ttft

    assert ttft_corr(sig(40.0, None, queued_p95)) == 1.0  # backlog, no prefill time: hold
    assert ttft_corr(sig(None, None, queued_p95)) == 1.0  # queue unknown: hold
    # The engine says prefill ran as predicted: the queue does not move the correction.
    assert ttft_corr(sig(40.0, prof.ttft_s(MIX.prompt_mean), queued_p95)) == pytest.approx(1.0)
    assert ttft_corr(sig(40.0, 2 * prof.ttft_s(MIX.prompt_mean), queued_p95)) == pytest.approx(0.7 + 0.3 * 2)
    # Nothing waiting: TTFT p95 is prefill, and a slow one counts.
    assert ttft_corr(sig(0.0, None, 2 * prof.ttft_s(MIX.prompt_p95))) == pytest.approx(0.7 + 0.3 * 2)


def test_a_declared_request_mix_sizes_the_model_before_any_request_finished() -> None:
    """No finished request yet: a model that declares short requests is not sized for 1,024/128 tokens."""
    from rayscale.core.catalog import RequestMixSpec

    cat = load_catalog()
    short = cat.model_copy(update={"models": {**cat.models, "mistral-7b": cat.models["mistral-7b"].model_copy(
        update={"request_mix": RequestMixSpec(prompt_mean=100, output_mean=32)})}})
    sig = {"mistral-7b": ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0, None)}
    generic = estimate(cat, sig)["mistral-7b"]
    declared = estimate(short, sig)["mistral-7b"]
    assert generic.mix == RequestMix.default()
    assert (declared.mix.prompt_mean, declared.mix.output_mean, declared.mix.prompt_p95) == (100, 32, 200)
    assert declared.capacity["a10g"].rps > 2 * generic.capacity["a10g"].rps
    # Once a mix is observed it wins over the declaration.
    seen = RequestMix(500.0, 64.0, 900.0)
    sig_seen = {"mistral-7b": ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0, seen)}
    assert estimate(short, sig_seen)["mistral-7b"].mix == seen


def test_tpot_correction_compares_with_the_busiest_replicas_batch_and_moves_by_time() -> None:
    """A new replica that took no load yet halves the mean batch; TPOT p95 comes from the busy one."""
    from rayscale.core.estimate import correction_smoothing

    cat = load_catalog()
    prof = cat.profile("mistral-7b", "a10g")
    obs_tpot = tpot_p95_at(prof, cat.models["mistral-7b"].slo, MIX, 40)  # 40 sequences, as profiled
    sig = ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 0.01, MIX, per_flavor={
        "a10g": FlavorObservation(replicas=2, running_per_replica=20.0, running_max_replica=40.0,
                                  tpot_p95_s=obs_tpot, completed=50)})
    assert update_corrections(cat, {"mistral-7b": sig}, {})[("mistral-7b", "a10g")].tpot == pytest.approx(1.0)
    # The same observation on a 2 s period moves a correction 0.7% of the way, on 5 s 1.7%: ~300 s either way.
    assert correction_smoothing(2.0) == pytest.approx(0.00664, abs=0.0001)
    assert correction_smoothing(5.0) == pytest.approx(0.0165, abs=0.0001)
    slow = ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 0.01, MIX, per_flavor={
        "a10g": FlavorObservation(replicas=1, running_max_replica=40.0, tpot_p95_s=2 * obs_tpot, completed=50)})
    c: dict = {}
    for _ in range(150):  # 300 s of 2 s periods
        c = update_corrections(cat, {"mistral-7b": slow}, c, smoothing=correction_smoothing(2.0))
    assert c[("mistral-7b", "a10g")].tpot == pytest.approx(1 + (1 - 1 / 2.718281828), abs=0.02)


def test_optional_prefill_terms_enter_ttft_and_the_decode_budget():
    from rayscale.core.estimate import tpot_at

    p = PROF.model_copy(update={"prefill_quadratic_s": 1e-8, "prefill_seq_s": 0.002})
    n = 1000.0
    assert p.ttft_s(n) == pytest.approx(PROF.ttft_s(n) + 1e-8 * n * n)
    assert p.prefill_engine_s(n) == pytest.approx(0.002 + n / PROF.prefill_tokens_per_s + 1e-8 * n * n)
    # Every sequence's prompt takes its engine time from the decodes, spread over its output tokens.
    mix = MIX
    extra = (p.prefill_engine_s(mix.prompt_mean) - PROF.prefill_engine_s(mix.prompt_mean)) / mix.output_mean
    assert tpot_at(p, 8, mix) == pytest.approx(tpot_at(PROF, 8, mix) + 8 * extra)


def test_per_prompt_cost_cannot_exceed_the_overhead_it_is_part_of():
    with pytest.raises(ValueError, match=r"prefill_seq_s .* is part of overhead_s"):
        PROF.model_validate({**PROF.model_dump(), "prefill_seq_s": PROF.overhead_s * 2})


def test_last_periods_demand_speeds_the_estimate_without_changing_it() -> None:
    """estimate(previous=...) starts each capacity search at last period's answer: same capacities (to the
    search's tolerance) as a cold estimate, and a TPOT correction remembers the prediction it compared with."""
    cat = load_catalog()
    mix = RequestMix(900, 120, 2500)
    sig = {"mistral-7b": ModelSignals("mistral-7b", Freshness.FRESH, 0.0, 6.0, mix)}
    cold = estimate(cat, sig)
    warm = estimate(cat, sig, previous=cold)
    for f, c in cold["mistral-7b"].capacity.items():
        w = warm["mistral-7b"].capacity[f]
        assert w.feasible == c.feasible
        assert w.rps == pytest.approx(c.rps, rel=2 * RTOL)
    moved = estimate(cat, {"mistral-7b": replace(sig["mistral-7b"], mix=RequestMix(1800, 60, 5000))}, previous=cold)
    fresh = estimate(cat, {"mistral-7b": replace(sig["mistral-7b"], mix=RequestMix(1800, 60, 5000))})
    for f, c in fresh["mistral-7b"].capacity.items():
        assert moved["mistral-7b"].capacity[f].rps == pytest.approx(c.rps, rel=2 * RTOL)
    obs = ModelSignals("mistral-7b", Freshness.FRESH, 0.0, 6.0, mix, per_flavor={
        "a10g": FlavorObservation(replicas=2, running_per_replica=4.0, tpot_p95_s=0.05, completed=50.0)})
    c = update_corrections(cat, {"mistral-7b": obs}, {})[("mistral-7b", "a10g")]
    assert c.tpot_p95_predicted_s > 0
    again = update_corrections(cat, {"mistral-7b": obs}, {("mistral-7b", "a10g"): c})[("mistral-7b", "a10g")]
    assert again.tpot_p95_predicted_s == c.tpot_p95_predicted_s
