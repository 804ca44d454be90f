"""Plan: replicas per (model, flavor, capacity type) that meet every SLO at least cost, made stable.

``plan()`` is a pure function: catalog, demand, what runs now, which offerings are backed off, the clock
value and the planner's memory in; the plan and the new memory out. Stability rules, per model:

- under-provisioned (demand > current capacity, or fewer than min_replicas): scale up at once, keeping
  every current replica (the solver may only add), and order whole replicas of the model's best-value
  flavor ($ per req/s, spot blended at its share cap) rather than the cheapest cover of the shortfall;
- inside the hysteresis band (demand >= (1 - band) x capacity): keep what runs, unless it has not changed
  for as long as a scale-down waits and the same capacity on one flavor it can add costs
  ``scale_down_move_saving`` less: then re-plan at that capacity (``steady_moves``; so too below the band
  while the scale-down waits);
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from rayscale.core.catalog import CapacityType, Catalog, Parallelism
from rayscale.core.derived import derived
from rayscale.core.estimate import Demand, DemandState, ReplicaCapacity, drain_rps, prior_mix
from rayscale.core.frozen import frozen_without_init
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
from rayscale.core.spot import availability

Key = tuple[str, str, str]  # (model, flavor, capacity type)
ZoneKey = tuple[str, str, str]  # (flavor, zone, capacity type)
# (model, flavor) pairs -> what one replica serves as its deployment's only one, a share of its pooled capacity
AloneShares = Callable[[Sequence[tuple[str, str]]], Mapping[tuple[str, str], float]]

# A spot gang counted for nothing is dropped (and its replicas moved) only where one interruption of it puts
# this many times the outage budget at risk. The risk rises as the need dips, so at 1x spot ordered for a
# rise was cancelled at the next dip; and a gang just over the budget still serves most of the time:
# dropped at 1x, the Azure code trace x3 at 1 notice per node-hour met 98.4% (a trial of bench.spot_zombies)
# where keeping it met 99.3%; at 2x, 99.5% (bench/results/spot_zombies.md).
SPOT_DROP_OVER_BUDGET = 2.0


class SolverChoice(StrEnum):
    """Which solver plans (PlannerSettings.solver); settings files name it by its value."""

    AUTO = "auto"  # exact up to exact_max_vars offerings, greedy beyond
    EXACT = "exact"
    GREEDY = "greedy"


@dataclass(frozen=True)
class PlannerSettings:
    hysteresis_band: float = 0.25
    # The band for a model whose bursts last a minute or more (Demand.burst_sharpness at most
    # sharp_bursts_above): None, the same band for every model.
    smooth_hysteresis_band: float | None = None
    sharp_bursts_above: float = 1.5
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
    # A steady model (demand inside the band) whose fleet costs scale_down_move_saving more than the same
    # capacity on one flavor it can add is re-planned at that capacity, once its last change is as old as a
    # scale-down waits (Karpenter's single-node consolidation by replacement). Off, a fleet bought while
    # its best flavor was backed off (an 8-GPU p5.48xlarge for 4 replicas) kept it for as long as the
    # demand stayed in the band.
    steady_moves: bool = True
    # No new spot gang of a flavor whose interruptions (the learned rate, rayscale.core.spot) would put more
    # than this share of the model's requests at risk: rate x nodes x replacement lead time x the share of
    # the model's need one gang carries. The availability discount counts a spot replica at its average
    # capacity; a small fleet that loses one of its two replicas misses the SLO for the whole lead time.
    # Running spot gangs over it (ordered before the rate was learned) count for nothing, so on-demand
    # capacity comes up beside them before they go (_counted); where gangs can be drained the plan drops
    # them once the ready rest covers the need (SPOT_DROP_OVER_BUDGET), and the act step moves their replicas.
    spot_outage_budget: float = 0.005
    # Scale up only when the demand exceeds what runs by more than this share (Kubernetes' HPA skips a
    # change within its 10% tolerance). The capacity a replica is counted at moves a few percent from window
    # to window (request mix, corrections), and a forecast held near the fleet's capacity crosses it on noise
    # alone: each crossing orders a replica that lands a start-up later, for a load already served. The
    # target utilisation, not this, is the fleet's margin. Off (0) as shipped: on the dev split 0.03-0.1
    # saved 3-8% on 5-min bursts but met less after a restart on bursty code traffic and lost 1.8 pt on a
    # chat ramp from cold (bench/results/tune_up_tolerance.md).
    scale_up_tolerance: float = 0.0
    # The same tolerance for a model whose SLO feedback trims its demand on a level (Demand.slo_slack) and
    # whose arrivals' recent line stays within it one horizon ahead (Demand.rise_rps): its fleet has
    # delivered the SLO with slack, so a crossing within this share is the capacity estimate's noise (the
    # request mix and latency corrections move it 10-15% on 2,000-token prompts), not a need. On a level
    # load where one replica more is a large step, each crossing orders a replica that a scale-down takes
    # back eleven minutes later (qwen2-7b at 2 req/s: 1.6x the cheapest fixed fleet; unguarded 17% less,
    # guarded 1%: the line through a noisy level reaches past the tolerance, bench/results/slack_tolerance.md).
    # The rule chose 0.1 on the dev split without the line's guard (2.3% less in steady state), but then a
    # chat ramp held 10% short for nine minutes of its climb and met 98.45% on one seed; with the guard
    # 1.1% less, every dev trace within 0.1 pt of before (bench/results/tune_slack_tolerance.md).
    slack_scale_up_tolerance: float = 0.1
    # Count a flavor deployment of one replica at what it serves alone (rayscale.core.estimate.alone_shares):
    # Serve's router has no second replica to send a prompt to, so every prompt prefills beside its decodes.
    # The pooled estimate called such a replica's capacity 1.2-5x what the simulated engine measures, the
    # alone one 0.8-1.7x (bench/results/capacity_error_alone_7b.md, _72b.md). Off as shipped: the dev split's
    # rule chose it (tune_alone.md), and from cold the 72B morning met 99.90% (was 99.17%), but in steady
    # state the 72B day met 97.32% (94.07% on seed 0) where it met 99.54%: a lone A100 counted short was
    # doubled early, the scale-down after it moved onto three L40S, and the next rise ordered an A100 that
    # takes 20 min to start (eval_models_alone.md, bench/README.md).
    alone_capacity: bool = False
    # Settings files and the CLI give the name as a string; __post_init__ makes it a SolverChoice.
    solver: SolverChoice | str = "auto"

    def __post_init__(self) -> None:
        for name in ("hysteresis_band", "downscale_headroom", "downscale_delay_s", "min_dwell_s",
                     "replace_worse_than", "scale_down_move_saving", "spot_outage_budget", "scale_up_tolerance",
                     "slack_scale_up_tolerance"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"PlannerSettings.{name} must be >= 0, got {getattr(self, name)}")
        if not self.hysteresis_band < 1:
            raise ValueError(f"PlannerSettings.hysteresis_band must be < 1, got {self.hysteresis_band}")
        if self.smooth_hysteresis_band is not None and not 0 <= self.smooth_hysteresis_band < 1:
            raise ValueError(f"PlannerSettings.smooth_hysteresis_band must be in [0, 1), got "
                             f"{self.smooth_hysteresis_band}")
        # The scaled-down fleet must land inside the keep band, or the next period scales it down again.
        band = min(self.hysteresis_band, self.smooth_hysteresis_band if self.smooth_hysteresis_band is not None
                   else self.hysteresis_band)
        limit = band / (1 - band)
        if self.downscale_headroom > limit + 1e-12:
            raise ValueError(f"PlannerSettings.downscale_headroom {self.downscale_headroom} must be <= "
                             f"band / (1 - band) = {limit:.3f} for the narrower hysteresis band")
        if not self.scale_down_move_saving < 1:
            raise ValueError(f"PlannerSettings.scale_down_move_saving must be < 1, got {self.scale_down_move_saving}")
        try:
            object.__setattr__(self, "solver", SolverChoice(self.solver))
        except ValueError:
            raise ValueError(f"PlannerSettings.solver must be auto, exact or greedy, got {self.solver!r}") from None


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
    at_s: float | None = None  # when the last plan was made (None: none yet)


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
    replica_rps: float = 0.0  # one replica's req/s at the SLO (known even where the plan wants none)

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
    # (model, flavor) -> what one replica serves alone, a share of Demand.capacity's rps, for the deployments
    # of one replica the plan found (now, standing, or planned): the ingress weighs such a replica by it.
    alone_shares: Mapping[tuple[str, str], float] = field(default_factory=dict)

    @property
    def usd_per_h(self) -> float:
        return sum(e.usd_per_h for e in self.entries)

    def replicas(self, model: str, flavor: str | None = None) -> int:
        return sum(e.replicas for e in self.entries if e.model == model and flavor in (None, e.flavor))

    def target(self) -> dict[Key, int]:
        return {(e.model, e.flavor, e.capacity_type): e.replicas for e in self.entries if e.replicas > 0}

    def replica_rps(self) -> dict[tuple[str, str], float]:
        """Req/s one replica of a (model, flavor) serves at the SLO, where the plan knows it."""
        return {(e.model, e.flavor): e.replica_rps for e in self.entries if e.replica_rps > 0}

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




class Mode(StrEnum):
    """What the stability rules let the solver do with a model's replicas this period."""

    KEEP = "keep"  # pin every offering at what runs
    UP = "up"  # only add to what runs
    FREE = "free"  # re-plan freely (a scale-down)


@dataclass(slots=True)
class _Offer:
    """One offering as the plan builds it: a way to run a replica of a model (flavor, capacity type), its
    price and capacity, and the bounds the stability rules put on its replicas."""

    model: str
    flavor: str
    capacity_type: CapacityType
    usd_per_h: float  # one replica: its share of the gang's price
    rps: float  # capacity of one replica (0: cannot meet the SLO)
    devices: int  # the gang's
    nodes: int
    lb: int
    ub: int
    unit: int  # numbers the (model, flavor): its capacity types share it
    slots: int  # replicas one gang holds
    have: int  # replicas now


@dataclass
class _Build:
    """What plan() gathers while it turns each model's demand into a need and offerings."""

    catalog: Catalog
    settings: PlannerSettings
    now: float
    blocked: set[tuple[str, str]]  # (flavor, capacity type) backed off in every zone
    last_change: dict[str, float]
    below_since: dict[str, float]
    offers: list[_Offer] = field(default_factory=list)
    needs: list[ModelNeed] = field(default_factory=list)
    gangs: dict[tuple[str, str], GangShape] = field(default_factory=dict)  # (model, flavor)
    why: dict[str, str] = field(default_factory=dict)  # model -> the reason its entries carry
    rounded: dict[str, float] = field(default_factory=dict)  # req/s ordered beyond the demand: not demand
    freed: set[str] = field(default_factory=set)  # models re-planned for a scale-down or a steady move
    repricing: set[str] = field(default_factory=set)  # ... of them, the steady ones (_cheaper_cover)
    notes: list[str] = field(default_factory=list)
    shapes: Shapes = field(default_factory=dict)
    spot_rates: Mapping[str, float] = field(default_factory=dict)  # flavor -> interruptions per node-hour
    world: Mapping[Key, int] = field(default_factory=dict)  # replicas the gangs that stand hold
    # Replicas serving on ready gangs per offering, where the provider can move them (rayscale.core.act.
    # DrainGang); None: it cannot.
    serving: Mapping[Key, int] | None = None
    current: Mapping[Key, int] = field(default_factory=dict)  # what every model converges to (_converging)
    room: dict[str, tuple[float, float]] | None = None  # flavor -> (devices, nodes) its limits leave (_room)
    last_plan_s: float | None = None  # PlannerMemory.at_s
    alone_share: AloneShares | None = None  # the estimator's alone_shares for (model, flavor) pairs
    alone: dict[tuple[str, str], float] = field(default_factory=dict)  # ... those asked so far
    alone_now: dict[str, set[str]] = field(default_factory=dict)  # model -> flavors it runs one replica of
    open: set[str] = field(default_factory=set)  # models the solver may change (scaled up or re-planned)


def plan(
    catalog: Catalog,
    demands: dict[str, Demand],
    current: dict[Key, int] | None = None,
    unavailable: dict[ZoneKey, float] | None = None,
    now: float = 0.0,
    memory: PlannerMemory | None = None,
    settings: PlannerSettings = PlannerSettings(),
    spot_rates: Mapping[str, float] | None = None,
    serving: Mapping[Key, int] | None = None,
    alone_share: AloneShares | None = None,
) -> tuple[Plan, PlannerMemory]:
    """The plan and the planner's new memory (module docstring). Stages: what each model converges to;
    per model, its stability rule, offerings and need (_add_model); solve; keep scale-downs to dropping
    replicas unless moving saves enough; serve what limits leave unmet best effort; entries, timers and
    shortfalls. ``spot_rates`` (flavor -> interruptions per node-hour, rayscale.core.spot) discount what a
    spot replica is worth; ``serving`` (replicas serving on ready gangs, where the provider can move them):
    spot that counts for nothing is dropped once the ready rest covers the need (the act step moves its
    replicas first). ``alone_share`` (rayscale.core.estimate.alone_shares; None: every replica pooled): what
    a flavor deployment of one replica serves alone; such a fleet is planned to cover the need with it."""
    world = {k: v for k, v in (current or {}).items() if v > 0}
    memory = memory or PlannerMemory()
    blocked = _blocked(catalog, unavailable or {}, now)
    current = _converging(world, memory.targets, blocked)
    b = _Build(catalog, settings, now, blocked, dict(memory.last_change_s), dict(memory.below_since_s),
               spot_rates=spot_rates or {}, world=world, serving=serving, current=current, last_plan_s=memory.at_s,
               alone_share=alone_share if settings.alone_capacity else None)
    cur_by_model: dict[str, dict[Key, int]] = {}
    for k, n in current.items():
        cur_by_model.setdefault(k[0], {})[k] = n
    if b.alone_share is not None:
        for m, f in _alone_pairs(current):
            b.alone_now.setdefault(m, set()).add(f)
        _alone_shares(b, _alone_pairs(current) | _alone_pairs(world))
    for name in sorted(catalog.models):
        _add_model(b, name, demands.get(name), cur_by_model.get(name, {}))
    problem, have = _problem(b)
    sol, problem = _solve_alone(b, problem)
    if b.freed:
        sol = _unless_moving_saves(problem, sol, have, b.freed, settings, b.why, b.repricing,
                                   lambda p: _solve_alone(b, p)[0])
    sol, rest_best_effort = _serve_rest_best_effort(catalog, demands, problem, sol, b.rounded, b.shapes, blocked,
                                                    have, settings)
    entries, changed = _entries(catalog, problem, sol, have, current, b.gangs, b.why)
    for m in changed:
        b.last_change[m] = now
        b.below_since.pop(m, None)
    shortfalls = _shortfalls(catalog, demands, problem, sol, b.rounded, rest_best_effort)
    targets: dict[str, dict[Key, int]] = {m: {} for m in catalog.models}
    for e in entries:
        if e.replicas > 0:
            targets[e.model][(e.model, e.flavor, e.capacity_type)] = e.replicas
    return (Plan(tuple(entries), shortfalls, sol.method, tuple(b.notes), dict(b.alone)),
            PlannerMemory(b.last_change, b.below_since, targets, now))


def _add_model(b: _Build, name: str, d: Demand | None, cur: dict[Key, int]) -> None:
    """One model's need and offerings, bounded by the stability rules (module docstring)."""
    spec = b.catalog.models[name]
    if d is not None and d.state == DemandState.OK and d.burst_rps > 0:
        d = _with_burst_floor(b.catalog, name, d, b.shapes)
    caps = d.capacity if d else {}
    # Replicas that serve best effort what limits left unmet count what they serve (Demand.fallback), or
    # every period would read the model as short and they could never be scaled down with the demand.
    have_caps = {**caps, **d.fallback} if d else caps
    need = _risk_need(d, cur, have_caps)
    alone = b.alone_now.get(name, ())
    cur_cap = sum(n * (have_caps[f].rps * _counted(b, name, f, ct, have_caps[f].rps, need)[0]
                       * (b.alone.get((name, f), 1.0) if f in alone else 1.0) if f in have_caps else 0.0)
                  for (_, f, ct), n in cur.items())
    cur_n = sum(cur.values())
    mode, rps = _mode(b, name, d, cur, cur_cap, cur_n)
    if mode in (Mode.UP, Mode.FREE):
        b.open.add(name)
    if d is not None and d.best_effort:
        b.why[name] += "; best effort: no flavor meets the SLO for this mix"
    first = len(b.offers)
    held = d is None or d.state != DemandState.OK
    slots = _add_offers(b, name, mode, caps, cur, rps, need, held)
    if mode == Mode.UP and b.settings.whole_best_replicas and d is not None and d.state == DemandState.OK:
        rps = _order_whole_best(b, name, d, rps, cur, cur_cap, cur_n, b.offers[first:], slots)
    b.needs.append(ModelNeed(name, rps, spec.min_replicas, spec.max_replicas, spec.priority))


def _mode(b: _Build, name: str, d: Demand | None, cur: dict[Key, int], cur_cap: float,
          cur_n: int) -> tuple[Mode, float]:
    """The stability rule that applies to one model, and the req/s its need asks for; records why."""
    spec = b.catalog.models[name]
    if d is None or d.state == DemandState.HOLD:
        if cur_n < spec.min_replicas:
            b.why[name] = f"below min_replicas {spec.min_replicas}"
            return Mode.UP, cur_cap
        b.why[name] = d.reason if d else "no demand estimate: holding capacity"
        b.below_since.pop(name, None)
        return Mode.KEEP, cur_cap
    slack = b.settings.slack_scale_up_tolerance
    if not (d.slo_slack and d.rise_rps <= cur_cap * (1 + slack)):
        slack = 0.0  # no record of slack, or the arrivals' recent line outgrows it within a horizon
    tolerance = max(b.settings.scale_up_tolerance, slack)
    if d.rps > cur_cap * (1 + tolerance) + 1e-9 or cur_n < spec.min_replicas:
        b.why[name] = f"scale up: need {d.rps:.2f} req/s ({d.reason}), have {cur_cap:.2f}"
        b.below_since.pop(name, None)
        return Mode.UP, d.rps
    if d.rps > cur_cap:
        b.why[name] = (f"steady: need {d.rps:.2f} req/s, within the {tolerance:.0%} scale-up tolerance of the "
                       f"{cur_cap:.2f} running ({d.reason})")
        b.below_since.pop(name, None)
        return Mode.KEEP, cur_cap
    if d.rps >= (1 - _band(b.settings, d)) * cur_cap:
        b.why[name] = f"steady: need {d.rps:.2f} req/s of {cur_cap:.2f} ({d.reason})"
        b.below_since.pop(name, None)
        return _keep_or_move(b, name, d, cur, cur_cap)
    return _scale_down_or_wait(b, name, d, cur, cur_cap)


def _keep_or_move(b: _Build, name: str, d: Demand, cur: dict[Key, int], cur_cap: float) -> tuple[Mode, float]:
    """A kept model (in the band, or below it waiting to scale down): what runs, or, where _cheaper_cover
    finds a reason, its running capacity re-planned on cheaper offerings. That is Karpenter's consolidation
    by replacement: a kept model is re-planned by nothing else, and a fleet bought while its best flavor was
    backed off kept the dearer one for as long as the need stayed in the band, or crossed it back and forth
    and reset the scale-down's wait each time."""
    cheaper = _cheaper_cover(b, name, d, cur, cur_cap) if b.settings.steady_moves else None
    if cheaper is None:
        return Mode.KEEP, d.rps
    b.freed.add(name)
    b.repricing.add(name)
    b.rounded[name] = cur_cap - d.rps
    b.why[name] += f"; re-pricing its {cur_cap:.2f} req/s ({cheaper})"
    return Mode.FREE, cur_cap


def _cheaper_cover(b: _Build, name: str, d: Demand, cur: dict[Key, int], cur_cap: float) -> str | None:
    """Why a kept model's fleet may move: on-demand replicas of one flavor it can add (and its limits leave
    room for) cover what runs for ``scale_down_move_saving`` less than it costs; None where they do not, or
    the fleet changed within the dwell a scale-down waits (_need_dwell) or the downscale delay, or when is
    not known (after a restart, until the next change), or it was checked within the last downscale delay.
    Priced in whole gangs, as they are paid for: an 8-GPU node holding four replicas costs the whole node.
    A filter only: the solver plans the move, and _unless_moving_saves keeps it only where the plan saves
    as much (else the next check is a downscale delay later)."""
    cfg, spec = b.settings, b.catalog.models[name]
    last, before = b.last_change.get(name), b.last_plan_s
    if cur_cap <= 0 or last is None or b.now - last < cfg.downscale_delay_s:
        return None
    # Checked once every downscale delay, counted from the model's last change (the first plan checks all):
    # the check reads every flavor of the model, and a thousand steady models checked every period cost
    # 15-20 ms a step (bench.planner).
    every = max(cfg.downscale_delay_s, cfg.min_dwell_s, 1.0)
    if before is not None and before > last and (b.now - last) // every == (before - last) // every:
        return None
    if b.now - last < _need_dwell(b, name, cur):
        return None
    covers = derived(b.catalog, "covers", _covers)[name]
    now_usd = 0.0
    for (_, f, ct), n in cur.items():
        c = covers.get(f)
        if c is None or ct not in c.usd_per_h:
            return None
        now_usd += -(-n // c.slots) * c.slots * c.usd_per_h[ct]
    # Only a cover under this price is a reason; most steady fleets run their best flavor already, so the
    # loop rejects a flavor on one product (a lower bound: a replica at its share of a gang) before it works
    # out whole gangs and limits.
    best, best_usd = "", (1 - cfg.scale_down_move_saving) * now_usd
    od, caps = CapacityType.ON_DEMAND.value, d.capacity
    for f, c in covers.items():
        cap, price = caps.get(f), c.usd_per_h.get(od)
        if cap is None or price is None or price * cur_cap >= best_usd * cap.rps or (f, od) in b.blocked:
            continue
        n = min(math.ceil(cur_cap / cap.rps - 1e-9), spec.max_replicas)
        gangs = -(-n // c.slots)
        devices, nodes = _room(b).get(f, (math.inf, math.inf))
        usd = gangs * c.slots * price
        if usd < best_usd and n * cap.rps >= cur_cap - RPS_TOLERANCE and gangs * c.devices <= devices \
                and gangs * c.nodes <= nodes:
            best, best_usd = f, usd
    return f"{best} would cost ${best_usd:.2f}/h where it runs at ${now_usd:.2f}/h" if best else None


@dataclass(frozen=True)
class _Cover:
    """A (model, flavor) as _cheaper_cover prices it: replicas a gang holds, the gang's devices and nodes,
    and a replica's $/h (its share of the gang) per capacity type."""

    slots: int
    devices: int
    nodes: int
    usd_per_h: dict[str, float]


def _covers(catalog: Catalog) -> dict[str, dict[str, _Cover]]:
    """Per model, per flavor a gang of it fits on, its _Cover (derived once per catalog)."""
    out: dict[str, dict[str, _Cover]] = {}
    for name, spec in catalog.models.items():
        out[name] = {}
        for f, par in sorted(spec.parallelism.items()):
            got = _offer_shape(catalog, f, par) if f in catalog.flavors else "gone"
            if not isinstance(got, str):
                out[name][f] = _Cover(got[0].slots, got[2], got[0].nodes, {v: usd for _, v, usd in got[1]})
    return out


def bursts_last(cfg: PlannerSettings, d: Demand) -> bool:
    """Whether the model's bursts last a minute or more (the load moves as a level): its burst floor is
    at most ``sharp_bursts_above`` x the hour's busiest minute."""
    return 0 < d.burst_sharpness <= cfg.sharp_bursts_above


def _band(cfg: PlannerSettings, d: Demand) -> float:
    """The hysteresis band for the model's demand: narrower where its bursts last a minute or more."""
    if cfg.smooth_hysteresis_band is not None and bursts_last(cfg, d):
        return cfg.smooth_hysteresis_band
    return cfg.hysteresis_band


def _scale_down_or_wait(b: _Build, name: str, d: Demand, cur: dict[Key, int], cur_cap: float) -> tuple[Mode, float]:
    """An over-provisioned model: re-planned freely once the demand stayed below the band for the downscale
    delay and its last change is older than the dwell; kept until then."""
    cfg = b.settings
    since = b.below_since.setdefault(name, b.now)
    waited, dwell = b.now - since, b.now - b.last_change.get(name, -1e18)
    need_dwell = _need_dwell(b, name, cur)
    if waited >= cfg.downscale_delay_s and dwell >= need_dwell:
        b.freed.add(name)
        b.why[name] = f"scale down: need {d.rps:.2f} req/s, {cur_cap:.2f} running for {waited:.0f}s ({d.reason})"
        if cfg.downscale_headroom:
            b.why[name] += f"; keeping {cfg.downscale_headroom:.0%} headroom"
        if d.rise_rps > d.rps:
            b.why[name] += (f"; keeping {d.rise_rps:.2f} req/s for the rise (the rate's recent line, or a demand "
                            "SLO feedback trimmed on it)")
        # The headroom and the rise are not demand: what the solver cannot cover of them is no shortfall.
        b.rounded[name] = min(cur_cap, max(d.rps, d.rise_rps) * (1 + cfg.downscale_headroom)) - d.rps
        return Mode.FREE, d.rps + b.rounded[name]
    b.why[name] = (f"over-provisioned for {waited:.0f}s (need {d.rps:.2f} of {cur_cap:.2f} req/s); "
                   f"scale-down waits {cfg.downscale_delay_s:.0f}s, and {need_dwell:.0f}s after the last change")
    return _keep_or_move(b, name, d, cur, cur_cap)


def _room(b: _Build) -> dict[str, tuple[float, float]]:
    """Per flavor with limits, the (devices, nodes) they leave beside what every model converges to; worked
    out once a plan, when a steady model first asks (_cheaper_cover). Where limits bind, a cover that does
    not fit would be offered to the solver, and refused, every period."""
    if b.room is None:
        used: dict[str, list[float]] = {}
        for (m, f, _), n in b.current.items():
            par = b.catalog.models[m].parallelism.get(f) if m in b.catalog.models else None
            got = _cached_shape(b.catalog, b.shapes, f, par) if par is not None and f in b.catalog.flavors else "gone"
            if not isinstance(got, str):
                u = used.setdefault(f, [0.0, 0.0])
                u[0] += got[0].gangs_for(n) * got[2]
                u[1] += got[0].gangs_for(n) * got[0].nodes
        b.room = {}
        for fl in b.catalog.flavors.values():
            lim, u = fl.limits, used.get(fl.name, [0.0, 0.0])
            if lim.devices is not None or lim.nodes is not None:
                b.room[fl.name] = (math.inf if lim.devices is None else lim.devices - u[0],
                                   math.inf if lim.nodes is None else lim.nodes - u[1])
    return b.room


def _need_dwell(b: _Build, name: str, cur: dict[Key, int]) -> float:
    """How old the model's last change must be before its fleet is re-planned: min_dwell_s, and the
    start-up of the flavors it runs where dwell_covers_startup (PlannerSettings)."""
    cfg, spec = b.settings, b.catalog.models[name]
    if not cfg.dwell_covers_startup:
        return cfg.min_dwell_s
    return max([cfg.min_dwell_s] + [b.catalog.flavors[f].node_startup_s + b.catalog.profile(name, f).startup_s
                                    for (_, f, _) in cur if f in b.catalog.flavors and f in spec.parallelism])


def _risk_need(d: Demand | None, cur: dict[Key, int], caps: dict[str, ReplicaCapacity]) -> float:
    """The req/s a spot gang's risk is a share of (_spot_outage_risk), one figure for what runs and what is
    offered: the demand, not the need a stability rule asks for (a scale-down's headroom and rise are no
    requests). Where signals are held the demand is unknown, and missing metrics never mean zero load: the
    fleet's own capacity stands in."""
    if d is not None and d.state == DemandState.OK:
        return d.rps
    return sum(n * caps[f].rps for (_, f, _), n in cur.items() if f in caps)


def _add_offers(b: _Build, name: str, mode: Mode, caps: dict[str, ReplicaCapacity],
                cur: dict[Key, int], need_rps: float, risk_need: float, held: bool) -> dict[str, int]:
    """The model's offerings, bounded by ``mode`` (``need_rps``: what the mode asks for); the replicas a gang
    holds per flavor it got. Spot gangs are counted against ``risk_need`` (_risk_need), and none is dropped
    while the model's signals are ``held``."""
    spec = b.catalog.models[name]
    slots: dict[str, int] = {}
    # A kept model offers only what it runs: most models in a large steady fleet, so skip the others early.
    running = {f for (_, f, _), n in cur.items() if n > 0} if mode == Mode.KEEP else None
    shapes = b.shapes
    for fname, key in derived(b.catalog, "shape_keys", _shape_keys)[name]:
        got = shapes.get(key)  # _cached_shape, inline: this runs for every (model, flavor) pair
        if got is None:
            got = shapes[key] = _offer_shape(b.catalog, fname, spec.parallelism[fname])
        if isinstance(got, str):
            b.notes.append(f"{name} on {fname}: {got}")
            continue
        if running is not None and fname not in running:
            continue
        shape, prices, devices = got
        b.gangs[(name, fname)] = shape
        slots[fname] = shape.slots
        cap = caps[fname].rps if fname in caps else 0.0
        unit = len(b.gangs)
        interrupted = _interrupted(b, fname)
        for ct, ctv, price in prices:
            # _counted's common case (no interruption seen on the flavor) without the call.
            worth, risk = _counted(b, name, fname, ctv, cap, risk_need) if interrupted else (1.0, 0.0)
            if 0 < worth < 0.995:
                b.why[name] = (f"{b.why.get(name, '')}; spot {fname} counted at {worth:.0%} "
                               f"({b.spot_rates[fname]:.2f} interruptions per node-hour)")
            have = cur.get((name, fname, ctv), 0)
            lb, ub = (have, have) if mode == Mode.KEEP else (have if mode == Mode.UP else 0, spec.max_replicas)
            if (fname, ctv) in b.blocked or cap <= 0:
                ub = min(ub, have)  # no new gangs where capacity errors back us off or SLO is unmeetable
                lb = min(lb, ub)
            if risk > b.settings.spot_outage_budget:  # nor is an interrupted one replaced on spot
                b.why[name] = (f"{b.why.get(name, '')}; no new spot {fname}, and the running ones count for "
                               f"nothing: one interrupted gang would put {risk:.1%} of requests at risk")
                ub = min(ub, have, b.world.get((name, fname, ctv), 0))
                # Dropped once the rest of the ready fleet covers the need: its replicas move onto it
                # (act._drains), and nothing new is ordered for them (SPOT_DROP_OVER_BUDGET says when).
                # Not on held signals: the need is then unknown, and no data is no reason to scale down.
                over = risk > SPOT_DROP_OVER_BUDGET * b.settings.spot_outage_budget
                drop = over and mode != Mode.UP and not held
                lb = 0 if drop and _ready_covers(b, name, caps, need_rps, risk_need) else min(lb, ub)
            if ub <= 0 and have == 0:
                continue
            b.offers.append(_Offer(name, fname, ct, price, cap * worth, devices, shape.nodes, lb, ub, unit,
                                   shape.slots, have))
    return slots


def _ready_covers(b: _Build, model: str, caps: dict[str, ReplicaCapacity], need_rps: float,
                  risk_need: float) -> bool:
    """The model's replicas serving on ready gangs, each at what it counts for (_counted against
    ``risk_need``), cover the need; False where the provider cannot move replicas (``_Build.serving`` None)."""
    if b.serving is None:
        return False
    have = sum(n * caps[f].rps * _counted(b, model, f, ct, caps[f].rps, risk_need)[0]
               for (m, f, ct), n in b.serving.items() if m == model and f in caps)
    return have >= need_rps


def _spot_exposure(b: _Build, model: str, flavor: str, capacity_type: str) -> tuple[float, int, float]:
    """(learned interruptions per node-hour, nodes per gang, a replacement's lead time in s) of one offering;
    a rate of 0 on demand and where no interruption of the flavor was seen (rayscale.core.spot)."""
    rate = b.spot_rates.get(flavor, 0.0) if capacity_type == CapacityType.SPOT else 0.0
    par = b.catalog.models[model].parallelism.get(flavor)
    if rate <= 0 or flavor not in b.catalog.flavors or par is None:
        return 0.0, 1, 0.0
    got = _cached_shape(b.catalog, b.shapes, flavor, par)
    nodes = 1 if isinstance(got, str) else got[0].nodes
    return rate, nodes, b.catalog.flavors[flavor].node_startup_s + b.catalog.profile(model, flavor).startup_s


def _spot_outage_risk(b: _Build, model: str, flavor: str, capacity_type: str, replica_rps: float,
                      need_rps: float) -> float:
    """Share of the model's requests one spot gang's interruptions put at risk: the share of the time it is
    out (rate x nodes x the replacement's lead time) times the share of the need it carries. 0 where the
    flavor's on-demand capacity may not stand in (not offered, or backed off): risky spot serves better
    than none."""
    rate, nodes, lead_s = _spot_exposure(b, model, flavor, capacity_type)
    if rate <= 0:
        return 0.0
    got = _cached_shape(b.catalog, b.shapes, flavor, b.catalog.models[model].parallelism[flavor])
    od = CapacityType.ON_DEMAND.value
    if isinstance(got, str) or (flavor, od) in b.blocked or not any(v == od for _, v, _ in got[1]):
        return 0.0
    carried = min(1.0, replica_rps * got[0].slots / need_rps) if need_rps > 0 else 1.0
    return rate * nodes * lead_s / 3600.0 * carried


def _counted(b: _Build, model: str, flavor: str, capacity_type: str, replica_rps: float,
             need_rps: float) -> tuple[float, float]:
    """(the share of its capacity a replica of the offering counts for, the share of the model's requests
    one interrupted gang of it puts at risk, _spot_outage_risk). The share is its availability (_worth),
    and nothing on a spot gang whose interruptions put more requests at risk than the outage budget allows.
    Such a gang was ordered before its flavor's rate was learned; counted at nothing, the plan orders
    on-demand capacity beside it, which serves before the gang goes (interrupted, or dropped by the next
    scale-down), where replacing it outright would take its capacity away for a start-up (simulated: the
    dev diurnal day at one notice per node-hour lost a kept spot L40S of three at its peak, 9 min to
    replace, 1,100 queued)."""
    if capacity_type != CapacityType.SPOT or not _interrupted(b, flavor):
        return 1.0, 0.0  # the common case, a thousand models a step: no interruption seen
    risk = _spot_outage_risk(b, model, flavor, capacity_type, replica_rps, need_rps)
    return (0.0 if risk > b.settings.spot_outage_budget else _worth(b, model, flavor, capacity_type)), risk


def _interrupted(b: _Build, flavor: str) -> bool:
    """Spot interruptions of the flavor have been seen (its learned rate is above 0)."""
    return not b.spot_rates.get(flavor, 0.0) <= 0


def _worth(b: _Build, model: str, flavor: str, capacity_type: str) -> float:
    """The share of its capacity a replica counts for: 1 on demand; on spot, the time it serves between
    interruptions and their replacements."""
    rate, nodes, lead_s = _spot_exposure(b, model, flavor, capacity_type)
    return availability(rate, nodes, lead_s) if rate > 0 else 1.0


def _order_whole_best(b: _Build, name: str, d: Demand, rps: float, cur: dict[Key, int], cur_cap: float,
                      cur_n: int, mine: list[_Offer], slots: dict[str, int]) -> float:
    """A scale-up's need rounded up to whole replicas of the model's best-value offering (_whole_best),
    after unpinning running replicas that cost ``replace_worse_than`` x the best per req/s."""
    cfg = b.settings
    value = _flavor_values(b.catalog, [(o.flavor, o.capacity_type, o.usd_per_h, o.rps, o.ub > o.lb) for o in mine])
    addable = [(v, r, f) for f, (v, r, can_add) in value.items() if can_add]
    kept_cap, kept_n = cur_cap, cur_n
    if addable and cfg.replace_worse_than:
        # Replicas of a flavor that costs replace_worse_than x the best per req/s are no longer
        # pinned: the scale-up may replace them (act starts the new ones before draining them).
        limit = cfg.replace_worse_than * min(addable)[0]
        for o in mine:
            if o.lb > 0 and value.get(o.flavor, (math.inf,))[0] > limit:
                kept_cap -= o.lb * o.rps
                kept_n -= o.lb
                o.lb = 0
    have_f: dict[str, int] = {}
    for (_, f, _), n in cur.items():
        have_f[f] = have_f.get(f, 0) + n
    addable = _order_values(addable, rps - kept_cap, slots, have_f)
    rps, b.why[name] = _whole_best(rps, kept_cap, kept_n, b.catalog.models[name].max_replicas, b.why[name], addable)
    b.rounded[name] = rps - d.rps
    return rps


def _problem(b: _Build) -> tuple[Problem, list[int]]:
    """The solver's problem over the gathered offerings (in column form), and the replicas each runs now."""
    # Column by column: one tuple per offering would add thousands of allocations, and garbage collections.
    offers = b.offers
    model, flavor, ct = [o.model for o in offers], [o.flavor for o in offers], [o.capacity_type for o in offers]
    usd, rps, devices = [o.usd_per_h for o in offers], [o.rps for o in offers], [o.devices for o in offers]
    nodes, lb, ub = [o.nodes for o in offers], [o.lb for o in offers], [o.ub for o in offers]
    unit, slots, have = [o.unit for o in offers], [o.slots for o in offers], [o.have for o in offers]
    flavors = b.catalog.flavors.values()
    return Problem(
        needs=b.needs,
        offerings=OfferingTable(model, flavor, ct, usd, rps, devices, nodes, lb, ub, unit, slots),
        device_limits={f.name: f.limits.devices for f in flavors if f.limits.devices is not None},
        node_limits={f.name: f.limits.nodes for f in flavors if f.limits.nodes is not None},
        spot_share={f.name: f.spot_max_share for f in flavors},
    ), have


def _entries(catalog: Catalog, problem: Problem, sol: Solution, have: list[int], current: dict[Key, int],
             gangs: dict[tuple[str, str], GangShape], why: dict[str, str]) -> tuple[list[PlanEntry], set[str]]:
    """The plan's entries, sorted, and the models whose replicas change."""
    offs = problem.offerings
    assert isinstance(offs, OfferingTable)
    entries = []
    changed: set[str] = set()
    known: set[Key] = set()
    for j in sorted(set(sol.counts) | {j for j, h in enumerate(have) if h}):
        m, f, ctv = offs.model[j], offs.flavor[j], offs.capacity_type[j].value
        k = (m, f, ctv)
        n = sol.counts.get(j, 0)
        now_n = current.get(k, 0)
        known.add(k)
        if n == 0 and now_n == 0:
            continue
        if n != now_n:
            changed.add(m)
        # Replicas are priced as their share of a gang; the plan pays for the whole gangs they pack into.
        g = gangs[(m, f)]
        rps = offs.rps[j]
        # Built without __init__ (one object.__setattr__ a field): a 10,000-node fleet has thousands.
        entries.append(frozen_without_init(PlanEntry, {
            "model": m, "flavor": f, "capacity_type": ctv, "replicas": n, "current": now_n, "gang": g,
            "usd_per_h": g.gangs_for(n) * g.slots * offs.usd_per_h[j], "rps_capacity": n * rps, "reason": why[m],
            "replica_rps": rps}))
    # Replicas on offerings the catalog no longer has (flavor removed): plan them away, visibly.
    for k, n in sorted(current.items()):
        if k not in known and k[0] in catalog.models and (k[0], k[1]) in gangs:
            entries.append(PlanEntry(*k, 0, n, gangs[(k[0], k[1])], 0.0, 0.0, "offering no longer available"))
    entries.sort(key=lambda e: (e.model, e.flavor, e.capacity_type))
    return entries, changed


def _shortfalls(catalog: Catalog, demands: dict[str, Demand], problem: Problem, sol: Solution,
                rounded: dict[str, float], rest_best_effort: set[str]) -> tuple[Shortfall, ...]:
    """Models with demand unmet, below min_replicas, or served best effort, highest priority first."""
    offs = problem.offerings
    assert isinstance(offs, OfferingTable)
    offs_of: dict[str, list[tuple[float, int, str]]] = {}  # model -> (rps, ub, flavor) per offering
    if sol.unmet_rps or sol.missing_min:
        for j, m in enumerate(offs.model):
            if m in sol.unmet_rps or m in sol.missing_min:
                offs_of.setdefault(m, []).append((offs.rps[j], offs.ub[j], offs.flavor[j]))
    # What rounding up ordered is not demand: only unmet demand is a shortfall.
    unmet = {m: u - rounded.get(m, 0.0) for m, u in sol.unmet_rps.items()}
    unmet = {m: u for m, u in unmet.items()
             if u > RPS_TOLERANCE and demands.get(m) is not None and demands[m].state == DemandState.OK}
    planned: dict[str, int] = {}
    runs: dict[str, dict[str, int]] = {}  # model -> flavor -> replicas planned
    for j, n in sol.counts.items():
        m, f = offs.model[j], offs.flavor[j]
        planned[m] = planned.get(m, 0) + n
        runs.setdefault(m, {})[f] = runs.get(m, {}).get(f, 0) + n
    # A best-effort model is a shortfall whenever it serves or should: its requests miss the SLO.
    best = {m for m, d in demands.items() if d.best_effort and m in catalog.models
            and (planned.get(m, 0) or m in unmet or m in sol.missing_min)} | rest_best_effort
    return tuple(
        Shortfall(m, round(unmet.get(m, 0.0), 4),
                  _shortfall_reason(catalog, m, problem, offs_of.get(m, []), planned.get(m, 0),
                                    (demands[m], runs.get(m, {})) if m in best else None,
                                    m in unmet or m in sol.missing_min),
                  sol.missing_min.get(m, 0), m in best)
        for m in sorted(set(unmet) | set(sol.missing_min) | best, key=lambda m: (-catalog.models[m].priority, m))
    )


Shapes = dict[tuple[str, int, int], tuple[GangShape, list[tuple[CapacityType, str, float]], int] | str]


def _shape_keys(catalog: Catalog) -> dict[str, tuple[tuple[str, tuple[str, int, int]], ...]]:
    """Per model, its flavors in name order with their Shapes keys."""
    return {name: tuple((f, (f, par.tp, par.pp)) for f, par in sorted(spec.parallelism.items()))
            for name, spec in catalog.models.items()}


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
        drain[fname] = drain_rps(catalog.profile(model, fname), mix, cap.batch, spec.slo.tpot_p95_s)
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


def _alone_pairs(counts: Mapping[Key, int]) -> set[tuple[str, str]]:
    """The (model, flavor) deployments that run one replica (on-demand and spot together: one deployment)."""
    per: dict[tuple[str, str], int] = {}
    for (m, f, _), n in counts.items():
        if n > 0:
            per[(m, f)] = per.get((m, f), 0) + n
    return {k for k, n in per.items() if n == 1}


def _alone_shares(b: _Build, pairs: Iterable[tuple[str, str]]) -> dict[tuple[str, str], float]:
    """The estimator's alone shares, each pair asked once a plan (a search per call: asked in batches)."""
    if b.alone_share is not None:
        todo = sorted(k for k in pairs if k not in b.alone)
        if todo:
            b.alone.update(b.alone_share(todo))
    return b.alone


# Doubling one flavor's lone replica may leave another model's lone one short: checked once more.
ALONE_RESOLVES = 2


def _solve_alone(b: _Build, problem: Problem) -> tuple[Solution, Problem]:
    """The solver's plan and the problem it solves. Where a scaled or re-planned model's fleet falls short
    of its demand once its deployments of one replica count what they serve alone, the one that loses most
    gets a second replica (a deployment of two pools again; the solver re-plans the rest around it), unless
    that leaves any model with more unmet than before (limits)."""
    sol = _solve(problem, b.settings)
    for _ in range(ALONE_RESOLVES if b.alone_share is not None else 0):
        short = _alone_short(b, problem, sol)
        if not short:
            break
        offs = problem.offerings
        assert isinstance(offs, OfferingTable)
        lb = list(offs.lb)
        for j in short.values():
            lb[j] = max(lb[j], 2)
        trial_problem = replace(problem, offerings=offs.with_bounds(lb, offs.ub))
        trial = _solve(trial_problem, b.settings)
        if _worse(trial, sol):
            break
        for m, j in sorted(short.items()):
            b.why[m] = b.why.get(m, "") + f"; two {offs.flavor[j]} replicas: one alone serves too little"
        problem, sol = trial_problem, trial
    return sol, problem


def _worse(sol: Solution, than: Solution) -> bool:
    """Some model has more demand unmet, or more replicas missing below its minimum, in ``sol``."""
    return any(sol.unmet_rps.get(m, 0.0) > than.unmet_rps.get(m, 0.0) + RPS_TOLERANCE
               or sol.missing_min.get(m, 0) > than.missing_min.get(m, 0)
               for m in set(sol.unmet_rps) | set(sol.missing_min))


def _alone_short(b: _Build, problem: Problem, sol: Solution) -> dict[str, int]:
    """Per open model (b.open) whose planned fleet, its one-replica deployments counted at what they serve
    alone, covers less than its demand: the offering of the one-replica deployment that loses most (the
    demand is the need less what rounding, headroom and a kept rise add to it, b.rounded: margin already)."""
    offs = problem.offerings
    assert isinstance(offs, OfferingTable)
    per: dict[tuple[str, str], int] = {}
    for j, n in sol.counts.items():
        # A model the solver left short already is bound by limits: a second replica cannot start.
        if n > 0 and offs.model[j] in b.open and sol.unmet_rps.get(offs.model[j], 0.0) <= RPS_TOLERANCE:
            k = (offs.model[j], offs.flavor[j])
            per[k] = per.get(k, 0) + n
    lone = [k for k, n in per.items() if n == 1]
    if not lone:
        return {}
    shares = _alone_shares(b, lone)
    served: dict[str, float] = {}
    lost: dict[str, float] = {}
    worst: dict[str, tuple[float, int]] = {}
    for j, n in sol.counts.items():
        k = (offs.model[j], offs.flavor[j])
        if n > 0 and k in per:
            served[k[0]] = served.get(k[0], 0.0) + n * offs.rps[j]
            if per[k] == 1 and offs.ub[j] >= 2:
                x = offs.rps[j] * (1.0 - shares.get(k, 1.0))
                lost[k[0]] = lost.get(k[0], 0.0) + x
                worst[k[0]] = max(worst.get(k[0], (-1.0, j)), (x, j))
    demand = {n.model: n.rps - b.rounded.get(n.model, 0.0) for n in problem.needs if n.model in lost}
    return {m: worst[m][1] for m, x in lost.items() if served[m] - x < demand[m] - RPS_TOLERANCE}


def _solve(problem: Problem, settings: PlannerSettings) -> Solution:
    if settings.solver == SolverChoice.EXACT:
        return solve_exact(problem)
    if settings.solver == SolverChoice.GREEDY:
        return solve_greedy(problem)
    return solve(problem, settings.exact_max_vars)


def _unless_moving_saves(problem: Problem, sol: Solution, have: list[int], freed: set[str],
                         settings: PlannerSettings, why: dict[str, str], steady: set[str],
                         solve: Callable[[Problem], Solution]) -> Solution:
    """The scale-downs of ``freed`` models by dropping running replicas only (the ``steady`` ones keep what
    runs), unless starting replicas on other offerings costs ``settings.scale_down_move_saving`` less
    (PlannerSettings says why). ``solve``: the plan's solver (_solve_alone)."""
    offs = problem.offerings
    assert isinstance(offs, OfferingTable)
    moves = [j for j in range(len(offs)) if offs.model[j] in freed and sol.counts.get(j, 0) > have[j]]
    if not moves:
        return sol
    ub = [min(u, have[j]) if offs.model[j] in freed else u for j, u in enumerate(offs.ub)]
    lb = [min(v, ub[j]) for j, v in enumerate(offs.lb)]
    down = solve(replace(problem, offerings=offs.with_bounds(lb, ub)))
    # Any model: on a flavor with a device limit, what the freed models keep may be what another one needed.
    worse = _worse(down, sol)
    if worse or sol.usd_per_h < (1 - settings.scale_down_move_saving) * down.usd_per_h:
        return sol
    saving = 1 - sol.usd_per_h / down.usd_per_h if down.usd_per_h > 0 else 0.0
    for m in sorted({offs.model[j] for j in moves}):
        why[m] += (f"; {'keeping' if m in steady else 'dropping'} running replicas only (starting others would "
                   f"save {saving:.0%}, under {settings.scale_down_move_saving:.0%})")
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
    # The solver may cover the rounded need with another mix (two inf2 for one L40S's worth): say what was rounded.
    return whole, (f"{why}; rounded up to {whole:.2f} req/s, whole {flavor} replicas "
                   f"({rps:.2f} req/s at ${per_rps * rps:.2f}/h each)")


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
