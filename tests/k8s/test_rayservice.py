"""KubeActuator with a KubeRay RayService: it drives the RayCluster the RayService's status names.

KubeRay names a RayService's cluster itself and replaces it on every cluster upgrade (a pending cluster
comes up beside the active one, traffic moves, the old one goes). The RayService stand-in here is the
test: it writes ``status.activeServiceStatus`` / ``pendingServiceStatus`` as KubeRay's RayService
controller does (see rayservice_controller.go), and the KubeRay stand-in runs each RayCluster's pods.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from rayscale_testing.kubeapi import KubeAPIServer
from rayscale_testing.rayservice import RayServiceStandIn, RecordedServe

from rayscale.cluster.kube import KubeError
from rayscale.core.act import Gang, GangPhase
from rayscale.core.catalog import Catalog

from .kubeworld import NS, World, make_world, rendered, rendered_raycluster
from .test_actuator import BIG, GROUP, act, up

RS = "llm"


@pytest.fixture
def world(catalog: Catalog) -> Iterator[World]:
    api = KubeAPIServer(default_watch_timeout=10, namespaces=("default", NS)).start()
    # make_world applies the plain RayCluster "rayscale" too: a cluster the RayService does not name,
    # which the actuator must leave alone.
    w = make_world(api, catalog)
    w.config = replace(w.config, rayservice=RS)
    w.actuator()
    rs = rendered(catalog, "deployments/k8s/rayservice.yaml")[0]
    rs["metadata"]["name"] = RS
    api.store.create("rayservices", rs, NS)
    try:
        yield w
    finally:
        w.close()
        api.stop()


def add_cluster(w: World, name: str) -> None:
    """What KubeRay creates for the RayService: its rayClusterConfig under a generated name."""
    rc = rendered_raycluster(w.catalog)
    rc["metadata"]["name"] = name
    w.api.store.create("rayclusters", rc, NS)


def set_status(w: World, active: str = "", pending: str = "") -> None:
    status: dict[str, Any] = {"activeServiceStatus": {}, "pendingServiceStatus": {}}
    if active:
        status["activeServiceStatus"] = {"rayClusterName": active}
    if pending:
        status["pendingServiceStatus"] = {"rayClusterName": pending}
    w.api.store.patch("rayservices", RS, {"status": status}, NS, subresource="status")


def group(w: World, cluster: str) -> dict[str, Any]:
    rc = w.api.store.get("rayclusters", cluster, NS)
    return next(g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == GROUP)


def workers(w: World, cluster: str) -> list[dict[str, Any]]:
    return w.api.store.list("pods", NS, f"ray.io/cluster={cluster},ray.io/node-type=worker")[0]


def head_nodes(w: World, n: int = 2) -> None:
    """Nodes of the rendered ray-head pool for the head pods (Karpenter would launch them for the pods):
    three heads during an upgrade (the plain RayCluster's, the active and the pending cluster's)."""
    for i in range(n):
        head_node(w, f"head-{i}")


def head_node(w: World, name: str) -> None:
    w.api.store.create("nodeclaims", {
        "apiVersion": "karpenter.sh/v1", "kind": "NodeClaim",
        "metadata": {"name": name, "labels": {"karpenter.sh/nodepool": "ray-head"},
                     "annotations": {"karpenter.sh/do-not-disrupt": "true"}},
        "spec": {"nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "ray-head"},
                 "requirements": [{"key": "node.kubernetes.io/instance-type", "operator": "In",
                                   "values": ["m6i.2xlarge"]}],
                 "taints": [{"key": "rayscale.io/ray-head", "effect": "NoSchedule"}]},
    })


@pytest.fixture
def kuberay(world: World) -> RayServiceStandIn:
    """KubeRay's RayService controller (the stand-in) over the world's RayService, with a head node."""
    head_nodes(world)
    return RayServiceStandIn(world.api.store, clock=world.clock)


def tick(w: World, rsc: RayServiceStandIn) -> list[Gang]:
    w.step()
    rsc.step()
    w.kuberay.step()
    assert w.act is not None
    return w.act.gangs(w.clock.now())


def until(w: World, rsc: RayServiceStandIn, pred: Callable[[list[Gang]], bool], what: str,
          ticks: int = 60) -> list[Gang]:
    for _ in range(ticks):
        try:
            gangs = tick(w, rsc)
        except KubeError:
            continue  # no cluster named yet: the controller skips the period
        if pred(gangs):
            return gangs
    raise AssertionError(f"not reached: {what}")


def active(w: World) -> str:
    status = w.api.store.get("rayservices", RS, NS).get("status") or {}
    return str((status.get("activeServiceStatus") or {}).get("rayClusterName") or "")


def pending(w: World) -> str:
    status = w.api.store.get("rayservices", RS, NS).get("status") or {}
    return str((status.get("pendingServiceStatus") or {}).get("rayClusterName") or "")


def edit_rayservice(w: World, fn: Callable[[dict[str, Any]], None]) -> None:
    rs = w.api.store.get("rayservices", RS, NS)
    fn(rs["spec"])
    w.api.store.update("rayservices", rs)


def deploy(w: World, rsc: RayServiceStandIn) -> tuple[str, Gang]:
    """First deploy through KubeRay's paths, then one gang of the big model on the active cluster."""
    until(w, rsc, lambda gs: active(w) != "", what="first cluster promoted")
    first = active(w)
    assert first.startswith(f"{RS}-") and rsc.created == [first]
    gangs: list[Gang] = []
    act(w, {BIG: 1}, gangs)
    (g,) = until(w, rsc, lambda gs: len(gs) == 1 and gs[0].phase == GangPhase.READY, what="gang ready")
    assert group(w, first)["replicas"] == 2 and len(workers(w, first)) == 2
    return first, g


def test_a_rayclusterconfig_change_starts_a_pending_cluster_and_kuberay_cuts_over(
    world: World, kuberay: RayServiceStandIn
) -> None:
    """rayservice_controller.go shouldPrepareNewCluster / reconcilePromotionAndServingStatus: a spec change
    that is not an appended worker group makes a new cluster at its manifest replicas; KubeRay promotes
    it once its Serve apps run, whatever workers it has; the old one goes after the deletion delay."""
    w, rsc = world, kuberay
    first, g = deploy(w, rsc)
    edit_rayservice(w, lambda spec: spec["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update(
        {"num-cpus": "1"}))
    (g,) = until(w, rsc, lambda gs: pending(w) != "" and w.api.store.try_get("rayclusters", pending(w), NS) is not None,
                 what="pending cluster")
    second = pending(w)
    assert second != first and g.phase == GangPhase.READY  # rayscale keeps driving the active cluster
    assert group(w, second)["replicas"] == 0  # the manifest's replicas: rayscale never gave it gangs
    until(w, rsc, lambda gs: active(w) == second, what="cut over")
    assert w.api.store.try_get("rayclusters", first, NS) is not None  # deleted only after 60 s
    # The actuator follows the new active cluster: the gang's workers come up there again.
    (g,) = until(w, rsc, lambda gs: len(gs) == 1 and gs[0].phase == GangPhase.READY and workers(w, second) != [],
                 what="gang ready on the new cluster")
    until(w, rsc, lambda gs: w.api.store.try_get("rayclusters", first, NS) is None, what="old cluster deleted")
    assert group(w, second)["replicas"] == 2
    assert isinstance(rsc.serve, RecordedServe)
    assert [c for c, _ in rsc.serve.submissions] == [first, second]


def test_appending_a_worker_group_rebuilds_the_active_cluster_from_the_manifest(
    world: World, kuberay: RayServiceStandIn
) -> None:
    """shouldUpdateCluster + modifyRayCluster: appended worker groups update the active cluster in place,
    every group back to its manifest replicas and workersToDelete cleared; KubeRay then deletes the
    surplus pods (no in-tree autoscaling), and rayscale raises the replicas again."""
    w, rsc = world, kuberay
    first, _ = deploy(w, rsc)
    before = {p["metadata"]["name"] for p in workers(w, first)}

    def append(spec: dict[str, Any]) -> None:
        extra = copy.deepcopy(spec["rayClusterConfig"]["workerGroupSpecs"][-1])
        extra["groupName"] = "extra"
        spec["rayClusterConfig"]["workerGroupSpecs"].append(extra)

    edit_rayservice(w, append)
    w.step()
    rsc.step()
    assert rsc.updated_in_place == [first] and rsc.created == [first] and pending(w) == ""
    assert group(w, first)["replicas"] == 0  # back to the manifest
    w.kuberay.step()
    assert workers(w, first) == []  # KubeRay deleted the gang's worker pods
    until(w, rsc, lambda gs: len(gs) == 1 and gs[0].phase == GangPhase.READY, what="ready again")
    assert group(w, first)["replicas"] == 2 and {p["metadata"]["name"] for p in workers(w, first)} != before


def test_kuberay_resubmits_serve_config_after_a_restart_and_on_a_change(
    world: World, kuberay: RayServiceStandIn
) -> None:
    """reconcileServe / checkIfNeedSubmitServeApplications: an empty cache (operator restart) or a changed
    serveConfigV2 re-submits to the active cluster; neither makes a new cluster."""
    w, rsc = world, kuberay
    first, _ = deploy(w, rsc)
    serve = rsc.serve
    assert isinstance(serve, RecordedServe) and [c for c, _ in serve.submissions] == [first]
    for _ in range(3):
        tick(w, rsc)
    assert len(serve.submissions) == 1  # cached and unchanged: nothing sent
    restarted = RayServiceStandIn(w.api.store, serve, clock=w.clock)
    tick(w, restarted)
    assert [c for c, _ in serve.submissions] == [first, first]
    edit_rayservice(w, lambda spec: spec.update(serveConfigV2=spec["serveConfigV2"] + "\n# changed\n"))
    tick(w, restarted)
    assert len(serve.submissions) == 3 and serve.submissions[-1][1].endswith("# changed\n")
    assert restarted.created == [] and active(w) == first and pending(w) == ""


def test_first_deploy_uses_the_pending_cluster(world: World) -> None:
    w = world
    add_cluster(w, "llm-q2w4r")
    set_status(w, pending="llm-q2w4r")  # no active cluster yet: KubeRay is bringing the first one up
    up(w)
    assert group(w, "llm-q2w4r")["replicas"] == 2 and len(workers(w, "llm-q2w4r")) == 2


def test_no_cluster_named_or_no_rayservice_is_an_error_not_an_empty_view(world: World) -> None:
    w = world
    assert w.act is not None
    set_status(w)  # KubeRay clears both names when a RayService fails to initialize in time
    with pytest.raises(KubeError, match="names no RayCluster"):
        w.tick()
    assert "status.activeServiceStatus.rayClusterName" in w.act.last_errors[0]
    w.api.store.delete("rayservices", RS, NS)
    with pytest.raises(KubeError, match=f"RayService {NS}/{RS} not found"):
        w.tick()
    assert w.act.last_errors == [f"RayService {NS}/{RS} not found"]


def test_controller_command_takes_a_rayservice() -> None:
    from rayscale.cli import build_parser

    args = build_parser().parse_args(["controller", "--actuator", "kube", "--dashboard", "http://head:8265",
                                      "--rayservice", "llm"])
    assert args.rayservice == "llm" and args.raycluster == "rayscale"
    assert build_parser().parse_args(["controller", "--actuator", "kube"]).rayservice is None
