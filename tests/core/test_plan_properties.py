"""Property tests of the planner and its solvers (hypothesis)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayscale.core.catalog import (
    SLO,
    CapacityType,
    Catalog,
    Flavor,
    FlavorLimits,
    InstanceType,
    ModelSpec,
    Parallelism,
    Profile,
    profile_key,
)
from rayscale.core.estimate import estimate
from rayscale.core.plan import PlannerSettings, plan
from rayscale.core.signals import Freshness, ModelSignals, RequestMix
from rayscale.core.solver import RPS_TOLERANCE, ModelNeed, Offering, Problem, solve_exact, solve_greedy

OD, SPOT = CapacityType.ON_DEMAND, CapacityType.SPOT
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- solver level ------------------------------------------------------------------------------------------

@st.composite
def problems(draw: st.DrawFn, max_models: int = 2, max_flavors: int = 3) -> Problem:
    nf = draw(st.integers(1, max_flavors))
    nm = draw(st.integers(1, max_models))
    flavors = [f"f{i}" for i in range(nf)]
    offerings = []
    needs = []
    for m in range(nm):
        name = f"m{m}"
        needs.append(ModelNeed(name, draw(st.floats(0, 12)), draw(st.integers(0, 1)), draw(st.integers(2, 6)),
                               draw(st.integers(0, 3))))
        for f in flavors:
            if draw(st.booleans()) or f == "f0":
                price = draw(st.floats(0.5, 10))
                rps = draw(st.floats(0.5, 6))
                dev = draw(st.sampled_from([1, 2, 4]))
                offerings.append(Offering(name, f, OD, round(price, 3), round(rps, 3), dev, 1))
                if draw(st.booleans()):
                    offerings.append(Offering(name, f, SPOT, round(price * 0.4, 3), round(rps, 3), dev, 1))
    limits = {f: draw(st.integers(2, 16)) for f in flavors if draw(st.booleans())}
    share = {f: draw(st.sampled_from([0.0, 0.5, 1.0])) for f in flavors}
    return Problem(needs, offerings, device_limits=limits, spot_share=share)


def _feasible(p: Problem, counts: dict[int, int], with_min: bool = True) -> bool:
    """Hard constraints; min_replicas is soft in the solver (limits may forbid it), so optional here."""
    for f, lim in p.device_limits.items():
        if sum(k * p.offerings[j].devices for j, k in counts.items() if p.offerings[j].flavor == f) > lim:
            return False
    for n in p.needs:
        js = [j for j, o in enumerate(p.offerings) if o.model == n.model]
        tot = sum(counts.get(j, 0) for j in js)
        if tot > n.max_replicas or (with_min and tot < n.min_replicas):
            return False
        for f, share in p.spot_share.items():
            same = [j for j in js if p.offerings[j].flavor == f]
            spot = sum(counts.get(j, 0) for j in same if p.offerings[j].capacity_type == SPOT)
            if spot > share * sum(counts.get(j, 0) for j in same) + 1e-9:
                return False
    return True


def _brute(p: Problem) -> float | None:
    """Least cost covering every demand exactly, by enumeration (None: no full cover exists)."""
    best = None
    ranges = [range(0, min(o.ub, 6) + 1) for o in p.offerings]
    for combo in itertools.product(*ranges):
        counts = {j: k for j, k in enumerate(combo) if k}
        if not _feasible(p, counts):
            continue
        cap = {n.model: 0.0 for n in p.needs}
        for j, k in counts.items():
            cap[p.offerings[j].model] += k * p.offerings[j].rps
        if any(cap[n.model] < n.rps - RPS_TOLERANCE for n in p.needs):
            continue
        cost = sum(k * p.offerings[j].usd_per_h for j, k in counts.items())
        best = cost if best is None else min(best, cost)
    return best


@FAST
@given(problems())
def test_exact_equals_brute_force_on_small_cases(p: Problem) -> None:
    if len(p.offerings) > 5:
        p = Problem(p.needs, p.offerings[:5], p.device_limits, p.node_limits, p.spot_share)
    sol = solve_exact(p)
    brute = _brute(p)
    assert _feasible(p, sol.counts, with_min=False)
    if brute is not None:
        assert _feasible(p, sol.counts)
        assert not sol.unmet_rps, "a full cover exists, so nothing may be unmet"
        assert math.isclose(sol.usd_per_h, brute, rel_tol=1e-6, abs_tol=1e-6)


@FAST
@given(problems(max_models=3, max_flavors=4))
def test_limits_and_bounds_never_exceeded_exact_and_greedy(p: Problem) -> None:
    for sol in (solve_exact(p), solve_greedy(p)):
        assert _feasible(p, sol.counts, with_min=False), sol.method
        # Whatever is reported unmet is exactly demand minus delivered capacity.
        for n in p.needs:
            cap = sum(k * p.offerings[j].rps for j, k in sol.counts.items() if p.offerings[j].model == n.model)
            gap = n.rps - cap
            assert math.isclose(sol.unmet_rps.get(n.model, 0.0), gap if gap > RPS_TOLERANCE else 0.0, abs_tol=1e-9)
            # ... and whatever is missing of min_replicas too.
            have = sum(k for j, k in sol.counts.items() if p.offerings[j].model == n.model)
            assert sol.missing_min.get(n.model, 0) == max(min(n.min_replicas, n.max_replicas) - have, 0)


@FAST
@given(problems(max_models=3, max_flavors=4))
def test_greedy_is_never_cheaper_than_exact_when_both_cover(p: Problem) -> None:
    ex, gr = solve_exact(p), solve_greedy(p)
    # Both complete: demand covered and min_replicas met (a heuristic answer missing a floor may be cheaper).
    if not ex.unmet_rps and not gr.unmet_rps and not gr.missing_min:
        assert _feasible(p, gr.counts)
        assert gr.usd_per_h >= ex.usd_per_h - 1e-6


@st.composite
def _with_floors(draw: st.DrawFn, max_models: int) -> Problem:
    p = draw(problems(max_models=max_models, max_flavors=4))
    needs = [ModelNeed(n.model, n.rps, draw(st.integers(0, 3)), n.max_replicas, n.priority) for n in p.needs]
    return Problem(needs, p.offerings, p.device_limits, p.node_limits, p.spot_share)


@FAST
@given(_with_floors(max_models=1))
def test_greedy_meets_a_floor_whenever_the_exact_solver_can(p: Problem) -> None:
    # One model: demand first, and when a limit then leaves the floor short, the floor first.
    if not solve_exact(p).missing_min:
        assert not solve_greedy(p).missing_min


def test_a_floor_outranks_demand_of_the_same_priority_level() -> None:
    # 'a' would fill the only flavor b runs on; b's one replica (its floor) comes first, a's shortfall shows.
    p = Problem([ModelNeed("a", 4.0, 0, 10, 1), ModelNeed("b", 0.0, 1, 4, 1)],
                [Offering("a", "f0", OD, 1.0, 1.0, 1, 1), Offering("b", "f0", OD, 1.0, 1.0, 1, 1)],
                device_limits={"f0": 4})
    for sol in (solve_exact(p), solve_greedy(p)):
        assert sol.counts == {0: 3, 1: 1}, sol.method
        assert not sol.missing_min and math.isclose(sol.unmet_rps["a"], 1.0), sol.method
    # A higher level's demand outranks a lower level's floor (both solvers), and the floor shows as missing.
    q = Problem([replace(p.needs[0], priority=2), p.needs[1]], p.offerings, p.device_limits)
    for sol in (solve_exact(q), solve_greedy(q)):
        assert sol.counts == {0: 4} and sol.missing_min == {"b": 1}, sol.method


@FAST
@given(problems(max_models=1), st.floats(0, 10))
def test_more_load_never_yields_less_capacity(p: Problem, extra: float) -> None:
    more = Problem([ModelNeed(n.model, n.rps + extra, n.min_replicas, n.max_replicas, n.priority) for n in p.needs],
                   p.offerings, p.device_limits, p.node_limits, p.spot_share)

    def cap(sol) -> float:  # type: ignore[no-untyped-def]
        return sum(k * p.offerings[j].rps for j, k in sol.counts.items())

    assert cap(solve_exact(more)) >= cap(solve_exact(p)) - 1e-6


# --- plan level --------------------------------------------------------------------------------------------

def _catalog(prices: list[float], alphas: list[float], limit: int | None) -> Catalog:
    flavors, profiles, par = {}, {}, {}
    for i, (price, alpha) in enumerate(zip(prices, alphas, strict=True)):
        name = f"g{i}"
        flavors[name] = Flavor(
            name=name, accelerator="test", kind="gpu", resource_name="nvidia.com/gpu",
            instance_types=[InstanceType(name=f"x{i}.large", devices=1, device_memory_gib=24, vcpu=4,
                                         memory_gib=16, on_demand_usd_per_h=price, price_source="nominal: test")],
            capacity_types=[OD, SPOT], spot_max_share=0.5, zones=["z1", "z2"],
            limits=FlavorLimits(devices=limit),
        )
        for m in ("a", "b"):
            profiles[profile_key(m, name)] = Profile(
                model=m, flavor=name, prefill_tokens_per_s=6000, itl_alpha_s=alpha, itl_beta_s=0.0005,
                kv_tokens=80000, startup_s=60, source="estimate: test")
            par.setdefault(m, {})[name] = Parallelism()
    models = {m: ModelSpec(name=m, model=m, slo=SLO(ttft_p95_s=2, tpot_p95_s=0.1), parallelism=par[m],
                           priority=p, max_replicas=40) for m, p in (("a", 2), ("b", 1))}
    return Catalog(models=models, flavors=flavors, profiles=profiles)


catalogs = st.builds(
    _catalog,
    st.lists(st.floats(0.5, 5), min_size=2, max_size=3),
    st.lists(st.floats(0.01, 0.06), min_size=3, max_size=3),
    st.one_of(st.none(), st.integers(1, 12)),
).map(lambda c: c)


def _signals(ra: float, rb: float) -> dict[str, ModelSignals]:
    mix = RequestMix(800, 150, 2400)
    return {"a": ModelSignals("a", Freshness.FRESH, 1.0, ra, mix), "b": ModelSignals("b", Freshness.FRESH, 1.0, rb, mix)}


@FAST
@given(st.lists(st.floats(0.5, 5), min_size=2, max_size=3), st.floats(0, 30), st.floats(0, 30))
def test_feasible_plan_meets_every_slo_capacity_and_limits(prices: list[float], ra: float, rb: float) -> None:
    for limit in (None, 6):
        cat = _catalog(prices, [0.03] * len(prices), limit)
        demands = estimate(cat, _signals(ra, rb))
        p, _ = plan(cat, demands)
        short = {s.model for s in p.shortfalls}
        for m, d in demands.items():
            if m not in short:
                assert sum(e.rps_capacity for e in p.entries if e.model == m) >= d.rps - RPS_TOLERANCE
        for f, fl in cat.flavors.items():
            used = sum(e.replicas * e.gang.devices for e in p.entries if e.flavor == f)
            assert fl.limits.devices is None or used <= fl.limits.devices
        # Under limits the lower priority model degrades first: 'a' short while 'b' holds a replica is wrong
        # ('a' short while 'b' needs nothing is only the limit).
        if short == {"a"} and any(e.model == "b" and e.replicas > 0 for e in p.entries):
            raise AssertionError("higher-priority model 'a' degraded while 'b' was served")


def test_a_floor_the_limits_forbid_is_a_shortfall() -> None:
    cat = _catalog([1.0, 2.0], [0.03, 0.03], 1)
    cat = cat.model_copy(update={"models": {**cat.models, "b": cat.models["b"].model_copy(update={"min_replicas": 3})}})
    for solver in ("exact", "greedy"):
        p, _ = plan(cat, estimate(cat, _signals(0.1, 0.1)), settings=PlannerSettings(solver=solver))
        # 'a' (priority 2) takes one device; 'b' gets the other flavor's one device: one replica of three.
        assert p.replicas("b") == 1 and p.replicas("a") == 1, solver
        (s,) = p.shortfalls
        assert (s.model, s.missing_replicas, s.unmet_rps) == ("b", 2, 0.0), solver
        assert "NodePool limits on g0, g1" in s.reason


@FAST
@given(st.lists(st.floats(0.5, 5), min_size=2, max_size=3), st.floats(0.5, 30), st.integers(0, 2))
def test_unavailable_flavors_never_get_new_replicas(prices: list[float], ra: float, off: int) -> None:
    cat = _catalog(prices, [0.03] * len(prices), None)
    flavor = f"g{min(off, len(prices) - 1)}"
    blocked = {(flavor, z, ct): 1e9 for z in ("z1", "z2") for ct in ("on-demand", "spot")}
    p, _ = plan(cat, estimate(cat, _signals(ra, ra)), unavailable=blocked, now=10.0)
    assert all(e.replicas == 0 for e in p.entries if e.flavor == flavor)
    # Once the back-off expires the flavor is usable again (same inputs, later clock).
    p2, _ = plan(cat, estimate(cat, _signals(ra, ra)), unavailable=blocked, now=2e9)
    assert p2.usd_per_h <= p.usd_per_h + 1e-9


@FAST
@given(st.lists(st.floats(0.5, 5), min_size=2, max_size=3), st.floats(0, 30), st.floats(0, 30))
def test_plans_are_deterministic(prices: list[float], ra: float, rb: float) -> None:
    cat = _catalog(prices, [0.03] * len(prices), 8)
    a = plan(cat, estimate(cat, _signals(ra, rb)))[0]
    b = plan(cat, estimate(cat, _signals(ra, rb)))[0]
    assert a == b
    for solver in ("exact", "greedy"):
        x = plan(cat, estimate(cat, _signals(ra, rb)), settings=PlannerSettings(solver=solver))[0]
        y = plan(cat, estimate(cat, _signals(ra, rb)), settings=PlannerSettings(solver=solver))[0]
        assert x == y
