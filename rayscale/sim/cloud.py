"""Cloud model: nodes and gangs with launch delays, capacity errors, spot interruptions and prices.

A replica is a gang (rayscale.core.gangs.gang_shape): it is live only once every node of the gang is Ready
and the replica itself has started (image pull + model load). Delays are log-normal around the catalog's
means (Flavor.node_startup_s, Profile.startup_s: the start-up the catalog's fast-start choices imply), so GPU
flavors start slower than the local CPU flavor; a replica on a node that served before skips the image pull
(Catalog.startup), as a reused node, or a second replica on a gang, holds the image already.
A launch attempt in a (flavor, zone, capacity type) may fail with an insufficient-capacity error; the
actuator then backs that zone off and retries the gang in another zone (rayscale.core.gangs.choose_zone).
Spot nodes get interrupted as a Poisson process with a 2-minute notice: the replica drains at the notice
and whatever it still runs fails when the node goes away.

Two ways in. The stock policy's (``set_target``, ``place_warm``) runs one replica per gang: Ray's autoscaler
asks for a worker pod per replica and Karpenter launches the cheapest instance that fits it. Every other
policy acts through the provider interface (rayscale.sim.provider; the baselines via rayscale.sim.fleet_act):
named gangs host up to their shape's ``slots`` Serve replicas (eight TP=1 on a p5.48xlarge). New
replicas fill gangs that already serve first (Serve's pack strategy, RAY_SERVE_USE_PACK_SCHEDULING_STRATEGY;
its default spreads, which act's gang count bounds the same way), and a scale-down stops what Serve stops:
starting replicas first, then those on the gangs with the fewest replicas
(``DeploymentScheduler._get_replicas_to_stop`` in ray/serve/_private/deployment_scheduler.py), so whole gangs
empty for the controller to release.

Events are few (a handful per replica), so they are plain Python objects in one heap; the engine is the
part that must be vectorised. Everything random is drawn from one seeded generator in event order.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import astuple, dataclass, field
from enum import StrEnum

import numpy as np

from rayscale.core.catalog import CapacityType, Catalog
from rayscale.core.gangs import GangShape, choose_zone, gang_shape
from rayscale.sim.engine import Engine


@dataclass(frozen=True)
class Outage:
    """Every launch in the window fails with a capacity error (zone/capacity type None: all)."""

    flavor: str
    start_s: float
    end_s: float
    zone: str | None = None
    capacity_type: str | None = None


@dataclass(frozen=True)
class Reclaim:
    """A correlated spot reclaim: at ``at_s`` every spot node of the flavor in the zone gets its notice at
    once (None: every flavor / zone), as when a provider takes back a whole capacity pool. ``largest``: the
    (flavor, zone) spot pool holding the most nodes at that moment, whichever it is (the worst case)."""

    at_s: float
    flavor: str | None = None
    zone: str | None = None
    largest: bool = False


@dataclass(frozen=True)
class CloudConfig:
    node_startup_sigma: float = 0.25  # log-normal shape of launch -> Ready (mean: Flavor.node_startup_s)
    replica_startup_sigma: float = 0.2  # log-normal shape of replica start (mean: Profile.startup_s)
    capacity_error_rate: float = 0.02  # chance one on-demand node launch fails with a capacity error
    spot_capacity_error_rate: float = 0.05
    capacity_error_overrides: dict[str, float] = field(default_factory=dict)  # "flavor" or "flavor/ct"
    outages: tuple[Outage, ...] = ()
    spot_interruptions_per_node_h: float = 0.01  # assumption; AWS advisor buckets GPU spot at <5%/month
    spot_notice_s: float = 120.0
    reclaims: tuple[Reclaim, ...] = ()
    capacity_error_delay_s: float = 5.0  # CreateFleet reports InsufficientInstanceCapacity quickly
    backoff_s: float = 300.0  # a zone stays backed off this long after a capacity error

    def error_rate(self, flavor: str, ct: str) -> float:
        o = self.capacity_error_overrides
        if f"{flavor}/{ct}" in o:
            return o[f"{flavor}/{ct}"]
        if flavor in o:
            return o[flavor]
        return self.spot_capacity_error_rate if ct == CapacityType.SPOT.value else self.capacity_error_rate


@dataclass(frozen=True)
class ActuatorConfig:
    """How a stack turns a replica target into nodes (rayscale's controller vs the stock chain)."""

    provision_delay_s: float = 1.0  # decision -> NodeClaims created
    karpenter_batch: bool = False  # pending pods batched: idle 1 s, at most 10 s
    batch_idle_s: float = 1.0
    batch_max_s: float = 10.0
    node_linger_s: float = 0.0  # after its replica stops, the node stays this long (idle timeout + consolidation)
    reuse_idle_nodes: bool = False  # a new replica may land on a lingering node
    drain_timeout_s: float = 600.0  # then in-flight requests are dropped
    instant: bool = False  # oracle: no delays, no capacity errors, no interruptions


class GangState(StrEnum):
    WAITING = "waiting"  # decided, NodeClaims not created yet (provision delay / Karpenter batch)
    PROVISIONING = "provisioning"  # nodes launching
    READY = "ready"  # every node up (a named gang: its Serve replicas, if any, are in Gang.replicas)
    FAILED = "failed"  # a named gang the cloud gave up on (capacity error): nodes gone, until the controller deletes it
    STARTING = "starting"  # all nodes Ready, replica loading the model
    LIVE = "live"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass
class Node:
    id: int
    flavor: str
    instance_type: str
    capacity_type: str
    zone: str
    usd_per_h: float
    devices: int
    t_launch: float
    t_ready: float | None = None
    t_end: float | None = None
    gang: int | None = None
    serving_s: float = 0.0  # time spent under a live or draining replica
    serve_since: float | None = None
    image_cached: bool = False  # a replica went live here, so the serving image is on its disk
    noticed: bool = False  # its spot interruption notice came (one per node)


@dataclass
class Replica:
    """A Serve replica on a named gang: STARTING, LIVE or DRAINING while it holds its devices."""

    id: int
    gang: int
    state: GangState
    t_start: float
    engine_rid: int | None = None
    migrating: bool = False  # LIVE on a drained gang: serves until Serve's replacement runs


@dataclass
class Gang:
    id: int
    flavor: str
    capacity_type: str
    shape: GangShape
    state: GangState
    t_created: float
    zone: str | None = None
    nodes: list[Node] = field(default_factory=list)
    engine_rid: int | None = None
    t_live: float | None = None
    attempts: int = 0
    # Gangs a controller created through the provider interface (rayscale.sim.provider) carry its name: their
    # nodes come up without a replica (Serve places one when told), and a capacity error or a spot notice
    # fails the gang for the controller to replace, as Karpenter deletes the NodeClaim.
    name: str | None = None
    failed: str = ""  # why the cloud gave up on it
    deleted: bool = False  # the controller deleted it; it only finishes draining
    t_phase: float = 0.0  # when it entered its current phase (the controller's launch timeout counts from it)
    replicas: list[Replica] = field(default_factory=list)  # a named gang's Serve replicas (at most shape.slots)
    draining: bool = False  # the controller drained its nodes: Serve moves its replicas off, places none on it


@dataclass(frozen=True)
class CloudTotals:
    cost_usd: float
    accelerator_hours: float
    node_hours: float
    idle_node_hours: float
    scale_up_events: int
    capacity_errors: int
    spot_interruptions: int

    def __sub__(self, earlier: CloudTotals) -> CloudTotals:
        """What accrued between ``earlier`` and these books."""
        return CloudTotals(*(a - b for a, b in zip(astuple(self), astuple(earlier), strict=True)))


class Cluster:
    """Nodes and gangs of one model's replicas, driven by events on the simulated clock."""

    def __init__(self, catalog: Catalog, model: str, engine: Engine, flavors: list[str], rng: np.random.Generator,
                 cloud: CloudConfig = CloudConfig(), act: ActuatorConfig = ActuatorConfig(),
                 slot_cap: int | None = None) -> None:
        self.catalog, self.model, self.engine = catalog, model, engine
        self.flavors = flavors  # index = engine flavor index
        self.rng, self.cloud, self.act = rng, cloud, act
        self.slot_cap = slot_cap
        self.gangs: dict[int, Gang] = {}
        self.nodes: dict[int, Node] = {}
        self.lingering: list[Node] = []
        self.unavailable: dict[tuple[str, str, str], float] = {}
        self._events: list[tuple[float, int, str, int]] = []
        self._seq = 0
        self._next_id = 0
        self._batch: list[int] = []  # gangs waiting for the Karpenter batch to close
        self._batch_open: float | None = None
        self._batch_last: float | None = None
        self.scale_up_events = 0
        self.capacity_errors = 0
        self.spot_interruptions = 0
        self._closed_cost = 0.0
        self._closed_dev_h = 0.0
        self._closed_node_h = 0.0
        self._closed_idle_h = 0.0
        self._shapes: dict[tuple[str, str], GangShape] = {}
        self._draining: set[int] = set()
        self._stopped: list[int] = []
        self.serve_target: dict[str, int] = {}  # named gangs: Serve's replica target per flavor
        self.by_name: dict[str, Gang] = {}
        self.replicas: dict[int, Replica] = {}  # named gangs' replicas by id
        self._rdraining: set[int] = set()
        self._migrating: dict[str, int] = {}  # flavor -> replicas on drained gangs waiting for replacements
        # Spot notices that took a serving replica away, and how long each took to be made good: the next
        # replica to go live after a notice counts as its replacement.
        self._lost_at: list[float] = []
        self.replacement_lags_s: list[float] = []
        if not act.instant:
            for i, rc in enumerate(cloud.reclaims):
                self._push(rc.at_s, "reclaim_wave", i)

    # --- bookkeeping ----------------------------------------------------------------------------

    def _id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _push(self, t: float, kind: str, obj: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, obj))

    def shape(self, flavor: str, ct: str) -> GangShape:
        k = (flavor, ct)
        if k not in self._shapes:
            self._shapes[k] = gang_shape(self.catalog, self.model, flavor, CapacityType(ct))
        return self._shapes[k]

    def _lognormal(self, mean: float, sigma: float) -> float:
        if mean <= 0:
            return 0.0
        # Mean of a log-normal is exp(mu + sigma^2/2): solve for mu so the catalog number is the mean.
        return float(self.rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma))

    def active(self) -> list[Gang]:
        return [g for g in self.gangs.values() if g.state not in (GangState.STOPPED, GangState.DRAINING)]

    def count(self, flavor: str, ct: str) -> int:
        """Replicas of the one-per-gang path (stock's) decided and not stopped."""
        return sum(1 for g in self.active() if g.flavor == flavor and g.capacity_type == ct)

    def live_by_flavor(self) -> dict[str, int]:
        """Live replicas per flavor: one per live gang of the policies' path, each live replica of a named gang."""
        out: dict[str, int] = {}
        for g in self.gangs.values():
            n = 1 if g.state == GangState.LIVE else sum(1 for r in g.replicas if r.state == GangState.LIVE)
            if n:
                out[g.flavor] = out.get(g.flavor, 0) + n
        return out

    def live_count(self) -> int:
        return sum(self.live_by_flavor().values())

    def usd_per_h(self) -> float:
        return sum(n.usd_per_h for n in self.nodes.values() if n.t_end is None)

    # --- actuation ------------------------------------------------------------------------------

    def set_target(self, flavor: str, ct: str, n: int, now: float) -> None:
        have = [g for g in self.active() if g.flavor == flavor and g.capacity_type == ct]
        if n > len(have):
            self.scale_up_events += 1
            for _ in range(n - len(have)):
                self._new_gang(flavor, ct, now)
        elif n < len(have):
            # Cancel what is not serving yet (newest first), then drain the least busy live replicas.
            order = {GangState.WAITING: 0, GangState.PROVISIONING: 1, GangState.STARTING: 2, GangState.LIVE: 3}
            have.sort(key=lambda g: (order[g.state], -g.t_created if g.state != GangState.LIVE
                                     else self.engine.running(g.engine_rid or 0), g.id))
            for g in have[: len(have) - n]:
                self._remove(g, now)

    def place_warm(self, flavor: str, ct: str, now: float) -> None:
        """A replica that is already live at the start (warm start of every policy)."""
        g = self._new_gang(flavor, ct, now, warm=True)
        assert g is not None

    def _new_gang(self, flavor: str, ct: str, now: float, warm: bool = False) -> Gang | None:
        g = Gang(self._id(), flavor, ct, self.shape(flavor, ct), GangState.WAITING, now)
        self.gangs[g.id] = g
        if warm:
            self._launch(g, now, warm=True)
            return g
        if self.act.instant:
            self._launch(g, now)
            return g
        if self.act.reuse_idle_nodes:
            node = self._take_lingering(flavor, ct, g.shape)
            if node is not None:
                g.zone = node.zone
                g.nodes = [node]
                node.gang = g.id
                g.state = GangState.PROVISIONING
                self._nodes_ready(g, now)
                return g
        if self.act.karpenter_batch:
            t = now + self.act.provision_delay_s
            self._batch.append(g.id)
            if self._batch_open is None:
                self._batch_open = t
            self._batch_last = t
            close = min(self._batch_open + self.act.batch_max_s, self._batch_last + self.act.batch_idle_s)
            self._push(close, "batch", 0)
        else:
            self._push(now + self.act.provision_delay_s, "launch", g.id)
        return g

    def _take_lingering(self, flavor: str, ct: str, shape: GangShape) -> Node | None:
        if shape.nodes != 1:
            return None
        for node in self.lingering:
            if node.flavor == flavor and node.capacity_type == ct and node.instance_type == shape.instance_type:
                self.lingering.remove(node)
                return node
        return None

    def _launch(self, g: Gang, now: float, warm: bool = False) -> None:
        if g.state != GangState.WAITING:
            return
        fl = self.catalog.flavors[g.flavor]
        ct = CapacityType(g.capacity_type)
        taken: dict[str, int] = {}
        for other in self.active():
            if other.flavor == g.flavor and other.zone:
                taken[other.zone] = taken.get(other.zone, 0) + 1
        blocked = [k for k, until in self.unavailable.items() if until > now]
        zone = g.zone if g.name is not None and g.zone else choose_zone(fl, ct, blocked, taken)
        if zone is None:
            self._stop(g, now)  # every zone backed off: the policy sees the replica missing and re-plans
            return
        g.zone = zone
        g.attempts += 1
        g.state = GangState.PROVISIONING
        it = fl.instance(g.shape.instance_type)
        price = self.catalog.price(g.flavor, it.name, ct)
        instant = warm or self.act.instant
        ice = False
        for _ in range(g.shape.nodes):
            if not instant and self._capacity_error(g.flavor, zone, g.capacity_type, now):
                ice = True
                continue
            node = Node(self._id(), g.flavor, it.name, g.capacity_type, zone, price, it.devices, now, gang=g.id)
            self.nodes[node.id] = node
            g.nodes.append(node)
        if ice:
            self.capacity_errors += 1
            self._push(now + self.cloud.capacity_error_delay_s, "ice", g.id)
            return
        if instant:
            for node in g.nodes:
                node.t_ready = now
            self._nodes_ready(g, now, instant=True)
            return
        for node in g.nodes:
            self._push(now + self._lognormal(fl.node_startup_s, self.cloud.node_startup_sigma), "ready", node.id)

    def _capacity_error(self, flavor: str, zone: str, ct: str, now: float) -> bool:
        for o in self.cloud.outages:
            if (o.flavor == flavor and o.start_s <= now < o.end_s and o.zone in (None, zone)
                    and o.capacity_type in (None, ct)):
                return True
        p = self.cloud.error_rate(flavor, ct)
        return p > 0 and bool(self.rng.random() < p)

    def _nodes_ready(self, g: Gang, now: float, instant: bool = False) -> None:
        for node in g.nodes:
            if node.capacity_type == CapacityType.SPOT.value and not self.act.instant:
                rate = self.cloud.spot_interruptions_per_node_h
                if rate > 0:
                    self._push(now + float(self.rng.exponential(3600.0 / rate)), "notice", node.id)
        if g.name is not None:  # Serve places a replica when its target asks for one
            g.state, g.t_phase = GangState.READY, now
            self._place(g.flavor, now, instant)
            return
        self._start_replica(g, now, instant)

    def _replica_start_s(self, g: Gang) -> float:
        """Mean replica start on this gang's nodes: one that served before (a reused node) skips the image pull."""
        cached = bool(g.nodes) and all(n.image_cached for n in g.nodes)
        return self.catalog.startup(self.model, g.flavor).replica_s(image_cached=cached)

    def _start_replica(self, g: Gang, now: float, instant: bool = False) -> None:
        g.state = GangState.STARTING
        delay = 0.0 if instant else self._lognormal(self._replica_start_s(g), self.cloud.replica_startup_sigma)
        if delay <= 0:
            self._go_live(g, now)
        else:
            self._push(now + delay, "live", g.id)

    def _go_live(self, g: Gang, now: float) -> None:
        if g.state != GangState.STARTING:
            return
        g.state = GangState.LIVE
        g.t_live = now
        self._replaced(now)
        prof = self.catalog.profile(self.model, g.flavor)
        g.engine_rid = self.engine.add_replica(prof, self.flavors.index(g.flavor), self.slot_cap)
        for node in g.nodes:
            node.serve_since = now
            node.image_cached = True

    def _remove(self, g: Gang, now: float) -> None:
        if g.state == GangState.LIVE:
            g.state = GangState.DRAINING
            self._draining.add(g.id)
            assert g.engine_rid is not None
            self.engine.drain(g.engine_rid)
            self._push(now + self.act.drain_timeout_s, "drain_timeout", g.id)
        elif g.state != GangState.STOPPED:
            self._stop(g, now)

    def _stop(self, g: Gang, now: float, linger: bool = True) -> None:
        if g.state == GangState.STOPPED:
            return
        if g.engine_rid is not None and g.state in (GangState.LIVE, GangState.DRAINING):
            self.engine.kill(g.engine_rid, now)
        for r in list(g.replicas):
            self._forget(r, now)
        g.state = GangState.STOPPED
        self._stopped.append(g.id)
        # A named gang the cloud gave up on stays, FAILED, until the controller deletes it, as a NodeClaim
        # Karpenter deleted stays (deletionTimestamp, the karpenter.sh/termination finalizer) while its node
        # drains and its instance terminates (kubernetes-sigs/karpenter pkg/controllers/node/termination/
        # controller.go; a spot notice deletes the claim: aws/karpenter-provider-aws
        # pkg/controllers/interruption/). The step learns spot interruptions from those (rayscale.core.spot);
        # gone at once, a spot gang whose replica drained in a second vanished between two periods unseen.
        if g.name is not None and (g.deleted or not g.failed):
            self.by_name.pop(g.name, None)
        if g.id in self._batch:
            self._batch.remove(g.id)
        for node in g.nodes:
            if node.serve_since is not None:
                node.serving_s += now - node.serve_since
                node.serve_since = None
            node.gang = None
            if node.t_end is not None:
                continue
            if linger and self.act.node_linger_s > 0 and node.t_ready is not None:
                self.lingering.append(node)
                self._push(now + self.act.node_linger_s, "release", node.id)
            else:
                self._release(node, now)

    def _release(self, node: Node, now: float) -> None:
        if node.t_end is not None:
            return
        node.t_end = now
        if node in self.lingering:
            self.lingering.remove(node)
        h = (now - node.t_launch) / 3600.0
        self._closed_cost += h * node.usd_per_h
        self._closed_dev_h += h * node.devices
        self._closed_node_h += h
        self._closed_idle_h += h - node.serving_s / 3600.0

    def _drained(self, g: Gang, now: float) -> None:
        """A replica of the policies' path that finished (or timed out) draining: its nodes go."""
        self._stop(g, now)

    # --- the provider interface's side (named gangs; rayscale.sim.provider) --------------------------

    def create_named(self, name: str, flavor: str, ct: str, zone: str, now: float, warm: bool = False) -> None:
        if name in self.by_name:
            return  # idempotent, as a provider's create is
        g = Gang(self._id(), flavor, ct, self.shape(flavor, ct), GangState.WAITING, now, zone=zone, name=name,
                 t_phase=now)
        self.gangs[g.id] = g
        self.by_name[name] = g
        if warm or self.act.instant:
            self._launch(g, now, warm=warm)
        else:
            self._push(now + self.act.provision_delay_s, "launch", g.id)

    def delete_named(self, name: str, now: float) -> None:
        g = self.by_name.pop(name, None)
        if g is None:
            return
        g.deleted = True
        self._unplace(g, now)  # live replicas drain, then _replica_drained stops the gang
        self._place(g.flavor, now)

    def drain_named(self, name: str, now: float) -> None:
        """The controller drains a gang's nodes (Ray's DrainNode): Serve cancels the replicas starting there and
        marks the live ones for migration; they serve until replacements elsewhere run
        (``migrate_replicas_on_draining_nodes`` in ray/serve/_private/deployment_state.py)."""
        g = self.by_name.get(name)
        if g is None or g.draining:
            return
        g.draining = True
        for r in list(g.replicas):
            if r.state == GangState.STARTING:
                self._forget(r, now)
            elif r.state == GangState.LIVE:
                r.migrating = True
                self._migrating[g.flavor] = self._migrating.get(g.flavor, 0) + 1
        self._place(g.flavor, now)

    def set_serve_target(self, flavor: str, n: int, now: float, instant: bool = False) -> None:
        """Serve's replica target for a flavor; ``instant``: replicas already loaded (a warm start)."""
        self.serve_target[flavor] = n
        self._place(flavor, now, instant)

    def named(self) -> list[Gang]:
        return list(self.by_name.values())

    def _place(self, flavor: str, now: float, instant: bool = False) -> None:
        """Serve's replicas of this flavor follow its target. New ones fill free slots of ready gangs, those
        that already serve first (fullest first), then empty ones (oldest first). Surplus ones stop as Serve
        picks them: starting ones first (newest first), then live ones on the gangs with the fewest live
        replicas, newest first; live ones drain."""
        want = self.serve_target.get(flavor, 0)
        held = [g for g in self.named() if g.flavor == flavor and not g.failed and g.state == GangState.READY
                and not g.draining]
        active = [r for g in held for r in g.replicas if r.state in (GangState.STARTING, GangState.LIVE)]
        add = want - len(active)
        if self._migrating.get(flavor):
            self._stop_migrated(flavor, want, active, now)
        if add > 0:
            for g in sorted(held, key=lambda g: (-len(g.replicas), g.t_phase, g.id)):
                while add > 0 and len(g.replicas) < g.shape.slots:
                    self._start_on(g, now, instant)
                    add -= 1
            return
        live_on = {g.id: sum(1 for r in g.replicas if r.state == GangState.LIVE) for g in held}
        starting = sorted((r for r in active if r.state == GangState.STARTING), key=lambda r: (-r.t_start, -r.id))
        live = sorted((r for r in active if r.state == GangState.LIVE),
                      key=lambda r: (live_on[r.gang], r.gang, -r.t_start, -r.id))
        for r in (starting + live)[: max(-add, 0)]:
            self._stop_replica(r, now)

    def _stop_migrated(self, flavor: str, want: int, active: list[Replica], now: float) -> None:
        """Serve stops replicas marked for migration once the running ones and they exceed its target (the
        replacements run), oldest first; each drains its requests."""
        migrating = sorted((r for g in self.named() if g.flavor == flavor for r in g.replicas
                            if r.migrating and r.state == GangState.LIVE), key=lambda r: (r.t_start, r.id))
        running = sum(1 for r in active if r.state == GangState.LIVE)
        for r in migrating[:max(0, running + len(migrating) - want)]:
            r.migrating = False
            self._migrating[flavor] -= 1
            self._stop_replica(r, now)

    def _unplace(self, g: Gang, now: float, linger: bool = True) -> None:
        """Every replica of a gang that goes (deleted, or failed by the cloud) stops; the gang with it, once
        no replica drains on it any more."""
        for r in list(g.replicas):
            self._stop_replica(r, now)
        if not g.replicas and g.state != GangState.STOPPED:
            self._stop(g, now, linger)

    def _start_on(self, g: Gang, now: float, instant: bool = False) -> None:
        r = Replica(self._id(), g.id, GangState.STARTING, now)
        g.replicas.append(r)
        self.replicas[r.id] = r
        instant = instant or self.act.instant  # the fluid bound's integer plan: no start-up anywhere
        delay = 0.0 if instant else self._lognormal(self._replica_start_s(g), self.cloud.replica_startup_sigma)
        if delay <= 0:
            self._replica_live(r, now)
        else:
            self._push(now + delay, "replica_live", r.id)

    def _replica_live(self, r: Replica, now: float) -> None:
        g = self.gangs.get(r.gang)
        if r.state != GangState.STARTING or g is None:
            return
        r.state = GangState.LIVE
        self._replaced(now)
        r.engine_rid = self.engine.add_replica(self.catalog.profile(self.model, g.flavor),
                                               self.flavors.index(g.flavor), self.slot_cap)
        if g.t_live is None:
            g.t_live = now
        for node in g.nodes:
            node.image_cached = True
            if node.serve_since is None:
                node.serve_since = now
        if self._migrating.get(g.flavor):
            self._place(g.flavor, now)  # a replacement runs: Serve stops what it replaces

    def _replaced(self, now: float) -> None:
        if self._lost_at:
            self.replacement_lags_s.append(now - self._lost_at.pop(0))

    def _stop_replica(self, r: Replica, now: float) -> None:
        """Serve stops a replica: a live one drains (its requests finish), a starting one is cancelled."""
        if r.state == GangState.LIVE:
            assert r.engine_rid is not None
            r.state = GangState.DRAINING
            self.engine.drain(r.engine_rid)
            self._rdraining.add(r.id)
            self._push(now + self.act.drain_timeout_s, "replica_drain_timeout", r.id)
        elif r.state == GangState.STARTING:
            self._forget(r, now)

    def _forget(self, r: Replica, now: float) -> None:
        """A replica gone from its gang (stopped, drained or killed with its nodes)."""
        if r.migrating:
            r.migrating = False
            g0 = self.gangs.get(r.gang)
            if g0 is not None:
                self._migrating[g0.flavor] -= 1
        if r.engine_rid is not None and r.state in (GangState.LIVE, GangState.DRAINING):
            self.engine.kill(r.engine_rid, now)
        r.state = GangState.STOPPED
        self.replicas.pop(r.id, None)
        self._rdraining.discard(r.id)
        g = self.gangs.get(r.gang)
        if g is None:
            return
        g.replicas.remove(r)
        if not any(x.state in (GangState.LIVE, GangState.DRAINING) for x in g.replicas):
            for node in g.nodes:
                if node.serve_since is not None:
                    node.serving_s += now - node.serve_since
                    node.serve_since = None

    def _replica_drained(self, r: Replica, now: float) -> None:
        self._forget(r, now)
        g = self.gangs.get(r.gang)
        if g is None:
            return
        if g.deleted or g.failed:
            if not g.replicas:
                self._stop(g, now)
            return
        self._place(g.flavor, now)  # its devices are free again for Serve's target

    # --- the clock ------------------------------------------------------------------------------

    def advance(self, now: float) -> None:
        """Process every event due at or before ``now``; drained replicas release their nodes."""
        ev = self._events
        while ev and ev[0][0] <= now:
            t, _, kind, obj = heapq.heappop(ev)
            self._handle(t, kind, obj)
        if self._draining:
            for gid in list(self._draining):
                g = self.gangs.get(gid)
                if g is None or g.state != GangState.DRAINING:
                    self._draining.discard(gid)
                elif g.engine_rid is not None and self.engine.idle(g.engine_rid):
                    self._drained(g, now)
                    self._draining.discard(gid)
        if self._rdraining:
            for rid in sorted(self._rdraining):
                r = self.replicas.get(rid)
                if r is None or r.state != GangState.DRAINING:
                    self._rdraining.discard(rid)
                elif r.engine_rid is not None and self.engine.idle(r.engine_rid):
                    self._replica_drained(r, now)
        if self._stopped:
            for gid in self._stopped:
                self.gangs.pop(gid, None)
            self._stopped.clear()

    def _handle(self, t: float, kind: str, obj: int) -> None:
        """One event of the queue: ``kind`` names the ``_on_<kind>`` handler, ``obj`` the node, gang, replica
        or reclaim it is about."""
        getattr(self, f"_on_{kind}")(t, obj)

    def _on_batch(self, t: float, obj: int) -> None:
        if self._batch_open is None or self._batch_last is None:
            return
        close = min(self._batch_open + self.act.batch_max_s, self._batch_last + self.act.batch_idle_s)
        if t + 1e-9 < close:
            return  # a later pod extended the window; its own event closes it
        batch, self._batch, self._batch_open, self._batch_last = self._batch, [], None, None
        for gid in batch:
            self._on_launch(t, gid)

    def _on_launch(self, t: float, obj: int) -> None:
        g = self.gangs.get(obj)
        if g is not None:
            self._launch(g, t)

    def _on_ready(self, t: float, obj: int) -> None:
        node = self.nodes[obj]
        if node.t_end is not None or node.gang is None:
            return
        node.t_ready = t
        g = self.gangs.get(node.gang)
        if g is not None and g.state == GangState.PROVISIONING and all(n.t_ready is not None for n in g.nodes):
            self._nodes_ready(g, t)

    def _on_live(self, t: float, obj: int) -> None:
        g = self.gangs.get(obj)
        if g is not None:
            self._go_live(g, t)

    def _on_replica_live(self, t: float, obj: int) -> None:
        r = self.replicas.get(obj)
        if r is not None:
            self._replica_live(r, t)

    def _on_replica_drain_timeout(self, t: float, obj: int) -> None:
        r = self.replicas.get(obj)
        if r is not None and r.state == GangState.DRAINING:
            self._replica_drained(r, t)

    def _on_ice(self, t: float, obj: int) -> None:
        """Insufficient capacity in the gang's zone: the zone backed off, the nodes that did launch given back."""
        g = self.gangs.get(obj)
        if g is None or g.state != GangState.PROVISIONING:
            return
        assert g.zone is not None
        self.unavailable[(g.flavor, g.zone, g.capacity_type)] = t + self.cloud.backoff_s
        for node in g.nodes:  # a gang is all or nothing: give back the nodes that did launch
            self._release(node, t)
        g.nodes = []
        if g.name is not None:  # Karpenter deletes the claim; the controller sees the gang fail
            g.state, g.failed = GangState.FAILED, f"insufficient capacity in {g.zone}"
            return
        g.state = GangState.WAITING
        self._launch(g, t)  # another zone, or stop if none is left

    def _on_reclaim_wave(self, t: float, obj: int) -> None:
        """A correlated reclaim: a notice to every running spot node of one flavor and zone (the largest pool)."""
        rc = self.cloud.reclaims[obj]
        up = [n for n in self.nodes.values() if n.capacity_type == CapacityType.SPOT.value
              and n.t_end is None and n.t_ready is not None and not n.noticed]
        pools = Counter((n.flavor, n.zone) for n in up)
        flavor, zone = rc.flavor, rc.zone
        if rc.largest and pools:
            (flavor, zone), _ = pools.most_common(1)[0]
        for node in up:
            if flavor in (None, node.flavor) and zone in (None, node.zone):
                self._on_notice(t, node.id)

    def _on_notice(self, t: float, obj: int) -> None:
        """A spot interruption notice: the node goes ``spot_notice_s`` later; its gang stops taking work."""
        node = self.nodes[obj]
        if node.t_end is not None or node.noticed:
            return
        node.noticed = True
        self.spot_interruptions += 1
        self._push(t + self.cloud.spot_notice_s, "reclaim", node.id)
        g = self.gangs.get(node.gang) if node.gang is not None else None
        if g is not None and (g.state == GangState.LIVE or any(r.state == GangState.LIVE for r in g.replicas)):
            self._lost_at.append(t)
        if g is not None and g.name is not None:
            g.failed = f"spot interruption notice for {node.id}"
            if g.state == GangState.READY:
                self._unplace(g, t, linger=False)  # its replicas drain until the node goes
            elif g.state == GangState.PROVISIONING:
                self._stop(g, t, linger=False)
        elif g is not None:
            if g.state == GangState.LIVE:
                g.state = GangState.DRAINING
                self._draining.add(g.id)
                assert g.engine_rid is not None
                self.engine.drain(g.engine_rid)
            elif g.state in (GangState.PROVISIONING, GangState.STARTING, GangState.READY):
                self._stop(g, t, linger=False)

    def _on_reclaim(self, t: float, obj: int) -> None:
        node = self.nodes[obj]
        g = self.gangs.get(node.gang) if node.gang is not None else None
        if g is not None:
            self._stop(g, t, linger=False)
            if g.name is not None:
                self._place(g.flavor, t)
        self._release(node, t)

    def _on_drain_timeout(self, t: float, obj: int) -> None:
        g = self.gangs.get(obj)
        if g is not None and g.state == GangState.DRAINING:
            self._drained(g, t)

    def _on_release(self, t: float, obj: int) -> None:
        node = self.nodes[obj]
        if node.gang is None:
            self._release(node, t)

    def snapshot(self, now: float) -> CloudTotals:
        """The books as if closed at ``now``, without closing them (what a warm-up leaves out)."""
        cost, dev_h, node_h, idle_h = self._closed_cost, self._closed_dev_h, self._closed_node_h, self._closed_idle_h
        for node in self.nodes.values():
            if node.t_end is not None or node.t_launch > now:
                continue
            h = (now - node.t_launch) / 3600.0
            serving = node.serving_s + (now - node.serve_since if node.serve_since is not None else 0.0)
            cost += h * node.usd_per_h
            dev_h += h * node.devices
            node_h += h
            idle_h += h - serving / 3600.0
        return CloudTotals(cost, dev_h, node_h, idle_h, self.scale_up_events, self.capacity_errors,
                           self.spot_interruptions)

    def finish(self, now: float) -> CloudTotals:
        """Close the books at the end of the run (every node still up is billed until ``now``)."""
        for g in list(self.gangs.values()):
            for node in g.nodes:
                if node.serve_since is not None:
                    node.serving_s += now - node.serve_since
                    node.serve_since = None
        for node in self.nodes.values():
            self._release(node, now)
        return CloudTotals(self._closed_cost, self._closed_dev_h, self._closed_node_h, self._closed_idle_h,
                           self.scale_up_events, self.capacity_errors, self.spot_interruptions)
