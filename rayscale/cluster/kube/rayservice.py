"""What rayscale keeps in a KubeRay RayService so that KubeRay's own paths never undo it.

KubeRay (ray-project/kuberay, ``ray-operator/controllers/ray/rayservice_controller.go``) rebuilds a
RayService's clusters from ``spec.rayClusterConfig`` and re-submits ``spec.serveConfigV2`` on its own:

- an operator upgrade, or worker groups appended to ``rayClusterConfig``, rebuild the active RayCluster
  in place (``shouldUpdateCluster`` + ``modifyRayCluster``): every worker group's ``replicas`` comes
  from the RayService and ``workersToDelete`` is cleared; KubeRay's RayCluster controller then deletes
  the surplus pods (``raycluster_controller.go`` ``reconcilePods``, random without in-tree autoscaling);
- any other ``rayClusterConfig`` change makes a new pending cluster from the RayService's spec and
  moves traffic to it once every Serve application there is RUNNING (``getAndCheckServeStatus``,
  ``reconcilePromotionAndServingStatus``);
- ``serveConfigV2`` is submitted to a cluster whenever the operator's cache for it is empty (a new
  cluster, an operator restart), the cluster reports no application, or the text changed
  (``checkIfNeedSubmitServeApplications``); the submission sets every listed deployment's replicas.

So the RayService carries rayscale's state: the worker groups' ``replicas`` (not in KubeRay's cluster
hash, ``utils/util.go`` ``GenerateHashWithoutReplicasAndWorkersToDelete``, so writing them starts no
upgrade) and the Serve replica targets as ``num_replicas`` of the deployments in ``serveConfigV2``.
Then a rebuild keeps every worker pod, a re-submission keeps every target, and a pending cluster
asks Serve for every replica rayscale runs, so KubeRay moves traffic only once it serves all of them.
A target of 0 cannot be written (Ray's DeploymentSchema: num_replicas >= 1): the pending cluster
deploys such a deployment at the application's own count, and ``KubeActuator.sync_serve_targets``
scales it there through that cluster's dashboard.
The helpers here are pure; ``KubeActuator`` reads and writes the objects.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

Obj = dict[str, Any]

# On a gang's NodeClaims: the RayCluster its nodes were made for (a RayService has several over time).
LABEL_RAYCLUSTER = "rayscale.io/raycluster"
# On a gang made for a pending cluster: the active cluster's gang it stands in for after the cut-over.
LABEL_TWIN_OF = "rayscale.io/twin-of"
_MAX_LABEL = 63


@dataclass(frozen=True)
class ServiceClusters:
    """The clusters a RayService's status names."""

    active: str = ""
    pending: str = ""

    @property
    def primary(self) -> str:
        """The cluster the controller drives and Serve is read from: the active one (the pending one
        on first deploy, before any cluster serves)."""
        return self.active or self.pending

    @property
    def upgrading(self) -> str:
        """The pending cluster of an upgrade ('' when there is none)."""
        return self.pending if self.active and self.pending else ""

    @classmethod
    def of(cls, rs: Obj) -> ServiceClusters:
        status = rs.get("status") or {}
        return cls(str((status.get("activeServiceStatus") or {}).get("rayClusterName") or ""),
                   str((status.get("pendingServiceStatus") or {}).get("rayClusterName") or ""))


@dataclass
class TwinBackoff:
    """When a failed twin may be made again, per (flavor, zone, capacity type): ``backoff_s`` after the
    failure, as decide() backs off a failed gang's zone (``ActSettings.backoff_s``: a failure while one
    is running does not extend it). A twin keeps its source's zone, so the upgrade waits it out. Memory
    only: a restarted controller tries at once, as it does for decide's back-offs."""

    backoff_s: float
    until: dict[tuple[str, str, str], float] = field(default_factory=dict)

    def fail(self, key: tuple[str, str, str], now: float) -> None:
        if self.until.get(key, float("-inf")) <= now:
            self.until[key] = now + self.backoff_s

    def until_s(self, key: tuple[str, str, str], now: float) -> float | None:
        """The end of the back-off of ``key`` (None: not backed off now)."""
        until = self.until.get(key)
        return until if until is not None and until > now else None


def twin_name(source: str, source_is_twin: bool, cluster: str) -> str:
    """The gang that stands in for ``source`` on ``cluster``: the source's base name and the suffix
    KubeRay gave the cluster (``<rayservice>-<5 random>``), so the name is the same after a restart
    and stays short over many upgrades. It is a label value: 63 characters at most."""
    base = source.rsplit("-", 1)[0] if source_is_twin else source
    suffix = cluster.rsplit("-", 1)[-1][:8]
    name = f"{base}-{suffix}"
    if len(name) > _MAX_LABEL:
        digest = hashlib.sha1(f"{base}/{cluster}".encode()).hexdigest()[:8]
        name = f"{base[:_MAX_LABEL - 9]}-{digest}"
    return name


def mirror_replicas(rs: Obj, replicas: Mapping[str, int], deleting: Mapping[str, bool]) -> bool:
    """Copy the driven cluster's worker-group ``replicas`` into the RayService's ``rayClusterConfig``
    (same group names); True when something changed. A lower count waits until the group's
    ``workersToDelete`` pods are gone: a rebuild in between clears the list, and with the lower count
    KubeRay would then delete a pod at random instead of the one named."""
    changed = False
    groups = ((rs.get("spec") or {}).get("rayClusterConfig") or {}).get("workerGroupSpecs") or []
    for g in groups:
        name = g.get("groupName", "")
        if name not in replicas:
            continue
        want, cur = replicas[name], int(g.get("replicas") or 0)
        if want > cur or (want < cur and not deleting.get(name)):
            g["replicas"] = want
            changed = True
    return changed


def with_serve_targets(config: str, targets: Mapping[str, Mapping[str, int]]) -> str | None:
    """``serveConfigV2`` with each application's deployment ``num_replicas`` set to ``targets``
    (application -> deployment -> replicas); None when it already says so. Applications the config
    does not have are left out: KubeRay deploys only what the config lists."""
    doc = yaml.safe_load(config) or {}
    changed = False
    for app in doc.get("applications") or []:
        want = targets.get(app.get("name", ""))
        if not want:
            continue
        deployments = app.setdefault("deployments", [])
        listed = {d.get("name"): d for d in deployments}
        built = _built_deployments(app) if any(dep not in listed for dep in want) else None
        for dep, n in sorted(want.items()):
            entry = listed.get(dep)
            if entry is None and built is not None and dep not in built:
                # Serve refuses an override of a deployment the application does not build
                # (override_deployment_info in ray/serve/_private/application_state.py): a gang-slot
                # flavor's replicas are per slot deployment, which the controller scales itself.
                continue
            if n <= 0:
                # Ray's DeploymentSchema takes num_replicas >= 1 (ray/serve/schema.py): a deployment at zero
                # is left to the application's own count, and the controller scales it to 0 after a submit.
                if entry is not None and set(entry) <= {"name", "num_replicas"}:
                    deployments.remove(entry)
                    changed = True
                elif entry is not None and "num_replicas" in entry:
                    del entry["num_replicas"]
                    changed = True
            elif entry is None:
                deployments.append({"name": dep, "num_replicas": n})
                changed = True
            elif entry.get("num_replicas") != n:
                entry["num_replicas"] = n
                changed = True
        if not deployments:
            del app["deployments"]
    return yaml.safe_dump(doc, sort_keys=False) if changed else None


def _built_deployments(app: Obj) -> set[str] | None:
    """The model deployments a rayscale application builds (a gang-slot flavor's: one per slot); None
    for another application, or args rayscale cannot read (then nothing is left out)."""
    from rayscale.serve.config import RAYSCALE_IMPORT_PREFIX, ConfigError, parse_app_args

    if not str(app.get("import_path", "")).startswith(RAYSCALE_IMPORT_PREFIX):
        return None
    try:
        cfg = parse_app_args(dict(app.get("args") or {}), f"application {app.get('name')}")
    except ConfigError:
        return None
    return {d for m in cfg.models for f in m.flavors for d in f.deployment_names(m.name)}
