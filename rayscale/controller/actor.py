"""The controller as a detached Ray actor on the head node: Ray restarts it when it dies.

Same code as the plain process (`rayscale controller`): the actor builds a Controller from a small spec
and runs its loop in a thread. Nothing is lost on a restart that the world does not hold (gangs come
from node labels, replicas from Serve), so a restarted actor picks up where the last one stopped.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any

import ray

NAME = "rayscale-controller"
NAMESPACE = "rayscale"


@dataclass
class ControllerSpec:
    root: str  # local cluster root (LocalCluster.attach)
    models: str | None = None
    flavors: str | None = None
    profiles: str | None = None
    only_models: list[str] | None = None
    only_flavors: list[str] | None = None
    app: str = "rayscale"
    launch_delay_s: float = 5.0
    max_nodes: int = 3
    decision_log: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)  # what it changes of the shipped settings


@ray.remote(num_cpus=0, max_restarts=-1)
class ControllerActor:
    def __init__(self, spec: dict[str, Any]) -> None:
        from pathlib import Path

        from rayscale.cluster.local import LocalCluster
        from rayscale.cluster.local_actuator import LocalActuator, LocalActuatorConfig
        from rayscale.config import load_catalog, settings_from_mapping
        from rayscale.controller.checkpoint import CHECKPOINT_FILE, FileStore
        from rayscale.controller.loop import Controller, ControllerConfig
        from rayscale.controller.metrics import ControllerMetrics
        from rayscale.controller.serve_client import ServeClient
        from rayscale.serve.weights import set_flavor_weights
        from rayscale.signals.scrape import MetricsScraper

        s = ControllerSpec(**spec)
        cat = load_catalog(s.models, s.flavors, s.profiles)
        if s.only_models or s.only_flavors:
            cat = cat.subset(s.only_models, s.only_flavors)
        cluster = LocalCluster.attach(s.root)
        if not cluster.dashboard_url:
            raise RuntimeError(f"the local cluster under {s.root} runs without a dashboard")
        self.actuator = LocalActuator(cluster, LocalActuatorConfig(default_launch_delay_s=s.launch_delay_s,
                                                                   max_worker_nodes=s.max_nodes))
        import time

        self.actuator.recover(time.time())  # Ray restarted this actor: settle a node start it was killed in
        self.ctl = Controller(cat, self.actuator, ServeClient(cluster.dashboard_url), MetricsScraper(),
                              ControllerConfig(settings_from_mapping(s.settings, "ControllerSpec.settings"),
                                               app_name=s.app,
                                               decision_log=Path(s.decision_log) if s.decision_log else None,
                                               state_store=FileStore(Path(s.root) / CHECKPOINT_FILE)),
                              weights_sink=set_flavor_weights)
        self.ctl.on_record(ControllerMetrics(cat).update)
        self._thread = threading.Thread(target=self.ctl.run, name="rayscale-controller", daemon=True)
        self._thread.start()

    def status(self) -> dict[str, Any]:
        last = self.ctl.records[-1] if self.ctl.records else None
        return {"reconciles": len(self.ctl.records), "running": self._thread.is_alive(),
                "gangs": last.gangs if last else {}, "serve": last.serve if last else {},
                "errors": last.errors if last else []}

    def stop(self) -> None:
        self.ctl.stop()
        self._thread.join(timeout=30)
        self.actuator.close()
        self.ctl.scraper.close()


def start_detached(spec: ControllerSpec) -> Any:
    """Start (or find) the detached controller actor, pinned to the head node."""
    return ControllerActor.options(  # type: ignore[attr-defined]
        name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        resources={"node:__internal_head__": 0.001},
    ).remote(asdict(spec))


def get_detached() -> Any:
    return ray.get_actor(NAME, namespace=NAMESPACE)
