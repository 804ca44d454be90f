"""Act, decided purely: the plan's target and the observed world in, the actions to take out.

Level-triggered and idempotent: the same world and target give the same actions, and a restarted
controller that rebuilt its view from the cluster (ownership labels) decides the same thing again.
Ordering rules (DESIGN.md): provision whole gangs first, then add Serve replicas; drain Serve replicas
first, then release gangs that serve nothing. A gang not fully up within its launch timeout, or marked
failed by the cloud (capacity error), is deleted whole and its (flavor, zone, capacity type) backed off,
so the next plan falls back to another zone or flavor. Never an idle half gang. Where the provider can
drain (``can_drain``), a serving gang of a capacity type the plan wants fewer of (spot it no longer counts
on) is drained once the flavor's other gangs have free slots for its replicas: Serve moves them before it
stops the old ones, and the drained gang is released once it serves nothing.

Packing: a single-node gang holds ``slots`` replicas (rayscale.core.gangs.GangShape.slots; eight TP=1 on a
p5.48xlarge). The plan's target is replicas: a key wants ceil(replicas / slots) gangs, so new replicas fill
the free slots of running gangs before a gang is ordered, and Serve runs min(planned, slots x ready gangs)
replicas of a (model, flavor). A scale-down lowers Serve's target; Serve stops the replicas on the nodes
with the fewest replicas first (``DeploymentScheduler._get_replicas_to_stop`` in
ray/serve/_private/deployment_scheduler.py), so whole gangs empty and a gang is released once it serves 0.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from operator import attrgetter

from rayscale.core.catalog import CapacityType, Catalog
from rayscale.core.gangs import GangError, choose_zone, gang_shape

Key = tuple[str, str, str]  # (model, flavor, capacity type)


class GangPhase(StrEnum):
    PENDING = "pending"  # some member not up yet
    READY = "ready"  # every member up and initialised
    FAILED = "failed"  # the cloud gave up on a member (capacity error, deleted)


@dataclass(frozen=True)
class Gang:
    """One replica's nodes as the actuator observes them (rebuilt from labels after a restart)."""

    name: str
    model: str
    flavor: str
    capacity_type: str
    zone: str
    instance_type: str
    nodes: int
    phase: GangPhase
    created_s: float
    serving: int = 0  # Serve replicas running on its nodes (up to its shape's slots)
    reason: str = ""
    node_ids: tuple[str, ...] = ()  # members that are up (Ray node ids locally, Node names on Kubernetes)
    # When it entered its phase; None: at creation. A ready gang that goes PENDING again (a restarted
    # worker pod) gets a fresh launch timeout from here, not from its creation long ago.
    since_s: float | None = None
    # Its slot among the gangs of its (model, flavor): the Ray node label a multi-node replica's placement
    # group selects (rayscale.serve.config.slot_label_selector). None: the actuator gives none.
    slot: int | None = None
    # Its nodes were drained (DrainGang): Serve moves its replicas elsewhere and it takes no new ones. A
    # drain cannot be undone, so the step counts it as gone and releases it once it serves nothing.
    draining: bool = False

    @property
    def phase_since_s(self) -> float:
        return self.created_s if self.since_s is None else self.since_s

    @property
    def key(self) -> Key:
        return (self.model, self.flavor, self.capacity_type)


@dataclass(frozen=True)
class CreateGang:
    name: str
    model: str
    flavor: str
    capacity_type: str
    zone: str
    instance_type: str
    nodes: int
    reason: str


@dataclass(frozen=True)
class DeleteGang:
    name: str
    reason: str


@dataclass(frozen=True)
class DrainGang:
    """Drain every node of the gang through Ray (the GCS's DrainNode, reason preemption): Serve starts a
    replacement of each replica on it elsewhere and stops the old one once the replacement runs
    (``migrate_replicas_on_draining_nodes`` in ray/serve/_private/deployment_state.py), so no request is
    dropped. The gang is released once it serves nothing."""

    name: str
    reason: str


@dataclass(frozen=True)
class SetReplicas:
    model: str
    flavor: str
    replicas: int
    reason: str


@dataclass(frozen=True)
class BackOff:
    flavor: str
    zone: str
    capacity_type: str
    until_s: float
    reason: str


Action = CreateGang | DeleteGang | DrainGang | SetReplicas | BackOff


@dataclass(frozen=True)
class ActSettings:
    launch_timeout_factor: float = 3.0  # a gang may take this x the flavor's node_startup_s to come up
    backoff_s: float = 300.0

    def __post_init__(self) -> None:
        if self.launch_timeout_factor <= 0:
            raise ValueError(f"ActSettings.launch_timeout_factor must be > 0, got {self.launch_timeout_factor}")
        if self.backoff_s < 0:
            raise ValueError(f"ActSettings.backoff_s must be >= 0, got {self.backoff_s}")


def gang_name(model: str, flavor: str, capacity_type: str, index: int) -> str:
    ct = "spot" if capacity_type == CapacityType.SPOT.value else "od"
    return f"{model}-{flavor}-{ct}-{index}"


def decide(
    catalog: Catalog,
    target: dict[Key, int],
    gangs: list[Gang],
    serve_target: dict[tuple[str, str], int],
    serve_running: dict[tuple[str, str], int],
    unavailable: dict[tuple[str, str, str], float],
    now: float,
    settings: ActSettings = ActSettings(),
    serve_serving: dict[tuple[str, str], int] | None = None,
    replica_rps: Mapping[tuple[str, str], float] | None = None,
    can_drain: bool = False,
) -> list[Action]:
    """``serve_running``: replicas that exist (starting and stopping ones too); ``serve_serving``: those that
    take requests (None: the running ones); ``replica_rps``: the plan's req/s of one replica per (model,
    flavor), so that a drain holds only what stands in for capacity coming up (None: every replica, _kept);
    ``can_drain``: the provider drains gangs (DrainGang), so a serving gang of an over-planned capacity type
    is moved onto the flavor's other gangs (_drains) instead of being kept until Serve empties it."""
    serving = serve_running if serve_serving is None else serve_serving
    backoffs = {k for k, until in unavailable.items() if until > now}
    actions, live = _drop_failed(catalog, gangs, backoffs, now, settings)
    actions += [DeleteGang(g.name, "drained: its replicas moved") for g in live if g.draining and g.serving == 0]
    live = [g for g in live if not g.draining]

    by_key: dict[Key, list[Gang]] = defaultdict(list)
    ready_n: dict[Key, int] = defaultdict(int)  # ready gangs per key
    pending_models: set[str] = set()
    for g in live:  # one pass: a 10,000-node fleet is as many gangs
        by_key[key := g.key].append(g)
        if g.phase == GangPhase.READY:
            ready_n[key] += 1
        elif g.phase == GangPhase.PENDING:
            pending_models.add(g.model)
    slots = _slots(catalog, {(k[0], k[1]) for k in set(target) | set(by_key)})
    gangs_wanted = {k: -(-n // slots[(k[0], k[1])]) for k, n in target.items()}

    creates = _create_gangs(catalog, target, gangs, by_key, gangs_wanted, _room(gangs_wanted, live), backoffs)
    actions += creates
    pending_models |= {a.model for a in creates}

    # Serve replicas per (model, flavor): only onto ready gangs; lowering drains before any release.
    flavors_of: dict[tuple[str, str], list[Key]] = defaultdict(list)
    for key in set(target) | set(by_key):
        flavors_of[(key[0], key[1])].append(key)
    desired = _desired(catalog, target, ready_n, flavors_of, serve_target, slots)
    coming = _coming(desired, serving)
    for mf, (n, want, ready) in desired.items():
        keep = _kept(mf, n, serve_target.get(mf, 0), coming.get(mf[0], {}), mf[0] in pending_models,
                     replica_rps)
        if can_drain:
            actions += _drains(flavors_of.get(mf, []), by_key, gangs_wanted, keep, slots.get(mf, 1))
        actions += _set_replicas(mf, n, keep, want, ready, serve_target.get(mf, 0), slots.get(mf, 1))
        actions += _release(mf, flavors_of.get(mf, []), by_key, target, gangs_wanted,
                            serve_running.get(mf, 0) <= keep, -(-keep // slots.get(mf, 1)), can_drain)
    return actions


def _room(gangs_wanted: dict[Key, int], live: list[Gang]) -> dict[tuple[str, str], int]:
    """Gangs each (model, flavor) may still order. Serve places a model's replicas on any ready node of the
    flavor, whatever its capacity type: gangs are counted per (model, flavor) too, so a flavor never holds
    more gangs than its replicas can use (else an on-demand gang serving where the plan wanted spot leaves a
    spot gang idle, held and never released)."""
    room: dict[tuple[str, str], int] = defaultdict(int)
    for key, n in gangs_wanted.items():
        room[(key[0], key[1])] += n
    for g in live:
        room[(g.model, g.flavor)] -= 1
    return room


def _desired(catalog: Catalog, target: dict[Key, int], ready_n: dict[Key, int],
             flavors_of: dict[tuple[str, str], list[Key]], serve_target: dict[tuple[str, str], int],
             slots: dict[tuple[str, str], int]) -> dict[tuple[str, str], tuple[int, int, int]]:
    """Per (model, flavor): (replicas Serve should run, replicas planned, ready gangs); ``ready_n``: ready
    gangs per key. Only deployments of models and flavors this controller owns: other apps' replicas are
    not ours."""
    owned = {mf for mf in serve_target if mf[0] in catalog.models and mf[1] in catalog.models[mf[0]].parallelism}
    desired: dict[tuple[str, str], tuple[int, int, int]] = {}
    for mf in sorted(set(flavors_of) | owned):
        keys = flavors_of.get(mf, [])
        want = sum(target.get(k, 0) for k in keys)
        ready = sum(ready_n.get(k, 0) for k in keys)
        desired[mf] = (min(want, ready * slots.get(mf, 1)), want, ready)
    return desired


def _over(keys: list[Key], by_key: dict[Key, list[Gang]], gangs_wanted: dict[Key, int]) -> set[Key]:
    """The capacity types of one (model, flavor) that hold more gangs than the plan wants."""
    return {k for k in keys if len(by_key.get(k, [])) > gangs_wanted.get(k, 0)}


def _drains(keys: list[Key], by_key: dict[Key, list[Gang]], gangs_wanted: dict[Key, int], serve_n: int,
            slots: int) -> list[Action]:
    """Serving gangs of over-planned capacity types (spot the plan no longer counts on) drained where their
    replicas fit: free slots of the (model, flavor)'s other ready gangs that Serve's target ``serve_n`` does
    not fill. Serve moves each replica before it stops the old one. At most each key's surplus; the gangs
    that serve fewest replicas first, then the newest. A lower target alone moves nothing: Serve stops the
    replicas it picks, and the gangs they leave idle are the free slots of the next period."""
    over = _over(keys, by_key, gangs_wanted)
    ready = [g for k in keys for g in by_key.get(k, []) if g.phase == GangPhase.READY]
    free = sum(slots - g.serving for g in ready if g.key not in over)
    free -= max(0, serve_n - sum(g.serving for g in ready))  # slots Serve's own target still fills
    out: list[Action] = []
    for key in sorted(over):
        surplus = len(by_key[key]) - gangs_wanted.get(key, 0)
        # One node only: a multi-node replica's placement group selects its gang's slot label
        # (rayscale.serve.config.slot_label_selector), so Serve could not place its replacement elsewhere.
        movable = sorted((g for g in by_key[key] if g.phase == GangPhase.READY and g.serving > 0 and g.nodes == 1),
                         key=lambda g: (g.serving, -g.created_s, g.name))
        for g in movable[:surplus]:
            if g.serving > free:
                break
            free -= g.serving
            out.append(DrainGang(g.name, f"plan wants {gangs_wanted.get(key, 0)} gang(s) of {key[2]}; "
                                         f"moving its {g.serving} replica(s) to free slots of the flavor"))
    return out


def _coming(desired: dict[tuple[str, str], tuple[int, int, int]],
            serving: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    """Per model and flavor, the planned replicas that do not serve yet (on pending gangs, or placed and
    starting)."""
    coming: dict[str, dict[str, int]] = defaultdict(dict)
    for (m, f), (_, want, _) in desired.items():
        if want > serving.get((m, f), 0):
            coming[m][f] = want - serving.get((m, f), 0)
    return coming


def _kept(mf: tuple[str, str], n: int, cur: int, coming: dict[str, int], pending: bool,
          replica_rps: Mapping[tuple[str, str], float] | None) -> int:
    """Replicas of ``mf`` Serve keeps: its share ``n``, or more while the model's capacity elsewhere is
    still coming up (make before break: gangs pending, or replicas placed but not serving, since a gang is
    ready minutes before its replica has loaded the model). Knowing each replica's req/s, it keeps only
    enough to stand in for what is not serving yet; a whole old fleet held for one small replica's start-up
    costs every one of its nodes for that long."""
    if n >= cur:
        return n
    model, flavor = mf
    others = {f: gap for f, gap in coming.items() if f != flavor}
    if not others and not pending:
        return n
    rps = replica_rps or {}
    if rps.get(mf, 0.0) <= 0 or any(rps.get((model, f), 0.0) <= 0 for f in others):
        return cur
    missing = sum(gap * rps[(model, f)] for f, gap in others.items())
    return min(cur, n + math.ceil(missing / rps[mf] - 1e-9))


def _set_replicas(mf: tuple[str, str], desired: int, keep: int, want: int, ready: int, cur: int,
                  slots: int) -> list[Action]:
    if desired > cur:
        held = f"{ready} gang(s) ready" + (f" ({ready * slots} slots)" if slots > 1 else "")
        return [SetReplicas(*mf, desired, f"{held} for {want} planned")]
    if keep < cur:
        held = f", {keep - desired} held while the model's capacity elsewhere comes up" if keep > desired else ""
        return [SetReplicas(*mf, keep, f"drain to {keep}: plan wants {want}{held}")]
    return []


def _drop_failed(catalog: Catalog, gangs: list[Gang], backoffs: set[tuple[str, str, str]], now: float,
                 settings: ActSettings) -> tuple[list[Action], list[Gang]]:
    """Failed gangs and those stuck pending past their launch timeout: deleted whole, their zone backed off
    (added to ``backoffs``). Returns those actions and the live gangs, by name."""
    actions: list[Action] = []
    live: list[Gang] = []
    for g in sorted(gangs, key=attrgetter("name")):
        if g.phase != GangPhase.PENDING and g.phase != GangPhase.FAILED:
            live.append(g)
            continue
        timeout = settings.launch_timeout_factor * catalog.flavors[g.flavor].node_startup_s \
            if g.flavor in catalog.flavors else 0.0
        pending_s = now - g.phase_since_s
        stuck = g.phase == GangPhase.PENDING and pending_s > timeout
        if g.phase == GangPhase.FAILED or stuck:
            why = g.reason or (f"not up after {pending_s:.0f}s" if stuck else "failed")
            actions.append(DeleteGang(g.name, f"partial gang: {why}; deleting all {g.nodes} nodes"))
            zk = (g.flavor, g.zone, g.capacity_type)
            if zk not in backoffs:
                backoffs.add(zk)
                actions.append(BackOff(*zk, now + settings.backoff_s, f"{g.name}: {why}"))
        else:
            live.append(g)
    return actions, live


def _create_gangs(catalog: Catalog, target: dict[Key, int], gangs: list[Gang], by_key: dict[Key, list[Gang]],
                  gangs_wanted: dict[Key, int], room: dict[tuple[str, str], int],
                  backoffs: set[tuple[str, str, str]]) -> list[CreateGang]:
    """Up: whole gangs, deterministic names (lowest free index) so a retry after a crash is idempotent.
    Takes what it creates from ``room``."""
    actions: list[CreateGang] = []
    used_names: set[str] | None = None  # built at the first gang to name: most periods order none
    for key in sorted(set(target) | set(by_key)):
        model, flavor, ct = key
        want, have = gangs_wanted.get(key, 0), by_key.get(key, [])
        if want <= len(have) or model not in catalog.models or flavor not in catalog.flavors:
            continue
        want = len(have) + min(want - len(have), max(room[(model, flavor)], 0))
        fl = catalog.flavors[flavor]
        shape = gang_shape(catalog, model, flavor)  # the plan sizes gangs at on-demand prices too
        taken: dict[str, int] = defaultdict(int)
        for g in have:
            taken[g.zone] += 1
        i = 0
        if used_names is None:
            used_names = {g.name for g in gangs}
        for _ in range(want - len(have)):
            zone = choose_zone(fl, CapacityType(ct), backoffs, taken)
            if zone is None:
                break  # every zone backed off: the next plan moves this demand elsewhere
            while gang_name(model, flavor, ct, i) in used_names:
                i += 1
            name = gang_name(model, flavor, ct, i)
            used_names.add(name)
            taken[zone] += 1
            room[(model, flavor)] -= 1
            actions.append(CreateGang(name, model, flavor, ct, zone, shape.instance_type, shape.nodes,
                                      f"plan wants {target[key]} x {ct} in {want} gang(s), have {len(have)}"))
    return actions


def _slots(catalog: Catalog, pairs: set[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """Replicas one gang of each (model, flavor) holds; 1 where the catalog no longer has it."""
    out = {}
    by_shape: dict[tuple[str, int, int], int] = {}  # a gang depends only on (flavor, tp, pp): once each
    for m, f in pairs:
        out[(m, f)] = 1
        if m in catalog.models and f in catalog.flavors and f in catalog.models[m].parallelism:
            par = catalog.models[m].parallelism[f]
            key = (f, par.tp, par.pp)
            if key not in by_shape:
                by_shape[key] = 1
                with contextlib.suppress(GangError):  # no instance fits: the plan never orders it
                    by_shape[key] = gang_shape(catalog, m, f).slots
            out[(m, f)] = by_shape[key]
    return out


def _release(mf: tuple[str, str], keys: list[Key], by_key: dict[Key, list[Gang]], target: dict[Key, int],
             gangs_wanted: dict[Key, int], drained: bool, held: int, can_drain: bool = False) -> list[Action]:
    """Surplus gangs of one (model, flavor), beyond those the plan wants and those ``held`` for the replicas
    Serve keeps: pending ones of over-planned capacity types first (nothing runs there), then, once Serve
    runs no more than it keeps (``drained``), ready ones that serve nothing, those of over-planned capacity
    types first, newest first. A gang that still serves a replica is never released:
    Serve empties whole nodes on a scale-down (the module docstring says how). With ``can_drain``, idle
    gangs the plan wants stay while serving gangs of over-planned types are to move onto them (_drains)."""
    have = [g for k in keys for g in by_key.get(k, [])]
    surplus = len(have) - max(sum(gangs_wanted.get(k, 0) for k in keys), held)
    if surplus <= 0:
        return []
    over = _over(keys, by_key, gangs_wanted)
    pending = [g for g in have if g.phase == GangPhase.PENDING and g.key in over]
    idle = sorted((g for g in have if g.phase == GangPhase.READY and g.serving == 0),
                  key=lambda g: (g.key not in over, -g.created_s, g.name)) if drained else []
    if can_drain:
        moving = sum(1 for g in have if g.key in over and g.phase == GangPhase.READY and g.serving > 0
                     and g.nodes == 1)
        wanted_idle = [g for g in idle if g.key not in over]
        idle = [g for g in idle if g.key in over] + wanted_idle[:max(0, surplus - moving)]
    return [DeleteGang(g.name, f"plan wants {target.get(g.key, 0)} x {g.capacity_type}; drained")
            for g in (sorted(pending, key=lambda g: (-g.created_s, g.name)) + idle)[:surplus]]
