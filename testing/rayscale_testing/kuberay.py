"""A KubeRay stand-in for the emulator: RayCluster -> head and worker pods, as the operator does.

Modelled on ray-project/kuberay ``ray-operator/controllers/ray/raycluster_controller.go``
(``reconcilePods``, at feeaf72f) for single-host indexing:
- one head pod per RayCluster, worker pods per ``workerGroupSpecs[]``, created with generateName
  ``{cluster}-{group}-worker-`` (``utils.PodName``: prefix clipped to 50 characters, lower-cased) and the
  labels ``ray.io/cluster``, ``ray.io/group``, ``ray.io/node-type``, ``ray.io/is-ray-node``, an
  ownerReference to the RayCluster (so deleting the cluster garbage-collects them);
- a group's ``labels`` (its Ray node labels) are put on its pods over the template's
  (``common/pod.go``: ``mergeLabels`` then ``labelPod``, which never lets them override
  ``ray.io/cluster``, ``ray.io/group`` or ``ray.io/node-type``); ``ray start`` gets them as ``--labels``
  (``updateRayStartParamsLabels``, which ``rayscale_testing.raypods`` follows);
- the desired count is ``replicas`` clamped to [minReplicas, maxReplicas] times ``numOfHosts``
  (``GetWorkerGroupDesiredReplicas``), 0 when ``suspend``;
- a worker pod that will not run again is deleted first (``shouldDeletePod``): phase ``Failed`` or
  ``Succeeded``, or ``Running`` with its Ray container (the first) terminated and ``restartPolicy: Never``
  (with ``Always`` or ``OnFailure`` the kubelet restarts it, and KubeRay leaves it); once it deleted such
  pods the pass ends there (the reconcile returns an error and is queued again);
- every pod named in ``scaleStrategy.workersToDelete`` is deleted on every pass, whatever
  ``replicas`` says (404 ignored); the diff is then taken against the remaining pods, so the client
  must lower ``replicas`` in the same write or KubeRay creates replacements;
- the operator does NOT clear ``workersToDelete`` in the stored spec (it clears its copy in
  ``reconcilePods`` and never writes the spec back; the Ray autoscaler patches the list away once the
  pods are gone, kuberay#733);
- with ``enableInTreeAutoscaling: true`` surplus pods are never deleted at random (only via
  workersToDelete); without it, surplus pods are deleted in list order;
- ``status``: desired/min/max/ready/available worker replicas, state ``ready`` once head and all
  desired workers run, observedGeneration, head pod name and IP.

Scheduling and pod start are done by ``PodScheduler`` (run inside this stand-in unless
``schedule=False``): pods stay Pending when no Node fits their nodeSelector, tolerations and requests.
Pods for which ``external_kubelet(pod)`` is true are bound but run by another stand-in
(``rayscale_testing.raypods.RayPodKubelet``: a real Ray node per worker pod).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from rayscale_testing.kubeapi import ApiError, Store, now_rfc3339
from rayscale_testing.scheduler import Clock, PodScheduler, StandIn

Obj = dict[str, Any]

L_CLUSTER = "ray.io/cluster"
L_GROUP = "ray.io/group"
L_NODE_TYPE = "ray.io/node-type"
HEAD_GROUP = "headgroup"


def worker_pod_prefix(cluster: str, group: str) -> str:
    """``utils.PodName(cluster-group, worker, true)``: the generateName of a worker pod."""
    return f"{cluster}-{group}"[:50].lower() + "-worker-"


def desired_workers(group: Obj) -> int:
    if group.get("suspend"):
        return 0
    lo = int(group.get("minReplicas") or 0)
    hi = group.get("maxReplicas")
    replicas = group.get("replicas")
    n = lo if replicas is None or replicas < lo else replicas
    if hi is not None and n > hi:
        n = int(hi)
    return int(n) * max(1, int(group.get("numOfHosts") or 1))


def should_delete_pod(pod: Obj) -> bool:
    """KubeRay's ``shouldDeletePod``: the pod cannot run again (a terminal phase, or its Ray container
    terminated under ``restartPolicy: Never``)."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Failed", "Succeeded"):
        return True
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    ray: Obj = next((c for c in status.get("containerStatuses") or () if c.get("name") == containers[0].get("name")), {})
    terminated = bool((ray.get("state") or {}).get("terminated"))
    return status.get("phase") == "Running" and terminated and (pod.get("spec") or {}).get("restartPolicy") == "Never"


def _running_ready(pod: Obj) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or ()
    )


class KubeRayStandIn(StandIn):
    watched = ("rayclusters", "pods", "nodes")

    def __init__(
        self,
        store: Store,
        *,
        schedule: bool = True,
        pod_start_delay: float = 0.0,
        clock: Clock | None = None,
        tick: float = 0.02,
        external_kubelet: Callable[[Obj], bool] | None = None,
    ) -> None:
        super().__init__(store, clock=clock, tick=tick)
        self.scheduler = (
            PodScheduler(
                store, start_delay=pod_start_delay, clock=clock, tick=tick, external_kubelet=external_kubelet
            )
            if schedule
            else None
        )
        self.deleted_pods: list[str] = []  # names deleted by this operator, in order
        self.created_pods: list[str] = []

    def step(self) -> None:
        clusters, _ = self.store.list("rayclusters")
        for rc in clusters:
            if rc["metadata"].get("deletionTimestamp"):
                continue
            self._reconcile(rc)
        if self.scheduler is not None:
            self.scheduler.step()
        for rc in clusters:
            if not rc["metadata"].get("deletionTimestamp"):
                self._update_status(rc["metadata"]["name"], rc["metadata"]["namespace"])

    # -- pods -----------------------------------------------------------------------------------------

    def _reconcile(self, rc: Obj) -> None:
        meta, spec = rc["metadata"], rc.get("spec") or {}
        ns, name = meta["namespace"], meta["name"]
        pods, _ = self.store.list("pods", ns, f"{L_CLUSTER}={name}")
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        heads = [p for p in live if p["metadata"]["labels"].get(L_NODE_TYPE) == "head"]
        if not heads and spec.get("headGroupSpec"):
            self._create_pod(rc, spec["headGroupSpec"], HEAD_GROUP, "head", f"{name}-head-"[:56].lower())
        autoscaling = bool(spec.get("enableInTreeAutoscaling"))
        groups = spec.get("workerGroupSpecs") or []
        for group in groups:
            gname = group["groupName"]
            gpods = [
                p
                for p in live
                if p["metadata"]["labels"].get(L_GROUP) == gname
                and p["metadata"]["labels"].get(L_NODE_TYPE) == "worker"
            ]
            if group.get("suspend"):
                for p in gpods:
                    self._delete_pod(ns, p["metadata"]["name"])
                continue
            unhealthy = [p for p in gpods if should_delete_pod(p)]
            for p in unhealthy:
                self._delete_pod(ns, p["metadata"]["name"])
            if unhealthy:
                return  # upstream returns an error here: the next pass goes on
            deleted: set[str] = set()
            to_delete = list((group.get("scaleStrategy") or {}).get("workersToDelete") or [])
            for pod_name in to_delete:
                if self._delete_pod(ns, pod_name):
                    deleted.add(pod_name)
            remaining = [p for p in gpods if p["metadata"]["name"] not in deleted]
            diff = desired_workers(group) - len(remaining)
            if diff > 0:
                for _ in range(diff):
                    self._create_pod(rc, group, gname, "worker", worker_pod_prefix(name, gname))
            elif diff < 0 and not autoscaling:
                for p in remaining[:-diff]:
                    self._delete_pod(ns, p["metadata"]["name"])

    def _create_pod(self, rc: Obj, group: Obj, gname: str, node_type: str, generate_name: str) -> None:
        meta = rc["metadata"]
        template = copy.deepcopy(group.get("template") or {})
        tmeta = template.get("metadata") or {}
        labels = {
            **(tmeta.get("labels") or {}),
            **(group.get("labels") or {}),  # mergeLabels: the group's Ray node labels win over the template's
            L_CLUSTER: meta["name"],
            L_GROUP: gname,
            L_NODE_TYPE: node_type,
            "ray.io/is-ray-node": "yes",
            "app.kubernetes.io/created-by": "kuberay-operator",
            "app.kubernetes.io/name": "kuberay",
        }
        pod: Obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "generateName": generate_name,
                "namespace": meta["namespace"],
                "labels": labels,
                "annotations": dict(tmeta.get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": rc["apiVersion"],
                        "kind": "RayCluster",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": template.get("spec") or {"containers": []},
        }
        if not pod["metadata"]["annotations"]:
            del pod["metadata"]["annotations"]
        created = self.store.create("pods", pod, meta["namespace"])
        self.created_pods.append(created["metadata"]["name"])

    def _delete_pod(self, ns: str, name: str) -> bool:
        try:
            self.store.delete("pods", name, ns)
        except ApiError as e:
            if e.code == 404:
                return False
            raise
        self.deleted_pods.append(name)
        return True

    # -- status ---------------------------------------------------------------------------------------

    def _update_status(self, name: str, ns: str) -> None:
        rc = self.store.try_get("rayclusters", name, ns)
        if rc is None:
            return
        spec = rc.get("spec") or {}
        pods, _ = self.store.list("pods", ns, f"{L_CLUSTER}={name}")
        workers = [p for p in pods if p["metadata"]["labels"].get(L_NODE_TYPE) == "worker"]
        heads = [p for p in pods if p["metadata"]["labels"].get(L_NODE_TYPE) == "head"]
        groups = spec.get("workerGroupSpecs") or []
        desired = sum(desired_workers(g) for g in groups)
        ready = sum(1 for p in workers if _running_ready(p))
        all_ready = bool(heads) and all(_running_ready(p) for p in heads) and ready == desired == len(workers)
        old = rc.get("status") or {}
        status: Obj = {
            **old,
            "desiredWorkerReplicas": desired,
            "minWorkerReplicas": sum(
                int(g.get("minReplicas") or 0) * max(1, int(g.get("numOfHosts") or 1))
                for g in groups
                if not g.get("suspend")
            ),
            "maxWorkerReplicas": sum(
                int(g.get("maxReplicas") or 0) * max(1, int(g.get("numOfHosts") or 1))
                for g in groups
                if not g.get("suspend")
            ),
            "readyWorkerReplicas": ready,
            "availableWorkerReplicas": sum(
                1 for p in workers if (p.get("status") or {}).get("phase") == "Running"
            ),
            "observedGeneration": rc["metadata"].get("generation", 1),
        }
        if all_ready:
            status["state"] = "ready"
        if heads:
            head = {"podName": heads[0]["metadata"]["name"]}
            if (heads[0].get("status") or {}).get("podIP"):
                head["podIP"] = heads[0]["status"]["podIP"]
            status["head"] = head
        if status != old:
            status["lastUpdateTime"] = now_rfc3339()
            self.store.patch("rayclusters", name, {"status": status}, ns, subresource="status")
