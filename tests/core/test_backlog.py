"""A visible backlog with the engines' metrics missing or stale is load: the estimator sizes for it and the
step orders capacity, never zero and never a hold."""

from __future__ import annotations

import pytest

from rayscale.autoscale_demo import local_stand_in_catalog
from rayscale.core.act import CreateGang, Gang, GangPhase
from rayscale.core.estimate import DemandState, estimate
from rayscale.core.signals import Freshness, ModelSignals
from rayscale.core.step import ServeView, StepContext, StepState, step
from rayscale.demo import REPO_ROOT

M, F = "mistral-7b", "a10g"


@pytest.mark.parametrize("fresh", [Freshness.MISSING, Freshness.STALE])
def test_in_flight_requests_with_engine_metrics_missing_are_demand_not_a_hold(fresh: Freshness) -> None:
    cat = local_stand_in_catalog()
    age = 30.0 if fresh == Freshness.STALE else None
    loaded = ModelSignals(M, fresh, age, arrival_rate_rps=None, in_flight=60.0, waiting=40.0)
    d = estimate(cat, {M: loaded})[M]
    assert d.state == DemandState.OK and "60 requests in flight" in d.reason and fresh.value in d.reason
    # Every visible request counts as backlog, drained within the settings' drain time (>= one start-up).
    assert d.rps == pytest.approx(60.0 / 30.0)
    # What the ingress saw arrive adds on top.
    arriving = estimate(cat, {M: ModelSignals(M, fresh, age, arrival_rate_rps=2.0, in_flight=60.0)})[M]
    assert arriving.rps == pytest.approx(2.0 + 60.0 / 30.0)
    # No backlog visible: the engines' silence is held, as before (no scale-down on no data).
    assert estimate(cat, {M: ModelSignals(M, fresh, age, in_flight=0.0)})[M].state == DemandState.HOLD
    assert estimate(cat, {M: ModelSignals(M, fresh, age)})[M].state == DemandState.HOLD


def test_a_step_scales_up_on_a_backlog_the_engines_do_not_report() -> None:
    from rayscale.config import load_settings

    cat = local_stand_in_catalog()
    settings = load_settings(REPO_ROOT / "rayscale" / "data" / "settings-local.yaml")
    one = (Gang("g1", M, F, "on-demand", "local", "a10g", 1, GangPhase.READY, 0.0, serving=1),)
    serve = ServeView({(M, F): 1}, {(M, F): 1})

    def orders(sig: ModelSignals) -> int:
        res = step(StepContext(100.0, cat, {M: sig}, one, serve, settings, StepState()))
        return sum(1 for a in res.actions if isinstance(a, CreateGang))

    assert orders(ModelSignals(M, Freshness.MISSING, in_flight=80.0)) >= 1
    assert orders(ModelSignals(M, Freshness.MISSING)) == 0  # nothing visible: hold what runs
