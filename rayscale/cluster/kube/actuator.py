"""The Kubernetes actuator: gangs of Karpenter NodeClaims, joined to Ray through KubeRay worker groups.

Level-triggered: every call reads the world (NodeClaims and Nodes by rayscale's ownership labels, the
RayCluster's worker pods, the RayCluster) and moves each gang one step; nothing blocks beyond one API
call with bounded retries. What a restarted controller needs is in the cluster:

- NodeClaims ``{gang}-{i}`` carry the ownership labels (owner, gang, model, flavor, capacity type,
  zone, size, created-at, member index, ``karpenter.sh/nodepool``); Karpenter copies them to the Node.
  Deterministic names make a repeated create a 409, never a second gang.
- ``rayscale.io/gang-complete`` on member 0 says every member was created: a member missing before it
  is one a crash never created (create it now); after it, one Karpenter deleted (the gang FAILED).
- ``rayscale.io/deleting`` on the claims says the gang is being released.
- ``rayscale.io/ray-worker=true`` on a Node says its gang was admitted to Ray (every member
  Initialized); worker pods select it. The worker group's replicas are the count of admitted Nodes.

Up: ``create_gang`` creates every NodeClaim of the gang (one zone, instance type and capacity type
from the flavor, ``expireAfter: Never``). Once every member is Initialized the Nodes are labelled and the
worker group's replicas raised; the gang is READY when a worker pod of its group runs on each of its
Nodes (``node_ids`` = Node names). A member that Karpenter deleted (or is deleting), or one not
Initialized in time, makes the gang FAILED with the reason; the controller deletes it whole and backs
off the zone.

Karpenter, as its source says it behaves (kubernetes-sigs/karpenter), and what this actuator does:

- Insufficient capacity is an ``InsufficientCapacityError`` Event on the claim, then the claim is
  deleted (``pkg/controllers/nodeclaim/lifecycle/launch.go``); ``Launched=False`` never happens. The
  reason of a deleted member is read from the claim's Events (namespace ``default``: the recorder's
  namespace for cluster-scoped objects). Liveness deletions (``lifecycle/liveness.go``: not launched in
  5 min, not registered in 15) publish no Event; the reason then says so.
- Emptiness consolidation (``pkg/controllers/disruption/emptiness.go``) deletes an Initialized node
  with no pods ``consolidateAfter`` after it emptied. A gang member waits for its siblings with no pod
  for up to ``init_timeout_factor`` x node start, so every claim carries ``karpenter.sh/do-not-disrupt``
  from creation until the gang is released (Karpenter copies it to the Node at registration,
  ``lifecycle/registration.go``; each pass puts it back where it is missing). Expiry and interruption
  ignore it, as upstream does.
- NodePool ``limits`` are enforced by Karpenter only for the claims it creates itself
  (``pkg/controllers/provisioning/provisioner.go`` ``Create``), so ``create_gang`` checks them for its
  own: a gang that would take the pool past a limit is not created and is reported FAILED.
- Each claim has an ownerReference to its NodePool (as ``provisioning/scheduling/nodeclaimtemplate.go``
  sets on Karpenter's own), so deleting the pool takes its claims and NodePool health counts them
  (``lifecycle/liveness.go`` ``updateNodePoolRegistrationHealth``).

Gang slots (``rayscale.cluster.kube.slots``): a gang of a multi-node (model, flavor) gets the lowest slot
no other gang's claims of that pair hold, as ``rayscale.io/gang-slot`` on its claims (so on its Nodes);
its worker group is that slot's, whose Ray node labels its Serve slot deployment selects, and
``Gang.slot`` is read back from the claims. With every slot held the gang is refused (FAILED).

Drain (with a ``drainer``, rayscale.cluster.ray_drain): ``drain_gang`` drains the Ray nodes of the gang's
worker pods, found by pod IP in the driven cluster's GCS, cordons its Nodes (``spec.unschedulable``, as
``kubectl drain`` does first) and marks its claims ``rayscale.io/draining``; the gang reports ``draining``
from then on (every pass keeps its Nodes cordoned), Serve moves its replicas off, and the step releases it.
A drained raylet exits once idle; its pod (``restartPolicy: Never``, rayscale.cluster.render) is not
restarted in place, and the one KubeRay creates in its place stays Pending on the cordoned Nodes until the
release names it in ``workersToDelete``.

Down: ``delete_gang`` (after Serve drained it) marks the claims; then the claims and Nodes lose
``do-not-disrupt`` and the Nodes the admission label; the worker group's replicas are lowered and
``scaleStrategy.workersToDelete`` names exactly the pods on the gang's Nodes, in one write (never while
an earlier list is pending, as KubeRay asks); once those pods are gone the list is cleared, and only
then the NodeClaims are deleted (Karpenter's finalizer drains and terminates the instances).

RayService (``rayservice`` set; rules and upstream files in ``rayscale.cluster.kube.rayservice`` and
docs/design.md, "KubeRay and rayscale"): KubeRay names the RayService's clusters itself
(``<rayservice>-<suffix>``). Each pass reads the RayService and drives the cluster its
``status.activeServiceStatus.rayClusterName`` names (``pendingServiceStatus`` only while there is no
active one, as on first deploy); the gangs it creates carry ``rayscale.io/raycluster``. After each
pass the RayService's worker-group ``replicas`` are those of the driven cluster, and
``sync_serve_targets`` writes Serve's replica targets into ``serveConfigV2``, so KubeRay's in-place
rebuilds and re-submissions keep them. During an upgrade (an active and a pending cluster) every live
gang of the active cluster gets a twin for the pending one (same model, flavor, zone, capacity type
and instance type, and gang slot; ``rayscale.io/twin-of``), whose Nodes the pending cluster's worker
groups are sized to; twins are not reported to the controller. A twin that fails is released and made
again only ``twin_backoff_s`` later (its zone backed off, as decide() does). ``sync_serve_targets`` also
sets every Serve target (zeros included, which ``serveConfigV2`` cannot carry) on a pending cluster
through that cluster's dashboard (``cluster_dashboard``), as nobody else scales it. KubeRay moves
traffic once the pending cluster serves every target; from then on the twins are the controller's
gangs, and the old cluster's gangs are released once KubeRay deleted that cluster's pods. When no cluster is named, or the RayService is
missing, the pass raises ``KubeError`` (and says why in ``last_errors``): no view, no decision.
"""

from __future__ import annotations

import json
import logging
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx

from rayscale.extras import missing_extra

try:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
except ImportError as e:
    raise missing_extra("kube", "the Kubernetes actuator") from e

from rayscale.cluster.actuator import (
    LABEL_CAPACITY,
    LABEL_CREATED,
    LABEL_FLAVOR_KEY,
    LABEL_GANG,
    LABEL_MODEL,
    LABEL_OWNER,
    LABEL_SIZE,
    LABEL_ZONE,
    OWNER,
)
from rayscale.cluster.kube.client import KubeError, RetryPolicy, call
from rayscale.cluster.kube.limits import exceeded, pool_usage, shape_of
from rayscale.cluster.kube.naming import (
    ANN_COMPLETE,
    ANN_DELETING,
    ANN_DO_NOT_DISRUPT,
    ANN_DRAINING,
    ANN_PHASE_SINCE,
    L_CAPACITY_TYPE,
    L_INSTANCE_TYPE,
    L_ZONE,
    LABEL_MEMBER,
    LABEL_NODEPOOL,
    LABEL_RAY_WORKER,
    claim_name,
    nodeclass_name,
    nodepool_name,
    worker_group_name,
)
from rayscale.cluster.kube.rayservice import (
    LABEL_RAYCLUSTER,
    LABEL_TWIN_OF,
    ServiceClusters,
    TwinBackoff,
    mirror_replicas,
    twin_name,
    with_serve_targets,
)
from rayscale.cluster.kube.slots import slot_flavor, slot_group_name
from rayscale.cluster.ray_drain import Drainer
from rayscale.controller.serve_client import ServeClient, ServeClientError
from rayscale.core.act import CreateGang, Gang, GangPhase
from rayscale.core.catalog import Catalog
from rayscale.serve.config import LABEL_GANG_SLOT

log = logging.getLogger(__name__)
Obj = dict[str, Any]
KARPENTER = ("karpenter.sh", "v1", "nodeclaims")
NODEPOOLS = ("karpenter.sh", "v1", "nodepools")
RAY = ("ray.io", "v1")
OWNED = f"{LABEL_OWNER}={OWNER}"


@dataclass(frozen=True)
class KubeActuatorConfig:
    namespace: str = "rayscale"
    raycluster: str = "rayscale"
    # A KubeRay RayService owning the RayCluster: its current cluster is read from its status each pass
    # (then ``raycluster`` is not used).
    rayservice: str | None = None
    node_class_group: str = "karpenter.k8s.aws"
    node_class_kind: str = "EC2NodeClass"
    # A member not Initialized this long after the gang was created fails the gang (x node_startup_s).
    init_timeout_factor: float = 3.0
    init_timeout_s: dict[str, float] = field(default_factory=dict)  # per flavor, overrides the factor
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    conflict_retries: int = 4
    # Where Karpenter's Events on NodeClaims land: client-go's recorder puts Events about cluster-scoped
    # objects in the default namespace.
    events_namespace: str = "default"
    # A twin gang for a pending cluster that failed is made again only this long after (in its
    # (flavor, zone, capacity type)), as decide() backs off a failed gang's zone (ActSettings.backoff_s).
    twin_backoff_s: float = 300.0
    # The Ray dashboard of a RayCluster, ``{cluster}`` and ``{namespace}`` filled in: KubeRay's head
    # Service of that cluster (utils.GenerateHeadServiceName / GenerateFQDNServiceName in
    # ray-operator/controllers/ray/utils/util.go; KubeRay reaches a pending cluster's dashboard so too).
    # The actuator sets a pending cluster's Serve targets there (``sync_serve_targets``).
    cluster_dashboard: str = "http://{cluster}-head-svc.{namespace}.svc.cluster.local:8265"
    # Bounded per request: an unanswering pending cluster must not stall the controller's period.
    dashboard_timeout_s: float = 5.0


def _cond(obj: Obj, type_: str) -> Obj | None:
    for c in (obj.get("status") or {}).get("conditions") or ():
        if c.get("type") == type_:
            return dict(c)
    return None


def _is_true(obj: Obj, type_: str) -> bool:
    c = _cond(obj, type_)
    return c is not None and c.get("status") == "True"


def _labels(obj: Obj) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("labels") or {})


def _annotations(obj: Obj) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("annotations") or {})


def _zone_key(labels: dict[str, str]) -> tuple[str, str, str]:
    """(flavor, zone, capacity type) of a gang, the key decide() backs off."""
    return (labels.get(LABEL_FLAVOR_KEY, ""), labels.get(LABEL_ZONE, ""), labels.get(LABEL_CAPACITY, "on-demand"))


def _running(pod: Obj) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Running" and _is_true(pod, "Ready")


@dataclass
class _GroupSync:
    """One cluster's worker groups after a pass: replicas, and whether a workersToDelete list is pending."""

    replicas: dict[str, int] = field(default_factory=dict)
    deleting: dict[str, bool] = field(default_factory=dict)


@dataclass
class _View:
    """One gang as read from the cluster in this pass."""

    name: str
    claims: dict[int, Obj]
    nodes: dict[int, Obj]  # member index -> Node, for members that registered
    labels: dict[str, str]
    instance_type: str
    deleting: bool
    complete: bool
    reason: str = ""
    refused: str = ""  # create_gang did not create it (a NodePool limit): FAILED with this reason

    @property
    def size(self) -> int:
        return int(self.labels.get(LABEL_SIZE, "1"))

    @property
    def slot(self) -> int | None:
        """Its gang slot (rayscale.cluster.kube.slots); None for a gang of a single-node flavor."""
        value = self.labels.get(LABEL_GANG_SLOT, "")
        return int(value) if value.isdigit() else None

    @property
    def group(self) -> str:
        flavor = self.labels.get(LABEL_FLAVOR_KEY, "")
        if self.slot is not None:
            return slot_group_name(flavor, self.instance_type, self.labels.get(LABEL_MODEL, ""), self.slot)
        return worker_group_name(flavor, self.instance_type)

    def node_names(self) -> set[str]:
        return {n["metadata"]["name"] for n in self.nodes.values()}

    def admitted(self) -> list[str]:
        return sorted(n["metadata"]["name"] for n in self.nodes.values()
                      if _labels(n).get(LABEL_RAY_WORKER) == "true")


class KubeActuator:
    """The Actuator protocol over the official ``kubernetes`` client (see the module docstring)."""

    # Draining needs the driven cluster's GCS (``drainer``, rayscale.cluster.ray_drain.GcsDrainer). Without
    # one the step never moves serving gangs through this provider: deleting a claim evicts its Ray pod,
    # which kills the replica's in-flight requests (spot that counts for nothing stays until a scale-down
    # or an interruption takes it).
    can_drain = False

    def __init__(self, catalog: Catalog, api_client: Any, config: KubeActuatorConfig | None = None,
                 *, seed: int | None = None, drainer: Drainer | None = None) -> None:
        self.catalog = catalog
        self.drainer = drainer
        self.can_drain = drainer is not None
        self.config = config or KubeActuatorConfig()
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self._rng = random.Random(seed)
        # Memory that only improves reports; a restarted actuator works without it.
        self._created: dict[str, CreateGang] = {}  # gangs this process created, to see all members vanish
        self._created_s: dict[str, float] = {}
        self._refused: dict[str, tuple[CreateGang, str]] = {}  # gang -> (action, why it was not created)
        self._events: dict[str, str] | None = None  # claim -> Karpenter's last Event on it, read once a pass
        self._clusters: ServiceClusters | None = None  # what the RayService named at the last read
        # gang -> the labels beyond its action's that it was created with (cluster, twin, slot), so that
        # a gang whose every claim vanished is still seen with them
        self._extra: dict[str, dict[str, str]] = {}
        self._twin_backoff = TwinBackoff(self.config.twin_backoff_s)
        self.last_errors: list[str] = []

    # --- API helpers ---------------------------------------------------------------------------------
    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return call(self.config.retry, fn, *args, rng=self._rng, **kwargs)

    def _raw(self, fn: Any, *args: Any, **kwargs: Any) -> Obj:
        resp = self._call(fn, *args, _preload_content=False, **kwargs)
        out: Obj = json.loads(resp.data)
        return out

    def _list_claims(self, selector: str = OWNED) -> list[Obj]:
        items: list[Obj] = self._raw(self.custom.list_cluster_custom_object, *KARPENTER,
                                     label_selector=selector)["items"]
        return items

    def _patch_claim(self, name: str, body: Obj) -> None:
        try:
            self._call(self.custom.patch_cluster_custom_object, *KARPENTER, name, body)
        except ApiException as e:
            if e.status != 404:
                raise

    def _patch_node(self, name: str, body: Obj) -> None:
        try:
            self._call(self.core.patch_node, name, body)
        except ApiException as e:
            if e.status != 404:
                raise

    def _delete_claim(self, name: str) -> None:
        try:
            self._call(self.custom.delete_cluster_custom_object, *KARPENTER, name)
        except ApiException as e:
            if e.status != 404:
                raise

    # --- NodeClaims ----------------------------------------------------------------------------------
    def nodeclaim(self, action: CreateGang, member: int, now: float, pool: Obj | None = None,
                  extra: dict[str, str] | None = None) -> Obj:
        """The NodeClaim for one member of a gang (also what render/tests validate); ``pool`` is its
        NodePool as read from the cluster, for the ownerReference; ``extra`` labels say which RayCluster
        the gang is for (RayService mode)."""
        fl = self.catalog.flavors[action.flavor]
        labels = {
            **(extra or {}),
            LABEL_OWNER: OWNER, LABEL_GANG: action.name, LABEL_MODEL: action.model,
            LABEL_FLAVOR_KEY: action.flavor, LABEL_CAPACITY: action.capacity_type, LABEL_ZONE: action.zone,
            LABEL_SIZE: str(action.nodes), LABEL_CREATED: f"{now:.3f}", LABEL_MEMBER: str(member),
            # Karpenter then manages it like its own: pool limits, timeouts, termination, interruption.
            LABEL_NODEPOOL: nodepool_name(fl),
        }
        spec: Obj = {
            "nodeClassRef": {"group": self.config.node_class_group, "kind": self.config.node_class_kind,
                             "name": nodeclass_name(fl)},
            "requirements": [
                {"key": L_INSTANCE_TYPE, "operator": "In", "values": [action.instance_type]},
                {"key": L_ZONE, "operator": "In", "values": [action.zone]},  # a gang is one zone
                {"key": L_CAPACITY_TYPE, "operator": "In", "values": [action.capacity_type]},
            ],
            "expireAfter": "Never",  # released by rayscale after a drain, never by age
        }
        devices = fl.instance(action.instance_type).devices
        if fl.resource_name != "cpu":
            spec["resources"] = {"requests": {fl.resource_name: str(devices)}}
        if fl.taints:
            spec["taints"] = [{"key": t.key, "effect": t.effect, **({"value": t.value} if t.value else {})}
                              for t in fl.taints]
        meta: Obj = {"name": claim_name(action.name, member), "labels": labels,
                     # A member waits for its siblings with no pod: without this, emptiness consolidation
                     # (consolidateAfter) may take it. Removed only when the gang is released.
                     "annotations": {ANN_DO_NOT_DISRUPT: "true"}}
        if pool is not None:
            # As Karpenter's own claims (nodeclaimtemplate.go): deleting the pool deletes the claim, and
            # NodePool health counts it. Not a controller reference: Karpenter does not reconcile it.
            meta["ownerReferences"] = [{"apiVersion": "karpenter.sh/v1", "kind": "NodePool",
                                        "name": pool["metadata"]["name"], "uid": pool["metadata"]["uid"],
                                        "blockOwnerDeletion": True}]
        return {"apiVersion": "karpenter.sh/v1", "kind": "NodeClaim", "metadata": meta, "spec": spec}

    def _nodepool(self, name: str) -> Obj | None:
        try:
            return self._raw(self.custom.get_cluster_custom_object, *NODEPOOLS, name)
        except ApiException as e:
            if e.status != 404:
                raise
            return None

    def _limit_error(self, action: CreateGang, pool: Obj) -> str:
        """Why creating this gang would take its NodePool past ``spec.limits`` ('' when it fits)."""
        limits = (pool.get("spec") or {}).get("limits") or {}
        if not limits:
            return ""
        name = pool["metadata"]["name"]
        usage = pool_usage(self._list_claims(f"{LABEL_NODEPOOL}={name}"), self.catalog)
        one = shape_of(self.catalog.flavors[action.flavor], action.instance_type)
        over = exceeded(limits, usage, {k: v * action.nodes for k, v in one.items()})
        return f"NodePool {name} limits: {'; '.join(over)}" if over else ""

    def _create_members(self, action: CreateGang, created_s: float, members: list[int],
                        pool: Obj | None, extra: dict[str, str] | None = None) -> None:
        if pool is None:
            self.last_errors.append(f"NodePool {nodepool_name(self.catalog.flavors[action.flavor])} not "
                                    f"found: gang {action.name}'s claims carry no ownerReference")
        for i in members:
            try:
                self._call(self.custom.create_cluster_custom_object, *KARPENTER,
                           self.nodeclaim(action, i, created_s, pool, extra))
            except ApiException as e:
                if e.status != 409:  # AlreadyExists: created before (a retry or a restart)
                    raise
        # Every member exists now: a member missing from here on was deleted, not never created.
        self._patch_claim(claim_name(action.name, 0), {"metadata": {"annotations": {ANN_COMPLETE: "true"}}})

    # --- Actuator ------------------------------------------------------------------------------------
    def create_gang(self, action: CreateGang, now: float) -> None:
        existing = self._list_claims(f"{OWNED},{LABEL_GANG}={action.name}")
        if any(ANN_DELETING in _annotations(c) or c["metadata"].get("deletionTimestamp") for c in existing):
            return  # an earlier gang of this name is still being released; decide() asks again later
        if existing:
            # Exists (a restart, a repeated action): reconcile completes any missing member. A gang of a
            # RayService's old cluster is released once that cluster is gone; decide() asks again then.
            return
        pool = self._nodepool(nodepool_name(self.catalog.flavors[action.flavor]))
        why = self._limit_error(action, pool) if pool is not None else ""
        slot, no_slot = self._free_slot(action)
        if why or no_slot:
            self._refused[action.name] = (action, why or no_slot)  # reported FAILED until delete_gang
            return
        self._created[action.name] = action
        self._created_s[action.name] = now
        extra = {LABEL_RAYCLUSTER: self._primary()} if self.config.rayservice else {}
        if slot is not None:
            # On its claims, so on its Nodes: the slot's worker group selects them (rayscale.cluster.kube.slots).
            extra[LABEL_GANG_SLOT] = str(slot)
        self._extra[action.name] = extra
        self._create_members(action, now, list(range(action.nodes)), pool, extra)

    def _free_slot(self, action: CreateGang) -> tuple[int | None, str]:
        """The gang slot for a new gang of a multi-node (model, flavor): the lowest that no other gang's
        claims hold, as LocalActuator gives them (released, twin and other clusters' gangs count: while
        their Nodes are listed, the slot's worker group selects them). (None, '') for a flavor without
        slots; (None, why) when every slot is held."""
        sf = slot_flavor(self.catalog, action.model, action.flavor)
        if sf is None:
            return None, ""
        held = set()
        for c in self._list_claims(f"{OWNED},{LABEL_MODEL}={action.model},{LABEL_FLAVOR_KEY}={action.flavor}"):
            lb = _labels(c)
            if lb.get(LABEL_GANG) != action.name and lb.get(LABEL_GANG_SLOT, "").isdigit():
                held.add(int(lb[LABEL_GANG_SLOT]))
        free = [k for k in range(sf.slots) if k not in held]
        if not free:
            return None, (f"every gang slot of {action.model} on {action.flavor} is held ({sf.slots} worker "
                          "groups rendered: one gang each)")
        return free[0], ""

    def delete_gang(self, name: str) -> None:
        self._created.pop(name, None)
        self._refused.pop(name, None)
        self._extra.pop(name, None)
        for c in self._list_claims(f"{OWNED},{LABEL_GANG}={name}"):
            if ANN_DELETING not in _annotations(c):
                self._patch_claim(c["metadata"]["name"], {"metadata": {"annotations": {ANN_DELETING: "true"}}})

    def drain_gang(self, name: str) -> None:
        """Drain the Ray nodes of the gang's worker pods (by pod IP) in the driven cluster's GCS, then mark
        its claims ``rayscale.io/draining``: every later pass, a restarted controller's too, reports it
        draining, and the step releases it once Serve moved its replicas. Raises when Ray was not asked
        (no worker pod, GCS unreachable): nothing is marked, and the next period's step asks again."""
        if self.drainer is None:
            raise NotImplementedError(f"KubeActuator cannot drain gang {name}: no drainer (can_drain is False)")
        claims = self._list_claims(f"{OWNED},{LABEL_GANG}={name}")
        nodes = {n["metadata"]["name"] for n in self._raw(self.core.list_node,
                                                         label_selector=f"{OWNED},{LABEL_GANG}={name}")["items"]}
        pods = self._raw(self.core.list_namespaced_pod, self.config.namespace,
                         label_selector="ray.io/node-type=worker")["items"]
        ips = sorted({ip for p in pods if (p.get("spec") or {}).get("nodeName") in nodes and _running(p)
                      and (ip := (p.get("status") or {}).get("podIP"))})
        if not claims or not ips:
            raise KubeError(f"gang {name}: no running Ray worker pod on its nodes to drain")
        cluster = _labels(claims[0]).get(LABEL_RAYCLUSTER) or (
            self._primary() if self.config.rayservice else self.config.raycluster)
        self.drainer.drain(cluster, ips, f"rayscale drain {name}")
        for node in sorted(nodes):
            self._patch_node(node, {"spec": {"unschedulable": True}})
        for c in claims:
            if ANN_DRAINING not in _annotations(c):
                self._patch_claim(c["metadata"]["name"], {"metadata": {"annotations": {ANN_DRAINING: "true"}}})

    def close(self) -> None:
        pass

    def gangs(self, now: float) -> list[Gang]:
        """Advance every gang one step and report them all. Raises KubeError if the API is unavailable:
        a period without a view decides nothing (never a half view that would double-create)."""
        try:
            return self._reconcile(now)
        except ApiException as e:
            raise KubeError(f"kubernetes API: {e.status} {e.reason}") from e

    # --- reconcile -----------------------------------------------------------------------------------
    def raycluster_name(self) -> str:
        """The RayCluster this pass drives: ``config.raycluster``, or the one the RayService names."""
        return self._service()[1].primary if self.config.rayservice else self.config.raycluster

    def _rayservice(self) -> Obj:
        """The RayService (KubeError when it is missing)."""
        cfg = self.config
        try:
            rs: Obj = self._raw(self.custom.get_namespaced_custom_object, *RAY, cfg.namespace, "rayservices",
                                cfg.rayservice)
            return rs
        except ApiException as e:
            if e.status != 404:
                raise
            self.last_errors = [f"RayService {cfg.namespace}/{cfg.rayservice} not found"]
            raise KubeError(self.last_errors[0]) from e

    def _service(self) -> tuple[Obj, ServiceClusters]:
        """The RayService and the clusters its status names; KubeError when it is missing or names none."""
        cfg = self.config
        where = f"RayService {cfg.namespace}/{cfg.rayservice}"
        rs = self._rayservice()
        clusters = ServiceClusters.of(rs)
        if not clusters.primary:
            self.last_errors = [f"{where} names no RayCluster yet (status.activeServiceStatus.rayClusterName and "
                                "status.pendingServiceStatus.rayClusterName are empty)"]
            raise KubeError(self.last_errors[0])
        self._clusters = clusters
        return rs, clusters

    def _primary(self) -> str:
        """The cluster a new gang is for: the one the last pass drove (read now before any pass)."""
        return (self._clusters or self._service()[1]).primary

    def _role(self, v: _View, where: ServiceClusters) -> str:
        """"own" (the driven cluster's: reported), "twin" (made for the pending cluster of an upgrade) or
        "retired" (for a cluster the RayService no longer names). Gangs made before clusters were
        recorded on them are the driven cluster's."""
        cluster = v.labels.get(LABEL_RAYCLUSTER, "")
        if not self.config.rayservice or not cluster or cluster == where.primary:
            return "own"
        return "twin" if cluster == where.upgrading else "retired"

    def _reconcile(self, now: float) -> list[Gang]:
        cfg = self.config
        self.last_errors = []
        rs, where = self._service() if cfg.rayservice else (None, ServiceClusters(cfg.raycluster))
        rc_name = where.primary
        claims = self._list_claims()
        nodes = {n["metadata"]["name"]: n for n in self._raw(self.core.list_node, label_selector=OWNED)["items"]}
        pods_of: dict[str, list[Obj]] = defaultdict(list)  # RayCluster -> its worker pods
        for p in self._raw(self.core.list_namespaced_pod, cfg.namespace,
                           label_selector="ray.io/node-type=worker")["items"]:
            pods_of[_labels(p).get("ray.io/cluster", "")].append(p)
        self._events = None
        views = self._views(claims, nodes)
        for name, action in list(self._created.items()):
            if name not in views:  # every member vanished: Karpenter deleted them (e.g. capacity error)
                views[name] = _View(name, {}, {}, self._labels_of(action), action.instance_type, False, True)
        for name, (action, why) in self._refused.items():
            views[name] = _View(name, {}, {}, self._labels_of(action), action.instance_type, False, True,
                                refused=why)
        for v in views.values():
            if v.deleting:
                self._teardown_nodes(v)
            else:
                self._advance(v, now)
        role = {name: self._role(v, where) for name, v in views.items()}
        if cfg.rayservice:
            for name, v in views.items():
                if role[name] == "own" and LABEL_RAYCLUSTER not in v.labels:
                    self._adopt(v, rc_name)
        by_role: dict[str, dict[str, _View]] = defaultdict(dict)
        for name, v in views.items():
            by_role[role[name]][name] = v
        synced = {rc_name: self._sync_groups(by_role["own"], pods_of[rc_name], rc_name)}
        if where.upgrading:
            self._mirror_gangs(by_role["own"], by_role["twin"], where.upgrading, now)
            synced[where.upgrading] = self._sync_groups(by_role["twin"], pods_of[where.upgrading], where.upgrading)
        pods_on: dict[str, int] = defaultdict(int)
        for p in (p for ps in pods_of.values() for p in ps):
            pods_on[(p.get("spec") or {}).get("nodeName") or ""] += 1
        self._retire(by_role["retired"], pods_on)
        if rs is not None and mirror_replicas(rs, synced[rc_name].replicas, synced[rc_name].deleting):
            self._update_rayservice(rs, "worker-group replicas")
        out = []
        for v in sorted(views.values(), key=lambda v: v.name):
            if v.deleting:
                busy = any(pods_on.get(n) for n in v.node_names())
                group = synced.get(v.labels.get(LABEL_RAYCLUSTER) or rc_name, _GroupSync())
                if not busy and not group.deleting.get(v.group):
                    for c in v.claims.values():
                        if not c["metadata"].get("deletionTimestamp"):
                            self._delete_claim(c["metadata"]["name"])
                if not v.claims and v.name in self._created:
                    self._created.pop(v.name, None)
                    self._extra.pop(v.name, None)
                continue  # a gang being released is no longer the controller's to count
            if role[v.name] == "own":
                out.append(self._report(v, pods_of[rc_name], now))
        return out

    # --- RayService: upgrades and what KubeRay rebuilds from (rayscale.cluster.kube.rayservice) -------
    def _mirror_gangs(self, own: dict[str, _View], twins: dict[str, _View], cluster: str, now: float) -> None:
        """During an upgrade: a twin on the pending ``cluster`` for every live gang of the active one; a
        twin whose gang went, or that failed, is released. A failed one is made again once its claims
        are gone and its (flavor, zone, capacity type) is no longer backed off (``twin_backoff_s``)."""
        sources = {n: v for n, v in own.items() if not v.deleting and not v.reason}
        have = {v.labels.get(LABEL_TWIN_OF, ""): v for v in twins.values()}
        for t in twins.values():
            if not t.deleting and (t.labels.get(LABEL_TWIN_OF) not in sources or t.reason):
                if t.reason:
                    self._twin_backoff.fail(_zone_key(t.labels), now)
                self.delete_gang(t.name)
        for name, src in sorted(sources.items()):
            if name in have:
                continue
            lb = src.labels
            until = self._twin_backoff.until_s(_zone_key(lb), now)
            if until is not None:  # the upgrade waits, as decide() waits out a failed zone
                self.last_errors.append(f"twin of {name} for {cluster}: {_zone_key(lb)} backed off until {until:.0f}")
                continue
            action = CreateGang(twin_name(name, LABEL_TWIN_OF in lb, cluster), lb.get(LABEL_MODEL, ""),
                                lb.get(LABEL_FLAVOR_KEY, ""), lb.get(LABEL_CAPACITY, "on-demand"),
                                lb.get(LABEL_ZONE, ""), src.instance_type, src.size,
                                f"stands in for {name} on {cluster}")
            pool = self._nodepool(nodepool_name(self.catalog.flavors[action.flavor]))
            why = self._limit_error(action, pool) if pool is not None else ""
            if why:  # the upgrade waits: KubeRay moves traffic only once the pending cluster serves
                self.last_errors.append(f"twin {action.name} of {name} for {cluster} not created: {why}")
                continue
            # The source's slot: the pending cluster's slot deployment k runs on the twin of slot k's gang.
            extra = {LABEL_RAYCLUSTER: cluster, LABEL_TWIN_OF: name,
                     **({LABEL_GANG_SLOT: lb[LABEL_GANG_SLOT]} if LABEL_GANG_SLOT in lb else {})}
            # Remembered like create_gang's: a twin whose every claim Karpenter deleted shows as failed.
            self._created[action.name], self._created_s[action.name] = action, now
            self._extra[action.name] = extra
            self._create_members(action, now, list(range(action.nodes)), pool, extra)

    def _adopt(self, v: _View, cluster: str) -> None:
        """Record the cluster on a gang made before clusters were recorded (or in RayCluster mode), so
        that after the next cut-over it is released with its cluster instead of counted twice."""
        for c in v.claims.values():
            self._patch_claim(c["metadata"]["name"], {"metadata": {"labels": {LABEL_RAYCLUSTER: cluster}}})
        v.labels[LABEL_RAYCLUSTER] = cluster

    def _retire(self, retired: dict[str, _View], pods_on: dict[str, int]) -> None:
        """Gangs of a cluster the RayService no longer names: released once no pod runs on them (KubeRay
        deletes the old cluster ``rayClusterDeletionDelaySeconds`` after the cut-over)."""
        for v in retired.values():
            self._created.pop(v.name, None)  # no longer the controller's: never reported as vanished
            if not v.deleting and not any(pods_on.get(n) for n in v.node_names()):
                self.delete_gang(v.name)

    def _update_rayservice(self, rs: Obj, what: str) -> bool:
        """Write the RayService back on the version read; a conflict leaves it to the next pass."""
        try:
            self._call(self.custom.replace_namespaced_custom_object, *RAY, self.config.namespace,
                       "rayservices", rs["metadata"]["name"], rs)
            return True
        except ApiException as e:
            if e.status != 409:
                raise
            self.last_errors.append(f"RayService changed while writing its {what}: written next time")
            return False

    def serve_dashboard(self) -> str | None:
        """With a RayService: the dashboard of the cluster the last pass drove (``cluster_dashboard``), KubeRay's
        head Service of that RayCluster, which exists from the cluster's creation on (the RayService's own
        Service only once a cluster serves: reconcileServicesToReadyCluster in rayservice_controller.go)."""
        if not self.config.rayservice or self._clusters is None or not self._clusters.primary:
            return None
        return self.config.cluster_dashboard.format(cluster=self._clusters.primary, namespace=self.config.namespace)

    def sync_serve_targets(self, targets: dict[str, dict[str, int]]) -> list[str]:
        """Serve's replica targets (application -> deployment -> replicas, zeros included) into the
        RayService's ``serveConfigV2``, so that KubeRay's re-submissions keep them and a pending cluster
        asks for all of them before it takes traffic; and onto a pending cluster's Serve through its
        dashboard (``_scale_pending``). Errors as text (the next period writes again)."""
        if not self.config.rayservice:
            return []
        errors, clusters = self._write_serve_targets(targets)
        if clusters is not None and clusters.pending:
            errors += self._scale_pending(clusters.pending, targets)
        return errors

    def _write_serve_targets(self, targets: dict[str, dict[str, int]]) -> tuple[list[str], ServiceClusters | None]:
        """``targets`` into ``serveConfigV2``; the errors, and the clusters the RayService names."""
        clusters = None
        try:
            for _ in range(self.config.conflict_retries):
                rs = self._rayservice()
                clusters = ServiceClusters.of(rs)
                spec = rs.setdefault("spec", {})
                text = with_serve_targets(str(spec.get("serveConfigV2") or ""), targets)
                if text is None:
                    return [], clusters
                spec["serveConfigV2"] = text
                if self._update_rayservice(rs, "serveConfigV2"):
                    return [], clusters
            return list(self.last_errors[-1:]), clusters
        except (ApiException, KubeError) as e:
            return [f"writing serve targets into the RayService: {e}"], clusters

    def _scale_pending(self, cluster: str, targets: dict[str, dict[str, int]]) -> list[str]:
        """Set every target on the pending ``cluster``'s Serve through its dashboard's external scaler
        (only those that differ there).

        A deployment at 0 cannot be in ``serveConfigV2`` (Ray's DeploymentSchema: num_replicas >= 1), so
        the pending cluster deploys it at the application's own count (>= 1) and, with no node for that
        replica (twins follow the active cluster's gangs only), its application stays DEPLOYING; KubeRay
        moves traffic only once every application is RUNNING (``getAndCheckServeStatus``), so without this
        the upgrade never completes. During an upgrade the controller's own ServeClient follows the active
        cluster (``serve_dashboard``): nobody else scales the pending one. On a first deploy the pending
        cluster is the driven one, which the controller scales too; reading first, this then sets nothing.
        Until Serve there has the application (head starting: connection refused; config not applied
        yet: 404/412/503), the error is returned and the next period tries again."""
        url = self.config.cluster_dashboard.format(cluster=cluster, namespace=self.config.namespace)
        where = f"Serve targets on pending cluster {cluster} ({url})"
        try:
            serve = ServeClient(url, timeout_s=self.config.dashboard_timeout_s)
        except ServeClientError as e:  # a Ray token configured but unreadable
            return [f"{where}: {e}"]
        errors: list[str] = []
        try:
            have = serve.deployment_targets()
            for app, deps in sorted(targets.items()):
                if not any(a == app for a, _ in have):
                    errors.append(f"{where}: application {app} not deployed there yet")
                    continue
                for dep, n in sorted(deps.items()):
                    # A deployment the application there does not build has no target to set.
                    if (app, dep) in have and have[(app, dep)] != n:
                        serve.scale_deployment(app, dep, n)
        except (ServeClientError, httpx.HTTPError) as e:
            errors.append(f"{where}: {e}")
        finally:
            serve.close()
        return errors

    def _labels_of(self, a: CreateGang) -> dict[str, str]:
        created = self._created_s.get(a.name)
        return {**self._extra.get(a.name, {}), LABEL_GANG: a.name, LABEL_MODEL: a.model, LABEL_FLAVOR_KEY: a.flavor,
                LABEL_CAPACITY: a.capacity_type, LABEL_ZONE: a.zone, LABEL_SIZE: str(a.nodes),
                **({LABEL_CREATED: f"{created:.3f}"} if created is not None else {})}

    def _views(self, claims: list[Obj], nodes: dict[str, Obj]) -> dict[str, _View]:
        by_gang: dict[str, dict[int, Obj]] = defaultdict(dict)
        for c in claims:
            lb = _labels(c)
            if LABEL_GANG in lb and LABEL_MEMBER in lb:
                by_gang[lb[LABEL_GANG]][int(lb[LABEL_MEMBER])] = c
        views = {}
        for gang, members in by_gang.items():
            first = members[min(members)]
            itype = next((r["values"][0] for r in first["spec"].get("requirements") or ()
                          if r.get("key") == L_INSTANCE_TYPE and r.get("values")), "")
            member_nodes = {}
            for i, c in members.items():
                node = nodes.get((c.get("status") or {}).get("nodeName") or "")
                if node is not None:
                    member_nodes[i] = node
            views[gang] = _View(
                gang, members, member_nodes, _labels(first), itype,
                deleting=any(ANN_DELETING in _annotations(c) for c in members.values()),
                complete=(0 in members and ANN_COMPLETE in _annotations(members[0])) or 0 not in members,
            )
        return views

    def _failure(self, v: _View, now: float) -> str:
        if v.refused:
            return v.refused
        missing = [i for i in range(v.size) if i not in v.claims]
        deleting = [c["metadata"]["name"] for _i, c in sorted(v.claims.items())
                    if c["metadata"].get("deletionTimestamp")]
        gone = [claim_name(v.name, i) for i in missing] if v.complete else []
        if deleting or gone:
            names = deleting + gone
            whys = "; ".join(w for w in (self._why(n) for n in names) if w)
            # Liveness, expiry, consolidation and interruption deletes publish no Event on the claim.
            return (f"member(s) {', '.join(names)} deleted by Karpenter: "
                    + (whys or "no Event (launch/registration timeout, expiry, disruption or interruption)"))
        flavor = v.labels.get(LABEL_FLAVOR_KEY, "")
        timeout = self.config.init_timeout_s.get(flavor)
        if timeout is None and flavor in self.catalog.flavors:
            timeout = self.config.init_timeout_factor * self.catalog.flavors[flavor].node_startup_s
        created = float(v.labels.get(LABEL_CREATED, now))
        slow = [c["metadata"]["name"] for c in v.claims.values() if not _is_true(c, "Initialized")]
        if timeout is not None and slow and now - created > timeout:
            return f"member(s) {', '.join(slow)} not Initialized after {now - created:.0f}s"
        return ""

    def _why(self, claim: str) -> str:
        """Karpenter's latest Warning Event on ``claim`` ("reason: message"), read once a pass and only
        when a member is gone (launch.go publishes InsufficientCapacityError before deleting it)."""
        if self._events is None:
            self._events = {}
            try:
                events = self._raw(self.core.list_namespaced_event, self.config.events_namespace,
                                   field_selector="involvedObject.kind=NodeClaim")["items"]
            except ApiException as e:  # the failure stands without its reason
                self.last_errors.append(f"reading NodeClaim Events: {e.status} {e.reason}")
                events = []
            for ev in sorted(events, key=lambda ev: (ev.get("lastTimestamp") or "", ev["metadata"]["name"])):
                if ev.get("type") == "Warning":
                    name = (ev.get("involvedObject") or {}).get("name", "")
                    self._events[name] = f"{ev.get('reason', '')}: {ev.get('message', '')}"
        return self._events.get(claim, "")

    def _protect(self, v: _View) -> None:
        """Keep ``karpenter.sh/do-not-disrupt`` on every claim and registered Node of a live gang."""
        for c in v.claims.values():
            if _annotations(c).get(ANN_DO_NOT_DISRUPT) != "true" and not c["metadata"].get("deletionTimestamp"):
                self._patch_claim(c["metadata"]["name"], {"metadata": {"annotations": {ANN_DO_NOT_DISRUPT: "true"}}})
        for n in v.nodes.values():
            if _annotations(n).get(ANN_DO_NOT_DISRUPT) != "true" and not n["metadata"].get("deletionTimestamp"):
                self._patch_node(n["metadata"]["name"], {"metadata": {"annotations": {ANN_DO_NOT_DISRUPT: "true"}}})

    def _cordon_drained(self, v: _View) -> None:
        """Keep a draining gang's Nodes unschedulable: no Ray worker pod may start on them again."""
        if not any(ANN_DRAINING in _annotations(c) for c in v.claims.values()):
            return
        for n in v.nodes.values():
            if not (n.get("spec") or {}).get("unschedulable") and not n["metadata"].get("deletionTimestamp"):
                self._patch_node(n["metadata"]["name"], {"spec": {"unschedulable": True}})

    def _advance(self, v: _View, now: float) -> None:
        self._protect(v)
        self._cordon_drained(v)
        v.reason = self._failure(v, now)
        if v.reason:
            return  # the controller deletes it whole; nothing more to build
        if not v.complete and 0 in v.claims:
            # A crash between creates: finish the gang as it was asked (labels and spec of member 0).
            missing = [i for i in range(v.size) if i not in v.claims]
            lb = v.labels
            action = CreateGang(v.name, lb.get(LABEL_MODEL, ""), lb.get(LABEL_FLAVOR_KEY, ""),
                                lb.get(LABEL_CAPACITY, "on-demand"), lb.get(LABEL_ZONE, ""), v.instance_type,
                                v.size, "resume after restart")
            pool = self._nodepool(nodepool_name(self.catalog.flavors[action.flavor]))
            extra = {k: lb[k] for k in (LABEL_RAYCLUSTER, LABEL_TWIN_OF, LABEL_GANG_SLOT) if k in lb}
            self._create_members(action, float(lb.get(LABEL_CREATED, now)), missing, pool, extra)
            v.complete = True
            return
        up = len(v.claims) == v.size and all(_is_true(c, "Initialized") for c in v.claims.values())
        if not up or len(v.nodes) != v.size:
            return
        for n in v.nodes.values():  # the whole gang is up: admit it to Ray in one pass
            if _labels(n).get(LABEL_RAY_WORKER) != "true":
                self._patch_node(n["metadata"]["name"], {"metadata": {"labels": {LABEL_RAY_WORKER: "true"}}})
                n["metadata"].setdefault("labels", {})[LABEL_RAY_WORKER] = "true"

    def _teardown_nodes(self, v: _View) -> None:
        for c in v.claims.values():
            ann = _annotations(c)
            if ANN_DELETING not in ann or ANN_DO_NOT_DISRUPT in ann:
                self._patch_claim(c["metadata"]["name"],
                                  {"metadata": {"annotations": {ANN_DELETING: "true", ANN_DO_NOT_DISRUPT: None}}})
        for n in v.nodes.values():
            if LABEL_RAY_WORKER in _labels(n) or ANN_DO_NOT_DISRUPT in _annotations(n):
                # No new Ray pod may land here, and Karpenter may now terminate it.
                self._patch_node(n["metadata"]["name"],
                                 {"metadata": {"labels": {LABEL_RAY_WORKER: None},
                                               "annotations": {ANN_DO_NOT_DISRUPT: None}}})
                n["metadata"].get("labels", {}).pop(LABEL_RAY_WORKER, None)

    def _sync_groups(self, views: dict[str, _View], pods: list[Obj], rc_name: str) -> _GroupSync:
        """Worker-group replicas = admitted Nodes of live gangs; surplus pods named in workersToDelete.

        Returns each group's replicas and whether a workersToDelete list is still pending after this pass."""
        admitted: dict[str, set[str]] = defaultdict(set)
        for v in views.values():
            if not v.deleting:
                admitted[v.group] |= set(v.admitted())
        for attempt in range(self.config.conflict_retries):
            try:
                rc = self._raw(self.custom.get_namespaced_custom_object, *RAY, self.config.namespace,
                               "rayclusters", rc_name)
            except ApiException as e:
                if e.status == 404:
                    self.last_errors.append(f"RayCluster {self.config.namespace}/{rc_name} not found")
                    return _GroupSync()
                raise
            if attempt == 0:
                self._missing_groups(rc, rc_name, admitted)
            pending, changed = self._plan_groups(rc, admitted, pods)
            synced = _GroupSync({g["groupName"]: int(g.get("replicas") or 0)
                                 for g in (rc.get("spec") or {}).get("workerGroupSpecs") or []}, pending)
            if not changed:
                return synced
            try:
                self._call(self.custom.replace_namespaced_custom_object, *RAY, self.config.namespace,
                           "rayclusters", rc_name, rc)
                return synced
            except ApiException as e:
                if e.status != 409 or attempt == self.config.conflict_retries - 1:
                    raise
                log.debug("RayCluster changed under us; re-reading")  # resourceVersion moved: decide again
        return _GroupSync()

    def _missing_groups(self, rc: Obj, rc_name: str, admitted: dict[str, set[str]]) -> None:
        """Say so when admitted gangs have no worker group (a RayCluster rendered from another catalog,
        or without a gang slot's group): no Ray worker would ever run on their Nodes."""
        have = {g.get("groupName") for g in (rc.get("spec") or {}).get("workerGroupSpecs") or []}
        for gname in sorted(g for g, nodes in admitted.items() if nodes and g not in have):
            self.last_errors.append(f"RayCluster {rc_name} has no worker group {gname}: its gangs' Nodes get "
                                    "no Ray worker (render the manifests from this catalog)")

    @staticmethod
    def _plan_groups(rc: Obj, admitted: dict[str, set[str]], pods: list[Obj]) -> tuple[dict[str, bool], bool]:
        existing = {p["metadata"]["name"] for p in pods}
        pending: dict[str, bool] = {}
        changed = False
        for g in (rc.get("spec") or {}).get("workerGroupSpecs") or []:
            gname = g["groupName"]
            mine = admitted.get(gname, set())
            want = len(mine)
            live = [p for p in pods if _labels(p).get("ray.io/group") == gname
                    and not p["metadata"].get("deletionTimestamp")]
            cur_r = int(g.get("replicas") or 0)
            w = list((g.get("scaleStrategy") or {}).get("workersToDelete") or [])
            if any(n in existing for n in w):
                # KubeRay's rule: no new deletes while earlier ones are pending; raising is safe.
                new_r, new_w = max(cur_r, want), w
            else:
                surplus = len(live) - want
                new_w = []
                if surplus > 0:
                    # Never a pod on an admitted Node: pods of released gangs first, then unbound ones.
                    extra = sorted((p for p in live if (p.get("spec") or {}).get("nodeName") not in mine),
                                   key=lambda p: (not (p.get("spec") or {}).get("nodeName"), p["metadata"]["name"]))
                    new_w = [p["metadata"]["name"] for p in extra[:surplus]]
                    new_r = len(live) - len(new_w)
                else:
                    new_r = want
            pending[gname] = any(n in existing for n in new_w)
            if new_r != cur_r or new_w != w:
                g["replicas"] = new_r
                g.setdefault("scaleStrategy", {})["workersToDelete"] = new_w
                changed = True
        return pending, changed

    def _report(self, v: _View, pods: list[Obj], now: float) -> Gang:
        lb = v.labels
        phase, reason = GangPhase.PENDING, v.reason
        node_ids: tuple[str, ...] = ()
        if reason:
            phase = GangPhase.FAILED
        else:
            admitted = v.admitted()
            running = {(p.get("spec") or {}).get("nodeName") for p in pods
                       if _labels(p).get("ray.io/group") == v.group and _running(p)}
            if len(admitted) == v.size and all(n in running for n in admitted):
                # Node names, plus the worker pods' IPs: Serve reports a replica's Ray node by its IP,
                # which on Kubernetes is the pod's, so the controller can tell which gang serves.
                ips = sorted(f"ip:{(p.get('status') or {}).get('podIP')}" for p in pods
                             if _labels(p).get("ray.io/group") == v.group and _running(p)
                             and (p.get("spec") or {}).get("nodeName") in admitted
                             and (p.get("status") or {}).get("podIP"))
                phase, node_ids = GangPhase.READY, (*admitted, *ips)
            elif admitted:
                reason = "waiting for Ray worker pods on its nodes"
            else:
                reason = f"{sum(_is_true(c, 'Initialized') for c in v.claims.values())}/{v.size} nodes initialized"
        return Gang(v.name, lb.get(LABEL_MODEL, ""), lb.get(LABEL_FLAVOR_KEY, ""),
                    lb.get(LABEL_CAPACITY, "on-demand"), lb.get(LABEL_ZONE, ""), v.instance_type, v.size, phase,
                    float(lb.get(LABEL_CREATED, now)), reason=reason, node_ids=node_ids,
                    since_s=self._phase_since(v, phase, now), slot=v.slot,
                    draining=any(ANN_DRAINING in _annotations(c) for c in v.claims.values()))

    def _phase_since(self, v: _View, phase: GangPhase, now: float) -> float | None:
        """When the gang entered ``phase``, kept on member 0 from its first READY on (None: since creation).

        Written at each transition only, in the controller's clock like created-at."""
        first = v.claims.get(0)
        if first is None or phase == GangPhase.FAILED:
            return None
        was, _, at = (_annotations(first).get(ANN_PHASE_SINCE) or "").partition("@")
        if was == phase.value:
            try:
                return float(at)
            except ValueError:
                pass  # unreadable: write it again
        elif not was and phase == GangPhase.PENDING:
            return None  # never ready yet: its launch timeout runs from creation
        self._patch_claim(first["metadata"]["name"],
                          {"metadata": {"annotations": {ANN_PHASE_SINCE: f"{phase.value}@{now:.3f}"}}})
        return now


__all__ = ["KubeActuator", "KubeActuatorConfig", "KubeError"]
