"""Scale from zero on a real local cluster: a model at zero replicas keeps its endpoint up, the ingress holds a
burst (exported as held), the controller reads the held requests as demand and orders the first gang at
once, every request is served once the replica runs, and after the idle delay the model is back at zero.

The model is the emulated Mistral-7B renamed ``zero-7b`` on ``l4`` stand-in nodes, in its own Serve
application: the session's other app (mistral-7b on a10g) never shares its nodes or its signals.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rayscale.cluster.local import LocalCluster
from rayscale.cluster.local_actuator import LocalActuator, LocalActuatorConfig
from rayscale.config import load_catalog
from rayscale.controller.loop import Controller, ControllerConfig
from rayscale.controller.serve_client import ServeClient
from rayscale.core.act import ActSettings, GangPhase
from rayscale.core.catalog import CapacityType, Catalog, FlavorLimits, RequestMixSpec
from rayscale.core.estimate import EstimateSettings
from rayscale.core.plan import PlannerSettings
from rayscale.core.settings import Settings
from rayscale.serve.readiness import HELD_EXPORTED
from rayscale.serve.weights import set_flavor_weights
from rayscale.signals.scrape import MetricsScraper, ray_metrics_endpoints
from tests.e2e.conftest import wait_for

APP = "zero"
MODEL = "zero-7b"
FLAVOR = "l4"
DEP = (MODEL, FLAVOR)
BURST = 12
PERIOD_S = 2.0


def zero_catalog() -> Catalog:
    """The shipped mistral-7b/l4 entry as ``zero-7b`` with min_replicas 0 and local start-up times."""
    cat = load_catalog().subset(["mistral-7b"], [FLAVOR])
    fl = cat.flavors[FLAVOR].model_copy(update={
        "node_startup_s": 20.0, "zones": ["local"], "capacity_types": [CapacityType.ON_DEMAND],
        "limits": FlavorLimits(nodes=1), "spot_max_share": 0.0})
    m = cat.models["mistral-7b"].model_copy(update={
        "name": MODEL, "min_replicas": 0, "max_replicas": 1,
        "request_mix": RequestMixSpec(prompt_mean=20, output_mean=16, prompt_p95=40)})
    p = cat.profile("mistral-7b", FLAVOR).model_copy(update={"model": MODEL, "startup_s": 5.0})
    return cat.model_copy(update={"flavors": {FLAVOR: fl}, "models": {MODEL: m}, "profiles": {f"{MODEL}/{FLAVOR}": p}})


def _app_args(cat: Catalog) -> dict[str, Any]:
    from rayscale.engines.profile import EmulatedProfile

    prof = EmulatedProfile.from_profile(cat.profile(MODEL, FLAVOR))
    return {
        "app_name": APP,
        # The burst waits for a node and a replica (20-60 s on two busy cores): held up to 4 minutes.
        "ingress": {"hold_max_requests": 64, "hold_timeout_s": 240, "readiness_poll_s": 0.5},
        "models": [{
            "name": MODEL, "engine": "emulated", "max_model_len": 8192,
            "flavors": [{
                "flavor": FLAVOR, "accelerator": "gpu", "num_replicas": 0, "profile": prof.model_dump(),
                "placement_bundles": [{"resources": {"GPU": 1, "accelerator_type:L4": 1}}],
            }],
        }],
    }


@pytest.fixture(scope="module")
def zero_url(cluster: LocalCluster, serve_url: str) -> str:
    """The app with the model's flavor at 0 (deployed at one replica that waits for an l4 node: Serve deploys
    nothing at zero; the controller scales it to zero), its ingress up (the session's Serve and HTTP proxy)."""
    from ray import serve

    from rayscale.serve.app import build_app

    serve.run_many([serve.RunTarget(target=build_app(_app_args(zero_catalog())), name=APP, route_prefix=f"/{APP}",
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


def _chat(url: str, i: int, out: list[tuple[int, str]]) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 16}
    try:
        r = httpx.post(f"{url}/chat/completions", json=body, timeout=300)
        out.append((r.status_code, r.text[:200]))
    except httpx.HTTPError as e:
        out.append((-1, repr(e)))


def _first_order_s(ctl: Controller, since: float) -> float | None:
    """Seconds from ``since`` to the first decision that created a gang of the model."""
    for r in list(ctl.records):
        if r.t >= since and any(a["type"] == "CreateGang" and a.get("model") == MODEL for a in r.actions):
            return r.t - since
    return None


def test_burst_at_zero_is_held_served_and_the_model_returns_to_zero(ctl: Controller, zero_url: str) -> None:
    # At zero: no replica, no gang, not listed, and the controller orders nothing without requests.
    wait_for(lambda: _target(ctl) == 0, 60, "the controller to scale the model to zero")
    time.sleep(3 * PERIOD_S)
    assert _target(ctl) == 0 and not _gangs(ctl)
    assert MODEL not in _listed(zero_url)

    results: list[tuple[int, str]] = []
    start = time.time()
    threads = [threading.Thread(target=_chat, args=(zero_url, i, results), daemon=True) for i in range(BURST)]
    for t in threads:
        t.start()
    # Held at the ingress and exported as held, while the controller orders the first gang at once.
    wait_for(lambda: _held() >= BURST, 30, f"{BURST} requests held")
    waited = wait_for(lambda: _first_order_s(ctl, start), 30, "the first gang ordered")
    assert waited <= 5 * PERIOD_S, f"the first gang came {waited:.1f}s after the burst"
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "requests still open after 300 s"
    errors = [r for r in results if r[0] != 200]
    assert len(results) == BURST and not errors, errors  # none lost
    assert MODEL in _listed(zero_url)
    wait_for(lambda: _held() == 0, 10, "the held count back to 0")

    # Idle: after the scale-down delay the replica goes, then its gang; the model is at zero again.
    wait_for(lambda: _target(ctl) == 0 and not _gangs(ctl), 180, "the model back at zero (no replica, no gang)")
    wait_for(lambda: MODEL not in _listed(zero_url), 30, "the model unlisted at zero")
