"""Per-request SLO attainment of one replica at a load: the tail that the mean-value TPOT(b) leaves out.

rayscale.core.estimate's TPOT(b) = alpha + beta*b + b*prefill(P)/O is the TPOT of the *mean* request. The SLO
counts requests (99% of them within both targets), and on slow-prefill flavors the mean overstated what a
replica sustains 1.6-3.8x (bench/results/capacity_error.md): a 2,048-token chunk there takes 0.4 s, four
TPOT budgets, so what binds is the tail. This module gives the share of requests that miss when a replica
runs b sequences on average (arrival rate lambda(b) = b / (O * TPOT(b)), Little's law), from three terms:

- TPOT of a request with O output tokens is s(b) + S/(O-1): s(b) = alpha + beta*b is a decode iteration and
  S the engine time of the prompts prefilled while it decodes (chunked prefill puts them into its
  iterations). S is a compound Poisson sum over the prompts that arrive during its decode, taken as an atom
  at zero plus a log-normal with the sum's conditional mean and variance. Short answers spread a stall over
  few tokens, so they miss first. An iteration carries at most one chunk of prompt tokens (the profile's
  max_num_batched_tokens, rayscale.core.chunk), so S is at most (O-1) chunks' prefill: where one chunk fits in
  what a gap can absorb beside its decode step, prefill never breaks a TPOT. That holds while the replica runs
  at most k* sequences; their number is Poisson around the mean load, and the miss above counts only where it
  is exceeded.
- TTFT is the request's own prefill plus a wait behind prompts already prefilling: an M/G/1 queue
  (Pollaczek-Khinchine mean wait, exponential tail). The prompts too long to prefill within the target at
  all are a share read off the mix's quantile function (``late_share``), not whole nodes.
- Ray Serve's router samples two replicas and takes the less loaded (power of two choices), so a request
  lands on a busy replica only when both samples are busy: it waits to prefill with probability rho^2, not
  rho, and a decoding request sees new prompts at lambda * min(b, 1): the router keeps replicas evenly
  loaded, so min(b, 1) of them are busy, and an arrival joins a busy one only when both samples are.
- One replica alone (``alone``: a flavor deployment of one replica, whose router has no second choice)
  takes every prompt: it waits with probability rho, and the prompts that arrived while a request waited
  and prefilled are prefilled (FIFO) during its decode, beside those arriving as it decodes, whose steps
  then last s + rho * chunk on average (a chunk rides along while prompts queue, a share rho of the time).
  Without these terms the pooled model called a lone replica's capacity 1.2-5x what the simulated engine
  measures (bench/results/capacity_error_lone_7b.md, lone_replica_*.md); with them, 0.8-1.4x.

Lengths enter as quantile nodes of the mix (RequestMix.prompt_quantiles / output_quantiles, weighted by
MIX_WEIGHTS), so the model sees the distribution's shape, not only its mean. bench/capacity_error.py checks
it against the simulated engine per flavor and trace. Everything is numpy over rows (one row per
(profile, SLO, mix, correction)) and each row's result depends on that row alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist
from typing import cast

import numpy as np
import numpy.typing as npt
from scipy.special import ndtr, pdtrc

from rayscale.core.frozen import frozen_without_init
from rayscale.core.signals import MIX_QUANTILES, MIX_WEIGHTS, RequestMix

F64 = npt.NDArray[np.float64]

# vLLM's default max_num_batched_tokens for an online server on a GPU under 70 GiB (vllm/engine/arg_utils.py,
# UsageContext.OPENAI_API_SERVER): the prefill chunk of a profile that pins none (rayscale.core.chunk).
CHUNK_TOKENS = 2048
ROUTER_CHOICES = 2  # Ray Serve's request router: power of two choices
# Log-normal spread of output lengths when the mix has no quantiles (chat and code traces: 0.9-1.0).
OUTPUT_SIGMA = 1.0
LOAD_FLOOR = 1e-3  # sequences per replica: the idle end of the search

_Z95 = NormalDist().inv_cdf(0.95)
_Z = tuple(NormalDist().inv_cdf(u) for u in MIX_QUANTILES)
WEIGHTS = np.array(MIX_WEIGHTS)
Z_NODES = np.array(_Z)
TOP_SHARE = 1.0 - MIX_QUANTILES[-1]  # the share of prompts above the top node


def lognormal_quantiles(mean: float, p95: float | None, sigma: float = OUTPUT_SIGMA) -> tuple[float, ...]:
    """Lengths at MIX_QUANTILES of the log-normal with this mean and 95th percentile (``sigma`` without one).

    The spread solves mean * exp(z95*s - s^2/2) = p95 for its smaller root; a p95 beyond e^(z95^2/2) = 3.9x
    the mean has none, and takes the largest spread that has one."""
    if p95 is not None:
        r = math.log(max(p95, mean) / mean)
        d = _Z95 * _Z95 - 2.0 * r
        sigma = _Z95 - math.sqrt(d) if d > 0 else _Z95
    mu = math.log(mean) - sigma * sigma / 2.0
    exp = math.exp
    return tuple([exp(mu + sigma * z) for z in _Z])


# A log-normal's far tail has prompts past any model's context; observed mixes end near their p95 (Azure
# code: p99 = 1.02 x p95; the generated traces, clipped at 8k: 1.5x). The fallback stops there.
PROMPT_TAIL_CAP = 1.5


@functools.lru_cache(maxsize=4096)
def mix_quantiles(mix: RequestMix) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(prompt, output) lengths at MIX_QUANTILES: the mix's own, else a log-normal through its mean and p95
    (prompts, at most PROMPT_TAIL_CAP x the p95) or its mean (outputs, spread OUTPUT_SIGMA). Cached by value:
    a step asks for each model's mix several times (the context cut, the estimate's rows, the corrections')."""
    cap = PROMPT_TAIL_CAP * max(mix.prompt_p95, mix.prompt_mean)
    prompt = mix.prompt_quantiles or tuple([x if x <= cap else cap for x in lognormal_quantiles(
        max(mix.prompt_mean, 1.0), mix.prompt_p95)])
    output = mix.output_quantiles or lognormal_quantiles(max(mix.output_mean, 1.0), None)
    return prompt, tuple([o if o >= 1.0 else 1.0 for o in output])


def prompt_end(mix: RequestMix) -> float:
    """The longest prompt the mix has: its own when known; the fallback log-normal's cap; else inf (the
    observed nodes' tail extrapolated)."""
    if mix.prompt_max is not None:
        return max(mix.prompt_max, 1.0)
    return PROMPT_TAIL_CAP * max(mix.prompt_p95, mix.prompt_mean) if mix.prompt_quantiles is None else math.inf


def _mean(x: npt.NDArray[np.float64] | npt.NDArray[np.bool_]) -> F64:
    """Weighted mean over the length nodes, row by row (a matmul's sums depend on how many rows it has, and
    a row's capacity must not)."""
    return np.asarray((x * WEIGHTS).sum(axis=1))


@dataclass(frozen=True)
class Rows:
    """Column arrays, one row per (profile, SLO, mix, correction); (rows, nodes) arrays are per length
    quantile. Build with ``make_rows``: the last block is derived once, as nothing in it depends on the load."""

    prefill_tokens_per_s: F64
    overhead_s: F64
    alpha: F64
    beta: F64
    seq_s: F64
    quad_s: F64
    ttft_slo: F64
    tpot_slo: F64
    corr_ttft: F64
    corr_tpot: F64
    output_mean: F64
    chunk: F64  # prompt tokens one iteration carries (vLLM's max_num_batched_tokens, rayscale.core.chunk)
    prompt: F64  # (rows, nodes)
    output: F64  # (rows, nodes)
    # Derived by make_rows.
    chunk_s: F64  # engine time of a full chunk of prefill: the most one gap of a decoding request can stall
    prefill: F64  # (rows, nodes): a prompt's own prefill time, p/R + quad*p^2
    log_prompt: F64  # (rows, nodes): log of the prompt lengths, the quantile function late_share reads
    log_prompt_end: F64  # log of the longest prompt (prompt_end; inf: not known), where that function ends
    gaps: F64  # (rows, nodes): output tokens - 1, the gaps a TPOT is the mean of
    ex: F64  # mean engine time of a prompt (its prefill + per-sequence cost: what the iterations it shares pay)
    cv: F64  # E[engine^2] / E[engine]^2
    ex2: F64  # E[engine^2]
    p1: F64  # E[p]
    p2: F64  # E[p^2]
    ep: F64  # E[engine * p]


def make_rows(prefill_tokens_per_s: F64, overhead_s: F64, alpha: F64, beta: F64, seq_s: F64, quad_s: F64,
              ttft_slo: F64, tpot_slo: F64, corr_ttft: F64, corr_tpot: F64, output_mean: F64, chunk: F64,
              prompt: F64, output: F64, prompt_end: F64) -> Rows:
    col = np.newaxis
    prefill = prompt / prefill_tokens_per_s[:, col] + quad_s[:, col] * prompt * prompt
    engine = seq_s[:, col] + prefill
    ex, ex2 = _mean(engine), _mean(engine * engine)
    chunk_s = seq_s + chunk / prefill_tokens_per_s + quad_s * chunk * chunk
    return Rows(prefill_tokens_per_s, overhead_s, alpha, beta, seq_s, quad_s, ttft_slo, tpot_slo, corr_ttft,
                corr_tpot, output_mean, chunk, prompt, output, chunk_s, prefill, np.log(np.maximum(prompt, 1.0)),
                np.log(np.maximum(prompt_end, 1.0)), output - 1.0, ex, ex2 / (ex * ex), ex2, _mean(prompt), _mean(prompt * prompt),
                _mean(engine * prompt))


@dataclass(frozen=True)
class Load:
    """The model at a load of ``batch`` sequences per replica (arrays over rows)."""

    batch: F64
    rps: F64  # arrival rate per replica
    tpot_mean_s: F64  # the mean request's TPOT (estimate.tpot_at)
    ttft_miss: F64  # share of requests over the TTFT target
    tpot_miss: F64  # share over the TPOT target

    @property
    def miss(self) -> F64:
        return np.asarray(self.ttft_miss + self.tpot_miss)  # the union, bounded from above


def _means(rows: Rows, batch: F64) -> tuple[F64, F64, F64]:
    """A decode iteration, the mean request's TPOT and the arrival rate (Little's law) at ``batch``."""
    s = rows.alpha + rows.beta * np.maximum(batch, 1.0)
    tpot_mean = rows.corr_tpot * (s + batch * rows.ex / rows.output_mean)
    return s, tpot_mean, batch / (rows.output_mean * tpot_mean)


def rate_at(rows: Rows, batch: F64) -> tuple[F64, F64]:
    """(arrival rate, mean request's TPOT) at ``batch``: at_load without the tails."""
    _, tpot_mean, rate = _means(rows, batch)
    return rate, tpot_mean


def late_share(rows: Rows, budget: F64, per_token: F64) -> F64:
    """Share of prompts whose own prefill, quad*p^2 + per_token*p, overruns ``budget``: those past the
    length p* that solves it, read off the mix's quantile function: log length linear in the normal score
    between nodes, the bottom segment extended past the bottom node; past the top node, the top share
    falls linearly in log length to 0 at the longest prompt (the segment extended where that is unknown:
    a log-normal's tail never ends, and read past prompts no window had it cost 5% on a trace clipped at
    8k tokens, bench/results/late_share.md).

    Counting a node late whole would make the 1% of prompts the top node stands for (the whole miss budget
    of a 99% SLO) miss or not as its length crosses p*: a few prompts in a window then flip a flavor's
    capacity 10-20x between periods (bench/results/late_share.md)."""
    col = np.newaxis
    b = np.maximum(budget, 0.0)
    p_star = 2.0 * b / (per_token + np.sqrt(per_token * per_token + 4.0 * rows.quad_s * b))
    log_star = np.log(np.maximum(p_star, 1e-300))
    m, n = rows.log_prompt.shape
    # The nodes at or below p*, counted by a matmul: a boolean sum along the short axis is 3x slower.
    below = (rows.log_prompt <= log_star[:, col]).astype(np.float64) @ np.ones(n)
    k = np.clip(below, 1, n - 1).astype(np.intp)  # p* is in the segment [k-1, k]
    flat = rows.log_prompt.ravel()
    at = np.arange(m) * n + k
    lo, hi = flat[at - 1], flat[at]
    z_lo, z_hi = Z_NODES[k - 1], Z_NODES[k]
    z = z_lo + (log_star - lo) * (z_hi - z_lo) / np.maximum(hi - lo, 1e-9)
    top = rows.log_prompt[:, -1]
    end = np.maximum(rows.log_prompt_end, top)
    with np.errstate(invalid="ignore"):  # inf - inf where the end is unknown: the where below drops it
        to_end = TOP_SHARE * np.clip((end - log_star) / np.maximum(end - top, 1e-9), 0.0, 1.0)
    share = np.where((log_star >= top) & np.isfinite(end), to_end, ndtr(-z))
    return np.asarray(np.where(budget <= 0, 1.0, share))


def at_load(rows: Rows, batch: F64, alone: bool = False) -> Load:
    """Arrival rate and SLO misses of one replica running ``batch`` sequences on average; ``alone``: the
    replica is its deployment's only one (module docstring).

    Moments over the length nodes are taken from make_rows' sums wherever the load enters only as a
    per-row factor; what is left per node is the two tails."""
    col = np.newaxis
    s, tpot_mean, rate = _means(rows, batch)
    # Prefill as a server: a prompt holds it for its engine time plus the decode share of its chunk
    # iterations, serve = engine + p*c; its first two moments follow from the rows' sums.
    c = s / rows.chunk
    rho = rate * (rows.ex + c * rows.p1)
    stable = rho < 1.0
    rho = np.minimum(rho, 1.0 - 1e-9)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        wait_mean = rate * (rows.ex2 + 2.0 * c * rows.ep + c * c * rows.p2) / (2.0 * (1.0 - rho))
        # TTFT: own prefill (and its chunks' decode share) within the target, then an exponential wait tail.
        budget = rows.ttft_slo / rows.corr_ttft - rows.overhead_s
        slack = (budget[:, col] - rows.prefill) - rows.prompt * c[:, col]
        decay = (rho / np.maximum(wait_mean, 1e-300))[:, col]
        waits = np.where(slack <= 0, 0.0, np.exp(-decay * np.maximum(slack, 0.0)))
        late = late_share(rows, budget, 1.0 / rows.prefill_tokens_per_s + c)
        # Two estimates of overlapping sets (the prompts too long to prefill in time, read off the mix's
        # quantile function; the waits, over the length nodes): their sum can pass 1 near saturation.
        ttft_miss = np.minimum(late + rho ** (1 if alone else ROUTER_CHOICES) * _mean(waits), 1.0)
        # TPOT: prompts prefilled during this request's decode, at the rate the router sends to a busy replica.
        # Their count over the request's gaps is Poisson(lam); the stall given at least one is log-normal
        # with the compound sum's mean m1 = lam*E/some and E[S^2]/m1^2 = some*(1 + cv/lam). The budget is
        # (SLO - s) per gap, so budget/m1 = some * (SLO - s) / (arrivals per gap * E): the gaps cancel.
        spare = rows.tpot_slo / rows.corr_tpot - s  # stall one gap can absorb
        if alone:
            lam, ratio = _alone_arrivals(rows, rate, s, rho, wait_mean, c, spare)
        else:
            per_gap = rate * np.minimum(batch, 1.0) ** (ROUTER_CHOICES - 1) * tpot_mean
            lam = per_gap[:, col] * rows.gaps
            ratio = (spare / (per_gap * rows.ex))[:, col]
        some = -np.expm1(-lam)  # P(at least one prompt)
        sig2 = np.maximum(np.log(some * (1.0 + rows.cv[:, col] / lam)), 1e-12)
        ln_ratio = np.log(some * ratio)
        tail = some * ndtr(-(ln_ratio + 0.5 * sig2) / np.sqrt(sig2))
        # A gap stalls at most one chunk: a stall can break a TPOT only in a step whose own decode leaves less
        # room than a chunk, i.e. one running more than k* sequences. The sequences decoding on a replica
        # are Poisson with mean b (an M/G/inf occupancy), so that is P(K > k*), not a step at the mean load:
        # the mean would make capacity fall off a cliff at b = k*, and a p95 taken where the batch peaks
        # would read as a slow profile and push every later estimate over it.
        k_star = (rows.tpot_slo / rows.corr_tpot - rows.alpha - rows.chunk_s) / np.maximum(rows.beta, 1e-12)
        over = np.where(k_star < 1.0, 1.0, pdtrc(np.floor(np.maximum(k_star, 0.0)), batch))
        per_node = np.where(rows.gaps <= 0, 0.0, np.where((spare <= 0)[:, col], 1.0, over[:, col] * tail))
    tpot_miss = _mean(per_node)
    return Load(batch, rate, tpot_mean, np.where(stable, ttft_miss, 1.0), np.where(stable, tpot_miss, 1.0))


def _alone_arrivals(rows: Rows, rate: F64, s: F64, rho: F64, wait_mean: F64, c: F64, spare: F64) -> tuple[F64, F64]:
    """(rows, nodes): for a replica alone, the prompts prefilled during a request's decode (those that came
    while it waited and prefilled, and while it decodes at s + rho * chunk a step), and the stall one gap
    can absorb over their mean stall a gap."""
    col = np.newaxis
    before = wait_mean[:, col] + rows.prefill + rows.prompt * c[:, col]
    lam = rate[:, col] * (before + rows.gaps * (s + rho * rows.chunk_s)[:, col])
    return lam, spare[:, col] * np.maximum(rows.gaps, 1e-9) / (lam * rows.ex[:, col])


# Loads (and TPOT thresholds) are found to this relative width: the grid the old search used gave ~1.3%.
RTOL = 0.01
MAX_STEPS = 40  # false position with the Illinois rule converges in under 10 steps; this only bounds it


def _rows(columns: dict[str, F64]) -> Rows:
    """A Rows without its frozen ``__init__``, whose ``object.__setattr__`` per column would cost a search
    step on a few rows more than its arithmetic."""
    return cast(Rows, frozen_without_init(Rows, columns))


def subset(rows: Rows, idx: npt.NDArray[np.intp]) -> Rows:
    """The rows at ``idx``, in that order (an index may repeat: one call then evaluates several points);
    ``rows`` itself where ``idx`` is every row in order (a warm search's first call, most often)."""
    n = len(rows.ttft_slo)
    if len(idx) == n and (n == 0 or (idx[0] == 0 and idx[-1] == n - 1 and bool((np.diff(idx) == 1).all()))):
        return rows
    return _rows({k: v[idx] for k, v in vars(rows).items()})


_Search = Callable[[Rows, F64, npt.NDArray[np.intp]], F64]


def _crossing(rows: Rows, lo: F64, hi: F64, g: _Search, slope: float | None = None,
              guess: F64 | None = None) -> tuple[F64, F64]:
    """Per row, a bracket [a, b] within [lo, hi], b/a - 1 <= RTOL, with g(a) <= 0 < g(b) for a ``g`` that
    grows with x (given the rows, the points and the rows' indices); (lo, lo) where g(lo) > 0 and (hi, hi)
    where g(hi) <= 0.

    Illinois false position, rows leaving as they converge: 5-8 evaluations per row, where a grid to the
    same width takes 64 (on 1,400 rows that is 20 ms against 250; on the simulator's 18, the calls' fixed
    cost dominates either way). ``slope``: g's least slope in log x, when known; the first step then
    extrapolates from lo with it, a far better guess than the chord of a g that is steep only near hi.

    ``guess``: per row, a point near the crossing (where it was last period; NaN or <= 0: none). The search
    then evaluates the guess, and one RTOL-wide step from it towards the crossing. A control loop's inputs
    move little between periods, so that usually brackets the crossing and the search ends after two calls
    on the rows, not 6-9; and with the guess itself an end of the bracket, a crossing that did not move
    returns the same answer, not one that drifts by a step per period. A guess that misses still narrows
    the bracket, and either way the answer is to RTOL."""
    n = len(lo)
    a, b = np.log(lo), np.log(np.maximum(hi, lo))
    if guess is None:
        every = np.arange(n)
        ends = g(subset(rows, np.concatenate([every, every])), np.exp(np.concatenate([a, b])),
                 np.concatenate([every, every]))
        ga, gb = ends[:n], ends[n:]
    else:
        ga, gb = _bracket_guess(rows, g, guess, a, b)
    fails, fits = ga > 0, gb <= 0
    a = np.where(fits, b, a)
    b = np.where(fails, a, b)
    _false_position(rows, g, slope, a, b, ga, gb, np.flatnonzero(~fails & ~fits & (b - a > math.log1p(RTOL))))
    # The ends exactly, not exp(log(x)): a batch bounded by KV cache stays a whole number of sequences.
    lo_x = np.where(fits, hi, np.where(fails, lo, np.exp(a)))
    hi_x = np.where(fits, hi, np.where(fails, lo, np.exp(b)))
    return lo_x, hi_x


def _bracket_guess(rows: Rows, g: _Search, guess: F64, a: F64, b: F64) -> tuple[F64, F64]:
    """g at the guess where it lies inside [a, b] (log x), then one step from it towards the crossing (up
    where g(guess) <= 0, down where above), and at the ends of the other rows; at a guessed row's far end
    only where its two points lie on one side of the crossing (g grows with x, so an end outside a bracket
    cannot change it). A guess at or past b (last period's answer was the cap: KV cache, max_num_seqs) is
    taken at b: where g(b) <= 0 still the row is done after one evaluation (in a 1,000-model fleet, two rows
    in five), else it is searched from its idle end, as without a guess. In a control loop most rows are
    bracketed by their two points: two evaluations a row, in two calls. Narrows a and b in place to the
    points that bracket the crossing; returns (g(a), g(b))."""
    n = len(a)
    with np.errstate(divide="ignore", invalid="ignore"):
        mid = np.log(guess)
    d = 0.98 * math.log1p(RTOL)  # a step: a bracket of two neighbouring points is within the tolerance
    seen = np.isfinite(mid) & (mid > a) & (b > a)
    mid = np.where(seen, np.minimum(mid, b), mid)
    near, far = np.flatnonzero(seen), np.flatnonzero(~seen)
    f = len(far)
    at = np.concatenate([far, far, near])
    vals = g(subset(rows, at), np.exp(np.concatenate([a[far], b[far], mid[near]])), at)
    ga, gb = np.zeros(n), np.zeros(n)
    ga[far], gb[far] = vals[:f], vals[f : 2 * f]
    m, gm = mid[near], vals[2 * f :]
    top = m >= b[near]
    capped, dropped = top & (gm <= 0), top & (gm > 0)  # within the SLO at the cap: the answer is the cap
    r = near[capped]
    a[r], ga[r], gb[r] = b[r], gm[capped], gm[capped]
    # The cap no longer holds: searched from the idle end, as a row without a guess is, so its answer is the
    # one the search gave before guesses at the cap were taken there (a rare row: a capped replica's load grew).
    dropped_at = near[dropped]
    gb[dropped_at] = gm[dropped]
    near, m, gm = near[~top], m[~top], gm[~top]
    up = gm <= 0
    x = np.where(up, np.minimum(m + d, b[near]), np.maximum(m - d, a[near]))  # next to an end: onto it
    gx = g(subset(rows, near), np.exp(x), near)
    above = gx > 0
    # g grows with x: a point at or below zero is a lower end, one above an upper end.
    step_up, step_down = up & above, ~up & ~above  # the crossing between the guess and its step
    r = near[step_up]
    a[r], ga[r], b[r], gb[r] = m[step_up], gm[step_up], x[step_up], gx[step_up]
    r = near[step_down]
    a[r], ga[r], b[r], gb[r] = x[step_down], gx[step_down], m[step_down], gm[step_down]
    hi_at, lo_at = near[up & ~above], near[~up & above]  # both points below the crossing, or both above
    a[hi_at], ga[hi_at] = x[up & ~above], gx[up & ~above]
    b[lo_at], gb[lo_at] = x[~up & above], gx[~up & above]
    lo_at = np.concatenate([lo_at, dropped_at])
    if lo_at.size or hi_at.size:
        ends_at = np.concatenate([lo_at, hi_at])
        ends = g(subset(rows, ends_at), np.exp(np.concatenate([a[lo_at], b[hi_at]])), ends_at)
        ga[lo_at], gb[hi_at] = ends[: len(lo_at)], ends[len(lo_at) :]
    return ga, gb


def _false_position(rows: Rows, g: _Search, slope: float | None, a: F64, b: F64, ga: F64, gb: F64,
                    act: npt.NDArray[np.intp]) -> None:
    """Illinois false position on the rows ``act`` until each bracket [a, b] (log x) is RTOL wide; narrows
    a, b and their g values in place."""
    moved = np.zeros(len(a), dtype=np.int8)  # which end the last step moved: -1 a, +1 b
    tol = math.log1p(RTOL)
    for step in range(MAX_STEPS):
        if act.size == 0:
            break
        A, B, GA, GB, M = a[act], b[act], ga[act], gb[act], moved[act]
        w = B - A
        if step == 0 and slope:
            x = A - GA / slope
        else:  # the chord in x itself: near the crossing g is close to linear in the load, not its log
            ea, eb = np.exp(A), np.exp(B)
            x = np.log(np.maximum(ea - GA * (eb - ea) / (GB - GA), ea))
        x = np.clip(x, A + 0.01 * w, B - 0.01 * w)  # strictly inside, so both ends move
        gx = g(subset(rows, act), np.exp(x), act)
        left = gx <= 0
        # Illinois: an end kept twice in a row counts half, so a convex g cannot pin it.
        GA, GB = np.where(~left & (M > 0), 0.5 * GA, GA), np.where(left & (M < 0), 0.5 * GB, GB)
        a[act], ga[act] = np.where(left, x, A), np.where(left, gx, GA)
        b[act], gb[act] = np.where(left, B, x), np.where(left, GB, gx)
        moved[act] = np.where(left, -1, 1)
        act = act[(b[act] - a[act]) > tol]


def _log_share(x: F64) -> F64:
    return np.log(np.maximum(x, 1e-300))


def largest_load(rows: Rows, high: F64, allowed_miss: float | F64, guess: F64 | None = None,
                 alone: bool = False) -> F64:
    """Per row, the largest mean batch in [LOAD_FLOOR, high] whose miss share is within ``allowed_miss``
    (one share for all rows, or one per row; misses grow with load), to RTOL; 0 for rows that miss more
    even at LOAD_FLOOR. ``guess``: per row, last period's answer (NaN: none), where the search starts
    (_crossing); ``alone``: each row's replica is its deployment's only one (at_load)."""
    limit = np.broadcast_to(np.log(np.asarray(allowed_miss, dtype=float)), np.shape(high))

    def g(r: Rows, b: F64, idx: npt.NDArray[np.intp]) -> F64:
        return _log_share(at_load(r, b, alone).miss) - limit[idx]

    # An idle replica's misses grow as the square of its load (rho^2 waits; prompts arriving during a decode
    # at a rate times a share of busy replicas) and faster near saturation: slope 2 in log-log to begin.
    floor = np.full(len(high), LOAD_FLOOR)
    lo, hi = _crossing(rows, floor, np.maximum(high, LOAD_FLOOR), g, slope=2.0, guess=guess)
    return np.where((lo == floor) & (hi == floor), 0.0, lo)  # (lo, lo): even the idle end misses


def tpot_quantile(rows: Rows, batch: F64, q: float = 0.95, guess: F64 | None = None) -> F64:
    """Per row, the per-request TPOT that a share ``q`` of the requests with more than one output token stay
    within at this load (to RTOL): what a window's TPOT p95 should read if the profile is right.
    ``guess``: per row, last period's answer (NaN: none), where the search starts (_crossing)."""
    multi = _mean(rows.output > 1.0)
    limit = _log_share((1.0 - q) * multi + 1e-15)
    s = rows.corr_tpot * _means(rows, batch)[0]

    def g(r: Rows, t: F64, idx: npt.NDArray[np.intp]) -> F64:
        # Grows with the threshold t: positive once no more than 1-q of the requests miss it.
        return limit[idx] - _log_share(at_load(_rows({**vars(r), 'tpot_slo': t}), batch[idx]).tpot_miss)

    _, hi = _crossing(rows, s, s + 60.0, g, guess=guess)  # no stall .. a minute per token
    return hi
