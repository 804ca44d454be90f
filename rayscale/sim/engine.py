"""Time-stepped engine model: every replica of one model, all in-flight requests, one compiled pass per tick.

Same latency model as the emulated engine (rayscale.engines.emulated, Profile's docstring):
TTFT = queue wait + overhead_s + prompt_tokens / prefill_tokens_per_s, then one token per
inter-token latency itl = itl_alpha_s + itl_beta_s x running batch; a request is admitted FIFO when the
replica runs fewer than its slot cap (max_num_seqs, or Ray Serve's max_ongoing_requests) and its KV
reservation (prompt + output tokens) fits in kv_tokens.

With ``prefill_contention`` (the default; ``EngineConfig(prefill_contention=False)`` restores the emulated
engine's independent prefill) prefill is not free: a replica's prefill tokens are processed at
``prefill_tokens_per_s`` shared by its requests, and while decodes run, each engine iteration carries at
most one chunk of prefill (vLLM's chunked prefill; the replica's ``max_num_batched_tokens``: its profile's,
which the simulator pins to what each policy deploys, else EngineConfig's), so long prompts slow everyone's
decode. That is the same physics the estimator's TPOT(b) = alpha + beta*b + b*P/(R*O) averages over (the
estimator has the mean; a request with a short output that shares its few iterations with a long
prompt's chunks sees a TPOT far above it, which is what per-request SLO attainment counts). Without it,
every in-flight request prefills at the replica's full rate in parallel: on a prompt-heavy trace (the
Azure code trace: 2,048-token prompts, 28-token outputs) a replica then "sustains" about ten times the
prefill throughput of its profile, which no GPU does.
For a single request both variants reduce exactly to the profile formula. The profile's optional
prefill terms (prefill_seq_s, prefill_quadratic_s) are charged as extra prompt tokens at the prefill rate;
rayscale.sim.iteration is the same engine stepped one vLLM iteration at a time (``EngineConfig(model=
"iteration")``), which the fluid model approximates per tick.

With the requests' prompt block hashes (a Mooncake trace's ``hash_ids``) and ``EngineConfig.prefix_caching``
(on, as in vLLM), each replica keeps a prefix cache (rayscale.sim.prefix): the prompt tokens a request finds
cached on the replica it is routed to are not prefilled, so its TTFT and the prefill chunks it puts beside
decodes shrink; its KV reservation stays the whole request's.

Why it is fast: no Python object per request. In-flight requests live in a few parallel numpy arrays.
All running requests of a replica decode at the same rate, so each replica keeps a *virtual token clock*
V (decode iterations done so far); a request that starts decoding at V=v finishes when V reaches v+O-1,
and its finish time is found by inverting the piecewise-linear V(t) of the tick. A tick is two compiled
(numba) passes: ``_route_weighted`` hands each queued request to the flavor it drew by the ingress's
weights, then FIFO within the flavor to its least-loaded replica with room (Ray Serve's router with
max_ongoing_requests behind each flavor deployment; a multi-node flavor's replicas are a deployment each, one per
gang slot, so there each request takes the one with fewest requests, as the ingress does, and waits for
it; ``_route``: one central queue over every replica, with
``EngineConfig(routing="least-loaded")``), and ``_tick`` walks the in-flight pool once per
stage (prefill FIFOs, first tokens, finishes). The same stages as vectorised numpy calls cost a fixed
~0.2 ms per tick in call overhead whatever the pool's size, most of a 24-hour simulation.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from rayscale.core.attainment import CHUNK_TOKENS
from rayscale.core.catalog import Profile
from rayscale.extras import missing_extra
from rayscale.sim.prefix import PrefixCaches

try:  # the engine's tick functions are compiled at import
    import numba
except ImportError as e:
    raise missing_extra("sim", "the trace simulator") from e

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

# Replica states inside the engine.
LIVE, DRAINING, STOPPED = 0, 1, 2
# Request status.
PENDING, DONE, FAILED = 0, 1, 2


def p95(x: npt.NDArray[np.floating[Any]] | npt.NDArray[np.integer[Any]]) -> float:
    """``float(np.percentile(x, 95))`` for a non-empty 1-d array, bit for bit, in a fraction of the time.

    numpy's default ('linear') method: virtual index (n - 1) q, computed in the data's precision for float
    data (float64 otherwise), and its two-sided lerp. The simulator calls this a few times per control
    period, where np.percentile's generic machinery cost more than the selection itself.
    """
    n = len(x)
    t: Any = x.dtype.type if x.dtype.kind == "f" else np.float64  # numpy scalar arithmetic, as numpy does it
    v = (n - 1) * t(0.95)
    if v >= n - 1:
        return float(np.percentile(x, 95))  # the maximum: tiny samples only
    lo = math.floor(v)
    part = np.partition(x, (lo, lo + 1, n - 1))
    if np.isnan(part[-1]):  # NaN sorts last: numpy's answer is NaN
        return math.nan
    a: Any = part[lo]
    b: Any = part[lo + 1]
    g = v - t(lo)
    d = b - a
    return float(b - d * (1 - g) if g >= 0.5 else a + d * g)


ENGINE_MODELS = ("fluid", "iteration")
ROUTINGS = ("least-loaded", "flavor-weights", "flavor-two-choices")
BY_FLAVOR = ("flavor-weights", "flavor-two-choices")  # routings that go through the ingress's flavor weights


@dataclass(frozen=True)
class EngineConfig:
    tick_s: float = 0.25
    prefill_contention: bool = True  # chunked prefill shares the replica with decode (module docstring)
    # Prefill tokens per engine iteration while decodes run, for a replica whose profile pins none (vLLM's
    # default; the simulator pins each policy's own, rayscale.core.chunk.pin_chunks).
    max_num_batched_tokens: int = CHUNK_TOKENS
    # "fluid": this module, a compiled pass per tick (fast); "iteration": vLLM's scheduler one engine iteration at a
    # time (rayscale.sim.iteration; slower, and what bench/fidelity.py checks against the real engine).
    model: str = "fluid"
    # vLLM's automatic prefix caching (on by default in vLLM V1): used where the requests carry block hashes.
    prefix_caching: bool = True
    # "flavor-weights": as rayscale's ingress routes (rayscale.serve.ingress): each request draws a flavor
    # with a live replica in proportion to its weight (Engine.set_flavor_weights), then waits in that
    # flavor's own queue for its least-loaded replica, as Serve's router queues behind one deployment.
    # "least-loaded": one central queue, each request to the least-loaded replica of any flavor, which no
    # Serve application spanning several accelerator flavors does; on a mixed fleet it hands the slower
    # flavor as many running requests as the faster one (an L40S with an inf2 beside it met 95.4% of
    # 2,000-token prompts at 2 req/s, where the L40S alone met 99.1% and the weighted split 99.5%).
    # "flavor-two-choices": a candidate ingress, not the one rayscale ships: as "flavor-weights", but each
    # request draws two distinct flavors in proportion to their weights and takes the one with fewer requests
    # in flight (running or waiting on it) per unit of weight, the power of two choices Serve's router makes
    # between the replicas of one deployment (ray/serve/_private/request_router/pow_2_router.py), made between
    # flavors, so that a flavor whose queue has built takes less. On the 72B day it met 99.95-99.98% on four
    # seeds of five at 4.5% less, and 93.75% on the fifth (bench/results/routing_two_choices.md).
    # None: flavor-weights, least-loaded for the iteration model (one flavor in bench.fidelity).
    routing: str | None = None

    def __post_init__(self) -> None:
        if not self.tick_s > 0:
            raise ValueError(f"engine.tick_s must be > 0, got {self.tick_s}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("engine.max_num_batched_tokens must be >= 1")
        if self.model not in ENGINE_MODELS:
            raise ValueError(f"engine.model must be one of {', '.join(ENGINE_MODELS)}, got {self.model!r}")
        if self.routing is None:
            object.__setattr__(self, "routing", "least-loaded" if self.model == "iteration" else "flavor-weights")
        if self.routing not in ROUTINGS:
            raise ValueError(f"engine.routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.model == "iteration" and self.routing != "least-loaded":
            raise ValueError("engine.routing: the iteration model routes least-loaded only")
        if self.model == "iteration" and not self.prefill_contention:
            raise ValueError("engine.prefill_contention: the iteration model always shares iterations between "
                             "prompts and decodes; independent prefill exists only in the fluid model")


@numba.njit(cache=True, nogil=True)
def _progress(x: float, tp: float, tq: float, vq: float, v: float) -> float:
    """Decode steps a replica makes in the first x seconds of a tick: none for tp, vq per second for tq, then v."""
    return min(max(x - tp, 0.0), tq) * vq + max(x - tp - tq, 0.0) * v


@numba.njit(cache=True, nogil=True)
def _reach(steps: float, tp: float, tq: float, vq: float, v: float) -> float:
    """Seconds into the tick at which the replica has made ``steps`` decode steps (_progress inverted)."""
    if steps <= tq * vq:
        return tp + steps / vq if vq > 0 else tp
    return tp + tq + (steps - tq * vq) / v


@numba.njit(cache=True, nogil=True)
def _prefilled_at(tokens: float, head: float, R: float, rho: float) -> float:
    """Seconds into the tick at which a replica has prefilled ``tokens``: ``head`` at the full rate R, then rho."""
    if tokens <= head:
        return tokens / R
    return head / R + (tokens - head) / rho


@numba.njit(cache=True, nogil=True)
def _tick(T: float, dt: float, m: int, nr: int, contention: bool, plain: bool,
          p_req: I64, p_rep: I64, p_rem: F64, p_tadm: F64, p_tfirst: F64, p_vend: F64,
          r_run: I64, r_kv: I64, r_alpha: F64, r_beta: F64, r_R: F64, r_over: F64, r_q: F64, r_seq: F64, r_chunk: F64,
          r_V: F64, r_flavor: npt.NDArray[np.int16],
          prompt: I64, output: I64, kv_req: I64, arr: F64, queue_s: npt.NDArray[np.float32],
          pf_started: npt.NDArray[np.bool_],
          status: npt.NDArray[np.int8], ttft: npt.NDArray[np.float32], tpot: npt.NDArray[np.float32],
          t_fin: F64, flavor_of: npt.NDArray[np.int16], out_req: I64, out_t: F64) -> int:
    """One tick of every replica, in place (Engine.step's body; the module docstring has the model).

    Compiled (numba), one pass per stage over the in-flight pool: at 100 req/s a tick touches a few
    hundred entries, and the same stages as numpy calls cost a fixed ~0.2 ms per tick in call overhead.
    ``prompt``: the tokens each request prefills (its prompt less its prefix-cache hit); ``kv_req``: the KV
    tokens it reserved. Returns how many requests finished; their trace indices and finish times are in
    out_req / out_t."""
    T1 = T + dt
    s = np.empty(nr)
    vrate = np.empty(nr)
    tp = np.zeros(nr)  # time at the tick's start with no decode (prefill alone: nothing else is running)
    tq = np.zeros(nr)  # then time decoding at vq (iterations that each carry a full chunk of prefill)
    vq = np.zeros(nr)
    prefilling = np.zeros(nr, dtype=np.int64)
    backlog = np.zeros(nr)
    first = np.full(nr, -1.0)  # prefill tokens left of each replica's first prompt (FIFO head)
    any_pf = _decode_steps(m, nr, contention, p_rep, p_rem, p_tfirst, r_run, r_alpha, r_beta, s, vrate, prefilling,
                           backlog, first)
    if contention and any_pf:
        _prefill_fifo(T, dt, m, nr, plain, p_req, p_rep, p_rem, p_tadm, p_tfirst, r_run, r_R, r_over, r_q, r_seq,
                      r_chunk, prompt, arr, queue_s, pf_started, s, prefilling, backlog, first, tp, tq, vq)
    V1 = np.empty(nr)
    for r in range(nr):
        V1[r] = r_V[r] + _progress(dt, tp[r], tq[r], vq[r], vrate[r])
    k = _finish(T, T1, m, p_req, p_rep, p_tfirst, p_vend, r_run, r_kv, r_V, r_flavor, output, kv_req, arr, status,
                ttft, tpot, t_fin, flavor_of, out_req, out_t, V1, tp, tq, vq, vrate)
    for r in range(nr):
        r_V[r] = V1[r]
    return k


@numba.njit(cache=True, nogil=True)
def _decode_steps(m: int, nr: int, contention: bool, p_rep: I64, p_rem: F64, p_tfirst: F64, r_run: I64, r_alpha: F64,
                  r_beta: F64, s: F64, vrate: F64, prefilling: I64, backlog: F64, first: F64) -> bool:
    """Each replica's decode iteration ``s`` and token rate ``vrate`` at this tick's batch; with ``contention``
    also its prompts waiting to prefill (``prefilling``, their ``backlog`` of tokens and the ``first`` one's).
    Whether any prompt waits."""
    any_pf = False
    if contention:
        for j in range(m):
            if np.isnan(p_tfirst[j]):
                r = p_rep[j]
                if first[r] < 0:
                    first[r] = p_rem[j]
                backlog[r] += p_rem[j]
                prefilling[r] += 1
                any_pf = True
    for r in range(nr):
        # A decode iteration at this batch: the sequences decoding, not the prompts waiting to prefill (vLLM's
        # waiting queue; their cost is the chunk's).
        s[r] = r_alpha[r] + r_beta[r] * max(r_run[r] - prefilling[r], 1)
        vrate[r] = 1.0 / s[r]
    return any_pf


@numba.njit(cache=True, nogil=True)
def _prefill_fifo(T: float, dt: float, m: int, nr: int, plain: bool, p_req: I64, p_rep: I64, p_rem: F64, p_tadm: F64,
                  p_tfirst: F64, r_run: I64, r_R: F64, r_over: F64, r_q: F64, r_seq: F64, r_chunk: F64, prompt: I64,
                  arr: F64, queue_s: npt.NDArray[np.float32], pf_started: npt.NDArray[np.bool_], s: F64,
                  prefilling: I64, backlog: F64, first: F64, tp: F64, tq: F64, vq: F64) -> None:
    """Chunked prefill over the tick, FIFO per replica (the pool is in admission order): each prompt's
    queueing time once its prefill starts, its first token's time once it ends, the tokens left of the
    others; each replica's time prefilling alone (``tp``), then decoding beside chunks (``tq`` at ``vq``)."""
    head = np.zeros(nr)  # prompt tokens prefilled at the full rate, before anything decodes
    rho = np.empty(nr)  # then the chunk rate: prompt tokens/s with decodes beside them
    processed = np.empty(nr)
    for r in range(nr):
        if first[r] < 0:
            continue
        chunk = r_chunk[r]
        chunk_rate = chunk / (s[r] + chunk / r_R[r])
        rho[r] = chunk_rate
        vq[r] = chunk_rate / chunk
        if r_run[r] - prefilling[r] <= 0:
            # Nothing decodes: iterations are all prefill, at the full rate, up to the end of the one
            # that completes the head prompt (with whatever else fits its chunk). Then that prompt
            # decodes, and every later iteration carries it beside a chunk.
            head[r] = min(backlog[r], math.ceil(first[r] / chunk) * chunk, r_R[r] * dt)
            tp[r] = head[r] / r_R[r]
        # Every iteration beside a decode carries a chunk (the last one part of one): prompts prefill
        # at the chunk rate and each decode step waits at most one chunk.
        processed[r] = head[r] + min(backlog[r] - head[r], chunk_rate * (dt - tp[r]))
        tq[r] = (processed[r] - head[r]) / chunk_rate
    cum_r = np.zeros(nr)
    for j in range(m):
        if not np.isnan(p_tfirst[j]):
            continue
        r = p_rep[j]
        q = p_req[j]
        x = p_rem[j]
        ahead = cum_r[r]  # prompt tokens before this one in its replica's FIFO
        cum = ahead + x
        cum_r[r] = cum
        if ahead <= processed[r] + 1e-6 and not pf_started[q]:
            queue_s[q] = max(T + _prefilled_at(ahead, head[r], r_R[r], rho[r]), p_tadm[j]) - arr[q]
            pf_started[q] = True
        if cum <= processed[r] + 1e-6:
            p = float(prompt[q])
            if not plain:
                p += r_R[r] * (r_seq[r] + r_q[r] * p * p)
            p_tfirst[j] = max(T + _prefilled_at(cum, head[r], r_R[r], rho[r]), p_tadm[j] + p / r_R[r]) + r_over[r]
            p_rem[j] = 0.0
        else:
            p_rem[j] = min(x, cum - processed[r])


@numba.njit(cache=True, nogil=True)
def _finish(T: float, T1: float, m: int, p_req: I64, p_rep: I64, p_tfirst: F64, p_vend: F64, r_run: I64, r_kv: I64,
            r_V: F64, r_flavor: npt.NDArray[np.int16], output: I64, kv_req: I64, arr: F64,
            status: npt.NDArray[np.int8], ttft: npt.NDArray[np.float32], tpot: npt.NDArray[np.float32], t_fin: F64,
            flavor_of: npt.NDArray[np.int16], out_req: I64, out_t: F64, V1: F64, tp: F64, tq: F64, vq: F64,
            vrate: F64) -> int:
    """Requests decoding on each replica's token clock (``r_V`` now, ``V1`` at the tick's end): a first token
    in this tick starts one, and those whose last token falls in it finish, leaving tombstones in the pool.
    Returns how many finished; their trace indices and times are in out_req / out_t."""
    k = 0
    for j in range(m):
        tf1 = p_tfirst[j]
        if not tf1 < T1:  # still prefilling (NaN), or a tombstone (+inf)
            continue
        r = p_rep[j]
        if np.isinf(p_vend[j]):  # its first token falls in this tick: it starts on its replica's token clock
            v0 = r_V[r] + _progress(tf1 - T, tp[r], tq[r], vq[r], vrate[r])
            p_vend[j] = v0 + (output[p_req[j]] - 1)
        if p_vend[j] <= V1[r] + 1e-9:
            q = p_req[j]
            tf = max(T + _reach(p_vend[j] - r_V[r], tp[r], tq[r], vq[r], vrate[r]), tf1)
            o = output[q]
            status[q] = DONE
            ttft[q] = tf1 - arr[q]
            tpot[q] = (tf - tf1) / (o - 1) if o > 1 else 0.0
            t_fin[q] = tf
            flavor_of[q] = r_flavor[r]
            r_run[r] -= 1
            r_kv[r] -= kv_req[q]
            p_tfirst[j] = np.inf  # a tombstone: never starts, never finishes
            p_vend[j] = np.inf
            out_req[k] = q
            out_t[k] = tf
            k += 1
    return k


@numba.njit(cache=True, nogil=True)
def _route(i: int, end: int, nr: int, r_state: npt.NDArray[np.int8], r_run: I64, r_slots: I64, r_kv: I64,
           r_kvcap: I64, kv: I64, never: float, out_rep: I64, out_failed: I64) -> tuple[int, int, int]:
    """Queued requests i..end-1, FIFO, each to the least-loaded live replica (fewest running, then lowest
    index) with a free slot and KV room for it, as Ray Serve's router with max_ongoing_requests does; stops
    at the first that no replica can take now (head-of-line blocking, as in vLLM's FIFO scheduler) or when
    every slot is taken. A request no replica can ever hold (KV above ``never``) fails. Updates r_run and
    r_kv; returns (next queued index, admitted, failed), the replicas and failed indices in out_rep /
    out_failed. A scan over replicas per request: compiled, that beats a heap in Python by far at the
    pool sizes simulated (tens to a few hundred replicas)."""
    k = 0
    nf = 0
    while i < end:
        free = False
        pick = -1
        need = kv[i]
        for r in range(nr):
            if r_state[r] != LIVE or r_run[r] >= r_slots[r]:
                continue
            free = True
            if r_kv[r] + need <= r_kvcap[r] and (pick < 0 or r_run[r] < r_run[pick]):
                pick = r
        if not free:
            break
        if need > never:
            out_failed[nf] = i
            nf += 1
            i += 1
            continue
        if pick < 0:
            break
        r_run[pick] += 1
        r_kv[pick] += need
        out_rep[k] = pick
        k += 1
        i += 1
    return i, k, nf


@numba.njit(cache=True, nogil=True)
def _route_weighted(i: int, end: int, nr: int, r_state: npt.NDArray[np.int8], r_flavor: npt.NDArray[np.int16],
                    r_run: I64, r_slots: I64, r_kv: I64, r_kvcap: I64, kv: I64, never: float, flavor_w: F64,
                    slotted: npt.NDArray[np.bool_], u: F64, u2: F64, u_slot: F64, req_flavor: npt.NDArray[np.int16],
                    req_rep: I64, admitted: npt.NDArray[np.bool_], out_req: I64, out_rep: I64,
                    out_failed: I64) -> tuple[int, int, int]:
    """Queued requests i..end-1 (those not ``admitted`` yet), each to the flavor it drew (``req_flavor``: by
    ``u`` and ``u2`` in proportion to ``flavor_w`` over the flavors with a live replica, uniformly where those
    weigh nothing, the one of two with fewer requests per unit of weight, _chosen; drawn again if its flavor
    has none left), then FIFO within that flavor to its least-loaded live replica with a free slot and KV
    room. A ``slotted`` flavor's replicas (a multi-node flavor's gang slots) are one Serve deployment each: a
    request takes the live one it has fewest requests on, running or waiting (``req_rep``; as pick_route), and
    waits for it. A flavor whose next request finds none takes no more this pass. A request no replica can
    ever hold fails. Returns (queue head, admitted, failed); the requests and replicas in out_req / out_rep."""
    live_w, n_live, total = _live_weights(nr, r_state, r_flavor, flavor_w)
    head, k, nf, n_blocked = i, 0, 0, 0
    if n_live == 0:
        return head, k, nf
    n_reps, full = _live_counts(nr, r_state, r_flavor, len(flavor_w)), np.zeros(len(flavor_w), dtype=np.int64)
    blocked, waiting = np.zeros(len(flavor_w), dtype=np.bool_), np.zeros(nr, dtype=np.bool_)
    on = _waiting_on(i, end, nr, r_state, admitted, req_rep)
    load = _flavor_load(i, end, nr, r_state, r_flavor, r_run, admitted, req_flavor, len(flavor_w))
    for j in range(i, end):
        if admitted[j]:
            continue
        if kv[j] > never:
            # Failed once a replica could take it, as the central queue fails it (_route).
            if not _any_slot(nr, r_state, r_run, r_slots):
                break
            admitted[j] = True
            out_failed[nf] = j
            nf += 1
            continue
        f = req_flavor[j]
        if f < 0 or live_w[f] < 0:
            f = _chosen(u[j], u2[j], live_w, total, n_live, load)
            req_flavor[j] = f
            load[f] += 1
        if blocked[f]:
            continue
        if slotted[f]:
            pick = _slot_of(j, f, nr, r_state, r_flavor, r_run, on, u_slot, req_rep)
            pick = _slot_room(pick, f, r_run, r_slots, r_kv, r_kvcap, kv[j], on, waiting, full, n_reps)
        else:
            pick = _least_loaded(nr, r_state, r_flavor, r_run, r_slots, r_kv, r_kvcap, f, kv[j])
        if pick == -1:
            blocked[f] = True
            n_blocked += 1
            if n_blocked == n_live:
                break
        if pick < 0:
            continue
        r_run[pick] += 1
        r_kv[pick] += kv[j]
        admitted[j] = True
        out_req[k] = j
        out_rep[k] = pick
        k += 1
    while head < end and admitted[head]:
        head += 1
    return head, k, nf


@numba.njit(cache=True, nogil=True)
def _live_counts(nr: int, r_state: npt.NDArray[np.int8], r_flavor: npt.NDArray[np.int16], n_flavors: int) -> I64:
    """Live replicas per flavor index."""
    out = np.zeros(n_flavors, dtype=np.int64)
    for r in range(nr):
        if r_state[r] == LIVE:
            out[r_flavor[r]] += 1
    return out


@numba.njit(cache=True, nogil=True)
def _slot_room(r: int, f: int, r_run: I64, r_slots: I64, r_kv: I64, r_kvcap: I64, need: int, on: I64,
               waiting: npt.NDArray[np.bool_], full: I64, n_reps: I64) -> int:
    """Replica ``r`` of slotted flavor ``f`` if it takes the request now (a free slot and KV room, no earlier
    request waiting for it); else -2, or -1 once every live replica of ``f`` has one waiting."""
    if waiting[r]:
        return -2
    if r_run[r] >= r_slots[r] or r_kv[r] + need > r_kvcap[r]:
        waiting[r] = True
        full[f] += 1
        return -1 if full[f] == n_reps[f] else -2
    on[r] -= 1
    return r


@numba.njit(cache=True, nogil=True)
def _waiting_on(i: int, end: int, nr: int, r_state: npt.NDArray[np.int8], admitted: npt.NDArray[np.bool_],
                req_rep: I64) -> I64:
    """Per replica, the requests i..end-1 not admitted yet that wait for it (a gang slot's, taken before)."""
    out = np.zeros(nr, dtype=np.int64)
    for j in range(i, end):
        r = req_rep[j]
        if not admitted[j] and r >= 0 and r_state[r] == LIVE:
            out[r] += 1
    return out


@numba.njit(cache=True, nogil=True)
def _flavor_load(i: int, end: int, nr: int, r_state: npt.NDArray[np.int8], r_flavor: npt.NDArray[np.int16],
                 r_run: I64, admitted: npt.NDArray[np.bool_], req_flavor: npt.NDArray[np.int16], n_flavors: int) -> I64:
    """Per flavor index, the requests in flight on it: running on its live replicas, and of i..end-1 those not
    admitted yet that drew it."""
    out = np.zeros(n_flavors, dtype=np.int64)
    for r in range(nr):
        if r_state[r] == LIVE:
            out[r_flavor[r]] += r_run[r]
    for j in range(i, end):
        if not admitted[j] and req_flavor[j] >= 0:
            out[req_flavor[j]] += 1
    return out


@numba.njit(cache=True, nogil=True)
def _chosen(u1: float, u2: float, live_w: F64, total: float, n_live: int, load: I64) -> int:
    """The flavor ``u1`` draws (_drawn_flavor), f1, or a second one ``u2`` draws in proportion to weight among
    the others (two distinct choices, as Serve's power-of-two router samples two distinct replicas), whichever
    has fewer requests in flight per unit of weight counting this one (f1 among equals; by count alone where
    no flavor weighs anything). f1 where ``u2`` is ``u1`` (the plain weighted draw), where it is the only live
    flavor, or where the others weigh nothing."""
    f1 = _drawn_flavor(u1, live_w, total, n_live)
    others = 0.0
    for g in range(len(live_w)):
        if g != f1 and live_w[g] > 0:
            others += live_w[g]
    if u1 == u2 or n_live < 2 or (total > 0 and others <= 0):
        return f1
    w1 = live_w[f1]
    live_w[f1] = -1.0
    f2 = _drawn_flavor(u2, live_w, others, n_live - 1)
    live_w[f1] = w1
    a, b = (live_w[f1], live_w[f2]) if total > 0 else (1.0, 1.0)
    return f2 if (load[f2] + 1) * a < (load[f1] + 1) * b else f1


@numba.njit(cache=True, nogil=True)
def _slot_of(j: int, f: int, nr: int, r_state: npt.NDArray[np.int8], r_flavor: npt.NDArray[np.int16], r_run: I64,
             on: I64, u_slot: F64, req_rep: I64) -> int:
    """The live replica of flavor ``f`` request ``j`` waits for: the one it took, or if that one is gone the
    one with the fewest requests running or waiting (``on``, which counts it), ``u_slot[j]`` drawing among
    equals. ``f`` has a live replica."""
    r = req_rep[j]
    if r >= 0 and r_state[r] == LIVE:
        return r
    n = 0
    for q in range(nr):
        if r_state[q] == LIVE and r_flavor[q] == f:
            n += 1
    x = min(int(u_slot[j] * n), n - 1)
    best = -1
    for q in range(nr):
        if r_state[q] != LIVE or r_flavor[q] != f:
            continue
        if best < 0 or r_run[q] + on[q] < r_run[best] + on[best] or (x == 0 and r_run[q] + on[q] == r_run[best] + on[best]):
            best = q
        x -= 1
    req_rep[j] = best
    on[best] += 1
    return best


@numba.njit(cache=True, nogil=True)
def _live_weights(nr: int, r_state: npt.NDArray[np.int8], r_flavor: npt.NDArray[np.int16],
                  flavor_w: F64) -> tuple[F64, int, float]:
    """Per flavor its routing weight where it has a live replica (at least 0), else -1; how many have one,
    and their weights' sum."""
    nf_ = len(flavor_w)
    live_w = np.full(nf_, -1.0)
    for r in range(nr):
        if r_state[r] == LIVE:
            live_w[r_flavor[r]] = max(flavor_w[r_flavor[r]], 0.0)
    n_live = 0
    total = 0.0
    for f in range(nf_):
        if live_w[f] >= 0:
            n_live += 1
            total += live_w[f]
    return live_w, n_live, total


@numba.njit(cache=True, nogil=True)
def _any_slot(nr: int, r_state: npt.NDArray[np.int8], r_run: I64, r_slots: I64) -> bool:
    """Whether a live replica has a free slot."""
    for r in range(nr):  # noqa: SIM110 (numba compiles the loop; any() over a generator it does not)
        if r_state[r] == LIVE and r_run[r] < r_slots[r]:
            return True
    return False


@numba.njit(cache=True, nogil=True)
def _drawn_flavor(u: float, live_w: F64, total: float, n_live: int) -> int:
    """The flavor ``u`` (uniform in [0, 1)) draws in proportion to ``live_w`` over the live flavors, uniformly
    where those weigh nothing."""
    x = u * (total if total > 0 else n_live)
    f = -1
    for g in range(len(live_w)):
        if live_w[g] < 0:
            continue
        f = g
        x -= live_w[g] if total > 0 else 1.0
        if x < 0:
            break
    return f


@numba.njit(cache=True, nogil=True)
def _least_loaded(nr: int, r_state: npt.NDArray[np.int8], r_flavor: npt.NDArray[np.int16], r_run: I64, r_slots: I64,
                  r_kv: I64, r_kvcap: I64, f: int, need: int) -> int:
    """The live replica of flavor ``f`` with a free slot and KV room for ``need`` tokens that runs fewest
    sequences (the lowest index among equals); -1: none."""
    pick = -1
    for r in range(nr):
        if r_state[r] != LIVE or r_flavor[r] != f or r_run[r] >= r_slots[r]:
            continue
        if r_kv[r] + need <= r_kvcap[r] and (pick < 0 or r_run[r] < r_run[pick]):
            pick = r
    return pick


@dataclass
class TickResult:
    """Requests that finished (or failed) during one tick, for the signal windows."""

    done: I64  # trace indices
    t_fin: F64
    failed: int


class Engine:
    """All replicas of one model. Replicas are added by the cloud model once their gang is live."""

    def __init__(self, arrival_s: F64, prompt: I64, output: I64, cfg: EngineConfig = EngineConfig(),
                 max_kv_tokens: int | None = None, hash_ids: npt.NDArray[np.object_] | None = None,
                 block_tokens: int = 512, seed: int = 0) -> None:
        self.cfg = cfg
        self.arr = np.asarray(arrival_s, dtype=np.float64)
        self.P = np.asarray(prompt, dtype=np.int64)
        self.O = np.maximum(np.asarray(output, dtype=np.int64), 1)  # a request yields at least one token
        n = len(self.arr)
        self._kv = self.P + self.O  # KV tokens a request reserves
        self._kv_list = self._kv.tolist()  # the iteration model's loops read these one by one
        self._arr_list = self.arr.tolist()
        # Prefix caches where the requests carry block hashes; Pf: the tokens each request prefills (its
        # prompt less what it found cached), P itself without caches.
        self.prefix = (PrefixCaches(hash_ids, self.P, block_tokens)
                       if hash_ids is not None and cfg.prefix_caching else None)
        self.Pf = self.P.copy() if self.prefix is not None else self.P
        # (time, prompt tokens looked up, tokens found cached), per flavor index: as the counters read then.
        self._pc_marks: deque[tuple[float, F64, F64]] = deque([(0.0, np.zeros(0), np.zeros(0))])
        # Per-request results.
        self.status = np.zeros(n, dtype=np.int8)
        self.ttft = np.full(n, np.nan, dtype=np.float32)
        self.tpot = np.full(n, np.nan, dtype=np.float32)
        self.t_fin = np.full(n, np.nan, dtype=np.float64)
        # Arrival to the start of its prefill: ttft - queue_s is the prefill time vLLM reports
        # (request_prefill_time_seconds), which the controller's TTFT correction compares with the profile.
        # vLLM's scheduler queue holds a prompt until its first chunk is scheduled; here a prompt admitted
        # onto a replica waits in the replica's prefill FIFO, and that wait is queue, not prefill.
        self.queue_s = np.full(n, np.nan, dtype=np.float32)
        self._pf_started = np.zeros(n, dtype=np.bool_)
        self.flavor_of = np.full(n, -1, dtype=np.int16)  # flavor index of the replica that served it
        self.q_head = 0  # next trace index not yet admitted (the central FIFO queue is [q_head, arrived))
        # Routing by flavor weights (EngineConfig.routing): the weights by flavor index (None: uniform), each
        # request's draw and flavor, and which requests past q_head were admitted out of order.
        self.flavor_w: F64 | None = None
        self.slotted: npt.NDArray[np.bool_] | None = None
        if cfg.routing in BY_FLAVOR:
            rng = np.random.default_rng(seed)
            self._u = rng.random(n)
            self._u_slot = rng.random(n)
            # The second draw of two choices, from its own stream so that the first stays what it was; one
            # draw (the same twice) is the plain weighted draw.
            two = cfg.routing == "flavor-two-choices"
            self._u2 = np.random.default_rng([seed, 2]).random(n) if two else self._u
            self._req_flavor = np.full(n, -1, dtype=np.int16)
            self._req_rep = np.full(n, -1, dtype=np.int64)
            self._admitted = np.zeros(n, dtype=np.bool_)
        self.arrived = 0
        self.failed = 0
        self.never_fit = max_kv_tokens
        self._new_replica_arrays()
        self._new_pool()

    def _new_replica_arrays(self) -> None:
        """Replica arrays, grown on demand."""
        self.nr = 0
        cap = 16
        self.r_state = np.full(cap, STOPPED, dtype=np.int8)
        self.r_flavor = np.zeros(cap, dtype=np.int16)
        self.r_alpha = np.zeros(cap)
        self.r_beta = np.zeros(cap)
        self.r_R = np.ones(cap)
        self.r_over = np.zeros(cap)
        self.r_q = np.zeros(cap)
        self.r_seq = np.zeros(cap)
        self.r_chunk = np.ones(cap)  # prefill tokens per iteration (vLLM's max_num_batched_tokens)
        self._plain_prefill = True
        self.r_slots = np.zeros(cap, dtype=np.int64)
        self.r_kvcap = np.zeros(cap, dtype=np.int64)
        self.r_run = np.zeros(cap, dtype=np.int64)
        self.r_kv = np.zeros(cap, dtype=np.int64)
        self.r_V = np.zeros(cap)
        self.n_draining = 0  # replicas in DRAINING (the end-of-tick scan is skipped when 0)

    def _new_pool(self) -> None:
        """The in-flight pool, in admission order."""
        self.m = 0  # pool entries in use, tombstones included
        self.live_m = 0  # in-flight requests
        self.dead = 0
        pc = 1024
        self.p_req = np.zeros(pc, dtype=np.int64)
        self.p_rep = np.zeros(pc, dtype=np.int64)
        self.p_rem = np.zeros(pc)  # prefill tokens left
        self.p_tadm = np.zeros(pc)
        self.p_tfirst = np.full(pc, np.nan)
        self.p_vend = np.full(pc, np.inf)

    # --- replicas -------------------------------------------------------------------------------

    def add_replica(self, profile: Profile, flavor_index: int, slot_cap: int | None = None) -> int:
        r = self.nr
        if r == len(self.r_state):
            for name in ("r_state", "r_flavor", "r_alpha", "r_beta", "r_R", "r_over", "r_q", "r_seq", "r_chunk",
                         "r_slots", "r_kvcap", "r_run", "r_kv", "r_V"):
                a = getattr(self, name)
                b = np.zeros(2 * len(a), dtype=a.dtype)
                b[: len(a)] = a
                setattr(self, name, b)
            self.r_state[r:] = STOPPED
        self.nr += 1
        self.r_state[r] = LIVE
        self.r_flavor[r] = flavor_index
        self.r_alpha[r] = profile.itl_alpha_s
        self.r_beta[r] = profile.itl_beta_s
        self.r_R[r] = profile.prefill_tokens_per_s
        # A prompt's engine time is prefill_engine_s (per-prompt cost and attention included), as
        # effective tokens at R; the rest of overhead_s is latency outside the engine.
        self.r_over[r] = profile.overhead_s - profile.prefill_seq_s
        self.r_q[r] = profile.prefill_quadratic_s
        self.r_seq[r] = profile.prefill_seq_s
        self.r_chunk[r] = profile.max_num_batched_tokens or self.cfg.max_num_batched_tokens
        self._plain_prefill = self._plain_prefill and not (profile.prefill_quadratic_s or profile.prefill_seq_s)
        self.r_slots[r] = min(profile.max_num_seqs, slot_cap) if slot_cap else profile.max_num_seqs
        self.r_kvcap[r] = profile.kv_tokens
        if self.prefix is not None:
            self.prefix.add_replica(profile.kv_tokens)
        return r

    def drain(self, r: int) -> None:
        """Stop admitting to replica r; it finishes what it runs."""
        if self.r_state[r] == LIVE:
            self.r_state[r] = DRAINING
            self.n_draining += 1

    def kill(self, r: int, now: float) -> int:
        """Replica r disappears (node terminated): its in-flight requests fail. Returns how many."""
        if self.r_state[r] == DRAINING:
            self.n_draining -= 1
        self.r_state[r] = STOPPED
        if self.prefix is not None:
            self.prefix.clear(r)
        m = self.m
        hit = (self.p_rep[:m] == r) & self._alive(m)
        k = int(hit.sum())
        if k:
            idx = self.p_req[:m][hit]
            self.status[idx] = FAILED
            self.t_fin[idx] = now
            self.failed += k
            self._bury(np.flatnonzero(hit))
        self.r_run[r] = 0
        self.r_kv[r] = 0
        return k

    def running(self, r: int) -> int:
        return int(self.r_run[r])

    def idle(self, r: int) -> bool:
        return self.r_run[r] == 0

    @property
    def waiting(self) -> int:
        if self.cfg.routing in BY_FLAVOR:
            return int(np.count_nonzero(~self._admitted[self.q_head : self.arrived]))
        return self.arrived - self.q_head

    def set_flavor_weights(self, weights: npt.ArrayLike, slotted: npt.ArrayLike | None = None) -> None:
        """The routing weight of each flavor index (EngineConfig.routing "flavor-weights"), and which flavors
        send each request to one replica that it then waits for, as to a multi-node flavor's gang slots (None:
        none)."""
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or not np.all(w >= 0):
            raise ValueError(f"flavor weights must be one non-negative weight per flavor, got {w}")
        sl = np.zeros(len(w), dtype=np.bool_) if slotted is None else np.asarray(slotted, dtype=np.bool_)
        if sl.shape != w.shape:
            raise ValueError(f"slotted must name every flavor that has a weight, got {sl} for {w}")
        self.flavor_w, self.slotted = w, sl

    @property
    def in_flight(self) -> int:
        return self.live_m

    def prefix_hit_rate(self, now: float, window_s: float, flavor: int | None = None) -> float | None:
        """Prompt tokens found in the prefix caches over those looked up, over about the last ``window_s``
        (vLLM's prefix_cache_hits / prefix_cache_queries, differenced as the controller does), of all replicas
        or of those of flavor index ``flavor``; None without prefix caching or lookups in the window: never
        observed is not a hit rate of 0."""
        if self.prefix is None:
            return None
        marks = self._pc_marks
        if now > marks[-1][0]:
            reps = self.r_flavor[: len(self.prefix.queries)]
            marks.append((now, np.bincount(reps, weights=self.prefix.queries).astype(np.float64),
                          np.bincount(reps, weights=self.prefix.hits).astype(np.float64)))
        while len(marks) > 2 and marks[1][0] <= now - window_s:
            marks.popleft()
        (_, q0, h0), (_, q1, h1) = marks[0], marks[-1]
        if flavor is None:
            queries, hits = float(q1.sum() - q0.sum()), float(h1.sum() - h0.sum())
        else:
            def at(a: F64) -> float:
                return float(a[flavor]) if flavor < len(a) else 0.0
            queries, hits = at(q1) - at(q0), at(h1) - at(h0)
        return hits / queries if queries > 0 else None

    def kv_usage(self) -> float:
        live = self.r_state[: self.nr] != STOPPED
        if not live.any():
            return 0.0
        return float((self.r_kv[: self.nr][live] / self.r_kvcap[: self.nr][live]).max())

    # --- the tick -------------------------------------------------------------------------------

    def _grow_pool(self, need: int) -> None:
        cap = len(self.p_req)
        if need <= cap:
            return
        new = max(need, 2 * cap)
        for name, fill in (("p_req", 0), ("p_rep", 0), ("p_rem", 0.0), ("p_tadm", 0.0), ("p_tfirst", np.nan),
                           ("p_vend", np.inf)):
            a = getattr(self, name)
            b = np.full(new, fill, dtype=a.dtype)
            b[:cap] = a
            setattr(self, name, b)

    def _alive(self, m: int) -> npt.NDArray[np.bool_]:
        return self.p_tfirst[:m] != np.inf  # finished entries are tombstones: t_first = +inf

    def _bury(self, idx: npt.NDArray[np.int64]) -> None:
        """Finished entries become tombstones (never start, never finish); compact once they dominate."""
        self.p_tfirst[idx] = np.inf
        self.p_vend[idx] = np.inf
        self.dead += len(idx)
        self.live_m -= len(idx)
        if self.dead * 4 > self.live_m:
            self._compact(self._alive(self.m))

    def _compact(self, keep: npt.NDArray[np.bool_]) -> None:
        m = self.m
        k = int(keep.sum())
        self.dead = 0
        for name in ("p_req", "p_rep", "p_rem", "p_tadm", "p_tfirst", "p_vend"):
            a = getattr(self, name)
            a[:k] = a[:m][keep]
        self.p_tfirst[k:m] = np.nan
        self.p_vend[k:m] = np.inf
        self.m = k

    def _effective_prompt(self, p: I64, rep: I64) -> F64:
        """Prompt tokens plus the per-prompt and attention cost, in tokens at the replica's prefill rate."""
        if self._plain_prefill:  # no replica has the optional terms (the published profiles): p itself
            return p.astype(np.float64)
        q, seq = self.r_q[rep], self.r_seq[rep]
        return p + self.r_R[rep] * (seq + q * p * p)

    def _admit(self, T: float, T1: float) -> None:
        """Hand queued and newly arrived requests to replicas with room: by flavor weight, then FIFO to the
        flavor's least-loaded replica (_route_weighted), or FIFO to the least-loaded of all (_route)."""
        end = bisect.bisect_left(self._arr_list, T1)
        self.arrived = max(self.arrived, end)
        i0 = self.q_head
        if i0 >= end:
            return
        n = end - i0
        rep, failed = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        never = float(self.never_fit) if self.never_fit is not None else math.inf
        if self.cfg.routing in BY_FLAVOR:
            self._admit_weighted(i0, end, never, rep, failed, T)
            return
        i, k, nf = _route(i0, end, self.nr, self.r_state, self.r_run, self.r_slots, self.r_kv, self.r_kvcap,
                          self._kv, never, rep, failed)
        self.q_head = i
        if nf:
            f = failed[:nf]
            self.status[f] = FAILED
            self.t_fin[f] = np.maximum(self.arr[f], T)
            self.failed += nf
        if not k:
            return
        req = np.arange(i0, i, dtype=np.int64)
        if nf:
            req = req[self.status[i0:i] != FAILED]
        self._enqueue(req, rep[:k], np.maximum(self.arr[req], T))

    def _admit_weighted(self, i0: int, end: int, never: float, rep: I64, failed: I64, T: float) -> None:
        top = int(self.r_flavor[: self.nr].max(initial=0))
        # No weights set: uniform, as the ingress's configured weights default to 1 each.
        w = self.flavor_w if self.flavor_w is not None else np.ones(top + 1)
        if len(w) <= top:
            raise ValueError(f"routing by flavor weights: {len(w)} weights for flavor index {top}")
        slotted = self.slotted if self.slotted is not None else np.zeros(len(w), dtype=np.bool_)
        req = np.empty(end - i0, dtype=np.int64)
        self.q_head, k, nf = _route_weighted(i0, end, self.nr, self.r_state, self.r_flavor, self.r_run,
                                             self.r_slots, self.r_kv, self.r_kvcap, self._kv, never, w, slotted,
                                             self._u, self._u2, self._u_slot, self._req_flavor, self._req_rep,
                                             self._admitted, req, rep, failed)
        if nf:
            f = failed[:nf]
            self.status[f] = FAILED
            self.t_fin[f] = np.maximum(self.arr[f], T)
            self.failed += nf
        if k:
            order = np.argsort(req[:k], kind="stable")
            self._enqueue(req[:k][order], rep[:k][order], np.maximum(self.arr[req[:k][order]], T))

    def _enqueue(self, req: I64, rep: I64, tadm: F64) -> None:
        """Admitted requests (trace indices, their replicas, admission times) join the in-flight pool."""
        k = len(req)
        m = self.m
        self._grow_pool(m + k)
        if self.prefix is not None:
            self.Pf[req] = self.P[req] - self.prefix.admit_many(req, rep)
        p = self._effective_prompt(self.Pf[req], rep)
        self.p_req[m : m + k] = req
        self.p_rep[m : m + k] = rep
        self.p_tadm[m : m + k] = tadm
        self.queue_s[req] = tadm - self.arr[req]  # until its prefill starts (step): the router queue so far
        self.p_rem[m : m + k] = p
        if self.cfg.prefill_contention:
            self.p_tfirst[m : m + k] = np.nan
        else:
            self.p_tfirst[m : m + k] = tadm + self.r_over[rep] + p / self.r_R[rep]
        self.p_vend[m : m + k] = np.inf
        self.m = m + k
        self.live_m += k

    def step(self, T: float, dt: float) -> TickResult:
        """Advance every replica from T to T + dt."""
        failed0 = self.failed
        self._admit(T, T + dt)
        m = self.m
        if self.live_m == 0:
            return TickResult(np.zeros(0, dtype=np.int64), np.zeros(0), self.failed - failed0)
        done_req, done_t = np.empty(m, dtype=np.int64), np.empty(m)
        k = _tick(T, dt, m, self.nr, self.cfg.prefill_contention,
                  self._plain_prefill, self.p_req, self.p_rep, self.p_rem, self.p_tadm, self.p_tfirst, self.p_vend,
                  self.r_run, self.r_kv, self.r_alpha, self.r_beta, self.r_R, self.r_over, self.r_q, self.r_seq,
                  self.r_chunk, self.r_V, self.r_flavor, self.Pf, self.O, self._kv, self.arr, self.queue_s,
                  self._pf_started, self.status,
                  self.ttft, self.tpot, self.t_fin, self.flavor_of, done_req, done_t)
        if k:  # the kernel left tombstones; compact once they dominate (as _bury does)
            self.dead += k
            self.live_m -= k
            if self.dead * 4 > self.live_m:
                self._compact(self._alive(self.m))
        self._stop_drained()
        return TickResult(done_req[:k], done_t[:k], self.failed - failed0)

    def _stop_drained(self) -> None:
        """Draining replicas that emptied are done."""
        if self.n_draining:
            nr = self.nr
            drained = (self.r_state[:nr] == DRAINING) & (self.r_run[:nr] == 0)
            k = int(np.count_nonzero(drained))
            if k:
                self.r_state[:nr][drained] = STOPPED
                self.n_draining -= k

    def fail_unfinished(self, now: float) -> int:
        """End of simulation: whatever is still queued or in flight counts as failed."""
        left = np.flatnonzero(self.status == PENDING)
        self.status[left] = FAILED
        self.t_fin[left] = now
        self.failed += len(left)
        return len(left)


def make_engine(arrival_s: F64, prompt: I64, output: I64, cfg: EngineConfig = EngineConfig(),
                max_kv_tokens: int | None = None, hash_ids: npt.NDArray[np.object_] | None = None,
                block_tokens: int = 512, seed: int = 0) -> Engine:
    """The engine model ``cfg.model`` names, over one model's requests (``hash_ids``: their prompt block
    hashes, ``block_tokens`` tokens a block, for the prefix caches)."""
    if cfg.model == "iteration":
        # Imported here: iteration builds on this module's types and constants, so a module-level
        # import would be a cycle.
        from rayscale.sim.iteration import IterationEngine

        return IterationEngine(arrival_s, prompt, output, cfg, max_kv_tokens, hash_ids, block_tokens)
    return Engine(arrival_s, prompt, output, cfg, max_kv_tokens, hash_ids, block_tokens, seed)
