"""Scale-up orders: whole replicas of the model's best-value flavor, not the cheapest increment; bounded
by max_replicas, never reported as a shortfall, and (when asked) replacing running worse-value flavors."""

from __future__ import annotations

import pytest

from rayscale.config import load_catalog
from rayscale.core.catalog import CapacityType
from rayscale.core.estimate import estimate
from rayscale.core.plan import PlannerSettings, _flavor_values, plan
from rayscale.core.signals import Freshness, ModelSignals, RequestMix

# Long prompts: inf2's slow prefill makes it the worse value per req/s, but the cheaper single replica.
MIX = RequestMix(2500, 150, 6000)
CAT = load_catalog().subset(["mistral-7b"], ["inf2", "l40s"])
OD, SPOT = "on-demand", "spot"


def _sig(rate: float) -> dict[str, ModelSignals]:
    return {"mistral-7b": ModelSignals("mistral-7b", Freshness.FRESH, 1.0, rate, MIX)}


def _caps() -> dict[str, float]:
    return {f: c.rps for f, c in estimate(CAT, _sig(5.0))["mistral-7b"].capacity.items()}


def test_scale_up_orders_whole_best_value_replicas_not_the_cheapest_increment() -> None:
    caps = _caps()
    # Four L40S run (two on spot: the spot share is full), and demand is 0.3 req/s past them.
    cur = {("mistral-7b", "l40s", OD): 2, ("mistral-7b", "l40s", SPOT): 2}
    rate = 4 * caps["l40s"] + 0.3
    old, _ = plan(CAT, estimate(CAT, _sig(rate)), cur, settings=PlannerSettings(whole_best_replicas=False))
    new, _ = plan(CAT, estimate(CAT, _sig(rate)), cur, settings=PlannerSettings())
    # The cheapest cover of 0.3 req/s alone is one inf2 ($0.76/h against an on-demand L40S at $1.86/h) ...
    assert old.target().get(("mistral-7b", "inf2", OD), 0) == 1
    # ... but per req/s the L40S is the better buy, and the order is rounded up to a whole one.
    assert new.target() == {("mistral-7b", "l40s", OD): 3, ("mistral-7b", "l40s", SPOT): 2}
    assert "whole l40s replicas" in new.entries[0].reason
    assert not new.shortfalls and not old.shortfalls
    assert sum(e.rps_capacity for e in new.entries) >= rate


def test_rounding_stops_at_max_replicas_and_is_never_a_shortfall() -> None:
    caps = _caps()
    cat = CAT.model_copy(update={"models": {"mistral-7b": CAT.models["mistral-7b"].model_copy(
        update={"max_replicas": 5})}})
    cur = {("mistral-7b", "l40s", OD): 2, ("mistral-7b", "l40s", SPOT): 2}
    p, _ = plan(cat, estimate(cat, _sig(4 * caps["l40s"] + 0.3)), cur, settings=PlannerSettings())
    assert sum(p.target().values()) <= 5
    assert not p.shortfalls
    # Demand past what five replicas give is a shortfall of the demand alone, not of the rounding.
    rate = 5 * caps["l40s"] + 1.0
    p, _ = plan(cat, estimate(cat, _sig(rate)), cur, settings=PlannerSettings())
    assert len(p.shortfalls) == 1
    assert p.shortfalls[0].unmet_rps == pytest.approx(rate - sum(e.rps_capacity for e in p.entries), abs=0.01)


def test_flavor_value_blends_spot_by_its_share() -> None:
    l40s = CAT.flavors["l40s"]
    it = l40s.instance_types[0].name
    od, spot = CAT.price("l40s", it, CapacityType.ON_DEMAND), CAT.price("l40s", it, CapacityType.SPOT)
    got = _flavor_values(CAT, [("l40s", CapacityType.ON_DEMAND, od, 2.0, True),
                               ("l40s", CapacityType.SPOT, spot, 2.0, False)])
    share = l40s.spot_max_share
    assert got["l40s"] == (pytest.approx(((1 - share) * od + share * spot) / 2.0), 2.0, True)
    # On-demand alone: its own price.
    assert _flavor_values(CAT, [("l40s", CapacityType.ON_DEMAND, od, 2.0, False)])["l40s"][0] == od / 2.0


def test_scale_up_may_replace_worse_value_replicas_when_asked() -> None:
    caps = _caps()
    cur = {("mistral-7b", "inf2", OD): 3}
    rate = 3 * caps["inf2"] + 0.3
    keep, _ = plan(CAT, estimate(CAT, _sig(rate)), cur, settings=PlannerSettings())
    swap, _ = plan(CAT, estimate(CAT, _sig(rate)), cur, settings=PlannerSettings(replace_worse_than=1.5))
    assert keep.target()[("mistral-7b", "inf2", OD)] == 3  # the default pins running replicas
    assert ("mistral-7b", "inf2", OD) not in swap.target()  # one L40S covers what three inf2 did, and more
    assert set(swap.target()) == {("mistral-7b", "l40s", OD)}
    assert sum(e.rps_capacity for e in swap.entries) >= rate
