"""The controller closing the loop on a real local cluster: scale up on a load step, hold when metrics
are gone, drain without dropping a request, and survive a kill -9 mid scale-up."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from rayscale.cluster.actuator import LABEL_GANG
from rayscale.cluster.local import LABEL_NODE, PAUSE_ENV, LocalCluster
from rayscale.cluster.local_actuator import LocalActuator, LocalActuatorConfig
from rayscale.controller.loop import Controller, ControllerConfig
from rayscale.controller.metrics import ControllerMetrics
from rayscale.controller.serve_client import ServeClient
from rayscale.core.act import ActSettings, GangPhase
from rayscale.core.estimate import EstimateSettings
from rayscale.core.plan import PlannerSettings
from rayscale.core.settings import Settings
from rayscale.serve.weights import set_flavor_weights
from rayscale.signals.scrape import MetricsScraper, ray_metrics_endpoints
from tests.e2e.conftest import APP, MODEL, local_catalog, wait_for
from tests.e2e.load import Background, SteadyLoad, errors, load

DEP = (MODEL, "a10g")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ctl(cluster: LocalCluster, serve_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Controller]:
    assert cluster.dashboard_url
    act = LocalActuator(cluster, LocalActuatorConfig(default_launch_delay_s=1.0, max_worker_nodes=3,
                                                     drain_grace_s=20.0))
    log = tmp_path_factory.mktemp("ctl") / "decisions.jsonl"
    scraper = MetricsScraper(ray_metrics_endpoints)
    c = Controller(local_catalog(), act, ServeClient(cluster.dashboard_url), scraper,
                   ControllerConfig(Settings(period_s=2.0, window_s=10.0, fast_window_s=4.0, stale_after_s=8.0,
                                             forecaster="last", estimate=EstimateSettings(),
                                             # a Ray node on two busy cores may take a while: a gang gets 120 s
                                             act=ActSettings(backoff_s=30.0, launch_timeout_factor=6.0),
                                             planner=PlannerSettings(downscale_delay_s=8.0, min_dwell_s=4.0)),
                                    app_name=APP, decision_log=log),
                   weights_sink=set_flavor_weights)
    c.metrics = ControllerMetrics(c.catalog, port=0)  # type: ignore[attr-defined]
    c.on_record(c.metrics.update)  # type: ignore[attr-defined]
    c.start()
    yield c
    c.stop()
    act.close()


def _serve(ctl: Controller) -> tuple[int, int]:
    s = ctl.serve.snapshot()
    return s.target.get(DEP, 0), s.running.get(DEP, 0)


def _serving(ctl: Controller) -> int:
    return ctl.serve.snapshot().serving.get(DEP, 0)


def _ready_gangs(ctl: Controller) -> list[Any]:
    return [g for g in ctl.gangs() if g.phase == GangPhase.READY]


def test_min_replicas_first_gang_then_serves(ctl: Controller, serve_url: str) -> None:
    wait_for(lambda: len(_ready_gangs(ctl)) == 1 and _serve(ctl) == (1, 1), 180, "the first gang and replica")
    # Running is not serving: the engine inside may still be starting (a minute on two busy cores), and the
    # ingress holds requests for it no longer than a load's timeout.
    wait_for(lambda: _serving(ctl) == 1, 180, "the first replica serving")
    r = load(serve_url, 1.0, 5.0, seed=1)
    assert r.summary.errors == 0, r.summary.table()


def test_load_step_adds_nodes_and_serves_through_them(ctl: Controller, serve_url: str) -> None:
    # The min_replicas gang; the light load of the test before may already have ordered a second (with the
    # engines' metrics not scraped yet, the ingress's in-flight requests count as backlog).
    before = {min(_ready_gangs(ctl), key=lambda g: g.created_s).name}
    steady = SteadyLoad(serve_url, 3.0, seed=2, max_s=180.0)
    try:
        wait_for(lambda: _serve(ctl)[0] >= 2 and len(_ready_gangs(ctl)) >= 2, 120, "a scale-up to 2+ replicas")
        new = {g.name for g in _ready_gangs(ctl)} - before
        assert new, "the scale-up must run on a new gang"
        new_nodes = {n for g in ctl.gangs() if g.name in new for n in g.node_ids}
        # Serve placed a replica on the new gang's node and requests reached it (per-replica metrics).
        wait_for(lambda: any(ctl.serve.snapshot().per_node.get(n, 0) for n in new_nodes), 60,
                 "a replica on the new node")
    finally:
        requests, failed, table = errors(steady.stop())
    assert failed == 0 and requests > 10, table
    # The controller's own metrics: its Prometheus endpoint and, through Ray, the dashboard's.
    import httpx

    port = ctl.metrics.port  # type: ignore[attr-defined]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert 'rayscale_desired_replicas{flavor="a10g",model="mistral-7b"}' in text
    assert "rayscale_decision_latency_seconds_count" in text

    def via_ray() -> bool:
        return any("ray_rayscale_desired_replicas" in httpx.get(u, timeout=5).text for u in ray_metrics_endpoints())

    wait_for(via_ray, 30, "ray_rayscale_desired_replicas on a Ray metrics endpoint")
    ups = [a for rec in ctl.records for a in rec.actions if a["type"] == "CreateGang"]
    assert ups and all("plan wants" in a["reason"] for a in ups)
    assert any("scale up" in e["reason"] for rec in ctl.records for e in rec.plan.get("entries", []))


def test_metrics_down_holds_capacity_then_drains_without_dropping(ctl: Controller, serve_url: str) -> None:
    # Load keeps demand up; then the metrics source goes away while the load ends: the controller is
    # blind to the drop and must hold what runs (a zero-load reading would scale down).
    bg0 = Background(lambda: load(serve_url, 3.0, 25.0, seed=4))
    wait_for(lambda: _serve(ctl)[0] >= 2, 90, "replicas for the load")
    time.sleep(8.0)
    n_before = _serve(ctl)[0]
    good = ctl.scraper.endpoints
    ctl.scraper.endpoints = lambda: ["http://127.0.0.2:9/metrics"]  # the metrics source goes away
    try:
        t0 = time.time()
        bg0.join(120)
        time.sleep(max(0.0, 30.0 - (time.time() - t0)))  # > stale_after_s + downscale_delay_s + dwell
        held = [r for r in ctl.records if r.t >= t0 + ctl.config.settings.period_s]
        # Capacity ordered before the outage may still arrive; nothing may go away while the controller is blind.
        assert held and _serve(ctl)[0] >= n_before
        assert not [a for r in held for a in r.actions if a["type"] == "DeleteGang"]
        assert not [a for r in held for a in r.actions if a["type"] == "SetReplicas" and a["replicas"] < n_before]
        assert any("stale" in json.dumps(r.plan) for r in held), "decision records must say why capacity is held"
    finally:
        ctl.scraper.endpoints = good  # a failure here must not leave the next test's controller blind
    # Metrics back, a trickle (one request every 3 s) until the drain ends: the controller drains replicas
    # first, then releases their nodes, and every request (streams included) completes.
    trickle = SteadyLoad(serve_url, 0.0, seed=3, every_s=3.0, max_s=180.0)
    try:
        wait_for(lambda: _serve(ctl) == (1, 1) and len(ctl.gangs()) == 1, 150, "drain back to one replica and gang")
    finally:
        requests, failed, table = errors(trickle.stop())
    assert failed == 0 and requests >= 5, table
    # Drain first, then release: every gang that was ready (it may host a replica) goes only after Serve
    # was lowered. A gang still pending when the plan shrinks never hosted one and may go at once.
    lowered, released = False, []
    for r in [r for r in ctl.records if r.t >= t0]:  # r.gangs: the phases this reconcile observed
        for a in r.actions:
            if a["type"] == "SetReplicas":
                lowered = True
            elif a["type"] == "DeleteGang" and r.gangs.get(a["name"]) == GangPhase.READY.value:
                assert lowered, f"ready gang {a['name']} released before Serve was lowered: {a}"
                released.append(a["name"])
    assert lowered and released, "the drain back to one gang must lower Serve and release ready gangs"


def test_kill_mid_scale_up_and_restart(ctl: Controller, cluster: LocalCluster, tmp_path: Path) -> None:
    # Start from one gang and one replica: a spike in the previous test's tail load may have added a
    # gang, and a gang being drained is still a node until its grace ends. The in-process controller
    # brings it back to one; then it stops (one writer at a time) and the CLI controller takes over.
    def settled() -> bool:
        workers = [n for n in cluster.nodes(include_dead=True) if not n.is_head]
        return len(workers) == 1 and len(_ready_gangs(ctl)) == 1 and _serve(ctl) == (1, 1)

    wait_for(settled, 150, "one gang, one node and one replica before the kill test")
    ctl.stop()
    time.sleep(3)
    assert settled(), "the stopped controller must leave one gang behind"
    survivor = _ready_gangs(ctl)[0].name
    cli = CliControllers(cluster, tmp_path)
    # 1. killed in the launch delay: no node yet
    p = cli.start("1")
    try:
        cli.wait(p, lambda: "CreateGang" in cli.log("1"), 90, "the CLI controller to order a gang")
    finally:
        cli.kill(p)
    # 2. killed after its node's `ray start` was spawned and before its pid was recorded (the pause
    # point holds the state lock, as a start does there): the node runs on, half-recorded
    known = set(ray_start_ids(cluster.root))
    p = cli.start("2", pause="after-spawn:120")
    try:
        spawned = cli.wait(p, lambda: set(ray_start_ids(cluster.root)) - known, 90, "the second controller to spawn")
    finally:
        cli.kill(p)
    (adopt,) = spawned
    # 3. the next controller adopts that node: its gang comes up without a second node or a delete
    p = cli.start("3")
    try:
        def converged() -> bool:
            gangs = ctl.actuator.gangs(time.time())
            return len(gangs) == 2 and all(g.phase == GangPhase.READY for g in gangs)

        cli.wait(p, converged, 120, "two ready gangs after the restarts")
        time.sleep(3)  # a few more periods: nothing more is created or deleted
        gangs = ctl.actuator.gangs(time.time())
        assert len(gangs) == 2 and survivor in {g.name for g in gangs}
        owned = [n for n in cluster.nodes() if not n.is_head]
        assert sorted(n.labels.get(LABEL_GANG) for n in owned) == sorted(g.name for g in gangs)
        assert adopt in {n.id for n in owned} and f"recover: adopted {adopt}" in cli.output("3")
        # each started from the memory the one before saved in the cluster's root (rayscale.core.checkpoint)
        first = json.loads(cli.log("3").splitlines()[0])
        where = cluster.root / "controller-checkpoint.json"
        (note,) = first["notes"]
        assert note.startswith("restored the checkpoint taken ") and note.endswith(f" s ago from {where}"), note
        # no id twice in Ray, no node process without a record, no healthy gang deleted
        names = alive_ray_names(cluster)
        assert sorted(names) == sorted({*names}) == sorted(["head", *(n.id for n in owned)]), names
        assert sorted(ray_start_ids(cluster.root)) == sorted(n.id for n in cluster.nodes(include_dead=True))
        assert "DeleteGang" not in cli.log("3"), cli.log("3")[-3000:]
    finally:
        p.send_signal(signal.SIGTERM)
        rc = p.wait(30)
    # SIGTERM: the period ends, the actuator closes, exit 0 with one line; serving is left as it is
    out = cli.output("3")
    assert rc == 0 and "SIGTERM: stopped" in out, out
    assert "Traceback" not in out and "SIGTERM received" not in out, out
    assert len([n for n in cluster.nodes() if not n.is_head]) == 2


class CliControllers:
    """`rayscale controller` processes on the test's cluster, each with its own decision log and output."""

    def __init__(self, cluster: LocalCluster, tmp_path: Path) -> None:
        self.cluster, self.dir = cluster, tmp_path
        cat = local_catalog()
        m = cat.models[MODEL].model_copy(update={"min_replicas": 2})
        files = {
            "models": {"models": [json.loads(m.model_dump_json())]},
            "flavors": {"flavors": [json.loads(f.model_dump_json()) for f in cat.flavors.values()]},
            "profiles": {"profiles": [json.loads(p.model_dump_json()) for p in cat.profiles.values()]},
        }
        for k, v in files.items():
            (tmp_path / f"{k}.yaml").write_text(yaml.safe_dump(v))

    def start(self, name: str, pause: str = "") -> subprocess.Popen[bytes]:
        d = self.dir
        cmd = [sys.executable, "-m", "rayscale.cli", "controller", "--root", str(self.cluster.root),
               "--metrics-port", "0", "--models", str(d / "models.yaml"), "--flavors", str(d / "flavors.yaml"),
               "--profiles", str(d / "profiles.yaml"), "--period", "1", "--launch-delay", "4",
               "--launch-timeout-factor", "6", "--decision-log", str(d / f"{name}.jsonl"), "--duration", "120"]
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", **({PAUSE_ENV: pause} if pause else {})}
        out = open(d / f"{name}.out", "ab")  # noqa: SIM115  (the child writes it; read on failure)
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def log(self, name: str) -> str:
        path = self.dir / f"{name}.jsonl"
        return path.read_text() if path.exists() else ""

    def output(self, name: str) -> str:
        return (self.dir / f"{name}.out").read_text(errors="replace")[-3000:]

    def wait(self, p: subprocess.Popen[bytes], predicate: Any, timeout_s: float, what: str) -> Any:
        """wait_for, failing at once if the controller exits, and with the controllers' output if it fails."""
        def ready() -> Any:
            if p.poll() is not None:
                raise AssertionError(f"the controller exited with {p.returncode}")
            return predicate()

        try:
            return wait_for(ready, timeout_s, what)
        except (TimeoutError, AssertionError) as e:
            outs = "\n".join(f"--- {o.name}\n{o.read_text(errors='replace')[-2000:]}" for o in self.dir.glob("*.out"))
            raise AssertionError(f"{e}; controller output:\n{outs}") from None

    @staticmethod
    def kill(p: subprocess.Popen[bytes]) -> None:
        p.send_signal(signal.SIGKILL)
        p.wait(10)


def ray_start_ids(root: Path) -> list[str]:
    """Node ids of the `ray start` processes running from ``root``, recorded or not."""
    flag = f"--temp-dir={root}/"
    out = []
    for q in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            args = q.info["cmdline"] or []
            out += [a[len(flag):] for a in args if a.startswith(flag) and "start" in args]
    return out


def alive_ray_names(cluster: LocalCluster) -> list[str]:
    """The rayscale node id of every alive node in Ray's GCS (one entry per Ray node)."""
    from ray.core.generated import gcs_pb2

    infos = cluster._gcs_client().get_all_node_info(timeout=10)
    alive = gcs_pb2.GcsNodeInfo.ALIVE  # type: ignore[attr-defined]
    return [i.labels.get(LABEL_NODE, "?") for i in infos.values() if i.state == alive]


def test_detached_actor_on_the_head_survives_a_crash(cluster: LocalCluster) -> None:
    """`rayscale controller --detached`: Ray restarts the actor after it dies; it converges again from the world."""
    import ray

    from rayscale.controller.actor import ControllerSpec, start_detached

    cat = local_catalog()
    spec_dir = Path(cluster.root) / "spec"
    spec_dir.mkdir(exist_ok=True)
    m = cat.models[MODEL].model_copy(update={"min_replicas": 2})
    for k, v in {
        "models": {"models": [json.loads(m.model_dump_json())]},
        "flavors": {"flavors": [json.loads(f.model_dump_json()) for f in cat.flavors.values()]},
        "profiles": {"profiles": [json.loads(p.model_dump_json()) for p in cat.profiles.values()]},
    }.items():
        (spec_dir / f"{k}.yaml").write_text(yaml.safe_dump(v))
    actor = start_detached(ControllerSpec(root=str(cluster.root), models=str(spec_dir / "models.yaml"),
                                          flavors=str(spec_dir / "flavors.yaml"),
                                          profiles=str(spec_dir / "profiles.yaml"), app=APP,
                                          settings={"period_s": 1.0, "forecaster": "last"},
                                          launch_delay_s=1.0))
    try:
        wait_for(lambda: ray.get(actor.status.remote(), timeout=30)["reconciles"] >= 3, 120, "the actor reconciling")
        pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        os.kill(pid, signal.SIGKILL)  # the controller process dies
        wait_for(lambda: ray.get(actor.status.remote(), timeout=30)["reconciles"] >= 2, 120, "Ray to restart it")
        assert ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30) != pid

        def ready() -> dict[str, str]:
            gangs: dict[str, str] = ray.get(actor.status.remote(), timeout=30)["gangs"]
            return gangs if len(gangs) >= 2 and set(gangs.values()) == {"ready"} else {}

        gangs = wait_for(ready, 120, "ready gangs (at least min_replicas) under the restarted actor")
        owned = [n for n in cluster.nodes() if not n.is_head]
        assert len(owned) == len(gangs) and {n.labels.get(LABEL_GANG) for n in owned} == set(gangs)
    finally:
        with contextlib.suppress(Exception):
            ray.get(actor.stop.remote(), timeout=60)
        ray.kill(actor, no_restart=True)
