"""A Karpenter stand-in for the emulator: it drives NodeClaims the way Karpenter's controllers do.

Each rule names the upstream file (kubernetes-sigs/karpenter, v1 API) it follows. For each NodeClaim
(level-triggered, so a restart of the stand-in picks up where things are):
- it adds the ``karpenter.sh/termination`` finalizer and sets Launched/Registered/Initialized/Ready
  to Unknown;
- launch (``pkg/controllers/nodeclaim/lifecycle/launch.go`` ``launchNodeClaim``): after ``launch``
  seconds it resolves instance type, zone and capacity type from the requirements (the first allowed
  instance type, zone and the preferred allowed capacity type that have capacity), labels the claim
  with them and fills ``status.providerID``, ``imageID``, ``capacity`` and ``allocatable``:
  Launched=True. With no capacity anywhere it publishes a Warning Event ``InsufficientCapacityError``
  on the claim (``lifecycle/events.go``; cluster-scoped, so the Event is in namespace ``default``) and
  deletes the claim. ``Launched=False`` is never set;
- after ``register`` more seconds it creates the Node (the claim's labels and annotations, the
  single-value ``In`` requirements as labels, instance-type/zone/region/capacity-type/arch/os/hostname,
  the claim's taints plus startupTaints, an ownerReference to the claim, the termination finalizer)
  and sets ``status.nodeName``: Registered=True;
- after ``initialize`` more seconds the Node turns Ready, startup taints go, extended resources
  (GPUs, Neuron devices) become allocatable: Initialized=True, Ready=True;
- liveness (``lifecycle/liveness.go``): a claim not launched ``launch_timeout`` (5 min) or not
  registered ``registration_timeout`` (15 min) after it was first seen is deleted, without an Event;
- expiration (``pkg/controllers/nodeclaim/expiration/controller.go``): ``spec.expireAfter`` after it
  was first seen the claim is deleted, forcefully: ``do-not-disrupt`` does not stop it;
- emptiness (``pkg/controllers/nodeclaim/disruption/consolidation.go``, ``pkg/controllers/disruption/
  emptiness.go``): an Initialized claim of an existing NodePool (``karpenter.sh/nodepool`` label) whose
  Node has no reschedulable pods is deleted ``consolidateAfter`` after it was initialized or last had a
  pod, unless ``karpenter.sh/do-not-disrupt`` is on the Node (the claim before registration,
  ``pkg/controllers/state/statenode.go`` ``Annotations``) or a pod, within the pool's Empty budget
  (``pkg/controllers/disruption/helpers.go`` ``BuildDisruptionBudgetMapping``);
- on deletion it taints the Node ``karpenter.sh/disrupted:NoSchedule``, evicts its pods, deletes the
  Node, then removes the claim's finalizer. A Node deleted directly takes its claim with it.

Not modelled here because the emulator or the stand-in's scope already gives upstream's behaviour:
NodePool deletion reaches claims only through their ownerReferences (the emulator's garbage
collector, as Kubernetes'; Karpenter sets them on the claims it creates in ``pkg/controllers/
provisioning/scheduling/nodeclaimtemplate.go``), so a claim without one escapes it. NodePool
``limits`` are checked only when Karpenter creates a claim itself (``pkg/controllers/provisioning/
provisioner.go`` ``Create``); this stand-in never provisions, so a third-party claim over the limit
still launches. Timers run from when the stand-in first saw a claim (its clock), not
``creationTimestamp``: a restarted stand-in restarts them.

Delays come from ``KarpenterConfig`` (per instance type if given); with a ``ManualClock`` and direct
``step()`` calls everything is deterministic. ``disrupt()`` emulates a voluntary disruption
(consolidation, drift) that honours ``karpenter.sh/do-not-disrupt`` on the claim, the node and its pods.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rayscale_testing.kubeapi import ApiError, Store, now_rfc3339
from rayscale_testing.scheduler import Clock, StandIn, set_condition

Obj = dict[str, Any]

FINALIZER = "karpenter.sh/termination"
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
L_INSTANCE_TYPE = "node.kubernetes.io/instance-type"
L_ZONE = "topology.kubernetes.io/zone"
L_REGION = "topology.kubernetes.io/region"
L_CAPACITY_TYPE = "karpenter.sh/capacity-type"
L_NODEPOOL = "karpenter.sh/nodepool"
# Where Events for cluster-scoped objects land (client-go's recorder: metav1.NamespaceDefault).
EVENTS_NAMESPACE = "default"
# Karpenter prefers reserved capacity, then spot, then on-demand when several are allowed.
CAPACITY_PREFERENCE = ("reserved", "spot", "on-demand")


@dataclass(frozen=True)
class InstanceShape:
    cpu: str
    memory: str
    extended: Mapping[str, str] = field(default_factory=dict)  # e.g. {"nvidia.com/gpu": "1"}
    pods: str = "110"


# Shapes from the EC2 instance type specs (vCPU, memory, accelerators); allocatable is kept equal to
# capacity: the stand-in does not model kube-reserved.
DEFAULT_INSTANCE_TYPES: dict[str, InstanceShape] = {
    "m6i.large": InstanceShape("2", "8Gi"),
    "m6i.xlarge": InstanceShape("4", "16Gi"),
    "m6i.2xlarge": InstanceShape("8", "32Gi"),
    "c6i.2xlarge": InstanceShape("8", "16Gi"),
    "g5.xlarge": InstanceShape("4", "16Gi", {"nvidia.com/gpu": "1"}),
    "g5.2xlarge": InstanceShape("8", "32Gi", {"nvidia.com/gpu": "1"}),
    "g5.12xlarge": InstanceShape("48", "192Gi", {"nvidia.com/gpu": "4"}),
    "g5.48xlarge": InstanceShape("192", "768Gi", {"nvidia.com/gpu": "8"}),
    "g6.xlarge": InstanceShape("4", "16Gi", {"nvidia.com/gpu": "1"}),
    "g6.12xlarge": InstanceShape("48", "192Gi", {"nvidia.com/gpu": "4"}),
    "g6e.xlarge": InstanceShape("4", "32Gi", {"nvidia.com/gpu": "1"}),
    "g6e.48xlarge": InstanceShape("192", "1536Gi", {"nvidia.com/gpu": "8"}),
    "p4d.24xlarge": InstanceShape("96", "1152Gi", {"nvidia.com/gpu": "8"}),
    "p5.48xlarge": InstanceShape("192", "2048Gi", {"nvidia.com/gpu": "8"}),
    "inf2.xlarge": InstanceShape(
        "4", "16Gi", {"aws.amazon.com/neuron": "1", "aws.amazon.com/neuroncore": "2"}
    ),
    "inf2.48xlarge": InstanceShape(
        "192", "768Gi", {"aws.amazon.com/neuron": "12", "aws.amazon.com/neuroncore": "24"}
    ),
    "trn1.2xlarge": InstanceShape(
        "8", "32Gi", {"aws.amazon.com/neuron": "1", "aws.amazon.com/neuroncore": "2"}
    ),
    "trn1.32xlarge": InstanceShape(
        "128", "512Gi", {"aws.amazon.com/neuron": "16", "aws.amazon.com/neuroncore": "32"}
    ),
}


@dataclass(frozen=True)
class Delays:
    launch: float = 0.0
    register: float = 0.0
    initialize: float = 0.0


@dataclass(frozen=True)
class CapacityError:
    """No capacity for this instance type in this zone (``*`` matches any) and capacity type."""

    instance_type: str
    zone: str = "*"
    capacity_type: str = "*"

    def matches(self, it: str, zone: str, ct: str) -> bool:
        return (
            self.instance_type in ("*", it) and self.zone in ("*", zone) and self.capacity_type in ("*", ct)
        )


@dataclass
class KarpenterConfig:
    delays: Delays = field(default_factory=Delays)
    delays_by_instance_type: dict[str, Delays] = field(default_factory=dict)
    capacity_errors: set[CapacityError] = field(default_factory=set)
    zones: tuple[str, ...] = ("us-east-1a", "us-east-1b", "us-east-1c")
    region: str = "us-east-1"
    instance_types: dict[str, InstanceShape] = field(default_factory=lambda: dict(DEFAULT_INSTANCE_TYPES))
    default_instance_type: str = "m6i.xlarge"
    termination_delay: float = 0.0
    # lifecycle/liveness.go: LaunchTimeout (5 min) and registrationTimeout (15 min).
    launch_timeout: float = 300.0
    registration_timeout: float = 900.0
    # Claims named here stay in their current phase (a slow member of a gang, for tests).
    held: set[str] = field(default_factory=set)

    def delays_for(self, instance_type: str) -> Delays:
        return self.delays_by_instance_type.get(instance_type, self.delays)


@dataclass
class _Track:
    seen: float
    launched: float | None = None
    registered: float | None = None
    initialized: float | None = None
    last_pod: float | None = None  # the last time a reschedulable pod was seen on its Node
    deleting: float | None = None


def _conds(obj: Obj) -> list[Obj]:
    return list((obj.get("status") or {}).get("conditions") or [])


def condition_status(obj: Obj, type_: str) -> str | None:
    for c in (obj.get("status") or {}).get("conditions") or ():
        if c.get("type") == type_:
            return str(c.get("status"))
    return None


def _node_labels(claim: Obj, node_name: str) -> dict[str, str]:
    """A registered node's labels: each single-value In requirement of its claim, the claim's own labels,
    then the ones the kubelet and Karpenter set."""
    labels: dict[str, str] = {}
    for r in (claim.get("spec") or {}).get("requirements") or ():
        if r.get("operator") == "In" and len(r.get("values") or []) == 1:
            labels[r["key"]] = r["values"][0]
    labels.update(claim["metadata"].get("labels") or {})
    labels.update({"kubernetes.io/hostname": node_name, "kubernetes.io/arch": "amd64", "kubernetes.io/os": "linux",
                   "karpenter.sh/registered": "true"})
    return labels


class KarpenterStandIn(StandIn):
    watched = ("nodeclaims", "nodes")

    def __init__(
        self,
        store: Store,
        config: KarpenterConfig | None = None,
        *,
        clock: Clock | None = None,
        tick: float = 0.02,
    ) -> None:
        super().__init__(store, clock=clock, tick=tick)
        self.config = config or KarpenterConfig()
        self._track: dict[str, _Track] = {}
        self.launched: list[tuple[str, str, str, str]] = []  # (claim, instance type, zone, capacity type)
        self.capacity_failures: list[str] = []
        self.disruptions: list[tuple[str, str]] = []
        # Every claim this stand-in deleted and why (the metric reason upstream records).
        self.deleted: list[tuple[str, str]] = []
        self._event_ids = itertools.count()

    # -- capacity control for tests -----------------------------------------------------------------

    def set_capacity_error(
        self, instance_type: str, zone: str = "*", capacity_type: str = "*", on: bool = True
    ) -> None:
        err = CapacityError(instance_type, zone, capacity_type)
        if on:
            self.config.capacity_errors.add(err)
        else:
            self.config.capacity_errors.discard(err)

    def _has_capacity(self, it: str, zone: str, ct: str) -> bool:
        return not any(e.matches(it, zone, ct) for e in self.config.capacity_errors)

    # -- reconcile ----------------------------------------------------------------------------------

    def step(self) -> None:
        now = self.clock.now()
        claims, _ = self.store.list("nodeclaims")
        live = set()
        for claim in claims:
            name = claim["metadata"]["name"]
            live.add(name)
            track = self._track.setdefault(name, _Track(seen=now))
            if claim["metadata"].get("deletionTimestamp"):
                self._terminate(claim, track, now)
            elif not self._expire_or_time_out(claim, track, now):
                self._progress(claim, track, now)
        self._consolidate_empty(now)
        for name in list(self._track):
            if name not in live:
                del self._track[name]
        # A Node deleted directly takes its NodeClaim with it (Karpenter's node termination path).
        nodes, _ = self.store.list("nodes")
        for node in nodes:
            meta = node["metadata"]
            if meta.get("deletionTimestamp") and FINALIZER in (meta.get("finalizers") or ()):
                owner = next(
                    (r["name"] for r in meta.get("ownerReferences") or () if r.get("kind") == "NodeClaim"),
                    None,
                )
                if owner and owner in live:
                    self._delete("nodeclaims", owner)
                else:
                    self._finish_node(node)

    def _progress(self, claim: Obj, track: _Track, now: float) -> None:
        meta = claim["metadata"]
        name = meta["name"]
        if FINALIZER not in (meta.get("finalizers") or ()):
            self.store.patch(
                "nodeclaims", name, {"metadata": {"finalizers": [*(meta.get("finalizers") or []), FINALIZER]}}
            )
        conds = _conds(claim)
        if not conds:
            for t in ("Launched", "Registered", "Initialized", "Ready"):
                set_condition(
                    conds, t, "Unknown", "AwaitingReconciliation", "object is awaiting reconciliation"
                )
            self._set_status(name, {"conditions": conds})
            return
        if name in self.config.held:
            return
        launched = condition_status(claim, "Launched")
        if launched != "True":
            itype_guess = self._first(claim, L_INSTANCE_TYPE) or self.config.default_instance_type
            if now - track.seen < self.config.delays_for(itype_guess).launch:
                return
            self._launch(claim, track, now)
            return
        itype = (meta.get("labels") or {}).get(L_INSTANCE_TYPE, self.config.default_instance_type)
        delays = self.config.delays_for(itype)
        if track.launched is None:
            track.launched = now  # launched before this stand-in (re)started
        if condition_status(claim, "Registered") != "True":
            if now - track.launched >= delays.register:
                self._register(claim, now, track)
            return
        if track.registered is None:
            track.registered = now
        if condition_status(claim, "Initialized") != "True":
            if now - track.registered >= delays.initialize:
                self._initialize(claim)
                track.initialized = now
        elif track.initialized is None:
            track.initialized = now  # initialized before this stand-in (re)started

    # -- phases -------------------------------------------------------------------------------------

    def _allowed(self, claim: Obj, key: str) -> tuple[list[str] | None, set[str]]:
        """(values of In requirements or None when unconstrained, values excluded by NotIn)."""
        allowed: list[str] | None = None
        excluded: set[str] = set()
        for r in (claim.get("spec") or {}).get("requirements") or ():
            if r.get("key") != key:
                continue
            if r.get("operator") == "In":
                vals = list(r.get("values") or [])
                allowed = vals if allowed is None else [v for v in allowed if v in vals]
            elif r.get("operator") == "NotIn":
                excluded |= set(r.get("values") or [])
        return allowed, excluded

    def _first(self, claim: Obj, key: str) -> str | None:
        allowed, excluded = self._allowed(claim, key)
        return next((v for v in allowed or () if v not in excluded), None)

    def _options(self, claim: Obj) -> list[tuple[str, str, str]]:
        its, it_ex = self._allowed(claim, L_INSTANCE_TYPE)
        zones, z_ex = self._allowed(claim, L_ZONE)
        cts, ct_ex = self._allowed(claim, L_CAPACITY_TYPE)
        it_list = [
            i for i in (its if its is not None else [self.config.default_instance_type]) if i not in it_ex
        ]
        zone_list = [z for z in (zones if zones is not None else list(self.config.zones)) if z not in z_ex]
        ct_list = [
            c
            for c in CAPACITY_PREFERENCE
            if (cts is None and c == "on-demand") or (cts is not None and c in cts)
        ]
        ct_list = [c for c in ct_list if c not in ct_ex]
        return [
            (it, z, ct)
            for it in it_list
            if it in self.config.instance_types
            for z in zone_list
            for ct in ct_list
        ]

    def _launch(self, claim: Obj, track: _Track, now: float) -> None:
        name = claim["metadata"]["name"]
        options = self._options(claim)
        choice = next((o for o in options if self._has_capacity(*o)), None)
        conds = _conds(claim)
        if choice is None:
            # launch.go launchNodeClaim: an InsufficientCapacityError Event, then the claim is deleted;
            # the Launched condition stays Unknown.
            tried = sorted({f"{it}/{z}/{ct}" for it, z, ct in options}) or ["no compatible instance type"]
            self.publish_event(
                claim, "InsufficientCapacityError",
                f"NodeClaim {name} event: insufficient capacity, all requested instance types were "
                f"unavailable during launch ({', '.join(tried)})",
            )
            self.capacity_failures.append(name)
            self._delete_claim(name, "insufficient_capacity")
            return
        it, zone, ct = choice
        shape = self.config.instance_types[it]
        digest = hashlib.sha256(name.encode()).hexdigest()
        labels = {L_INSTANCE_TYPE: it, L_ZONE: zone, L_CAPACITY_TYPE: ct, L_REGION: self.config.region}
        self.store.patch("nodeclaims", name, {"metadata": {"labels": labels}})
        capacity = {"cpu": shape.cpu, "memory": shape.memory, "pods": shape.pods, **shape.extended}
        set_condition(conds, "Launched", "True")
        self._set_status(
            name,
            {
                "conditions": conds,
                "providerID": f"aws:///{zone}/i-{digest[:17]}",
                "imageID": "ami-0123456789abcdef0",
                "capacity": capacity,
                "allocatable": capacity,
            },
        )
        track.launched = now
        self.launched.append((name, it, zone, ct))

    def _node_name(self, claim: Obj) -> str:
        d = hashlib.sha256(claim["metadata"]["uid"].encode()).digest()
        return f"ip-10-{d[0]}-{d[1]}-{d[2]}.ec2.internal"

    def _register(self, claim: Obj, now: float, track: _Track) -> None:
        meta = claim["metadata"]
        spec = claim.get("spec") or {}
        status = claim.get("status") or {}
        node_name = self._node_name(claim)
        labels = _node_labels(claim, node_name)
        extended = (
            set(self.config.instance_types[labels[L_INSTANCE_TYPE]].extended)
            if labels.get(L_INSTANCE_TYPE) in self.config.instance_types
            else set()
        )
        allocatable = {k: v for k, v in (status.get("allocatable") or {}).items() if k not in extended}
        node: Obj = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node_name,
                "labels": labels,
                "annotations": dict(meta.get("annotations") or {}),
                "finalizers": [FINALIZER],
                "ownerReferences": [
                    {
                        "apiVersion": "karpenter.sh/v1",
                        "kind": "NodeClaim",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {
                "providerID": status.get("providerID", ""),
                "taints": [*(spec.get("taints") or []), *(spec.get("startupTaints") or [])],
            },
            "status": {
                "capacity": dict(status.get("capacity") or {}),
                "allocatable": allocatable,
                "conditions": [
                    {"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "starting"}
                ],
                "addresses": [
                    {"type": "InternalIP", "address": node_name[3:].split(".")[0].replace("-", ".")}
                ],
            },
        }
        if not node["spec"]["taints"]:
            del node["spec"]["taints"]
        if self.store.try_get("nodes", node_name) is None:
            self.store.create("nodes", node)
        conds = _conds(claim)
        set_condition(conds, "Registered", "True")
        self._set_status(meta["name"], {"conditions": conds, "nodeName": node_name})
        track.registered = now

    def _initialize(self, claim: Obj) -> None:
        meta = claim["metadata"]
        status = claim.get("status") or {}
        node_name = status.get("nodeName")
        node = self.store.try_get("nodes", node_name) if node_name else None
        if node is None or not node_name:
            return
        startup = {
            (t.get("key"), t.get("effect")) for t in (claim.get("spec") or {}).get("startupTaints") or ()
        }
        taints = [
            t
            for t in (node.get("spec") or {}).get("taints") or ()
            if (t.get("key"), t.get("effect")) not in startup
        ]
        node["spec"]["taints"] = taints
        node["metadata"]["labels"]["karpenter.sh/initialized"] = "true"
        node = self.store.update("nodes", node)
        node_status = dict(node.get("status") or {})
        node_status["allocatable"] = dict(status.get("allocatable") or {})
        node_status["conditions"] = [
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "kubelet is posting ready status",
            }
        ]
        self.store.patch("nodes", node_name, {"status": node_status}, subresource="status")
        conds = _conds(claim)
        set_condition(conds, "Initialized", "True")
        set_condition(conds, "Ready", "True")
        self._set_status(meta["name"], {"conditions": conds})

    def _terminate(self, claim: Obj, track: _Track, now: float) -> None:
        meta = claim["metadata"]
        if FINALIZER not in (meta.get("finalizers") or ()):
            return  # not ours (or already released): the apiserver removes it once others are done
        if track.deleting is None:
            track.deleting = now
        if now - track.deleting < self.config.termination_delay:
            return
        node_name = (claim.get("status") or {}).get("nodeName")
        node = self.store.try_get("nodes", node_name) if node_name else None
        if node is not None and node_name:
            if not node["metadata"].get("deletionTimestamp"):
                taints = list((node.get("spec") or {}).get("taints") or [])
                if not any(t.get("key") == "karpenter.sh/disrupted" for t in taints):
                    taints.append({"key": "karpenter.sh/disrupted", "effect": "NoSchedule"})
                    self.store.patch("nodes", node_name, {"spec": {"taints": taints}})
                self._delete("nodes", node_name)
            node = self.store.try_get("nodes", node_name)
            if node is not None:
                self._finish_node(node)
        self._remove_finalizer("nodeclaims", meta["name"])

    def _finish_node(self, node: Obj) -> None:
        """Evict the node's pods, then release the node."""
        name = node["metadata"]["name"]
        pods, _ = self.store.list("pods", field_selector=f"spec.nodeName={name}")
        for p in pods:
            self._delete("pods", p["metadata"]["name"], p["metadata"]["namespace"])
        self._remove_finalizer("nodes", name)

    # -- liveness and expiration ---------------------------------------------------------------------

    def _expire_or_time_out(self, claim: Obj, track: _Track, now: float) -> bool:
        """Delete a claim that expired or missed a liveness deadline; True when it was deleted."""
        name = claim["metadata"]["name"]
        if not _conds(claim):
            return False  # not reconciled yet: the conditions (and their clocks) start at the next pass
        # expiration/controller.go: forceful, so do-not-disrupt is not consulted.
        expire_after = parse_duration((claim.get("spec") or {}).get("expireAfter"))
        if expire_after is not None and now - track.seen >= expire_after:
            self._delete_claim(name, "expired")
            return True
        # lifecycle/liveness.go Reconcile: no Event is published for a timeout.
        if condition_status(claim, "Registered") == "True":
            return False
        if condition_status(claim, "Launched") != "True" and now - track.seen >= self.config.launch_timeout:
            self._delete_claim(name, "launch_timeout")
            return True
        if now - track.seen >= self.config.registration_timeout:
            self._delete_claim(name, "registration_timeout")
            return True
        return False

    # -- emptiness consolidation ---------------------------------------------------------------------

    def _consolidate_empty(self, now: float) -> None:
        """disruption/emptiness.go: delete empty, consolidatable claims within each pool's Empty budget."""
        claims, _ = self.store.list("nodeclaims")
        budgets = self._empty_budgets(claims)
        for claim in claims:
            pool = (claim["metadata"].get("labels") or {}).get(L_NODEPOOL, "")
            track = self._track.get(claim["metadata"]["name"])
            if track is None or not self._consolidatable(claim, track, now) or budgets.get(pool, 0) <= 0:
                continue
            budgets[pool] -= 1
            self.disruptions.append((claim["metadata"]["name"], "Empty"))
            self._delete_claim(claim["metadata"]["name"], "empty")

    def _consolidatable(self, claim: Obj, track: _Track, now: float) -> bool:
        """nodeclaim/disruption/consolidation.go (the Consolidatable condition) and statenode.go
        ValidateNodeDisruptable / ValidatePodsDisruptable, for an empty node."""
        meta = claim["metadata"]
        pool = self._nodepool(claim)
        node_name = (claim.get("status") or {}).get("nodeName")
        if meta.get("deletionTimestamp") or pool is None or not node_name or track.initialized is None:
            return False
        after = parse_duration(((pool.get("spec") or {}).get("disruption") or {}).get("consolidateAfter"))
        node = self.store.try_get("nodes", node_name)
        if after is None or node is None or node["metadata"].get("deletionTimestamp"):
            return False
        pods, _ = self.store.list("pods", field_selector=f"spec.nodeName={node_name}")
        if any(_reschedulable(p) for p in pods):
            track.last_pod = now
            return False
        # After registration Karpenter reads do-not-disrupt from the Node (statenode.go Annotations).
        if any((o["metadata"].get("annotations") or {}).get(DO_NOT_DISRUPT) == "true" for o in [node, *pods]):
            return False
        since = max(track.initialized, track.last_pod or track.initialized)
        return now - since >= after

    def _nodepool(self, claim: Obj) -> Obj | None:
        # disruption/types.go NewCandidate: a claim without the label or its NodePool is no candidate.
        name = (claim["metadata"].get("labels") or {}).get(L_NODEPOOL)
        return self.store.try_get("nodepools", name) if name else None

    def _empty_budgets(self, claims: list[Obj]) -> dict[str, int]:
        """helpers.go BuildDisruptionBudgetMapping: allowed Empty disruptions per pool, less those under way."""
        nodes: dict[str, int] = {}
        disrupting: dict[str, int] = {}
        for c in claims:
            if condition_status(c, "Initialized") != "True":
                continue  # only initialized nodes count towards the total
            pool = (c["metadata"].get("labels") or {}).get(L_NODEPOOL, "")
            nodes[pool] = nodes.get(pool, 0) + 1
            if c["metadata"].get("deletionTimestamp"):
                disrupting[pool] = disrupting.get(pool, 0) + 1
        out: dict[str, int] = {}
        for pool in nodes:
            np = self.store.try_get("nodepools", pool) if pool else None
            if np is not None:
                allowed = allowed_disruptions(np, nodes[pool], "Empty")
                out[pool] = max(allowed - disrupting.get(pool, 0), 0)
        return out

    # -- events ----------------------------------------------------------------------------------------

    def publish_event(self, obj: Obj, reason: str, message: str, type_: str = "Warning") -> None:
        """A core/v1 Event on ``obj`` as client-go's recorder writes it (pkg/events/recorder.go)."""
        meta = obj["metadata"]
        ts = now_rfc3339()
        self.store.create(
            "events",
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": f"{meta['name']}.{next(self._event_ids):x}", "namespace": EVENTS_NAMESPACE},
                "involvedObject": {
                    "apiVersion": obj.get("apiVersion", "karpenter.sh/v1"),
                    "kind": obj.get("kind", "NodeClaim"),
                    "name": meta["name"],
                    "uid": meta.get("uid", ""),
                },
                "reason": reason,
                "message": message,
                "type": type_,
                "source": {"component": "karpenter"},
                "reportingComponent": "karpenter",
                "firstTimestamp": ts,
                "lastTimestamp": ts,
                "count": 1,
            },
            EVENTS_NAMESPACE,
        )

    def _delete_claim(self, name: str, reason: str) -> None:
        self.deleted.append((name, reason))
        self._delete("nodeclaims", name)

    # -- voluntary disruption -------------------------------------------------------------------------

    def disrupt(self, claim_name: str, reason: str = "Underutilized") -> bool:
        """Try to disrupt a claim like consolidation would; False when do-not-disrupt blocks it."""
        claim = self.store.try_get("nodeclaims", claim_name)
        if claim is None:
            return False
        blockers = [claim]
        node_name = (claim.get("status") or {}).get("nodeName")
        if node_name:
            node = self.store.try_get("nodes", node_name)
            if node is not None:
                blockers.append(node)
            pods, _ = self.store.list("pods", field_selector=f"spec.nodeName={node_name}")
            blockers.extend(pods)
        if any((b["metadata"].get("annotations") or {}).get(DO_NOT_DISRUPT) == "true" for b in blockers):
            return False
        self.disruptions.append((claim_name, reason))
        self._delete("nodeclaims", claim_name)
        return True

    # -- store helpers --------------------------------------------------------------------------------

    def _set_status(self, name: str, status: Obj) -> None:
        self.store.patch("nodeclaims", name, {"status": status}, subresource="status")

    def _delete(self, type_name: str, name: str, namespace: str | None = None) -> None:
        try:
            self.store.delete(type_name, name, namespace)
        except ApiError as e:
            if e.code != 404:
                raise

    def _remove_finalizer(self, type_name: str, name: str) -> None:
        obj = self.store.try_get(type_name, name)
        if obj is None:
            return
        fins = [f for f in obj["metadata"].get("finalizers") or () if f != FINALIZER]
        self.store.patch(
            type_name,
            name,
            [
                {
                    "op": "test",
                    "path": "/metadata/resourceVersion",
                    "value": obj["metadata"]["resourceVersion"],
                },
                {"op": "replace", "path": "/metadata/finalizers", "value": fins},
            ],
            patch_type="json",
        )


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(h|m|s)")
_DURATION_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(text: str | None) -> float | None:
    """A NodePool/NodeClaim duration (Go's ``time.ParseDuration`` subset: ``720h``, ``1h30m``, ``10s``) in
    seconds; None for ``Never`` or unset."""
    if text is None or text == "Never":
        return None
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * _DURATION_UNIT[u] for n, u in parts)


def allowed_disruptions(nodepool: Obj, num_nodes: int, reason: str) -> int:
    """pkg/apis/v1/nodepool.go GetAllowedDisruptionsByReason: the smallest budget naming ``reason`` (or
    no reasons); percentages round up. Budget schedules are not modelled (every budget is active). The
    CRD's default budget is ``nodes: 10%``."""
    budgets = ((nodepool.get("spec") or {}).get("disruption") or {}).get("budgets") or [{"nodes": "10%"}]
    allowed = math.inf
    for b in budgets:
        if b.get("reasons") and reason not in b["reasons"]:
            continue
        nodes = str(b.get("nodes", "10%"))
        val = math.ceil(num_nodes * float(nodes[:-1]) / 100) if nodes.endswith("%") else int(nodes)
        allowed = min(allowed, val)
    return int(allowed) if allowed != math.inf else num_nodes


def _reschedulable(pod: Obj) -> bool:
    """A pod that makes its node non-empty: not owned by a DaemonSet, not terminal, not terminating
    (pkg/utils/pod/scheduling.go IsReschedulable)."""
    meta = pod["metadata"]
    if any(r.get("kind") == "DaemonSet" for r in meta.get("ownerReferences") or ()):
        return False
    if meta.get("deletionTimestamp"):
        return False
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
