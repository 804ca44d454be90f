"""The embedded default actuator: a gang of flavor nodes = Ray worker nodes started on this machine.

Same interface as the Kubernetes actuator. Each node carries rayscale's ownership labels (gang, model,
flavor, capacity type, zone, size, creation time, gang slot) as Ray node labels, so ``gangs()`` is rebuilt from
the cluster alone and a restarted controller sees exactly what runs; ``recover()``, which a (re)started
controller calls once, settles a node start its predecessor was killed in. A configurable launch delay stands
in for cloud provisioning and capacity errors can be injected per (flavor, zone). The machine bounds how
many nodes can run: a gang that would exceed it fails at once with a reason that says so.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from rayscale.cluster.actuator import (
    LABEL_CAPACITY,
    LABEL_CREATED,
    LABEL_GANG,
    LABEL_MODEL,
    LABEL_OWNER,
    LABEL_SIZE,
    LABEL_ZONE,
    OWNER,
)
from rayscale.cluster.local import LocalCluster, LocalNode, flavor_spec
from rayscale.core.act import CreateGang, Gang, GangPhase
from rayscale.serve.config import LABEL_GANG_SLOT

_UP = {"ALIVE", "IDLE", "ACTIVE", "DRAINING"}  # a draining node still runs what it ran


@dataclass
class LocalActuatorConfig:
    launch_delay_s: dict[str, float] = field(default_factory=dict)  # per flavor; missing: default below
    default_launch_delay_s: float = 0.0
    max_worker_nodes: int = 3  # what this machine can run beside the head (2 cores, vLLM on CPU)
    capacity_errors: set[tuple[str, str]] = field(default_factory=set)  # (flavor, zone) that fail to launch
    drain_grace_s: float = 30.0
    # A drained gang's replicas move within this long (a replacement's start-up); then Serve stops them.
    drain_deadline_s: float = 600.0
    # A node whose start fails (on a busy small machine Ray's dashboard agent can miss the raylet's
    # start-up deadline) is started again, as a kubelet restarts a crashed Ray pod; then the gang fails.
    start_attempts: int = 3
    node_start_timeout_s: float = 90.0


@dataclass
class _Launch:
    action: CreateGang
    created_s: float
    error: str = ""
    done: bool = False
    mono_s: float = field(default_factory=time.monotonic)
    # When this machine began starting its first node, in the controller's clock: starts are serialised,
    # so a gang queued behind another's start is not "stuck" while it waits its turn.
    started_s: float | None = None
    have: int = 0  # members already started: a gang resumed by recover() starts the rest
    slot: int = 0  # the gang's slot among its (model, flavor)'s gangs (rayscale.serve.config.LABEL_GANG_SLOT)


class LocalActuator:
    can_drain = True  # through the GCS (LocalCluster.drain_node): Serve moves the replicas off

    def __init__(self, cluster: LocalCluster, config: LocalActuatorConfig | None = None):
        self.cluster = cluster
        self.config = config or LocalActuatorConfig()
        self._lock = threading.Lock()
        self._launching: dict[str, _Launch] = {}
        self._deleting: set[str] = set()
        # Gangs this process drained: a drained node's raylet exits once it is idle (Ray's DrainNode), which
        # is the drain done, not a lost node. After a restart Ray's death reason says the same
        # (LocalNode.drained).
        self._drained: set[str] = set()
        self._since: dict[str, tuple[GangPhase, float]] = {}  # gang -> (phase, entered at), once ready
        self._threads: list[threading.Thread] = []
        # One node start at a time: concurrent `ray start`s on two cores are what time out the agent.
        self._start_lock = threading.Lock()
        self._closing = threading.Event()

    # --- injection, for tests and the demo -------------------------------------------------------
    def fail_zone(self, flavor: str, zone: str, failing: bool = True) -> None:
        with self._lock:
            (self.config.capacity_errors.add if failing else self.config.capacity_errors.discard)((flavor, zone))

    # --- Actuator ---------------------------------------------------------------------------------
    def gangs(self, now: float) -> list[Gang]:
        members: dict[str, list[LocalNode]] = defaultdict(list)
        # Dead members too: a gang with a node that died is FAILED (deleted whole), never silently smaller.
        for n in self.cluster.nodes(include_dead=True):
            if n.labels.get(LABEL_OWNER) == OWNER and LABEL_GANG in n.labels:
                members[n.labels[LABEL_GANG]].append(n)
        out: list[Gang] = []
        with self._lock:
            launching = dict(self._launching)
            deleting = set(self._deleting)
        for name, nodes in sorted(members.items()):
            if name in deleting:
                continue
            lb = nodes[0].labels
            size = int(lb.get(LABEL_SIZE, "1"))
            up = [n for n in nodes if n.state in _UP and n.ray_node_id]
            launch = launching.get(name)
            phase = GangPhase.READY if len(up) == size else GangPhase.PENDING
            reason = ""
            dead = [n for n in nodes if not n.alive]
            drained = name in self._drained or any(n.state == "DRAINING" or n.drained for n in nodes)
            if drained:
                phase, dead = GangPhase.READY, []
            if launch and launch.error:
                phase, reason = GangPhase.FAILED, launch.error
            elif dead and not (launch and not launch.done):  # while launching, the launcher restarts it
                phase, reason = GangPhase.FAILED, f"node {dead[0].id} exited (log {dead[0].log})"
            out.append(Gang(name, lb.get(LABEL_MODEL, ""), nodes[0].flavor, lb.get(LABEL_CAPACITY, "on-demand"),
                            lb.get(LABEL_ZONE, "local"), "local-" + nodes[0].flavor, size, phase,
                            float(lb.get(LABEL_CREATED, now)), reason=reason,
                            node_ids=tuple(str(n.ray_node_id) for n in up),
                            since_s=self._phase_since(name, phase, now),
                            slot=int(lb[LABEL_GANG_SLOT]) if lb.get(LABEL_GANG_SLOT, "").isdigit() else None,
                            draining=drained))
        # Launches with no node started yet (in their delay, or failed before any node came up).
        for name, la in sorted(launching.items()):
            if name in members or name in deleting:
                continue
            if la.done and not la.error:
                continue  # started and since removed
            a = la.action
            out.append(Gang(name, a.model, a.flavor, a.capacity_type, a.zone, a.instance_type, a.nodes,
                            GangPhase.FAILED if la.error else GangPhase.PENDING, la.created_s, reason=la.error,
                            since_s=None if la.error else (la.started_s if la.started_s is not None else now),
                            slot=la.slot))
        return out

    def _phase_since(self, name: str, phase: GangPhase, now: float) -> float | None:
        """When the gang entered ``phase`` as this process saw it (None: since creation, or unknown after
        a restart: the launch timeout then runs from creation, as before)."""
        with self._lock:
            was = self._since.get(name)
            if was is None:
                if phase == GangPhase.READY:
                    self._since[name] = (phase, now)  # from the first READY on, transitions count
                    return now
                la = self._launching.get(name)
                if la is None or phase != GangPhase.PENDING:
                    return None
                # Waiting for its turn (launch delay, another gang's start) is not being stuck: the
                # launcher's own timeouts bound that; the controller's clock starts at the node start.
                return la.started_s if la.started_s is not None else now
            if was[0] != phase:
                self._since[name] = (phase, now)
                return now
            return was[1]

    def create_gang(self, action: CreateGang, now: float) -> None:
        nodes = self.cluster.nodes(include_dead=True)
        with self._lock:
            prev = self._launching.get(action.name)
            if prev is not None and not prev.error and not prev.done:
                return  # still launching
            slot = self._free_slot(action, nodes)
            self._launching[action.name] = launch = _Launch(action, now, slot=slot)
            self._deleting.discard(action.name)
        if any(n.labels.get(LABEL_GANG) == action.name for n in nodes if n.alive):
            return  # already there (a controller restarted mid-launch): idempotent
        t = threading.Thread(target=self._launch, args=(launch,), name=f"launch-{action.name}", daemon=True)
        self._threads.append(t)
        t.start()

    def _free_slot(self, a: CreateGang, nodes: list[LocalNode]) -> int:
        """The lowest slot no other gang of the same (model, flavor) holds (lock held). A slot stays held
        while any node labelled with it is listed, a released gang's draining nodes included, so a new
        gang's replica never shares a slot deployment with an old gang's nodes. A gang whose nodes exist
        (ordered again after a controller restart) keeps theirs."""
        for n in nodes:
            if n.labels.get(LABEL_GANG) == a.name and n.labels.get(LABEL_GANG_SLOT, "").isdigit():
                return int(n.labels[LABEL_GANG_SLOT])
        held = {la.slot for name, la in self._launching.items()
                if name != a.name and (la.action.model, la.action.flavor) == (a.model, a.flavor)}
        for n in nodes:
            lb = n.labels
            if lb.get(LABEL_MODEL) == a.model and n.flavor == a.flavor and lb.get(LABEL_GANG) != a.name \
                    and lb.get(LABEL_GANG_SLOT, "").isdigit():
                held.add(int(lb[LABEL_GANG_SLOT]))
        return min(set(range(len(held) + 1)) - held)

    def drain_gang(self, name: str) -> None:
        """Drain every member through the GCS (reason preemption, LocalActuatorConfig.drain_deadline_s as
        its deadline): Serve starts each replica's replacement on another node before it stops the old one."""
        with self._lock:
            if name in self._drained or name in self._deleting:
                return
            self._drained.add(name)
        for n in self.cluster.nodes():
            if n.labels.get(LABEL_OWNER) == OWNER and n.labels.get(LABEL_GANG) == name and n.alive:
                self.cluster.drain_node(n.id, deadline_s=self.config.drain_deadline_s, reason=f"rayscale drain {name}")

    def delete_gang(self, name: str) -> None:
        with self._lock:
            if name in self._deleting:
                return
            self._deleting.add(name)
            self._since.pop(name, None)
            la = self._launching.pop(name, None)
            if la:
                la.done = True
        t = threading.Thread(target=self._delete, args=(name,), name=f"delete-{name}", daemon=True)
        self._threads.append(t)
        t.start()

    def recover(self, now: float) -> list[str]:
        """Call once when a controller (re)starts, before it reconciles: the cluster adopts or removes a
        node whose start a crash cut short (``LocalCluster.recover``), and a gang with members not yet
        started (its launcher died with the old controller) starts the rest. One line per change."""
        notes = self.cluster.recover()
        members: dict[str, list[LocalNode]] = defaultdict(list)
        for n in self.cluster.nodes(include_dead=True):
            if n.labels.get(LABEL_OWNER) == OWNER and LABEL_GANG in n.labels:
                members[n.labels[LABEL_GANG]].append(n)
        for name, nodes in sorted(members.items()):
            lb = nodes[0].labels
            size = int(lb.get(LABEL_SIZE, "1"))
            if len(nodes) >= size or not all(n.alive for n in nodes):
                continue  # whole, or failed (the controller deletes it whole)
            action = CreateGang(name, lb.get(LABEL_MODEL, ""), nodes[0].flavor, lb.get(LABEL_CAPACITY, "on-demand"),
                                lb.get(LABEL_ZONE, "local"), "local-" + nodes[0].flavor, size,
                                "resumed after a controller restart")
            with self._lock:
                if name in self._launching or name in self._deleting:
                    continue
                # the rest of the gang joins the slot its first members hold
                slot = int(lb.get(LABEL_GANG_SLOT, "0") or 0)
                self._launching[name] = la = _Launch(action, float(lb.get(LABEL_CREATED, now)), have=len(nodes),
                                                     slot=slot)
            self._spawn_thread(self._launch, la, f"launch-{name}")
            notes.append(f"resumed {name}: {len(nodes)} of {size} nodes had started")
        return notes

    def serve_dashboard(self) -> str | None:
        return None  # the local cluster's dashboard never moves

    def sync_serve_targets(self, targets: dict[str, dict[str, int]]) -> list[str]:
        return []  # Serve on a local cluster keeps its own targets: nothing re-submits its config

    def close(self, timeout_s: float = 30.0) -> None:
        """Stops starting nodes and waits (bounded) for starts and deletions under way. A start cut
        short here is adopted by the next controller's ``recover()``; nothing that serves is drained."""
        self._closing.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _spawn_thread(self, target: Callable[[_Launch], None], arg: _Launch, name: str) -> None:
        t = threading.Thread(target=target, args=(arg,), name=name, daemon=True)
        self._threads.append(t)
        t.start()

    # --- internals ---------------------------------------------------------------------------------
    def _launch(self, la: _Launch) -> None:
        a = la.action
        # a resumed gang already waited its launch delay under the controller that created it
        delay = 0.0 if la.have else self.config.launch_delay_s.get(a.flavor, self.config.default_launch_delay_s)
        end = time.monotonic() + delay
        while time.monotonic() < end:
            if la.done or self._closing.is_set():
                return  # deleted while waiting, or the controller stops
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))
        with self._lock:
            failing = (a.flavor, a.zone) in self.config.capacity_errors
        if failing:
            la.error = f"InsufficientCapacityError: no {a.flavor} capacity in {a.zone}"
            return
        workers = [n for n in self.cluster.nodes() if not n.is_head]
        if len(workers) + a.nodes - la.have > self.config.max_worker_nodes:
            la.error = (f"this machine runs at most {self.config.max_worker_nodes} worker nodes; "
                        f"{len(workers)} run, the gang needs {a.nodes - la.have} more")
            return
        labels = {
            LABEL_OWNER: OWNER, LABEL_GANG: a.name, LABEL_MODEL: a.model, LABEL_CAPACITY: a.capacity_type,
            LABEL_ZONE: a.zone, LABEL_SIZE: str(a.nodes), LABEL_CREATED: f"{la.created_s:.3f}",
            LABEL_GANG_SLOT: str(la.slot),
        }
        for _ in range(a.nodes - la.have):
            for attempt in range(1, self.config.start_attempts + 1):
                if la.done or self._closing.is_set():
                    return
                try:
                    with self._start_lock:
                        if la.started_s is None:
                            la.started_s = la.created_s + (time.monotonic() - la.mono_s)
                        self.cluster.add_node(flavor_spec(a.flavor, labels=labels), wait=True,
                                              timeout_s=self.config.node_start_timeout_s)
                    break
                except Exception as e:  # add_node removed the failed node; a last failure fails the gang
                    if attempt == self.config.start_attempts:
                        la.error = f"node start failed {attempt} times: {str(e)[:300]}"
                        return
        la.done = True

    def _delete(self, name: str) -> None:
        try:
            for n in self.cluster.nodes(include_dead=True):
                if n.labels.get(LABEL_GANG) == name and not n.is_head:
                    with contextlib.suppress(Exception):
                        self.cluster.remove_node(n.id, grace_s=self.config.drain_grace_s)
        finally:
            with self._lock:
                self._launching.pop(name, None)
                self._deleting.discard(name)
                self._drained.discard(name)
