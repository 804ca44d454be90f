"""What the core is told about load: one window of aggregated signals per model (plain data).

The observe shell (rayscale.signals) builds these from engine and Serve metrics; the simulator builds
them from its own clock. ``None`` means "not observed" and is never read as zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Freshness(StrEnum):
    FRESH = "fresh"
    STALE = "stale"  # the source answered before, but not within the staleness limit
    MISSING = "missing"  # never observed (or source down since start)


@dataclass(frozen=True)
class RequestMix:
    """Token lengths of a model's requests over the window."""

    prompt_mean: float
    output_mean: float
    prompt_p95: float

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


@dataclass(frozen=True)
class ModelSignals:
    model: str
    freshness: Freshness
    age_s: float | None = None  # seconds since the newest sample; None when missing
    arrival_rate_rps: float | None = None
    mix: RequestMix | None = None
    waiting: float | None = None  # requests queued across all replicas
    running: float | None = None
    ttft_p95_s: float | None = None
    tpot_p95_s: float | None = None
    kv_usage: float | None = None  # 0..1, max over replicas
    per_flavor: dict[str, FlavorObservation] = field(default_factory=dict)
    rate_history: tuple[float, ...] = ()  # arrival rate per past window, oldest first, for forecasting

    @property
    def usable(self) -> bool:
        return self.freshness == Freshness.FRESH and self.arrival_rate_rps is not None
