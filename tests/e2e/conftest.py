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
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rayscale.cluster.local import LocalCluster, LocalClusterConfig
from rayscale.config import load_catalog
from rayscale.core.catalog import CapacityType, Catalog, FlavorLimits

NODE_IP = "127.0.0.2"
APP = "rayscale"
MODEL = "mistral-7b"


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:
            last = e
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}" + (f": {last!r}" if last else ""))


def free_port() -> int:
    with socket.socket() as s:
        s.bind((NODE_IP, 0))
        return int(s.getsockname()[1])


def local_catalog() -> Catalog:
    """The shipped Mistral-7B/A10G entry, with start-up times of local nodes (seconds, not minutes)."""
    cat = load_catalog().subset([MODEL], ["a10g"])
    fl = cat.flavors["a10g"].model_copy(update={
        "node_startup_s": 5.0, "zones": ["local"], "capacity_types": [CapacityType.ON_DEMAND],
        "limits": FlavorLimits(nodes=3), "spot_max_share": 0.0})
    m = cat.models[MODEL].model_copy(update={"min_replicas": 1, "max_replicas": 3})
    # A slow stand-in (one replica serves ~1 req/s of short requests) so that a load step this machine
    # can generate needs several replicas; the emulated engine runs the same profile.
    p = cat.profile(MODEL, "a10g").model_copy(update={
        "startup_s": 5.0, "itl_alpha_s": 0.05, "itl_beta_s": 0.01, "source": "estimate: e2e stand-in"})
    return cat.model_copy(update={"flavors": {"a10g": fl}, "models": {MODEL: m}, "profiles": {f"{MODEL}/a10g": p}})


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

    from rayscale.engines.profile import EmulatedProfile
    from rayscale.serve.app import build_from_config
    from rayscale.serve.config import parse_app_args

    port = free_port()
    serve.start(http_options={"host": NODE_IP, "port": port}, proxy_location="HeadOnly")
    prof = EmulatedProfile.from_profile(local_catalog().profile(MODEL, "a10g"))
    cfg = parse_app_args({
        "app_name": APP,
        "models": [{
            "name": MODEL, "engine": "emulated", "max_model_len": 8192,
            "flavors": [{
                "flavor": "a10g", "accelerator": "gpu", "num_replicas": 1, "profile": prof.model_dump(),
                # one replica per a10g node: the node's GPU and its flavor resource
                "placement_bundles": [{"resources": {"GPU": 1, "accelerator_type:A10G": 1}}],
            }],
        }],
    })
    # Serve's own wait is unbounded: start without waiting, then poll with a deadline.
    serve.run_many([serve.RunTarget(target=build_from_config(cfg, app_name=APP), name=APP, route_prefix="/",
                                    external_scaler_enabled=True)],
                   wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    url = f"http://{NODE_IP}:{port}"
    # The flavor replica stays pending until the controller brings an a10g gang; the ingress must be up.
    wait_for(lambda: serve.status().applications[APP].deployments["ingress"].status == "HEALTHY", 120,
             "the ingress to run")
    return url
