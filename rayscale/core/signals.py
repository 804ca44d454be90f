"""What the core is told about load: one window of aggregated signals per model (plain data).

The observe shell (rayscale.signals) builds these from engine and Serve metrics; the simulator builds
them from its own clock. ``None`` means "not observed" and is never read as zero.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np


class Freshness(StrEnum):
    FRESH = "fresh"
    STALE = "stale"  # the source answered before, but not within the staleness limit
    MISSING = "missing"  # never observed (or source down since start)


# Quantile bins of a mix's length distributions, as (probability of the node, weight): tail-weighted, so
# that the 1% of requests an SLO of 99% attainment may miss is resolved at both ends (the longest prompts
# miss TTFT, the shortest answers miss TPOT). Weights are the bins' widths between edges 0, 1, 5, 15, 35,
# 65, 85, 95, 99, 100%.
MIX_BIN_EDGES = (0.0, 0.01, 0.05, 0.15, 0.35, 0.65, 0.85, 0.95, 0.99, 1.0)
MIX_QUANTILES = tuple((a + b) / 2 for a, b in itertools.pairwise(MIX_BIN_EDGES))
MIX_WEIGHTS = tuple(b - a for a, b in itertools.pairwise(MIX_BIN_EDGES))


def length_quantiles(lengths: Sequence[float] | np.ndarray) -> tuple[float, ...]:
    """A sample's lengths at MIX_QUANTILES (numpy's linear interpolation); the sample must not be empty."""
    return tuple(np.quantile(np.asarray(lengths, dtype=float), MIX_QUANTILES).tolist())


@dataclass(frozen=True)
class RequestMix:
    """Token lengths of a model's requests over the window.

    ``prompt_quantiles`` / ``output_quantiles``: the lengths at MIX_QUANTILES (from the window's requests,
    or the engine's token histograms), when known; the estimator's tail terms read them, and fall back to a
    log-normal through the mean (and p95) when they are not. ``prompt_max``: the window's longest prompt,
    where the prompt tail ends (None: not known, and the tail past the top node is extrapolated)."""

    prompt_mean: float
    output_mean: float
    prompt_p95: float
    prompt_quantiles: tuple[float, ...] | None = None
    output_quantiles: tuple[float, ...] | None = None
    prompt_max: float | None = None

    def __post_init__(self) -> None:
        for name in ("prompt_quantiles", "output_quantiles"):
            q = getattr(self, name)
            if q is not None and len(q) != len(MIX_QUANTILES):
                raise ValueError(f"RequestMix.{name}: expected {len(MIX_QUANTILES)} lengths at {MIX_QUANTILES}, "
                                 f"got {len(q)}")

    @staticmethod
    def default() -> RequestMix:
        # Used only before the first request is seen; deliberately long-ish so capacity is not overstated.
        return RequestMix(prompt_mean=1024.0, output_mean=128.0, prompt_p95=4096.0)


@dataclass(frozen=True)
class FlavorObservation:
    """Observed latency of a model's replicas on one flavor, for correcting its profile."""

    replicas: int
    running_per_replica: float | None = None
    # The busiest replica's running sequences, averaged over the window: TPOT p95 comes from the busiest
    # replicas, so an uneven spread (a cold new replica) must not read as a slow profile. None: unknown.
    running_max_replica: float | None = None
    ttft_p95_s: float | None = None
    tpot_p95_s: float | None = None
    prompt_mean: float | None = None
    # Requests that finished in the window (the latency quantiles' sample size); None: not known.
    completed: float | None = None
    # Mean seconds from being scheduled to the first token (vLLM's request_prefill_time_seconds): TTFT
    # without the queue, so a backlog does not read as a slow flavor. None: not known.
    prefill_mean_s: float | None = None
    # Prompt tokens these replicas found in their prefix caches over those looked up (vLLM's
    # prefix_cache_hits / prefix_cache_queries). None: not observed.
    prefix_hit_rate: float | None = None
    # The share of these replicas' KV caches in use (vLLM's kv_cache_usage_perc, their mean), read with
    # running_per_replica: the KV tokens a running sequence holds (Correction.kv). None: not known.
    kv_usage: float | None = None


@dataclass(frozen=True)
class ModelSignals:
    model: str
    freshness: Freshness
    age_s: float | None = None  # seconds since the newest sample; None when missing
    arrival_rate_rps: float | None = None
    mix: RequestMix | None = None
    # Requests queued anywhere before an engine runs them: in the engines' queues, in Serve's routers (every
    # replica at max_ongoing_requests) and in the ingress before a first byte (rayscale.signals.window).
    waiting: float | None = None
    running: float | None = None
    ttft_p95_s: float | None = None
    tpot_p95_s: float | None = None
    kv_usage: float | None = None  # 0..1, max over replicas
    per_flavor: dict[str, FlavorObservation] = field(default_factory=dict)
    rate_history: tuple[float, ...] = ()  # arrival rate per past window, oldest first, for forecasting
    # Arrivals per arrival_bin_s-long bin, oldest first (the last hour): the bursts within the minute that
    # rayscale.core.burst sizes for (empty: not observed, no burst floor).
    arrival_counts: tuple[float, ...] = ()
    arrival_bin_s: float = 0.0
    # Requests the ingress accepted and has not finished (queued anywhere or running), from the ingress's own
    # metrics, which do not go missing when the engines' do. None: not observed.
    in_flight: float | None = None
    # TTFT p95 as clients see it: from arrival at the ingress to the first byte, queues in Serve included.
    client_ttft_p95_s: float | None = None
    # Prompt tokens the engines found in their prefix caches over those they looked up, over the window
    # (vLLM's prefix_cache_hits / prefix_cache_queries). None: not observed (caching off, no lookups).
    prefix_hit_rate: float | None = None
    # Requests that finished in the window and the share of them that met both SLO targets (TTFT as clients
    # see it where the ingress reports it): what the fleet delivered (rayscale.core.feedback). None: unknown.
    finished: float | None = None
    slo_met: float | None = None

    @property
    def usable(self) -> bool:
        return self.freshness == Freshness.FRESH and self.arrival_rate_rps is not None

    @property
    def backlog(self) -> float:
        """Requests visibly waiting or in flight (0 when neither is observed): load, whatever the engines'
        metrics say."""
        return max(self.waiting or 0.0, self.in_flight or 0.0)
