"""A KubeRay RayService stand-in: which RayCluster serves, how upgrades replace it, when Serve is re-submitted.

Modelled on ray-project/kuberay ``ray-operator/controllers/ray/rayservice_controller.go`` (at feeaf72f),
blue/green (``upgradeStrategy.type: NewCluster``, the default; ``None`` turns upgrades off). Incremental
upgrades, rollback, Gateway routes, suspend and the initializing timeout are not modelled. Each pass,
per RayService (``Reconcile``):

- the Serve config cache forgets clusters neither active nor pending (``cleanUpServeConfigCache``);
  dangling clusters (labelled as this RayService's but neither active nor pending) are deleted
  ``rayClusterDeletionDelaySeconds`` (default 60 s) after first seen (``cleanUpRayClusterInstance``);
- a pending cluster named in the status but missing is created from ``rayClusterConfig``
  (``reconcileRayCluster``, ``constructRayClusterForRayService``: the spec as written, so every
  worker group at its manifest ``replicas``; the hash, worker-group count and KubeRay version as
  annotations; an ownerReference to the RayService);
  the pass goes no further into the clusters after that create (``reconcileRayCluster`` returns);
- the active cluster is rebuilt in place from ``rayClusterConfig`` (``shouldUpdateCluster`` +
  ``modifyRayCluster``: replicas back to the RayService's, ``workersToDelete`` gone) when its KubeRay
  version annotation differs from this operator's (an operator upgrade), or when the spec differs only
  by worker groups appended at the end; never while the status read at the start of the pass has the
  ``UpgradeInProgress`` condition True (set by ``calculateConditions`` when both an active and a
  pending cluster are named);
- any other change of the spec's hash (``utils.GenerateHashWithoutReplicasAndWorkersToDelete`` in
  ``utils/util.go``: replicas, min/max replicas, ``workersToDelete``, tolerations and scheduling gates
  do not count) names a new pending cluster ``<rayservice>-<5 random>`` (``shouldPrepareNewCluster``,
  ``utils.GenerateRayClusterName``);
- Serve: on the pending cluster, else on the active one when no new cluster is due, once the head pod
  is running and ready, ``serveConfigV2`` is submitted when this operator's cache for that cluster is
  empty (a new cluster, or an operator restart), when the cluster reports no applications, or when
  the config changed (``reconcileServe``, ``checkIfNeedSubmitServeApplications``); the cluster is ready
  when every application was RUNNING in the status read before that submission
  (``getAndCheckServeStatus``);
- promotion: a ready pending cluster becomes active, the pending status is cleared
  (``reconcilePromotionAndServingStatus``); the old active cluster is then dangling.

- status: ``UpgradeInProgress`` True while both an active and a pending cluster are named, False with
  an active one only (``calculateConditions``).

Serve itself is behind ``ServeBackend``: ``RecordedServe`` records submissions and reports the
submitted applications RUNNING (``ready[cluster] = False`` holds a cluster back); ``ServeModel`` keeps
each cluster's replica targets as Serve does (a submitted config sets every deployment it lists, the
external scaler sets one) and reports an application RUNNING only once every deployment's target fits
the capacity the test says the cluster has (Serve's ``ApplicationStatus``: DEPLOYING until the target
replicas run).
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import yaml

from rayscale_testing.kubeapi import ApiError, Store, now_rfc3339
from rayscale_testing.scheduler import Clock, StandIn

Obj = dict[str, Any]

# ray-operator/controllers/ray/utils/constant.go
L_ORIGIN_NAME = "ray.io/originated-from-cr-name"
L_ORIGIN_CRD = "ray.io/originated-from-crd"
A_HASH = "ray.io/hash-without-replicas-and-workers-to-delete"
A_NUM_GROUPS = "ray.io/num-worker-groups"
A_VERSION = "ray.io/kuberay-version"
DELETION_DELAY_S = 60.0  # RayClusterDeletionDelayDuration


class ServeBackend(Protocol):
    def submit(self, cluster: str, config: str) -> None: ...

    def applications(self, cluster: str) -> dict[str, str]:
        """Application name -> status (RUNNING, DEPLOYING, ...) as the cluster's dashboard reports it."""
        ...


@dataclass
class RecordedServe:
    submissions: list[tuple[str, str]] = field(default_factory=list)  # (cluster, serveConfigV2)
    ready: dict[str, bool] = field(default_factory=dict)

    def submit(self, cluster: str, config: str) -> None:
        self.submissions.append((cluster, config))

    def applications(self, cluster: str) -> dict[str, str]:
        configs = [c for name, c in self.submissions if name == cluster]
        if not configs:
            return {}
        status = "RUNNING" if self.ready.get(cluster, True) else "DEPLOYING"
        apps = (yaml.safe_load(configs[-1]) or {}).get("applications") or []
        return {a.get("name", ""): status for a in apps}


@dataclass
class ServeModel:
    """Ray Serve on each cluster, as far as KubeRay and rayscale see it through the dashboard.

    A submitted config (``PUT /api/serve/applications/``) replaces the cluster's applications and sets
    the target of every deployment it lists (``num_replicas``; 1 when absent, as for code that sets
    none); deployments it does not list are not modelled; the
    external scaler (``serve_head.py``) sets one target and answers 412 unless the application has
    ``external_scaler_enabled``. An application is RUNNING once every listed deployment's target fits
    ``capacity(cluster, deployment)`` (replicas that can run there now), DEPLOYING before."""

    capacity: Callable[[str, str], int]
    submissions: list[tuple[str, str]] = field(default_factory=list)  # (cluster, serveConfigV2)
    targets: dict[str, dict[tuple[str, str], int]] = field(default_factory=dict)  # cluster -> (app, dep) -> n
    scalable: dict[str, dict[str, bool]] = field(default_factory=dict)  # cluster -> app -> external scaler on

    def submit(self, cluster: str, config: str) -> None:
        self.submissions.append((cluster, config))
        apps = (yaml.safe_load(config) or {}).get("applications") or []
        self.scalable[cluster] = {a.get("name", ""): bool(a.get("external_scaler_enabled")) for a in apps}
        self.targets[cluster] = {(a.get("name", ""), d["name"]): int(d.get("num_replicas", 1))
                                 for a in apps for d in a.get("deployments") or []}

    def scale(self, cluster: str, app: str, deployment: str, replicas: int) -> None:
        if not self.scalable.get(cluster, {}).get(app):
            raise ValueError(f"412: application {app} on {cluster} has no external_scaler_enabled")
        self.targets[cluster][(app, deployment)] = replicas

    def target(self, cluster: str, app: str, deployment: str) -> int:
        return self.targets.get(cluster, {}).get((app, deployment), 0)

    def running(self, cluster: str, app: str, deployment: str) -> int:
        return min(self.target(cluster, app, deployment), self.capacity(cluster, deployment))

    def applications(self, cluster: str) -> dict[str, str]:
        out = {}
        for app in self.scalable.get(cluster, {}):
            fits = all(n <= self.capacity(cluster, dep)
                       for (a, dep), n in self.targets.get(cluster, {}).items() if a == app)
            out[app] = "RUNNING" if fits else "DEPLOYING"
        return out


def spec_hash(spec: Obj) -> str:
    """utils/util.go GenerateHashWithoutReplicasAndWorkersToDelete (a stable hash, not KubeRay's bytes)."""
    s = copy.deepcopy(spec)
    s.pop("suspend", None)  # rayClusterSpecForHashing
    s.pop("upgradeStrategy", None)
    head = ((s.get("headGroupSpec") or {}).get("template") or {}).get("spec") or {}
    head.pop("tolerations", None)
    head.pop("schedulingGates", None)
    for g in s.get("workerGroupSpecs") or []:
        for k in ("replicas", "minReplicas", "maxReplicas"):
            g.pop(k, None)
        (g.get("scaleStrategy") or {}).pop("workersToDelete", None)
        if not g.get("scaleStrategy"):
            g.pop("scaleStrategy", None)
        tspec = (g.get("template") or {}).get("spec") or {}
        tspec.pop("tolerations", None)
        tspec.pop("schedulingGates", None)
    return hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()[:16]


class RayServiceStandIn(StandIn):
    watched = ("rayservices", "rayclusters", "pods")

    def __init__(
        self,
        store: Store,
        serve: ServeBackend | None = None,
        *,
        version: str = "v1.5.0",
        head_ready: Callable[[Obj], bool] | None = None,
        clock: Clock | None = None,
        tick: float = 0.02,
        seed: int | None = 0,
    ) -> None:
        super().__init__(store, clock=clock, tick=tick)
        self.serve: ServeBackend = serve or RecordedServe()
        self.version = version
        self.head_ready = head_ready or self._head_pod_ready
        self._cache: dict[tuple[str, str], str] = {}  # (rayservice, cluster) -> submitted serveConfigV2
        self._dangling_since: dict[tuple[str, str], float] = {}
        self._rng = random.Random(seed)
        self.created: list[str] = []
        self.updated_in_place: list[str] = []

    def step(self) -> None:
        services, _ = self.store.list("rayservices")
        for rs in services:
            if not rs["metadata"].get("deletionTimestamp"):
                self._reconcile(rs)

    def _reconcile(self, rs: Obj) -> None:
        ns, name = rs["metadata"]["namespace"], rs["metadata"]["name"]
        status = copy.deepcopy(rs.get("status") or {})
        active_name = (status.get("activeServiceStatus") or {}).get("rayClusterName", "")
        pending_name = (status.get("pendingServiceStatus") or {}).get("rayClusterName", "")
        for key in [k for k in self._cache if k[0] == name and k[1] not in (active_name, pending_name)]:
            del self._cache[key]  # cleanUpServeConfigCache
        self._clean_up(rs, {active_name, pending_name})
        active, pending = self._reconcile_clusters(rs, active_name, pending_name,
                                                   _condition_true(status, "UpgradeInProgress"))
        pending_ready = pending is not None and self._reconcile_serve(rs, pending)
        if active is not None and pending is None and not self._should_prepare(rs, active, None):
            self._reconcile_serve(rs, active)
        if pending_ready:  # reconcilePromotionAndServingStatus: traffic switched, the pending is active
            status["activeServiceStatus"] = {"rayClusterName": pending_name}
            status["pendingServiceStatus"] = {}
        elif self._should_prepare(rs, active, pending):  # calculateStatus
            status["pendingServiceStatus"] = {"rayClusterName": f"{name}-{self._suffix()}"}
        status["conditions"] = _conditions(status)
        if status != (rs.get("status") or {}):
            # A merge patch: a cleared status ({}) is sent as null, or it would merge into the old one.
            patch = {k: (None if v == {} else v) for k, v in status.items()}
            self.store.patch("rayservices", name, {"status": patch}, ns, subresource="status")

    # -- clusters -----------------------------------------------------------------------------------

    def _reconcile_clusters(self, rs: Obj, active_name: str, pending_name: str,
                            upgrading: bool) -> tuple[Obj | None, Obj | None]:
        """reconcileRayCluster: create a named pending cluster (and stop there), else update in place."""
        ns = rs["metadata"]["namespace"]
        active, pending = self._get(ns, active_name), self._get(ns, pending_name)
        if pending_name and pending is None:
            return active, self._create(rs, pending_name)
        if active is not None and not upgrading and self._should_update(rs, active, is_active=True):
            self._update_in_place(rs, active)
        if pending is not None and self._should_update(rs, pending, is_active=False):
            self._update_in_place(rs, pending)
        return active, pending

    def _get(self, ns: str, name: str) -> Obj | None:
        return self.store.try_get("rayclusters", name, ns) if name else None

    def _suffix(self) -> str:
        return "".join(self._rng.choice(string.ascii_lowercase + string.digits) for _ in range(5))

    def _goal(self, rs: Obj, cluster_name: str) -> Obj:
        """constructRayClusterForRayService."""
        spec = copy.deepcopy((rs.get("spec") or {}).get("rayClusterConfig") or {})
        return {
            "apiVersion": "ray.io/v1",
            "kind": "RayCluster",
            "metadata": {
                "name": cluster_name,
                "namespace": rs["metadata"]["namespace"],
                "labels": {**(rs["metadata"].get("labels") or {}), L_ORIGIN_NAME: rs["metadata"]["name"],
                           L_ORIGIN_CRD: "RayService"},
                "annotations": {**(rs["metadata"].get("annotations") or {}), A_HASH: spec_hash(spec),
                                A_NUM_GROUPS: str(len(spec.get("workerGroupSpecs") or [])),
                                A_VERSION: self.version},
                "ownerReferences": [{"apiVersion": "ray.io/v1", "kind": "RayService", "name": rs["metadata"]["name"],
                                     "uid": rs["metadata"]["uid"], "controller": True,
                                     "blockOwnerDeletion": True}],
            },
            "spec": spec,
        }

    def _create(self, rs: Obj, cluster_name: str) -> Obj:
        self.created.append(cluster_name)
        return self.store.create("rayclusters", self._goal(rs, cluster_name), rs["metadata"]["namespace"])

    def _update_in_place(self, rs: Obj, cluster: Obj) -> None:
        """modifyRayCluster: spec, labels and annotations replaced from the RayService (suspend kept)."""
        goal = self._goal(rs, cluster["metadata"]["name"])
        new = copy.deepcopy(cluster)
        suspend = (cluster.get("spec") or {}).get("suspend")
        new["spec"] = goal["spec"]
        if suspend is not None:
            new["spec"]["suspend"] = suspend
        new["metadata"]["labels"] = goal["metadata"]["labels"]
        new["metadata"]["annotations"] = goal["metadata"]["annotations"]
        self.store.update("rayclusters", new)
        self.updated_in_place.append(cluster["metadata"]["name"])

    def _hash_equal(self, rs: Obj, cluster: Obj, partial: bool) -> bool:
        """isClusterSpecHashEqual: ``partial`` compares only the cluster's first N worker groups."""
        ann = cluster["metadata"].get("annotations") or {}
        goal = copy.deepcopy((rs.get("spec") or {}).get("rayClusterConfig") or {})
        if partial:
            try:
                n = int(ann.get(A_NUM_GROUPS, ""))
            except ValueError:
                return True
            groups = goal.get("workerGroupSpecs") or []
            if len(groups) < n:
                return ann.get(A_HASH) == ""
            goal["workerGroupSpecs"] = groups[:n]
        return ann.get(A_HASH) == spec_hash(goal)

    def _should_update(self, rs: Obj, cluster: Obj, *, is_active: bool) -> bool:
        """shouldUpdateCluster (the caller skips the active cluster while an upgrade is in progress)."""
        if is_active and (cluster["metadata"].get("annotations") or {}).get(A_VERSION) != self.version:
            return True
        if self._hash_equal(rs, cluster, partial=False):
            return False
        return self._hash_equal(rs, cluster, partial=True)

    def _should_prepare(self, rs: Obj, active: Obj | None, pending: Obj | None) -> bool:
        """shouldPrepareNewCluster."""
        if active is None and pending is None:
            return True
        cluster = pending if pending is not None else active
        assert cluster is not None
        if self._hash_equal(rs, cluster, partial=False) or self._hash_equal(rs, cluster, partial=True):
            return False
        strategy = ((rs.get("spec") or {}).get("upgradeStrategy") or {}).get("type", "NewCluster")
        return bool(strategy != "None")

    def _clean_up(self, rs: Obj, keep: set[str]) -> None:
        """cleanUpRayClusterInstance: dangling clusters go after the deletion delay."""
        ns, name = rs["metadata"]["namespace"], rs["metadata"]["name"]
        delay = (rs.get("spec") or {}).get("rayClusterDeletionDelaySeconds")
        delay_s = DELETION_DELAY_S if delay is None else float(delay)
        sel = f"{L_ORIGIN_NAME}={name},{L_ORIGIN_CRD}=RayService"
        now = self.clock.now()
        for rc in self.store.list("rayclusters", ns, sel)[0]:
            cname = rc["metadata"]["name"]
            if cname in keep or rc["metadata"].get("deletionTimestamp"):
                continue
            since = self._dangling_since.setdefault((name, cname), now)
            if now - since >= delay_s:
                try:
                    self.store.delete("rayclusters", cname, ns)
                except ApiError as e:
                    if e.code != 404:
                        raise

    # -- Serve ----------------------------------------------------------------------------------------

    def _head_pod_ready(self, cluster: Obj) -> bool:
        ns, name = cluster["metadata"]["namespace"], cluster["metadata"]["name"]
        heads = self.store.list("pods", ns, f"ray.io/cluster={name},ray.io/node-type=head")[0]
        return any(
            (p.get("status") or {}).get("phase") == "Running"
            and any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (p.get("status") or {}).get("conditions") or ())
            for p in heads
        )

    def _reconcile_serve(self, rs: Obj, cluster: Obj) -> bool:
        """reconcileServe: submit when needed; True when every application is RUNNING."""
        if not self.head_ready(cluster):
            return False
        key = (rs["metadata"]["name"], cluster["metadata"]["name"])
        config = str((rs.get("spec") or {}).get("serveConfigV2") or "")
        apps = self.serve.applications(key[1])  # getAndCheckServeStatus: read before any submission
        ready = bool(apps) and all(s == "RUNNING" for s in apps.values())
        cached = self._cache.get(key, "")
        if not cached or not apps or cached != config:  # checkIfNeedSubmitServeApplications
            self.serve.submit(key[1], config)
            if config:
                self._cache[key] = config  # cacheServeConfig
        return ready


def _condition_true(status: Obj, type_: str) -> bool:
    return any(c.get("type") == type_ and c.get("status") == "True" for c in status.get("conditions") or ())


def _conditions(status: Obj) -> list[Obj]:
    """calculateConditions, its UpgradeInProgress part (from the cluster names this pass ends with)."""
    conds = [dict(c) for c in status.get("conditions") or ()]
    old = next((c for c in conds if c.get("type") == "UpgradeInProgress"), None)
    active = (status.get("activeServiceStatus") or {}).get("rayClusterName")
    pending = (status.get("pendingServiceStatus") or {}).get("rayClusterName")
    if active and pending:
        new = ("True", "BothActivePendingClustersExist", "Both active and pending Ray clusters exist")
    elif active:
        new = ("False", "NoPendingCluster", "Active Ray cluster exists and no pending Ray cluster")
    elif old is None:
        new = ("False", "Initializing", "RayService is initializing")
    elif old.get("reason") in ("Initializing", "InitializingTimeout"):
        return conds
    else:
        new = ("Unknown", "NoActiveCluster", "No active Ray cluster exists")
    if old is not None and (old.get("status"), old.get("reason"), old.get("message")) == new:
        return conds
    cond = {"type": "UpgradeInProgress", "status": new[0], "reason": new[1], "message": new[2],
            "lastTransitionTime": now_rfc3339()}
    if old is not None and old.get("status") == new[0]:
        cond["lastTransitionTime"] = old.get("lastTransitionTime") or cond["lastTransitionTime"]
    return [c for c in conds if c.get("type") != "UpgradeInProgress"] + [cond]
