"""The greedy heuristic for problems too large for the MILP in a reconcile's time budget (``solve_greedy``).

Offerings are grouped into units (one (model, flavor), on-demand and spot priced jointly); every model's
candidate covers are enumerated at once with numpy; priority levels are then allocated in order under the
flavors' shared limits, one model at a time, by small functions over one ``_Greedy`` state record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rayscale.core.catalog import CapacityType
from rayscale.core.problem import RPS_TOLERANCE, ModelNeed, OfferingTable, Problem, Solution, finish

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
    rps: np.ndarray  # per replica added (_added_rps)
    kept_rps: np.ndarray  # what the replicas the lower bounds keep serve, each at its capacity type's rate
    devices: np.ndarray  # a replica's share of its gang's devices and nodes
    nodes: np.ndarray
    usd_od: np.ndarray  # $/h per replica, on-demand (0 where the unit has none; then ub_o = 0)
    usd_spot: np.ndarray
    share: np.ndarray
    lb_o: np.ndarray
    ub_o: np.ndarray
    lb_s: np.ndarray
    ub_s: np.ndarray
    offering_od: list[int]  # offering index, -1 when absent
    offering_spot: list[int]
    slots: np.ndarray  # replicas per gang

    @property
    def kept(self) -> np.ndarray:
        """Replicas per unit the lower bounds keep."""
        return self.lb_o + self.lb_s

    def spot_count(self, u: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(replicas on spot, feasible) for n replicas of units u (arrays of one shape)."""
        lb_o, ub_o, lb_s, ub_s = self.lb_o[u], self.ub_o[u], self.lb_s[u], self.ub_s[u]
        kmax = np.minimum(np.minimum(ub_s, np.floor(self.share[u] * n + 1e-9)), n - lb_o)
        kmin = np.maximum(lb_s, n - ub_o)
        k = np.where(self.usd_spot[u] < self.usd_od[u], kmax, kmin)
        base = n == lb_o + lb_s  # what runs now is always allowed, even above a (lowered) spot share
        k = np.where(base, lb_s, k)
        return k, base | (kmin <= kmax)

    def cost(self, u: np.ndarray, n: np.ndarray) -> np.ndarray:
        """$/h of n replicas of units u; inf where no split of n meets the bounds and the spot share."""
        k, ok = self.spot_count(u, n)
        sl = self.slots[u]
        od, sp = np.ceil((n - k) / sl - 1e-9) * sl, np.ceil(k / sl - 1e-9) * sl
        return np.where(ok, od * self.usd_od[u] + sp * self.usd_spot[u], np.inf)


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
    floats = lambda v: np.asarray(v, dtype=float)  # noqa: E731
    usd_a, lb_a, ub_a = floats(usd), floats(lb), floats(ub)
    cols = {}
    rps_a = floats(rps)
    for name, mask in (("o", ~is_spot), ("s", is_spot)):
        c, lo, hi, r = np.zeros(nu), np.zeros(nu), np.zeros(nu), np.zeros(nu)
        j_of = np.full(nu, -1, dtype=np.int64)
        idx = np.nonzero(mask)[0]
        c[unit_arr[idx]], lo[unit_arr[idx]], hi[unit_arr[idx]] = usd_a[idx], lb_a[idx], ub_a[idx]
        r[unit_arr[idx]] = rps_a[idx]
        j_of[unit_arr[idx]] = idx
        cols[name] = (c, lo, hi, j_of.tolist(), r)
    added_rps, ub_spot = _added_rps(cols["o"][4], cols["s"][4], cols["o"][1], cols["o"][2], cols["s"][1], cols["s"][2])
    kept_rps = cols["o"][1] * cols["o"][4] + cols["s"][1] * cols["s"][4]
    uflavor = [flavor[j] for j in first.tolist()]
    share = floats([p.spot_share.get(fl, 1.0) for fl in uflavor])  # no entry: the exact solver adds no share row
    # Limits count a replica's share of its gang here (exact for full gangs; the MILP counts whole gangs).
    per = floats(slots)[first]
    return _Units(np.array([need_idx[model[j]] for j in first.tolist()], dtype=np.int64), uflavor,
                  added_rps, kept_rps, floats(dev)[first] / per, floats(nodes)[first] / per, cols["o"][0],
                  cols["s"][0], share,
                  cols["o"][1], cols["o"][2], cols["s"][1], ub_spot, cols["o"][3], cols["s"][3], per)


def _added_rps(rps_o: np.ndarray, rps_s: np.ndarray, lb_o: np.ndarray, ub_o: np.ndarray, lb_s: np.ndarray,
               ub_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(req/s a replica added to each unit counts for, the spot upper bounds). A spot replica may count for
    less than an on-demand one (the interruptions seen, rayscale.core.plan): one that counts for nothing is
    never added, and where both may be added each counts at the lower rate, which the spot/on-demand split
    chosen later cannot then undercut."""
    ub_s = np.where(rps_s > 0, ub_s, np.minimum(ub_s, lb_s))
    can_o, can_s = ub_o > lb_o, ub_s > lb_s
    both = np.minimum(np.where(rps_o > 0, rps_o, rps_s), np.where(rps_s > 0, rps_s, rps_o))
    return np.where(can_o & can_s, both, np.where(can_s, rps_s, np.where(can_o, rps_o, np.maximum(rps_o, rps_s)))), ub_s




@dataclass(frozen=True)
class _ScalarUnits:
    """Scalar twins of ``_Units.spot_count`` / ``_Units.cost`` (same rules) over Python lists: the per-model
    fallbacks look at one unit at a time, where indexing numpy arrays costs more than the arithmetic."""

    lb_o: list[float]
    ub_o: list[float]
    lb_s: list[float]
    ub_s: list[float]
    share: list[float]
    usd_od: list[float]
    usd_spot: list[float]
    slots: list[float]

    @classmethod
    def of(cls, units: _Units) -> _ScalarUnits:
        fields = ("lb_o", "ub_o", "lb_s", "ub_s", "share", "usd_od", "usd_spot", "slots")
        return cls(*(getattr(units, k).tolist() for k in fields))

    def split(self, u: int, n: float) -> tuple[float, bool]:
        """(replicas on spot, feasible) for n replicas of unit u."""
        lb_o, ub_o, lb_s = self.lb_o[u], self.ub_o[u], self.lb_s[u]
        if n == lb_o + lb_s:
            return lb_s, True
        kmax = min(self.ub_s[u], math.floor(self.share[u] * n + 1e-9), n - lb_o)
        kmin = max(lb_s, n - ub_o)
        return (kmax if self.usd_spot[u] < self.usd_od[u] else kmin), kmin <= kmax

    def feasible(self, u: int, n: float) -> bool:
        return self.split(u, n)[1]

    def cost(self, u: int, n: float) -> float:
        k, ok = self.split(u, n)
        per_gang = self.slots[u]
        whole = lambda m: math.ceil(m / per_gang - 1e-9) * per_gang  # noqa: E731
        return whole(n - k) * self.usd_od[u] + whole(k) * self.usd_spot[u] if ok else math.inf


Move = tuple[int, float]  # (unit, replicas added)


@dataclass(frozen=True)
class _Candidates:
    """Candidate covers of every model's remaining demand, one row per model (numpy, [models x candidates]):
    candidate s adds ``count_a[s]`` replicas of ``unit_a[s]`` and, where ``unit_b[s] >= 0``, ``count_b[s]`` of
    ``unit_b[s]``, for ``cost[s]`` more $/h (inf: infeasible). Columns: every unit alone, then the pairs."""

    cost: np.ndarray
    unit_a: np.ndarray
    count_a: np.ndarray
    unit_b: np.ndarray
    count_b: np.ndarray
    cheapest: np.ndarray  # per row: the column of least cost
    row_of: np.ndarray  # per model: its row (-1: none; it had no demand left to cover)

    def moves(self, row: int, s: int) -> list[Move]:
        out = [(int(self.unit_a[row, s]), float(self.count_a[row, s]))]
        if self.unit_b[row, s] >= 0:
            out.append((int(self.unit_b[row, s]), float(self.count_b[row, s])))
        return out


@dataclass(frozen=True)
class _Singles:
    """Each unit alone covering its model's remaining demand, as [models x width] matrices (see _unit_matrix)."""

    rate: np.ndarray  # req/s per replica
    count: np.ndarray  # replicas added (0 where infeasible)
    feasible: np.ndarray
    cost: np.ndarray  # $/h added (inf where infeasible)
    kept_cost: np.ndarray  # $/h of what the unit keeps
    per_req: np.ndarray  # $/h added per req/s added (inf where none)


def _unit_matrix(need: np.ndarray, n_models: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Units ``ids`` by model (``need``: each one's row), padded: ([models x width] unit indices, 0 in padding;
    which entries are real)."""
    order = np.argsort(need, kind="stable")
    per = np.bincount(need, minlength=n_models)
    width = int(per.max(initial=1))
    start = np.cumsum(per) - per
    pos = np.arange(len(need)) - np.repeat(start, per)
    mat = np.full((n_models, width), -1, dtype=np.int64)
    mat[need[order], pos] = ids[order]
    valid = mat >= 0
    return np.where(valid, mat, 0), valid


def _single_covers(units: _Units, kept: np.ndarray, rest: np.ndarray, budget: np.ndarray, um: np.ndarray,
                   valid: np.ndarray) -> _Singles:
    r = units.rps[um]
    rest_m = rest[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        count = np.where(valid & (r > 0), np.ceil(np.maximum(rest_m, 0.0) / r), np.inf)
    count = np.where(rest_m > 0, count, 0.0)
    ok = np.isfinite(count) & (count <= budget[:, None]) & valid
    count = np.where(ok, count, 0.0)
    kept_cost = units.cost(um, kept[um])
    cost = np.where(ok, units.cost(um, kept[um] + count) - kept_cost, np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        per_req = np.where(ok & (count > 0), cost / (count * r), np.inf)
    return _Singles(r, count, ok, cost, kept_cost, per_req)


def _candidates(units: _Units, kept: np.ndarray, rest_all: np.ndarray, budget_all: np.ndarray) -> _Candidates:
    """Singles, and pairs: an anchor (one of the ``_ANCHORS`` units with the best $/req) running 1..``_WINDOW``
    replicas fewer than its single cover, another unit covering the remainder. Only for the models with
    demand left to cover (a row each): in a steady control loop that is few of them."""
    todo = np.flatnonzero(rest_all > 0)
    row_of = np.full(len(rest_all), -1, dtype=np.int64)
    row_of[todo] = np.arange(len(todo))
    n_models, rest, budget = len(todo), rest_all[todo], budget_all[todo]
    if not n_models:
        none = np.zeros((0, 0))
        return _Candidates(none, none.astype(np.int64), none, none.astype(np.int64), none,
                           np.zeros(0, dtype=np.int64), row_of)
    ids = np.flatnonzero(row_of[units.need] >= 0)
    um, valid = _unit_matrix(row_of[units.need[ids]], n_models, ids)
    one = _single_covers(units, kept, rest, budget, um, valid)
    width = um.shape[1]
    anc = np.argsort(one.per_req, axis=1, kind="stable")[:, :min(_ANCHORS, width)]  # column positions
    rows = np.arange(n_models)[:, None]
    count_a = one.count[rows, anc][:, :, None] - np.arange(1, _WINDOW + 1)[None, None, :]  # [models, k, W]
    unit_a = um[rows, anc]
    ok_a = (count_a >= 1) & np.isfinite(one.per_req[rows, anc])[:, :, None]
    count_a = np.where(ok_a, count_a, 0.0)
    cost_a = (units.cost(np.broadcast_to(unit_a[:, :, None], count_a.shape), kept[unit_a][:, :, None] + count_a)
              - one.kept_cost[rows, anc][:, :, None])
    rest_b = (rest[:, None, None] - count_a * units.rps[unit_a][:, :, None])[..., None]  # [models, k, W, 1]
    rate_b = one.rate[:, None, None, :]  # [models, 1, 1, width]
    with np.errstate(divide="ignore", invalid="ignore"):
        count_b = np.where(valid[:, None, None, :] & (rate_b > 0), np.ceil(rest_b / rate_b), np.inf)
    ok_b = (ok_a[..., None] & np.isfinite(count_b) & (anc[:, :, None, None] != np.arange(width)[None, None, None, :])
            & (count_a[..., None] + count_b <= budget[:, None, None, None]) & (count_b >= 1))
    count_b = np.where(ok_b, count_b, 0.0)
    unit_b = np.broadcast_to(um[:, None, None, :], count_b.shape)
    cost_b = units.cost(unit_b, kept[unit_b] + count_b) - one.kept_cost[:, None, None, :]
    pair_cost = np.where(ok_b, cost_a[..., None] + cost_b, np.inf)
    shape = pair_cost.shape

    def flat(single: np.ndarray, pair: np.ndarray) -> np.ndarray:
        return np.concatenate([single, np.broadcast_to(pair, shape).reshape(n_models, -1)], axis=1)

    cost = flat(one.cost, pair_cost)
    return _Candidates(cost, flat(um, unit_a[:, :, None, None]), flat(one.count, count_a[..., None]),
                       flat(np.full((n_models, width), -1), unit_b), flat(np.zeros((n_models, width)), count_b),
                       np.argmin(cost, axis=1), row_of)


@dataclass
class _Greedy:
    """One greedy solve's working state: replicas added per unit on top of what the lower bounds keep, and
    what the flavors' device and node limits have left."""

    units: _Units
    scalar: _ScalarUnits
    needs: list[ModelNeed]
    kept: np.ndarray  # replicas per unit the lower bounds keep
    kept_per_model: np.ndarray
    rest: np.ndarray  # demand per model the kept replicas leave uncovered (less the tolerance)
    budget: np.ndarray  # replicas per model max_replicas allows beyond the kept ones
    added: np.ndarray  # replicas per unit added so far
    devices_left: dict[str, float]
    nodes_left: dict[str, float]
    units_of: dict[int, list[int]]  # model -> its units
    candidates: _Candidates | None  # None: no units at all
    flavor_names: list[str]
    flavor_id: np.ndarray  # per unit: its flavor's position in flavor_names

    @property
    def limited(self) -> bool:
        return bool(self.devices_left or self.nodes_left)


def _start(p: Problem) -> _Greedy:
    needs = list(p.needs)
    nm = len(needs)
    units = _units(p)
    kept = units.kept
    rest = np.array([n.rps for n in needs], dtype=float) - RPS_TOLERANCE - np.bincount(
        units.need, weights=units.kept_rps, minlength=nm)
    kept_per_model = np.bincount(units.need, weights=kept, minlength=nm)
    budget = np.array([n.max_replicas for n in needs], dtype=float) - kept_per_model
    # Shared limits, with what runs now reserved first.
    devices_left = {f: float(v) for f, v in p.device_limits.items()}
    nodes_left = {f: float(v) for f, v in p.node_limits.items()}
    for u in np.nonzero(kept)[0]:
        f = units.flavor[u]
        if f in devices_left:
            devices_left[f] -= kept[u] * units.devices[u]
        if f in nodes_left:
            nodes_left[f] -= kept[u] * units.nodes[u]
    units_of: dict[int, list[int]] = {}
    for u in range(len(units.need)):
        units_of.setdefault(int(units.need[u]), []).append(u)
    names = sorted(set(units.flavor))
    pos = {f: i for i, f in enumerate(names)}
    return _Greedy(units, _ScalarUnits.of(units), needs, kept, kept_per_model, rest, budget,
                   np.zeros(len(units.need)), devices_left, nodes_left, units_of,
                   _candidates(units, kept, rest, budget) if len(units.need) else None, names,
                   np.array([pos[f] for f in units.flavor], dtype=np.int64))


def _fits(st: _Greedy, moves: list[Move]) -> bool:
    use_d: dict[str, float] = {}
    use_n: dict[str, float] = {}
    for u, a in moves:
        f = st.units.flavor[u]
        if f in st.devices_left:
            use_d[f] = use_d.get(f, 0.0) + a * st.units.devices[u]
        if f in st.nodes_left:
            use_n[f] = use_n.get(f, 0.0) + a * st.units.nodes[u]
    return all(v <= st.devices_left[f] + 1e-9 for f, v in use_d.items()) and all(
        v <= st.nodes_left[f] + 1e-9 for f, v in use_n.items())


def _take(st: _Greedy, u: int, a: float) -> None:
    st.added[u] += a
    f = st.units.flavor[u]
    if f in st.devices_left:
        st.devices_left[f] -= a * st.units.devices[u]
    if f in st.nodes_left:
        st.nodes_left[f] -= a * st.units.nodes[u]


def _room(st: _Greedy, u: int) -> float:
    """Replicas of unit u the limits still allow."""
    f = st.units.flavor[u]
    n = np.inf
    if f in st.devices_left:
        n = min(n, max(st.devices_left[f], 0.0) // max(st.units.devices[u], 1.0))
    if f in st.nodes_left:
        n = min(n, (max(st.nodes_left[f], 0.0) + 1e-9) // max(st.units.nodes[u], 1e-9))
    return n


def _fill(st: _Greedy, i: int, order: list[int]) -> tuple[float, float, list[Move]]:
    """Greedy fill of model i's remaining demand over its units in ``order``, within every limit:
    (demand still unmet, $/h added, moves)."""
    units, mine = st.units, st.units_of[i]
    base = {u: st.kept[u] + st.added[u] for u in mine}  # added > 0 only once the model's floor is placed
    left = st.rest[i] - sum(st.added[u] * units.rps[u] for u in mine)
    left_n = st.budget[i] - sum(st.added[u] for u in mine)
    moves: list[Move] = []
    used_d: dict[str, float] = {}
    used_n: dict[str, float] = {}
    dcost = 0.0
    for u in order:
        if left <= 0 or left_n <= 0:
            break
        f = units.flavor[u]
        a = min(left_n, np.ceil(left / units.rps[u]))
        if f in st.devices_left:
            a = min(a, max(st.devices_left[f] - used_d.get(f, 0.0), 0.0) // max(units.devices[u], 1.0))
        if f in st.nodes_left:
            a = min(a, (max(st.nodes_left[f] - used_n.get(f, 0.0), 0.0) + 1e-9) // max(units.nodes[u], 1e-9))
        while a > 0 and not st.scalar.feasible(u, base[u] + a):
            a -= 1
        if a <= 0:
            continue
        moves.append((u, a))
        used_d[f] = used_d.get(f, 0.0) + a * units.devices[u]
        used_n[f] = used_n.get(f, 0.0) + a * units.nodes[u]
        left -= a * units.rps[u]
        left_n -= a
        dcost += st.scalar.cost(u, base[u] + a) - st.scalar.cost(u, base[u])
    return max(left, 0.0), dcost, moves


def _fill_best(st: _Greedy, i: int) -> list[Move]:
    """The better of two greedy fills: best $/req first, or most rps per device first."""
    units = st.units
    us = [u for u in st.units_of[i] if units.rps[u] > 0]
    by_price = sorted(us, key=lambda u: (units.usd_od[u] if units.ub_o[u] > 0 else units.usd_spot[u]) / units.rps[u])
    by_dev = sorted(us, key=lambda u: -units.rps[u] / max(units.devices[u], 1.0))
    fills = [_fill(st, i, by_price), _fill(st, i, by_dev)]
    return min(fills, key=lambda t: (round(t[0], 9), t[1]))[2]


def _cheapest_fitting(st: _Greedy, c: _Candidates, i: int) -> int:
    """Row i's cheapest candidate that fits the limits left (-1: none), checked for the whole row at once."""
    units, names = st.units, st.flavor_names
    dl = np.fromiter((st.devices_left.get(f, np.inf) for f in names), float, len(names)) + 1e-9
    nl = np.fromiter((st.nodes_left.get(f, np.inf) for f in names), float, len(names)) + 1e-9
    ua, aa, ub, ab = c.unit_a[i], c.count_a[i], c.unit_b[i], c.count_b[i]
    has_b = ub >= 0
    ubx = np.where(has_b, ub, 0)
    fa, fb = st.flavor_id[ua], st.flavor_id[ubx]
    same = has_b & (fa == fb)
    ok = np.isfinite(c.cost[i])
    for per, left in ((units.devices, dl), (units.nodes, nl)):
        xa = aa * per[ua]
        xb = np.where(has_b, ab * per[ubx], 0.0)
        ok &= (xa + np.where(same, xb, 0.0) <= left[fa]) & (xb + np.where(same, xa, 0.0) <= left[fb])
    cost = np.where(ok, c.cost[i], np.inf)
    s = int(np.argmin(cost))
    return s if np.isfinite(cost[s]) else -1


def _cover(st: _Greedy, i: int) -> None:
    """Model i's demand: its cheapest candidate cover that fits, else a greedy fill."""
    c = st.candidates
    if st.rest[i] <= 0 or i not in st.units_of or c is None:
        return
    # Every flavor it may use is full (a large fleet at its limits: most of the short models). Where one more
    # replica of a unit does not fit, no move on it does, and _room is 0: neither path below could add any.
    if st.limited and not any(_fits(st, [(u, 1.0)]) for u in st.units_of[i]):
        return
    chosen: list[Move] | None = None
    row = int(c.row_of[i])
    s = int(c.cheapest[row])
    if np.isfinite(c.cost[row, s]):
        moves = c.moves(row, s)
        if not st.limited or _fits(st, moves):
            chosen = moves
        elif (s := _cheapest_fitting(st, c, row)) >= 0:
            chosen = c.moves(row, s)
    for u, a in chosen if chosen is not None else _fill_best(st, i):
        if a > 0:
            _take(st, u, a)


def _top_up(st: _Greedy, i: int) -> int:
    """Cheapest feasible replicas, one at a time, until model i reaches its min_replicas; how many it
    still lacks when no flavor has room."""
    mine = st.units_of.get(i, [])
    have = st.kept_per_model[i] + sum(st.added[u] for u in mine)
    floor = min(st.needs[i].min_replicas, st.needs[i].max_replicas)
    while have < floor:
        best: tuple[tuple[float, float], int] | None = None
        for u in mine:
            n = st.kept[u] + st.added[u]
            if _room(st, u) < 1 or not st.scalar.feasible(u, n + 1):
                continue
            # Equal cost: the flavor with the most room left, so a floor leaves scarce devices to others.
            dc = (st.scalar.cost(u, n + 1) - st.scalar.cost(u, n), -_room(st, u))
            if best is None or dc < best[0]:
                best = (dc, u)
        if best is None:
            break
        _take(st, best[1], 1.0)
        have += 1
    return int(max(floor - have, 0))


_Snapshot = tuple[np.ndarray, dict[str, float], dict[str, float]]


def _snapshot(st: _Greedy) -> _Snapshot:
    return st.added.copy(), dict(st.devices_left), dict(st.nodes_left)


def _restore(st: _Greedy, snap: _Snapshot) -> None:
    st.added[:] = snap[0]
    st.devices_left.clear()
    st.devices_left.update(snap[1])
    st.nodes_left.clear()
    st.nodes_left.update(snap[2])


def _place_level(st: _Greedy, level: list[int]) -> None:
    """One priority level: demand, then min_replicas. Placing demand first keeps floors from pinning a
    costlier flavor; when a limit then leaves a floor unmet, the level is re-run with its floors reserved
    first (a floor outranks demand within a level, as in the MILP), and the answer missing fewer kept."""
    before = _snapshot(st)
    for i in level:
        _cover(st, i)
    short = sum(_top_up(st, i) for i in level)
    if not short:
        return
    demand_first = _snapshot(st)
    _restore(st, before)
    # The most constrained models (fewest flavors with room) place their floors first.
    short_floor_first = sum(_top_up(st, i) for i in sorted(
        level, key=lambda i: sum(_room(st, u) >= 1 for u in st.units_of.get(i, []))))
    for i in level:
        if i in st.units_of:
            for u, a in _fill_best(st, i):
                _take(st, u, a)
    if short_floor_first >= short:
        _restore(st, demand_first)


def _counts(st: _Greedy) -> dict[int, int]:
    """Units back to offerings: replicas per offering index (only > 0)."""
    units = st.units
    counts: dict[int, int] = {}
    if not len(units.need):
        return counts
    n_all = st.kept + st.added
    ks, _ = units.spot_count(np.arange(len(units.need)), n_all)
    for u in np.nonzero(n_all)[0]:
        k, tot_u = int(ks[u]), int(n_all[u])
        if units.offering_spot[u] >= 0 and k > 0:
            counts[units.offering_spot[u]] = k
        if units.offering_od[u] >= 0 and tot_u - k > 0:
            counts[units.offering_od[u]] = tot_u - k
    return counts


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
    st = _start(p)
    needs = st.needs
    for prio in sorted({n.priority for n in needs}, reverse=True):
        _place_level(st, sorted((i for i in range(len(needs)) if needs[i].priority == prio),
                                key=lambda i: needs[i].model))
    return finish(p, _counts(st), "greedy")
