"""Session fixtures shared by the whole suite.

- ``ray_cluster``: one local Ray cluster (``ray.cluster_utils.Cluster``), head at 127.0.0.2 with CPU only,
  in its own temp dir, removed at session end. Tests that need cluster nodes call
  ``ray_cluster.add_node(num_cpus=..., resources={"accelerator_type:A10G": 1, ...})`` and remove them.
- ``serve_instance``: Ray Serve started once on that cluster, HTTP on a free port (``serve_url``).
- ``deploy_app`` / ``wait_for``: deploy a Serve application and wait for it, always with a timeout.
- ``tiny_vllm_app``: ONE real vLLM CPU deployment (tiny Qwen2) shared by every serving test.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from rayscale_testing.waits import wait_for  # also re-exported to tests

from rayscale.cluster.local import free_port  # also re-exported to tests

NODE_IP = "127.0.0.2"  # Ray rewrites 127.0.0.1 to the machine address; 127.0.0.2 stays loopback.


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``pytest -n 2 --dist loadgroup`` (the Makefile's): every test of the shared Ray cluster runs in
    one worker, so the session still starts one cluster and one vLLM engine, while whole files of the rest
    (simulations, planners, the Kubernetes emulator) run beside it in the other."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_xdist_group(item)))


def _xdist_group(item: pytest.Item) -> str:
    """The cluster a test shares, else its file. In the e2e session, the tests of the `ray start` cluster
    (tests/e2e/conftest.py's ``cluster``) share one worker; test_from_config starts its own beside them."""
    fixtures = getattr(item, "fixturenames", ())
    if "ray_cluster" in fixtures:
        return "ray"
    if item.path.parent.name == "e2e" and "cluster" in fixtures:
        return "e2e-cluster"
    return item.nodeid.split("::")[0]


@pytest.fixture(scope="session")
def rayscale_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Where the builtin tiny model is written; every Ray worker inherits it via the environment."""
    d = tmp_path_factory.mktemp("rayscale-cache")
    old = os.environ.get("RAYSCALE_CACHE_DIR")
    os.environ["RAYSCALE_CACHE_DIR"] = str(d)
    yield d
    if old is None:
        os.environ.pop("RAYSCALE_CACHE_DIR", None)
    else:
        os.environ["RAYSCALE_CACHE_DIR"] = old


def _one_worker_owns_the_cluster(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Under xdist, the first worker to start the shared cluster claims it; a second one fails loudly rather
    than start another cluster and vLLM engine beside it (the xdist_group of its tests was lost)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    claim = tmp_path_factory.getbasetemp().parent / "ray-cluster-worker"
    try:
        with open(claim, "x") as f:
            f.write(worker)
    except FileExistsError:
        raise RuntimeError(f"worker {worker} needs the shared Ray cluster, which {claim.read_text()} runs: "
                           "the tests' xdist_group 'ray' was not honoured (see pyproject's pytest pin)") from None


@pytest.fixture(scope="session")
def ray_cluster(rayscale_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A local Ray cluster: head only (CPU), own temp dir, fast metrics export; torn down at the end."""
    import ray
    from ray.cluster_utils import Cluster

    _one_worker_owns_the_cluster(tmp_path_factory)
    temp_dir = tempfile.mkdtemp(prefix="rs-ray-", dir="/tmp")
    # Ray's address file, vLLM's scratch files and sockets all land in this dir (inherited by workers),
    # so parallel sessions on one machine do not collide and cleanup is one rmtree.
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    saved_env = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "TMPDIR")}
    os.environ["RAY_TMPDIR"] = temp_dir
    os.environ["TMPDIR"] = temp_dir
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": int(os.environ.get("RAYSCALE_TEST_HEAD_CPUS", "4")),
                "num_gpus": 0,
                "node_ip_address": NODE_IP,
                "temp_dir": temp_dir,
                "gcs_server_port": free_port(),
                "include_dashboard": True,
                "dashboard_host": NODE_IP,
                "dashboard_port": free_port(),
                "metrics_export_port": free_port(),
                "object_store_memory": 200 * 2**20,
                # Engine metrics reach the Prometheus endpoint within ~1 s instead of ~10 s.
                "_system_config": {"metrics_report_interval_ms": 1000},
            },
        )
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    ray.init(address=cluster.address, _node_ip_address=NODE_IP, namespace="rayscale-tests")
    try:
        yield cluster
    finally:
        try:
            from ray import serve

            serve.shutdown()
        except Exception:
            pass
        ray.shutdown()
        cluster.shutdown()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(temp_dir, ignore_errors=True)


@dataclass
class ServeInstance:
    url: str
    port: int


@pytest.fixture(scope="session")
def serve_instance(ray_cluster: Any) -> ServeInstance:
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": NODE_IP, "port": port}, proxy_location="HeadOnly")
    return ServeInstance(url=f"http://{NODE_IP}:{port}", port=port)


@pytest.fixture(scope="session")
def serve_url(serve_instance: ServeInstance) -> str:
    return serve_instance.url


def _deploy(app: Any, name: str, route_prefix: str, timeout_s: float) -> Any:
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    # Serve's own waits are unbounded; ask it not to wait and poll with a deadline instead.
    serve.run_many(
        [serve.RunTarget(target=app, name=name, route_prefix=route_prefix)],
        wait_for_ingress_deployment_creation=False,
        wait_for_applications_running=False,
    )

    def ready() -> bool:
        st = serve.status().applications.get(name)
        if st is None:
            return False
        if st.status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"app {name} failed to deploy: {st.message} {st.deployments}")
        return bool(st.status == ApplicationStatus.RUNNING)

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return serve.get_app_handle(name)
        time.sleep(1.0)
    st = serve.status().applications.get(name)
    raise TimeoutError(f"app {name} not RUNNING after {timeout_s}s: {st}")


@pytest.fixture(scope="session")
def deploy_app(serve_instance: ServeInstance) -> Callable[..., Any]:
    """deploy_app(app, name, route_prefix="/name", timeout_s=...) -> app handle, once RUNNING."""

    def deploy(app: Any, name: str, route_prefix: str | None = None, timeout_s: float = 120.0) -> Any:
        return _deploy(app, name, route_prefix or f"/{name}", timeout_s)

    return deploy


TINY_APP = "tiny"
EMULATED_MODEL = "mistral-7b"


def emulated_profile(flavor: str, slowdown: float = 1.0) -> dict[str, Any]:
    """The published Mistral-7B/A10G profile (FACTS.md), optionally slower for a second flavor."""
    from rayscale.engines.profile import catalog_profile

    p = catalog_profile("mistral-7b", "a10g").model_dump()
    p.update(
        flavor=flavor,
        itl_alpha_s=p["itl_alpha_s"] * slowdown,
        prefill_tokens_per_s=p["prefill_tokens_per_s"] / slowdown,
    )
    return p


@pytest.fixture(scope="session")
def tiny_vllm_app(deploy_app: Callable[..., Any], serve_url: str) -> str:
    """The shared serving app; returns its OpenAI base URL.

    One ingress, two models: the real vLLM tiny Qwen2 on CPU ("tiny-qwen2--cpu"), and an emulated
    Mistral-7B on two flavors ("mistral-7b--a10g" weight 1, "mistral-7b--l4" weight 0).
    """
    from rayscale.serve.app import build_from_config
    from rayscale.serve.config import parse_app_args

    cfg = parse_app_args(
        {
            "app_name": TINY_APP,
            "models": [
                {
                    "name": "tiny-qwen2",
                    "engine": "vllm",
                    "source": "builtin:tiny-qwen2",
                    "max_model_len": 1024,
                    "flavors": [{"flavor": "cpu", "accelerator": "cpu", "num_replicas": 1}],
                },
                {
                    "name": EMULATED_MODEL,
                    "engine": "emulated",
                    # As the tiny model's: vLLM's per-request token histograms take their buckets from
                    # max_model_len, and Ray keeps one bucket list per metric name in a cluster.
                    "max_model_len": 1024,
                    "flavors": [
                        # Emulated replicas need no device here; the controller's tests place them on
                        # nodes with accelerator resources.
                        {
                            "flavor": "a10g",
                            "accelerator": "cpu",
                            "weight": 1.0,
                            "profile": emulated_profile("a10g"),
                        },
                        {
                            "flavor": "l4",
                            "accelerator": "cpu",
                            "weight": 0.0,
                            "profile": emulated_profile("l4", 1.3),
                        },
                    ],
                },
            ],
        }
    )
    # vLLM's CPU build imports slowly on two busy cores; start-up dominates this fixture.
    deploy_app(
        build_from_config(cfg, app_name=TINY_APP), TINY_APP, route_prefix=f"/{TINY_APP}", timeout_s=420
    )
    url = f"{serve_url}/{TINY_APP}/v1"

    # The ingress lists a model once it has seen a replica RUNNING (it reads Serve's status about once a second).
    def listed() -> bool:
        r = httpx.get(f"{url}/models", timeout=10)
        return r.status_code == 200 and len(r.json()["data"]) == 2

    wait_for(listed, 60, "both models listed by the ingress")
    return url
