"""Baselines act as rayscale acts: their replica targets go through the product's act step.

A baseline (static-peak, fluid-bound, static-best's fixed fleets, clairvoyant's per-minute plan) says how many
replicas it wants per (flavor, capacity type); ``FleetActor`` hands that to ``rayscale.core.act.decide`` as its
target, with the simulated cloud's gangs and Serve view (rayscale.sim.provider), and applies the actions
with ``apply_actions``, exactly as ``RayscalePolicy`` applies the step's. So every policy but ``stock`` packs
replicas onto nodes the same way (eight TP=1 replicas on one p5.48xlarge), makes before it breaks, backs
off zones after capacity errors and replaces interrupted gangs by the same rules: equal footing, and what
they cost differs only by what they decide.

Pricing a fleet follows the same packing: n replicas of a (flavor, capacity type) take ceil(n / slots)
gangs (``decide`` counts gangs per key the same way), each billed whole (``fleet_usd_per_h``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rayscale.cluster.actuator import apply_actions
from rayscale.core.act import Action, BackOff, CreateGang, GangPhase, Key, decide
from rayscale.core.catalog import CapacityType, Catalog
from rayscale.core.gangs import gang_shape
from rayscale.sim.cloud import Cluster, GangState
from rayscale.sim.provider import SimProvider

if TYPE_CHECKING:  # the simulation imports the policies that use this: annotations only, or a cycle
    from rayscale.sim.simulator import Simulation

Fleet = dict[tuple[str, str], int]  # replicas per (flavor, capacity type)
ZoneKey = tuple[str, str, str]  # (flavor, zone, capacity type)


def gangs_usd_per_h(catalog: Catalog, model: str, flavor: str, ct: str, replicas: int) -> float:
    """$/h of ``replicas`` replicas of one (flavor, capacity type), packed: ceil(replicas / slots) gangs."""
    shape = gang_shape(catalog, model, flavor, CapacityType(ct))
    return shape.gangs_for(replicas) * shape.nodes * catalog.price(flavor, shape.instance_type, CapacityType(ct))


def fleet_usd_per_h(catalog: Catalog, model: str, fleet: Mapping[tuple[str, str], int]) -> float:
    """What a fleet of replicas costs an hour when it packs as ``decide`` packs it (per capacity type)."""
    return sum(gangs_usd_per_h(catalog, model, f, ct, n) for (f, ct), n in fleet.items() if n > 0)


def share_usd_per_h(catalog: Catalog, model: str, flavor: str, ct: str) -> float:
    """One replica's share of the gang it packs into (a whole gang / its slots): the price per replica of a
    fleet large enough to fill its nodes."""
    shape = gang_shape(catalog, model, flavor, CapacityType(ct))
    return shape.nodes * catalog.price(flavor, shape.instance_type, CapacityType(ct)) / shape.slots


def start_warm(cluster: Cluster, actions: Sequence[Action], replicas: Mapping[str, int],
               now: float = 0.0) -> None:
    """A warm start: the gangs ``actions`` create come up at once, and Serve's target per flavor (the
    replicas planned, at most the slots those gangs hold) is live at once too."""
    created = [a for a in actions if isinstance(a, CreateGang)]
    for a in created:
        cluster.create_named(a.name, a.flavor, a.capacity_type, a.zone, now, warm=True)
    for f in sorted({a.flavor for a in created}):
        room = sum(g.shape.slots for g in cluster.named() if g.flavor == f)
        cluster.set_serve_target(f, min(replicas.get(f, 0), room), now, instant=True)


def first_fleet(sim: Simulation) -> Fleet:
    """The fleet the shipped step orders for the trace's first signal window (SimConfig.same_start), as
    replicas per (flavor, capacity type) on on-demand capacity: what every policy starts from cold. Worked
    out once per simulation (the policy starts from it, the result reports it)."""
    if sim.start_fleet is not None:
        return sim.start_fleet
    from rayscale.core.settings import Settings
    from rayscale.core.step import ServeView, StepContext, StepState, step

    result = step(StepContext(0.0, sim.catalog, {sim.model: sim.initial_signals()}, (), ServeView({}, {}),
                              Settings(), StepState()))
    fleet: Fleet = {}
    for e in result.plan.entries:
        if e.model == sim.model and e.replicas > 0:
            key = (e.flavor, CapacityType.ON_DEMAND.value)
            fleet[key] = fleet.get(key, 0) + e.replicas
    sim.start_fleet = fleet
    return fleet


class FleetActor:
    """One simulation's baseline acting through ``decide`` and the simulated cloud's provider."""

    def __init__(self, sim: Simulation) -> None:
        self.sim, self.catalog, self.model, self.cluster = sim, sim.catalog, sim.model, sim.cluster
        self.same_start = sim.cfg.same_start
        self.settings = sim.cfg.settings.act
        self.provider = SimProvider(sim.cluster, sim.model)
        self.unavailable: dict[ZoneKey, float] = {}  # zones backed off after a failed gang, until when
        self._settled: tuple[object, ...] | None = None  # the world in which decide last had nothing to do

    def current(self) -> dict[Key, int]:
        """Replicas per (model, flavor, capacity type) as the step counts them for the planner: as many as Serve
        runs on a gang, at least the one it was ordered for."""
        out: dict[Key, int] = {}
        for g in self.provider.gangs(0.0):
            if g.phase != GangPhase.FAILED:
                out[g.key] = out.get(g.key, 0) + max(g.serving, 1)
        return out

    def _decide(self, targets: Mapping[tuple[str, str], int], now: float) -> list[Action]:
        self.provider.now = now
        self.unavailable = {k: u for k, u in self.unavailable.items() if u > now}
        view = self.provider.serve_view()
        target = {(self.model, f, ct): n for (f, ct), n in targets.items() if n > 0}
        actions = decide(self.catalog, target, self.provider.gangs(now), dict(view.target), dict(view.running),
                         self.unavailable, now, self.settings, dict(view.serving or view.running))
        for a in actions:
            if isinstance(a, BackOff):  # kept as the step keeps it in its state
                self.unavailable[(a.flavor, a.zone, a.capacity_type)] = a.until_s
        return actions

    def warm(self, targets: Mapping[tuple[str, str], int], now: float = 0.0) -> None:
        """The fleet for ``targets``, up and serving at ``now`` (as RayscalePolicy's warm start); with
        SimConfig.same_start, the shared first fleet instead."""
        if self.same_start:
            targets = first_fleet(self.sim)
        replicas: dict[str, int] = {}
        for (f, _), n in targets.items():
            replicas[f] = replicas.get(f, 0) + n
        start_warm(self.cluster, self._decide(targets, now), replicas, now)

    def _world(self, targets: Mapping[tuple[str, str], int]) -> tuple[object, ...] | None:
        """Everything ``decide`` reads here but the clock, or None while a gang is pending (its launch timeout
        runs on the clock) or a zone is backed off (its end does)."""
        if self.unavailable:
            return None
        gangs = []
        for g in self.cluster.gangs.values():
            if g.name is not None:
                if g.state in (GangState.WAITING, GangState.PROVISIONING):
                    return None
                gangs.append((g.id, g.state, g.failed, g.deleted, tuple(r.state for r in g.replicas)))
        return (tuple(sorted(targets.items())), tuple(gangs), tuple(sorted(self.cluster.serve_target.items())))

    def act(self, targets: Mapping[tuple[str, str], int], now: float) -> None:
        """Move the cloud towards ``targets``: one ``decide``, its actions applied. With instant nodes
        (the fluid bound's integer plan) the gangs just created are ready at once, so Serve's replicas are
        placed in the same period by a second ``decide``. A world in which ``decide`` had nothing to do and
        that has not changed since is left alone without asking again (it would answer the same: a fixed
        fleet asks every period of a replay, and a search runs many)."""
        world = self._world(targets)
        if world is not None and world == self._settled:
            return
        actions = self._decide(targets, now)
        self._settled = world if not actions else None
        if any(isinstance(a, CreateGang) for a in actions):
            self.cluster.scale_up_events += 1
            if self.cluster.act.instant:
                apply_actions(actions, self.provider, self.provider.set_replicas, now)
                actions = self._decide(targets, now)
        apply_actions(actions, self.provider, self.provider.set_replicas, now)
