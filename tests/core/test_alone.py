"""A flavor deployment of one replica serves alone: Serve's router has no second replica to send a prompt to.
The tail model's alone case against the simulated engine, and the planner and the ingress counting it."""

from __future__ import annotations

import numpy as np
import pytest

from rayscale.config import load_catalog
from rayscale.core.attainment import LOAD_FLOOR, at_load
from rayscale.core.estimate import (
    Correction,
    EstimateSettings,
    alone_shares,
    estimate,
    replica_capacity,
    rows_of,
)
from rayscale.core.plan import PlannerSettings, plan
from rayscale.core.route import flavor_weights
from rayscale.core.signals import Freshness, ModelSignals, RequestMix
from rayscale.sim.capacity import CapacitySettings, measure_capacity
from rayscale.sim.engine import EngineConfig
from rayscale.sim.policies import window_mix

M = "mistral-7b"
CODE = RequestMix(prompt_mean=2048, output_mean=28, prompt_p95=7305)  # Azure code completion's shape
CAT = load_catalog().subset([M], ["l40s"])
OD = "on-demand"
ALONE = PlannerSettings(alone_capacity=True)  # off as shipped (PlannerSettings says why)


def _sig(rate: float) -> dict[str, ModelSignals]:
    return {M: ModelSignals(M, Freshness.FRESH, 1.0, rate, CODE)}


def _shares(rate: float):  # type: ignore[no-untyped-def]
    demands = estimate(CAT, _sig(rate))
    return demands, lambda pairs: alone_shares(CAT, demands, pairs, {}, EstimateSettings(), {})


def test_a_replica_alone_misses_more_than_one_in_a_pool_at_every_load_and_the_same_idle() -> None:
    rows = rows_of([CAT.profile(M, "l40s")], [CAT.models[M].slo], [CODE], [Correction()])
    for batch in (0.3, 1.0, 2.0, 4.0):
        pooled, alone = at_load(rows, np.array([batch])), at_load(rows, np.array([batch]), alone=True)
        assert alone.ttft_miss[0] >= pooled.ttft_miss[0]
        assert alone.tpot_miss[0] > pooled.tpot_miss[0]
    idle = np.array([LOAD_FLOOR])
    assert at_load(rows, idle, alone=True).miss[0] == pytest.approx(at_load(rows, idle).miss[0], abs=1e-4)


def test_the_alone_estimate_tracks_the_engine_where_the_pooled_one_is_twice_it() -> None:
    """One L40S alone on code-completion traffic (long prompts, short answers), measured in the simulated
    engine: the pooled estimate is two to three times what it sustains (bench/results/capacity_error_lone_7b.md),
    the alone one within half."""
    prof, slo = CAT.profile(M, "l40s"), CAT.models[M].slo
    rng = np.random.default_rng(7)
    prompt = np.clip(rng.lognormal(np.log(2048) - 1.245**2 / 2, 1.245, 4000), 10, 8000).astype(np.int64)
    output = np.clip(rng.lognormal(np.log(28) - 0.5, 1.0, 4000), 1, 1000).astype(np.int64)
    mix = window_mix(prompt, output)
    assert mix is not None
    measured = measure_capacity(prof, slo, prompt, output, EngineConfig(), CapacitySettings(pool_sequences=1),
                                seed=0, guess_rps=1.0).rps
    pooled = replica_capacity(prof, slo, mix, target_utilization=1.0).rps
    alone = replica_capacity(prof, slo, mix, target_utilization=1.0, alone=True).rps
    assert measured > 0
    assert pooled > 2 * measured
    assert 0.7 * measured < alone < 1.55 * measured


def test_alone_shares_are_of_the_pooled_capacity_and_one_where_there_is_none() -> None:
    _, shares = _shares(1.0)
    got = shares([(M, "l40s"), (M, "gone"), ("other", "l40s")])
    assert 0 < got[(M, "l40s")] < 0.8
    assert got[(M, "gone")] == 1.0 and got[("other", "l40s")] == 1.0


def test_a_need_one_replica_covers_pooled_but_not_alone_gets_a_second() -> None:
    demands, shares = _shares(1.0)
    cap = demands[M].capacity["l40s"].rps
    share = shares([(M, "l40s")])[(M, "l40s")]
    rate = cap * (1 + share) / 2  # between what one replica serves alone and what it serves pooled
    demands, shares = _shares(rate)
    pooled, _ = plan(CAT, demands, settings=PlannerSettings(alone_capacity=False), alone_share=shares)
    alone, _ = plan(CAT, demands, settings=ALONE, alone_share=shares)
    assert sum(pooled.target().values()) == 1
    assert sum(alone.target().values()) == 2  # one deployment of two: pooled
    assert "two l40s replicas: one alone serves too little" in alone.entries[0].reason
    assert not alone.shortfalls
    assert alone.alone_shares[(M, "l40s")] == pytest.approx(share, rel=0.02)


def test_one_running_replica_that_serves_the_need_only_pooled_is_scaled_up() -> None:
    demands, shares = _shares(1.0)
    cap = demands[M].capacity["l40s"].rps
    share = shares([(M, "l40s")])[(M, "l40s")]
    demands, shares = _shares(cap * (1 + share) / 2)
    cur = {(M, "l40s", OD): 1}
    kept, _ = plan(CAT, demands, cur, settings=PlannerSettings(alone_capacity=False), alone_share=shares)
    up, _ = plan(CAT, demands, cur, settings=ALONE, alone_share=shares)
    assert kept.target() == cur
    assert sum(up.target().values()) == 2 and up.target()[(M, "l40s", OD)] == 1
    assert up.entries[0].reason.startswith("scale up")


def test_the_ingress_weighs_a_flavor_serving_on_one_replica_by_what_it_serves_alone() -> None:
    cat = load_catalog().subset([M], ["a10g", "l40s"])
    demands = estimate(cat, {M: ModelSignals(M, Freshness.FRESH, 1.0, 2.0, CODE)})
    d = demands[M]
    lone = {M: d.__class__(**{**d.__dict__, "alone_share": {"l40s": 0.5, "a10g": 0.5}})}
    w = flavor_weights({(M, "a10g"): 2, (M, "l40s"): 1}, lone)[M]
    assert w["l40s"] == pytest.approx(0.5 * d.capacity["l40s"].rps, rel=1e-3)
    assert w["a10g"] == pytest.approx(2 * d.capacity["a10g"].rps, rel=1e-3)  # two replicas: pooled


def test_the_step_plans_one_replica_at_what_it_serves_alone_and_hands_the_share_to_the_ingress() -> None:
    from dataclasses import replace

    from rayscale.core.settings import Settings
    from rayscale.core.step import ServeView, StepContext, StepState, step

    demands, shares = _shares(1.0)
    share = shares([(M, "l40s")])[(M, "l40s")]
    sig = ModelSignals(M, Freshness.FRESH, 0.0, demands[M].capacity["l40s"].rps * (1 + share) / 2, CODE, waiting=0.0)
    off = Settings()
    on = replace(off, planner=replace(off.planner, alone_capacity=True))
    got = {s.planner.alone_capacity: step(StepContext(0.0, CAT, {M: sig}, (), ServeView({}, {}), s, StepState()))
           for s in (on, off)}
    assert sum(got[False].plan.target().values()) == 1
    assert sum(got[True].plan.target().values()) == 2
    assert got[True].demands[M].alone_share["l40s"] == pytest.approx(share, rel=0.02)
    assert not got[False].demands[M].alone_share
