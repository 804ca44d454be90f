"""Run-time flavor weights: how the ingress spreads one model's requests over its flavor deployments.

The controller writes weights (proportional to each flavor's capacity) into one small named actor per
application; every ingress replica polls it, so all replicas route alike without redeploying.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Mapping
from typing import Any

import ray

from rayscale.serve.config import split_route_key

NAMESPACE = "rayscale"


def store_name(app_name: str) -> str:
    return f"rayscale-weights:{app_name}"


@ray.remote(num_cpus=0)
class WeightStore:
    def __init__(self) -> None:
        self._weights: dict[str, dict[str, float]] = {}
        self._version = 0

    def set(self, model: str, weights: dict[str, float]) -> int:
        self._weights[model] = dict(weights)
        self._version += 1
        return self._version

    def get(self, since: int = -1) -> tuple[int, dict[str, dict[str, float]] | None]:
        """(version, weights), or (version, None) when nothing changed since ``since``."""
        if since == self._version:
            return self._version, None
        return self._version, {m: dict(w) for m, w in self._weights.items()}


def get_store(app_name: str) -> Any:
    """The app's weight store, created on first use (detached: it outlives the replica that made it)."""
    return WeightStore.options(  # type: ignore[attr-defined]
        name=store_name(app_name), namespace=NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote()


def validate_weights(weights: Mapping[str, float], flavors: list[str] | None = None) -> dict[str, float]:
    out = {}
    for f, w in weights.items():
        if flavors is not None and f not in flavors:
            raise ValueError(f"unknown flavor {f!r} (known: {flavors})")
        w = float(w)
        if not w >= 0:  # also rejects NaN
            raise ValueError(f"weight of {f!r} must be >= 0, got {w}")
        out[f] = w
    return out


def set_flavor_weights(
    app_name: str, model: str, weights: Mapping[str, float], timeout_s: float = 10.0
) -> int:
    """Set the routing weights of ``model``'s flavors; ingress replicas pick them up within a refresh."""
    return int(ray.get(get_store(app_name).set.remote(model, validate_weights(weights)), timeout=timeout_s))


def delete_store(app_name: str) -> None:
    with contextlib.suppress(ValueError):  # never created
        ray.kill(ray.get_actor(store_name(app_name), namespace=NAMESPACE))


def pick_flavor(weights: Mapping[str, float], rng: random.Random) -> str:
    """A flavor drawn with probability proportional to its weight; all-zero weights mean uniform."""
    names = list(weights)
    total = sum(weights.values())
    if total <= 0:
        return rng.choice(names)
    x = rng.random() * total
    for name in names:
        x -= weights[name]
        if x < 0:
            return name
    return names[-1]


def pick_route(weights: Mapping[str, float], in_flight: Mapping[str, int], rng: random.Random) -> str:
    """The routing key a request goes to: drawn in proportion to ``weights`` (pick_flavor), except that a
    multi-node flavor's gang slots (``{flavor}--slot{k}``) are a Serve deployment each, one replica with its
    own queue, so the request takes, among the drawn slot's siblings that weigh anything, the one with the
    fewest of this ingress's requests in flight (the drawn one among equals): what Serve's router does
    between the replicas of one deployment, which a draw per request would not."""
    key = pick_flavor(weights, rng)
    flavor, slot = split_route_key(key)
    if slot is None:
        return key
    siblings = [k for k, w in weights.items() if w > 0 and split_route_key(k)[0] == flavor]
    return min(siblings, key=lambda k: (in_flight.get(k, 0), k != key), default=key)
