"""`rayscale controller`: the reconcile loop as a plain process, on the local cluster or on Kubernetes."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rayscale.commands.plan import add_catalog_args, catalog_from_args
from rayscale.commands.settings_args import add_settings_args, settings_from_args

if TYPE_CHECKING:
    from rayscale.cluster.actuator import Actuator
    from rayscale.controller.checkpoint import StateStore
    from rayscale.core.catalog import Catalog
    from rayscale.core.settings import Settings


def register(sub: Any) -> None:
    p = sub.add_parser("controller", help="run the reconcile loop (local cluster or Kubernetes)",
                       description="Observe, estimate, plan and act every period; one JSON decision record "
                                   "per period.")
    add_catalog_args(p)
    add_settings_args(p)
    p.add_argument("--actuator", choices=["local", "kube"], default="local",
                   help="local: Ray nodes on this machine (`rayscale local up`); kube: Karpenter + KubeRay")
    p.add_argument("--root", default=None, help="local: cluster root dir (default: the one `local up` made)")
    p.add_argument("--launch-delay", type=float, default=5.0, help="local: seconds a node takes to 'launch'")
    p.add_argument("--max-nodes", type=int, default=3, help="local: worker nodes this machine may run")
    p.add_argument("--namespace", default="rayscale", help="kube: namespace of the RayCluster")
    p.add_argument("--raycluster", default="rayscale", help="kube: the RayCluster whose worker groups rayscale owns")
    p.add_argument("--rayservice", default=None, metavar="NAME",
                   help="kube: the KubeRay RayService that owns the RayCluster; its current cluster is read from "
                        "the RayService's status every period (replaces --raycluster)")
    p.add_argument("--dashboard", default=None, help="kube: Ray dashboard URL (Serve API)")
    p.add_argument("--ray-address", default=None,
                   help="kube: Ray address for node discovery and routing weights (default: Ray Client on the "
                        "dashboard host, ray://HOST:--ray-client-port)")
    p.add_argument("--ray-client-port", type=int, default=10001,
                   help="kube: Ray Client port on a RayCluster's head Service (KubeRay's default 10001); with "
                        "--rayservice the driver follows each new cluster there")
    p.add_argument("--ray-gcs", default=None, metavar="ADDRESS",
                   help="kube: the driven cluster's GCS, where gangs are drained before they are released "
                        "(default: KubeRay's head Service, {cluster}-head-svc.{namespace}.svc:6379; "
                        "`none`: never drain, serving gangs then only go on a scale-down)")
    p.add_argument("--app", default="rayscale", help="Serve application of the flavor deployments")
    p.add_argument("--decision-log", default="rayscale-decisions.jsonl", help="JSON lines, one per period")
    p.add_argument("--checkpoint", default=None, metavar="WHERE",
                   help="where the controller saves its memory every period and reads it back on a restart "
                        "(rate history, SLO feedback, timers): local: a file (default: controller-checkpoint.json "
                        "in the cluster root); kube: a ConfigMap in --namespace (default: rayscale-controller-state); "
                        "'none': a restart starts without history")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--detached", action="store_true",
                   help="local: run as a detached Ray actor on the head node (Ray restarts it if it dies)")
    p.add_argument("--stop", action="store_true", help="stop the detached controller actor")
    p.add_argument("--metrics-port", type=int, default=9108, help="Prometheus endpoint of the controller's own "
                   "metrics (local: also exported through Ray as ray_rayscale_*); -1 disables it")
    # All interfaces by default: on Kubernetes Prometheus scrapes the pod's IP, never its loopback.
    p.add_argument("--metrics-address", default="0.0.0.0", help="address the Prometheus endpoint binds")
    p.set_defaults(handler=run)


class _Usage(Exception):
    """A command-line error: printed as ``error: ...``, exit status 2."""


@dataclass(frozen=True)
class _Wiring:
    """What the loop drives and reads, per actuator."""

    actuator: Actuator
    dashboard: str
    address: str
    leader: Callable[[], bool] | None = None  # Kubernetes: the replica holding the Lease acts
    store: StateStore | None = None  # where the checkpoint is kept (rayscale.controller.checkpoint)


def run(args: argparse.Namespace) -> int:
    from rayscale.core.catalog import CatalogError

    try:
        cat = catalog_from_args(args)
        settings = settings_from_args(args)
    except CatalogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.detached or args.stop:
        return _detached(args)
    from rayscale.controller.heap import settle_heap

    settle_heap()
    # SIGTERM from here on stops the controller cleanly (it may come while it still starts up)
    term = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: term.set())
    try:
        wiring = _local_wiring(args) if args.actuator == "local" else _kube_wiring(args, cat, settings)
    except _Usage as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _run_loop(args, cat, settings, wiring, term)
    if term.is_set():
        print("rayscale controller: SIGTERM: stopped after the current period, closed the actuator; "
              "gangs and replicas left running", flush=True)
    return 0


def _local_wiring(args: argparse.Namespace) -> _Wiring:
    """The local cluster's actuator, after settling a node start a previous controller was killed in."""
    from rayscale.cluster.local import DEFAULT_ROOT, LocalCluster, LocalClusterError
    from rayscale.cluster.local_actuator import LocalActuator, LocalActuatorConfig
    from rayscale.controller.checkpoint import CHECKPOINT_FILE, FileStore

    try:
        cluster = LocalCluster.attach(args.root or DEFAULT_ROOT)
    except LocalClusterError as e:
        raise _Usage(str(e)) from None
    if not cluster.dashboard_url:
        raise _Usage("the local cluster runs without a dashboard (needed for Serve's API)")
    local = LocalActuator(cluster, LocalActuatorConfig(default_launch_delay_s=args.launch_delay,
                                                       max_worker_nodes=args.max_nodes))
    for note in local.recover(time.time()):
        print(f"recover: {note}", flush=True)
    store = None if args.checkpoint == "none" else FileStore(args.checkpoint or Path(cluster.root) / CHECKPOINT_FILE)
    return _Wiring(local, cluster.dashboard_url, cluster.address, store=store)


def _kube_wiring(args: argparse.Namespace, cat: Catalog, settings: Settings) -> _Wiring:
    """Karpenter and KubeRay through the API server, the Lease that picks the acting replica and the
    ConfigMap checkpoint."""
    try:
        from kubernetes import client, config
    except ImportError as e:
        from rayscale.extras import missing_extra

        raise missing_extra("kube", "--actuator kube") from e
    from rayscale.cluster.kube.actuator import KubeActuator, KubeActuatorConfig
    from rayscale.cluster.kube.checkpoint import ConfigMapStore
    from rayscale.cluster.kube.lease import LeaderElection
    from rayscale.cluster.ray_drain import KUBERAY_GCS, GcsDrainer

    if not args.dashboard:
        raise _Usage("--dashboard is required with --actuator kube")
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    drainer = None if args.ray_gcs == "none" else GcsDrainer(args.ray_gcs or KUBERAY_GCS, args.namespace)
    actuator = KubeActuator(cat, client.ApiClient(),
                            KubeActuatorConfig(namespace=args.namespace, raycluster=args.raycluster,
                                               rayservice=args.rayservice, twin_backoff_s=settings.act.backoff_s),
                            drainer=drainer)
    identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    leader = LeaderElection(client.CoordinationV1Api(client.ApiClient()), args.namespace, identity).hold
    store = None if args.checkpoint == "none" else ConfigMapStore(
        client.CoreV1Api(client.ApiClient()), args.namespace, **({"name": args.checkpoint} if args.checkpoint else {}))
    address = args.ray_address or ray_client_address(args.dashboard, args.ray_client_port)
    return _Wiring(actuator, args.dashboard, address, leader, store)


def _run_loop(args: argparse.Namespace, cat: Catalog, settings: Settings, wiring: _Wiring,
              term: threading.Event) -> None:
    """The controller on ``wiring`` until ``--duration``, SIGTERM or Ctrl-C; closes what it opened."""
    import logging

    import ray

    from rayscale.controller.loop import Controller, ControllerConfig, record_line
    from rayscale.controller.metrics import ControllerMetrics
    from rayscale.controller.serve_client import ServeClient
    from rayscale.serve.weights import set_flavor_weights
    from rayscale.signals.scrape import MetricsScraper

    follow = args.actuator == "kube" and args.rayservice is not None and not args.ray_address
    if not follow:
        ray.init(address=wiring.address, logging_level=logging.ERROR)
    serve_client, scraper = ServeClient(wiring.dashboard), MetricsScraper(_connected_endpoints)
    ctl = Controller(cat, wiring.actuator, serve_client, scraper,
                     ControllerConfig(settings, app_name=args.app, decision_log=Path(args.decision_log),
                                      state_store=wiring.store),
                     weights_sink=set_flavor_weights, leader=wiring.leader)
    if follow:  # a RayService's cluster changes at every upgrade: the Ray driver follows Serve there
        ctl.on_serve_moved(lambda url: reconnect_ray(url, args.ray_client_port))
    # On Kubernetes the driver is a Ray Client (no core worker here to record Ray metrics through): the
    # Prometheus endpoint is what the cluster scrapes.
    metrics = ControllerMetrics(cat, port=None if args.metrics_port < 0 else args.metrics_port,
                                addr=args.metrics_address, ray_metrics=args.actuator == "local")
    ctl.on_record(metrics.update)
    ctl.on_standby(metrics.standby)
    ctl.on_record(lambda r: print(record_line(r), flush=True))
    _stop_on_sigterm(ctl, term)
    try:
        ctl.run(args.duration)
    except KeyboardInterrupt:
        pass
    finally:
        wiring.actuator.close()
        serve_client.close()
        scraper.close()
        ray.shutdown()


def _connected_endpoints() -> list[str]:
    """The Ray nodes' metrics URLs once the driver is connected; none before (missing metrics, never zero)."""
    import ray

    from rayscale.signals.scrape import ray_metrics_endpoints

    return ray_metrics_endpoints() if ray.is_initialized() else []


def ray_client_address(dashboard_url: str, client_port: int = 10001) -> str:
    """Ray Client on the head Service behind ``dashboard_url``. The controller pod runs no raylet, and a plain
    GCS address needs one on the driver's host (``get_node_to_connect_for_driver`` in
    ray/_private/services.py finds none and fails); Ray Client is Ray's API for a driver off the cluster.
    KubeRay's head Service exposes it as port ``client`` (DefaultClientPort in
    ray-operator/controllers/ray/utils/constant.go)."""
    from urllib.parse import urlparse

    return f"ray://{urlparse(dashboard_url).hostname}:{client_port}"


def reconnect_ray(dashboard_url: str, client_port: int = 10001) -> None:
    """The Ray driver (node discovery for metrics, the ingress's routing-weight store) on the cluster whose
    dashboard Serve is now read from, through Ray Client on the same head Service (``ray_client_address``)."""
    import logging

    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address=ray_client_address(dashboard_url, client_port), logging_level=logging.ERROR)


def _stop_on_sigterm(ctl: Any, got: threading.Event) -> None:
    """SIGTERM (Kubernetes, systemd, kill) stops the loop after the period under way; the caller then
    closes what it opened and exits 0. Nothing is drained: a stopped controller leaves serving as it is.
    Set again after ray.init(), whose native failure handler replaced the first one (it dumps stacks)."""

    def handler(signum: int, frame: object) -> None:
        got.set()
        ctl.stop()

    signal.signal(signal.SIGTERM, handler)
    if got.is_set():  # it came while the controller started: run() returns at once
        ctl.stop()


def _detached(args: argparse.Namespace) -> int:
    import dataclasses
    import logging

    import ray

    from rayscale.cluster.local import DEFAULT_ROOT, LocalCluster
    from rayscale.controller.actor import ControllerSpec, get_detached, start_detached

    if args.actuator != "local":
        print("error: --detached runs the local actuator; on Kubernetes use the rendered Deployment", file=sys.stderr)
        return 2
    root = str(args.root or DEFAULT_ROOT)
    ray.init(address=LocalCluster.attach(root).address, logging_level=logging.ERROR, namespace="rayscale")
    if args.stop:
        try:
            actor = get_detached()
        except ValueError:
            print("no detached controller runs")
            return 0
        ray.get(actor.stop.remote(), timeout=60)
        ray.kill(actor, no_restart=True)
        print("detached controller stopped")
        return 0
    actor = start_detached(ControllerSpec(
        root=root, models=args.models, flavors=args.flavors, profiles=args.profiles,
        only_models=args.only_models, only_flavors=args.only_flavors, app=args.app,
        launch_delay_s=args.launch_delay, max_nodes=args.max_nodes, decision_log=args.decision_log,
        settings=dataclasses.asdict(settings_from_args(args))))
    st = ray.get(actor.status.remote(), timeout=120)
    print(f"detached controller running on the head node ({st}); stop it with `rayscale controller --stop`")
    return 0
