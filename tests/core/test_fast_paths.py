"""The planner's fast paths: vectorised capacity equals the scalar reference, the heuristic keeps every
bound (lower/upper bounds, spot share, node limits), the column form of offerings acts as a sequence, and
the heuristic stays close to the exact solver."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayscale.config import load_catalog
from rayscale.core.catalog import SLO, CapacityType, Profile
from rayscale.core.estimate import Correction, estimate, replica_capacities, replica_capacity
from rayscale.core.plan import plan
from rayscale.core.signals import Freshness, ModelSignals, RequestMix
from rayscale.core.solver import ModelNeed, Offering, OfferingTable, Problem, solve_exact, solve_greedy

OD, SPOT = CapacityType.ON_DEMAND, CapacityType.SPOT
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

profiles = st.builds(
    lambda seq_share, **kw: Profile(prefill_seq_s=seq_share * kw["overhead_s"], **kw),  # seq within overhead
    seq_share=st.sampled_from([0.0, 0.3, 1.0]), prefill_quadratic_s=st.sampled_from([0.0, 2e-8, 1e-6]),
    model=st.just("m"), flavor=st.sampled_from(["a", "b"]), prefill_tokens_per_s=st.floats(100, 20000),
    overhead_s=st.floats(0, 0.2), itl_alpha_s=st.floats(0.005, 0.2), itl_beta_s=st.floats(0, 0.01),
    max_num_seqs=st.integers(1, 512), kv_tokens=st.integers(100, 200000), startup_s=st.just(60.0),
    source=st.just("estimate: test"))
slos = st.builds(SLO, ttft_p95_s=st.floats(0.1, 5), tpot_p95_s=st.floats(0.01, 0.3))
mixes = st.builds(lambda p, o, k: RequestMix(p, o, p * k), st.floats(1, 8000), st.floats(0, 1000), st.floats(1, 4))
corrs = st.builds(Correction, ttft=st.floats(0.5, 3), tpot=st.floats(0.5, 3))


@FAST
@given(st.lists(st.tuples(profiles, slos, mixes, corrs), min_size=1, max_size=12), st.floats(0.3, 1.0))
def test_vectorised_capacity_equals_scalar_reference(rows: list[tuple[Profile, SLO, RequestMix, Correction]],
                                                      util: float) -> None:
    prs, ss, ms, cs = (list(x) for x in zip(*rows, strict=True))
    fast = replica_capacities(prs, ss, ms, cs, util)
    assert fast == [replica_capacity(p, s, m, c, util) for p, s, m, c in rows]


@st.composite
def bounded_problems(draw: st.DrawFn) -> Problem:
    offerings, needs = [], []
    flavors = ["f0", "f1", "f2"]
    for m in range(draw(st.integers(1, 3))):
        name = f"m{m}"
        needs.append(ModelNeed(name, draw(st.floats(0, 25)), draw(st.integers(0, 3)), draw(st.integers(3, 12)),
                               draw(st.integers(0, 2))))
        for f in flavors:
            price, rps = draw(st.floats(0.5, 10)), draw(st.floats(0.5, 6))
            dev, nodes = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 2))
            for ct, mult in ((OD, 1.0), (SPOT, draw(st.floats(0.3, 1.2)))):
                if ct == SPOT and not draw(st.booleans()):
                    continue
                lb = draw(st.integers(0, 2))
                ub = lb + draw(st.integers(0, 6))
                offerings.append(Offering(name, f, ct, round(price * mult, 3), round(rps, 3), dev, nodes, lb, ub))
    dev_lim = {f: draw(st.integers(4, 40)) for f in flavors if draw(st.booleans())}
    node_lim = {f: draw(st.integers(2, 20)) for f in flavors if draw(st.booleans())}
    share = {f: draw(st.sampled_from([0.0, 0.3, 0.5, 1.0])) for f in flavors if draw(st.booleans())}
    return Problem(needs, offerings, dev_lim, node_lim, share)


@FAST
@given(bounded_problems())
def test_heuristic_keeps_bounds_limits_and_spot_share(p: Problem) -> None:
    sol = solve_greedy(p)
    offs = p.offerings
    for j, o in enumerate(offs):
        assert o.lb <= sol.counts.get(j, 0) <= o.ub
    for lims, attr in ((p.device_limits, "devices"), (p.node_limits, "nodes")):
        for f, lim in lims.items():
            lbs = sum(o.lb * getattr(o, attr) for o in offs if o.flavor == f)
            used = sum(k * getattr(offs[j], attr) for j, k in sol.counts.items() if offs[j].flavor == f)
            assert used <= max(lim, lbs)  # what runs is kept even above a lowered limit; nothing added then
    for n in p.needs:
        js = [j for j, o in enumerate(offs) if o.model == n.model]
        tot = sum(sol.counts.get(j, 0) for j in js)
        assert tot <= max(n.max_replicas, sum(offs[j].lb for j in js))
        for f, share in p.spot_share.items():
            same = [j for j in js if offs[j].flavor == f]
            spot = sum(sol.counts.get(j, 0) for j in same if offs[j].capacity_type == SPOT)
            lb_spot = sum(offs[j].lb for j in same if offs[j].capacity_type == SPOT)
            if spot > lb_spot:  # anything added on spot respects the share
                assert spot <= share * sum(sol.counts.get(j, 0) for j in same) + 1e-9


def test_offering_table_is_a_sequence_of_offerings() -> None:
    rows = [Offering("m", "a", OD, 1.0, 2.0, 1, 1, 0, 4), Offering("m", "a", SPOT, 0.4, 2.0, 1, 1, 1, 4)]
    t = OfferingTable(*[[getattr(o, k) for o in rows] for k in
                        ("model", "flavor", "capacity_type", "usd_per_h", "rps", "devices", "nodes", "lb", "ub")])
    assert len(t) == 2 and list(t) == rows and t[-1] == rows[1] and t[0:1] == rows[:1]
    p = Problem([ModelNeed("m", 5.0, 0, 8, 0)], t, spot_share={"a": 0.5})
    q = Problem([ModelNeed("m", 5.0, 0, 8, 0)], rows, spot_share={"a": 0.5})
    assert solve_greedy(p) == solve_greedy(q)
    assert solve_exact(p).usd_per_h == solve_exact(q).usd_per_h


def test_heuristic_within_two_percent_of_exact_on_bench_instance() -> None:
    from bench.planner import synthetic
    from rayscale.core.estimate import estimate
    from rayscale.core.plan import PlannerSettings, plan

    cat, sig = synthetic(8, seed=3)
    d = estimate(cat, sig)
    ex = plan(cat, d, settings=PlannerSettings(solver="exact"))[0]
    gr = plan(cat, d, settings=PlannerSettings(solver="greedy"))[0]
    assert not ex.shortfalls and not gr.shortfalls
    assert gr.usd_per_h <= ex.usd_per_h * 1.02 + 1e-9


@FAST
@given(st.lists(st.tuples(profiles, slos, mixes, corrs), min_size=2, max_size=5), st.lists(st.integers(0, 4), min_size=1,
                                                                                            max_size=12))
def test_rows_sharing_objects_in_any_order_equal_the_scalar_reference(
        rows: list[tuple[Profile, SLO, RequestMix, Correction]], order: list[int]) -> None:
    """A model's rows share its mix and SLO objects, worked out once per distinct object: the same object in
    runs apart from each other (A, B, A) still gets its own values in every row."""
    picked = [rows[i % len(rows)] for i in order]
    prs, ss, ms, cs = (list(x) for x in zip(*picked, strict=True))
    assert replica_capacities(prs, ss, ms, cs) == [replica_capacity(p, s, m, c) for p, s, m, c in picked]


def test_what_is_derived_from_a_catalog_follows_the_catalog_object() -> None:
    """Pairs and shape keys are derived once per catalog object: a new catalog (one model's flavors cut) is
    estimated and planned on its own pairs, and the first again on all of its."""
    cat = load_catalog()
    name = "mistral-7b"
    keep = sorted(cat.models[name].parallelism)[:2]
    spec = cat.models[name].model_copy(update={"parallelism": {f: cat.models[name].parallelism[f] for f in keep}})
    cut = cat.model_copy(update={"models": {**cat.models, name: spec}})
    sig = {name: ModelSignals(name, Freshness.FRESH, 1.0, 4.0, RequestMix(1000, 200, 3000))}
    for c, flavors in ((cat, sorted(cat.models[name].parallelism)), (cut, keep), (cat, sorted(cat.models[name].parallelism))):
        assert sorted(estimate(c, sig)[name].capacity) == flavors
        assert {e.flavor for e in plan(c, estimate(c, sig))[0].entries if e.model == name} <= set(flavors)
