"""Ready means ready: which models a replica can serve now, and holding the requests of those it cannot.

A model is ready when at least one replica of one of its flavor deployments is RUNNING in Serve. Serve marks
a replica RUNNING only once its constructor returned and its first health check passed (Ray Serve LLM's
``LLMServer`` starts its engine in the constructor), and routes only to running replicas, so RUNNING is
"can serve". The states come from Serve's public ``serve.status()``, read off the event loop every
``poll_s``. A replica on a draining node (PENDING_MIGRATION) still serves until its replacement runs.

Until a model is ready (its first replica starting, or scaled to zero) the ingress does not list it and
holds its requests: at most ``max_requests`` per model, each at most ``timeout_s``; past either the client
gets 503 with Retry-After. The held count is exported per model (``HELD``) so that the controller sees
the demand of a model no engine reports for (rayscale.signals.window).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rayscale.serve.errors import ApiError

# Exported by Ray as HELD_EXPORTED; its prefix is the ingress's (rayscale.serve.metrics.INGRESS_PREFIX), so
# the controller's scraper keeps it with the other ingress series.
HELD = "rayscale_ingress_requests_held"
HELD_EXPORTED = "ray_" + HELD
HELD_TAG_KEYS: tuple[str, ...] = ("model", "replica")
# Replica states that take requests.
SERVING_STATES = ("RUNNING", "PENDING_MIGRATION")


@dataclass(frozen=True)
class HoldSettings:
    """How long and how many requests the ingress holds for a model that cannot serve yet (serve config
    ``args.ingress``: hold_max_requests, hold_timeout_s, hold_retry_after_s, readiness_poll_s)."""

    max_requests: int = 256  # per model and ingress replica; 0: answer 503 at once
    timeout_s: float = 300.0
    retry_after_s: float = 10.0
    poll_s: float = 1.0

    @classmethod
    def from_ingress(cls, ingress: Any) -> HoldSettings:
        """From rayscale.serve.config.IngressConfig."""
        return cls(ingress.hold_max_requests, ingress.hold_timeout_s, ingress.hold_retry_after_s,
                   ingress.readiness_poll_s)


def serving_flavors(status: Any, app: str, deployments: Mapping[str, Mapping[str, str]]) -> dict[str, set[str]] | None:
    """Per model, its flavors with at least one replica that serves, from ``serve.status()``;
    ``deployments``: model -> flavor -> Serve deployment name. None when Serve does not know ``app``."""
    app_status = status.applications.get(app)
    if app_status is None:
        return None
    out: dict[str, set[str]] = {}
    for model, flavors in deployments.items():
        out[model] = set()
        for flavor, name in flavors.items():
            dep = app_status.deployments.get(name)
            if dep is not None and any(dep.replica_states.get(s, 0) > 0 for s in SERVING_STATES):
                out[model].add(flavor)
    return out


class ReadinessGate:
    """Per model: the flavors that can serve now, and the requests held until one can (one event loop)."""

    def __init__(self, models: list[str], settings: HoldSettings) -> None:
        self.settings = settings
        self.ready: dict[str, frozenset[str]] = {m: frozenset() for m in models}
        self.held: dict[str, int] = dict.fromkeys(models, 0)
        self._events = {m: asyncio.Event() for m in models}
        self._known = asyncio.Event()  # set by the first successful read of Serve's states

    def update(self, ready: Mapping[str, set[str]]) -> None:
        for model, event in self._events.items():
            self.ready[model] = frozenset(ready.get(model, ()))
            if self.ready[model]:
                event.set()
            else:
                event.clear()
        self._known.set()

    def is_ready(self, model: str) -> bool:
        return bool(self.ready.get(model))

    async def wait_known(self, timeout_s: float) -> bool:
        """Whether Serve's states have been read, waiting up to ``timeout_s`` for the first read."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._known.wait(), timeout_s)
        return self._known.is_set()

    def not_ready(self, model: str, why: str) -> ApiError:
        # Imported here: the controller reads HELD from this module without the ingress's web stack.
        from rayscale.serve.errors import ApiError

        return ApiError(503, f"The model `{model}` has no replica ready to serve it yet ({why}). Retry later.",
                        param="model", retry_after_s=self.settings.retry_after_s)

    async def wait_ready(self, model: str) -> None:
        """Returns once ``model`` can serve; raises the 503 when the hold is full or runs out of time."""
        if self.is_ready(model):
            return
        s = self.settings
        if self.held[model] >= s.max_requests:
            raise self.not_ready(model, f"{self.held[model]} requests are already waiting for one")
        self.held[model] += 1
        try:
            await asyncio.wait_for(self._events[model].wait(), s.timeout_s)
        except TimeoutError:
            raise self.not_ready(model, f"none started within {s.timeout_s:g}s") from None
        finally:
            self.held[model] -= 1

    def ready_weights(self, model: str, weights: Mapping[str, float]) -> dict[str, float]:
        """``weights`` over the flavors that can serve (all of them while none is known to): a request never
        goes to a flavor with no running replica while another flavor has one."""
        ready = self.ready.get(model) or frozenset()
        picked = {f: w for f, w in weights.items() if f in ready}
        return picked or dict(weights)


async def poll_readiness(gate: ReadinessGate, app: str, deployments: Mapping[str, Mapping[str, str]],
                         read_status: Callable[[], Any] | None = None) -> None:
    """Feeds ``gate`` from Serve's replica states forever (a failed read keeps the last known states)."""
    if read_status is None:
        from ray import serve

        read_status = serve.status
    while True:
        with contextlib.suppress(Exception):
            # serve.status() blocks on the Serve controller: off the replica's event loop.
            ready = serving_flavors(await asyncio.to_thread(read_status), app, deployments)
            if ready is not None:
                gate.update(ready)
        await asyncio.sleep(gate.settings.poll_s)


class HeldMetric:
    """The held count per model as a Ray gauge (created in the ingress replica)."""

    def __init__(self, replica: str) -> None:
        from ray.util import metrics as rm

        self.replica = replica
        self._gauge = rm.Gauge(HELD, description="Requests the ingress holds because no replica of their model "
                               "can serve yet (starting, or scaled to zero).", tag_keys=HELD_TAG_KEYS)

    def report(self, held: Mapping[str, int]) -> None:
        for model, n in held.items():
            self._gauge.set(n, tags={"model": model, "replica": self.replica})
