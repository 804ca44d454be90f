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
each cluster's replica targets as Serve does (a submitted config deploys every deployment the
application builds, at the config's count or the application's own; the external scaler sets one) and
reports an application RUNNING only once every deployment's target fits the capacity the test says the
cluster has (Serve's ``ApplicationStatus``: DEPLOYING until the target replicas run).
``rayscale_testing.serve_http.ServeDashboards`` puts each cluster's dashboard (its Serve part) in front
of a ``ServeModel`` over HTTP.
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

    A submitted config (``PUT /api/serve/applications/``) replaces the cluster's applications. The
    deployments an application has, with the count each is deployed at:

    - a rayscale application (``import_path`` under ``rayscale.serve.app:``) has the deployments its
      builder makes from ``args`` (``rayscale.serve.app.build_from_config``): one per single-node
      flavor, deployed at the flavor's ``num_replicas`` or 1 where that is 0 (Serve refuses 0 at deploy
      time, so the builder raises it), and one per gang slot of a multi-node flavor, each at 1
      (``_slot_options``). A ``deployments`` entry with ``num_replicas`` overrides the count; an entry
      naming a deployment the builder does not make fails the application (``override_deployment_info``
      in ray/serve/_private/application_state.py). The ingress is not modelled: it asks for no CPU
      (``num_cpus: 0``) and runs on any node, the head's included, so it never holds an application back;
    - any other application has the deployments its entry lists, each at its ``num_replicas`` (1 when
      absent, as for code that sets none).

    A re-submission sets a deployment's target only where what it deploys changed (the application's
    code: import path, args, runtime env; or the deployment's entry): Serve's ``DeploymentState.deploy``
    (ray/serve/_private/deployment_state.py) returns early on an unchanged deployment config and version,
    so a target the external scaler set stays. The external scaler (``serve_head.py``
    ``scale_deployment``, ``controller.update_deployment_replicas``) sets one target: 404 for an
    application or deployment the cluster does not have, 412 unless the application has
    ``external_scaler_enabled``, 400 for a negative count (``ScaleDeploymentRequest``: NonNegativeInt).
    An application is RUNNING once every deployment's target fits ``capacity(cluster, deployment)``
    (replicas that can run there now), DEPLOYING before (Serve's ``ApplicationStatus``)."""

    capacity: Callable[[str, str], int]
    submissions: list[tuple[str, str]] = field(default_factory=list)  # (cluster, serveConfigV2)
    targets: dict[str, dict[tuple[str, str], int]] = field(default_factory=dict)  # cluster -> (app, dep) -> n
    scalable: dict[str, dict[str, bool]] = field(default_factory=dict)  # cluster -> app -> external scaler on
    failed: dict[str, dict[str, str]] = field(default_factory=dict)  # cluster -> app -> why it failed
    # cluster -> (app, dep) -> what was deployed (the re-submission compares it)
    deployed: dict[str, dict[tuple[str, str], str]] = field(default_factory=dict)

    def submit(self, cluster: str, config: str) -> None:
        self.submissions.append((cluster, config))
        apps = (yaml.safe_load(config) or {}).get("applications") or []
        old_targets, old_deployed = self.targets.get(cluster, {}), self.deployed.get(cluster, {})
        self.scalable[cluster] = {a.get("name", ""): bool(a.get("external_scaler_enabled")) for a in apps}
        self.failed[cluster], self.targets[cluster], self.deployed[cluster] = {}, {}, {}
        for app in apps:
            name = app.get("name", "")
            try:
                counts = app_deployments(app)
            except ValueError as e:
                self.failed[cluster][name] = str(e)
                continue
            for dep, (n, what) in counts.items():
                key = (name, dep)
                same = old_deployed.get(key) == what and key in old_targets
                self.targets[cluster][key] = old_targets[key] if same else n
                self.deployed[cluster][key] = what

    def scale(self, cluster: str, app: str, deployment: str, replicas: int) -> None:
        """The external scaler's ``POST .../deployments/{dep}/scale``; ServeHTTPError as Ray answers."""
        if replicas < 0:
            raise ServeHTTPError(400, f"Invalid request body: target_num_replicas {replicas} < 0")
        if app not in self.scalable.get(cluster, {}):
            raise ServeHTTPError(404, "Application or Deployment not found")
        if not self.scalable[cluster][app]:
            raise ServeHTTPError(412, f"application {app} on {cluster} has no external_scaler_enabled")
        if (app, deployment) not in self.targets.get(cluster, {}):
            raise ServeHTTPError(404, "Application or Deployment not found")
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
            out[app] = "DEPLOY_FAILED" if app in self.failed.get(cluster, {}) else "RUNNING" if fits else "DEPLOYING"
        return out

    def details(self, cluster: str) -> Obj:
        """``GET /api/serve/applications/`` as Ray's ServeInstanceDetails has it, the parts read here:
        per application its status and per deployment ``target_num_replicas`` and running replicas."""
        apps: Obj = {}
        for app, status in self.applications(cluster).items():
            deps = {dep: {"name": dep, "target_num_replicas": n,
                          "replicas": [{"state": "RUNNING"}] * self.running(cluster, app, dep)}
                    for (a, dep), n in sorted(self.targets.get(cluster, {}).items()) if a == app}
            apps[app] = {"name": app, "status": status, "deployments": deps}
        return {"applications": apps}


class ServeHTTPError(Exception):
    """An answer of the dashboard's Serve API other than 200 (``code``, as serve_head.py sends it)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


def app_deployments(app: Obj) -> dict[str, tuple[int, str]]:
    """Deployment -> (count it is deployed at, what it deploys) of one application entry (ServeModel);
    ValueError when Serve would refuse the entry's overrides."""
    listed = {d.get("name", ""): d for d in app.get("deployments") or []}
    code = json.dumps([app.get("import_path"), app.get("args"), app.get("runtime_env")], sort_keys=True)
    built = _rayscale_builds(app)
    if built is None:
        return {dep: (int(d.get("num_replicas", 1)), json.dumps([code, d], sort_keys=True))
                for dep, d in listed.items()}
    unknown = sorted(set(listed) - set(built))
    if unknown:  # override_deployment_info
        raise ValueError(f"Deployment '{unknown[0]}' does not exist. Available: {sorted(built)}")
    out = {}
    for dep, own in built.items():
        entry = listed.get(dep)
        n = int(entry["num_replicas"]) if entry is not None and "num_replicas" in entry else own
        out[dep] = (n, json.dumps([code, entry], sort_keys=True))
    return out


def _rayscale_builds(app: Obj) -> dict[str, int] | None:
    """The model deployments rayscale's builder makes, each with the count it deploys it at
    (rayscale.serve.app.build_from_config); None for an application that is not rayscale's."""
    from rayscale.serve.config import RAYSCALE_IMPORT_PREFIX, parse_app_args

    if not str(app.get("import_path", "")).startswith(RAYSCALE_IMPORT_PREFIX):
        return None
    cfg = parse_app_args(dict(app.get("args") or {}), f"application {app.get('name')}")  # ConfigError: a ValueError
    out = {}
    for m in cfg.models:
        for f in m.flavors:
            for dep in f.deployment_names(m.name):
                out[dep] = 1 if f.gang_slots else max(f.num_replicas, 1)
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
