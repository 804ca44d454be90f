"""Least-cost replica counts that cover every model's demand: exact (MILP, HiGHS) or greedy.

Both take the same ``Problem`` and return the same ``Solution``, so the planner and the benchmark can
compare them. ``solve`` uses the exact solver up to ``exact_max_vars`` offerings (integer variables); past
that the heuristic (documented on ``rayscale.core.greedy.solve_greedy``) keeps a reconcile inside its time
budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from rayscale.core.catalog import CapacityType
from rayscale.core.greedy import solve_greedy
from rayscale.core.problem import (
    RPS_TOLERANCE,
    ModelNeed,
    Offering,
    OfferingTable,
    Problem,
    Solution,
    finish,
)

__all__ = ["EXACT_MAX_VARS", "RPS_TOLERANCE", "ModelNeed", "Offering", "OfferingTable", "Problem", "Solution",
           "solve", "solve_exact", "solve_greedy"]


@dataclass
class _Rows:
    """A sparse constraint matrix built row by row: lo <= A x <= hi."""

    rows: list[int] = field(default_factory=list)
    cols: list[int] = field(default_factory=list)
    vals: list[float] = field(default_factory=list)
    lo: list[float] = field(default_factory=list)
    hi: list[float] = field(default_factory=list)

    def add(self, entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        r = len(self.lo)
        for col, v in entries:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(v)
        self.lo.append(lb)
        self.hi.append(ub)

    def constraint(self, n_vars: int) -> LinearConstraint:
        a = coo_array((self.vals, (self.rows, self.cols)), shape=(len(self.lo), n_vars)).tocsr()
        return LinearConstraint(a, self.lo, self.hi)


@dataclass
class _Milp:
    """The MILP's variables, in this order: x, replicas per offering (integer); s, unmet req/s per model;
    t, missing min replicas per model; g, gangs per packed offering (slots > 1; integer)."""

    nx: int
    nm: int
    packed: list[int]  # offerings whose gang holds several replicas
    cons: LinearConstraint
    lb: np.ndarray
    ub: np.ndarray  # lowered as priority levels are settled
    integrality: np.ndarray
    cost: np.ndarray  # $/h per x (packed: a tie-break only; their gangs carry the cost)
    gang_cost: np.ndarray  # $/h per g
    big: float  # weight of unmet demand: more than any gang costs

    @property
    def n_vars(self) -> int:
        return self.nx + 2 * self.nm + len(self.packed)


def _constraints(p: Problem, offs: list[Offering], gvar: dict[int, int]) -> _Rows:
    """Demand (with unmet slack), min and max replicas per model, gangs per packed offering, device and node
    limits per flavor, and the spot share per (model, flavor)."""
    needs, nx, nm = list(p.needs), len(offs), len(p.needs)
    midx = {n.model: i for i, n in enumerate(needs)}
    rows = _Rows()
    by_model: dict[int, list[int]] = {i: [] for i in range(nm)}
    for j, o in enumerate(offs):
        by_model[midx[o.model]].append(j)
    for i, n in enumerate(needs):
        js = by_model[i]
        rows.add([(j, offs[j].rps) for j in js] + [(nx + i, 1.0)], max(0.0, n.rps - RPS_TOLERANCE), np.inf)
        rows.add([(j, 1.0) for j in js] + [(nx + nm + i, 1.0)], n.min_replicas, np.inf)
        rows.add([(j, 1.0) for j in js], 0, n.max_replicas)
    for j, g in gvar.items():
        rows.add([(g, float(offs[j].slots)), (j, -1.0)], 0.0, np.inf)
    for limits, per in ((p.device_limits, "devices"), (p.node_limits, "nodes")):
        for f, lim in limits.items():
            js = [j for j, o in enumerate(offs) if o.flavor == f]
            if js:
                rows.add([(gvar.get(j, j), float(getattr(offs[j], per))) for j in js], -np.inf, lim)
    for i in range(nm):
        for f, share in p.spot_share.items():
            js = [j for j in by_model[i] if offs[j].flavor == f]
            spot = [j for j in js if offs[j].capacity_type == CapacityType.SPOT]
            if spot:
                rows.add([(j, (1 - share) if j in spot else -share) for j in js], -np.inf, 0.0)
    return rows


def _milp_model(p: Problem) -> _Milp:
    offs = list(p.offerings)
    nx, nm = len(offs), len(p.needs)
    packed = [j for j, o in enumerate(offs) if o.slots > 1]
    gvar = {j: nx + 2 * nm + i for i, j in enumerate(packed)}
    max_cap = max((o.rps for o in offs), default=1.0) or 1.0
    # Tie-break towards more capacity among equal-cost plans: keeps capacity monotone in demand.
    cost = np.array([1e-6 if o.slots > 1 else o.usd_per_h - 1e-6 * o.rps / max_cap for o in offs])
    gang_cost = np.array([offs[j].usd_per_h * offs[j].slots for j in packed])
    # Unmet demand below 1e-3 req/s is noise; above it, it must outweigh buying any gang.
    big = 10.0 / RPS_TOLERANCE * max((o.usd_per_h * o.slots for o in offs), default=1.0) + 1.0
    ng = len(packed)
    lb = np.concatenate([np.array([o.lb for o in offs], dtype=float), np.zeros(2 * nm + ng)])
    ub = np.concatenate([np.array([o.ub for o in offs], dtype=float), np.full(2 * nm + ng, np.inf)])
    integrality = np.concatenate([np.ones(nx), np.zeros(2 * nm), np.ones(ng)])
    return _Milp(nx, nm, packed, _constraints(p, offs, gvar).constraint(nx + 2 * nm + ng), lb, ub, integrality,
                 cost, gang_cost, big)


def _run(m: _Milp, c: np.ndarray, rel_gap: float, time_limit_s: float,
         fallback: np.ndarray | None = None) -> np.ndarray:
    res = milp(c, constraints=m.cons, bounds=Bounds(m.lb, m.ub), integrality=m.integrality,
               options={"mip_rel_gap": rel_gap, "time_limit": time_limit_s, "presolve": True})
    if res.x is None:
        if fallback is not None:  # out of time: the previous stage's answer is still feasible
            return fallback
        raise RuntimeError(f"MILP found no solution: {res.message}")
    return np.asarray(res.x)


def solve_exact(p: Problem, rel_gap: float = 1e-7, time_limit_s: float = 5.0) -> Solution:
    """MILP over replicas per offering, with unmet demand as slack.

    When everything can be covered one solve suffices (cost only). When limits make some demand unmet,
    the shortfall is settled lexicographically by priority, highest first (each level's unmet demand is
    minimised and then fixed), and the cost is minimised last, so "which model degrades first" is strict
    and never traded against dollars.

    Packing: an offering whose gang holds several replicas (slots > 1) gets an integer gang count
    g >= replicas / slots. The gangs carry its cost (a new node costs all of it; free slots of a gang that
    runs cost nothing) and the NodePool limits count their nodes; its replicas cost only a tie-break that
    keeps them as few as cover the demand.
    """
    m = _milp_model(p)
    nx, nm = m.nx, m.nm
    x = _run(m, np.concatenate([m.cost, np.full(nm, m.big), np.full(nm, m.big * 1e3), m.gang_cost]),
             rel_gap, time_limit_s)
    if x[nx:nx + 2 * nm].max(initial=0.0) > RPS_TOLERANCE:
        # Limits bind: settle shortfalls by priority, then cost.
        for prio in sorted({n.priority for n in p.needs}, reverse=True):
            level = [i for i, n in enumerate(p.needs) if n.priority == prio]
            c = np.zeros(m.n_vars)
            for i in level:
                c[nx + i], c[nx + nm + i] = 1.0, 1e3
            x = _run(m, c, rel_gap, time_limit_s, x)
            for i in level:
                m.ub[nx + i] = max(x[nx + i], 0.0) + 1e-6
                m.ub[nx + nm + i] = max(x[nx + nm + i], 0.0) + 1e-6
        zeros_m = np.zeros(nm)
        x = _run(m, np.concatenate([m.cost, zeros_m, zeros_m, m.gang_cost]), rel_gap, time_limit_s, x)
    counts = {j: int(v) for j, v in enumerate(np.round(x[:nx]).astype(int)) if v > 0}
    return finish(p, counts, "exact")


# Measured (bench/results/planner.md, 2 cores): the MILP takes ~20-40 ms for one model x 20 flavors
# (~30 offerings) but 0.3-1 s at 10 models and hits its time limit at 100, while the heuristic matched
# or beat it on every bench instance; past ~2 models' worth of offerings exact no longer pays.
EXACT_MAX_VARS = 64


def solve(p: Problem, exact_max_vars: int = EXACT_MAX_VARS) -> Solution:
    """Exact (MILP) up to ``exact_max_vars`` offerings, the heuristic (``solve_greedy``) beyond."""
    if len(p.offerings) <= exact_max_vars:
        return solve_exact(p)
    return solve_greedy(p)
