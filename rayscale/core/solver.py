"""Least-cost replica counts that cover every model's demand: exact (MILP, HiGHS) or greedy.

Both take the same ``Problem`` and return the same ``Solution``, so the planner and the benchmark can
compare them. ``solve`` uses the exact solver up to ``exact_max_vars`` offerings (integer variables); past
that the heuristic (documented on ``solve_greedy``) keeps a reconcile inside its time budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from rayscale.core.catalog import CapacityType

# Demand differences below this (req/s) are noise: not worth a replica, not reported as unmet.
RPS_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Offering:
    """One way to run a replica of a model: flavor, capacity type, the gang it needs and what it gives.

    A gang holds ``slots`` replicas (rayscale.core.gangs.GangShape.slots): a replica costs its share of the
    gang, and NodePool limits count the whole gangs the replicas pack into."""

    model: str
    flavor: str
    capacity_type: CapacityType
    usd_per_h: float  # one replica: the gang's price / slots
    rps: float  # capacity of one replica
    devices: int  # devices the gang's nodes carry (what NodePool limits count)
    nodes: int  # nodes of one gang
    lb: int = 0
    ub: int = 10**6
    slots: int = 1  # replicas one gang holds


class OfferingTable(Sequence[Offering]):
    """Offerings in column form: what ``plan()`` builds for thousands of (model, flavor) pairs without
    creating one object each. Items are made on access; ``unit`` (optional) numbers (model, flavor) groups
    whose on-demand and spot offerings differ only in capacity type, price and bounds."""

    def __init__(self, model: list[str], flavor: list[str], capacity_type: list[CapacityType],
                 usd_per_h: list[float], rps: list[float], devices: list[int], nodes: list[int], lb: list[int],
                 ub: list[int], unit: list[int] | None = None, slots: list[int] | None = None) -> None:
        self.model, self.flavor, self.capacity_type = model, flavor, capacity_type
        self.usd_per_h, self.rps, self.devices, self.nodes, self.lb, self.ub = usd_per_h, rps, devices, nodes, lb, ub
        self.unit = unit
        self.slots = slots if slots is not None else [1] * len(model)

    def __len__(self) -> int:
        return len(self.model)

    def _item(self, j: int) -> Offering:
        return Offering(self.model[j], self.flavor[j], self.capacity_type[j], self.usd_per_h[j], self.rps[j],
                        self.devices[j], self.nodes[j], self.lb[j], self.ub[j], self.slots[j])

    @overload
    def __getitem__(self, j: int) -> Offering: ...

    @overload
    def __getitem__(self, j: slice) -> list[Offering]: ...

    def __getitem__(self, j: int | slice) -> Offering | list[Offering]:
        if isinstance(j, slice):
            return [self._item(i) for i in range(*j.indices(len(self)))]
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError(j)
        return self._item(j)


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
    # model -> replicas short of min_replicas (only > 0): limits can forbid a floor too, and it must show
    missing_min: dict[str, int] = field(default_factory=dict)


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
    offs = list(p.offerings)
    needs = list(p.needs)
    nx, nm = len(offs), len(needs)
    packed = [j for j, o in enumerate(offs) if o.slots > 1]
    ng = len(packed)
    gvar = {j: nx + 2 * nm + i for i, j in enumerate(packed)}
    midx = {n.model: i for i, n in enumerate(needs)}
    max_cap = max((o.rps for o in offs), default=1.0) or 1.0
    # Tie-break towards more capacity among equal-cost plans: keeps capacity monotone in demand.
    cost = np.array([1e-6 if o.slots > 1 else o.usd_per_h - 1e-6 * o.rps / max_cap for o in offs])
    gang_cost = np.array([offs[j].usd_per_h * offs[j].slots for j in packed])
    # Unmet demand below 1e-3 req/s is noise; above it, it must outweigh buying any gang.
    big = 10.0 / RPS_TOLERANCE * max((o.usd_per_h * o.slots for o in offs), default=1.0) + 1.0
    # x: replicas per offering (integer); s: unmet rps per model; t: missing min replicas; g: gangs (integer)
    nv = nx + 2 * nm + ng
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
    for j in packed:
        row([(gvar[j], float(offs[j].slots)), (j, -1.0)], 0.0, np.inf)
    for f, lim in p.device_limits.items():
        js = [j for j, o in enumerate(offs) if o.flavor == f]
        if js:
            row([(gvar.get(j, j), float(offs[j].devices)) for j in js], -np.inf, lim)
    for f, lim in p.node_limits.items():
        js = [j for j, o in enumerate(offs) if o.flavor == f]
        if js:
            row([(gvar.get(j, j), float(offs[j].nodes)) for j in js], -np.inf, lim)
    for i in range(nm):
        for f, share in p.spot_share.items():
            js = [j for j in by_model[i] if offs[j].flavor == f]
            spot = [j for j in js if offs[j].capacity_type == CapacityType.SPOT]
            if spot:
                row([(j, (1 - share) if j in spot else -share) for j in js], -np.inf, 0.0)
    lb = np.concatenate([np.array([o.lb for o in offs], dtype=float), np.zeros(2 * nm + ng)])
    ub = np.concatenate([np.array([o.ub for o in offs], dtype=float), np.full(2 * nm + ng, np.inf)])
    integrality = np.concatenate([np.ones(nx), np.zeros(2 * nm), np.ones(ng)])

    a = coo_array((vals, (rows, cols)), shape=(len(lo), nv)).tocsr()
    cons = LinearConstraint(a, lo, hi)

    def run(c: np.ndarray, fallback: np.ndarray | None = None) -> np.ndarray:
        res = milp(c, constraints=cons, bounds=Bounds(lb, ub), integrality=integrality,
                   options={"mip_rel_gap": rel_gap, "time_limit": time_limit_s, "presolve": True})
        if res.x is None:
            if fallback is not None:  # out of time: the previous stage's answer is still feasible
                return fallback
            raise RuntimeError(f"MILP found no solution: {res.message}")
        return np.asarray(res.x)

    zeros_m = np.zeros(nm)
    x = run(np.concatenate([cost, np.full(nm, big), np.full(nm, big * 1e3), gang_cost]))
    if x[nx:nx + 2 * nm].max(initial=0.0) > RPS_TOLERANCE:
        # Limits bind: settle shortfalls by priority, then cost.
        for prio in sorted({n.priority for n in needs}, reverse=True):
            level = [i for i, n in enumerate(needs) if n.priority == prio]
            c = np.zeros(nv)
            for i in level:
                c[nx + i], c[nx + nm + i] = 1.0, 1e3
            x = run(c, x)
            for i in level:
                ub[nx + i] = max(x[nx + i], 0.0) + 1e-6
                ub[nx + nm + i] = max(x[nx + nm + i], 0.0) + 1e-6
        x = run(np.concatenate([cost, zeros_m, zeros_m, gang_cost]), x)
    counts = {j: int(v) for j, v in enumerate(np.round(x[:nx]).astype(int)) if v > 0}
    return _finish(p, counts, "exact")


def _finish(p: Problem, counts: dict[int, int], method: str) -> Solution:
    cap: dict[str, float] = {n.model: 0.0 for n in p.needs}
    cost = 0.0
    for j, k in counts.items():
        o = p.offerings[j]
        cap[o.model] += k * o.rps
        cost += -(-k // o.slots) * o.slots * o.usd_per_h  # whole gangs
    unmet = {n.model: n.rps - cap[n.model] for n in p.needs if cap[n.model] < n.rps - RPS_TOLERANCE}
    have: dict[str, int] = {n.model: 0 for n in p.needs}
    for j, k in counts.items():
        have[p.offerings[j].model] += k
    missing = {n.model: floor - have[n.model] for n in p.needs
               if have[n.model] < (floor := min(n.min_replicas, n.max_replicas))}
    return Solution(counts, unmet, cost, method, missing)


# --- heuristic ----------------------------------------------------------------------------------------------

_ANCHORS = 3  # per model: the units with the best $/req, tried as the bulk of a two-flavor cover
_WINDOW = 6  # replica counts of an anchor tried below its own single-flavor cover


@dataclass
class _Units:
    """Offerings grouped into units: one (model, flavor) with its on-demand and spot offering, priced jointly.

    n replicas of a unit put k of them on spot, k as large as the share, the bounds and the on-demand lower
    bound allow when spot is cheaper (as small as allowed otherwise); the rest run on-demand. Each part pays
    for the whole gangs it packs into (``slots`` replicas per gang).
    """

    need: np.ndarray  # need index per unit
    flavor: list[str]
    r: np.ndarray  # rps per replica
    dev: np.ndarray  # a replica's share of its gang's devices and nodes
    nodes: np.ndarray
    c_o: np.ndarray  # $/h per replica, on-demand (0 where the unit has none; then ub_o = 0)
    c_s: np.ndarray
    share: np.ndarray
    lb_o: np.ndarray
    ub_o: np.ndarray
    lb_s: np.ndarray
    ub_s: np.ndarray
    j_o: list[int]  # offering index, -1 when absent
    j_s: list[int]
    slots: np.ndarray  # replicas per gang

    @property
    def n0(self) -> np.ndarray:
        return self.lb_o + self.lb_s

    def spot_count(self, u: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(replicas on spot, feasible) for n replicas of units u (arrays of one shape)."""
        lb_o, ub_o, lb_s, ub_s = self.lb_o[u], self.ub_o[u], self.lb_s[u], self.ub_s[u]
        kmax = np.minimum(np.minimum(ub_s, np.floor(self.share[u] * n + 1e-9)), n - lb_o)
        kmin = np.maximum(lb_s, n - ub_o)
        k = np.where(self.c_s[u] < self.c_o[u], kmax, kmin)
        base = n == lb_o + lb_s  # what runs now is always allowed, even above a (lowered) spot share
        k = np.where(base, lb_s, k)
        return k, base | (kmin <= kmax)

    def cost(self, u: np.ndarray, n: np.ndarray) -> np.ndarray:
        """$/h of n replicas of units u; inf where no split of n meets the bounds and the spot share."""
        k, ok = self.spot_count(u, n)
        sl = self.slots[u]
        od, sp = np.ceil((n - k) / sl - 1e-9) * sl, np.ceil(k / sl - 1e-9) * sl
        return np.where(ok, od * self.c_o[u] + sp * self.c_s[u], np.inf)


def _units(p: Problem) -> _Units:
    need_idx = {n.model: i for i, n in enumerate(p.needs)}
    offs = p.offerings
    spot = CapacityType.SPOT
    if isinstance(offs, OfferingTable):
        model, flavor, ct = offs.model, offs.flavor, offs.capacity_type
        usd, rps, dev, nodes, lb, ub = offs.usd_per_h, offs.rps, offs.devices, offs.nodes, offs.lb, offs.ub
        unit, slots = offs.unit, offs.slots
    else:
        model = [o.model for o in offs]
        flavor = [o.flavor for o in offs]
        ct = [o.capacity_type for o in offs]
        usd, rps = [o.usd_per_h for o in offs], [o.rps for o in offs]
        dev, nodes = [o.devices for o in offs], [o.nodes for o in offs]
        lb, ub = [o.lb for o in offs], [o.ub for o in offs]
        unit, slots = None, [o.slots for o in offs]
    is_spot = np.fromiter((c == spot for c in ct), dtype=bool, count=len(ct))
    if unit is None:  # group (model, flavor, rps, devices, nodes); a duplicate gets a unit of its own
        index: dict[tuple[str, str, float, int, int], int] = {}
        seen: set[tuple[int, bool]] = set()
        ids: list[int] = []
        for j in range(len(model)):
            key = (model[j], flavor[j], rps[j], dev[j], nodes[j])
            s = bool(is_spot[j])
            u = index.get(key)
            if u is None or (u, s) in seen:
                u = index[key] = len(seen) + len(ids)  # unique: grows with every offering
            seen.add((u, s))
            ids.append(u)
        _, unit_arr = np.unique(np.asarray(ids, dtype=np.int64), return_inverse=True)
    else:  # a table's unit ids may skip numbers (offerings dropped after numbering): an empty unit would
        # be padded into some model's row of the candidate matrix and widen every row to the largest id
        _, unit_arr = np.unique(np.asarray(unit, dtype=np.int64), return_inverse=True)
    nu = int(unit_arr.max(initial=-1)) + 1
    first = np.full(nu, -1, dtype=np.int64)
    first[unit_arr[::-1]] = np.arange(len(unit_arr))[::-1]  # first offering of each unit
    f = lambda v: np.asarray(v, dtype=float)  # noqa: E731
    usd_a, lb_a, ub_a = f(usd), f(lb), f(ub)
    cols = {}
    for name, mask in (("o", ~is_spot), ("s", is_spot)):
        c, lo, hi = np.zeros(nu), np.zeros(nu), np.zeros(nu)
        j_of = np.full(nu, -1, dtype=np.int64)
        idx = np.nonzero(mask)[0]
        c[unit_arr[idx]], lo[unit_arr[idx]], hi[unit_arr[idx]] = usd_a[idx], lb_a[idx], ub_a[idx]
        j_of[unit_arr[idx]] = idx
        cols[name] = (c, lo, hi, j_of.tolist())
    uflavor = [flavor[j] for j in first.tolist()]
    share = f([p.spot_share.get(fl, 1.0) for fl in uflavor])  # no entry: the exact solver adds no share row
    # Limits count a replica's share of its gang here (exact for full gangs; the MILP counts whole gangs).
    per = f(slots)[first]
    return _Units(np.array([need_idx[model[j]] for j in first.tolist()], dtype=np.int64), uflavor,
                  f(rps)[first], f(dev)[first] / per, f(nodes)[first] / per, cols["o"][0], cols["s"][0], share,
                  cols["o"][1], cols["o"][2], cols["s"][1], cols["s"][2], cols["o"][3], cols["s"][3], per)


def solve_greedy(p: Problem) -> Solution:
    """Heuristic for problems too large for the MILP in a reconcile's time budget.

    1. Group offerings into units, one per (model, flavor): n replicas of a unit cost
       ``(n - k) * on_demand + k * spot`` with k = min(floor(share * n), spot upper bound, n - on-demand lower
       bound) when spot is cheaper, so on-demand and spot are chosen together and the spot share holds by
       construction. Lower bounds (replicas kept by the stability rules) are the starting point.
    2. For every model at once (numpy, models x units padded), enumerate candidate covers of the demand
       left after the lower bounds: every unit alone (ceil(rest / rps) replicas) and every pair
       (anchor, other) where the anchor is one of the ``_ANCHORS`` units with the best $/req and runs
       1..``_WINDOW`` replicas fewer than its own single cover, the other unit covering the remainder.
       Upper bounds, the spot share and max_replicas make a candidate infeasible.
    3. Allocate priority levels in order (highest first; by name within a level) under the flavors' shared
       device and node limits (lower bounds are reserved first): each model takes its cheapest candidate
       that still fits; when none fits, it fills greedily with what is left (best $/req first, or most rps
       per device first, whichever leaves less unmet), and reports the rest as unmet.
    4. min_replicas, per level after its demand: models still below it add their cheapest feasible replica
       until they reach it. If a limit leaves a floor unmet, the level is re-run with its floors placed
       before its demand and the answer missing fewer floors kept (the MILP's order: a higher level's
       demand outranks a lower level's floor; within a level a floor outranks demand). What is still
       missing is reported (``Solution.missing_min``).

    Pairs capture the usual gain over a single flavor (bulk on the best $/req, remainder on a right-sized
    flavor); on the benchmark instances the cost is within a few tenths of a percent of the MILP's.
    """
    needs = list(p.needs)
    nm = len(needs)
    U = _units(p)
    nu = len(U.need)
    n0 = U.n0
    cap0 = np.bincount(U.need, weights=n0 * U.r, minlength=nm)
    cnt0 = np.bincount(U.need, weights=n0, minlength=nm)
    rest = np.array([n.rps for n in needs], dtype=float) - RPS_TOLERANCE - cap0
    budget = np.array([n.max_replicas for n in needs], dtype=float) - cnt0
    extra = np.zeros(nu)  # replicas added on top of n0

    # Shared limits, with what runs now reserved first.
    dev_left = {f: float(v) for f, v in p.device_limits.items()}
    node_left = {f: float(v) for f, v in p.node_limits.items()}
    for u in np.nonzero(n0)[0]:
        f = U.flavor[u]
        if f in dev_left:
            dev_left[f] -= n0[u] * U.dev[u]
        if f in node_left:
            node_left[f] -= n0[u] * U.nodes[u]

    # Candidates, for all models at once: a [models x units] matrix of unit indices (-1: padding).
    best_s = np.zeros(0, dtype=np.int64)
    if nu:
        order = np.argsort(U.need, kind="stable")
        per = np.bincount(U.need, minlength=nm)
        width = int(per.max(initial=1))
        start = np.concatenate([[0], np.cumsum(per)[:-1]])
        pos = np.arange(nu) - np.repeat(start, per)
        mat = np.full((nm, width), -1, dtype=np.int64)
        mat[U.need[order], pos] = order
        valid = mat >= 0
        um = np.where(valid, mat, 0)
        r = U.r[um]
        rest_m = rest[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            a1 = np.where(valid & (r > 0), np.ceil(np.maximum(rest_m, 0.0) / r), np.inf)
        a1 = np.where(rest_m > 0, a1, 0.0)
        ok1 = np.isfinite(a1) & (a1 <= budget[:, None]) & valid
        a1f = np.where(ok1, a1, 0.0)
        base_cost = U.cost(um, n0[um])
        d1 = np.where(ok1, U.cost(um, n0[um] + a1f) - base_cost, np.inf)
        # Anchors: best $/req among single covers.
        with np.errstate(divide="ignore", invalid="ignore"):
            per_req = np.where(ok1 & (a1f > 0), d1 / (a1f * r), np.inf)
        k = min(_ANCHORS, width)
        anc = np.argsort(per_req, axis=1, kind="stable")[:, :k]  # column positions [nm, k]
        rows = np.arange(nm)[:, None]
        a_anc = a1f[rows, anc]  # [nm, k]
        w = np.arange(1, _WINDOW + 1)
        aA = a_anc[:, :, None] - w[None, None, :]  # [nm, k, W]
        uA = um[rows, anc]  # [nm, k]
        okA = (aA >= 1) & np.isfinite(per_req[rows, anc])[:, :, None]
        aA = np.where(okA, aA, 0.0)
        rA = U.r[uA][:, :, None]
        dA = U.cost(np.broadcast_to(uA[:, :, None], aA.shape), n0[uA][:, :, None] + aA) - base_cost[rows, anc][:, :, None]
        restB = (rest_m[:, :, None] - aA * rA)[..., None]  # [nm, k, W, 1]
        rB = r[:, None, None, :]  # [nm, 1, 1, width]
        with np.errstate(divide="ignore", invalid="ignore"):
            aB = np.where(valid[:, None, None, :] & (rB > 0), np.ceil(restB / rB), np.inf)
        okB = (okA[..., None] & np.isfinite(aB) & (anc[:, :, None, None] != np.arange(width)[None, None, None, :])
               & (aA[..., None] + aB <= budget[:, None, None, None]) & (aB >= 1))
        aB = np.where(okB, aB, 0.0)
        umB = np.broadcast_to(um[:, None, None, :], aB.shape)
        dB = U.cost(umB, n0[umB] + aB) - base_cost[:, None, None, :]
        d2 = np.where(okB, dA[..., None] + dB, np.inf)
        # Flatten: columns [singles | pairs]; each candidate is (unit A, count A, unit B, count B).
        cost = np.concatenate([d1, d2.reshape(nm, -1)], axis=1)
        cand_uA = np.concatenate([um, np.broadcast_to(uA[:, :, None, None], d2.shape).reshape(nm, -1)], axis=1)
        cand_aA = np.concatenate([a1f, np.broadcast_to(aA[..., None], d2.shape).reshape(nm, -1)], axis=1)
        cand_uB = np.concatenate([np.full((nm, width), -1), umB.reshape(nm, -1)], axis=1)
        cand_aB = np.concatenate([np.zeros((nm, width)), aB.reshape(nm, -1)], axis=1)
        best_s = np.argmin(cost, axis=1)
    limited = set(dev_left) | set(node_left)

    def fits(moves: list[tuple[int, float]]) -> bool:
        use_d: dict[str, float] = {}
        use_n: dict[str, float] = {}
        for u, a in moves:
            f = U.flavor[u]
            if f in dev_left:
                use_d[f] = use_d.get(f, 0.0) + a * U.dev[u]
            if f in node_left:
                use_n[f] = use_n.get(f, 0.0) + a * U.nodes[u]
        return all(v <= dev_left[f] + 1e-9 for f, v in use_d.items()) and all(
            v <= node_left[f] + 1e-9 for f, v in use_n.items())

    def take(u: int, a: float) -> None:
        extra[u] += a
        f = U.flavor[u]
        if f in dev_left:
            dev_left[f] -= a * U.dev[u]
        if f in node_left:
            node_left[f] -= a * U.nodes[u]

    def room(u: int) -> float:
        f = U.flavor[u]
        n = np.inf
        if f in dev_left:
            n = min(n, max(dev_left[f], 0.0) // max(U.dev[u], 1.0))
        if f in node_left:
            n = min(n, (max(node_left[f], 0.0) + 1e-9) // max(U.nodes[u], 1e-9))
        return n

    # Scalar twins of _Units.spot_count/cost (same rules) for the per-model fallbacks below.
    L = {k: getattr(U, k).tolist() for k in ("lb_o", "ub_o", "lb_s", "ub_s", "share", "c_o", "c_s", "slots")}

    def split(u: int, n: float) -> tuple[float, bool]:
        lb_o, ub_o, lb_s = L["lb_o"][u], L["ub_o"][u], L["lb_s"][u]
        if n == lb_o + lb_s:
            return lb_s, True
        kmax = min(L["ub_s"][u], math.floor(L["share"][u] * n + 1e-9), n - lb_o)
        kmin = max(lb_s, n - ub_o)
        return (kmax if L["c_s"][u] < L["c_o"][u] else kmin), kmin <= kmax

    def feasible_n(u: int, n: float) -> bool:
        return split(u, n)[1]

    def unit_cost(u: int, n: float) -> float:
        k, ok = split(u, n)
        sl = L["slots"][u]
        whole = lambda m: math.ceil(m / sl - 1e-9) * sl  # noqa: E731
        return whole(n - k) * L["c_o"][u] + whole(k) * L["c_s"][u] if ok else math.inf

    mine: dict[int, list[int]] = {}
    for u in range(nu):
        mine.setdefault(int(U.need[u]), []).append(u)

    def fill(i: int, units: list[int]) -> tuple[float, float, list[tuple[int, float]]]:
        """Greedy fill of model i's remaining demand over units in this order, within every limit."""
        base = {u: n0[u] + extra[u] for u in mine[i]}  # extra > 0 only once the model's floor is placed
        left = rest[i] - sum(extra[u] * U.r[u] for u in mine[i])
        left_n = budget[i] - sum(extra[u] for u in mine[i])
        moves: list[tuple[int, float]] = []
        used_d: dict[str, float] = {}
        used_n: dict[str, float] = {}
        dcost = 0.0
        for u in units:
            if left <= 0 or left_n <= 0:
                break
            f = U.flavor[u]
            lim = min(left_n, np.ceil(left / U.r[u]))
            if f in dev_left:
                lim = min(lim, max(dev_left[f] - used_d.get(f, 0.0), 0.0) // max(U.dev[u], 1.0))
            if f in node_left:
                lim = min(lim, (max(node_left[f] - used_n.get(f, 0.0), 0.0) + 1e-9) // max(U.nodes[u], 1e-9))
            a = lim
            while a > 0 and not feasible_n(u, base[u] + a):
                a -= 1
            if a <= 0:
                continue
            moves.append((u, a))
            used_d[f] = used_d.get(f, 0.0) + a * U.dev[u]
            used_n[f] = used_n.get(f, 0.0) + a * U.nodes[u]
            left -= a * U.r[u]
            left_n -= a
            dcost += unit_cost(u, base[u] + a) - unit_cost(u, base[u])
        return max(left, 0.0), dcost, moves

    def fill_best(i: int) -> list[tuple[int, float]]:
        """The better of two greedy fills: best $/req first, or most rps per device first."""
        us = [u for u in mine[i] if U.r[u] > 0]
        by_price = sorted(us, key=lambda u: (U.c_o[u] if U.ub_o[u] > 0 else U.c_s[u]) / U.r[u])
        by_dev = sorted(us, key=lambda u: -U.r[u] / max(U.dev[u], 1.0))
        fills = [fill(i, by_price), fill(i, by_dev)]
        return min(fills, key=lambda t: (round(t[0], 9), t[1]))[2]

    fnames = sorted(set(U.flavor))
    fpos = {f: i for i, f in enumerate(fnames)}
    fid = np.array([fpos[f] for f in U.flavor], dtype=np.int64)

    def _cheapest_fitting(i: int) -> int:
        dl = np.fromiter((dev_left.get(f, np.inf) for f in fnames), float, len(fnames)) + 1e-9
        nl = np.fromiter((node_left.get(f, np.inf) for f in fnames), float, len(fnames)) + 1e-9
        ua, aa, ub_, ab = cand_uA[i], cand_aA[i], cand_uB[i], cand_aB[i]
        hasb = ub_ >= 0
        ubx = np.where(hasb, ub_, 0)
        fa, fb = fid[ua], fid[ubx]
        same = hasb & (fa == fb)
        ok = np.isfinite(cost[i])
        for per, left in ((U.dev, dl), (U.nodes, nl)):
            xa = aa * per[ua]
            xb = np.where(hasb, ab * per[ubx], 0.0)
            ok &= (xa + np.where(same, xb, 0.0) <= left[fa]) & (xb + np.where(same, xa, 0.0) <= left[fb])
        c = np.where(ok, cost[i], np.inf)
        s = int(np.argmin(c))
        return s if np.isfinite(c[s]) else -1

    def cover(i: int) -> None:
        """Model i's demand: its cheapest candidate cover that fits, else a greedy fill."""
        if rest[i] <= 0 or i not in mine:
            return
        chosen: list[tuple[int, float]] | None = None
        s = int(best_s[i])
        if np.isfinite(cost[i, s]):
            moves = [(int(cand_uA[i, s]), float(cand_aA[i, s]))]
            if cand_uB[i, s] >= 0:
                moves.append((int(cand_uB[i, s]), float(cand_aB[i, s])))
            if not limited or fits(moves):
                chosen = moves
            else:  # a limit binds: the cheapest candidate that still fits, checked for the whole row at once
                s = _cheapest_fitting(i)
                if s >= 0:
                    chosen = [(int(cand_uA[i, s]), float(cand_aA[i, s]))]
                    if cand_uB[i, s] >= 0:
                        chosen.append((int(cand_uB[i, s]), float(cand_aB[i, s])))
        if chosen is None:
            chosen = fill_best(i)
        for u, a in chosen:
            if a > 0:
                take(u, a)

    def top_up(i: int) -> int:
        """Cheapest feasible replicas, one at a time, until model i reaches its min_replicas; how many it
        still lacks when no flavor has room."""
        have = cnt0[i] + sum(extra[u] for u in mine.get(i, []))
        floor = min(needs[i].min_replicas, needs[i].max_replicas)
        while have < floor:
            best: tuple[tuple[float, float], int] | None = None
            for u in mine.get(i, []):
                if room(u) < 1 or not feasible_n(u, n0[u] + extra[u] + 1):
                    continue
                # Equal cost: the flavor with the most room left, so a floor leaves scarce devices to others.
                dc = (unit_cost(u, n0[u] + extra[u] + 1) - unit_cost(u, n0[u] + extra[u]), -room(u))
                if best is None or dc < best[0]:
                    best = (dc, u)
            if best is None:
                break
            take(best[1], 1.0)
            have += 1
        return int(max(floor - have, 0))

    def snapshot() -> tuple[np.ndarray, dict[str, float], dict[str, float]]:
        return extra.copy(), dict(dev_left), dict(node_left)

    def restore(s: tuple[np.ndarray, dict[str, float], dict[str, float]]) -> None:
        extra[:] = s[0]
        dev_left.clear()
        dev_left.update(s[1])
        node_left.clear()
        node_left.update(s[2])

    # Priority levels, highest first (the MILP's lexicographic order): demand, then min_replicas. Placing
    # demand first keeps floors from pinning a costlier flavor; when a limit then leaves a floor unmet, the
    # level is re-run with its floors reserved first (a floor outranks demand within a level, as in the MILP).
    for prio in sorted({n.priority for n in needs}, reverse=True):
        level = sorted((i for i in range(nm) if needs[i].priority == prio), key=lambda i: needs[i].model)
        before = snapshot()
        for i in level:
            cover(i)
        short = sum(top_up(i) for i in level)
        if short:
            first = snapshot()
            restore(before)
            # The most constrained models (fewest flavors with room) place their floors first.
            short_floor_first = sum(top_up(i) for i in sorted(
                level, key=lambda i: sum(room(u) >= 1 for u in mine.get(i, []))))
            for i in level:
                if i in mine:
                    for u, a in fill_best(i):
                        take(u, a)
            if short_floor_first >= short:
                restore(first)
    # Units back to offerings.
    counts: dict[int, int] = {}
    if nu:
        n_all = n0 + extra
        ks, _ = U.spot_count(np.arange(nu), n_all)
        for u in np.nonzero(n_all)[0]:
            k, tot_u = int(ks[u]), int(n_all[u])
            if U.j_s[u] >= 0 and k > 0:
                counts[U.j_s[u]] = k
            if U.j_o[u] >= 0 and tot_u - k > 0:
                counts[U.j_o[u]] = tot_u - k
    return _finish(p, counts, "greedy")


# Measured (bench/results/planner.md, 2 cores): the MILP takes ~20-40 ms for one model x 20 flavors
# (~30 offerings) but 0.3-1 s at 10 models and hits its time limit at 100, while the heuristic matched
# or beat it on every bench instance; past ~2 models' worth of offerings exact no longer pays.
EXACT_MAX_VARS = 64


def solve(p: Problem, exact_max_vars: int = EXACT_MAX_VARS) -> Solution:
    """Exact (MILP) up to ``exact_max_vars`` offerings, the heuristic (``solve_greedy``) beyond."""
    if len(p.offerings) <= exact_max_vars:
        return solve_exact(p)
    return solve_greedy(p)
