"""Scale from zero on a real local cluster with the real vLLM engine: the tiny Qwen2 model at zero replicas
keeps its endpoint up, the ingress holds a burst (exported as held), the controller reads the held requests as
demand and orders the first gang at once, every request is served (200) once the replica runs, and after the
idle delay the model is back at zero.

The model, its catalog and its serve config are the shipped example deployments/local-zero (its own Serve
application here, under /zero): the session's other app (emulated mistral-7b on a10g) never shares its nodes
or its signals. It is the only vLLM engine this e2e session starts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from rayscale.cluster.local import LocalCluster
from rayscale.cluster.local_actuator import LocalActuator, LocalActuatorConfig
from rayscale.config import load_catalog
from rayscale.controller.loop import Controller, ControllerConfig
from rayscale.controller.serve_client import ServeClient
from rayscale.core.act import ActSettings, GangPhase
from rayscale.core.catalog import Catalog
from rayscale.core.estimate import EstimateSettings
from rayscale.core.plan import PlannerSettings
from rayscale.core.settings import Settings
from rayscale.serve.readiness import HELD_EXPORTED
from rayscale.serve.weights import set_flavor_weights
from rayscale.signals.scrape import MetricsScraper, ray_metrics_endpoints
from tests.e2e.conftest import wait_for

SHIPPED = Path(__file__).resolve().parents[2] / "deployments" / "local-zero"
APP = "zero"
MODEL = "tiny-qwen2"
FLAVOR = "cpu"
DEP = (MODEL, FLAVOR)
BURST = 12
PERIOD_S = 2.0
# A first replica needs a local node, vLLM's import and its CPU engine start: well inside the shipped hold
# (hold_timeout_s), which every client outwaits.
SERVED_WITHIN_S = 300.0


def zero_catalog() -> Catalog:
    """The shipped example's catalog: tiny-qwen2 at min_replicas 0 on at most one local cpu node."""
    return load_catalog(SHIPPED / "models.yaml", SHIPPED / "flavors.yaml", SHIPPED / "profiles.yaml")


def _app_args() -> dict[str, Any]:
    """The shipped serve config's application args, under this test's app name."""
    (app,) = yaml.safe_load((SHIPPED / "serve.yaml").read_text())["applications"]
    return {**app["args"], "app_name": APP}


@pytest.fixture(scope="module")
def zero_url(cluster: LocalCluster, serve_url: str) -> str:
    """The app with the model's flavor at 0 (deployed at one replica that waits for a cpu node: Serve deploys
    nothing at zero; the controller scales it to zero), its ingress up (the session's Serve and HTTP proxy)."""
    from ray import serve

    from rayscale.serve.app import build_app

    serve.run_many([serve.RunTarget(target=build_app(_app_args()), name=APP, route_prefix=f"/{APP}",
                                    external_scaler_enabled=True)],
                   wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    wait_for(lambda: serve.status().applications[APP].deployments["ingress"].status == "HEALTHY", 120,
             "the ingress to run")
    return f"{serve_url}/{APP}/v1"


@pytest.fixture(scope="module")
def ctl(cluster: LocalCluster, zero_url: str) -> Iterator[Controller]:
    assert cluster.dashboard_url
    act = LocalActuator(cluster, LocalActuatorConfig(default_launch_delay_s=1.0, max_worker_nodes=4,
                                                     drain_grace_s=10.0))
    c = Controller(zero_catalog(), act, ServeClient(cluster.dashboard_url), MetricsScraper(ray_metrics_endpoints),
                   ControllerConfig(Settings(period_s=PERIOD_S, window_s=10.0, fast_window_s=4.0, stale_after_s=8.0,
                                             forecaster="last", estimate=EstimateSettings(),
                                             act=ActSettings(backoff_s=30.0, launch_timeout_factor=6.0),
                                             # the idle delay before the model returns to zero
                                             planner=PlannerSettings(downscale_delay_s=8.0, min_dwell_s=4.0)),
                                    app_name=APP),
                   weights_sink=set_flavor_weights)
    c.start()
    yield c
    c.stop()
    act.close()


@dataclass(frozen=True)
class Reply:
    status: int  # -1: no HTTP answer
    text: str
    after_s: float  # from the burst's start


def _gangs(ctl: Controller) -> list[Any]:
    return [g for g in ctl.gangs() if g.model == MODEL and g.phase != GangPhase.FAILED]


def _target(ctl: Controller) -> int:
    snap = ctl.serve.snapshot()
    assert snap.ok, snap.error
    return snap.target.get(DEP, 0)


def _listed(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(f"{url}/models", timeout=30).json()["data"]}


def _held() -> float:
    from rayscale.serve.metrics import scrape_metrics

    return sum(v for _, labels, v in scrape_metrics(HELD_EXPORTED) if labels.get("model") == MODEL)


def _chat(url: str, i: int, start: float, out: list[Reply]) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 16}
    try:
        r = httpx.post(f"{url}/chat/completions", json=body, timeout=SERVED_WITHIN_S + 30)
        out.append(Reply(r.status_code, r.text[:200], time.time() - start))
    except httpx.HTTPError as e:
        out.append(Reply(-1, repr(e), time.time() - start))


def _first_order_s(ctl: Controller, since: float) -> float | None:
    """Seconds from ``since`` to the first decision that created a gang of the model (never 0: a found order
    must read as found)."""
    for r in list(ctl.records):
        if r.t >= since and any(a["type"] == "CreateGang" and a.get("model") == MODEL for a in r.actions):
            return max(r.t - since, 1e-3)
    return None


def test_shipped_example_is_at_zero_and_holds_long_enough() -> None:
    from rayscale.serve.config import parse_app_args

    cfg = parse_app_args(_app_args())
    (model,) = cfg.models
    (flavor,) = model.flavors
    assert (model.name, model.engine, flavor.flavor, flavor.num_replicas) == (MODEL, "vllm", FLAVOR, 0)
    assert zero_catalog().models[MODEL].min_replicas == 0
    assert cfg.ingress.hold_timeout_s >= SERVED_WITHIN_S and cfg.ingress.hold_max_requests >= BURST


def test_burst_at_zero_is_held_served_and_the_model_returns_to_zero(ctl: Controller, zero_url: str) -> None:
    # At zero: no replica, no gang, not listed, and the controller orders nothing without requests.
    wait_for(lambda: _target(ctl) == 0, 60, "the controller to scale the model to zero")
    time.sleep(3 * PERIOD_S)
    assert _target(ctl) == 0 and not _gangs(ctl)
    assert MODEL not in _listed(zero_url)

    results: list[Reply] = []
    start = time.time()
    threads = [threading.Thread(target=_chat, args=(zero_url, i, start, results), daemon=True) for i in range(BURST)]
    for t in threads:
        t.start()
    # Held at the ingress and exported as held, while the controller orders the first gang at once.
    wait_for(lambda: _held() >= BURST, 30, f"{BURST} requests held")
    waited = wait_for(lambda: _first_order_s(ctl, start), 30, "the first gang ordered")
    assert waited <= 5 * PERIOD_S, f"the first gang came {waited:.1f}s after the burst"
    for t in threads:
        t.join(timeout=max(1.0, start + SERVED_WITHIN_S + 60 - time.time()))
    assert not any(t.is_alive() for t in threads), f"requests still open after {SERVED_WITHIN_S + 60:g} s"
    errors = [r for r in results if r.status != 200]
    assert len(results) == BURST and not errors, errors  # none lost
    served = sorted(r.after_s for r in results)
    print(f"\nscale from zero ({MODEL}, vLLM CPU): first gang ordered {waited:.1f}s after the burst, "
          f"first 200 at {served[0]:.1f}s, all {BURST} at {served[-1]:.1f}s")
    assert MODEL in _listed(zero_url)
    wait_for(lambda: _held() == 0, 10, "the held count back to 0")

    # Idle: after the scale-down delay the replica goes, then its gang; the model is at zero again.
    wait_for(lambda: _target(ctl) == 0 and not _gangs(ctl), 180, "the model back at zero (no replica, no gang)")
    wait_for(lambda: MODEL not in _listed(zero_url), 30, "the model unlisted at zero")
