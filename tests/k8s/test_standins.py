"""The Karpenter and KubeRay stand-ins on the emulator."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import watch
from rayscale_testing.karpenter import (
    CapacityError,
    Delays,
    KarpenterConfig,
    KarpenterStandIn,
)
from rayscale_testing.kubeapi import KubeAPIServer, Store
from rayscale_testing.kuberay import KubeRayStandIn, desired_workers
from rayscale_testing.scheduler import ManualClock, wait_for

from rayscale.core.catalog import Catalog

from .conftest import Clients
from .kubeworld import rendered
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


def claim_events(store: Store, name: str) -> list[dict[str, Any]]:
    """Events on a NodeClaim: cluster-scoped, so client-go's recorder writes them to ``default``."""
    return store.list("events", "default", field_selector=f"involvedObject.kind=NodeClaim,involvedObject.name={name}")[0]


def test_capacity_error_is_an_event_and_the_claim_is_deleted_never_launched_false(store: Store) -> None:
    """launch.go launchNodeClaim: InsufficientCapacityError Event, then delete; Launched stays Unknown."""
    k = KarpenterStandIn(store, KarpenterConfig(capacity_errors={CapacityError("g5.xlarge", "us-east-1a")}))
    store.create("nodeclaims", nodeclaim("ice", zones=("us-east-1a",)))
    k.step()  # conditions Unknown
    seen: list[str | None] = []
    store.add_listener(lambda ev: seen.append(
        next((c["status"] for c in (ev.obj.get("status") or {}).get("conditions") or () if c["type"] == "Launched"),
             None) if ev.type_key == "nodeclaims" else "other"))
    k.step()  # launch fails: Event, delete (deletionTimestamp, our finalizer)
    k.step()  # terminate: finalizer removed
    assert store.try_get("nodeclaims", "ice") is None and store.list("nodes")[0] == []
    assert "False" not in seen  # upstream never writes Launched=False
    (ev,) = claim_events(store, "ice")
    assert (ev["reason"], ev["type"]) == ("InsufficientCapacityError", "Warning")
    assert "g5.xlarge/us-east-1a/on-demand" in ev["message"]
    assert k.capacity_failures == ["ice"] and k.deleted == [("ice", "insufficient_capacity")]


def test_liveness_deletes_a_claim_not_launched_in_5_min_or_not_registered_in_15(store: Store) -> None:
    """lifecycle/liveness.go: LaunchTimeout 5 min, registrationTimeout 15 min, no Event."""
    clock = ManualClock()
    k = KarpenterStandIn(store, KarpenterConfig(delays=Delays(launch=10, register=10, initialize=10)), clock=clock)
    for name in ("unlaunched", "unregistered", "fine"):
        store.create("nodeclaims", nodeclaim(name))
    k.step()
    k.config.held.add("unlaunched")  # the cloud never answers for this one
    clock.advance(10)
    k.step()  # the other two launch
    k.config.held.add("unregistered")  # its instance never joins
    for _ in range(4):
        clock.advance(10)
        k.step()
    assert conditions(store, "fine")["Initialized"] == "True"
    clock.advance(300 - 50 - 0.1)
    k.step()
    assert store.try_get("nodeclaims", "unlaunched") is not None
    clock.advance(0.1)
    k.step()
    k.step()
    assert store.try_get("nodeclaims", "unlaunched") is None
    assert store.try_get("nodeclaims", "unregistered") is not None  # launched: 15 min apply
    clock.advance(600)
    k.step()
    k.step()
    assert store.try_get("nodeclaims", "unregistered") is None
    assert store.try_get("nodeclaims", "fine") is not None  # registered claims have no deadline
    assert k.deleted == [("unlaunched", "launch_timeout"), ("unregistered", "registration_timeout")]
    assert claim_events(store, "unlaunched") == [] and claim_events(store, "unregistered") == []


def test_expiry_is_forceful_and_ignores_do_not_disrupt(store: Store) -> None:
    """expiration/controller.go: deleted expireAfter after creation, do-not-disrupt notwithstanding."""
    clock = ManualClock()
    k = KarpenterStandIn(store, clock=clock)
    claim = nodeclaim("old")
    claim["spec"]["expireAfter"] = "1h"
    claim["metadata"]["annotations"] = {"karpenter.sh/do-not-disrupt": "true"}
    store.create("nodeclaims", claim)
    store.create("nodeclaims", nodeclaim("never"))  # expireAfter: Never
    for _ in range(4):
        k.step()
    clock.advance(3599)
    k.step()
    assert store.try_get("nodeclaims", "old") is not None
    clock.advance(1)
    k.step()
    k.step()
    assert store.try_get("nodeclaims", "old") is None and store.try_get("nodeclaims", "never") is not None
    assert k.deleted == [("old", "expired")]


def pool_claim(name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    c = nodeclaim(name, taints=[GPU_TAINT], labels={"karpenter.sh/nodepool": "a10g"})
    if annotations:
        c["metadata"]["annotations"] = annotations
    return c


@pytest.fixture
def a10g_pool(store: Store, catalog: Catalog) -> dict[str, Any]:
    """The rendered a10g NodePool: WhenEmpty, consolidateAfter 10m, one Empty node at a time."""
    (pool,) = rendered(catalog, "nodepools/a10g.yaml")
    return store.create("nodepools", pool)


def test_an_empty_node_is_consolidated_consolidate_after_it_emptied_unless_do_not_disrupt(
    store: Store, a10g_pool: dict[str, Any]
) -> None:
    """consolidation.go / emptiness.go / statenode.go, with the rendered pool (consolidateAfter 10m)."""
    assert a10g_pool["spec"]["disruption"]["consolidateAfter"] == "10m"
    clock = ManualClock()
    k = KarpenterStandIn(store, clock=clock)
    store.create("nodeclaims", pool_claim("empty"))
    store.create("nodeclaims", pool_claim("pinned", {"karpenter.sh/do-not-disrupt": "true"}))
    store.create("nodeclaims", pool_claim("busy"))
    store.create("nodeclaims", nodeclaim("no-pool"))  # no karpenter.sh/nodepool label: never a candidate
    for _ in range(4):
        k.step()
    busy_node = store.get("nodeclaims", "busy")["status"]["nodeName"]
    pod = {"metadata": {"name": "p", "namespace": "default"}, "spec": {"nodeName": busy_node, "containers": []}}
    store.create("pods", pod)
    # the claim's annotation reached the Node at registration, where Karpenter reads it from then on
    pinned_node = store.get("nodeclaims", "pinned")["status"]["nodeName"]
    assert store.get("nodes", pinned_node)["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    clock.advance(599)
    k.step()
    assert k.disruptions == []
    clock.advance(1)
    k.step()
    k.step()
    assert k.disruptions == [("empty", "Empty")] and store.try_get("nodeclaims", "empty") is None
    # a node emptied later waits its own consolidateAfter from the moment its last pod left
    store.delete("pods", "p", "default")
    clock.advance(599)
    k.step()
    assert store.try_get("nodeclaims", "busy") is not None
    clock.advance(1)
    k.step()
    k.step()
    assert store.try_get("nodeclaims", "busy") is None
    assert {c["metadata"]["name"] for c in store.list("nodeclaims")[0]} == {"pinned", "no-pool"}


def test_empty_consolidation_respects_the_pools_empty_budget(store: Store, a10g_pool: dict[str, Any]) -> None:
    """helpers.go BuildDisruptionBudgetMapping: the rendered pool allows one Empty node at a time."""
    clock = ManualClock()
    k = KarpenterStandIn(store, KarpenterConfig(termination_delay=30), clock=clock)
    for i in range(3):
        store.create("nodeclaims", pool_claim(f"e-{i}"))
    for _ in range(4):
        k.step()
    clock.advance(600)
    k.step()
    k.step()  # the first one starts terminating
    clock.advance(29)
    k.step()
    assert len(k.disruptions) == 1  # the other two wait while the first one terminates
    clock.advance(1)
    k.step()  # terminated: the budget frees up
    k.step()
    assert len(k.disruptions) == 2


def test_deleting_a_nodepool_cascades_to_owned_claims_only(store: Store, a10g_pool: dict[str, Any]) -> None:
    """Kubernetes' garbage collector follows ownerReferences (Karpenter sets them on its own claims,
    nodeclaimtemplate.go); a claim that only carries the nodepool label escapes the cascade."""
    k = KarpenterStandIn(store)
    owned = pool_claim("owned")
    owned["metadata"]["ownerReferences"] = [{
        "apiVersion": "karpenter.sh/v1", "kind": "NodePool", "name": "a10g",
        "uid": a10g_pool["metadata"]["uid"], "blockOwnerDeletion": True,
    }]
    store.create("nodeclaims", owned)
    store.create("nodeclaims", pool_claim("orphan"))
    for _ in range(4):
        k.step()
    owned_node = store.get("nodeclaims", "owned")["status"]["nodeName"]
    store.delete("nodepools", "a10g")
    k.step()
    k.step()
    assert store.try_get("nodeclaims", "owned") is None and store.try_get("nodes", owned_node) is None
    assert store.try_get("nodeclaims", "orphan") is not None


def test_pool_limits_do_not_stop_a_claim_karpenter_did_not_create(store: Store, a10g_pool: dict[str, Any]) -> None:
    """provisioner.go Create checks limits for Karpenter's own claims only; a third-party claim over
    the pool's limit still launches."""
    pool = store.get("nodepools", "a10g")
    pool["spec"]["limits"] = {"nvidia.com/gpu": "1"}
    store.update("nodepools", pool)
    k = KarpenterStandIn(store)
    store.create("nodeclaims", pool_claim("a"))
    store.create("nodeclaims", pool_claim("b"))
    for _ in range(4):
        k.step()
    assert conditions(store, "a")["Initialized"] == "True" and conditions(store, "b")["Initialized"] == "True"


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
