"""The controller closing the loop through Kubernetes: load -> controller -> NodeClaims -> Karpenter's Nodes
-> KubeRay's worker pods -> a real Ray node per Running worker pod -> a real Serve replica serving there
-> scale down drains the replica, then releases the gang.

Kubernetes is the project's HTTP API emulator, reached through the official client, with the Karpenter and
KubeRay stand-ins on a real clock; ``RayPodKubelet`` runs every Ray worker pod as a real Ray worker node of
the session's local cluster, on its own loopback IP (the pod's IP), so the controller joins Serve's
replicas to gangs exactly as on EKS (``ip:<podIP>``). Serve runs the emulated Mistral-7B (tests/e2e/conftest.py).

This module shares the session's cluster and Serve app with test_controller.py: it first clears what that
module leaves (its worker nodes, Serve replicas) and at the end removes every node it started and scales
the deployment to zero, so the next user of the cluster starts from zero worker nodes. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from rayscale_testing.karpenter import Delays, KarpenterConfig, KarpenterStandIn
from rayscale_testing.kubeapi import KubeAPIServer, WatchEvent
from rayscale_testing.kuberay import KubeRayStandIn
from rayscale_testing.raypods import RayPodKubelet

from rayscale.cluster.kube import KubeActuator, KubeActuatorConfig
from rayscale.cluster.local import LocalCluster
from rayscale.controller.loop import Controller, ControllerConfig
from rayscale.controller.serve_client import ServeClient, deployment_name
from rayscale.core.act import ActSettings, CreateGang, Gang, GangPhase
from rayscale.core.catalog import Catalog
from rayscale.core.estimate import EstimateSettings
from rayscale.core.plan import PlannerSettings
from rayscale.core.settings import Settings
from rayscale.serve.weights import set_flavor_weights
from rayscale.signals.scrape import MetricsScraper, ray_metrics_endpoints
from tests.e2e.conftest import APP, MODEL, local_catalog, wait_for
from tests.e2e.load import SteadyLoad, errors, load
from tests.k8s.kubeworld import NS, RC, install_manifests

FLAVOR = "a10g"
DEP = (MODEL, FLAVOR)
GROUP = "a10g-g5-xlarge"  # the rendered worker group of the mistral-7b gang (one g5.xlarge)


@dataclass
class Events:
    """What happened in the emulator, with monotonic times (a store listener: short, under its lock)."""

    pods_created: dict[str, float] = field(default_factory=dict)
    pods_gone: dict[str, float] = field(default_factory=dict)
    pods_deleting: dict[str, float] = field(default_factory=dict)
    # NodeClaims by uid: a gang's name (and so its claims' names) is taken again once it is gone.
    claims: dict[str, str] = field(default_factory=dict)  # uid -> name
    claims_deleting: dict[str, float] = field(default_factory=dict)  # uid -> when its deletion began
    workers_to_delete: list[tuple[float, str, tuple[str, ...]]] = field(default_factory=list)
    pod_node: dict[str, str] = field(default_factory=dict)  # every worker pod ever bound, and its Node
    pod_ip: dict[str, str] = field(default_factory=dict)
    node_gang: dict[str, str] = field(default_factory=dict)  # every gang Node ever registered (unique names)

    def pods_of(self, gang: str, at: float | None = None) -> set[str]:
        """Pods bound to the gang's Nodes (a gang's name is taken again once it is gone): all of them, or
        those that existed at ``at``."""
        return {p for p, n in self.pod_node.items() if self.node_gang.get(n) == gang
                and (at is None or self.pods_created.get(p, 0.0) <= at <= self.pods_gone.get(p, float("inf")))}

    def claims_of(self, gang: str, since: float = 0.0) -> dict[str, str]:
        """uid -> name of the gang's NodeClaims not yet being deleted at ``since``."""
        return {u: n for u, n in self.claims.items()
                if n.rsplit("-", 1)[0] == gang and self.claims_deleting.get(u, float("inf")) >= since}

    def __call__(self, ev: WatchEvent) -> None:
        t = time.monotonic()
        meta = ev.obj["metadata"]
        name = meta["name"]
        kind = ev.type_key.split(".")[0]
        if kind == "nodes" and "rayscale.io/gang" in (meta.get("labels") or {}):
            self.node_gang[name] = meta["labels"]["rayscale.io/gang"]
        if kind == "pods":
            if (ev.obj.get("spec") or {}).get("nodeName"):
                self.pod_node[name] = ev.obj["spec"]["nodeName"]
            if (ev.obj.get("status") or {}).get("podIP"):
                self.pod_ip[name] = ev.obj["status"]["podIP"]
            if ev.type == "ADDED":
                self.pods_created.setdefault(name, t)
            if ev.type == "DELETED":
                self.pods_gone.setdefault(name, t)
            elif meta.get("deletionTimestamp"):
                self.pods_deleting.setdefault(name, t)
        elif kind == "nodeclaims":
            self.claims[meta["uid"]] = name
            if ev.type == "DELETED" or meta.get("deletionTimestamp"):
                self.claims_deleting.setdefault(meta["uid"], t)
        elif kind == "rayclusters" and ev.old is not None:
            def lists(obj: dict[str, Any]) -> dict[str, tuple[str, ...]]:
                return {g["groupName"]: tuple((g.get("scaleStrategy") or {}).get("workersToDelete") or ())
                        for g in (obj.get("spec") or {}).get("workerGroupSpecs") or []}

            old = lists(ev.old)
            for g, w in lists(ev.obj).items():
                if w != old.get(g, ()):
                    self.workers_to_delete.append((t, g, w))


class SerialKubeActuator(KubeActuator):
    """The controller's actuator, also read by the test thread: one pass at a time (a pass writes)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.RLock()

    def gangs(self, now: float) -> list[Gang]:
        with self._lock:
            return super().gangs(now)

    def create_gang(self, action: CreateGang, now: float) -> None:
        with self._lock:
            super().create_gang(action, now)

    def delete_gang(self, name: str) -> None:
        with self._lock:
            super().delete_gang(name)


@dataclass
class KubeWorld:
    api: KubeAPIServer
    catalog: Catalog
    cluster: LocalCluster
    karpenter: KarpenterStandIn
    kuberay: KubeRayStandIn
    kubelet: RayPodKubelet
    act: KubeActuator
    ctl: Controller
    serve: ServeClient
    events: Events
    trickle: SteadyLoad | None = None  # the light load that goes on once the load step ends
    # When the step ended: monotonic time, and how many controller records and KubeRay pod deletions there were.
    step_end: tuple[float, int, int] = (0.0, 0, 0)

    def claims(self, gang: str | None = None) -> list[dict[str, Any]]:
        sel = "rayscale.io/owned-by=rayscale" + (f",rayscale.io/gang={gang}" if gang else "")
        return self.api.store.list("nodeclaims", label_selector=sel)[0]

    def workers(self) -> list[dict[str, Any]]:
        return self.api.store.list("pods", NS, f"ray.io/cluster={RC},ray.io/node-type=worker")[0]

    def pods_of(self, gang: Gang) -> list[dict[str, Any]]:
        return [p for p in self.workers() if p["spec"].get("nodeName") in gang.node_ids]

    def group(self) -> dict[str, Any]:
        rc = self.api.store.get("rayclusters", RC, NS)
        return next(g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == GROUP)

    def ready(self) -> list[Gang]:
        return [g for g in self.ctl.gangs() if g.phase == GangPhase.READY]

    def replicas(self) -> list[dict[str, Any]]:
        """Serve's replicas of the flavor deployment (state, node_ip, node_id), from the dashboard."""
        assert self.cluster.dashboard_url
        r = httpx.get(f"{self.cluster.dashboard_url}/api/serve/applications/", timeout=10)
        r.raise_for_status()
        deps = r.json()["applications"][APP]["deployments"]
        reps: list[dict[str, Any]] = deps[deployment_name(*DEP)].get("replicas") or []
        return reps

    def running_on(self, ip: str) -> bool:
        return any(r.get("state") == "RUNNING" and r.get("node_ip") == ip for r in self.replicas())

    def describe(self) -> str:
        """Every layer, for a failure message."""
        lines = [f"gangs: {[(g.name, g.phase.value, g.reason, g.node_ids) for g in self.ctl.gangs()]}"]
        lines += [f"claims: {[c['metadata']['name'] for c in self.claims()]}"]
        lines += [f"pod {p['metadata']['name']} on {p['spec'].get('nodeName')}: {p['status'].get('phase')} "
                  f"{p['status'].get('podIP')} deleting={bool(p['metadata'].get('deletionTimestamp'))}"
                  for p in self.workers()]
        with contextlib.suppress(Exception):
            lines += [f"group replicas={self.group()['replicas']} "
                      f"workersToDelete={self.group().get('scaleStrategy', {}).get('workersToDelete')}"]
        lines += [f"kubelet {r.pod}: {r.state} {r.ip} {r.node_id} {r.error}" for r in self.kubelet.runs.values()]
        with contextlib.suppress(Exception):
            lines += [f"ray nodes: {[(n.id, n.state, n.node_ip) for n in self.cluster.nodes(include_dead=True)]}"]
        with contextlib.suppress(Exception):
            lines += [f"serve replicas: {[(r.get('state'), r.get('node_ip')) for r in self.replicas()]}"]
        recs = self.ctl.records[-8:]
        lines += [f"record: actions={[(a['type'], a.get('name') or a.get('replicas')) for a in r.actions]} "
                  f"errors={r.errors}" for r in recs]
        return "\n".join(lines)

    def released(self, gangs: set[str]) -> bool:
        """Every gang named is gone from the cluster: no NodeClaim, no worker pod, no Ray node of its pods."""
        pods = {p for g in gangs for p in self.events.pods_of(g)}
        live_pods = {p["metadata"]["name"] for p in self.workers()}
        return (not any(self.claims(g) for g in gangs) and not pods & live_pods
                and all(r.state == "stopped" for r in self.kubelet.runs.values() if r.pod in pods))


def _serve(w: KubeWorld) -> tuple[int, int]:
    s = w.serve.snapshot()
    return s.target.get(DEP, 0), s.running.get(DEP, 0)


def _served_on(ip: str) -> float:
    """Requests the engines on the Ray node at ``ip`` finished (its own metrics endpoint: per node)."""
    import ray

    total = 0.0
    for n in ray.nodes():
        if n.get("Alive") and n.get("NodeManagerAddress") == ip and n.get("MetricsExportPort"):
            text = httpx.get(f"http://{ip}:{n['MetricsExportPort']}/metrics", timeout=5).text
            for line in text.splitlines():
                if line.startswith("ray_vllm_e2e_request_latency_seconds_count{") and f'model_name="{MODEL}"' in line:
                    total += float(line.rsplit(" ", 1)[1])
    return total


def _no_replica(serve: ServeClient) -> bool:
    s = serve.snapshot()
    return s.ok and DEP in s.target and s.running.get(DEP, 0) == 0


def _clear_leftovers(cluster: LocalCluster, serve: ServeClient) -> None:
    """Start from zero: the flavor deployment at 0 replicas and no worker nodes (test_controller.py's
    gangs are still up when it ends). Nothing else writes to the cluster now."""
    if serve.snapshot().target.get(DEP, 0):
        serve.scale(APP, MODEL, FLAVOR, 0)
    wait_for(lambda: _no_replica(serve), 90, "no flavor replica left from earlier tests")
    for n in cluster.nodes(include_dead=True):
        if not n.is_head:
            cluster.remove_node(n.id, grace_s=5)


@pytest.fixture(scope="module")
def world(cluster: LocalCluster, serve_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeWorld]:
    assert cluster.dashboard_url
    cat = local_catalog()
    serve = ServeClient(cluster.dashboard_url)
    _clear_leftovers(cluster, serve)
    api = KubeAPIServer(default_watch_timeout=10, namespaces=("default", NS)).start()
    events = Events()
    api.store.add_listener(events)
    install_manifests(api, cat)  # the rendered EC2NodeClasses, NodePools and RayCluster
    kubelet = RayPodKubelet(api.store, cluster, namespace=NS, raycluster=RC, drain_grace_s=15.0)
    karpenter = KarpenterStandIn(api.store, KarpenterConfig(delays=Delays(launch=1.0, register=1.0, initialize=1.0)),
                                 tick=0.25)
    kuberay = KubeRayStandIn(api.store, tick=0.25, external_kubelet=kubelet.runs_pod)
    for s in (kubelet, karpenter, kuberay):
        s.start()
    api_client = api.api_client()
    act = SerialKubeActuator(cat, api_client, KubeActuatorConfig(namespace=NS, raycluster=RC), seed=1)
    log = tmp_path_factory.mktemp("kctl") / "decisions.jsonl"
    ctl = Controller(cat, act, serve, MetricsScraper(ray_metrics_endpoints),
                     ControllerConfig(Settings(period_s=2.0, window_s=10.0, stale_after_s=8.0, forecaster="last",
                                               estimate=EstimateSettings(),
                                               # a Ray node on two busy cores may take a while: a gang gets 120 s
                                               act=ActSettings(backoff_s=30.0, launch_timeout_factor=6.0),
                                               planner=PlannerSettings(downscale_delay_s=8.0, min_dwell_s=4.0)),
                                      app_name=APP, decision_log=log),
                     weights_sink=set_flavor_weights)
    thread = ctl.start()
    w = KubeWorld(api, cat, cluster, karpenter, kuberay, kubelet, act, ctl, serve, events)
    try:
        yield w
    finally:
        if w.trickle is not None:
            w.trickle.stop()
        ctl.stop()
        thread.join(30)
        with contextlib.suppress(Exception):
            serve.scale(APP, MODEL, FLAVOR, 0)
            wait_for(lambda: _no_replica(serve), 60, "the flavor replicas to stop")
        kubelet.close()
        for s in (kuberay, karpenter):
            s.stop()
        api.store.remove_listener(events)
        api_client.close()
        serve.close()
        api.stop()
        left = [n.id for n in cluster.nodes(include_dead=True) if not n.is_head]
        assert not left, f"worker nodes left behind: {left}"
        assert not kubelet.errors and not karpenter.errors and not kuberay.errors, \
            (kubelet.errors, karpenter.errors, kuberay.errors)


def _wait(w: KubeWorld, predicate: Any, timeout_s: float, what: str) -> Any:
    """wait_for, and on a timeout the state of every layer (gangs, pods, Ray nodes, Serve replicas)."""
    try:
        return wait_for(predicate, timeout_s, what)
    except TimeoutError as e:
        raise AssertionError(f"{e}\n{w.describe()}") from None


def test_min_replicas_first_gang_through_kubernetes(world: KubeWorld, serve_url: str) -> None:
    w = world
    _wait(w, lambda: len(w.ready()) == 1 and _serve(w) == (1, 1), 150, "the first gang and replica")
    (g,) = w.ready()
    # NodeClaims created by the actuator, launched by Karpenter, their Nodes admitted to Ray.
    claims = w.claims(g.name)
    assert [c["metadata"]["name"] for c in claims] == [f"{g.name}-0"]
    assert [x[0] for x in w.karpenter.launched] == [f"{g.name}-0"]
    node = claims[0]["status"]["nodeName"]
    assert w.api.store.get("nodes", node)["metadata"]["labels"]["rayscale.io/ray-worker"] == "true"
    assert w.group()["replicas"] == 1
    # One worker pod, Running on that Node, whose IP is its real Ray node's.
    (pod,) = w.pods_of(g)
    ip = pod["status"]["podIP"]
    assert pod["status"]["phase"] == "Running" and ip.startswith("127.0.0.") and ip != "127.0.0.2"
    assert f"ip:{ip}" in g.node_ids
    run = w.kubelet.run_of(pod["metadata"]["name"])
    assert run is not None and run.state == "running" and run.node_id
    ray_node = w.cluster.node(run.node_id)
    assert ray_node.alive and ray_node.node_ip == ip
    # What the pod's `ray start` declares: the worker group's GPU count and flavor resource.
    assert ray_node.num_gpus == 1 and ray_node.resources.get("accelerator_type:A10G") == 1
    assert w.cluster.address.startswith("127.0.0.2:")  # the head and the GCS stay where they were
    # Serve's replica runs on that node, and requests are served there.
    _wait(w, lambda: w.running_on(ip), 90, f"the Serve replica RUNNING on {ip}")
    r = load(serve_url, 1.0, 5.0, seed=11)
    assert r.summary.errors == 0 and r.summary.requests >= 3, r.summary.table()
    _wait(w, lambda: _served_on(ip) > 0, 30, f"requests served by the engine on {ip}")


def test_load_step_adds_a_gang_and_serves_through_it(world: KubeWorld, serve_url: str) -> None:
    w = world
    before = {g.name for g in w.ready()}
    steady = SteadyLoad(serve_url, 3.0, seed=12)
    try:
        _wait(w, lambda: len(w.ready()) >= 2 and _serve(w)[0] >= 2, 150, "a second gang and replica")
        new = [g for g in w.ready() if g.name not in before]
        assert new, "the scale-up must run on a new gang"
        new_ips = set()
        for g in new:
            (pod,) = w.pods_of(g)
            ip = pod["status"]["podIP"]
            assert f"ip:{ip}" in g.node_ids and ip != "127.0.0.2"
            new_ips.add(ip)
        # Serve placed a replica on a new gang's node, and requests were served by the engine there. The
        # step may add more than one gang, and Serve may start its replica on any of them: look at all.
        def new_nodes() -> set[str]:
            return {ip for g in w.ready() if g.name not in before for p in w.pods_of(g)
                    if (ip := p["status"].get("podIP"))}

        _wait(w, lambda: any(w.running_on(i) for i in new_nodes()), 180,
              f"a Serve replica RUNNING on a new gang's node (first: {sorted(new_ips)})")
        _wait(w, lambda: any(_served_on(i) > 0 for i in new_nodes()), 60,
              f"requests served by an engine on a new node (first: {sorted(new_ips)})")
    finally:
        # The step ends: a trickle goes on, so the scale-down that follows drains under live traffic.
        w.trickle = SteadyLoad(serve_url, 0.0, seed=13, every_s=15.0)
        w.step_end = (time.monotonic(), len(w.ctl.records), len(w.kuberay.deleted_pods))
        requests, failed, table = errors(steady.stop())
    assert failed == 0 and requests > 30, table
    assert w.group()["replicas"] >= 2
    ups = [a for rec in w.ctl.records for a in rec.actions if a["type"] == "CreateGang"]
    assert len(ups) >= 2 and all("plan wants" in a["reason"] for a in ups)


def test_load_ends_drain_then_release(world: KubeWorld) -> None:
    w = world
    assert w.trickle is not None, "runs after the load step"
    t0, r0, d0 = w.step_end

    def deleted() -> set[str]:
        return {a["name"] for rec in w.ctl.records[r0:] for a in rec.actions if a["type"] == "DeleteGang"}

    def settled() -> bool:
        live = {g.name for g in w.ctl.gangs()}
        return _serve(w) == (1, 1) and len(live) == 1 and bool(deleted() - live) and w.released(deleted() - live)

    try:
        _wait(w, settled, 180, "drain back to one replica and one gang, the others released")
    finally:
        requests, failed, table = errors(w.trickle.stop())
        w.trickle = None
    assert failed == 0 and requests >= 1, table  # nothing failed while replicas drained and gangs went
    (kept,) = w.ready()
    records = w.ctl.records[r0:]
    # The gangs that served when the step ended, and their pods then: what the drain is about. (The
    # planner may also order and cancel a gang on the way down; that one serves nothing.)
    served = {n for n, phase in records[0].gangs.items() if phase == "ready"}
    gone = (deleted() & served) - {kept.name}
    assert gone and kept.name in served
    gone_pods = {p for g in gone for p in w.events.pods_of(g, at=t0)}
    kept_pods = w.events.pods_of(kept.name, at=time.monotonic())
    assert all(w.events.pods_of(g, at=t0) for g in gone) and len(kept_pods) == 1, (gone_pods, kept_pods)
    # Drain first, then release: a gang that served was deleted only after Serve was lowered, at some point
    # after the gang was created (the lowering may precede the step's end: the step can order a gang the
    # planner gives back before the load stops).
    actions = [(a, rec) for rec in w.ctl.records for a in rec.actions]
    for k, (a, rec) in enumerate(actions):
        if a["type"] == "DeleteGang" and rec.gangs.get(a["name"]) == "ready":
            born = max((i for i, (b, _) in enumerate(actions[:k]) if b["type"] == "CreateGang" and b["name"] == a["name"]),
                       default=0)
            assert any(b["type"] == "SetReplicas" for b, _ in actions[born:k]), [b for b, _ in actions[born:k + 1]]
    # workersToDelete named the released gangs' pods and only pods of gangs being released, never the
    # kept one's; KubeRay deleted exactly what was named.
    released_pods = {p for g in deleted() for p in w.events.pods_of(g)}
    lists = [set(wl) for t, _grp, wl in w.events.workers_to_delete if t >= t0 and wl]
    named = set().union(*lists) if lists else set()
    assert gone_pods <= named <= released_pods and not named & kept_pods, (lists, gone_pods, kept_pods)
    assert set(w.kuberay.deleted_pods[d0:]) == named
    assert w.group()["replicas"] == 1 and not w.group()["scaleStrategy"]["workersToDelete"]
    # Each gang's NodeClaims were deleted only once its pods were gone (their Ray nodes drained and stopped).
    for g in gone:
        claims = w.events.claims_of(g, since=t0)
        assert claims and w.claims(g) == []
        for uid, c in claims.items():
            assert all(w.events.claims_deleting[uid] >= w.events.pods_gone[p] for p in w.events.pods_of(g, t0)), c
    # Their Ray nodes are gone; the kept gang's node and replica still run.
    for p in gone_pods:
        run = w.kubelet.run_of(p)
        assert run is not None and run.state == "stopped" and run.node_id
        assert run.node_id not in {n.id for n in w.cluster.nodes(include_dead=True)}
    import ray

    alive_ips = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    assert not {w.events.pod_ip[p] for p in gone_pods} & alive_ips
    (kept_ip,) = {w.events.pod_ip[p] for p in kept_pods}
    assert kept_ip in alive_ips and w.running_on(kept_ip)

