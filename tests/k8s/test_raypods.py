"""RayPodKubelet without Ray: what a worker pod's `ray start` declares, and the pod lifecycle it drives
(IP, Running only once the Ray node is up, Terminating until the Ray node is gone). The real Ray nodes
are exercised by tests/e2e/test_kube_controller.py."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
from rayscale_testing.karpenter import KarpenterStandIn
from rayscale_testing.kubeapi import KubeAPIServer, Store
from rayscale_testing.kuberay import KubeRayStandIn
from rayscale_testing.raypods import FINALIZER, RayPodKubelet, ray_start_params
from rayscale_testing.scheduler import wait_for

from rayscale.cluster.local import LocalFlavor

from .manifests import nodeclaim, raycluster


def test_ray_start_params_follow_kuberay() -> None:
    rendered = {"rayStartParams": {"num-gpus": "1", "resources": '"{\\"accelerator_type:A10G\\": 1}"'}}
    container = {"resources": {"limits": {"cpu": "2", "memory": "13Gi", "nvidia.com/gpu": "1"},
                               "requests": {"cpu": "2", "memory": "13Gi"}}}
    assert ray_start_params(rendered, container) == {
        "num-cpus": 2.0, "num-gpus": 1.0, "resources": {"accelerator_type:A10G": 1.0}}
    # Nothing in rayStartParams: CPUs from the limit (rounded up, as Quantity.Value()), GPUs from the limit.
    bare = {"resources": {"limits": {"cpu": "1500m", "nvidia.com/gpu": "4"}}}
    assert ray_start_params({}, bare) == {"num-cpus": 2.0, "num-gpus": 4.0, "resources": {}}
    # Neuron: the first custom accelerator in the limits becomes a Ray resource, unless one is given.
    neuron = {"resources": {"limits": {"cpu": "6", "aws.amazon.com/neuron": "1", "aws.amazon.com/neuroncore": "2"}}}
    assert ray_start_params({"rayStartParams": {"resources": "'{\"accelerator_type:Inferentia2\": 1}'"}}, neuron) == {
        "num-cpus": 6.0, "num-gpus": 0.0, "resources": {"accelerator_type:Inferentia2": 1.0, "neuron_cores": 2.0}}
    given = {"rayStartParams": {"num-cpus": "1", "resources": '"{\\"neuron_cores\\": 1}"'}}
    assert ray_start_params(given, neuron)["resources"] == {"neuron_cores": 1.0}


@dataclass
class FakeCluster:
    """LocalCluster's node calls, recorded; ``remove_node`` blocks until ``release`` is set."""

    added: list[tuple[LocalFlavor, str | None]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    failures: int = 0  # the first starts that fail (a raylet timing out on a busy machine)
    exited: set[str] = field(default_factory=set)  # nodes whose raylet exited (a drain done)

    def add_node(self, flavor: LocalFlavor, node_ip: str | None = None, wait: bool = True) -> str:
        self.added.append((flavor, node_ip))
        return f"{flavor.name}-{len(self.added)}"

    def wait_node(self, node_id: str, timeout_s: float = 0.0) -> Any:
        if self.failures:
            self.failures -= 1
            raise RuntimeError(f"node {node_id} exited while starting")
        return type("Node", (), {"ray_node_id": f"ray-{node_id}"})()

    def nodes(self) -> list[Any]:
        """The alive nodes, as LocalCluster.nodes() lists them."""
        started = [f"{f.name}-{i}" for i, (f, _) in enumerate(self.added, start=1)]
        return [type("Node", (), {"id": n})() for n in started if n not in self.exited and n not in self.removed]

    def remove_node(self, node_id: str, grace_s: float | None = None) -> None:
        if grace_s != 0:  # a failed start is cleaned up at once; a drain waits for the test
            assert self.release.wait(10)
        self.removed.append(node_id)


def pods(store: Store) -> list[dict[str, Any]]:
    return store.list("pods", "default", "ray.io/cluster=rc,ray.io/node-type=worker")[0]


@pytest.fixture
def store(api: KubeAPIServer) -> Store:
    return api.store


def one_bound_worker_pod(store: Store, kubelet: RayPodKubelet, restart_policy: str | None = None) -> KubeRayStandIn:
    """A GPU node from Karpenter and a one-worker RayCluster whose pod KubeRay created and bound; running
    it is left to ``kubelet``."""
    kuberay = KubeRayStandIn(store, external_kubelet=kubelet.runs_pod)
    karpenter = KarpenterStandIn(store)
    store.create("nodeclaims", nodeclaim("g-0", taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]))
    for _ in range(6):
        karpenter.step()
    store.create("rayclusters", raycluster("rc", replicas=1, restart_policy=restart_policy))
    kuberay.step()
    return kuberay


def test_a_worker_pod_runs_as_a_ray_node_and_terminates_with_it(store: Store) -> None:
    cluster = FakeCluster()
    kubelet = RayPodKubelet(store, cluster, namespace="default", raycluster="rc")  # type: ignore[arg-type]
    kuberay = one_bound_worker_pod(store, kubelet)
    (pod,) = pods(store)
    assert pod["spec"].get("nodeName") and pod["status"].get("phase") == "Pending"
    kubelet.step()
    wait_for(lambda: pods(store)[0]["status"].get("phase") == "Running", 5, what="pod Running")
    (pod,) = pods(store)
    name = pod["metadata"]["name"]
    assert pod["status"]["podIP"] == "127.0.0.3" and FINALIZER in pod["metadata"]["finalizers"]
    assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "True"
    ((spec, ip),) = cluster.added
    assert ip == "127.0.0.3" and spec.name == "a10g" and spec.num_gpus == 1
    assert spec.labels["rayscale.io/pod"] == name
    run = kubelet.run_of(name)
    assert run is not None and run.state == "running" and run.ray_node_id == "ray-a10g-1"

    # KubeRay deletes the pod: it stays Terminating until its Ray node is removed, then goes.
    rc = store.get("rayclusters", "rc", "default")
    rc["spec"]["workerGroupSpecs"][0].update(replicas=0, scaleStrategy={"workersToDelete": [name]})
    store.update("rayclusters", rc)
    kuberay.step()
    kubelet.step()
    assert pods(store)[0]["metadata"].get("deletionTimestamp") and run.state == "stopping"
    cluster.release.set()
    wait_for(lambda: pods(store) == [], 5, what="the pod gone once its Ray node is")
    assert cluster.removed == ["a10g-1"] and run.state == "stopped"
    kubelet.close()


def test_a_failed_ray_start_is_restarted_like_a_container(store: Store) -> None:
    cluster = FakeCluster(failures=2)
    kubelet = RayPodKubelet(store, cluster, namespace="default", restart_backoff_s=0.01)  # type: ignore[arg-type]
    one_bound_worker_pod(store, kubelet)
    kubelet.step()
    wait_for(lambda: pods(store)[0]["status"].get("phase") == "Running", 5, what="pod Running after restarts")
    (pod,) = pods(store)
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 2 and pod["status"]["podIP"] == "127.0.0.3"
    assert [ip for _, ip in cluster.added] == ["127.0.0.3"] * 3  # the same pod IP on every restart
    assert cluster.removed == ["a10g-1", "a10g-2"]  # the failed starts cleaned up
    run = kubelet.run_of(pod["metadata"]["name"])
    assert run is not None and run.state == "running" and run.node_id == "a10g-3" and not kubelet.errors
    cluster.release.set()
    kubelet.close()


def test_under_restart_policy_never_an_exited_ray_node_fails_its_pod_and_kuberay_replaces_it(store: Store) -> None:
    """A drained raylet exits once idle: under ``restartPolicy: Never`` its container is not restarted in
    place, the pod turns Failed, and KubeRay deletes it (``shouldDeletePod``) and creates another."""
    cluster = FakeCluster()
    kubelet = RayPodKubelet(store, cluster, namespace="default", raycluster="rc", exit_poll_s=0.0)  # type: ignore[arg-type]
    kuberay = one_bound_worker_pod(store, kubelet, restart_policy="Never")
    kubelet.step()
    wait_for(lambda: pods(store)[0]["status"].get("phase") == "Running", 5, what="pod Running")
    (pod,) = pods(store)
    first = pod["metadata"]["name"]
    kubelet.step()
    assert kubelet.run_of(first).state == "running"  # type: ignore[union-attr]  # alive: nothing ends
    cluster.exited.add("a10g-1")
    kubelet.step()
    (pod,) = pods(store)
    assert pod["status"]["phase"] == "Failed" and kubelet.run_of(first).state == "exited"  # type: ignore[union-attr]
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 1
    assert len(cluster.added) == 1  # not restarted in place
    kuberay.step()  # deletes the failed pod; it stays Terminating until the kubelet let its node go
    assert [p["metadata"]["name"] for p in pods(store) if p["metadata"].get("deletionTimestamp")] == [first]
    cluster.release.set()
    kubelet.step()
    wait_for(lambda: all(p["metadata"]["name"] != first for p in pods(store)), 5, what="the failed pod gone")
    kuberay.step()  # and creates its replacement, which runs as a new Ray node
    (pod,) = pods(store)
    assert pod["metadata"]["name"] != first
    kubelet.step()
    wait_for(lambda: pods(store)[0]["status"].get("phase") == "Running", 5, what="the replacement Running")
    assert [ip for _, ip in cluster.added] == ["127.0.0.3", "127.0.0.4"] and not kubelet.errors
    kubelet.close()


def test_under_restart_policy_never_a_failed_start_is_not_restarted(store: Store) -> None:
    cluster = FakeCluster(failures=1)
    kubelet = RayPodKubelet(store, cluster, namespace="default", restart_backoff_s=0.01)  # type: ignore[arg-type]
    kuberay = one_bound_worker_pod(store, kubelet, restart_policy="Never")
    kubelet.step()
    wait_for(lambda: pods(store)[0]["status"].get("phase") == "Failed", 5, what="pod Failed")
    (pod,) = pods(store)
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0 and len(cluster.added) == 1
    assert cluster.removed == ["a10g-1"] and not kubelet.errors  # the failed start cleaned up
    kuberay.step()
    kubelet.step()
    wait_for(lambda: all(p["metadata"]["name"] != pod["metadata"]["name"] for p in pods(store)), 5,
             what="KubeRay deletes the failed pod")
    kuberay.step()
    kubelet.step()
    wait_for(lambda: [p["status"].get("phase") for p in pods(store)] == ["Running"], 5,
             what="its replacement Running")
    cluster.release.set()
    kubelet.close()
