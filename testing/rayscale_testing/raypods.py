"""A kubelet for Ray worker pods: every worker pod KubeRay's stand-in creates runs as a real Ray node.

The Kubernetes stand-ins (Karpenter, KubeRay, the pod scheduler) only move objects in the emulator;
``RayPodKubelet`` closes the gap to Ray. For each worker pod bound to a Node it starts a real local Ray
worker node, joined to a ``LocalCluster`` (the head stands in for the RayCluster's head pod), and
removes it when the pod is deleted, as a kubelet runs and stops the pod's ``ray start`` container:

- the node declares what KubeRay's generated ``ray start`` for the pod would (``ray_start_params``,
  after KubeRay's ``generateRayStartCommand``): the worker group's ``rayStartParams`` (``num-gpus``,
  ``resources`` with the flavor's ``accelerator_type:*``), ``num-cpus`` and ``num-gpus`` from the
  container's limits when the params do not say, Neuron cores and TPUs from the limits; its Ray node
  labels are the group's ``labels`` (``ray_node_labels``, after ``updateRayStartParamsLabels`` in
  ``common/pod.go``: ``--labels k=v,...``);
- the pod gets its own IP, a loopback address (``127.0.0.3``, ``.4``, ... any 127/8 address is this
  machine): the Ray node runs on that address, so ``status.podIP`` is what Ray (and Serve's replica
  details) report as the node's IP, as on Kubernetes, where a Ray node is its pod's IP;
- ``status.podIP`` is set when the pod's sandbox starts (before the container, as a CNI does); the pod
  turns Running and Ready (KubeRay's worker readiness probe checks the raylet) once the Ray node is
  registered and alive in the GCS;
- a container whose ``ray start`` fails (on a busy machine a raylet can time out waiting for its agent)
  is restarted, as a kubelet does (``restartPolicy: Always``), up to ``max_restarts`` times with a short
  back-off, the pod not Ready meanwhile; starts run one at a time (``parallel_starts``), since Ray nodes
  starting together on two cores is what makes them time out;
- under ``restartPolicy: Never`` (what rayscale renders) a container that ends is not restarted: a failed
  start, or a Ray node that exits while its pod runs (a drained raylet does once idle; looked for every
  ``exit_poll_s``), leaves the Ray container terminated and the pod ``Failed``, for KubeRay to delete
  (``rayscale_testing.kuberay``). A node exiting under another policy would be restarted in place by a
  kubelet; that is not modelled;
- termination is graceful: the kubelet puts ``rayscale.io/test-kubelet`` on the pods it runs (the
  emulator has no kubelet, so a pod without a finalizer goes at once), so a deleted pod stays
  Terminating until its Ray node is drained (``LocalCluster.remove_node``: no new work, then stopped)
  and gone; then the finalizer goes and the pod with it.

Pass ``kubelet.runs_pod`` as ``external_kubelet`` to ``KubeRayStandIn`` (or ``PodScheduler``): the
scheduler binds these pods and leaves running them to this stand-in. Starting and stopping Ray nodes
take seconds, so each runs in its own thread; ``step()`` never blocks on one.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import math
import shlex
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayscale.cluster.local import LocalCluster, LocalFlavor
from rayscale_testing.kubeapi import ApiError, Store, now_rfc3339
from rayscale_testing.scheduler import Clock, StandIn, parse_quantity, set_condition

log = logging.getLogger(__name__)
Obj = dict[str, Any]

FINALIZER = "rayscale.io/test-kubelet"
L_CLUSTER = "ray.io/cluster"
L_GROUP = "ray.io/group"
L_NODE_TYPE = "ray.io/node-type"
LABEL_POD = "rayscale.io/pod"  # Ray node label: the pod a bridged node runs for
LABEL_WORKER_GROUP = "rayscale.io/worker-group"
# KubeRay's customAcceleratorToRayResourceMap: container resource -> Ray resource.
CUSTOM_ACCELERATORS = {"aws.amazon.com/neuroncore": "neuron_cores", "google.com/tpu": "TPU"}


def _unquote(value: str) -> str:
    """A rayStartParams value as the shell of KubeRay's generated command sees it."""
    parts = shlex.split(str(value))
    return parts[0] if len(parts) == 1 else str(value)


def ray_start_params(group: Mapping[str, Any], container: Mapping[str, Any]) -> dict[str, Any]:
    """``num-cpus``, ``num-gpus`` and ``resources`` of the ``ray start`` KubeRay generates for a worker.

    After ``generateRayStartCommand`` / ``addWellKnownAcceleratorResources``: the group's
    rayStartParams win; else CPUs from the container's cpu limit (or request), GPUs from a limit
    whose name ends in ``gpu``, and the first custom accelerator (Neuron cores, TPU) from the limits
    unless ``resources`` already names one."""
    params = {k: _unquote(v) for k, v in (group.get("rayStartParams") or {}).items()}
    res = container.get("resources") or {}
    limits, requests = dict(res.get("limits") or {}), dict(res.get("requests") or {})
    if "num-cpus" in params:
        cpus = float(params["num-cpus"])
    else:
        q = limits.get("cpu") or requests.get("cpu")
        cpus = float(math.ceil(parse_quantity(q))) if q is not None else 1.0
    resources = {k: float(v) for k, v in json.loads(params.get("resources") or "{}").items()}
    gpus = float(params["num-gpus"]) if "num-gpus" in params else 0.0
    custom = any(r in resources for r in CUSTOM_ACCELERATORS.values())
    for key in sorted(limits):
        amount = float(parse_quantity(limits[key]))
        if "num-gpus" not in params and key.endswith("gpu") and amount:
            gpus = amount
        if not custom and key in CUSTOM_ACCELERATORS and amount:
            resources.setdefault(CUSTOM_ACCELERATORS[key], amount)
            custom = True
    return {"num-cpus": cpus, "num-gpus": gpus, "resources": resources}


def _never(pod: Mapping[str, Any] | None) -> bool:
    return ((pod or {}).get("spec") or {}).get("restartPolicy") == "Never"


def ray_node_labels(group: Mapping[str, Any]) -> dict[str, str]:
    """The Ray node labels of the ``ray start`` KubeRay generates for a worker of ``group``: its
    ``labels`` (``updateRayStartParamsLabels`` in ray-project/kuberay ``ray-operator/controllers/ray/
    common/pod.go`` writes them as ``--labels``; ``rayStartParams.labels`` itself is refused by
    ``validateRayGroupLabels``)."""
    return {str(k): str(v) for k, v in (group.get("labels") or {}).items()}


@dataclass
class PodRun:
    """One worker pod this kubelet runs, and its Ray node."""

    namespace: str
    pod: str
    uid: str
    group: str
    ip: str
    node_id: str | None = None  # the LocalCluster node id once it was started
    ray_node_id: str | None = None
    state: str = "starting"  # starting, running, failed, exited, stopping, stopped
    error: str = ""
    restarts: int = 0
    started_s: float | None = None
    stopped_s: float | None = None
    threads: list[threading.Thread] = field(default_factory=list)


class RayPodKubelet(StandIn):
    """Runs the worker pods of RayClusters (in ``namespace``; of ``raycluster`` if given) as Ray nodes."""

    watched = ("pods",)

    def __init__(
        self,
        store: Store,
        cluster: LocalCluster,
        *,
        namespace: str | None = None,
        raycluster: str | None = None,
        first_ip: str = "127.0.0.3",
        drain_grace_s: float = 15.0,
        start_timeout_s: float = 180.0,
        max_restarts: int = 3,
        restart_backoff_s: float = 2.0,
        parallel_starts: int = 1,
        exit_poll_s: float = 2.0,
        clock: Clock | None = None,
        tick: float = 0.25,
    ) -> None:
        super().__init__(store, clock=clock, tick=tick)
        self.exit_poll_s = exit_poll_s
        self._next_exit_poll = 0.0
        self.cluster = cluster
        self.namespace = namespace
        self.raycluster = raycluster
        self.drain_grace_s = drain_grace_s
        self.start_timeout_s = start_timeout_s
        self.max_restarts = max_restarts
        self.restart_backoff_s = restart_backoff_s
        self._starts = threading.Semaphore(parallel_starts)
        # Addresses are never reused: a dead node stays in the GCS's table under its IP for a while.
        self._next_ip = ipaddress.IPv4Address(first_ip)
        if not self._next_ip.is_loopback:
            raise ValueError(f"first_ip {first_ip} must be a loopback (127/8) address")
        self._lock = threading.Lock()
        self.runs: dict[str, PodRun] = {}  # pod uid -> run, kept after the pod is gone (tests read it)

    # --- for the scheduler ---------------------------------------------------------------------------
    def runs_pod(self, pod: Mapping[str, Any]) -> bool:
        """The ``external_kubelet`` predicate: Ray worker pods of the RayClusters this kubelet serves."""
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        return (
            labels.get(L_NODE_TYPE) == "worker"
            and (self.namespace is None or meta.get("namespace") == self.namespace)
            and (self.raycluster is None or labels.get(L_CLUSTER) == self.raycluster)
        )

    # --- reading -------------------------------------------------------------------------------------
    def run_of(self, pod: str) -> PodRun | None:
        with self._lock:
            return next((r for r in self.runs.values() if r.pod == pod), None)

    def live(self) -> list[PodRun]:
        """Runs whose Ray node may still exist (not stopped yet)."""
        with self._lock:
            return [r for r in self.runs.values() if r.state != "stopped"]

    # --- the loop ------------------------------------------------------------------------------------
    def step(self) -> None:
        pods, _ = self.store.list("pods", self.namespace)
        seen = set()
        for p in pods:
            if not self.runs_pod(p):
                continue
            meta = p["metadata"]
            uid = meta["uid"]
            seen.add(uid)
            with self._lock:
                run = self.runs.get(uid)
            deleting = bool(meta.get("deletionTimestamp"))
            if run is None:
                if deleting:
                    self._remove_finalizer(meta["namespace"], meta["name"])  # never started here
                    continue
                if not (p.get("spec") or {}).get("nodeName"):
                    continue  # not bound yet
                if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                self._start(p)
            elif deleting and run.state not in ("stopping", "stopped"):
                self._stop_pod(run)
        # A pod gone without passing through Terminating (its finalizer was taken away): stop its node.
        with self._lock:
            gone = [r for uid, r in self.runs.items() if uid not in seen and r.state not in ("stopping", "stopped")]
        for r in gone:
            self._stop_pod(r)
        if time.monotonic() >= self._next_exit_poll:
            self._next_exit_poll = time.monotonic() + self.exit_poll_s
            self._find_exits({p["metadata"]["uid"]: p for p in pods if p["metadata"]["uid"] in seen})

    def _find_exits(self, pods: Mapping[str, Obj]) -> None:
        """Pods under ``restartPolicy: Never`` whose running Ray node exited: their container is done."""
        with self._lock:
            running = [r for r in self.runs.values() if r.state == "running" and r.node_id is not None
                       and _never(pods.get(r.uid))]
        if not running:
            return
        try:
            alive = {n.id for n in self.cluster.nodes()}
        except Exception:  # the head is busy or restarting: look again next time
            log.debug("listing the Ray nodes failed", exc_info=True)
            return
        for run in running:
            if run.node_id not in alive:
                with self._lock:
                    if run.state != "running":
                        continue
                    run.state = "exited"
                self._set_terminated(run, "the Ray node exited")

    def _allocate_ip(self) -> str:
        with self._lock:
            ip = self._next_ip
            self._next_ip += 1
        if not ip.is_loopback:
            raise RuntimeError("ran out of loopback addresses")
        return str(ip)

    def _start(self, pod: Obj) -> None:
        meta = pod["metadata"]
        ns, name = meta["namespace"], meta["name"]
        ip = self._allocate_ip()
        # The sandbox: the finalizer (graceful termination) and the pod's IP, in that order.
        self.store.patch(
            "pods",
            name,
            {"metadata": {"finalizers": [*(meta.get("finalizers") or []), FINALIZER]}},
            ns,
        )
        status = dict(pod.get("status") or {})
        status.update(podIP=ip, podIPs=[{"ip": ip}], hostIP=self._host_ip(pod), startTime=now_rfc3339())
        self.store.patch("pods", name, {"status": status}, ns, subresource="status")
        run = PodRun(ns, name, meta["uid"], (meta.get("labels") or {}).get(L_GROUP, ""), ip)
        with self._lock:
            self.runs[run.uid] = run
        t = threading.Thread(target=self._run_node, args=(run, pod), name=f"raypod-start-{name}", daemon=True)
        run.threads.append(t)
        t.start()

    def _host_ip(self, pod: Obj) -> str:
        node = self.store.try_get("nodes", (pod.get("spec") or {}).get("nodeName") or "")
        addresses = ((node or {}).get("status") or {}).get("addresses") or [{}]
        return str(addresses[0].get("address", ""))

    def node_spec(self, pod: Obj) -> LocalFlavor:
        """What the pod's ``ray start`` declares, as a local node flavor (named after the pod's flavor)."""
        labels = pod["metadata"].get("labels") or {}
        group_name = labels.get(L_GROUP, "")
        rc = self.store.get("rayclusters", labels.get(L_CLUSTER, ""), pod["metadata"]["namespace"])
        group: Obj = next((g for g in (rc.get("spec") or {}).get("workerGroupSpecs") or []
                      if g.get("groupName") == group_name), {})
        containers = (pod.get("spec") or {}).get("containers") or [{}]
        params = ray_start_params(group, containers[0])
        flavor = labels.get("rayscale.io/flavor") or group_name or "worker"
        return LocalFlavor(
            flavor,
            num_cpus=params["num-cpus"],
            num_gpus=params["num-gpus"],
            resources=params["resources"],
            labels={**ray_node_labels(group), LABEL_POD: pod["metadata"]["name"], LABEL_WORKER_GROUP: group_name},
        )

    def _run_node(self, run: PodRun, pod: Obj) -> None:
        restarts = 0 if _never(pod) else self.max_restarts
        for attempt in range(restarts + 1):
            if run.state != "starting":
                return  # deleted before (re)starting
            node_id = None
            try:
                with self._starts:
                    node_id = self.cluster.add_node(self.node_spec(pod), node_ip=run.ip, wait=False)
                    with self._lock:
                        run.node_id = node_id
                    node = self.cluster.wait_node(node_id, self.start_timeout_s)
                break
            except Exception as e:  # the container failed: restart it, the pod not Ready meanwhile
                with self._lock:
                    run.error = f"{type(e).__name__}: {e}" + (self._agent_log(node_id) if node_id else "")
                    run.node_id = None
                if node_id is not None:
                    with contextlib.suppress(Exception):
                        self.cluster.remove_node(node_id, grace_s=0)
                if attempt == restarts:
                    with self._lock:
                        run.state = "failed"
                    if restarts == 0:  # restartPolicy Never: the pod is done, KubeRay replaces it
                        log.warning("Ray node for pod %s/%s did not start (%s)", run.namespace, run.pod,
                                    run.error.splitlines()[0])
                        self._set_terminated(run, run.error[:500])
                        return
                    log.exception("Ray node for pod %s/%s did not start", run.namespace, run.pod)
                    self.errors.append(e)
                    self._set_status(run, ready=False, message=run.error[:500])
                    return
                log.warning("Ray node for pod %s/%s did not start (%s); restarting", run.namespace, run.pod,
                            run.error.splitlines()[0])
                run.restarts += 1
                self._set_status(run, ready=False, message=f"restart {run.restarts}: {run.error[:300]}")
                time.sleep(self.restart_backoff_s * 2**attempt)
        with self._lock:
            run.error = ""
            run.ray_node_id = node.ray_node_id
            run.started_s = time.monotonic()
            if run.state != "starting":
                return  # deleted while starting: _stop_pod takes it from here
            run.state = "running"
        self._set_status(run, ready=True)

    def _agent_log(self, node_id: str, lines: int = 15) -> str:
        """The tail of a failed node's dashboard agent log (a raylet that times out waits for its agent)."""
        with contextlib.suppress(Exception):
            logs = sorted(Path(self.cluster.node(node_id).temp_dir).glob("session_*/logs/dashboard_agent.log"))
            if logs:
                tail = logs[-1].read_text(errors="replace").splitlines()[-lines:]
                return "\ndashboard_agent.log:\n" + "\n".join(tail)
        return ""

    def _set_status(self, run: PodRun, *, ready: bool, message: str = "") -> None:
        pod = self.store.try_get("pods", run.pod, run.namespace)
        if pod is None or pod["metadata"]["uid"] != run.uid or pod["metadata"].get("deletionTimestamp"):
            return
        status = dict(pod.get("status") or {})
        conds = list(status.get("conditions") or [])
        set_condition(conds, "Initialized", "True")
        flag = "True" if ready else "False"
        reason = "" if ready else "ContainersNotReady"
        set_condition(conds, "ContainersReady", flag, reason, message)
        set_condition(conds, "Ready", flag, reason, message)
        container = (((pod.get("spec") or {}).get("containers") or [{}])[0]).get("name", "ray-worker")
        status.update(conditions=conds, phase="Running" if ready else status.get("phase", "Pending"),
                      containerStatuses=[{"name": container, "ready": ready, "restartCount": run.restarts,
                                          "image": "", "imageID": ""}])
        with contextlib.suppress(ApiError):
            self.store.patch("pods", run.pod, {"status": status}, run.namespace, subresource="status")

    def _set_terminated(self, run: PodRun, message: str) -> None:
        """The Ray container ended and will not restart: the pod ``Failed`` (``ray start --block`` exits 1
        once its raylet is gone)."""
        pod = self.store.try_get("pods", run.pod, run.namespace)
        if pod is None or pod["metadata"]["uid"] != run.uid or pod["metadata"].get("deletionTimestamp"):
            return
        status = dict(pod.get("status") or {})
        conds = list(status.get("conditions") or [])
        for type_ in ("ContainersReady", "Ready"):
            set_condition(conds, type_, "False", "PodFailed", message)
        container = (((pod.get("spec") or {}).get("containers") or [{}])[0]).get("name", "ray-worker")
        terminated = {"exitCode": 1, "reason": "Error", "message": message, "finishedAt": now_rfc3339()}
        status.update(conditions=conds, phase="Failed",
                      containerStatuses=[{"name": container, "ready": False, "restartCount": run.restarts,
                                          "image": "", "imageID": "", "state": {"terminated": terminated}}])
        with contextlib.suppress(ApiError):
            self.store.patch("pods", run.pod, {"status": status}, run.namespace, subresource="status")

    def _stop_pod(self, run: PodRun) -> None:
        with self._lock:
            if run.state in ("stopping", "stopped"):
                return
            run.state = "stopping"
        t = threading.Thread(target=self._stop_node, args=(run,), name=f"raypod-stop-{run.pod}", daemon=True)
        run.threads.append(t)
        t.start()

    def _stop_node(self, run: PodRun) -> None:
        for t in run.threads[:-1]:  # a start still under way finishes (or fails) first
            t.join(self.start_timeout_s + 30)
        try:
            if run.node_id is not None:
                self.cluster.remove_node(run.node_id, grace_s=self.drain_grace_s)
        except Exception as e:
            log.exception("removing the Ray node of pod %s/%s", run.namespace, run.pod)
            self.errors.append(e)
        finally:
            with self._lock:
                run.state, run.stopped_s = "stopped", time.monotonic()
            self._remove_finalizer(run.namespace, run.pod, run.uid)

    def _remove_finalizer(self, ns: str, name: str, uid: str | None = None) -> None:
        for _ in range(5):
            pod = self.store.try_get("pods", name, ns)
            if pod is None or (uid is not None and pod["metadata"]["uid"] != uid):
                return
            fins = list(pod["metadata"].get("finalizers") or [])
            if FINALIZER not in fins:
                return
            try:
                self.store.patch(
                    "pods",
                    name,
                    [
                        {"op": "test", "path": "/metadata/resourceVersion",
                         "value": pod["metadata"]["resourceVersion"]},
                        {"op": "replace", "path": "/metadata/finalizers", "value": [f for f in fins if f != FINALIZER]},
                    ],
                    ns,
                    patch_type="json",
                )
                return
            except ApiError as e:
                if e.code not in (404, 409, 422):
                    raise
                if e.code == 404:
                    return

    # --- shutdown ------------------------------------------------------------------------------------
    def close(self, grace_s: float = 5.0) -> None:
        """Stop the loop and every Ray node this kubelet started (their pods lose the finalizer)."""
        self.stop()
        self.drain_grace_s = min(self.drain_grace_s, grace_s)
        for r in self.live():
            self._stop_pod(r)
        with self._lock:
            runs = list(self.runs.values())
        for r in runs:
            for t in list(r.threads):
                t.join(self.start_timeout_s + 60)


__all__ = ["FINALIZER", "PodRun", "RayPodKubelet", "ray_start_params"]
