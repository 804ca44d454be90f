"""Routing weights follow the capacity each flavor serves, not its replica count."""

from __future__ import annotations

import pytest

from rayscale.config import load_catalog
from rayscale.core.estimate import estimate
from rayscale.core.route import flavor_weights
from rayscale.core.signals import Freshness, ModelSignals, RequestMix

MIX = RequestMix(prompt_mean=1000, output_mean=200, prompt_p95=3000)


def test_weights_are_replicas_times_per_replica_capacity() -> None:
    cat = load_catalog()
    demands = estimate(cat, {"mistral-7b": ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0, MIX)})
    caps = demands["mistral-7b"].capacity
    assert caps["h100"].rps > caps["a10g"].rps > 0
    w = flavor_weights({("mistral-7b", "a10g"): 2, ("mistral-7b", "h100"): 1, ("mistral-7b", "gone"): 3}, demands)
    assert w["mistral-7b"]["a10g"] == pytest.approx(2 * caps["a10g"].rps, rel=1e-3)
    assert w["mistral-7b"]["h100"] == pytest.approx(caps["h100"].rps, rel=1e-3)
    assert w["mistral-7b"]["gone"] == 0.0  # a deployment the catalog no longer has gets no traffic
    # One H100 replica outweighs one A10G replica: equal per-replica weights would overload the A10G.
    assert w["mistral-7b"]["h100"] > w["mistral-7b"]["a10g"] / 2


def test_a_model_without_demand_gets_zero_weights() -> None:
    assert flavor_weights({("other", "a10g"): 2}, {}) == {"other": {"a10g": 0.0}}


def test_the_controller_pushes_the_weights_of_the_replicas_serving_not_of_its_targets() -> None:
    """A flavor scaling up (Serve told 3, 1 RUNNING) weighs the one that runs: Serve's router queues the
    share of the other two behind it until they start."""
    from typing import Any

    from rayscale.controller.loop import Controller, ControllerConfig
    from rayscale.controller.serve_client import ServeSnapshot

    cat = load_catalog().subset(["mistral-7b"], ["a10g", "l40s"])
    demands = estimate(cat, {"mistral-7b": ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0, MIX)})
    pushed: list[tuple[str, str, dict[str, float]]] = []
    none: Any = None
    ctl = Controller(cat, none, none, none, ControllerConfig(), weights_sink=lambda a, m, w: pushed.append((a, m, w)))
    snap = ServeSnapshot(target={("mistral-7b", "a10g"): 3, ("mistral-7b", "l40s"): 1},
                         running={("mistral-7b", "a10g"): 3, ("mistral-7b", "l40s"): 1},
                         serving={("mistral-7b", "a10g"): 1, ("mistral-7b", "l40s"): 1})
    assert ctl._route(dict(demands), snap) == []
    caps = demands["mistral-7b"].capacity
    (_, model, w), = pushed
    assert model == "mistral-7b"
    assert w["a10g"] == pytest.approx(caps["a10g"].rps, rel=1e-3)
    assert w["l40s"] == pytest.approx(caps["l40s"].rps, rel=1e-3)
    # The other two start: the A10G's weight follows, pushed once more.
    ctl._route(dict(demands), ServeSnapshot(target=snap.target, running=snap.running, serving=snap.target))
    assert len(pushed) == 2 and pushed[1][2]["a10g"] == pytest.approx(3 * caps["a10g"].rps, rel=1e-3)
