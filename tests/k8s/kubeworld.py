"""A small world for actuator tests: the HTTP emulator, the Karpenter and KubeRay stand-ins on a manual
clock, the rendered RayCluster, and KubeActuators built on the official client.

``rendered`` and ``install_manifests`` are shared with the end-to-end test that closes the loop through
Kubernetes on a real clock (tests/e2e/test_kube_controller.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml
from rayscale_testing.karpenter import Delays, KarpenterConfig, KarpenterStandIn
from rayscale_testing.kubeapi import KubeAPIServer
from rayscale_testing.kuberay import KubeRayStandIn
from rayscale_testing.scheduler import ManualClock

from rayscale.cluster.kube import KubeActuator, KubeActuatorConfig, RetryPolicy
from rayscale.cluster.render import RenderSettings, render
from rayscale.core.act import Gang
from rayscale.core.catalog import Catalog

NS = "rayscale"
RC = "rayscale"
FAST_RETRY = RetryPolicy(attempts=5, base_s=0.005, max_s=0.02, request_timeout_s=5.0)


@dataclass
class World:
    api: KubeAPIServer
    catalog: Catalog
    clock: ManualClock
    karpenter: KarpenterStandIn
    kuberay: KubeRayStandIn
    clients: list[Any] = field(default_factory=list)
    act: KubeActuator | None = None
    config: KubeActuatorConfig = field(
        default_factory=lambda: KubeActuatorConfig(namespace=NS, raycluster=RC, retry=FAST_RETRY))
    # Serve's targets the controller hands the actuator each period (``sync_serve_targets``), where a
    # test drives a RayService; empty: none.
    serve_targets: dict[str, dict[str, int]] = field(default_factory=dict)

    def actuator(self) -> KubeActuator:
        """A fresh actuator (a restarted controller): no memory but what the cluster holds."""
        c = self.api.api_client()
        self.clients.append(c)
        self.act = KubeActuator(self.catalog, c, self.config, seed=1)
        return self.act

    def step(self, dt: float = 5.0) -> None:
        self.clock.advance(dt)
        self.karpenter.step()
        self.kuberay.step()

    def tick(self, dt: float = 5.0) -> list[Gang]:
        self.step(dt)
        assert self.act is not None
        return self.act.gangs(self.clock.now())

    def until(self, pred: Callable[[list[Gang]], bool], ticks: int = 40, what: str = "") -> list[Gang]:
        for _ in range(ticks):
            gangs = self.tick()
            if pred(gangs):
                return gangs
        raise AssertionError(f"not reached in {ticks} ticks: {what}; gangs={gangs}")

    # --- reading the world -------------------------------------------------------------------------
    def claims(self, gang: str | None = None) -> list[dict[str, Any]]:
        sel = "rayscale.io/owned-by=rayscale" + (f",rayscale.io/gang={gang}" if gang else "")
        return sorted(self.api.store.list("nodeclaims", label_selector=sel)[0], key=lambda c: c["metadata"]["name"])

    def group(self, name: str) -> dict[str, Any]:
        rc = self.api.store.get("rayclusters", RC, NS)
        return next(g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == name)

    def workers(self, group: str | None = None) -> list[dict[str, Any]]:
        pods = self.api.store.list("pods", NS, f"ray.io/cluster={RC},ray.io/node-type=worker")[0]
        return [p for p in pods if group is None or p["metadata"]["labels"]["ray.io/group"] == group]

    def close(self) -> None:
        for c in self.clients:
            c.close()


_RENDERED: dict[int, tuple[Catalog, dict[str, list[dict[str, Any]]]]] = {}


def _render(catalog: Catalog) -> dict[str, list[dict[str, Any]]]:
    if id(catalog) not in _RENDERED or _RENDERED[id(catalog)][0] is not catalog:
        files = render(catalog, RenderSettings(namespace=NS, raycluster=RC))
        _RENDERED[id(catalog)] = (catalog, {p: [d for d in yaml.safe_load_all(t) if d] for p, t in files.items()})
    return _RENDERED[id(catalog)][1]


def rendered(catalog: Catalog, path: str) -> list[dict[str, Any]]:
    """The documents `rayscale render` writes to ``path`` (rendered once per catalog)."""
    return copy.deepcopy(_render(catalog)[path])


def rendered_raycluster(catalog: Catalog) -> dict[str, Any]:
    """The RayCluster `rayscale render` writes."""
    return rendered(catalog, "deployments/k8s/raycluster.yaml")[0]


def install_manifests(api: KubeAPIServer, catalog: Catalog, *, nodepools: bool = True) -> None:
    """What a user applies: the rendered EC2NodeClasses and NodePools (the emulator validates them against
    the real CRDs) and the rendered RayCluster."""
    if nodepools:
        for path in sorted(p for p in _render(catalog) if p.startswith("nodepools/")):
            for doc in rendered(catalog, path):
                api.store.create(doc["kind"], doc)
    api.store.create("rayclusters", rendered_raycluster(catalog), NS)


def make_world(api: KubeAPIServer, catalog: Catalog, delays: Delays | None = None) -> World:
    """The rendered NodePools are applied: the actuator reads them (ownerReference, limits) and the
    Karpenter stand-in consolidates empty nodes by their disruption settings."""
    install_manifests(api, catalog)
    clock = ManualClock()
    k = KarpenterStandIn(api.store, KarpenterConfig(delays=delays or Delays(launch=5, register=5, initialize=5)),
                         clock=clock)
    r = KubeRayStandIn(api.store, clock=clock)
    w = World(api, catalog, clock, k, r)
    w.actuator()
    return w
