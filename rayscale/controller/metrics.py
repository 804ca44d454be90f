"""The controller's own metrics: a Prometheus endpoint, and the same series through Ray's metrics so they
show in the Ray dashboard (Ray exports them as ``ray_rayscale_*``; deployments/grafana has a dashboard).

Series: desired vs actual replicas per (model, flavor), gangs per (flavor, phase), nodes per flavor,
SLO attainment per model (observed p95 TTFT and TPOT within the SLO over the window: 1, else 0; absent
while signals are stale), the share of requests within the SLO that SLO feedback has smoothed and the factor
it puts on demand (rayscale.core.feedback), plan cost in $/h, decision latency, and errors.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

from rayscale.controller.loop import DecisionRecord
from rayscale.core.catalog import Catalog

PREFIX = "rayscale_"
DELIVERED_HELP = "share of finished requests within both SLO targets, smoothed (SLO feedback)"
FACTOR_HELP = "SLO feedback's factor on the model's demand"


class ControllerMetrics:
    def __init__(self, catalog: Catalog, port: int | None = None, addr: str = "127.0.0.1",
                 ray_metrics: bool = True):
        self.catalog = catalog
        self.registry = CollectorRegistry()
        r = self.registry
        self.desired = Gauge(PREFIX + "desired_replicas", "replicas the plan wants", ["model", "flavor"], registry=r)
        self.actual = Gauge(PREFIX + "actual_replicas", "Serve target replicas now", ["model", "flavor"], registry=r)
        self.gangs = Gauge(PREFIX + "gangs", "gangs by phase", ["flavor", "phase"], registry=r)
        self.nodes = Gauge(PREFIX + "nodes", "nodes in ready gangs", ["flavor"], registry=r)
        self.slo = Gauge(PREFIX + "slo_attainment", "1 if observed p95 TTFT and TPOT meet the SLO", ["model"],
                         registry=r)
        self.delivered = Gauge(PREFIX + "slo_delivered", DELIVERED_HELP, ["model"], registry=r)
        self.factor = Gauge(PREFIX + "demand_factor", FACTOR_HELP, ["model"], registry=r)
        self.cost = Gauge(PREFIX + "usd_per_hour", "cost of the plan", registry=r)
        self.latency = Histogram(PREFIX + "decision_latency_seconds", "one reconcile, observe to act",
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.errors = Gauge(PREFIX + "errors", "errors in the last reconcile", registry=r)
        self.leader = Gauge(PREFIX + "leader", "1 while this controller acts, 0 while it waits for the Lease",
                            registry=r)
        self.port = start_http_server(port, addr=addr, registry=r)[0].server_port if port is not None else None
        self._ray: dict[str, Any] = {}
        if ray_metrics:
            self._init_ray()

    def _init_ray(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        from ray.util import metrics as rm

        self._ray = {
            "desired": rm.Gauge(PREFIX + "desired_replicas", "replicas the plan wants", ("model", "flavor")),
            "actual": rm.Gauge(PREFIX + "actual_replicas", "Serve target replicas now", ("model", "flavor")),
            "gangs": rm.Gauge(PREFIX + "gangs", "gangs by phase", ("flavor", "phase")),
            "nodes": rm.Gauge(PREFIX + "nodes", "nodes in ready gangs", ("flavor",)),
            "slo": rm.Gauge(PREFIX + "slo_attainment", "1 if observed p95 TTFT and TPOT meet the SLO", ("model",)),
            "delivered": rm.Gauge(PREFIX + "slo_delivered", DELIVERED_HELP, ("model",)),
            "factor": rm.Gauge(PREFIX + "demand_factor", FACTOR_HELP, ("model",)),
            "cost": rm.Gauge(PREFIX + "usd_per_hour", "cost of the plan"),
            "latency": rm.Histogram(PREFIX + "decision_latency_seconds", "one reconcile, observe to act",
                                    boundaries=[0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]),
        }

    def update(self, rec: DecisionRecord) -> None:
        if not rec.plan:
            return
        desired: dict[tuple[str, str], int] = defaultdict(int)
        for e in rec.plan.get("entries", []):
            desired[(e["model"], e["flavor"])] += int(e["replicas"])
        actual = {tuple(k.split("--", 1)): v for k, v in rec.serve.items()}
        for (m, f) in set(desired) | set(actual):
            self._set("desired", desired.get((m, f), 0), model=m, flavor=f)
            self._set("actual", actual.get((m, f), 0), model=m, flavor=f)
        for f in self.catalog.flavors:
            counts = rec.by_flavor.get(f, {})
            for ph in ("pending", "ready", "failed"):
                self._set("gangs", counts.get(ph, 0), flavor=f, phase=ph)
            self._set("nodes", counts.get("nodes", 0), flavor=f)
        for m, s in rec.signals.items():
            spec = self.catalog.models.get(m)
            if spec is None or s.get("freshness") != "fresh":
                continue
            ok = all(v is None or v <= lim for v, lim in ((s.get("ttft_p95_s"), spec.slo.ttft_p95_s),
                                                          (s.get("tpot_p95_s"), spec.slo.tpot_p95_s)))
            self._set("slo", 1.0 if ok else 0.0, model=m)
            if "slo_delivered" in s:
                self._set("delivered", float(s["slo_delivered"]), model=m)
                self._set("factor", float(s["demand_factor"]), model=m)
        self._set("cost", float(rec.plan.get("usd_per_h", 0.0)))
        total_s = sum(rec.durations_ms.values()) / 1000
        self.latency.observe(total_s)
        if "latency" in self._ray:
            self._ray["latency"].observe(total_s)
        self.errors.set(len(rec.errors))
        self.leader.set(1)

    def standby(self) -> None:
        """This replica waits for the Lease: it exports no decisions, or the dashboard would show its last
        ones (stale since it lost the Lease) beside the acting replica's."""
        self.leader.set(0)
        for g in (self.desired, self.actual, self.gangs, self.nodes, self.slo, self.delivered, self.factor):
            g.clear()
        self.cost.set(math.nan)  # unlabelled: it cannot be removed, and PromQL's max skips NaN

    def _set(self, name: str, value: float, **tags: str) -> None:
        g = getattr(self, name)
        (g.labels(**tags) if tags else g).set(value)
        if name in self._ray:
            self._ray[name].set(value, tags=tags or None)
