"""The Karpenter and KubeRay stand-ins on the emulator."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import watch

from rayscale.testing.karpenter import (
    CapacityError,
    Delays,
    KarpenterConfig,
    KarpenterStandIn,
)
from rayscale.testing.kubeapi import KubeAPIServer, Store
from rayscale.testing.kuberay import KubeRayStandIn, desired_workers
from rayscale.testing.scheduler import ManualClock, wait_for

from .conftest import Clients
from .manifests import nodeclaim, raycluster

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}


@pytest.fixture
def store(api: KubeAPIServer) -> Store:
    return api.store


def conditions(store: Store, name: str) -> dict[str, str]:
    claim = store.get("nodeclaims", name)
    return {c["type"]: c["status"] for c in (claim.get("status") or {}).get("conditions") or ()}


# -- Karpenter ---------------------------------------------------------------------------------------


def test_karpenter_lifecycle_is_deterministic_with_a_manual_clock(store: Store) -> None:
    clock = ManualClock()
    cfg = KarpenterConfig(delays=Delays(launch=10, register=30, initialize=60))
    k = KarpenterStandIn(store, cfg, clock=clock)
    store.create("nodeclaims", nodeclaim("g-0", zones=("us-east-1b",), taints=[GPU_TAINT]))
    k.step()
    assert conditions(store, "g-0") == {
        "Launched": "Unknown",
        "Registered": "Unknown",
        "Initialized": "Unknown",
        "Ready": "Unknown",
    }
    assert store.get("nodeclaims", "g-0")["metadata"]["finalizers"] == ["karpenter.sh/termination"]
    clock.advance(9.9)
    k.step()
    assert conditions(store, "g-0")["Launched"] == "Unknown"
    clock.advance(0.1)
    k.step()
    claim = store.get("nodeclaims", "g-0")
    assert conditions(store, "g-0")["Launched"] == "True"
    assert claim["status"]["providerID"].startswith("aws:///us-east-1b/i-")
    assert claim["status"]["capacity"]["nvidia.com/gpu"] == "1"
    assert claim["metadata"]["labels"]["node.kubernetes.io/instance-type"] == "g5.xlarge"
    assert store.list("nodes")[0] == []
    clock.advance(30)
    k.step()
    claim = store.get("nodeclaims", "g-0")
    assert (
        conditions(store, "g-0")["Registered"] == "True"
        and conditions(store, "g-0")["Initialized"] == "Unknown"
    )
    node = store.get("nodes", claim["status"]["nodeName"])
    labels = node["metadata"]["labels"]
    assert labels["rayscale.io/flavor"] == "a10g"
    assert labels["node.kubernetes.io/instance-type"] == "g5.xlarge"
    assert labels["topology.kubernetes.io/zone"] == "us-east-1b"
    assert labels["karpenter.sh/capacity-type"] == "on-demand"
    assert node["spec"]["taints"] == [GPU_TAINT]
    assert "nvidia.com/gpu" not in node["status"]["allocatable"]  # GPUs appear at initialization
    clock.advance(60)
    k.step()
    assert conditions(store, "g-0") == {
        "Launched": "True",
        "Registered": "True",
        "Initialized": "True",
        "Ready": "True",
    }
    node = store.get("nodes", claim["status"]["nodeName"])
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "1"
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])
    assert k.errors == []


def test_conditions_progress_in_order_as_seen_by_a_watch(
    api: KubeAPIServer, k8s: Clients, store: Store
) -> None:
    start = k8s.custom.list_cluster_custom_object("karpenter.sh", "v1", "nodeclaims")["metadata"][
        "resourceVersion"
    ]
    with KarpenterStandIn(store, KarpenterConfig(delays=Delays(0.05, 0.05, 0.05))):
        k8s.custom.create_cluster_custom_object("karpenter.sh", "v1", "nodeclaims", nodeclaim("w-0"))
        wait_for(lambda: conditions(store, "w-0").get("Initialized") == "True", 10, what="initialized")
    order: list[str] = []
    for e in watch.Watch().stream(
        k8s.custom.list_cluster_custom_object,
        "karpenter.sh",
        "v1",
        "nodeclaims",
        resource_version=start,
        timeout_seconds=1,
    ):
        for c in (e["object"].get("status") or {}).get("conditions") or ():
            if c["status"] == "True" and c["type"] not in order:
                order.append(c["type"])
    assert order == ["Launched", "Registered", "Initialized", "Ready"]


def test_capacity_error_marks_launch_failed_then_deletes_the_claim(store: Store) -> None:
    clock = ManualClock()
    k = KarpenterStandIn(
        store,
        KarpenterConfig(
            capacity_errors={CapacityError("g5.xlarge", "us-east-1a")}, delete_after_capacity_error=5
        ),
        clock=clock,
    )
    store.create("nodeclaims", nodeclaim("ice", zones=("us-east-1a",)))
    k.step()
    k.step()
    claim = store.get("nodeclaims", "ice")
    launched = next(c for c in claim["status"]["conditions"] if c["type"] == "Launched")
    assert (launched["status"], launched["reason"]) == ("False", "InsufficientCapacityError")
    assert "g5.xlarge/us-east-1a/on-demand" in launched["message"]
    clock.advance(5)
    k.step()  # delete: deletionTimestamp set, finalizer still ours
    k.step()  # terminate: finalizer removed
    assert store.try_get("nodeclaims", "ice") is None
    assert store.list("nodes")[0] == []
    assert k.capacity_failures == ["ice"]


def test_capacity_errors_are_per_instance_type_and_zone(store: Store) -> None:
    k = KarpenterStandIn(store, KarpenterConfig(capacity_errors={CapacityError("g5.xlarge", "us-east-1a")}))
    store.create(
        "nodeclaims", nodeclaim("z", instance_types=("g5.xlarge",), zones=("us-east-1a", "us-east-1b"))
    )
    store.create(
        "nodeclaims", nodeclaim("t", instance_types=("g5.xlarge", "g6.xlarge"), zones=("us-east-1a",))
    )
    for _ in range(3):
        k.step()
    assert {(c, it, z) for c, it, z, _ in k.launched} == {
        ("z", "g5.xlarge", "us-east-1b"),
        ("t", "g6.xlarge", "us-east-1a"),
    }


def test_deleting_a_claim_evicts_pods_deletes_the_node_then_the_claim(store: Store) -> None:
    k = KarpenterStandIn(store)
    store.create("nodeclaims", nodeclaim("d"))
    for _ in range(4):
        k.step()
    node_name = store.get("nodeclaims", "d")["status"]["nodeName"]
    store.create(
        "pods",
        {
            "metadata": {"name": "p", "namespace": "default"},
            "spec": {"nodeName": node_name, "containers": []},
        },
    )
    store.delete("nodeclaims", "d")
    assert store.get("nodeclaims", "d")["metadata"]["deletionTimestamp"]
    k.step()
    assert store.try_get("nodes", node_name) is None
    assert store.try_get("pods", "p", "default") is None
    assert store.try_get("nodeclaims", "d") is None


def test_deleting_the_node_directly_takes_the_claim(store: Store) -> None:
    k = KarpenterStandIn(store)
    store.create("nodeclaims", nodeclaim("n"))
    for _ in range(4):
        k.step()
    node_name = store.get("nodeclaims", "n")["status"]["nodeName"]
    store.delete("nodes", node_name)
    for _ in range(3):
        k.step()
    assert store.try_get("nodeclaims", "n") is None and store.try_get("nodes", node_name) is None


def test_do_not_disrupt_blocks_voluntary_disruption(store: Store) -> None:
    k = KarpenterStandIn(store)
    store.create("nodeclaims", nodeclaim("keep"))
    store.create("nodeclaims", nodeclaim("go"))
    for _ in range(4):
        k.step()
    node = store.get("nodeclaims", "keep")["status"]["nodeName"]
    store.patch("nodes", node, {"metadata": {"annotations": {"karpenter.sh/do-not-disrupt": "true"}}})
    assert k.disrupt("keep") is False
    assert k.disrupt("go") is True
    k.step()
    assert store.try_get("nodeclaims", "keep") is not None
    assert store.try_get("nodeclaims", "go") is None


# -- KubeRay ---------------------------------------------------------------------------------------------


@pytest.fixture
def cluster(store: Store) -> Iterator[tuple[KarpenterStandIn, KubeRayStandIn]]:
    k = KarpenterStandIn(store, KarpenterConfig(delays=Delays(0.02, 0.02, 0.02)))
    kr = KubeRayStandIn(store)
    k.start()
    kr.start()
    try:
        yield k, kr
    finally:
        kr.stop()
        k.stop()
    assert k.errors == [] and kr.errors == [] and kr.scheduler is not None and kr.scheduler.errors == []


def workers(store: Store, cluster_name: str = "rc") -> list[dict[str, Any]]:
    pods, _ = store.list("pods", "default", f"ray.io/cluster={cluster_name},ray.io/node-type=worker")
    return pods


def test_worker_pods_follow_replicas_and_wait_for_matching_nodes(store: Store, cluster: Any) -> None:
    store.create("rayclusters", raycluster("rc", replicas=2))
    wait_for(lambda: len(workers(store)) == 2, 5, what="2 worker pods")
    pods = workers(store)
    for p in pods:
        assert (
            p["metadata"]["name"].startswith("rc-a10g-worker-")
            and len(p["metadata"]["name"]) == len("rc-a10g-worker-") + 5
        )
        assert p["metadata"]["labels"]["ray.io/group"] == "a10g"
        assert p["metadata"]["ownerReferences"][0]["kind"] == "RayCluster"
    # no node matches the nodeSelector yet: the pods stay Pending and Unschedulable
    wait_for(
        lambda: all(
            any(c.get("reason") == "Unschedulable" for c in (p.get("status") or {}).get("conditions") or ())
            for p in workers(store)
        ),
        5,
        what="unschedulable",
    )
    assert all(p["status"]["phase"] == "Pending" for p in workers(store))
    for i in range(2):
        store.create("nodeclaims", nodeclaim(f"g-{i}", taints=[GPU_TAINT]))
    wait_for(
        lambda: (
            (store.get("rayclusters", "rc", "default").get("status") or {}).get("readyWorkerReplicas") == 2
        ),
        10,
        what="2 ready workers",
    )
    nodes = {p["spec"]["nodeName"] for p in workers(store)}
    assert len(nodes) == 2  # one GPU each: the second pod cannot share the first node
    status = store.get("rayclusters", "rc", "default")["status"]
    assert status["desiredWorkerReplicas"] == 2 and status["availableWorkerReplicas"] == 2


def test_workers_to_delete_removes_exactly_those_pods_and_is_not_cleared(store: Store, cluster: Any) -> None:
    for i in range(3):
        store.create("nodeclaims", nodeclaim(f"g-{i}", taints=[GPU_TAINT]))
    store.create("rayclusters", raycluster("rc", replicas=3, autoscaling=True))
    wait_for(
        lambda: (
            (store.get("rayclusters", "rc", "default").get("status") or {}).get("readyWorkerReplicas") == 3
        ),
        10,
        what="3 ready",
    )
    names = sorted(p["metadata"]["name"] for p in workers(store))
    victim = names[1]
    rc = store.get("rayclusters", "rc", "default")
    group = rc["spec"]["workerGroupSpecs"][0]
    group["replicas"] = 2
    group["scaleStrategy"] = {"workersToDelete": [victim]}
    store.update("rayclusters", rc)
    wait_for(lambda: victim not in {p["metadata"]["name"] for p in workers(store)}, 5, what="victim deleted")
    wait_for(
        lambda: (
            (store.get("rayclusters", "rc", "default").get("status") or {}).get("desiredWorkerReplicas") == 2
        ),
        5,
    )
    assert sorted(p["metadata"]["name"] for p in workers(store)) == [names[0], names[2]]
    _, kr = cluster
    assert victim in kr.deleted_pods and set(kr.deleted_pods) == {victim}
    # KubeRay leaves the list for the client to clear once the pods are gone (kuberay#733)
    assert store.get("rayclusters", "rc", "default")["spec"]["workerGroupSpecs"][0]["scaleStrategy"][
        "workersToDelete"
    ] == [victim]


def test_without_autoscaling_surplus_pods_are_deleted_and_with_it_they_stay(store: Store) -> None:
    kr = KubeRayStandIn(store, schedule=False)
    store.create("rayclusters", raycluster("plain", replicas=3))
    store.create("rayclusters", raycluster("auto", replicas=3, autoscaling=True))
    kr.step()
    assert len(workers(store, "plain")) == 3 and len(workers(store, "auto")) == 3
    for name in ("plain", "auto"):
        store.patch(
            "rayclusters",
            name,
            {
                "spec": {
                    "workerGroupSpecs": [{**raycluster(name)["spec"]["workerGroupSpecs"][0], "replicas": 1}]
                }
            },
            "default",
        )
    kr.step()
    assert len(workers(store, "plain")) == 1
    assert len(workers(store, "auto")) == 3  # only workersToDelete may remove pods under autoscaling


def test_replicas_are_clamped_and_multiplied_by_hosts() -> None:
    assert desired_workers({"replicas": 10, "minReplicas": 0, "maxReplicas": 4}) == 4
    assert desired_workers({"replicas": 0, "minReplicas": 2, "maxReplicas": 4}) == 2
    assert desired_workers({"replicas": 2, "numOfHosts": 2}) == 4
    assert desired_workers({"replicas": 2, "suspend": True}) == 0


def test_deleting_the_raycluster_garbage_collects_its_pods(store: Store) -> None:
    kr = KubeRayStandIn(store, schedule=False)
    store.create("rayclusters", raycluster("rc", replicas=2))
    kr.step()
    assert len(store.list("pods", "default")[0]) == 3  # head + 2 workers
    store.delete("rayclusters", "rc", "default")
    assert store.list("pods", "default")[0] == []


def test_clear_workers_to_delete_option(store: Store) -> None:
    kr = KubeRayStandIn(store, schedule=False, clear_workers_to_delete=True)
    store.create("rayclusters", raycluster("rc", replicas=2, autoscaling=True))
    kr.step()
    victim = workers(store)[0]["metadata"]["name"]
    rc = store.get("rayclusters", "rc", "default")
    rc["spec"]["workerGroupSpecs"][0].update(replicas=1, scaleStrategy={"workersToDelete": [victim]})
    store.update("rayclusters", rc)
    kr.step()
    assert [p["metadata"]["name"] for p in workers(store)] != [victim] and len(workers(store)) == 1
    assert (
        store.get("rayclusters", "rc", "default")["spec"]["workerGroupSpecs"][0]["scaleStrategy"][
            "workersToDelete"
        ]
        == []
    )
