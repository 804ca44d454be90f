"""Plan: replicas per (model, flavor, capacity type) that meet every SLO at least cost, made stable.

``plan()`` is a pure function: catalog, demand, what runs now, which offerings are backed off, the clock
value and the planner's memory in; the plan and the new memory out. Stability rules, per model:

- under-provisioned (demand > current capacity, or fewer than min_replicas): scale up at once, keeping
  every current replica (the solver may only add), and order whole replicas of the model's best-value
  flavor ($ per req/s, spot blended at its share cap) rather than the cheapest cover of the shortfall;
- inside the hysteresis band (demand >= (1 - band) x capacity): keep what runs;
- over-provisioned: only after demand stayed below the band for ``downscale_delay_s`` and the model's last
  change is ``min_dwell_s`` old (and at least as old as its flavors' start-up time, so capacity is never
  cancelled before it could serve), re-plan freely (this is also when a cheaper flavor mix replaces the
  current one; act adds the new replicas before it drains the old);
- signals stale or missing (Demand HOLD): keep what runs, never scale down on no data.

Best effort: a model no flavor of which meets its SLO is planned on the estimator's best-effort capacities,
and one whose SLO-meeting flavors are capped by limits serves the rest on its other flavors
(``_serve_rest_best_effort``); either is reported as a Shortfall with ``best_effort`` set.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rayscale.core.catalog import CapacityType, Catalog, Parallelism
from rayscale.core.estimate import Demand, DemandState, drain_rps, prior_mix
from rayscale.core.gangs import GangError, GangShape, gang_shape_for
from rayscale.core.signals import RequestMix
from rayscale.core.solver import (
    EXACT_MAX_VARS,
    RPS_TOLERANCE,
    ModelNeed,
    OfferingTable,
    Problem,
    Solution,
    solve,
    solve_exact,
    solve_greedy,
)

Key = tuple[str, str, str]  # (model, flavor, capacity type)
ZoneKey = tuple[str, str, str]  # (flavor, zone, capacity type)


@dataclass(frozen=True)
class PlannerSettings:
    hysteresis_band: float = 0.25
    # A scale-down keeps this much capacity above the demand. Capacity estimates move a few percent from
    # window to window (the request mix, corrections): a fleet cut to exactly the demand reads as short
    # at the next dip and orders a whole replica back, minutes later, for the same load.
    downscale_headroom: float = 0.1
    downscale_delay_s: float = 120.0
    min_dwell_s: float = 60.0
    # Never cancel capacity before it could have served: after a change, the dwell also covers the
    # start-up time (node + model load) of the flavors the model runs on. Without it a short burst
    # orders replicas and the next dip cancels them while they are still starting, billed and useless.
    dwell_covers_startup: bool = True
    exact_max_vars: int = EXACT_MAX_VARS
    # Scale-ups order whole replicas of the model's best $/req offering (see _whole_best), not the cheapest
    # cover of the shortfall alone.
    whole_best_replicas: bool = True
    # ... and may replace running replicas of flavors that cost this many times the best per req/s (bought
    # when demand was too small for a best-value replica); 0 keeps every running replica on a scale-up.
    replace_worse_than: float = 0.0
    # A scale-down re-plans the model's fleet, and may start replicas on offerings it does not run (a
    # cheaper flavor for the smaller demand). It does so only when that costs at least this share less than
    # dropping running replicas alone (Karpenter consolidates by replacement only onto cheaper capacity
    # too): a move pays for start-up and make-before-break overlap, and per-flavor capacity estimates are
    # noisy. Without it, on the diurnal trace a scale-down swapped 1 L40S for 3 inf2 to save 2%, the next
    # rise swapped back, and each swap's start-up cost SLO (simulated, 99.48% where 99.9% was usual).
    scale_down_move_saving: float = 0.15
    solver: str = "auto"  # auto | exact | greedy

    def __post_init__(self) -> None:
        for name in ("hysteresis_band", "downscale_headroom", "downscale_delay_s", "min_dwell_s",
                     "replace_worse_than", "scale_down_move_saving"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"PlannerSettings.{name} must be >= 0, got {getattr(self, name)}")
        if not self.hysteresis_band < 1:
            raise ValueError(f"PlannerSettings.hysteresis_band must be < 1, got {self.hysteresis_band}")
        # The scaled-down fleet must land inside the keep band, or the next period scales it down again.
        limit = self.hysteresis_band / (1 - self.hysteresis_band)
        if self.downscale_headroom > limit + 1e-12:
            raise ValueError(f"PlannerSettings.downscale_headroom {self.downscale_headroom} must be <= "
                             f"hysteresis_band / (1 - hysteresis_band) = {limit:.3f}")
        if not self.scale_down_move_saving < 1:
            raise ValueError(f"PlannerSettings.scale_down_move_saving must be < 1, got {self.scale_down_move_saving}")
        if self.solver not in ("auto", "exact", "greedy"):
            raise ValueError(f"PlannerSettings.solver must be auto, exact or greedy, got {self.solver!r}")


@dataclass(frozen=True)
class PlannerMemory:
    """What the planner remembers between reconciles (the controller stores it; a restart loses only
    the downscale timers, which errs on the side of keeping capacity)."""

    last_change_s: dict[str, float] = field(default_factory=dict)  # model -> time of last target change
    below_since_s: dict[str, float] = field(default_factory=dict)  # model -> when over-provisioning began
    # The last plan's target per model: what the world is converging to. Planning against it rather than
    # the world keeps a decision in force while gangs drain or start (the world lags the plan), so the
    # planner does not re-decide the old state and flap.
    targets: dict[str, dict[Key, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class PlanEntry:
    model: str
    flavor: str
    capacity_type: str
    replicas: int
    current: int
    gang: GangShape
    usd_per_h: float
    rps_capacity: float
    reason: str

    @property
    def gangs(self) -> int:
        """Gangs the replicas pack into (a gang holds gang.slots replicas)."""
        return self.gang.gangs_for(self.replicas)

    @property
    def nodes(self) -> int:
        return self.gangs * self.gang.nodes


@dataclass(frozen=True)
class Shortfall:
    model: str
    unmet_rps: float
    reason: str
    missing_replicas: int = 0  # below min_replicas (limits forbid the floor)
    # No flavor meets the model's SLO for its mix: what runs serves it best effort (Demand.best_effort), and
    # some requests miss the SLO even with no demand unmet.
    best_effort: bool = False


@dataclass(frozen=True)
class Plan:
    entries: tuple[PlanEntry, ...]
    shortfalls: tuple[Shortfall, ...]
    method: str
    notes: tuple[str, ...] = ()

    @property
    def usd_per_h(self) -> float:
        return sum(e.usd_per_h for e in self.entries)

    def replicas(self, model: str, flavor: str | None = None) -> int:
        return sum(e.replicas for e in self.entries if e.model == model and flavor in (None, e.flavor))

    def target(self) -> dict[Key, int]:
        return {(e.model, e.flavor, e.capacity_type): e.replicas for e in self.entries if e.replicas > 0}

    def changes(self) -> list[PlanEntry]:
        return [e for e in self.entries if e.replicas != e.current]

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "usd_per_h": round(self.usd_per_h, 4),
            "entries": [{**asdict(e), "gangs": e.gangs, "nodes": e.nodes} for e in self.entries],
            "shortfalls": [asdict(s) for s in self.shortfalls],
            "notes": list(self.notes),
        }


def _blocked(catalog: Catalog, unavailable: dict[ZoneKey, float], now: float) -> set[tuple[str, str]]:
    """(flavor, capacity type) pairs with every zone backed off at ``now``."""
    active = {k for k, until in unavailable.items() if until > now}
    out = set()
    for f in catalog.flavors.values():
        for ct in f.capacity_types:
            if all((f.name, z, ct.value) in active for z in f.zones):
                out.add((f.name, ct.value))
    return out


def plan(
    catalog: Catalog,
    demands: dict[str, Demand],
    current: dict[Key, int] | None = None,
    unavailable: dict[ZoneKey, float] | None = None,
    now: float = 0.0,
    memory: PlannerMemory | None = None,
    settings: PlannerSettings = PlannerSettings(),
) -> tuple[Plan, PlannerMemory]:
    world = {k: v for k, v in (current or {}).items() if v > 0}
    memory = memory or PlannerMemory()
    blocked = _blocked(catalog, unavailable or {}, now)
    current = _converging(world, memory.targets, blocked)
    notes: list[str] = []
    last_change = dict(memory.last_change_s)
    below_since = dict(memory.below_since_s)

    cols: tuple[list[Any], ...] = ([], [], [], [], [], [], [], [], [], [], [])
    o_model, o_flavor, o_ct, o_usd, o_rps, o_dev, o_nodes, o_lb, o_ub, o_unit, o_slots = cols
    running: list[int] = []  # offerings with replicas now
    o_have: list[int] = []  # replicas now, per offering
    freed: set[str] = set()  # models re-planned for a scale-down
    gangs: dict[tuple[str, str], GangShape] = {}
    needs: list[ModelNeed] = []
    why: dict[str, str] = {}
    rounded: dict[str, float] = {}  # req/s a scale-up orders beyond the demand (whole best-value replicas)
    cur_by_model: dict[str, dict[Key, int]] = {}
    for k, n in current.items():
        cur_by_model.setdefault(k[0], {})[k] = n
    # Gang shape, price per capacity type and devices depend only on (flavor, tp, pp): once per plan call.
    shapes: Shapes = {}
    for name, spec in sorted(catalog.models.items()):
        d = demands.get(name)
        if d is not None and d.state == DemandState.OK and d.burst_rps > 0:
            d = _with_burst_floor(catalog, name, d, shapes)
        cur = cur_by_model.get(name, {})
        caps = d.capacity if d else {}
        # Replicas that serve best effort what limits left unmet count what they serve (Demand.fallback), or
        # every period would read the model as short and they could never be scaled down with the demand.
        have_caps = {**caps, **d.fallback} if d else caps
        cur_cap = sum(n * (have_caps[f].rps if f in have_caps else 0.0) for (_, f, _), n in cur.items())
        cur_n = sum(cur.values())
        # Bounds per offering from the stability rules: 'keep' pins, 'up' only adds, 'free' re-plans.
        if cur_n < spec.min_replicas and (d is None or d.state == DemandState.HOLD):
            mode, why[name] = "up", f"below min_replicas {spec.min_replicas}"
            rps = cur_cap
        elif d is None or d.state == DemandState.HOLD:
            mode, why[name] = "keep", (d.reason if d else "no demand estimate: holding capacity")
            below_since.pop(name, None)
            rps = cur_cap
        elif d.rps > cur_cap + 1e-9 or cur_n < spec.min_replicas:
            mode = "up"
            why[name] = f"scale up: need {d.rps:.2f} req/s ({d.reason}), have {cur_cap:.2f}"
            below_since.pop(name, None)
            rps = d.rps
        elif d.rps >= (1 - settings.hysteresis_band) * cur_cap:
            mode, why[name] = "keep", f"steady: need {d.rps:.2f} req/s of {cur_cap:.2f} ({d.reason})"
            below_since.pop(name, None)
            rps = d.rps
        else:
            since = below_since.setdefault(name, now)
            waited, dwell = now - since, now - last_change.get(name, -1e18)
            need_dwell = settings.min_dwell_s
            if settings.dwell_covers_startup:
                need_dwell = max([need_dwell] + [
                    catalog.flavors[f].node_startup_s + catalog.profile(name, f).startup_s
                    for (_, f, _) in cur if f in catalog.flavors and f in spec.parallelism])
            if waited >= settings.downscale_delay_s and dwell >= need_dwell:
                mode = "free"
                freed.add(name)
                why[name] = (f"scale down: need {d.rps:.2f} req/s, {cur_cap:.2f} running for {waited:.0f}s "
                             f"({d.reason})")
                if settings.downscale_headroom:
                    why[name] += f"; keeping {settings.downscale_headroom:.0%} headroom"
                # The headroom is not demand: what the solver cannot cover of it is no shortfall.
                rounded[name] = min(cur_cap, d.rps * (1 + settings.downscale_headroom)) - d.rps
            else:
                mode = "keep"
                why[name] = (f"over-provisioned for {waited:.0f}s (need {d.rps:.2f} of {cur_cap:.2f} req/s); "
                             f"scale-down waits {settings.downscale_delay_s:.0f}s, and {need_dwell:.0f}s after the last change")
            rps = d.rps + rounded.get(name, 0.0)
        if d is not None and d.best_effort:
            why[name] += "; best effort: no flavor meets the SLO for this mix"
        first = len(o_model)  # this model's offerings start here
        for fname in sorted(spec.parallelism):
            par = spec.parallelism[fname]
            got = _cached_shape(catalog, shapes, fname, par)
            if isinstance(got, str):
                notes.append(f"{name} on {fname}: {got}")
                continue
            shape, prices, devices = got
            gangs[(name, fname)] = shape
            cap = caps[fname].rps if fname in caps else 0.0
            unit = len(gangs)
            for ct, ctv, price in prices:
                have = cur.get((name, fname, ctv), 0) if cur else 0
                if mode == "keep":
                    lb, ub = have, have
                elif mode == "up":
                    lb, ub = have, spec.max_replicas
                else:
                    lb, ub = 0, spec.max_replicas
                if (fname, ctv) in blocked or cap <= 0:
                    ub = min(ub, have)  # no new gangs where capacity errors back us off or SLO is unmeetable
                    lb = min(lb, ub)
                if ub <= 0 and have == 0:
                    continue
                if have:
                    running.append(len(o_model))
                o_have.append(have)
                o_model.append(name)
                o_flavor.append(fname)
                o_ct.append(ct)
                o_usd.append(price)
                o_rps.append(cap)
                o_dev.append(devices)
                o_nodes.append(shape.nodes)
                o_slots.append(shape.slots)
                o_lb.append(lb)
                o_ub.append(ub)
                o_unit.append(unit)
        if mode == "up" and settings.whole_best_replicas and d is not None and d.state == DemandState.OK:
            mine = range(first, len(o_model))
            value = _flavor_values(catalog, [(o_flavor[j], o_ct[j], o_usd[j], o_rps[j], o_ub[j] > o_lb[j])
                                             for j in mine])
            addable = [(v, r, f) for f, (v, r, can_add) in value.items() if can_add]
            kept_cap, kept_n = cur_cap, cur_n
            if addable and settings.replace_worse_than:
                # Replicas of a flavor that costs replace_worse_than x the best per req/s are no longer
                # pinned: the scale-up may replace them (act starts the new ones before draining them).
                limit = settings.replace_worse_than * min(addable)[0]
                for j in mine:
                    if o_lb[j] > 0 and value.get(o_flavor[j], (math.inf,))[0] > limit:
                        kept_cap -= o_lb[j] * o_rps[j]
                        kept_n -= o_lb[j]
                        o_lb[j] = 0
            have_f: dict[str, int] = {}
            for (_, f, _), n in cur.items():
                have_f[f] = have_f.get(f, 0) + n
            slots_f = {f: g.slots for (m, f), g in gangs.items() if m == name}
            addable = _order_values(addable, rps - kept_cap, slots_f, have_f)
            rps, why[name] = _whole_best(rps, kept_cap, kept_n, spec.max_replicas, why[name], addable)
            rounded[name] = rps - d.rps
        needs.append(ModelNeed(name, rps, spec.min_replicas, spec.max_replicas, spec.priority))
    offerings = OfferingTable(*cols)
    problem = Problem(
        needs=needs,
        offerings=offerings,
        device_limits={f.name: f.limits.devices for f in catalog.flavors.values() if f.limits.devices is not None},
        node_limits={f.name: f.limits.nodes for f in catalog.flavors.values() if f.limits.nodes is not None},
        spot_share={f.name: f.spot_max_share for f in catalog.flavors.values()},
    )
    sol = _solve(problem, settings)
    if freed:
        sol = _unless_moving_saves(problem, sol, o_have, freed, settings, why)
    sol, rest_best_effort = _serve_rest_best_effort(catalog, demands, problem, sol, rounded, shapes, blocked,
                                                    o_have, settings)

    entries = []
    changed: set[str] = set()
    known: set[Key] = set()
    for j in sorted(set(sol.counts) | set(running)):
        m, f, ctv = o_model[j], o_flavor[j], o_ct[j].value
        k = (m, f, ctv)
        n = sol.counts.get(j, 0)
        have = current.get(k, 0)
        known.add(k)
        if n == 0 and have == 0:
            continue
        if n != have:
            changed.add(m)
        # Replicas are priced as their share of a gang; the plan pays for the whole gangs they pack into.
        g = gangs[(m, f)]
        entries.append(PlanEntry(m, f, ctv, n, have, g, g.gangs_for(n) * g.slots * o_usd[j], n * o_rps[j], why[m]))
    # Replicas on offerings the catalog no longer has (flavor removed): plan them away, visibly.
    for k, have in sorted(current.items()):
        if k not in known and k[0] in catalog.models and (k[0], k[1]) in gangs:
            entries.append(PlanEntry(*k, 0, have, gangs[(k[0], k[1])], 0.0, 0.0, "offering no longer available"))
    for m in changed:
        last_change[m] = now
        below_since.pop(m, None)
    offs_of: dict[str, list[tuple[float, int, str]]] = {}  # model -> (rps, ub, flavor) per offering
    if sol.unmet_rps:
        for j, m in enumerate(o_model):
            if m in sol.unmet_rps:
                offs_of.setdefault(m, []).append((o_rps[j], o_ub[j], o_flavor[j]))
    # What rounding up ordered is not demand: only unmet demand is a shortfall.
    unmet = {m: u - rounded.get(m, 0.0) for m, u in sol.unmet_rps.items()}
    unmet = {m: u for m, u in unmet.items()
             if u > RPS_TOLERANCE and demands.get(m) is not None and demands[m].state == DemandState.OK}
    if sol.missing_min:
        for j, m in enumerate(o_model):
            if m in sol.missing_min and m not in sol.unmet_rps:
                offs_of.setdefault(m, []).append((o_rps[j], o_ub[j], o_flavor[j]))
    planned: dict[str, int] = {}
    runs: dict[str, dict[str, int]] = {}  # model -> flavor -> replicas planned
    for j, n in sol.counts.items():
        planned[o_model[j]] = planned.get(o_model[j], 0) + n
        runs.setdefault(o_model[j], {})[o_flavor[j]] = runs.get(o_model[j], {}).get(o_flavor[j], 0) + n
    # A best-effort model is a shortfall whenever it serves or should: its requests miss the SLO.
    best = {m for m, d in demands.items() if d.best_effort and m in catalog.models
            and (planned.get(m, 0) or m in unmet or m in sol.missing_min)} | rest_best_effort
    shortfalls = tuple(
        Shortfall(m, round(unmet.get(m, 0.0), 4),
                  _shortfall_reason(catalog, m, problem, offs_of.get(m, []), planned.get(m, 0),
                                    (demands[m], runs.get(m, {})) if m in best else None,
                                    m in unmet or m in sol.missing_min),
                  sol.missing_min.get(m, 0), m in best)
        for m in sorted(set(unmet) | set(sol.missing_min) | best, key=lambda m: (-catalog.models[m].priority, m))
    )
    entries.sort(key=lambda e: (e.model, e.flavor, e.capacity_type))
    targets: dict[str, dict[Key, int]] = {m: {} for m in catalog.models}
    for e in entries:
        if e.replicas > 0:
            targets[e.model][(e.model, e.flavor, e.capacity_type)] = e.replicas
    return (Plan(tuple(entries), shortfalls, sol.method, tuple(notes)),
            PlannerMemory(last_change, below_since, targets))


Shapes = dict[tuple[str, int, int], tuple[GangShape, list[tuple[CapacityType, str, float]], int] | str]


def _cached_shape(catalog: Catalog, shapes: Shapes, flavor: str, par: Parallelism
                  ) -> tuple[GangShape, list[tuple[CapacityType, str, float]], int] | str:
    """_offer_shape, once per (flavor, tp, pp) and plan call."""
    key = (flavor, par.tp, par.pp)
    if key not in shapes:
        shapes[key] = _offer_shape(catalog, flavor, par)
    return shapes[key]


def _with_burst_floor(catalog: Catalog, model: str, d: Demand, shapes: Shapes) -> Demand:
    """The demand, raised to what holds enough replicas to drain its bursts (Demand.burst_rps).

    Replicas of flavor f drain drain_rps(f) req/s in a burst but count ReplicaCapacity.rps(f) against demand,
    so the floor is burst_rps x rps / drain of one flavor: the model's best value per req/s, which the bulk of
    its fleet runs (the fastest flavor's ratio would hold for any mix, but on the Azure code trace it bought
    H100 gangs for a floor 32 L40S nearly covered)."""
    spec = catalog.models[model]
    mix = _floor_mix(catalog, model, d)
    offers, drain, slots = [], {}, {}
    for fname, par in sorted(spec.parallelism.items()):
        cap = d.capacity.get(fname)
        if cap is None or not cap.feasible:
            continue
        got = _cached_shape(catalog, shapes, fname, par)
        if isinstance(got, str):
            continue
        drain[fname] = drain_rps(catalog.profile(model, fname), mix, cap.batch)
        slots[fname] = got[0].slots
        offers += [(fname, ct, price, cap.rps, True) for ct, _, price in got[1]]
    # Valued at what serving the demand on each flavor costs in whole gangs: a share of an 8-GPU node is
    # cheap only for a fleet that fills it.
    value = {f: v for v, _, f in _order_values([(v, r, f) for f, (v, r, _) in _flavor_values(catalog, offers).items()],
                                               d.rps, slots, {}) if drain.get(f, 0.0) > 0}
    if not value:
        return d
    best = min(value, key=lambda f: (value[f], f))
    floor = d.burst_rps * d.capacity[best].rps / drain[best]
    if floor <= d.rps:
        return d
    return replace(d, rps=floor, reason=f"{d.reason}, {floor:.2f} burst floor ({d.burst_rps:.1f} req/s bursts)")


def _solve(problem: Problem, settings: PlannerSettings) -> Solution:
    if settings.solver == "exact":
        return solve_exact(problem)
    if settings.solver == "greedy":
        return solve_greedy(problem)
    return solve(problem, settings.exact_max_vars)


def _unless_moving_saves(problem: Problem, sol: Solution, have: list[int], freed: set[str],
                         settings: PlannerSettings, why: dict[str, str]) -> Solution:
    """The scale-downs of ``freed`` models by dropping running replicas only, unless starting replicas on
    other offerings costs ``settings.scale_down_move_saving`` less (PlannerSettings says why)."""
    offs = problem.offerings
    assert isinstance(offs, OfferingTable)
    moves = [j for j in range(len(offs)) if offs.model[j] in freed and sol.counts.get(j, 0) > have[j]]
    if not moves:
        return sol
    ub = [min(u, have[j]) if offs.model[j] in freed else u for j, u in enumerate(offs.ub)]
    lb = [min(v, ub[j]) for j, v in enumerate(offs.lb)]
    down = _solve(replace(problem, offerings=OfferingTable(
        offs.model, offs.flavor, offs.capacity_type, offs.usd_per_h, offs.rps, offs.devices, offs.nodes, lb, ub,
        offs.unit, offs.slots)), settings)
    # Any model: on a flavor with a device limit, what the freed models keep may be what another one needed.
    worse = any(down.unmet_rps.get(m, 0.0) > sol.unmet_rps.get(m, 0.0) + RPS_TOLERANCE
                or down.missing_min.get(m, 0) > sol.missing_min.get(m, 0)
                for m in set(down.unmet_rps) | set(down.missing_min))
    if worse or sol.usd_per_h < (1 - settings.scale_down_move_saving) * down.usd_per_h:
        return sol
    saving = 1 - sol.usd_per_h / down.usd_per_h if down.usd_per_h > 0 else 0.0
    for m in sorted({offs.model[j] for j in moves}):
        why[m] += (f"; dropping running replicas only (starting others would save {saving:.0%}, under "
                   f"{settings.scale_down_move_saving:.0%})")
    return down


def _floor_mix(catalog: Catalog, model: str, d: Demand) -> RequestMix:
    """The mix the burst floor's drain is counted in. The floor is an hour's worth of bursts: the mix the
    model declares (the shape of its requests over hours), not the last few minutes'. On the Azure code
    trace (x3) the latter's prompt mean swings +-25% minute to minute, and the floor's replica count with
    it, resetting the scale-down timer whenever it crossed the hysteresis band (28 L40S held for a floor
    of 19)."""
    return prior_mix(catalog, model) if catalog.models[model].request_mix is not None else d.mix


def _flavor_values(catalog: Catalog, offers: list[tuple[str, CapacityType, float, float, bool]]
                   ) -> dict[str, tuple[float, float, bool]]:
    """Per flavor of one model's offerings (flavor, capacity type, $/h, req/s, can add): ($/h per req/s,
    req/s, can add). Spot counts at most the flavor's spot_max_share: a flavor whose spot is cheap but
    capped costs the blend a fleet of it pays, not the spot price."""
    by: dict[str, dict[CapacityType, float]] = {}
    rps: dict[str, float] = {}
    add: dict[str, bool] = {}
    for f, ct, usd, r, can_add in offers:
        if r > 0:
            by.setdefault(f, {})[ct] = usd
            rps[f] = r
            add[f] = add.get(f, False) or can_add
    out = {}
    for f, price in by.items():
        od, spot = price.get(CapacityType.ON_DEMAND), price.get(CapacityType.SPOT)
        if od is not None and spot is not None:
            share = catalog.flavors[f].spot_max_share
            usd = (1.0 - share) * od + share * min(spot, od)
        else:
            usd = next(iter(price.values()))
        out[f] = (usd / rps[f], rps[f], add[f])
    return out


def _order_values(offers: list[tuple[float, float, str]], short: float, slots: dict[str, int],
                  have: dict[str, int]) -> list[tuple[float, float, str]]:
    """A scale-up's offers ($/h per req/s, req/s, flavor) valued at what the order costs: where a gang holds
    several replicas, the new gangs that covering ``short`` req/s on that flavor alone needs (free slots on
    its running gangs cost nothing), not its share of a full gang. Two H100 replicas cost a whole
    p5.48xlarge; a share price would buy it for a demand a smaller flavor serves for less."""
    out = []
    for per_rps, rps, f in offers:
        s, h = slots.get(f, 1), have.get(f, 0)
        if s > 1 and short > 0:
            n = max(math.ceil(short / rps - 1e-9), 1)
            new_gangs = math.ceil((h + n) / s) - math.ceil(h / s)
            per_rps = new_gangs * s * per_rps / n
        out.append((per_rps, rps, f))
    return out


def _whole_best(need: float, have: float, replicas: int, max_replicas: int, why: str,
                offers: list[tuple[float, float, str]]) -> tuple[float, str]:
    """A scale-up's order, rounded up to whole replicas of the model's best-value offering ($ per req/s,
    among those that can still add): (need, reason).

    The least-cost cover of a shortfall alone is its cheapest increment: on a ramp, one small, slow replica
    after another (an inf2 for 0.8 req/s at $0.76/h, where an L40S gives 3.5 for $1.86), never replaced while
    demand stays inside the hysteresis band. Rounding the order up to whole best-value replicas makes those
    the cheapest cover; the extra is at most one of them, and the ramp grows into it. Bounded by
    max_replicas, so rounding never asks for what the model may not have."""
    if not offers or need <= have:
        return need, why
    per_rps, rps, flavor = min(offers)
    room = max(max_replicas - replicas, 0)
    whole = have + min(math.ceil((need - have) / rps - 1e-9), room) * rps
    if whole <= need + RPS_TOLERANCE:
        return need, why
    return whole, f"{why}; ordering whole {flavor} replicas ({rps:.2f} req/s at ${per_rps * rps:.2f}/h each)"


def _converging(world: dict[Key, int], targets: dict[str, dict[Key, int]],
                blocked: set[tuple[str, str]]) -> dict[Key, int]:
    """What each model is converging to: its last target, else (first plan, restart) the world.

    Where an offering is backed off the world wins when it has less: a gang that cannot launch must
    free its demand for another flavor instead of being kept in the plan.
    """
    out = {k: v for k, v in world.items() if k[0] not in targets}
    for tgt in targets.values():
        for k, v in tgt.items():
            if (k[1], k[2]) in blocked:
                v = min(v, world.get(k, 0))
            if v > 0:
                out[k] = v
    return out


def _offer_shape(catalog: Catalog, flavor: str, par: Parallelism
                 ) -> tuple[GangShape, list[tuple[CapacityType, str, float]], int] | str:
    """The gang of one replica (chosen at on-demand prices), a replica's $/h per capacity type (its share
    of the gang: the gang's price / slots) and the gang's devices; or why no instance type fits."""
    fl = catalog.flavors[flavor]
    try:
        shape = gang_shape_for(catalog, flavor, par)
    except GangError as e:
        return str(e)
    prices = [(ct, ct.value, shape.nodes * catalog.price(flavor, shape.instance_type, ct) / shape.slots)
              for ct in fl.capacity_types]
    return shape, prices, shape.nodes * fl.instance(shape.instance_type).devices


def _best_effort_reason(d: Demand, runs: dict[str, int]) -> str:
    """What a best-effort model's fleet serves: why and, per flavor it runs on, the share of requests
    expected to miss the SLO there (none noted: the flavor meets it)."""
    caps = {**d.capacity, **d.fallback}
    served = [f"{n} {f}" + (f" (~{c.miss:.0%} of requests miss)" if (c := caps.get(f)) and c.best_effort else "")
              for f, n in sorted(runs.items())]
    why = d.best_effort or "the flavors that meet the SLO cannot cover the demand within limits"
    return f"best effort: {why}; serving throughput on " + (", ".join(served) or "nothing")


def _serve_rest_best_effort(catalog: Catalog, demands: dict[str, Demand], problem: Problem, sol: Solution,
                            rounded: dict[str, float], shapes: Shapes, blocked: set[tuple[str, str]],
                            have: list[int], settings: PlannerSettings) -> tuple[Solution, set[str]]:
    """When limits leave part of a model's demand unmet on the flavors that meet its SLO, its flavors that
    do not serve the rest best effort (Demand.fallback): the plan keeps what ``sol`` put on the former and
    solves again with the latter open. Unmet requests all fail; a best-effort replica serves most of them.
    Extends ``problem``'s offerings (the plan's columns) in place; the new solution and the models served so."""
    offs = problem.offerings
    assert isinstance(offs, OfferingTable) and offs.unit is not None
    short = sorted(m for m, u in sol.unmet_rps.items() if u - rounded.get(m, 0.0) > RPS_TOLERANCE
                   and (d := demands.get(m)) is not None and d.state == DemandState.OK
                   and any(c.rps > 0 for c in d.fallback.values()))
    if not short:
        return sol, set()
    at = {(offs.model[j], offs.flavor[j], offs.capacity_type[j].value): j for j in range(len(offs))}
    units = {(offs.model[j], offs.flavor[j]): u for j, u in enumerate(offs.unit)}
    next_unit = max(units.values(), default=0) + 1
    for j in range(len(offs)):
        if offs.model[j] in short:
            offs.lb[j] = max(offs.lb[j], sol.counts.get(j, 0))
    for m in short:
        spec, d = catalog.models[m], demands[m]
        for f, cap in sorted(d.fallback.items()):
            got = _cached_shape(catalog, shapes, f, spec.parallelism[f]) if f in spec.parallelism else "gone"
            if cap.rps <= 0 or isinstance(got, str):
                continue
            shape, prices, devices = got
            if (m, f) not in units:
                units[(m, f)], next_unit = next_unit, next_unit + 1
            for ct, ctv, price in prices:
                j = at.get((m, f, ctv), len(offs))
                if j == len(offs):
                    if (f, ctv) in blocked:
                        continue
                    offs.model.append(m)
                    offs.flavor.append(f)
                    offs.capacity_type.append(ct)
                    offs.usd_per_h.append(price)
                    offs.rps.append(0.0)
                    offs.devices.append(devices)
                    offs.nodes.append(shape.nodes)
                    offs.slots.append(shape.slots)
                    for ints, v in ((offs.lb, 0), (offs.ub, 0), (offs.unit, units[(m, f)]), (have, 0)):
                        ints.append(v)
                offs.rps[j] = cap.rps
                if (f, ctv) not in blocked:
                    offs.ub[j] = max(offs.ub[j], spec.max_replicas)
    return _solve(problem, settings), set(short)


def _shortfall_reason(catalog: Catalog, model: str, p: Problem, offs: list[tuple[float, int, str]],
                      planned: int, best_effort: tuple[Demand, dict[str, int]] | None = None,
                      short: bool = True) -> str:
    """Why a model is short (``short``: demand unmet or below min_replicas), and when it is served best
    effort, that too."""
    spec = catalog.models[model]
    best = _best_effort_reason(*best_effort) if best_effort else ""
    if not short:
        return best
    if not offs or all(rps <= 0 for rps, _, _ in offs):
        return "; ".join(filter(None, (best, "no flavor can meet its SLO (or all are backed off)")))
    reasons = []
    if planned >= spec.max_replicas:
        reasons.append(f"max_replicas {spec.max_replicas}")
    lim = sorted({f for _, _, f in offs if f in p.device_limits or f in p.node_limits})
    if lim:
        reasons.append("NodePool limits on " + ", ".join(lim))
    degraded = f"degraded (priority {spec.priority}): " + (" or ".join(reasons) or "capacity exhausted")
    return "; ".join(filter(None, (best, degraded)))
