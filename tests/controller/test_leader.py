"""A controller replica that does not hold the Lease changes nothing; it acts from the period it holds it."""

from __future__ import annotations

from typing import Any

from rayscale.config import load_catalog
from rayscale.controller.loop import Controller, ControllerConfig
from rayscale.core.settings import Settings


def test_only_the_holder_reconciles_and_a_standby_takes_over_when_it_gets_the_lease() -> None:
    cat = load_catalog().subset(["mistral-7b"], ["a10g"])
    none: Any = None
    held = {"a": True, "b": False}
    calls: dict[str, int] = {"a": 0, "b": 0}
    waits: dict[str, int] = {"a": 0, "b": 0}
    ctls = {}
    for name in ("a", "b"):
        c = Controller(cat, none, none, none, ControllerConfig(Settings(period_s=0.01)),
                       leader=lambda name=name: held[name])
        c.reconcile = lambda name=name: calls.__setitem__(name, calls[name] + 1)  # type: ignore[method-assign,assignment,misc]
        c.on_standby(lambda name=name: waits.__setitem__(name, waits[name] + 1))  # type: ignore[misc]
        ctls[name] = c
    for c in ctls.values():
        c.run(duration_s=0.2)
    assert calls["a"] > 5 and calls["b"] == 0
    assert waits["a"] == 0 and waits["b"] > 5  # the standby says so every period (its metrics go quiet)
    held.update(a=False, b=True)  # a lost the Lease (it could not renew); b took it over
    before = calls["a"]
    for c in ctls.values():
        c.run(duration_s=0.2)
    assert calls["a"] == before and calls["b"] > 5
