"""A real local cluster (separate `ray start` nodes), Serve with the emulated Mistral-7B, and a controller.

These tests run in their own pytest process (see the Makefile): this process connects to a cluster of
`ray start` nodes that the local actuator grows and shrinks, while the rest of the suite shares an
in-process cluster. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rayscale_testing.waits import wait_for

from rayscale.autoscale_demo import app_args, local_stand_in_catalog
from rayscale.cluster.local import LocalCluster, LocalClusterConfig, free_port
from rayscale.core.catalog import Catalog

NODE_IP = "127.0.0.2"
APP = "rayscale"
MODEL = "mistral-7b"


def serve_http_url(dashboard_url: str) -> str:
    """Serve's HTTP proxy as it runs. ``serve.start`` keeps the proxy of a Serve an earlier test started
    and ignores new http_options, so the address comes from Serve's REST API, not from what was asked."""
    from ray import serve

    serve.start(http_options={"host": NODE_IP, "port": free_port()}, proxy_location="HeadOnly")
    http = httpx.get(f"{dashboard_url}/api/serve/applications/", timeout=10).json()["http_options"]
    return f"http://{http['host']}:{http['port']}"


def local_catalog() -> Catalog:
    return local_stand_in_catalog()


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    import ray

    root = Path(tempfile.mkdtemp(prefix="rs-e2e-", dir="/tmp"))
    cfg = LocalClusterConfig(root_dir=root, head_num_cpus=2, dashboard_port=None,
                             # engine metrics reach the Prometheus endpoints within ~1 s, not ~10 s
                             env={"RAY_metrics_report_interval_ms": "1000"})
    c = LocalCluster(cfg).start()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Replica and request logs stay in the session's log files: on a failure, CI's excerpt of the output
    # must show the controller's timeline (below), not thousands of access-log lines.
    ray.init(address=c.address, logging_level="ERROR", namespace="rayscale-e2e", log_to_driver=False)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        yield c
    finally:
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        c.stop()


@pytest.fixture(scope="session")
def serve_url(cluster: LocalCluster) -> str:
    """Serve with one app: ingress + the emulated Mistral-7B on a10g nodes (its replica waits for a gang)."""
    from ray import serve

    from rayscale.serve.app import build_app

    port = free_port()
    serve.start(http_options={"host": NODE_IP, "port": port}, proxy_location="HeadOnly")
    args = {**app_args(local_catalog()), "app_name": APP}
    # Serve's own wait is unbounded: start without waiting, then poll with a deadline.
    serve.run_many([serve.RunTarget(target=build_app(args), name=APP, route_prefix="/",
                                    external_scaler_enabled=True)],
                   wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    url = f"http://{NODE_IP}:{port}"
    # The flavor replica stays pending until the controller brings an a10g gang; the ingress must be up.
    wait_for(lambda: serve.status().applications[APP].deployments["ingress"].status == "HEALTHY", 120,
             "the ingress to run")
    return url


def timeline(records: list[Any], last: int = 60) -> str:
    """The controller's decision records as one line each: what it saw, ran and did, for a failure report."""
    if not records:
        return "(no decision records)"
    t0 = records[0].t
    lines = []
    for r in records[-last:]:
        sig = {m: (v.get("freshness"), v.get("arrival_rate_rps")) for m, v in r.signals.items()}
        reasons = [e.get("reason", "") for e in r.plan.get("entries", [])]
        acts = [(a.get("type"), a.get("name"), a.get("replicas"), a.get("reason")) for a in r.actions]
        lines.append(f"{r.t - t0:7.1f}s serve={r.serve} gangs={r.gangs} signals={sig} plan={reasons} "
                     f"actions={acts} errors={[e[:80] for e in r.errors]}")
    return "\n".join(lines)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    funcargs = getattr(item, "funcargs", {})
    ctl = funcargs.get("ctl") or getattr(funcargs.get("world"), "ctl", None)
    if ctl is not None:
        report.sections.append(("controller timeline", timeline(list(ctl.records))))
        with contextlib.suppress(Exception):
            report.sections.append(("serve now", repr(ctl.serve.snapshot())[:3000]))
