"""KubeActuator with a KubeRay RayService: it drives the RayCluster the RayService's status names.

KubeRay names a RayService's cluster itself and replaces it on every cluster upgrade (a pending cluster
comes up beside the active one, traffic moves, the old one goes). The RayService stand-in
(rayscale_testing.rayservice, after rayservice_controller.go) writes ``status.activeServiceStatus`` /
``pendingServiceStatus``, rebuilds clusters in place and submits ``serveConfigV2`` as KubeRay does; the
KubeRay stand-in runs each RayCluster's pods. With ``ServeModel`` a cluster's application is RUNNING only
once every replica target has a worker pod (every deployment the application builds, those the
controller keeps at 0 included), so the tests see whether traffic is ever moved to, or left on, a
cluster that cannot serve its targets (docs/design.md, "KubeRay and rayscale"). ``ServeDashboards``
answers each cluster's dashboard, where the actuator sets a pending cluster's targets.
"""

from __future__ import annotations

import copy
import socket
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import yaml
from rayscale_testing.kubeapi import KubeAPIServer
from rayscale_testing.rayservice import RayServiceStandIn, RecordedServe, ServeHTTPError, ServeModel
from rayscale_testing.serve_http import ServeDashboards

from rayscale.cluster.kube import KubeError
from rayscale.controller.loop import Controller, ControllerConfig
from rayscale.controller.serve_client import ServeSnapshot
from rayscale.core.act import Gang, GangPhase, SetReplicas
from rayscale.core.catalog import Catalog
from rayscale.serve.config import parse_app_args, validate_serve_config

from .kubeworld import NS, World, make_world, rendered, rendered_raycluster
from .test_actuator import BIG, GROUP, act, created_claims, up

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


def group(w: World, cluster: str, name: str = GROUP) -> dict[str, Any]:
    rc = w.api.store.get("rayclusters", cluster, NS)
    return next(g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == name)


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
    """One period: the world moves, KubeRay and its RayCluster controller pass, then the controller's
    actuator reads the gangs and (where the test set them) keeps Serve's targets (Controller.reconcile:
    gangs, actions, then ``_keep_targets``); its errors are the controller's to log, the next period
    writes again."""
    w.step()
    rsc.step()
    w.kuberay.step()
    assert w.act is not None
    gangs = w.act.gangs(w.clock.now())
    if w.serve_targets:
        w.act.sync_serve_targets(w.serve_targets)
    return gangs


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


# --- rayscale and KubeRay sharing the RayService (rayscale.cluster.kube.rayservice) ----------------------

MISTRAL = ("mistral-7b", "a10g", "on-demand")  # one g5.xlarge per gang, one Serve replica per gang
M_GROUP = "a10g-g5-xlarge"
APP, DEP = "llm", "mistral-7b--a10g"  # the rendered application and its a10g deployment
SLOT0 = "qwen2-72b--a10g--slot0"  # the slot deployment of BIG's first gang (two g5.12xlarge, group GROUP)


def serving_pods(w: World, cluster: str) -> list[dict[str, Any]]:
    return [p for p in workers(w, cluster) if p["metadata"]["labels"]["ray.io/group"] == M_GROUP
            and p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]


def running_in(w: World, cluster: str, group_name: str) -> list[dict[str, Any]]:
    return [p for p in workers(w, cluster) if p["metadata"]["labels"]["ray.io/group"] == group_name
            and p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]


@pytest.fixture
def dashboards(world: World) -> Iterator[ServeDashboards]:
    """Serve on each cluster (the model) behind each cluster's dashboard (one local server): a cluster runs
    one mistral-7b replica per Running worker pod of its g5.xlarge group, and BIG's slot-0 replica once
    both pods of the slot-0 group run; nothing else has a node. The actuator reaches a cluster's
    dashboard there (``cluster_dashboard``)."""
    w = world

    def capacity(cluster: str, deployment: str) -> int:
        if deployment == DEP:
            return len(serving_pods(w, cluster))
        if deployment == SLOT0:
            return int(len(running_in(w, cluster, GROUP)) >= 2)
        return 0

    d = ServeDashboards(ServeModel(capacity)).start()
    w.config = replace(w.config, cluster_dashboard=d.template)
    w.actuator()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def served(world: World, dashboards: ServeDashboards) -> tuple[World, RayServiceStandIn, ServeModel]:
    """KubeRay's RayService controller over the Serve model, with a head node for each cluster; its
    application is RUNNING once every target fits."""
    w = world
    head_nodes(w, 3)
    return w, RayServiceStandIn(w.api.store, dashboards.model, clock=w.clock), dashboards.model


def model_deployments(w: World) -> list[str]:
    """Every model deployment the RayService's application builds: what the controller's Serve snapshot
    lists, so what it hands the actuator each period (gang-slot flavors by slot, Controller._keep_targets)."""
    rs = w.api.store.get("rayservices", RS, NS)
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    cfg = parse_app_args(app["args"])
    return [d for m in cfg.models for f in m.flavors for d in f.deployment_names(m.name)]


def targets(w: World, n: int, more: dict[str, int] | None = None) -> None:
    """The controller's Serve targets from now on (written at once, then every period): DEP at ``n``,
    ``more`` (deployment -> replicas), every other deployment as before (at first 0, as the plan keeps
    them)."""
    assert w.act is not None
    kept = w.serve_targets.get(APP) or dict.fromkeys(model_deployments(w), 0)
    w.serve_targets = {APP: {**kept, DEP: n, **(more or {})}}
    assert w.act.sync_serve_targets(w.serve_targets) == []


def deploy_served(w: World, rsc: RayServiceStandIn, serve: ServeModel, n: int = 2) -> tuple[str, list[Gang]]:
    """First deploy: the controller's targets in serveConfigV2, gangs for the first (pending) cluster;
    KubeRay makes it active once its n replicas run."""
    targets(w, n)
    until(w, rsc, lambda gs: pending(w) != "" or active(w) != "", what="a cluster named")
    gangs: list[Gang] = []
    act(w, {MISTRAL: n}, gangs)
    gangs = until(w, rsc, lambda gs: active(w) != "" and len(gs) == n and all(g.phase == GangPhase.READY for g in gs),
                  what="first cluster serving and promoted")
    first = active(w)
    assert serve.running(first, APP, DEP) == n and group(w, first, M_GROUP)["replicas"] == n
    rs = w.api.store.get("rayservices", RS, NS)
    assert group_of(rs["spec"]["rayClusterConfig"], M_GROUP)["replicas"] == n  # mirrored
    return first, gangs


def group_of(spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(g for g in spec["workerGroupSpecs"] if g["groupName"] == name)


def serving_cluster(w: World) -> str:
    """The cluster KubeRay's Serve service points to (the active one; the pending one on first deploy)."""
    return active(w)


def test_an_upgrade_gets_twins_on_the_pending_cluster_and_cuts_over_only_once_they_serve(
    served: tuple[World, RayServiceStandIn, ServeModel]
) -> None:
    """rayservice_controller.go shouldPrepareNewCluster / reconcileServe / reconcilePromotionAndServingStatus:
    a rayClusterConfig change makes a pending cluster from the RayService (the mirrored replicas, the
    written Serve targets); rayscale gives it a twin of every gang; KubeRay moves traffic once its Serve
    application runs both replicas. The serving cluster never runs fewer replicas than its target, the
    controller always sees two ready gangs, and the old gangs go once KubeRay deleted the old cluster."""
    w, rsc, serve = served
    first, gangs = deploy_served(w, rsc, serve)
    old = {g.name for g in gangs}
    old_pods = {p["metadata"]["name"] for p in workers(w, first)}
    edit_rayservice(w, lambda spec: spec["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update(
        {"num-cpus": "1"}))
    second, seen_twins, ticks = "", False, 0
    while active(w) == first and ticks < 80:
        gangs = tick(w, rsc)
        ticks += 1
        assert serve.running(serving_cluster(w), APP, DEP) == 2  # traffic is served at full target
        if active(w) != first:
            break
        # The controller's view does not move during the upgrade.
        assert {g.name for g in gangs} == old and all(g.phase == GangPhase.READY for g in gangs), gangs
        second = pending(w) or second
        made = [c for c in w.claims() if c["metadata"]["labels"].get("rayscale.io/raycluster") == second]
        if made and not seen_twins:
            w.actuator()  # a controller restart mid-upgrade: the twins are found again, none made twice
        seen_twins |= len(made) == 2
    assert created_claims(w) == 4  # two gangs, two twins
    assert second and active(w) == second and seen_twins
    # The pending cluster was submitted the controller's targets and ran them all before the cut-over.
    assert serve.submissions[-1][0] == second and serve.running(second, APP, DEP) == 2
    assert [c for c, _ in serve.submissions].count(second) == 1
    assert {p["metadata"]["name"] for p in workers(w, first)} == old_pods  # never touched while serving
    twins = {c["metadata"]["labels"]["rayscale.io/gang"]: c["metadata"]["labels"]["rayscale.io/twin-of"]
             for c in w.claims() if c["metadata"]["labels"].get("rayscale.io/raycluster") == second}
    assert sorted(twins.values()) == sorted(old)
    # From now on the twins are the controller's gangs; the old cluster's go when KubeRay deleted it.
    gangs = tick(w, rsc)
    assert {g.name for g in gangs} == set(twins) and all(g.phase == GangPhase.READY for g in gangs)
    until(w, rsc, lambda gs: w.api.store.try_get("rayclusters", first, NS) is None and not any(w.claims(g) for g in old),
          what="old cluster deleted, its gangs released", ticks=40)
    assert w.clock.now() > 60  # rayClusterDeletionDelaySeconds: the old cluster served in-flight requests
    gangs = tick(w, rsc)
    assert {g.name for g in gangs} == set(twins) and serve.running(active(w), APP, DEP) == 2
    assert group(w, second, M_GROUP)["replicas"] == 2
    rs = w.api.store.get("rayservices", RS, NS)
    assert group_of(rs["spec"]["rayClusterConfig"], M_GROUP)["replicas"] == 2


def closed_port() -> int:
    """A local port nothing listens on (connection refused, as from a head pod not up yet)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_upgrade_waits_for_the_pending_cluster_to_run_the_targets_kept_at_zero_then_cuts_over(
    served: tuple[World, RayServiceStandIn, ServeModel], dashboards: ServeDashboards
) -> None:
    """Deployments the controller keeps at 0 (qwen2-7b--a10g, every other flavor, the idle gang slots)
    cannot be in serveConfigV2 (Ray's DeploymentSchema: num_replicas >= 1), so the pending cluster of an
    upgrade deploys each at the application's own count, 1 (rayscale.serve.app), with no node for it:
    its application stays DEPLOYING, and KubeRay moves traffic only once every application is RUNNING
    (getAndCheckServeStatus). While the pending cluster's dashboard does not answer, the twins serve
    DEP there but the upgrade waits, the actuator says why, and the active cluster keeps its full
    target. Once it answers, the actuator sets every target there through the scale endpoint (each
    once: it reads the targets first), and traffic moves with serving never short."""
    w, rsc, serve = served
    assert w.act is not None
    first, _ = deploy_served(w, rsc, serve)
    zeros = {d for d, n in w.serve_targets[APP].items() if n == 0}
    assert "qwen2-7b--a10g" in zeros and SLOT0 in zeros and len(zeros) > 20
    live = w.config
    w.config = replace(live, cluster_dashboard=f"http://127.0.0.1:{closed_port()}/{{cluster}}")
    w.actuator()
    upgrade(w)
    until(w, rsc, lambda gs: pending(w) != "" and serve.running(pending(w), APP, DEP) == 2,
          what="the twins serve DEP on the pending cluster", ticks=80)
    second = pending(w)
    for _ in range(20):  # 100 s more: the stall
        tick(w, rsc)
        assert active(w) == first and pending(w) == second and serve.running(first, APP, DEP) == 2
    assert serve.applications(second) == {APP: "DEPLOYING"}
    assert all(serve.target(second, APP, d) == 1 for d in zeros)  # the application's own count
    errors = w.act.sync_serve_targets(w.serve_targets)
    assert len(errors) == 1 and f"pending cluster {second}" in errors[0], errors
    assert dashboards.scales(second) == []
    w.config = live
    w.actuator()
    while active(w) == first:
        tick(w, rsc)
        assert serve.running(serving_cluster(w), APP, DEP) == 2
        assert w.clock.now() < 2000, "no cut-over"
    assert active(w) == second and pending(w) == ""
    assert sorted(dashboards.scales(second)) == sorted((APP, d, 0) for d in zeros)  # each once
    assert all(serve.target(second, APP, d) == n for d, n in w.serve_targets[APP].items())
    assert serve.applications(second) == {APP: "RUNNING"}


def test_on_first_deploy_the_controller_reads_and_scales_serve_on_the_pending_clusters_own_service(
    served: tuple[World, RayServiceStandIn, ServeModel], dashboards: ServeDashboards
) -> None:
    """KubeRay makes the RayService's own head Service only once a cluster serves
    (reconcileServicesToReadyCluster), so a controller that read Serve only there would never see Serve on a
    first deploy, skip every act, and the cluster would never get the gangs it needs to serve: a deadlock.
    The controller follows the actuator to the driven cluster's own head Service (Actuator.serve_dashboard):
    its snapshot works, it orders the gangs and scales the pending cluster's deployments."""
    from rayscale.controller.serve_client import ServeClient
    from rayscale.signals.scrape import MetricsScraper

    w, rsc, _ = served
    assert w.act is not None
    given = f"http://127.0.0.1:{closed_port()}"  # the RayService's Service: not there before a cluster serves
    client = ServeClient(given, timeout_s=1.0)
    ctl = Controller(w.catalog, w.act, client, MetricsScraper(lambda: []), ControllerConfig(app_name=APP),
                     clock=w.clock.now)
    moved: list[str] = []  # where the command reconnects its Ray driver (metrics discovery, weights)

    def follow(url: str) -> None:
        moved.append(url)
        if len(moved) == 1:
            raise ConnectionError("head pod not up yet")  # the next period tries again

    ctl.on_serve_moved(follow)
    until(w, rsc, lambda gs: pending(w) != "", what="a first (pending) cluster named")
    first = pending(w)
    records = []
    for _ in range(6):
        tick(w, rsc)
        records.append(ctl.reconcile())
    assert active(w) == "" and pending(w) == first  # still the first deploy
    assert client.url == dashboards.template.format(cluster=first, namespace=NS)
    assert moved == [client.url, client.url]  # failed once, followed the next period, then left alone
    assert sum("following the driven cluster" in e for r in records for e in r.errors) == 1
    assert not any("act skipped" in e for r in records for e in r.errors), [r.errors for r in records]
    assert any(a["type"] == "CreateGang" for r in records for a in r.actions)  # min_replicas' first gangs
    assert dashboards.scales(first)  # its deployments set through its own dashboard


def test_editing_the_rayservice_to_append_a_worker_group_keeps_every_worker(
    served: tuple[World, RayServiceStandIn, ServeModel]
) -> None:
    """shouldUpdateCluster + modifyRayCluster: an appended worker group rebuilds the active cluster in
    place from the RayService. The RayService carries rayscale's replicas, so an edit of the live object
    (kubectl edit / patch) rebuilds it with them: KubeRay deletes no pod, Serve is not re-submitted."""
    w, rsc, serve = served
    first, gangs = deploy_served(w, rsc, serve)
    before = {p["metadata"]["name"] for p in workers(w, first)}
    deleted, submitted = len(w.kuberay.deleted_pods), len(serve.submissions)

    def append(spec: dict[str, Any]) -> None:
        extra = copy.deepcopy(spec["rayClusterConfig"]["workerGroupSpecs"][-1])
        extra["groupName"] = "extra"
        spec["rayClusterConfig"]["workerGroupSpecs"].append(extra)

    edit_rayservice(w, append)
    for _ in range(5):
        gangs = tick(w, rsc)
        assert serve.running(active(w), APP, DEP) == 2
    assert rsc.updated_in_place == [first] and rsc.created == [first] and pending(w) == ""
    assert group(w, first, M_GROUP)["replicas"] == 2 and group(w, first, "extra")["replicas"] == 0
    assert {p["metadata"]["name"] for p in workers(w, first)} == before
    assert len(w.kuberay.deleted_pods) == deleted and len(serve.submissions) == submitted
    assert all(g.phase == GangPhase.READY for g in gangs) and len(gangs) == 2


def test_an_operator_upgrade_and_restart_keep_workers_and_serve_targets(
    served: tuple[World, RayServiceStandIn, ServeModel]
) -> None:
    """A new KubeRay version rebuilds the active cluster in place (its version annotation differs) and,
    its cache empty, re-submits serveConfigV2: with rayscale's replicas and targets in the RayService,
    no pod goes and every target stays; a later scale by the controller reaches the config too."""
    w, rsc, serve = served
    first, _ = deploy_served(w, rsc, serve)
    before = {p["metadata"]["name"] for p in workers(w, first)}
    deleted = len(w.kuberay.deleted_pods)
    upgraded = RayServiceStandIn(w.api.store, serve, version="v1.6.0", clock=w.clock)
    for _ in range(4):
        gangs = tick(w, upgraded)
        assert serve.running(active(w), APP, DEP) == 2
    assert upgraded.updated_in_place == [first] and upgraded.created == [] and active(w) == first
    assert w.api.store.get("rayclusters", first, NS)["metadata"]["annotations"]["ray.io/kuberay-version"] == "v1.6.0"
    assert serve.submissions[-1][0] == first and serve.target(first, APP, DEP) == 2  # re-submitted, kept
    assert {p["metadata"]["name"] for p in workers(w, first)} == before and len(w.kuberay.deleted_pods) == deleted
    assert len(gangs) == 2 and all(g.phase == GangPhase.READY for g in gangs)
    # The controller scales Serve to 3 (its scale endpoint) and writes the target: KubeRay re-submits 3.
    serve.scale(first, APP, DEP, 3)
    targets(w, 3)
    tick(w, upgraded)
    assert serve.target(first, APP, DEP) == 3 and yaml.safe_load(serve.submissions[-1][1])["applications"][0][
        "deployments"][0] == {"name": DEP, "num_replicas": 3}


def test_reapplying_the_manifest_with_a_group_appended_loses_the_pods_but_not_the_gangs(
    served: tuple[World, RayServiceStandIn, ServeModel]
) -> None:
    """`kubectl apply` of a manifest whose workerGroupSpecs changed replaces the whole list (an atomic
    list in the CRD, a JSON merge patch): every group's replicas go back to the manifest's 0, KubeRay
    rebuilds the active cluster with them and deletes its worker pods in the same pass
    (raycluster_controller.go reconcilePods), before any other controller can act. rayscale keeps the
    gangs and their admitted Nodes, raises the replicas again, and KubeRay's new pods land on the same
    Nodes; Serve's targets (serveConfigV2 is not in the patch) are untouched."""
    w, rsc, serve = served
    first, _ = deploy_served(w, rsc, serve)
    nodes = {p["spec"]["nodeName"] for p in workers(w, first)}
    claims = {c["metadata"]["uid"] for c in w.claims()}
    manifest = rendered(w.catalog, "deployments/k8s/rayservice.yaml")[0]["spec"]["rayClusterConfig"]
    extra = copy.deepcopy(manifest["workerGroupSpecs"][-1])
    extra["groupName"] = "extra"
    w.api.store.patch("rayservices", RS, {"spec": {"rayClusterConfig": {
        "workerGroupSpecs": [*manifest["workerGroupSpecs"], extra]}}}, NS)
    w.step()
    rsc.step()
    w.kuberay.step()
    assert workers(w, first) == [] and rsc.updated_in_place == [first]  # upstream: gone at once
    until(w, rsc, lambda gs: len(gs) == 2 and all(g.phase == GangPhase.READY for g in gs)
          and serve.running(first, APP, DEP) == 2, what="serving again")
    assert {p["spec"]["nodeName"] for p in workers(w, first)} == nodes
    assert {c["metadata"]["uid"] for c in w.claims()} == claims  # the same NodeClaims throughout
    assert serve.target(first, APP, DEP) == 2 and active(w) == first and rsc.created == [first]
    rs = w.api.store.get("rayservices", RS, NS)
    assert group_of(rs["spec"]["rayClusterConfig"], M_GROUP)["replicas"] == 2  # mirrored again


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


def test_the_controller_writes_serve_targets_after_its_set_replicas_into_serve_config_v2(world: World) -> None:
    """Each period the controller hands Serve's targets, after its own SetReplicas, to the actuator, which
    writes them as num_replicas of the RayService's serveConfigV2 (a config Ray's schema and rayscale's
    rules still accept); unchanged targets write nothing."""
    w = world
    none: Any = None
    assert w.act is not None
    ctl = Controller(w.catalog, w.act, none, none, ControllerConfig(app_name="llm"))
    snap = ServeSnapshot(target={("mistral-7b", "a10g"): 1, ("qwen2-7b", "a10g"): 1},
                         app_of={("mistral-7b", "a10g"): "llm", ("qwen2-7b", "a10g"): "llm"})
    assert ctl._keep_targets((SetReplicas("mistral-7b", "a10g", 3, "plan"),), snap) == []
    rs = w.api.store.get("rayservices", RS, NS)
    raw = yaml.safe_load(rs["spec"]["serveConfigV2"])
    (app,) = raw["applications"]
    assert {d["name"]: d["num_replicas"] for d in app["deployments"]} == {"mistral-7b--a10g": 3, "qwen2-7b--a10g": 1}
    assert set(validate_serve_config(raw, "serveConfigV2").apps) == {"llm"}
    version = rs["metadata"]["resourceVersion"]
    snap.target[("mistral-7b", "a10g")] = 3
    assert ctl._keep_targets((), snap) == []
    assert w.api.store.get("rayservices", RS, NS)["metadata"]["resourceVersion"] == version


def test_a_gang_slot_flavor_is_kept_per_slot_deployment_in_serve_config_v2(world: World) -> None:
    """A multi-node flavor is served by one deployment per gang slot: KubeRay must re-submit those slots'
    targets (the ones the controller last set), never a per-flavor name the application does not build."""
    w = world
    none: Any = None
    assert w.act is not None
    ctl = Controller(w.catalog, w.act, none, none, ControllerConfig(app_name="llm"))
    mf = ("qwen2-72b", "a10g")
    snap = ServeSnapshot(target={mf: 2}, app_of={mf: "llm"}, slots={mf: {0: 1, 1: 1, 2: 0}})
    assert ctl._keep_targets((), snap) == []
    raw = yaml.safe_load(w.api.store.get("rayservices", RS, NS)["spec"]["serveConfigV2"])
    (app,) = raw["applications"]
    kept = {d["name"]: d.get("num_replicas") for d in app.get("deployments", [])}
    assert kept.get("qwen2-72b--a10g--slot0") == 1 and kept.get("qwen2-72b--a10g--slot1") == 1
    assert "qwen2-72b--a10g" not in kept and kept.get("qwen2-72b--a10g--slot2") is None  # 0: the app's own
    assert set(validate_serve_config(raw, "serveConfigV2").apps) == {"llm"}


def test_a_gang_made_before_clusters_were_recorded_is_adopted_by_the_driven_cluster(world: World) -> None:
    """Gangs made by a RayCluster-mode controller carry no cluster; the first RayService pass records the
    driven one on them, so that after the next cut-over they are released with it, not counted twice."""
    w = world
    add_cluster(w, "llm-q2w4r")
    set_status(w, active="llm-q2w4r")
    with_service = w.config
    w.config = replace(with_service, rayservice=None, raycluster="llm-q2w4r")
    w.actuator()
    up(w)
    assert w.claims() and all("rayscale.io/raycluster" not in c["metadata"]["labels"] for c in w.claims())
    w.config = with_service
    w.actuator()
    (g,) = w.tick()
    assert g.phase == GangPhase.READY
    assert all(c["metadata"]["labels"]["rayscale.io/raycluster"] == "llm-q2w4r" for c in w.claims())


def test_serve_targets_written_into_serve_config_v2_pass_rays_own_schema_at_zero_too() -> None:
    """Ray's DeploymentSchema takes num_replicas >= 1: a deployment the controller scaled to zero is left to
    the application's own count rather than written as 0 (KubeRay could not submit that config)."""
    from ray.serve.schema import ServeDeploySchema

    from rayscale.cluster.kube.rayservice import with_serve_targets

    base = yaml.safe_dump({"applications": [{
        "name": APP, "route_prefix": "/", "import_path": "rayscale.serve.app:build_app",
        "args": {"app_name": APP}, "deployments": [{"name": DEP, "num_replicas": 1},
                                                    {"name": "qwen2-7b--a10g", "num_replicas": 2,
                                                     "max_ongoing_requests": 64}]}]})
    out = with_serve_targets(base, {APP: {DEP: 0, "qwen2-7b--a10g": 0, "qwen2-7b--l4": 3}})
    assert out is not None
    (app,) = ServeDeploySchema.model_validate(yaml.safe_load(out)).applications
    counts = {d.name: d.num_replicas if "num_replicas" in d.model_fields_set else None for d in app.deployments}
    assert counts == {"qwen2-7b--a10g": None, "qwen2-7b--l4": 3}
    assert with_serve_targets(out, {APP: {DEP: 0, "qwen2-7b--a10g": 0, "qwen2-7b--l4": 3}}) is None


# --- twins: back-off and gang slots ------------------------------------------------------------------


def twin_claims(w: World) -> list[dict[str, Any]]:
    return [c for c in w.claims() if "rayscale.io/twin-of" in c["metadata"]["labels"]]


def upgrade(w: World) -> None:
    """A rayClusterConfig change outside the replicas: KubeRay prepares a new (pending) cluster."""
    edit_rayservice(w, lambda spec: spec["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update(
        {"num-cpus": "1"}))


def test_a_failed_twin_is_made_again_only_after_the_back_off(
    served: tuple[World, RayServiceStandIn, ServeModel]
) -> None:
    """Twins for the pending cluster that fail (no capacity in their zone: Karpenter deletes their claims,
    launch.go) are released and made again only ``twin_backoff_s`` later, as decide() backs off a failed
    gang's zone (ActSettings.backoff_s); meanwhile the active cluster serves its full target and KubeRay
    waits. Once the back-off is over and capacity is back, the twins come up and traffic moves."""
    w, rsc, serve = served
    w.config = replace(w.config, twin_backoff_s=120.0)
    w.actuator()
    first, gangs = deploy_served(w, rsc, serve)
    old = {g.name for g in gangs}
    for g in gangs:
        w.karpenter.set_capacity_error("g5.xlarge", zone=g.zone)
    base = created_claims(w)
    upgrade(w)
    until(w, rsc, lambda gs: created_claims(w) >= base + 2 and not twin_claims(w), what="twins made, failed, gone")
    assert {why for _, why in w.karpenter.deleted} == {"insufficient_capacity"}
    failed_at, made = w.clock.now(), created_claims(w)
    while w.clock.now() < failed_at + 100:
        gangs = tick(w, rsc)
        assert created_claims(w) == made, "a failed twin was made again within its back-off"
        assert active(w) == first and pending(w) and serve.running(first, APP, DEP) == 2
        assert {g.name for g in gangs} == old and all(g.phase == GangPhase.READY for g in gangs)
    assert w.act is not None and any("backed off until" in e for e in w.act.last_errors), w.act.last_errors
    for g in gangs:
        w.karpenter.set_capacity_error("g5.xlarge", zone=g.zone, on=False)
    until(w, rsc, lambda gs: active(w) != first, what="cut over once the twins serve", ticks=80)
    assert created_claims(w) == made + 2  # each twin made once more, after its back-off
    made_again = [c for c in twin_claims(w) if c["metadata"]["labels"].get("rayscale.io/raycluster") == active(w)]
    assert len(made_again) == 2
    assert min(float(c["metadata"]["labels"]["rayscale.io/created-at"]) for c in made_again) >= failed_at + 100
    assert serve.running(active(w), APP, DEP) == 2


def test_a_slot_gangs_twin_keeps_its_slot_on_the_pending_cluster(
    served: tuple[World, RayServiceStandIn, ServeModel]
) -> None:
    """The twin of a gang-slot gang carries its source's slot: on the new cluster the worker group of the
    same slot is sized to it, so the slot's Serve deployment finds its replica's nodes there too, and
    traffic moves only once that replica runs there."""
    w, rsc, serve = served
    first, _ = deploy_served(w, rsc, serve)
    act(w, {BIG: 1}, [])
    gangs = until(w, rsc, lambda gs: any(g.model == BIG[0] and g.phase == GangPhase.READY for g in gs),
                  what="the big gang ready")
    (big,) = [g for g in gangs if g.model == BIG[0]]
    assert big.slot == 0 and group(w, first)["replicas"] == 2
    # The controller runs the slot's replica on its gang (its ServeClient, on the active cluster).
    serve.scale(first, APP, SLOT0, 1)
    targets(w, 2, {SLOT0: 1})
    assert serve.running(first, APP, SLOT0) == 1
    upgrade(w)
    while active(w) == first:
        tick(w, rsc)
        assert serve.running(serving_cluster(w), APP, SLOT0) == 1 and w.clock.now() < 2000
    second = active(w)
    assert serve.target(second, APP, SLOT0) == 1 and serve.running(second, APP, SLOT0) == 1
    twin = [c for c in twin_claims(w) if c["metadata"]["labels"]["rayscale.io/twin-of"] == big.name]
    assert len(twin) == 2 and all(c["metadata"]["labels"]["rayscale.io/gang-slot"] == "0" for c in twin)
    assert {c["metadata"]["labels"]["rayscale.io/raycluster"] for c in twin} == {second}
    name = twin[0]["metadata"]["labels"]["rayscale.io/gang"]
    gangs = until(w, rsc, lambda gs: any(g.name == name and g.phase == GangPhase.READY for g in gs),
                  what="the twin ready as the controller's gang")
    assert [g.slot for g in gangs if g.name == name] == [0]
    assert group(w, second)["replicas"] == 2
    slot_pods = [p for p in workers(w, second) if p["metadata"]["labels"]["ray.io/group"] == GROUP]
    assert sorted(p["spec"]["nodeName"] for p in slot_pods) == sorted(c["status"]["nodeName"] for c in twin)
    rs = w.api.store.get("rayservices", RS, NS)
    assert group_of(rs["spec"]["rayClusterConfig"], GROUP)["replicas"] == 2  # mirrored by slot group name


# --- the Serve stand-in and its dashboards ---------------------------------------------------------


def test_the_serve_model_deploys_what_the_application_builds_and_keeps_scaled_targets_on_resubmit(
    catalog: Catalog,
) -> None:
    """ServeModel after rayscale.serve.app and Ray Serve: every model deployment the application builds
    is deployed (a flavor at 0 at 1, a gang slot at 1), a listed one at its num_replicas; a re-submission
    resets only a deployment whose deployment changed (DeploymentState.deploy); the scale endpoint's
    answers (serve_head.py); an override of a deployment the application does not build fails it."""
    from ray.serve.schema import ServeDeploySchema

    from rayscale.cluster.kube.rayservice import with_serve_targets

    rs = rendered(catalog, "deployments/k8s/rayservice.yaml")[0]
    base = rs["spec"]["serveConfigV2"]
    config = with_serve_targets(base, {APP: {DEP: 2}})
    assert config is not None
    serve = ServeModel(lambda cluster, dep: 5)
    serve.submit("c", config)
    (app,) = yaml.safe_load(base)["applications"]
    built = {d for m in parse_app_args(app["args"]).models for f in m.flavors for d in f.deployment_names(m.name)}
    assert {d for (a, d) in serve.targets["c"]} == built and "qwen2-72b--a10g" not in built
    assert serve.target("c", APP, DEP) == 2 and serve.target("c", APP, "qwen2-7b--a10g") == 1
    assert serve.target("c", APP, SLOT0) == 1 and serve.applications("c") == {APP: "RUNNING"}
    serve.scale("c", APP, "qwen2-7b--a10g", 0)
    serve.submit("c", config)  # unchanged: the scaled target stays
    assert serve.target("c", APP, "qwen2-7b--a10g") == 0
    serve.scale("c", APP, DEP, 4)
    changed = with_serve_targets(config, {APP: {DEP: 3}})
    assert changed is not None
    serve.submit("c", changed)  # DEP's entry changed: its target is the config's; the others stay
    assert serve.target("c", APP, DEP) == 3 and serve.target("c", APP, "qwen2-7b--a10g") == 0
    doc = yaml.safe_load(changed)
    doc["applications"][0]["args"]["ingress"] = {"num_replicas": 2}
    serve.submit("c", yaml.safe_dump(doc))  # new code (args): every deployment deployed again
    assert serve.target("c", APP, "qwen2-7b--a10g") == 1
    with pytest.raises(ServeHTTPError, match="404"):
        serve.scale("c", APP, "qwen2-72b--a10g", 0)
    with pytest.raises(ServeHTTPError, match="404"):
        serve.scale("c", "other", DEP, 0)
    with pytest.raises(ServeHTTPError, match="400"):
        serve.scale("c", APP, DEP, -1)
    doc["applications"][0]["external_scaler_enabled"] = False
    serve.submit("c", yaml.safe_dump(doc))
    with pytest.raises(ServeHTTPError, match="412"):
        serve.scale("c", APP, DEP, 0)
    doc["applications"][0]["deployments"].append({"name": "qwen2-72b--a10g", "num_replicas": 1})
    ServeDeploySchema.model_validate(doc)  # Ray's schema takes it; building the application does not
    serve.submit("c", yaml.safe_dump(doc))
    assert serve.applications("c") == {APP: "DEPLOY_FAILED"}


def test_the_dashboards_answer_the_serve_client_per_cluster_as_ray_does() -> None:
    """ServeDashboards: each cluster's scale endpoint and Serve details at ``{url}/clusters/{cluster}``,
    Ray's codes through the ServeClient the actuator uses, token auth as Ray's middleware checks it."""
    from rayscale.controller.serve_client import ServeClient, ServeClientError

    serve = ServeModel(lambda cluster, dep: 1)
    cfg = {"applications": [{"name": "a", "route_prefix": "/", "import_path": "x:app", "external_scaler_enabled": True,
                             "deployments": [{"name": "d", "num_replicas": 2}]}]}
    serve.submit("one", yaml.safe_dump(cfg))
    d = ServeDashboards(serve, token="s3cret").start()
    clients: list[ServeClient] = []

    def client(cluster: str, token: str) -> ServeClient:
        clients.append(ServeClient(d.template.format(cluster=cluster), timeout_s=5, token=token))
        return clients[-1]

    try:
        one = client("one", "s3cret")
        assert one.deployment_targets() == {("a", "d"): 2} and serve.applications("one") == {"a": "DEPLOYING"}
        one.scale_deployment("a", "d", 1)
        assert one.deployment_targets() == {("a", "d"): 1} and serve.applications("one") == {"a": "RUNNING"}
        assert d.scales("one") == [("a", "d", 1)]
        with pytest.raises(ServeClientError, match="HTTP 404"):
            one.scale_deployment("a", "nope", 0)
        with pytest.raises(ServeClientError, match="HTTP 503"):
            client("two", "s3cret").scale_deployment("a", "d", 0)
        assert client("two", "s3cret").deployment_targets() == {}
        with pytest.raises(ServeClientError, match="HTTP 403"):
            client("one", "wrong").scale_deployment("a", "d", 0)
        assert serve.target("one", "a", "d") == 1
    finally:
        for c in clients:
            c.close()
        d.stop()
