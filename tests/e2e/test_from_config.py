"""The user's path, from shipped files only: `serve run deployments/local-emulated/serve.yaml` (a Ray Serve
LLM config with ``llm_configs``) on a local cluster, and `rayscale controller --catalog
deployments/local-emulated` scaling it. No Python of the test builds the app or the controller.

The cluster is its own (not the session's): `serve run` of a config deploys declaratively, which would
replace the session's imperatively deployed application.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from rayscale_testing.waits import wait_for

from rayscale.cluster.local import LocalCluster, LocalClusterConfig
from rayscale.config import load_catalog
from tests.e2e.conftest import NODE_IP, free_port
from tests.e2e.load import SteadyLoad, errors

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "deployments" / "local-emulated"
MODEL = "mistral-7b"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = Path(tempfile.mkdtemp(prefix="rs-cfg-", dir="/tmp"))
    cluster = LocalCluster(LocalClusterConfig(root_dir=root, head_num_cpus=2, dashboard_port=None,
                                              env={"RAY_metrics_report_interval_ms": "1000"})).start()
    d = tmp_path_factory.mktemp("cfg")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": cluster.address}
    config = yaml.safe_load((SHIPPED / "serve.yaml").read_text())
    port = free_port()
    config["http_options"] = {"host": NODE_IP, "port": port}  # the only change: a free port on this machine
    (d / "serve.yaml").write_text(yaml.safe_dump(config))
    ctl: subprocess.Popen[bytes] | None = None
    try:
        subprocess.run([str(Path(sys.executable).parent / "serve"), "run", "--non-blocking", str(d / "serve.yaml")],
                       cwd=ROOT, env=env, check=True, timeout=180, capture_output=True)
        out = open(d / "controller.out", "ab")  # noqa: SIM115  (the child writes it; read on failure)
        ctl = subprocess.Popen(
            [sys.executable, "-m", "rayscale.cli", "controller", "--actuator", "local", "--root", str(root),
             "--catalog", str(SHIPPED), "--settings", str(ROOT / "rayscale/data/settings-local.yaml"),
             "--app", "default", "--launch-delay", "2", "--launch-timeout-factor", "6", "--metrics-port", "-1",
             "--decision-log", str(d / "decisions.jsonl"), "--duration", "600"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        yield {"url": f"http://{NODE_IP}:{port}", "cluster": cluster, "dir": d, "ctl": ctl}
    finally:
        if ctl is not None and ctl.poll() is None:
            ctl.send_signal(signal.SIGTERM)
            try:
                ctl.wait(60)
            except subprocess.TimeoutExpired:
                ctl.kill()
        subprocess.run([str(Path(sys.executable).parent / "serve"), "shutdown", "-y",
                        "-a", cluster.dashboard_url or ""], env=env, timeout=120, capture_output=True)
        cluster.stop()


def _records(d: Path) -> list[dict[str, Any]]:
    p = d / "decisions.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def _why(w: dict[str, Any]) -> str:
    recs = _records(w["dir"])
    out = (w["dir"] / "controller.out").read_text(errors="replace")[-2000:]
    last = [(r.get("signals"), r.get("serve"), r.get("actions")) for r in recs[-5:]]
    return f"controller output:\n{out}\nlast records (signals, serve, actions): {last}"


def _wait(w: dict[str, Any], predicate: Any, timeout_s: float, what: str) -> Any:
    def alive() -> Any:
        if w["ctl"].poll() is not None:
            raise AssertionError(f"the controller exited with {w['ctl'].returncode}")
        return predicate()

    try:
        return wait_for(alive, timeout_s, what)
    except (TimeoutError, AssertionError) as e:
        raise AssertionError(f"{e}\n{_why(w)}") from None


def test_shipped_files_are_the_demo_stand_in() -> None:
    """The catalog the controller reads is the one `make demo` plans with (one truth, two spellings)."""
    from rayscale.autoscale_demo import local_stand_in_catalog
    from rayscale.engines.profile import EmulatedProfile
    from rayscale.serve.config import load_serve_config

    shipped = load_catalog(SHIPPED / "models.yaml", SHIPPED / "flavors.yaml", SHIPPED / "profiles.yaml")
    assert shipped == local_stand_in_catalog()
    # the emulated replicas run the latency model the controller plans with
    (app,) = load_serve_config(SHIPPED / "serve.yaml").apps.values()
    (flavor,) = app.models[0].flavors
    assert flavor.profile == EmulatedProfile.from_profile(shipped.profile(MODEL, "a10g"))


def test_llm_config_served_and_scaled_by_the_controller(world: dict[str, Any]) -> None:
    url, d = world["url"], world["dir"]

    last: list[str] = []

    def serves() -> bool:
        try:
            r = httpx.post(f"{url}/v1/completions", timeout=30,
                           json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
        except httpx.HTTPError as e:
            last[:] = [repr(e)]
            return False
        last[:] = [f"{r.status_code} {r.text[:300]}"]
        return r.status_code == 200

    # min_replicas 1: the controller orders the first a10g node, Serve places the replica there
    try:
        _wait(world, serves, 240, "the first replica to serve")
    except AssertionError as e:
        raise AssertionError(f"{e}\nlast answer: {last}\nServe: {_serve_state(world)}") from None
    # Metrics are Ray's: the replica's reach the node's exporter some seconds after it serves, and until the
    # controller reads them it holds (missing metrics are not zero load). Load before that would go unseen.
    _wait(world, lambda: _fresh(world["dir"]), 180, "the controller to read the replica's metrics")
    # ~3 req/s where one replica serves ~1: the controller adds nodes and replicas. The load lasts until a
    # second replica runs, however long a node and a replica take to start on two busy cores.
    steady = SteadyLoad(url, 3.0, seed=5, max_s=330.0)
    try:
        _wait(world, lambda: _running(world) >= 2, 300, "a second replica running")
    finally:
        requests, failed, table = errors(steady.stop())
    assert failed == 0 and requests > 10, table
    ups = [a for r in _records(d) for a in r.get("actions", []) if a.get("type") == "CreateGang"]
    assert len(ups) >= 2, _why(world)
    nodes = [n for n in world["cluster"].nodes() if not n.is_head]
    assert len(nodes) >= 2 and all(n.flavor == "a10g" for n in nodes)


def _fresh(d: Path) -> bool:
    recs = _records(d)
    return bool(recs) and recs[-1].get("signals", {}).get(MODEL, {}).get("freshness") == "fresh"


def _running(w: dict[str, Any]) -> int:
    """RUNNING replicas of the flavor deployment, from Serve's REST API (what `serve status` shows)."""
    url = w["cluster"].dashboard_url
    apps = httpx.get(f"{url}/api/serve/applications/", timeout=10).json()["applications"]
    dep = apps.get("default", {}).get("deployments", {}).get(f"{MODEL}--a10g", {})
    return sum(1 for r in dep.get("replicas", []) if r.get("state") == "RUNNING")


def _serve_state(w: dict[str, Any]) -> str:
    try:
        apps = httpx.get(f"{w['cluster'].dashboard_url}/api/serve/applications/", timeout=10).json()["applications"]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        return repr(e)
    return json.dumps({a: {"status": v.get("status"), "message": (v.get("message") or "")[-500:],
                           "deployments": {d: (x.get("status"), x.get("message", "")[-300:],
                                               [r.get("state") for r in x.get("replicas", [])])
                                           for d, x in v.get("deployments", {}).items()}}
                       for a, v in apps.items()})
