"""A real local cluster (separate `ray start` nodes), Serve with the emulated Mistral-7B, and a controller.

These tests run in their own pytest process (see the Makefile): this process connects to a cluster of
`ray start` nodes that the local actuator grows and shrinks, while the rest of the suite shares an
in-process cluster. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rayscale.autoscale_demo import app_args, local_stand_in_catalog
from rayscale.cluster.local import LocalCluster, LocalClusterConfig
from rayscale.core.catalog import Catalog
from rayscale.testing.waits import wait_for

NODE_IP = "127.0.0.2"
APP = "rayscale"
MODEL = "mistral-7b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((NODE_IP, 0))
        return int(s.getsockname()[1])


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
    ray.init(address=c.address, logging_level="ERROR", namespace="rayscale-e2e")
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
