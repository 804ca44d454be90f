"""Least-cost replica counts that cover every model's demand: exact (MILP, HiGHS) or greedy.

Both take the same ``Problem`` and return the same ``Solution``, so the planner and the benchmark can
compare them. The exact solver is used up to ``exact_max_vars`` integer variables; past that the greedy
(documented on ``solve_greedy``) keeps a reconcile inside its time budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from rayscale.core.catalog import CapacityType


# Demand differences below this (req/s) are noise: not worth a replica, not reported as unmet.
RPS_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Offering:
    """One way to run a replica of a model: flavor, capacity type, the gang it needs and what it gives."""

    model: str
    flavor: str
    capacity_type: CapacityType
    usd_per_h: float  # the whole gang
    rps: float  # capacity of one replica
    devices: int  # devices the gang's nodes carry (what NodePool limits count)
    nodes: int
    lb: int = 0
    ub: int = 10**6


@dataclass(frozen=True)
class ModelNeed:
    model: str
    rps: float
    min_replicas: int
    max_replicas: int
    priority: int


@dataclass(frozen=True)
class Problem:
    needs: Sequence[ModelNeed]
    offerings: Sequence[Offering]
    device_limits: dict[str, int] = field(default_factory=dict)  # flavor -> devices
    node_limits: dict[str, int] = field(default_factory=dict)  # flavor -> nodes
    spot_share: dict[str, float] = field(default_factory=dict)  # flavor -> most replicas of a model on spot


@dataclass(frozen=True)
class Solution:
    counts: dict[int, int]  # offering index -> replicas (only > 0)
    unmet_rps: dict[str, float]  # model -> demand not covered (limits or max_replicas)
    usd_per_h: float
    method: str


def solve_exact(p: Problem, rel_gap: float = 1e-7, time_limit_s: float = 5.0) -> Solution:
    """MILP over replicas per offering, with unmet demand as slack.

    When everything can be covered one solve suffices (cost only). When limits make some demand unmet,
    the shortfall is settled lexicographically by priority, highest first (each level's unmet demand is
    minimised and then fixed), and the cost is minimised last, so "which model degrades first" is strict
    and never traded against dollars.
    """
    offs = list(p.offerings)
    needs = list(p.needs)
    nx, nm = len(offs), len(needs)
    midx = {n.model: i for i, n in enumerate(needs)}
    max_cap = max((o.rps for o in offs), default=1.0) or 1.0
    # Tie-break towards more capacity among equal-cost plans: keeps capacity monotone in demand.
    cost = np.array([o.usd_per_h - 1e-6 * o.rps / max_cap for o in offs])
    # Unmet demand below 1e-3 req/s is noise; above it, it must outweigh buying any replica.
    big = 10.0 / RPS_TOLERANCE * max((o.usd_per_h for o in offs), default=1.0) + 1.0
    nv = nx + 2 * nm  # x: replicas per offering (integer); s: unmet rps per model; t: missing min replicas
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def row(entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        r = len(lo)
        for col, v in entries:
            rows.append(r)
            cols.append(col)
            vals.append(v)
        lo.append(lb)
        hi.append(ub)

    by_model: dict[int, list[int]] = {i: [] for i in range(nm)}
    for j, o in enumerate(offs):
        by_model[midx[o.model]].append(j)
    for i, n in enumerate(needs):
        js = by_model[i]
        row([(j, offs[j].rps) for j in js] + [(nx + i, 1.0)], max(0.0, n.rps - RPS_TOLERANCE), np.inf)
        row([(j, 1.0) for j in js] + [(nx + nm + i, 1.0)], n.min_replicas, np.inf)
        row([(j, 1.0) for j in js], 0, n.max_replicas)
    for f, lim in p.device_limits.items():
        js = [j for j, o in enumerate(offs) if o.flavor == f]
        if js:
            row([(j, float(offs[j].devices)) for j in js], -np.inf, lim)
    for f, lim in p.node_limits.items():
        js = [j for j, o in enumerate(offs) if o.flavor == f]
        if js:
            row([(j, float(offs[j].nodes)) for j in js], -np.inf, lim)
    for i in range(nm):
        for f, share in p.spot_share.items():
            js = [j for j in by_model[i] if offs[j].flavor == f]
            spot = [j for j in js if offs[j].capacity_type == CapacityType.SPOT]
            if spot:
                row([(j, (1 - share) if j in spot else -share) for j in js], -np.inf, 0.0)
    lb = np.concatenate([np.array([o.lb for o in offs], dtype=float), np.zeros(2 * nm)])
    ub = np.concatenate([np.array([o.ub for o in offs], dtype=float), np.full(2 * nm, np.inf)])
    integrality = np.concatenate([np.ones(nx), np.zeros(2 * nm)])

    def run(c: np.ndarray) -> np.ndarray:
        a = coo_array((vals, (rows, cols)), shape=(len(lo), nv)).tocsr()
        res = milp(c, constraints=LinearConstraint(a, lo, hi), bounds=Bounds(lb, ub), integrality=integrality,
                   options={"mip_rel_gap": rel_gap, "time_limit": time_limit_s, "presolve": True})
        if res.x is None:
            raise RuntimeError(f"MILP found no solution: {res.message}")
        return np.asarray(res.x)

    zeros_m = np.zeros(nm)
    x = run(np.concatenate([cost, np.full(nm, big), np.full(nm, big * 1e3)]))
    if x[nx:].max(initial=0.0) > RPS_TOLERANCE:
        # Limits bind: settle shortfalls by priority, then cost.
        for prio in sorted({n.priority for n in needs}, reverse=True):
            level = [i for i, n in enumerate(needs) if n.priority == prio]
            c = np.zeros(nv)
            for i in level:
                c[nx + i], c[nx + nm + i] = 1.0, 1e3
            x = run(c)
            for i in level:
                ub[nx + i] = x[nx + i] + 1e-6
                ub[nx + nm + i] = x[nx + nm + i] + 1e-6
        x = run(np.concatenate([cost, zeros_m, zeros_m]))
    counts = {j: int(v) for j, v in enumerate(np.round(x[:nx]).astype(int)) if v > 0}
    return _finish(p, counts, "exact")


def _finish(p: Problem, counts: dict[int, int], method: str) -> Solution:
    cap: dict[str, float] = {n.model: 0.0 for n in p.needs}
    cost = 0.0
    for j, k in counts.items():
        o = p.offerings[j]
        cap[o.model] += k * o.rps
        cost += k * o.usd_per_h
    unmet = {n.model: n.rps - cap[n.model] for n in p.needs if cap[n.model] < n.rps - RPS_TOLERANCE}
    return Solution(counts, unmet, cost, method)


def solve_greedy(p: Problem) -> Solution:
    """Greedy: models in priority order; each takes the cheapest of

    (a) one offering alone, ceil(demand / capacity) replicas, or
    (b) floor(demand / capacity) of the best $/req offering plus the cheapest single-offering cover of the
        remainder,

    with spot replicas limited to the flavor's share (rounded down) and every pick clipped by what the
    flavor's device and node limits still allow. Current replicas (lower bounds) are kept first.
    """
    offs = list(p.offerings)
    dev_left = dict(p.device_limits)
    node_left = dict(p.node_limits)
    counts: dict[int, int] = {}
    by_model: dict[str, list[int]] = {}
    for j, o in enumerate(offs):
        by_model.setdefault(o.model, []).append(j)

    def room(j: int) -> int:
        o = offs[j]
        n = o.ub - counts.get(j, 0)
        if o.flavor in dev_left:
            n = min(n, dev_left[o.flavor] // max(o.devices, 1))
        if o.flavor in node_left:
            n = min(n, node_left[o.flavor] // max(o.nodes, 1))
        return max(n, 0)

    def take(j: int, k: int) -> None:
        o = offs[j]
        counts[j] = counts.get(j, 0) + k
        if o.flavor in dev_left:
            dev_left[o.flavor] -= k * o.devices
        if o.flavor in node_left:
            node_left[o.flavor] -= k * o.nodes

    def spot_ok(j: int, k: int, js: list[int]) -> bool:
        o = offs[j]
        if o.capacity_type != CapacityType.SPOT:
            return True
        share = p.spot_share.get(o.flavor, 0.0)
        same = [i for i in js if offs[i].flavor == o.flavor]
        spot = sum(counts.get(i, 0) for i in same if offs[i].capacity_type == CapacityType.SPOT) + k
        total = sum(counts.get(i, 0) for i in same) + k
        return spot <= share * total + 1e-9

    for need in sorted(p.needs, key=lambda n: (-n.priority, n.model)):
        js = by_model.get(need.model, [])
        for j in js:
            if offs[j].lb:
                take(j, offs[j].lb)
        placed = sum(counts.get(j, 0) for j in js)
        rest = need.rps - sum(counts.get(j, 0) * offs[j].rps for j in js)
        budget = need.max_replicas - placed
        # On-demand first, then spot up to the share: each step re-picks the cheapest feasible cover.
        while rest > 1e-9 and budget > 0:
            best: tuple[float, float, int, int] | None = None  # (cost, -capacity, j, k)
            for j in js:
                o = offs[j]
                if o.rps <= 0:
                    continue
                k = min(math.ceil(rest / o.rps), room(j), budget)
                while k > 0 and not spot_ok(j, k, js):
                    k -= 1
                if k <= 0:
                    continue
                # Score per unit of covered demand so partial covers (limits) still compete fairly.
                covered = min(k * o.rps, rest)
                cand = (k * o.usd_per_h / covered, -k * o.rps, j, k)
                if best is None or cand < best:
                    best = cand
            if best is None:
                break
            _, _, j, k = best
            # Use the cheapest-per-request offering for the bulk, then re-pick the remainder.
            o = offs[j]
            bulk = max(1, min(k, math.floor(rest / o.rps)))
            take(j, bulk)
            budget -= bulk
            rest -= bulk * o.rps
        while sum(counts.get(j, 0) for j in js) < need.min_replicas and budget > 0:
            cands = [j for j in js if room(j) > 0 and spot_ok(j, 1, js)]
            if not cands:
                break
            take(min(cands, key=lambda j: (offs[j].usd_per_h, j)), 1)
            budget -= 1
    return _finish(p, {j: k for j, k in counts.items() if k > 0}, "greedy")


def solve(p: Problem, exact_max_vars: int = 4000) -> Solution:
    if len(p.offerings) <= exact_max_vars:
        return solve_exact(p)
    return solve_greedy(p)
