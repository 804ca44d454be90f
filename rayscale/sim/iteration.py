"""Engine model at the grain of vLLM's scheduler: one engine iteration at a time, per replica.

``EngineConfig(model="iteration")``. The router, the replicas' slots and KV admission are the fluid
engine's (rayscale.sim.engine); what happens inside a replica follows vLLM V1's scheduler
(vllm/v1/core/sched/scheduler.py) with chunked prefill:

- an iteration has a token budget, the replica's ``max_num_batched_tokens`` (as the fluid engine's); each decoding sequence takes one token of
  it, the rest goes to prompts in FIFO order: the partially prefilled one first, then waiting ones, as
  many as fit, the last one chunked;
- a request that reaches the replica while an iteration runs joins the next one;
- every prompt whose last token is in an iteration gets its first token when the iteration ends, all of
  them together; every decoding sequence gets one token per iteration;
- an iteration with d decoding sequences costs itl_alpha_s + itl_beta_s d + 2 prefill_quadratic_s S, S
  their context tokens (decode attention: the quadratic prefill term's per-token counterpart), plus
  prefill_iteration_s when it carries prompt tokens; one with prompts only the base b0 = min(itl_alpha_s + prefill_iteration_s,
  overhead_s - prefill_seq_s); each prompt chunk of k tokens, c of its tokens already computed, adds
  prefill_seq_s + k / prefill_tokens_per_s + prefill_quadratic_s (k^2 + 2 k c);
- overhead_s - prefill_seq_s - b0 is latency outside the engine (API server, streaming): added to every
  token the client sees, not engine time.
- a prompt that finds its prefix in the replica's prefix cache (rayscale.sim.prefix) starts with those
  tokens computed (c > 0 at its first chunk) and prefills only the rest.

A lone request therefore costs exactly the profile's TTFT while its prompt fits one iteration, and a
pure decode batch exactly itl_s(d). Unlike the fluid model this costs Python work per iteration that
carries a prompt; stretches of decode-only iterations are skipped in one step (to the next finish, the
next arrival's iteration boundary or the tick's end). Fine for one replica's replay and hour-long traces;
the fluid model stays the default for day-long runs (bench/results/sim_speed.md).
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np
import numpy.typing as npt

from rayscale.core.catalog import Profile
from rayscale.sim.engine import (
    DONE,
    DRAINING,
    F64,
    FAILED,
    I64,
    LIVE,
    STOPPED,
    Engine,
    EngineConfig,
    TickResult,
)

# A waiting or partially prefilled prompt: [trace index, tokens left, tokens computed, admission time, tokens
# found in the prefix cache]. A prefix-cache hit starts computed (vLLM's num_computed_tokens), so its chunks
# attend to the cached prefix and only the rest is prefilled.
_REQ, _LEFT, _CTX, _TADM, _HIT = 0, 1, 2, 3, 4


def _iterations_to(gap: float, s: float, S: int, d: int, quad: float) -> int:
    """Decode iterations from now until the first one that starts at or after ``gap`` seconds: iteration j
    costs s + 2 quad (S + j d) (its attention reads S + j d context tokens)."""
    if gap <= 0:
        return 0
    a = quad * d
    if a <= 0:
        return math.ceil(gap / (s + 2 * quad * S))
    b = s + 2 * quad * S - a  # time(k) = a k^2 + b k
    return math.ceil((-b + math.sqrt(b * b + 4 * a * gap)) / (2 * a) - 1e-12)


class IterationEngine(Engine):
    """All replicas of one model, each stepped iteration by iteration (module docstring)."""

    def __init__(self, arrival_s: F64, prompt: I64, output: I64, cfg: EngineConfig,
                 max_kv_tokens: int | None = None, hash_ids: npt.NDArray[np.object_] | None = None,
                 block_tokens: int = 512) -> None:
        super().__init__(arrival_s, prompt, output, cfg, max_kv_tokens, hash_ids, block_tokens)
        self._out = self.O.tolist()
        self._p_list = self.P.tolist()
        # Per replica.
        self._free: list[float] = []  # when its engine loop can start the next iteration
        self._it: list[int] = []  # iterations done
        self._pf: list[deque[list[float]]] = []  # prompts not fully prefilled, FIFO
        # Sequences decoding: a heap of (iteration of the last token, trace index), and their context tokens
        # summed (decode attention reads all of them).
        self._fin: list[list[tuple[int, int]]] = []
        self._ctx: list[int] = []
        self._cost: list[tuple[float, ...]] = []
        self._first: dict[int, float] = {}  # engine time of the first token, per decoding request
        self._busy: set[int] = set()  # replicas with requests

    def add_replica(self, profile: Profile, flavor_index: int, slot_cap: int | None = None) -> int:
        r = super().add_replica(profile, flavor_index, slot_cap)
        seq, pi = profile.prefill_seq_s, profile.prefill_iteration_s
        b0 = min(profile.itl_alpha_s + pi, profile.overhead_s - seq)
        front = profile.overhead_s - seq - b0
        self._free.append(-math.inf)
        self._it.append(0)
        self._pf.append(deque())
        self._ctx.append(0)
        self._fin.append([])
        self._cost.append((profile.itl_alpha_s, profile.itl_beta_s, b0, seq, 1.0 / profile.prefill_tokens_per_s,
                           profile.prefill_quadratic_s, front, pi))
        return r

    def _waiting(self, q: int, r: int, t: float) -> list[float]:
        """Request q's entry in replica r's prefill queue, admitted at t, past its prefix-cache hit."""
        if self.prefix is None:
            return [q, self._p_list[q], 0, t, 0]
        c = self.prefix.admit(q, r)
        self.Pf[q] = self._p_list[q] - c
        return [q, self._p_list[q] - c, c, t, c]

    def _enqueue(self, req: I64, rep: I64, tadm: F64) -> None:
        for q, r, t in zip(req.tolist(), rep.tolist(), tadm.tolist(), strict=True):
            self._pf[r].append(self._waiting(q, r, t))
            self._busy.add(r)
        self.live_m += len(req)

    def kill(self, r: int, now: float) -> int:
        if self.r_state[r] == DRAINING:
            self.n_draining -= 1
        self.r_state[r] = STOPPED
        idx = [int(e[_REQ]) for e in self._pf[r]] + [q for _, q in self._fin[r]]
        for q in idx:
            self._first.pop(q, None)
        self._pf[r].clear()
        self._fin[r].clear()
        self._ctx[r] = 0
        self._busy.discard(r)
        if idx:
            a = np.asarray(idx, dtype=np.int64)
            self.status[a] = FAILED
            self.t_fin[a] = now
            self.failed += len(a)
            self.live_m -= len(a)
        self.r_run[r] = 0
        self.r_kv[r] = 0
        return len(idx)

    def step(self, T: float, dt: float) -> TickResult:
        T1 = T + dt
        failed0 = self.failed
        self._admit(T, T1)
        done: list[int] = []
        t_done: list[float] = []
        # Replicas advance in time order, each to the next one's clock, so that a slot freed mid-tick takes
        # the head of the central queue when it frees (Serve's router assigns on completion, not per tick).
        heap = [(self._free[r], r) for r in self._busy]
        heapq.heapify(heap)
        while heap:
            _, r = heapq.heappop(heap)
            until = min(heap[0][0], T1) if heap else T1
            if self._run(r, T1, until, done, t_done):
                heapq.heappush(heap, (self._free[r], r))
            elif not self._pf[r] and not self._fin[r]:
                self._busy.discard(r)
        if done:
            req = np.asarray(done, dtype=np.int64)
            tf = np.asarray(t_done)
            self.status[req] = DONE
            self.t_fin[req] = tf
            self.live_m -= len(req)
        else:
            req, tf = np.zeros(0, dtype=np.int64), np.zeros(0)
        self._stop_drained()
        return TickResult(req, tf, self.failed - failed0)

    def _pull(self, r: int, t: float, T1: float) -> None:
        """Replica r freed slots at t: queued requests join it, FIFO, when they have arrived (as the tick's
        admission does, with the requests that arrive before the tick ends)."""
        i, end = self.q_head, len(self._arr_list)
        if i >= end or self._arr_list[i] >= T1 or self.r_state[r] != LIVE:
            return
        never = self.never_fit if self.never_fit is not None else math.inf
        run, slots, kv, kvcap = int(self.r_run[r]), int(self.r_slots[r]), int(self.r_kv[r]), int(self.r_kvcap[r])
        pf, kv_list, arr = self._pf[r], self._kv_list, self._arr_list
        while i < end and run < slots and arr[i] < T1:
            need = kv_list[i]
            if need > never or kv + need > kvcap:
                break  # the tick's admission fails it or finds it room elsewhere
            pf.append(self._waiting(i, r, arr[i] if arr[i] > t else t))
            run += 1
            kv += need
            i += 1
        if i > self.q_head:
            self.live_m += i - self.q_head
            self.q_head = i
            self.arrived = max(self.arrived, i)
            self.r_run[r], self.r_kv[r] = run, kv

    def _run(self, r: int, T1: float, until: float, done: list[int], t_done: list[float]) -> bool:
        """Replica r's iterations that start before ``until`` (<= T1; the last may end after it); its finished
        requests are appended to done / t_done. True when it has more to run in this tick."""
        alpha, beta, b0, seq, inv_r, quad, front, pi = self._cost[r]
        C = int(self.r_chunk[r])
        pf, fin = self._pf[r], self._fin[r]
        arr, out, first = self._arr_list, self._out, self._first
        tpot, queue_s = self.tpot, self.queue_s
        t, v, d, S = self._free[r], self._it[r], len(fin), self._ctx[r]  # every decoding sequence is in fin
        P = self._p_list
        fl = int(self.r_flavor[r])
        while True:
            freed = False
            if d == 0:
                if not pf:
                    break  # idle: the next request starts its own iteration when it comes
                if pf[0][_TADM] > t:
                    t = pf[0][_TADM]
            if t >= T1 or t > until:  # ties run: every replica the heap pops makes progress
                break
            if not pf or pf[0][_TADM] > t:
                # Decode only: iterations until a sequence finishes, a prompt can join or the tick ends; each
                # costs s plus the attention over a context that grows by d tokens per iteration.
                s = alpha + beta * d
                k = fin[0][0] - v
                if pf:
                    k = min(k, _iterations_to(pf[0][_TADM] - t, s, S, d, quad))
                k = max(min(k, _iterations_to(until - t, s, S, d, quad)), 1)
                t += k * s + 2 * quad * (k * S + d * k * (k - 1) / 2)
                v += k
                S += k * d
            else:
                # One iteration with prompt tokens.
                cost, completed = _chunks(pf, t, C - d, alpha + beta * d + pi + 2 * quad * S if d else b0, seq,
                                          inv_r, quad, queue_s, arr)
                t += cost
                v += 1
                S += d
                started, context, freed = self._prefilled(r, completed, t, v, front, fl, done, t_done)
                d += started
                S += context
            # Sequences that decoded in these iterations (not those just started) may have got their last token.
            while fin and fin[0][0] <= v:
                _, q = heapq.heappop(fin)
                tpot[q] = (t - first.pop(q)) / (out[q] - 1)
                S -= P[q] + out[q]
                self._finish_one(r, q, fl)
                done.append(q)
                t_done.append(t + front)
                d -= 1
                freed = True
            if freed and t < T1:
                self._pull(r, t, T1)
        self._free[r], self._it[r], self._ctx[r] = t, v, S
        return t < T1 and (d > 0 or bool(pf))

    def _prefilled(self, r: int, completed: int, t: float, v: int, front: float, fl: int, done: list[int],
                   t_done: list[float]) -> tuple[int, int, bool]:
        """The ``completed`` prompts at the head of replica r's prefill queue, prefilled by time ``t``
        (iteration ``v``): a one-token answer finishes, the others start decoding. Returns (sequences that
        started decoding, context tokens they add, whether a slot was freed)."""
        pf, fin, P = self._pf[r], self._fin[r], self._p_list
        started = context = 0
        freed = False
        for _ in range(completed):
            q = int(pf.popleft()[_REQ])
            self.ttft[q] = t + front - self._arr_list[q]
            o = self._out[q]
            if o == 1:
                self.tpot[q] = 0.0
                self._finish_one(r, q, fl)
                done.append(q)
                t_done.append(t + front)
                freed = True
            else:
                self._first[q] = t
                heapq.heappush(fin, (v + o - 1, q))
                started += 1
                context += P[q] + 1
        return started, context, freed

    def _finish_one(self, r: int, q: int, flavor: int) -> None:
        self.flavor_of[q] = flavor
        self.r_run[r] -= 1
        self.r_kv[r] -= self._kv_list[q]


def _chunks(pf: deque[list[float]], t: float, room: int, cost: float, seq: float, inv_r: float, quad: float,
            queue_s: npt.NDArray[np.float32], arr: list[float]) -> tuple[float, int]:
    """One iteration's prompt chunks at time ``t``, FIFO from the head of the prefill queue ``pf`` while
    ``room`` tokens are left: each entry's tokens left and context advance, a first chunk records its
    request's queueing time. Returns the iteration's cost (``cost`` plus the chunks') and how many prompts
    it completed."""
    completed = 0
    for e in pf:
        if room <= 0 or e[_TADM] > t:
            break
        left = e[_LEFT]
        k = int(left if left <= room else room)
        c = e[_CTX]
        if c == e[_HIT]:  # its first chunk
            q = int(e[_REQ])
            queue_s[q] = t - arr[q]
        cost += seq + k * inv_r + quad * (k * k + 2 * k * c)
        e[_LEFT] = left - k
        e[_CTX] = c + k
        room -= k
        if left == k:
            completed += 1
    return cost, completed
