"""KubeActuator with a KubeRay RayService: it drives the RayCluster the RayService's status names.

KubeRay names a RayService's cluster itself and replaces it on every cluster upgrade (a pending cluster
comes up beside the active one, traffic moves, the old one goes). The RayService stand-in here is the
test: it writes ``status.activeServiceStatus`` / ``pendingServiceStatus`` as KubeRay's RayService
controller does (see rayservice_controller.go), and the KubeRay stand-in runs each RayCluster's pods.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from rayscale.cluster.kube import KubeError
from rayscale.core.act import GangPhase
from rayscale.core.catalog import Catalog
from rayscale.testing.kubeapi import KubeAPIServer

from .kubeworld import NS, RC, World, make_world, rendered, rendered_raycluster
from .test_actuator import GROUP, up

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


def test_follows_the_active_cluster_through_an_upgrade(world: World) -> None:
    w = world
    add_cluster(w, "llm-x7k2p")
    set_status(w, active="llm-x7k2p")
    (g,) = up(w)
    assert group(w, "llm-x7k2p")["replicas"] == 2
    assert group(w, RC)["replicas"] == 0 and workers(w, RC) == []  # not the RayService's cluster
    ips = {f"ip:{p['status']['podIP']}" for p in workers(w, "llm-x7k2p")}
    assert ips and ips <= set(g.node_ids)

    # An upgrade starts: KubeRay creates the pending cluster; the active one is still the one to drive.
    add_cluster(w, "llm-b5q9z")
    set_status(w, active="llm-x7k2p", pending="llm-b5q9z")
    for _ in range(3):
        (g,) = w.tick()
        assert g.phase == GangPhase.READY
    assert group(w, "llm-b5q9z")["replicas"] == 0 and workers(w, "llm-b5q9z") == []

    # Traffic moved: the pending cluster is the active one; KubeRay deletes the old cluster (its pods
    # are garbage-collected with it). The actuator follows the new name and the gang serves there.
    set_status(w, active="llm-b5q9z")
    w.api.store.delete("rayclusters", "llm-x7k2p", NS)
    (g,) = w.until(lambda gs: len(gs) == 1 and gs[0].phase == GangPhase.READY and workers(w, "llm-b5q9z") != []
                   and {f"ip:{p['status']['podIP']}" for p in workers(w, "llm-b5q9z")} <= set(gs[0].node_ids),
                   what="the gang ready under the new cluster")
    assert group(w, "llm-b5q9z")["replicas"] == 2
    assert sorted(p["spec"]["nodeName"] for p in workers(w, "llm-b5q9z")) == sorted(
        n for n in g.node_ids if not n.startswith("ip:"))
    assert w.act is not None and w.act.last_errors == []


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
