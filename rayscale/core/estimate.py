"""Estimate: signals -> the capacity each model needs, and what one replica on each flavor delivers.

Capacity is counted in requests per second of the model's current request mix. One replica on a flavor
runs a batch of b sequences; prefill of new requests interleaves with decode (chunked prefill), so the
time per output token a sequence sees is

    TPOT(b) = alpha + beta*b + b*P/(R*O)

(P, O: prompt and output tokens per request, R: prefill tokens/s), and by Little's law it completes
lambda(b) = b / (O * TPOT(b)) requests per second. The largest b that meets the TPOT SLO (and fits KV
cache and max_num_seqs) gives the replica's capacity; a target utilisation below 1 leaves the queueing
headroom that keeps TTFT p95 inside its SLO. Profiles are corrected by observed/predicted latency
(as NVIDIA Dynamo's planner does), smoothed and clamped so one bad window cannot swing the plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import numpy as np

from rayscale.core.catalog import SLO, Catalog, Profile, profile_key
from rayscale.core.forecast import Forecaster, last_value
from rayscale.core.signals import Freshness, ModelSignals, RequestMix


@dataclass(frozen=True)
class Correction:
    """Multipliers on predicted latency for one (model, flavor): observed / predicted, smoothed."""

    ttft: float = 1.0
    tpot: float = 1.0

    def updated(self, observed_ttft: float | None, predicted_ttft: float, observed_tpot: float | None,
                predicted_tpot: float, smoothing: float = 0.3, lo: float = 0.5, hi: float = 3.0) -> Correction:
        def step(old: float, obs: float | None, pred: float) -> float:
            if obs is None or pred <= 0 or obs <= 0:
                return old
            ratio = min(hi, max(lo, obs / pred))
            return (1 - smoothing) * old + smoothing * ratio

        return Correction(step(self.ttft, observed_ttft, predicted_ttft),
                          step(self.tpot, observed_tpot, predicted_tpot))


@dataclass(frozen=True)
class ReplicaCapacity:
    flavor: str
    rps: float  # requests/s one replica serves within the SLO at the target utilisation; 0 if infeasible
    batch: int  # sequences it runs at that load
    tpot_s: float
    ttft_floor_s: float  # TTFT of the p95 prompt with no queue
    reason: str = ""  # why infeasible, when rps == 0

    @property
    def feasible(self) -> bool:
        return self.rps > 0


def tpot_at(profile: Profile, batch: float, mix: RequestMix, corr: Correction = Correction()) -> float:
    # Every sequence's prompt is prefilled once in iterations the others decode in: its engine time spread
    # over its output tokens.
    o = max(mix.output_mean, 1.0)
    return corr.tpot * (profile.itl_s(batch) + batch * profile.prefill_engine_s(mix.prompt_mean) / o)


def replica_capacity(profile: Profile, slo: SLO, mix: RequestMix, corr: Correction = Correction(),
                     target_utilization: float = 0.8) -> ReplicaCapacity:
    p, o = mix.prompt_mean, max(mix.output_mean, 1.0)
    ttft_floor = corr.ttft * profile.ttft_s(mix.prompt_p95)
    if ttft_floor > slo.ttft_p95_s:
        return ReplicaCapacity(profile.flavor, 0.0, 0, 0.0, ttft_floor,
                               f"p95 prompt ({mix.prompt_p95:.0f} tok) prefills in {ttft_floor:.2f}s "
                               f"> TTFT SLO {slo.ttft_p95_s}s")
    # Largest batch meeting TPOT: corr*(alpha + b*(beta + prefill(P)/O)) <= slo.
    per_seq = profile.itl_beta_s + profile.prefill_engine_s(p) / o
    b_slo = math.floor((slo.tpot_p95_s / corr.tpot - profile.itl_alpha_s) / per_seq) if per_seq > 0 else 10**9
    if b_slo < 1 and per_seq > 0 and (slo.tpot_p95_s - profile.itl_alpha_s) / per_seq >= 1:
        # The profile meets the SLO; only the correction says it does not. Keep one sequence's worth of
        # capacity so that a pessimistic correction makes the planner scale out, never give up.
        b_slo = 1
    b_kv = math.floor(profile.kv_tokens / max(p + o, 1.0))
    b = min(b_slo, b_kv, profile.max_num_seqs)
    if b < 1:
        why = "KV cache holds no whole request" if b_kv < 1 else (
            f"inter-token latency {tpot_at(profile, 1, mix, corr):.3f}s at batch 1 > TPOT SLO {slo.tpot_p95_s}s")
        return ReplicaCapacity(profile.flavor, 0.0, 0, 0.0, ttft_floor, why)
    tpot = tpot_at(profile, b, mix, corr)
    lam = b / (o * tpot)
    return ReplicaCapacity(profile.flavor, lam * target_utilization, b, tpot, ttft_floor)


def _new(cls: type, **fields: Any) -> Any:
    """Build a frozen dataclass without its ``__init__`` (one ``object.__setattr__`` per field is the
    slowest part of a 1,000-model reconcile). Only for classes without ``__post_init__``."""
    obj: Any = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def replica_capacities(profiles: Sequence[Profile], slos: Sequence[SLO], mixes: Sequence[RequestMix],
                       corrs: Sequence[Correction], target_utilization: float = 0.8) -> list[ReplicaCapacity]:
    """``replica_capacity`` over many (profile, SLO, mix, correction) tuples at once, with numpy.

    Same arithmetic in the same order as the scalar reference, so the results are identical (the tests
    check it); infeasible entries are delegated to the scalar function for their reason text.
    """
    n = len(profiles)
    if n == 0:
        return []
    ctx: dict[tuple[int, int, int], tuple[float, ...]] = {}  # per (slo, mix, corr): shared by a model's pairs
    rows = []
    for pr, s, m, c in zip(profiles, slos, mixes, corrs, strict=True):
        key = (id(s), id(m), id(c))
        t = ctx.get(key)
        if t is None:
            t = ctx[key] = (s.ttft_p95_s, s.tpot_p95_s, m.prompt_mean, m.output_mean, m.prompt_p95, c.ttft, c.tpot)
        rows.append((pr.prefill_tokens_per_s, pr.overhead_s, pr.itl_alpha_s, pr.itl_beta_s, pr.max_num_seqs,
                     pr.kv_tokens, pr.prefill_quadratic_s, pr.prefill_seq_s, *t))
    cols = np.array(rows, dtype=float).T
    r, over, alpha, beta, max_seqs, kv, quad, seq, ttft_slo, tpot_slo, p, o_raw, p95, c_ttft, c_tpot = cols
    o = np.maximum(o_raw, 1.0)
    ttft_floor = c_ttft * (0.0 + over + p95 / r + quad * p95 * p95)
    per_seq = beta + (seq + p / r + quad * p * p) / o
    with np.errstate(divide="ignore", invalid="ignore"):
        b_slo = np.where(per_seq > 0, np.floor((tpot_slo / c_tpot - alpha) / per_seq), 1e9)
        b_unc = np.where(per_seq > 0, (tpot_slo - alpha) / per_seq, 1e9)
    b_slo = np.where((b_slo < 1) & (per_seq > 0) & (b_unc >= 1), 1.0, b_slo)
    b_kv = np.floor(kv / np.maximum(p + o, 1.0))
    b = np.minimum(np.minimum(b_slo, b_kv), max_seqs)
    ok = (ttft_floor <= ttft_slo) & (b >= 1)
    bf = np.where(ok, b, 1.0)
    tpot = c_tpot * ((alpha + beta * np.maximum(bf, 1.0)) + bf * (seq + p / r + quad * p * p) / o)
    rps = bf / (o * tpot) * target_utilization
    out: list[ReplicaCapacity] = []
    ok_l, rps_l, b_l, tpot_l, floor_l = ok.tolist(), rps.tolist(), bf.tolist(), tpot.tolist(), ttft_floor.tolist()
    for i in range(n):
        if ok_l[i]:
            out.append(_new(ReplicaCapacity, flavor=profiles[i].flavor, rps=rps_l[i], batch=int(b_l[i]),
                            tpot_s=tpot_l[i], ttft_floor_s=floor_l[i], reason=""))
        else:
            out.append(replica_capacity(profiles[i], slos[i], mixes[i], corrs[i], target_utilization))
    return out


class DemandState(StrEnum):
    OK = "ok"
    HOLD = "hold"  # signals stale or missing: keep what runs, never scale down on no data


@dataclass(frozen=True)
class Demand:
    model: str
    state: DemandState
    rps: float  # capacity to provision (req/s of this model's mix); meaningless when HOLD
    mix: RequestMix
    capacity: dict[str, ReplicaCapacity] = field(default_factory=dict)  # per flavor
    reason: str = ""


@dataclass(frozen=True)
class EstimateSettings:
    target_utilization: float = 0.8
    # Queued requests are cleared within this, on top of arrivals. Never faster than the model's quickest
    # replica start (node + load): capacity ordered for a backlog arrives only then, and ordering for a
    # 30 s drain when replicas take 10 min to start buys a fleet that lands idle after the queue is gone.
    backlog_drain_s: float = 30.0
    headroom: float = 0.0  # extra fraction of demand to provision


def prior_mix(catalog: Catalog, model: str) -> RequestMix:
    """The mix to size with before one is observed: the model's declared ``request_mix``, else a generic
    long-ish one (capacity not overstated; a short-request model then orders too much until it is seen)."""
    spec = catalog.models[model].request_mix if model in catalog.models else None
    if spec is None:
        return RequestMix.default()
    return RequestMix(spec.prompt_mean, spec.output_mean, spec.prompt_p95 or 2.0 * spec.prompt_mean)


def estimate(catalog: Catalog, signals: dict[str, ModelSignals],
             corrections: dict[tuple[str, str], Correction] | None = None,
             forecaster: Forecaster = last_value, settings: EstimateSettings = EstimateSettings(),
             ) -> dict[str, Demand]:
    """Demand per catalog model. A model with no usable signals gets state HOLD with the reason."""
    corrections = corrections or {}
    out: dict[str, Demand] = {}
    none = Correction()
    mixes = {name: (sig.mix if sig and sig.mix else None) or prior_mix(catalog, name)
             for name in catalog.models for sig in (signals.get(name),)}
    pairs = [(name, f) for name, spec in catalog.models.items() for f in spec.parallelism]
    profiles = catalog.profiles
    all_caps = replica_capacities(
        [profiles[profile_key(m, f)] for m, f in pairs], [catalog.models[m].slo for m, _ in pairs],
        [mixes[m] for m, _ in pairs], [corrections.get(k, none) for k in pairs], settings.target_utilization)
    caps_of: dict[str, dict[str, ReplicaCapacity]] = {name: {} for name in catalog.models}
    for (m, f), c in zip(pairs, all_caps, strict=True):
        caps_of[m][f] = c
    for name in catalog.models:
        sig = signals.get(name)
        mix = mixes[name]
        caps = caps_of[name]
        if sig is None or not sig.usable:
            fresh = sig.freshness if sig else Freshness.MISSING
            age = f" (last sample {sig.age_s:.0f}s ago)" if sig and sig.age_s is not None else ""
            out[name] = Demand(name, DemandState.HOLD, 0.0, mix, caps, f"signals {fresh.value}{age}: holding capacity")
            continue
        assert sig.arrival_rate_rps is not None
        rate = forecaster(sig.rate_history, sig.arrival_rate_rps)
        startup = min((catalog.flavors[f].node_startup_s + catalog.profile(name, f).startup_s
                       for f in catalog.models[name].parallelism), default=0.0)
        backlog = (sig.waiting or 0.0) / max(settings.backlog_drain_s, startup)
        rps = (rate + backlog) * (1.0 + settings.headroom)
        why = f"{sig.arrival_rate_rps:.2f} req/s observed"
        if rate > sig.arrival_rate_rps + 1e-9:
            why += f", {rate:.2f} forecast"
        if backlog > 0:
            why += f", {sig.waiting:.0f} queued"
        out[name] = Demand(name, DemandState.OK, rps, mix, caps, why)
    return out


# A p95 of fewer requests than this is mostly noise: one slow request would move capacity by half.
MIN_CORRECTION_SAMPLES = 8
# Corrections follow a persistent error over about this long, not one overloaded window: a 2 s period
# weighs each window 6%, a 5 s one 15%.
CORRECTION_TIME_CONSTANT_S = 30.0


def correction_smoothing(period_s: float, time_constant_s: float = CORRECTION_TIME_CONSTANT_S) -> float:
    """Weight of one period's observation: the same response in seconds whatever the control period."""
    return 1.0 - math.exp(-period_s / time_constant_s)


def update_corrections(catalog: Catalog, signals: dict[str, ModelSignals],
                       previous: dict[tuple[str, str], Correction],
                       min_samples: float = MIN_CORRECTION_SAMPLES,
                       smoothing: float = 0.3) -> dict[tuple[str, str], Correction]:
    """New corrections from observed latency per (model, flavor); unobserved pairs keep theirs, and so do
    pairs whose window finished fewer than ``min_samples`` requests (when the count is known).
    ``smoothing``: weight of this window (``correction_smoothing(period)`` in the loops)."""
    out = dict(previous)
    for name, sig in signals.items():
        if name not in catalog.models or not sig.usable or sig.mix is None:
            continue
        for flavor, obs in sig.per_flavor.items():
            if flavor not in catalog.models[name].parallelism or obs.replicas <= 0:
                continue
            if obs.completed is not None and obs.completed < min_samples:
                continue
            prof = catalog.profile(name, flavor)
            mix = replace(sig.mix, prompt_mean=obs.prompt_mean or sig.mix.prompt_mean)
            # Compare with the batch the window ran at, not the gauge's instant value: by Little's law
            # the mean running sequences per replica are arrivals x output tokens x time per token.
            batch = obs.running_per_replica if obs.running_per_replica is not None else 1.0
            if obs.running_max_replica is not None:
                batch = max(batch, obs.running_max_replica)
            if obs.tpot_p95_s is not None and sig.arrival_rate_rps is not None:
                share = obs.replicas / max(sum(o.replicas for o in sig.per_flavor.values()), 1)
                little = sig.arrival_rate_rps * share / obs.replicas * mix.output_mean * obs.tpot_p95_s
                batch = max(batch, little)
            # TTFT: the profile predicts prefill, not queueing. Compare the engine's own prefill time
            # (scheduled -> first token) with the mean prompt's when it is reported; otherwise TTFT p95,
            # but only in a window without a backlog, where TTFT is (nearly) all prefill. Correcting on a
            # queue would call the flavor slow and rule it out exactly when capacity is short.
            if obs.prefill_mean_s is not None:
                ttft_obs, ttft_pred = obs.prefill_mean_s, prof.ttft_s(mix.prompt_mean)
            elif sig.waiting is None or sig.waiting > 0:
                ttft_obs, ttft_pred = None, 0.0
            else:
                ttft_obs, ttft_pred = obs.ttft_p95_s, prof.ttft_s(mix.prompt_p95)
            old = previous.get((name, flavor), Correction())
            out[(name, flavor)] = old.updated(
                ttft_obs, ttft_pred,
                obs.tpot_p95_s, tpot_at(prof, max(batch, 1.0), mix), smoothing=smoothing,
            )
    return out
