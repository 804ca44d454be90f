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
  few tokens, so they miss first.
- TTFT is the request's own prefill plus a wait behind prompts already prefilling: an M/G/1 queue
  (Pollaczek-Khinchine mean wait, exponential tail).
- Ray Serve's router samples two replicas and takes the less loaded (power of two choices), so a request
  lands on a busy replica only when both samples are busy: it waits to prefill with probability rho^2, not
  rho, and a decoding request sees new prompts at lambda * min(b, 1): the router keeps replicas evenly
  loaded, so min(b, 1) of them are busy, and an arrival joins a busy one only when both samples are.

Lengths enter as quantile nodes of the mix (RequestMix.prompt_quantiles / output_quantiles, weighted by
MIX_WEIGHTS), so the model sees the distribution's shape, not only its mean. bench/capacity_error.py checks
it against the simulated engine per flavor and trace. Everything is numpy over rows (one row per
(profile, SLO, mix, correction)) and each row's result depends on that row alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from statistics import NormalDist

import numpy as np
import numpy.typing as npt
from scipy.special import ndtr

from rayscale.core.signals import MIX_QUANTILES, MIX_WEIGHTS, RequestMix

F64 = npt.NDArray[np.float64]

# vLLM's max_num_batched_tokens for online serving: prompt tokens one engine iteration carries beside decodes.
CHUNK_TOKENS = 2048
ROUTER_CHOICES = 2  # Ray Serve's request router: power of two choices
# Log-normal spread of output lengths when the mix has no quantiles (chat and code traces: 0.9-1.0).
OUTPUT_SIGMA = 1.0
LOAD_FLOOR = 1e-3  # sequences per replica: the idle end of the search

_Z95 = NormalDist().inv_cdf(0.95)
_Z = tuple(NormalDist().inv_cdf(u) for u in MIX_QUANTILES)
WEIGHTS = np.array(MIX_WEIGHTS)


def lognormal_quantiles(mean: float, p95: float | None, sigma: float = OUTPUT_SIGMA) -> tuple[float, ...]:
    """Lengths at MIX_QUANTILES of the log-normal with this mean and 95th percentile (``sigma`` without one).

    The spread solves mean * exp(z95*s - s^2/2) = p95 for its smaller root; a p95 beyond e^(z95^2/2) = 3.9x
    the mean has none, and takes the largest spread that has one."""
    if p95 is not None:
        r = math.log(max(p95, mean) / mean)
        d = _Z95 * _Z95 - 2.0 * r
        sigma = _Z95 - math.sqrt(d) if d > 0 else _Z95
    mu = math.log(mean) - sigma * sigma / 2.0
    return tuple(math.exp(mu + sigma * z) for z in _Z)


# A log-normal's far tail has prompts past any model's context; observed mixes end near their p95 (Azure
# code: p99 = 1.02 x p95; the generated traces, clipped at 8k: 1.5x). The fallback stops there.
PROMPT_TAIL_CAP = 1.5


def mix_quantiles(mix: RequestMix) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(prompt, output) lengths at MIX_QUANTILES: the mix's own, else a log-normal through its mean and p95
    (prompts, at most PROMPT_TAIL_CAP x the p95) or its mean (outputs, spread OUTPUT_SIGMA)."""
    cap = PROMPT_TAIL_CAP * max(mix.prompt_p95, mix.prompt_mean)
    prompt = mix.prompt_quantiles or tuple(min(x, cap) for x in lognormal_quantiles(max(mix.prompt_mean, 1.0),
                                                                                      mix.prompt_p95))
    output = mix.output_quantiles or lognormal_quantiles(max(mix.output_mean, 1.0), None)
    return prompt, tuple(max(o, 1.0) for o in output)


@dataclass(frozen=True)
class Rows:
    """Column arrays, one row per (profile, SLO, mix, correction); ``prompt``/``output`` are (rows, nodes)."""

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
    prompt: F64
    output: F64


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


def at_load(rows: Rows, batch: F64) -> Load:
    """Arrival rate and SLO misses of one replica running ``batch`` sequences on average."""
    col = np.newaxis
    r, quad = rows.prefill_tokens_per_s[:, col], rows.quad_s[:, col]
    p, o = rows.prompt, rows.output
    s = rows.alpha + rows.beta * np.maximum(batch, 1.0)  # one decode iteration
    engine = rows.seq_s[:, col] + p / r + quad * p * p  # what a prompt costs the iterations it shares
    ex = (engine * WEIGHTS).sum(axis=1)
    ex2 = (engine * engine * WEIGHTS).sum(axis=1)
    tpot_mean = rows.corr_tpot * (s + batch * ex / rows.output_mean)
    rate = batch / (rows.output_mean * tpot_mean)
    # Prefill as a server: a prompt holds it for its engine time plus the decode share of its chunk iterations.
    per_chunk = (s / CHUNK_TOKENS)[:, col]
    serve = engine + p * per_chunk
    rho = rate * (serve * WEIGHTS).sum(axis=1)
    stable = rho < 1.0
    rho = np.minimum(rho, 1.0 - 1e-9)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        wait_mean = rate * (serve * serve * WEIGHTS).sum(axis=1) / (2.0 * (1.0 - rho))
        own = rows.overhead_s[:, col] + p / r + quad * p * p + p * per_chunk
        slack = (rows.ttft_slo / rows.corr_ttft)[:, col] - own
        waits = (rho ** ROUTER_CHOICES)[:, col] * np.exp(-(rho / wait_mean)[:, col] * np.maximum(slack, 0.0))
        ttft_miss = (np.where(slack <= 0, 1.0, np.nan_to_num(waits)) * WEIGHTS).sum(axis=1)
        # TPOT: prompts prefilled during this request's decode, at the rate the router sends to a busy replica.
        gaps = o - 1.0
        arrivals = (rate * np.minimum(batch, 1.0) ** (ROUTER_CHOICES - 1) * tpot_mean)[:, col] * gaps
        budget = (rows.tpot_slo / rows.corr_tpot - s)[:, col] * gaps  # stall this request can absorb
        some = -np.expm1(-arrivals)  # P(at least one prompt)
        m1 = arrivals * ex[:, col] / some
        m2 = (arrivals * ex2[:, col] + arrivals * arrivals * (ex * ex)[:, col]) / some
        sig2 = np.log1p(np.maximum(m2 - m1 * m1, 0.0) / (m1 * m1))
        z = (np.log(budget) - np.log(m1) + sig2 / 2.0) / np.sqrt(sig2)
        tail = some * np.where(sig2 > 0, ndtr(-z), (budget < m1).astype(float))
        per_node = np.where(gaps <= 0, 0.0, np.where(budget <= 0, 1.0, np.nan_to_num(tail)))
    tpot_miss = (per_node * WEIGHTS).sum(axis=1)
    return Load(batch, rate, tpot_mean, np.where(stable, ttft_miss, 1.0), np.where(stable, tpot_miss, 1.0))


GRID = 32  # loads (or thresholds) per row evaluated in one call; two rounds resolve a 5e5 range to ~1.3%


def _tile(rows: Rows, k: int) -> Rows:
    """Every row repeated k times in place (row i becomes rows i*k .. i*k+k-1): one call evaluates a grid."""
    return Rows(*(np.repeat(getattr(rows, f.name), k, axis=0) for f in fields(Rows)))


def _last_within(rows: Rows, lo: F64, hi: F64, ok_at: Callable[[Rows, F64], npt.NDArray[np.bool_]]
                 ) -> tuple[F64, F64]:
    """Per row, the bracket [x_i, x_i+1] of a log grid over [lo, hi] around the last point where ``ok_at``
    holds (it holds below some point and fails above it); lo when it fails everywhere."""
    n = len(lo)
    steps = np.linspace(0.0, 1.0, GRID)
    xs = np.exp(np.log(lo)[:, np.newaxis] + (np.log(hi) - np.log(lo))[:, np.newaxis] * steps)  # (n, GRID)
    xs[:, 0], xs[:, -1] = lo, hi  # the ends exactly, not exp(log(x))
    ok = ok_at(_tile(rows, GRID), xs.ravel()).reshape(n, GRID)
    last = np.where(ok.any(axis=1), GRID - 1 - np.argmax(ok[:, ::-1], axis=1), 0)
    nxt = np.minimum(last + 1, GRID - 1)
    at = np.arange(n)
    return xs[at, last], xs[at, nxt]


def largest_load(rows: Rows, high: F64, allowed_miss: float) -> F64:
    """Per row, the largest mean batch in [LOAD_FLOOR, high] whose miss share is within ``allowed_miss``
    (misses grow with load), to ~1.3%; rows that miss more even at LOAD_FLOOR get LOAD_FLOOR (the caller
    checks). Two rounds of a log grid, each one numpy call over rows x GRID."""
    def ok_at(r: Rows, b: F64) -> npt.NDArray[np.bool_]:
        return np.asarray(at_load(r, b).miss <= allowed_miss)

    high = np.maximum(high, LOAD_FLOOR)
    lo, hi = _last_within(rows, np.full(len(high), LOAD_FLOOR), high, ok_at)
    lo, _ = _last_within(rows, lo, np.maximum(hi, lo), ok_at)
    return lo


def tpot_quantile(rows: Rows, batch: F64, q: float = 0.95) -> F64:
    """Per row, the per-request TPOT that a share ``q`` of the requests with more than one output token stay
    within at this load (to ~1%): what a window's TPOT p95 should read if the profile is right."""
    multi = (np.where(rows.output > 1.0, 1.0, 0.0) * WEIGHTS).sum(axis=1)
    s = rows.corr_tpot * (rows.alpha + rows.beta * np.maximum(batch, 1.0))

    def above(r: Rows, t: F64) -> npt.NDArray[np.bool_]:
        # "ok" while the threshold is still below the quantile: more than 1-q of them miss it.
        k = len(t) // len(batch)
        at = at_load(replace(r, tpot_slo=t), np.repeat(batch, k))
        return np.asarray(at.tpot_miss > (1.0 - q) * np.repeat(multi, k) + 1e-15)

    lo, hi = _last_within(rows, s, s + 60.0, above)  # no stall .. a minute per token
    _, hi = _last_within(rows, lo, np.maximum(hi, lo), above)
    return np.asarray(hi)
