"""Estimate: signals -> the capacity each model needs, and what one replica on each flavor delivers.

Capacity is counted in requests per second of the model's current request mix. One replica on a flavor
runs a batch of b sequences; prefill of new requests interleaves with decode (chunked prefill), so the
time per output token the mean request sees is

    TPOT(b) = alpha + beta*b + b*P/(R*O)

(P, O: prompt and output tokens per request, R: prefill tokens/s), and by Little's law it completes
lambda(b) = b / (O * TPOT(b)) requests per second. The SLO counts requests, so the replica's capacity is
the largest lambda(b) at which ``attainment`` of them meet both targets: rayscale.core.attainment adds the
tails the mean leaves out (prefill stalls in short answers, waits behind other prompts), bounded by KV
cache and max_num_seqs. A target utilisation below 1 leaves headroom for what no model of one replica
sees (bursts, forecast error). Profiles are corrected by observed/predicted latency (as NVIDIA Dynamo's
planner does), smoothed and clamped so one bad window cannot swing the plan.

Where a flavor cannot meet the SLO for the mix at all, it still gets a best-effort capacity (what it serves
adding the fewest misses, ``best_effort_capacities``): a model no flavor of which meets it is sized with
those (Demand.best_effort says why), and the others keep them aside for when limits cap the flavors that
do (Demand.fallback). Prompts past the model's max_model_len are cut to it (``within_context``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from rayscale.core.attainment import (
    CHUNK_TOKENS,
    LOAD_FLOOR,
    Load,
    Rows,
    at_load,
    largest_load,
    make_rows,
    mix_quantiles,
    prompt_end,
    rate_at,
    subset,
    tpot_quantile,
)
from rayscale.core.burst import BURST_BUDGET_SHARE, burst_rate, sharpness
from rayscale.core.catalog import SLO, Catalog, Profile, profile_key
from rayscale.core.derived import derived
from rayscale.core.forecast import Forecaster, last_value
from rayscale.core.frozen import replaced
from rayscale.core.signals import (
    MIX_QUANTILES,
    MIX_WEIGHTS,
    FlavorObservation,
    Freshness,
    ModelSignals,
    RequestMix,
)

# Share of requests a replica's capacity serves within both SLO targets: issue 6's goal. The SLO's targets
# are p95s; sizing for 99% leaves room for what the tail model leaves out (bursts within a minute).
DEFAULT_ATTAINMENT = 0.99


@dataclass(frozen=True)
class Correction:
    """Multipliers on one (model, flavor)'s profile (its latency, the KV tokens a sequence holds): observed /
    predicted, smoothed."""

    ttft: float = 1.0
    tpot: float = 1.0
    # The per-request TPOT p95 the profile predicted for the last window (what ``tpot`` compared it with),
    # 0 before one: the next period's search for it starts there (attainment._crossing).
    tpot_p95_predicted_s: float = 0.0
    # KV-cache tokens a running sequence holds, observed (vLLM's kv_cache_usage_perc x the profile's kv_tokens
    # over num_requests_running) over the mix's prompt + output mean, which the KV bound on the batch assumes.
    # The sequences in flight are not the mix's average request: a long answer stays in flight longer, so
    # they are longer than it, and they hold their prompt and the answer so far (vLLM allocates blocks for
    # the tokens each step schedules, vllm/v1/core/sched/scheduler.py allocate_slots, and preempts when
    # none are free; the simulator reserves the whole answer at admission). On the 72B day on L40S the
    # fleet's queue built at 27 sequences a replica where the mean request fits 33, and the day met 93.42%
    # on one seed (bench/results/eval_models_kv.md; dev: tune_kv.md).
    kv: float = 1.0

    def updated(self, observed_ttft: float | None, predicted_ttft: float, observed_tpot: float | None,
                predicted_tpot: float, smoothing: float = 0.3, lo: float = 0.5, hi: float = 3.0,
                observed_kv: float | None = None, predicted_kv: float = 0.0) -> Correction:
        def step(old: float, obs: float | None, pred: float) -> float:
            if obs is None or pred <= 0 or obs <= 0:
                return old
            ratio = min(hi, max(lo, obs / pred))
            return (1 - smoothing) * old + smoothing * ratio

        return Correction(step(self.ttft, observed_ttft, predicted_ttft),
                          step(self.tpot, observed_tpot, predicted_tpot), predicted_tpot,
                          step(self.kv, observed_kv, predicted_kv))


class ReplicaCapacity(NamedTuple):
    """One replica of a (model, flavor) at the SLO. A named tuple, not a dataclass: a 1,000-model step makes
    14,000 of them, and a tuple is built in a quarter of the time (``_replace`` changes fields)."""

    flavor: str
    rps: float  # requests/s one replica serves within the SLO at the target utilisation; 0 if infeasible
    batch: float  # sequences it runs on average at full load (before target utilisation); 0 if infeasible
    tpot_s: float
    ttft_floor_s: float  # TTFT of the p95 prompt with no queue
    reason: str = ""  # why infeasible (the SLO's reason also when best_effort)
    # The SLO is out of reach on this flavor and rps is what it serves adding the fewest misses
    # (best_effort_capacities); ``miss``: the share of requests expected to miss the SLO at that load.
    best_effort: bool = False
    miss: float = 0.0

    @property
    def feasible(self) -> bool:
        """Meets the SLO (a best-effort capacity serves, but does not)."""
        return self.rps > 0 and not self.best_effort


# The simulator hands the same hour of counts for a minute while it asks every period (the same as
# forecast._season_of): computed once.
_burst_rate = functools.lru_cache(maxsize=16)(burst_rate)


def _burst_floor(counts: tuple[float, ...], bin_s: float, ttft_s: float, attainment: float) -> tuple[float, float]:
    """(burst rate, sharpness) of the counts."""
    burst = _burst_rate(counts, bin_s, ttft_s, attainment)
    return burst, sharpness(counts, bin_s, burst)


def drain_rps(profile: Profile, mix: RequestMix, batch: float, tpot_s: float) -> float:
    """Requests/s one replica starts once a burst has queued more than it can hold: the rate a queue drains
    at, not the capacity at the SLO. The lower of two bounds: prompts prefill one chunk per iteration beside
    ``batch`` decodes, and with the batch as full as the TPOT target ``tpot_s`` allows (and max_num_seqs and
    the KV cache) a request starts only when one finishes. The profile as given (no correction).

    The TPOT bound matters where prompts are long: a full batch (110) of the Azure code trace's 2,000-token
    prompts on an L40S decodes at 0.58 s a token against a 0.1 s target, so a burst drained there misses
    TPOT instead of TTFT; at the target's batch (15) a replica drains 5.4 req/s, not 6.3. The floor so
    counted is worth 1.7 points there (x3, steady state: 98.77% with it, 97.04% without; bench/results/tune.md)."""
    p, o = max(mix.prompt_mean, 1.0), max(mix.output_mean, 1.0)
    chunk = profile.max_num_batched_tokens or CHUNK_TOKENS
    per_token = profile.prefill_engine_s(p) / p
    prefill = chunk / (profile.itl_s(batch) + chunk * per_token) / p
    full = max(min(float(profile.max_num_seqs), profile.kv_tokens / (p + o)), 1.0)
    # tpot_at is affine in the batch from one sequence up: alpha + b (beta + prefill / o).
    per_seq = profile.itl_beta_s + profile.prefill_engine_s(mix.prompt_mean) / o
    within = (tpot_s - profile.itl_alpha_s) / per_seq if per_seq > 0 else full
    full = min(full, max(within, 1.0))
    finish = full / (o * tpot_at(profile, full, mix))
    return min(prefill, finish)


def tpot_at(profile: Profile, batch: float, mix: RequestMix, corr: Correction = Correction()) -> float:
    # Every sequence's prompt is prefilled once in iterations the others decode in: its engine time spread
    # over its output tokens.
    o = max(mix.output_mean, 1.0)
    return corr.tpot * (profile.itl_s(batch) + batch * profile.prefill_engine_s(mix.prompt_mean) / o)


def tpot_p95_at(profile: Profile, slo: SLO, mix: RequestMix, batch: float) -> float:
    """Per-request TPOT p95 the uncorrected tail model predicts at a mean batch: what a TPOT correction
    compares a window's TPOT p95 with (the mean request's TPOT would read every tail as a slow profile)."""
    rows = rows_of([profile], [slo], [mix], [Correction()])
    return float(tpot_quantile(rows, np.array([max(batch, LOAD_FLOOR)]))[0])


def replica_capacity(profile: Profile, slo: SLO, mix: RequestMix, corr: Correction = Correction(),
                     target_utilization: float = 0.8, attainment: float = DEFAULT_ATTAINMENT,
                     alone: bool = False) -> ReplicaCapacity:
    """What one replica on ``profile`` serves within the SLO (``replica_capacities`` for one row)."""
    return replica_capacities([profile], [slo], [mix], [corr], target_utilization, attainment, alone=alone)[0]


_PROFILE_COLUMNS = itemgetter("prefill_tokens_per_s", "overhead_s", "itl_alpha_s", "itl_beta_s", "prefill_seq_s",
                              "prefill_quadratic_s")
_KV_COLUMNS = itemgetter("kv_tokens", "max_num_seqs")


@dataclass
class _ColumnCache:
    """The profile columns of the last few large batches, by their profiles' ids. Profiles are frozen and an
    entry keeps them alive, so equal ids mean the same profiles: a control loop asks for the same ones every
    period (the estimate's every pair, the corrections' observed pairs, the best-effort rows)."""

    entries: dict[bytes, tuple[tuple[Profile, ...], npt.NDArray[np.float64]]] = field(default_factory=dict)


_COLUMNS = _ColumnCache()
_CACHED_FROM = 256  # rows: smaller batches (one model's, a subset's) are cheap and would only evict the big ones
_CACHED_BATCHES = 4


def _profile_columns(profiles: Sequence[Profile]) -> npt.NDArray[np.float64]:
    """Per profile: the six _PROFILE_COLUMNS, its prefill chunk, kv_tokens and max_num_seqs (one row each)."""
    key = b""
    if len(profiles) >= _CACHED_FROM:
        key = np.fromiter(map(id, profiles), dtype=np.int64, count=len(profiles)).tobytes()
        if (hit := _COLUMNS.entries.pop(key, None)) is not None:
            _COLUMNS.entries[key] = hit  # the most recently used last: the oldest goes first
            return hit[1]
    # Straight from the models' field dicts: attribute access on 14,000 pydantic profiles is most of the time.
    fields = list(map(vars, profiles))
    cols = np.empty((len(profiles), 9))
    cols[:, :6] = np.array(list(map(_PROFILE_COLUMNS, fields)), dtype=float).reshape(-1, 6)
    # The chunk the replicas run: pinned by rayscale.core.chunk.pin_chunks, else vLLM's default.
    cols[:, 6] = [f["max_num_batched_tokens"] or CHUNK_TOKENS for f in fields]
    cols[:, 7:] = np.array(list(map(_KV_COLUMNS, fields)), dtype=float).reshape(-1, 2)
    if key:
        cols.flags.writeable = False  # shared by later calls: nothing may change it in place
        if len(_COLUMNS.entries) >= _CACHED_BATCHES:
            del _COLUMNS.entries[next(iter(_COLUMNS.entries))]  # the least recently used
        _COLUMNS.entries[key] = (tuple(profiles), cols)
    return cols


def _shared(items: Sequence[Any], f: Callable[[Any], Any]) -> tuple[list[Any], npt.NDArray[np.intp]]:
    """``f`` of each distinct object in ``items`` (by identity) and, per item, the index of its value: a
    model's rows share its mix and SLO, so each is worked out once."""
    n = len(items)
    ids = np.fromiter(map(id, items), dtype=np.int64, count=n)
    # Rows come in runs of one object (a model's flavors): the distinct ones are found among the runs.
    starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]])) if n else np.zeros(0, dtype=np.intp)
    _, first, of_run = np.unique(ids[starts], return_index=True, return_inverse=True)
    of_item = np.repeat(of_run.reshape(-1), np.diff(np.append(starts, n)))
    return [f(items[i]) for i in starts[first].tolist()], of_item


def rows_of(profiles: Sequence[Profile], slos: Sequence[SLO], mixes: Sequence[RequestMix],
          corrs: Sequence[Correction], uncorrected: bool = False,
          prefill_scale: npt.NDArray[np.float64] | None = None) -> Rows:
    """The tail model's column arrays, one row per (profile, SLO, mix, correction); ``uncorrected``: every
    correction taken as 1 (what the profile alone says); ``prefill_scale``: per row, the factor its prefill
    is faster by (prefix_scales; None: 1)."""
    lengths, by_mix = _shared(mixes, lambda m: (*mix_quantiles(m), max(m.output_mean, 1.0), prompt_end(m)))
    targets, by_slo = _shared(slos, lambda s: (s.ttft_p95_s, s.tpot_p95_s))
    r, over, alpha, beta, seq, quad, chunk = _profile_columns(profiles)[:, :7].T
    if prefill_scale is not None:
        r = r * prefill_scale
    ttft, tpot = np.array(targets, dtype=float).reshape(-1, 2)[by_slo].T
    factors, by_corr = _shared(corrs, lambda c: (1.0, 1.0) if uncorrected else (c.ttft, c.tpot))
    c_ttft, c_tpot = np.array(factors, dtype=float).reshape(-1, 2)[by_corr].T
    nodes = len(MIX_QUANTILES)
    prompt = np.array([q[0] for q in lengths], dtype=float).reshape(-1, nodes)[by_mix]
    output = np.array([q[1] for q in lengths], dtype=float).reshape(-1, nodes)[by_mix]
    o, end = np.array([q[2:] for q in lengths], dtype=float).reshape(-1, 2)[by_mix].T
    return make_rows(r, over, alpha, beta, seq, quad, ttft, tpot, c_ttft, c_tpot, o, chunk, prompt, output, end)


def replica_capacities(profiles: Sequence[Profile], slos: Sequence[SLO], mixes: Sequence[RequestMix],
                       corrs: Sequence[Correction], target_utilization: float = 0.8,
                       attainment: float = DEFAULT_ATTAINMENT, guesses: Sequence[float] | None = None,
                       prefill_scale: Sequence[float] | None = None, alone: bool = False) -> list[ReplicaCapacity]:
    """Per (profile, SLO, mix, correction): the largest arrival rate at which one replica serves
    ``attainment`` of the mix's requests within both SLO targets (rayscale.core.attainment's tail model),
    bounded by KV cache and max_num_seqs, times ``target_utilization``.

    A flavor is infeasible when even an idle replica misses: the p95 prompt alone prefills past the TTFT
    target, no request fits its KV cache, or the misses at no load exceed the allowance. A flavor the
    uncorrected profile calls feasible keeps one sequence's worth of capacity however pessimistic its
    correction, so that the planner scales it out and never gives up on it.

    ``guesses``: per row, the batch found last period (0: none); the search starts there, which in a
    control loop makes it several times cheaper (the answer is the same to the search's tolerance).
    ``prefill_scale``: per row, the factor its prefill is faster by (prefix_scales; None: 1). ``alone``: each
    replica is its flavor deployment's only one (rayscale.core.attainment.at_load)."""
    n = len(profiles)
    if n == 0:
        return []
    allowed = 1.0 - attainment
    scale = np.ones(n) if prefill_scale is None else np.asarray(prefill_scale, dtype=float)
    rows = rows_of(profiles, slos, mixes, corrs, prefill_scale=scale)
    sizes, by_mix = _shared(mixes, lambda m: (m.prompt_p95, max(m.prompt_mean + m.output_mean, 1.0)))
    p95, request_tokens = np.array(sizes, dtype=float).reshape(-1, 2)[by_mix].T
    ttft_floor = rows.corr_ttft * (rows.overhead_s + p95 / rows.prefill_tokens_per_s + rows.quad_s * p95 * p95)
    kv_fit, kv_batch, max_num_seqs = _kv_bound(profiles, request_tokens, corrs)
    high = np.minimum(kv_batch, max_num_seqs)
    floor_ok = (ttft_floor <= rows.ttft_slo) & (kv_fit >= 1)
    batch = largest_load(rows, high, allowed, None if guesses is None else np.array(guesses, dtype=float), alone)
    ok = floor_ok & (batch > 0)  # batch 0: even an idle replica misses more than allowed
    # Never give up on a flavor only its correction rules out: one sequence, at the corrected latency.
    rescue = floor_ok & ~ok
    if rescue.any():
        idx = np.flatnonzero(rescue)
        plain = at_load(rows_of([profiles[i] for i in idx], [slos[i] for i in idx], [mixes[i] for i in idx],
                                [corrs[i] for i in idx], uncorrected=True, prefill_scale=scale[idx]),
                        np.full(len(idx), LOAD_FLOOR), alone)
        rescue[idx] = plain.miss <= allowed
        batch = np.where(rescue, 1.0, batch)
    good = ok | rescue
    rate, tpot_mean = rate_at(rows, np.maximum(batch, LOAD_FLOOR))
    rps = rate * target_utilization
    # Why a flavor is out, for the plan's notes: the idle replica's misses, one call for all such rows.
    missing = np.flatnonzero(~good & floor_ok)
    idle_at = dict(zip(missing.tolist(), range(len(missing)), strict=True))
    idle = at_load(subset(rows, missing), np.full(len(missing), LOAD_FLOOR), alone) if missing.size else None
    out: list[ReplicaCapacity] = []
    append, make = out.append, tuple.__new__
    for i, (p, meets, r, b, t, fl) in enumerate(zip(profiles, good.tolist(), rps.tolist(), batch.tolist(),
                                                 tpot_mean.tolist(), ttft_floor.tolist(), strict=True)):
        if meets:  # ReplicaCapacity(...) without its generated __new__'s call: 14,000 rows a step
            append(make(ReplicaCapacity, (p.flavor, r, b, t, fl, "", False, 0.0)))
            continue
        why = _infeasible_reason(scaled_profile(p, float(scale[i])), slos[i], mixes[i], corrs[i], fl,
                                 float(kv_fit[i]), (idle, idle_at[i]) if i in idle_at else None, allowed)
        append(ReplicaCapacity(p.flavor, 0.0, 0.0, 0.0, fl, reason=why))
    return out


def _kv_bound(profiles: Sequence[Profile], request_tokens: npt.NDArray[np.float64],
              corrs: Sequence[Correction]) -> tuple[npt.NDArray[np.float64], ...]:
    """Per row: the mean requests its KV cache holds (below 1: none fits, the flavor is out), the sequences
    it runs at once by the observed KV tokens each holds (Correction.kv; at least 1 where a request fits),
    and max_num_seqs."""
    kv_tokens, max_num_seqs = _profile_columns(profiles)[:, 7:].T
    kv_fit = np.floor(kv_tokens / request_tokens)
    held = np.array([c.kv for c in corrs], dtype=float)
    kv_batch = np.where(kv_fit >= 1, np.maximum(np.floor(kv_tokens / (request_tokens * held)), 1.0), kv_fit)
    return kv_fit, kv_batch, max_num_seqs


def _infeasible_reason(pr: Profile, s: SLO, m: RequestMix, c: Correction, ttft_floor: float, kv_fit: float,
                       idle: tuple[Load | None, int] | None, allowed: float) -> str:
    """Why one replica cannot meet the SLO (for the plan's notes); ``idle``: the idle replica's misses and
    this row's index in them, where those are what rules it out."""
    if ttft_floor > s.ttft_p95_s:
        return f"p95 prompt ({m.prompt_p95:.0f} tok) prefills in {ttft_floor:.2f}s > TTFT SLO {s.ttft_p95_s}s"
    if kv_fit < 1:
        return "KV cache holds no whole request"
    if c.tpot * pr.itl_s(1) > s.tpot_p95_s:
        return f"inter-token latency {tpot_at(pr, 1, m, c):.3f}s at batch 1 > TPOT SLO {s.tpot_p95_s}s"
    assert idle is not None
    load, j = idle
    assert load is not None
    return (f"an idle replica misses the SLO for {float(load.miss[j]):.1%} of requests (TTFT "
            f"{float(load.ttft_miss[j]):.1%}, TPOT {float(load.tpot_miss[j]):.1%}) > {allowed:.0%}")


def best_effort_capacities(profiles: Sequence[Profile], slos: Sequence[SLO], mixes: Sequence[RequestMix],
                           corrs: Sequence[Correction], infeasible: Sequence[ReplicaCapacity],
                           target_utilization: float = 0.8, attainment: float = DEFAULT_ATTAINMENT,
                           prefill_scale: Sequence[float] | None = None) -> list[ReplicaCapacity]:
    """Per row whose SLO is out of reach (``infeasible``, from replica_capacities): the largest arrival rate
    at which one replica misses at most ``1 - attainment`` more of the requests than it does idle, times
    ``target_utilization``; marked ``best_effort``, keeping the SLO's reason.

    The misses an idle replica has (prompts whose own prefill passes the TTFT target, decode steps slower
    than the TPOT target) no capacity removes; what load adds, capacity does. So this serves every request
    the flavor can serve within the SLO and adds as few misses as the SLO's own allowance. Where the idle
    replica misses every request it comes down to throughput: the load at which the prefill queue still
    keeps up. A flavor whose KV cache holds no whole request serves nothing (rps 0). ``prefill_scale``: as
    in replica_capacities."""
    if not profiles:
        return []
    allowed = 1.0 - attainment
    rows = rows_of(profiles, slos, mixes, corrs,
                   prefill_scale=None if prefill_scale is None else np.asarray(prefill_scale, dtype=float))
    floor = np.full(len(profiles), LOAD_FLOOR)
    idle = at_load(rows, floor).miss
    # at_load's miss is the TTFT share plus the TPOT share, 2 only past the prefill queue's stability: a row
    # whose idle replica misses (nearly) everything is searched for the largest stable load.
    limit = np.where(idle + allowed < 2.0 - 1e-6, idle + allowed, 2.0 - 1e-9)
    request_tokens = np.array([max(m.prompt_mean + m.output_mean, 1.0) for m in mixes], dtype=float)
    kv_fit, kv_batch, max_num_seqs = _kv_bound(profiles, request_tokens, corrs)
    batch = largest_load(rows, np.minimum(kv_batch, max_num_seqs), limit)
    batch = np.where(kv_fit >= 1, batch, 0.0)
    load = np.maximum(batch, LOAD_FLOOR)
    rate, tpot_mean = rate_at(rows, load)
    miss = np.minimum(at_load(rows, load).miss, 1.0)
    out: list[ReplicaCapacity] = []
    for i, c in enumerate(infeasible):
        ok = bool(batch[i] > 0)
        out.append(c._replace(rps=float(rate[i]) * target_utilization if ok else 0.0,
                              batch=float(batch[i]) if ok else 0.0, tpot_s=float(tpot_mean[i]) if ok else 0.0,
                              best_effort=ok, miss=float(miss[i]) if ok else 0.0))
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
    # Req/s the fleet must drain a burst at (rayscale.core.burst; 0: none). Not demand: the planner holds
    # replicas whose queues drain it (drain_rps), counted through the model's best-value flavor.
    burst_rps: float = 0.0
    # Why no flavor meets the SLO for this mix, when ``capacity`` is best effort (best_effort_capacities);
    # "" when some flavor meets it. The planner reports it as a shortfall.
    best_effort: str = ""
    # When some flavors meet the SLO: the best-effort capacities of those that do not, which the planner
    # serves with only the demand that limits leave unmet on the others.
    fallback: dict[str, ReplicaCapacity] = field(default_factory=dict)
    # burst_rps over the last hour's busiest minute (rayscale.core.burst.sharpness; 0: no floor): near 1
    # the bursts are the level moving, well above it they come and go within the minute.
    burst_sharpness: float = 0.0
    # Req/s a scale-down keeps capacity for: where the arrival rate's recent line reaches one start-up
    # ahead (Settings.rise_window_s; 0: none), or on a rise the demand before SLO feedback trimmed it
    # (FeedbackSettings.rise_keeps_untrimmed). Not demand: nothing is ordered for it.
    rise_rps: float = 0.0
    # SLO feedback trims this demand on a level (its factor below 1, no rise): the fleet has delivered the
    # SLO with slack, and the planner may scale up only past PlannerSettings.slack_scale_up_tolerance.
    slo_slack: bool = False
    # Flavor -> what one replica serves as its flavor deployment's only one, a share of ``capacity``'s rps
    # (alone_shares), where the plan asked (rayscale.core.plan.Plan.alone_shares): the ingress weighs a
    # flavor serving on one replica by it.
    alone_share: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EstimateSettings:
    target_utilization: float = 0.8
    # The target utilisation of a model whose bursts last a minute or more (Demand.burst_sharpness at most
    # PlannerSettings.sharp_bursts_above; the step applies it, knowing both); None: target_utilization for
    # every model. A level that moves is forecast and held; the headroom is for bursts within the minute.
    smooth_target_utilization: float | None = None
    attainment: float = DEFAULT_ATTAINMENT
    # Queued requests are cleared within this, on top of arrivals. Never faster than the model's quickest
    # replica start (node + load): capacity ordered for a backlog arrives only then, and ordering for a
    # 30 s drain when replicas take 10 min to start buys a fleet that lands idle after the queue is gone.
    backlog_drain_s: float = 30.0
    headroom: float = 0.0  # extra fraction of demand to provision
    # Report the burst rate of the signals' arrival counts (Demand.burst_rps, rayscale.core.burst), which the
    # planner holds replicas for: their queues drain (``drain_rps``) each burst within the TTFT target, for
    # all but 1 - attainment of the requests. The product ships it on (rayscale/data/settings.yaml,
    # rayscale.core.settings.shipped_estimate; bench/results/burst_floor.md); a bare EstimateSettings() is off.
    burst_floor: bool = False
    # When no flavor meets a model's SLO for its mix, size it with best-effort capacities (serve the demand
    # with the fewest misses) rather than none, which orders nothing and fails every request.
    best_effort: bool = True
    # Bound each flavor's batch by the KV tokens its running sequences were seen to hold (Correction.kv)
    # rather than by the mix's mean request alone (false: the mean request).
    kv_correction: bool = True
    # Where the burst floor reads the arrival counts: the rate now is read over a shorter window than a
    # minute, so a burst within the minute reads above any minute of the hour. Capped at the hour's busiest
    # minute (which holds this moment) or the burst rate the floor sizes for, whichever is larger: a reading
    # above both is a burst the floor already holds replicas for, and capacity ordered for it lands a
    # start-up after it ended (dev minute bursts: a sixth L40S for 16 min after one 30-s reading of 11 req/s
    # where the busiest minute held 8.7). A new level shows in the busiest minute within a minute. Off as
    # shipped: 4% less on those bursts, but Azure code x3 cost 1.4% more at 99.12% (was 99.26%), 0.1% less
    # summed over dev (bench/results/tune_busiest_minute.md).
    current_within_busiest_minute: bool = False

    def __post_init__(self) -> None:
        for name in ("target_utilization", "smooth_target_utilization"):
            u = getattr(self, name)
            if u is not None and not 0 < u <= 1:
                raise ValueError(f"EstimateSettings.{name} must be in (0, 1], got {u}")


def prior_mix(catalog: Catalog, model: str) -> RequestMix:
    """The mix to size with before one is observed: the model's declared ``request_mix``, else a generic
    long-ish one (capacity not overstated; a short-request model then orders too much until it is seen)."""
    spec = catalog.models[model].request_mix if model in catalog.models else None
    if spec is None:
        return RequestMix.default()
    return RequestMix(spec.prompt_mean, spec.output_mean, spec.prompt_p95 or 2.0 * spec.prompt_mean)


# The largest prefix-cache hit rate prefill is discounted by: a window in which nearly every prompt token
# hit (a burst of one conversation) must not make prefill free and size the model to nothing.
MAX_PREFIX_DISCOUNT = 0.9


def prefix_scales(catalog: Catalog, signals: Mapping[str, ModelSignals]) -> dict[tuple[str, str], float]:
    """Per (model, flavor) with an observed prefix-cache hit rate h > 0: the factor 1 / (1 - h) by which its
    prefill is faster. Cached prompt tokens are not prefilled (vLLM's automatic prefix caching), so a prompt of
    P tokens costs P x (1 - h) tokens of prefill: its profiles prefill at R / (1 - h) (``scaled_profile``).
    KV use, the per-prompt and attention terms stay whole (cached blocks still occupy and are attended to).

    A flavor's own rate counts where its replicas report one (FlavorObservation.prefix_hit_rate): what a
    prompt finds cached depends on the flavor's KV cache and on how many replicas split the shared prefixes,
    so one flavor's rate says nothing of another's: planned on 2 H100s' rate, 6 L40S met 95.8% of a long-prompt
    trace that the H100s, discounted by their own, serve at 99.8% (bench/README.md, Mooncake seed 3). Where no flavor
    reports one, the model's rate counts for the flavors serving it (all of them with no per-flavor view).
    Only fresh, observed rates count: a flavor without one (caching off, metric missing, or not serving where
    the signals break the model down by flavor) keeps its profile, never a guessed discount. The estimator applies the factors to its columns (rows_of), not
    to copies of the profiles: at 1,000 models x 20 flavors copying them cost 70 ms a period."""
    scale: dict[tuple[str, str], float] = {}
    for name, sig in signals.items():
        if sig is None or not sig.usable or name not in catalog.models:
            continue
        rates = {f: o.prefix_hit_rate for f, o in sig.per_flavor.items() if o.prefix_hit_rate is not None}
        if not rates and sig.prefix_hit_rate is not None:
            rates = dict.fromkeys(sig.per_flavor or catalog.models[name].parallelism, sig.prefix_hit_rate)
        for f, h in rates.items():
            if h > 0 and f in catalog.models[name].parallelism:
                scale[(name, f)] = 1.0 / (1.0 - min(h, MAX_PREFIX_DISCOUNT))
    return scale


def scaled_profile(profile: Profile, prefill_scale: float) -> Profile:
    """The profile with its prefill ``prefill_scale`` x as fast (prefix_scales)."""
    if prefill_scale == 1.0:
        return profile
    return profile.model_copy(update={"prefill_tokens_per_s": profile.prefill_tokens_per_s * prefill_scale})


def within_context(mix: RequestMix, max_model_len: int | None) -> RequestMix:
    """The mix with its prompt lengths cut at the model's context: the engine rejects a longer request
    (vLLM answers 400) and spends nothing on it, so no capacity is sized for one. Cutting, not dropping,
    keeps the quantile nodes' weights; it counts a rejected request as one of the longest served, which
    errs towards more capacity."""
    if max_model_len is None:
        return mix
    cap = float(max_model_len)
    prompt, _ = mix_quantiles(mix)
    if max(mix.prompt_mean, mix.prompt_p95, *prompt, prompt_end(mix)) <= cap:
        return mix
    cut = tuple(min(x, cap) for x in prompt)
    # The mean falls with the tail cut off (by the nodes' weighted means), so that what reads the mean
    # (TPOT(b), the KV fit, drain_rps) sees the mix the nodes describe.
    share = float(np.dot(MIX_WEIGHTS, cut)) / max(float(np.dot(MIX_WEIGHTS, prompt)), 1e-9)
    return replace(mix, prompt_mean=min(mix.prompt_mean * share, cap), prompt_p95=min(mix.prompt_p95, cap),
                   prompt_quantiles=cut, prompt_max=min(prompt_end(mix), cap))


def _best_effort(catalog: Catalog, caps_of: dict[str, dict[str, ReplicaCapacity]],
                 mixes: dict[str, RequestMix], observed: dict[str, RequestMix],
                 corrections: dict[tuple[str, str], Correction], settings: EstimateSettings,
                 scales: dict[tuple[str, str], float]
                 ) -> tuple[dict[str, str], dict[str, dict[str, ReplicaCapacity]]]:
    """Best-effort capacities of the flavors that miss the SLO: in ``caps_of`` for the models no flavor of
    which meets it (with, per such model, the reason), else apart (Demand.fallback)."""
    # c.feasible, inline: this runs over every (model, flavor) pair.
    pairs = [(m, f) for m, caps in caps_of.items() for f, c in caps.items() if not c.rps > 0 or c.best_effort]
    none = Correction()
    caps = best_effort_capacities(
        [catalog.profile(m, f) for m, f in pairs], [catalog.models[m].slo for m, _ in pairs],
        [mixes[m] for m, _ in pairs], [corrections.get(k, none) for k in pairs],
        [caps_of[m][f] for m, f in pairs], settings.target_utilization, settings.attainment,
        [scales.get(k, 1.0) for k in pairs])
    todo = [m for m, caps in caps_of.items() if caps and not any(c.feasible for c in caps.values())]
    fallback: dict[str, dict[str, ReplicaCapacity]] = {}
    for (m, f), c in zip(pairs, caps, strict=True):
        fallback.setdefault(m, {})[f] = c
    for m in todo:
        caps_of[m].update(fallback.pop(m))
    out = {}
    for m in todo:
        slo, mix, seen = catalog.models[m].slo, mixes[m], observed[m]
        why = (f"no flavor meets TTFT p95 {slo.ttft_p95_s:g} s, TPOT p95 {slo.tpot_p95_s:g} s for prompt mean "
               f"{mix.prompt_mean:.0f}, p95 {mix.prompt_p95:.0f} tok")
        if seen.prompt_p95 > mix.prompt_p95:
            why += f" (observed p95 {seen.prompt_p95:.0f}, cut at max_model_len {catalog.models[m].max_model_len})"
        out[m] = why
    return out, fallback


def _pairs(catalog: Catalog) -> tuple[list[tuple[str, str]], list[Profile], list[SLO]]:
    """The catalog's (model, flavor) pairs, model by model, with their profiles and their models' SLOs."""
    pairs = [(name, f) for name, spec in catalog.models.items() for f in spec.parallelism]
    return pairs, [catalog.profiles[profile_key(m, f)] for m, f in pairs], [catalog.models[m].slo for m, _ in pairs]


def _capacities_of(catalog: Catalog, mixes: dict[str, RequestMix], corrections: dict[tuple[str, str], Correction],
                   settings: EstimateSettings, previous: dict[str, Demand] | None,
                   scales: dict[tuple[str, str], float]) -> dict[str, dict[str, ReplicaCapacity]]:
    """Per model and flavor, one replica's capacity for the model's mix, all pairs in one batch."""
    pairs, profiles, slos = derived(catalog, "pairs", _pairs)
    none = Correction()
    # The per-pair columns built model by model (the pairs' order): a model's mix is repeated,
    # not looked up 14,000 times at 1,000 models.
    pair_mixes: list[RequestMix] = []
    pair_scales: list[float] | None = [] if scales else None
    guesses: list[float] | None = [] if previous else None
    last = previous or {}
    for name, spec in catalog.models.items():
        k = len(spec.parallelism)
        pair_mixes += [mixes[name]] * k
        if pair_scales is not None:
            pair_scales += [scales.get((name, f), 1.0) for f in spec.parallelism]
        if guesses is not None:
            caps = d.capacity if (d := last.get(name)) else {}
            guesses += [c.batch if (c := caps.get(f)) else 0.0 for f in spec.parallelism]
    all_caps = replica_capacities(profiles, slos, pair_mixes, [corrections.get(k, none) for k in pairs],
                                  settings.target_utilization, settings.attainment, guesses, pair_scales)
    caps_of: dict[str, dict[str, ReplicaCapacity]] = {}
    start = 0
    for name, spec in catalog.models.items():  # the pairs run model by model
        end = start + len(spec.parallelism)
        caps_of[name] = dict(zip(spec.parallelism, all_caps[start:end], strict=True))
        start = end
    return caps_of


def estimate(catalog: Catalog, signals: dict[str, ModelSignals],
             corrections: dict[tuple[str, str], Correction] | None = None,
             forecaster: Forecaster = last_value, settings: EstimateSettings = EstimateSettings(),
             previous: dict[str, Demand] | None = None) -> dict[str, Demand]:
    """Demand per catalog model. A model with no usable signals gets state HOLD with the reason.
    ``previous``: last period's demands, whose capacities start this period's searches (a speed-up only)."""
    corrections = corrections or {}
    scales = prefix_scales(catalog, signals)
    out: dict[str, Demand] = {}
    observed = {name: (sig.mix if sig and sig.mix else None) or prior_mix(catalog, name)
                for name in catalog.models for sig in (signals.get(name),)}
    mixes = {name: within_context(mix, catalog.models[name].max_model_len) for name, mix in observed.items()}
    caps_of = _capacities_of(catalog, mixes, corrections, settings, previous, scales)
    best_effort: dict[str, str] = {}
    fallback: dict[str, dict[str, ReplicaCapacity]] = {}
    if settings.best_effort:
        best_effort, fallback = _best_effort(catalog, caps_of, mixes, observed, corrections, settings, scales)
    for name in catalog.models:
        sig = signals.get(name)
        mix = mixes[name]
        caps = caps_of[name]
        if sig is not None and not sig.usable and sig.backlog > 0:
            # Engines' metrics missing or stale while requests wait or run (the ingress sees them): a new
            # replica not yet reporting, a scrape lost under load. That is load, never zero and never a hold:
            # every visible request counts as backlog, on top of what the ingress saw arrive.
            arrived = sig.arrival_rate_rps or 0.0
            rps = (arrived + sig.backlog / _drain_s(catalog, name, settings)) * (1.0 + settings.headroom)
            out[name] = Demand(name, DemandState.OK, rps, mix, caps,
                               f"signals {sig.freshness.value}, {sig.backlog:.0f} requests in flight at the ingress"
                               f" ({arrived:.2f} req/s arriving): sized as backlog",
                               best_effort=best_effort.get(name, ""), fallback=fallback.get(name, {}))
            continue
        if sig is None or not sig.usable:
            fresh = sig.freshness if sig else Freshness.MISSING
            age = f" (last sample {sig.age_s:.0f}s ago)" if sig and sig.age_s is not None else ""
            out[name] = Demand(name, DemandState.HOLD, 0.0, mix, caps, f"signals {fresh.value}{age}: holding capacity",
                               best_effort=best_effort.get(name, ""), fallback=fallback.get(name, {}))
            continue
        assert sig.arrival_rate_rps is not None
        burst = sharp = 0.0
        if settings.burst_floor and sig.arrival_counts and sig.arrival_bin_s > 0:
            burst, sharp = _burst_floor(tuple(sig.arrival_counts), sig.arrival_bin_s,
                                        catalog.models[name].slo.ttft_p95_s,
                                        1.0 - BURST_BUDGET_SHARE * (1.0 - settings.attainment))
        current, why = _current_rate(sig.arrival_rate_rps, burst, sharp, settings)
        rate = forecaster(sig.rate_history, current)
        backlog = sig.waiting / _drain_s(catalog, name, settings) if sig.waiting else 0.0
        rps = (rate + backlog) * (1.0 + settings.headroom)
        if rate > current + 1e-9:
            why += f", {rate:.2f} forecast"
        if backlog > 0:
            why += f", {sig.waiting:.0f} queued"
        out[name] = Demand(name, DemandState.OK, rps, mix, caps, why, burst, best_effort.get(name, ""),
                           fallback.get(name, {}), sharp)
    return out


def _current_rate(observed: float, burst: float, sharp: float, settings: EstimateSettings) -> tuple[float, str]:
    """The rate now the forecast may not fall below, and the reason's first words: the rate observed, or with
    ``current_within_busiest_minute`` at most the larger of the burst rate and the hour's busiest minute
    (any alignment, this moment's included; burst / sharpness), where the burst floor reads the counts."""
    why = f"{observed:.2f} req/s observed"
    if not settings.current_within_busiest_minute or burst <= 0:
        return observed, why
    busiest = burst / sharp if sharp > 0 else 0.0
    cap = max(burst, busiest)
    if observed <= cap:
        return observed, why
    return cap, f"{why}, {cap:.2f} within the hour's busiest minute"


def alone_shares(catalog: Catalog, demands: Mapping[str, Demand], pairs: Sequence[tuple[str, str]],
                 corrections: Mapping[tuple[str, str], Correction], settings: EstimateSettings,
                 scales: Mapping[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    """Per (model, flavor): what one replica serves as its flavor deployment's only one (replica_capacities
    with ``alone``), as a share of the pooled capacity ``demands`` hold for it, both for the model's mix at
    the SLO with the same corrections and prefill scale (``scales``, prefix_scales). 1 where that capacity is
    best effort or nil: there is nothing it is a share of."""
    out = dict.fromkeys(pairs, 1.0)
    todo = [(m, f) for m, f in pairs if (d := demands.get(m)) is not None and (c := d.capacity.get(f)) is not None
            and c.feasible]
    if not todo:
        return out
    caps = replica_capacities([catalog.profile(m, f) for m, f in todo], [catalog.models[m].slo for m, _ in todo],
                              [demands[m].mix for m, _ in todo], [corrections.get(k, Correction()) for k in todo],
                              settings.target_utilization, settings.attainment,
                              prefill_scale=[scales.get(k, 1.0) for k in todo], alone=True)
    for (m, f), c in zip(todo, caps, strict=True):
        out[(m, f)] = min(c.rps / demands[m].capacity[f].rps, 1.0)
    return out


def _drain_s(catalog: Catalog, name: str, settings: EstimateSettings) -> float:
    """How long a backlog may take to drain: never less than the fastest start-up of a replica that could
    help (asked only where there is a backlog: a 1,000-model step would spend 20 ms on it)."""
    startup = min((catalog.flavors[f].node_startup_s + catalog.profile(name, f).startup_s
                   for f in catalog.models[name].parallelism), default=0.0)
    return max(settings.backlog_drain_s, startup)


# A p95 of fewer requests than this is mostly noise: one slow request would move capacity by half.
MIN_CORRECTION_SAMPLES = 8
# Corrections follow a persistent error over about this long, not a transient: just after a surge the
# requests that finish ran at a batch the window no longer shows, and a light-load window's p95 comes
# from a handful of requests. At 30 s those swung the simulated L40S capacity 0.4-5.1 req/s on the
# bursty trace (2.6-5.5 at 300 s). A 5 s period weighs each window 1.7%, a 2 s one 0.7%.
CORRECTION_TIME_CONSTANT_S = 300.0


def correction_smoothing(period_s: float, time_constant_s: float = CORRECTION_TIME_CONSTANT_S) -> float:
    """Weight of one period's observation: the same response in seconds whatever the control period."""
    return 1.0 - math.exp(-period_s / time_constant_s)


def update_corrections(catalog: Catalog, signals: dict[str, ModelSignals],
                       previous: dict[tuple[str, str], Correction],
                       min_samples: float = MIN_CORRECTION_SAMPLES,
                       smoothing: float = 0.3, kv: bool = True) -> dict[tuple[str, str], Correction]:
    """New corrections from observed latency (and, with ``kv``, the KV tokens a running sequence holds) per
    (model, flavor); unobserved pairs keep theirs, and so do pairs whose window finished fewer than
    ``min_samples`` requests (when the count is known).
    ``smoothing``: weight of this window (``correction_smoothing(period)`` in the loops)."""
    # Predictions with the prefill the estimate sizes with: observed prefix-cache hits are not a fast profile.
    scales = prefix_scales(catalog, signals)
    out = dict(previous)
    todo: list[tuple[tuple[str, str], Profile, SLO, RequestMix, float, float | None, float, float | None, float,
                     tuple[float | None, float]]] = []
    for name, sig in signals.items():
        if name not in catalog.models or not sig.usable or sig.mix is None:
            continue
        shares = traffic_shares(sig.per_flavor)
        for flavor, obs in sig.per_flavor.items():
            if flavor not in catalog.models[name].parallelism or obs.replicas <= 0:
                continue
            if obs.completed is not None and obs.completed < min_samples:
                continue
            prof, scale = catalog.profile(name, flavor), scales.get((name, flavor), 1.0)
            # Without __init__: its checks are of the quantiles, which this leaves as they were.
            mix = replaced(sig.mix, prompt_mean=obs.prompt_mean or sig.mix.prompt_mean)
            # Compare with the batch the window ran at, not the gauge's instant value: by Little's law
            # the mean running sequences per replica are arrivals x output tokens x time per token.
            batch = obs.running_per_replica if obs.running_per_replica is not None else 1.0
            if obs.running_max_replica is not None:
                batch = max(batch, obs.running_max_replica)
            if obs.tpot_p95_s is not None and sig.arrival_rate_rps is not None:
                little = sig.arrival_rate_rps * shares[flavor] / obs.replicas * mix.output_mean * obs.tpot_p95_s
                batch = max(batch, little)
            # TTFT: the profile predicts prefill, not queueing. Compare the engine's own prefill time
            # (scheduled -> first token) with the mean prompt's when it is reported; otherwise TTFT p95,
            # but only in a window without a backlog, where TTFT is (nearly) all prefill. Correcting on a
            # queue would call the flavor slow and rule it out exactly when capacity is short.
            if obs.prefill_mean_s is not None:
                ttft_obs, ttft_pred = obs.prefill_mean_s, prof.ttft_s(mix.prompt_mean, prefill_scale=scale)
            elif sig.waiting is None or sig.waiting > 0:
                ttft_obs, ttft_pred = None, 0.0
            else:
                ttft_obs, ttft_pred = obs.ttft_p95_s, prof.ttft_s(mix.prompt_p95, prefill_scale=scale)
            todo.append(((name, flavor), prof, catalog.models[name].slo, mix, batch, ttft_obs, ttft_pred,
                         obs.tpot_p95_s, scale, (_kv_held(prof, obs, min_samples) if kv else None,
                                                 max(sig.mix.prompt_mean + sig.mix.output_mean, 1.0))))
    if not todo:
        return out
    # Every pair's predicted TPOT p95 in one call: the tail model's cost is per call, not per row.
    key_, prof_, slo_, mix_, batch_, _, _, _, scale_, _ = zip(*todo, strict=True)
    rows = rows_of(prof_, slo_, mix_, [Correction()] * len(todo), prefill_scale=np.array(scale_, dtype=float))
    guess = np.array([previous[k].tpot_p95_predicted_s if k in previous else 0.0 for k in key_], dtype=float)
    predicted = tpot_quantile(rows, np.maximum(np.array(batch_, dtype=float), LOAD_FLOOR), guess=guess).tolist()
    for (k, _, _, _, _, ttft_obs, ttft_pred, tpot_obs, _, held), tpot_pred in zip(todo, predicted, strict=True):
        out[k] = previous.get(k, Correction()).updated(ttft_obs, ttft_pred, tpot_obs, tpot_pred,
                                                       smoothing=smoothing, observed_kv=held[0], predicted_kv=held[1])
    return out


def traffic_shares(per_flavor: Mapping[str, FlavorObservation]) -> dict[str, float]:
    """Each flavor's share of a model's arrivals over the window: of the requests that finished where every
    flavor counts them, else of the replicas. The ingress weighs flavors by capacity, so one L40S beside one
    A100 takes under a third of a 72B model's requests, not half: counted by replicas, the L40S's batch reads
    twice what it ran, its TPOT faster than its profile, and the plan over-counts it (1.45x what a pool of
    them sustains on the 72B day; bench/results/traffic_shares.md)."""
    done = [o.completed for o in per_flavor.values()]
    total = sum(d for d in done if d is not None)
    if total > 0 and all(d is not None for d in done):
        return {f: (o.completed or 0.0) / total for f, o in per_flavor.items()}
    replicas = max(sum(o.replicas for o in per_flavor.values()), 1)
    return {f: o.replicas / replicas for f, o in per_flavor.items()}


def _kv_held(profile: Profile, obs: FlavorObservation, min_sequences: float) -> float | None:
    """KV-cache tokens a running sequence held on this flavor over the window (None: unknown, or too few
    sequences running to say: a few long ones would read as the whole mix)."""
    running = obs.running_per_replica
    if obs.kv_usage is None or running is None or running < min_sequences or obs.kv_usage <= 0:
        return None
    return obs.kv_usage * profile.kv_tokens / running
