"""Ready means ready: a model no replica can serve is not listed, its requests are held (bounded) and then
served, or answered 503 with Retry-After; the held count is exported for the controller."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rayscale.serve.errors import ApiError
from rayscale.serve.readiness import HELD_EXPORTED, HoldSettings, ReadinessGate
from tests.conftest import emulated_profile, wait_for

APP = "readiness"
READY, ZERO = "ready-7b", "zero-7b"


# --- the gate, on its own event loop ----------------------------------------------------------------------
def _gate(**kw: Any) -> ReadinessGate:
    return ReadinessGate([READY, ZERO], HoldSettings(**{"max_requests": 2, "timeout_s": 5.0, "retry_after_s": 7.0,
                                                         "poll_s": 0.1, **kw}))


def test_held_requests_go_on_once_a_flavor_serves() -> None:
    async def run() -> tuple[list[int], dict[str, int], float]:
        gate = _gate()
        gate.update({READY: {"a10g"}})
        await gate.wait_ready(READY)  # ready: no wait
        t0 = time.monotonic()
        waiters = [asyncio.create_task(gate.wait_ready(ZERO)) for _ in range(2)]
        await asyncio.sleep(0.2)
        held = dict(gate.held)
        gate.update({READY: {"a10g"}, ZERO: {"l4"}})
        await asyncio.gather(*waiters)
        return [len(gate.ready[m]) for m in (READY, ZERO)], held, time.monotonic() - t0

    ready, held, waited = asyncio.run(run())
    assert held == {READY: 0, ZERO: 2}
    assert ready == [1, 1] and 0.2 <= waited < 2.0


def test_hold_full_or_too_long_is_503_with_retry_after() -> None:
    async def run() -> tuple[ApiError, ApiError, dict[str, int]]:
        gate = _gate(max_requests=1, timeout_s=0.3)
        first = asyncio.create_task(gate.wait_ready(ZERO))
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as full:  # one already held: the second is refused at once
            await gate.wait_ready(ZERO)
        with pytest.raises(ApiError) as late:
            await first
        return full.value, late.value, dict(gate.held)

    full, late, held = asyncio.run(run())
    for e in (full, late):
        assert e.status_code == 503 and e.retry_after_s == 7.0 and e.param == "model"
    assert "1 requests are already waiting" in full.message and "within 0.3s" in late.message
    assert held == {READY: 0, ZERO: 0}  # nothing stays counted as held after an answer


def test_routing_prefers_flavors_that_serve() -> None:
    gate = _gate()
    weights = {"a10g": 1.0, "l4": 0.0}
    assert gate.ready_weights(READY, weights) == weights  # none known to serve: the configured weights
    gate.update({READY: {"l4"}})
    assert gate.ready_weights(READY, weights) == {"l4": 0.0}  # the only flavor that serves, weight or not


# --- the ingress on real Serve ------------------------------------------------------------------------------
def _held(model: str) -> float | None:
    from rayscale.serve.metrics import scrape_metrics

    vals = [v for name, labels, v in scrape_metrics(HELD_EXPORTED) if labels.get("model") == model]
    return sum(vals) if vals else None


def _chat(base: str, model: str, out: list[Any]) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(f"{base}/chat/completions", json=body, timeout=120)
    out.append((r.status_code, r.headers.get("retry-after"), r.json()))


@pytest.fixture(scope="module")
def zero_app(ray_cluster: Any, serve_url: str) -> Iterator[str]:
    """One ingress, two emulated models: READY with a replica, ZERO scaled to zero through Serve's scale API
    as the controller scales (the ingress holds 2 requests for 60 s)."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    from rayscale.serve.app import build_from_config
    from rayscale.serve.config import parse_app_args

    def model(name: str, replicas: int) -> dict[str, Any]:
        return {"name": name, "engine": "emulated", "max_model_len": 1024, "flavors": [
            {"flavor": "a10g", "accelerator": "cpu", "num_replicas": replicas, "profile": emulated_profile("a10g")}]}

    cfg = parse_app_args({"app_name": APP, "models": [model(READY, 1), model(ZERO, 0)],
                          "ingress": {"hold_max_requests": 2, "hold_timeout_s": 60, "hold_retry_after_s": 3,
                                      "readiness_poll_s": 0.5}})
    # The replica count is set later through Serve's external scaler API, as the controller sets it.
    serve.run_many([serve.RunTarget(build_from_config(cfg, app_name=APP), name=APP, route_prefix=f"/{APP}",
                                    external_scaler_enabled=True)],
                   wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)

    def running() -> bool:
        st = serve.status().applications.get(APP)
        return st is not None and st.status == ApplicationStatus.RUNNING

    # Three replicas start Python workers at once; beside the other test worker on two cores that took over
    # two minutes once.
    wait_for(running, 300, "the readiness app to run")
    _scale(ray_cluster, 0)

    def at_zero() -> bool:
        states = serve.status().applications[APP].deployments[f"{ZERO}--a10g"].replica_states
        return not any(states.values())

    wait_for(at_zero, 60, f"{ZERO} at zero replicas")
    yield f"{serve_url}/{APP}/v1"
    serve.delete(APP)  # the session's other tests share this Serve


def _scale(ray_cluster: Any, replicas: int) -> None:
    """The controller's way: Serve's external scaler API."""
    from rayscale.controller.serve_client import ServeClient

    ServeClient("http://" + ray_cluster.head_node.address_info["webui_url"]).scale(APP, ZERO, "a10g", replicas)


@pytest.mark.ray
def test_not_ready_model_is_not_listed_held_then_served(ray_cluster: Any, zero_app: str) -> None:
    base = zero_app
    listed = {m["id"] for m in httpx.get(f"{base}/models", timeout=30).json()["data"]}
    assert listed == {READY}  # ZERO has no replica: not listed
    r = httpx.get(f"{base}/models/{ZERO}", timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "3", r.text
    assert r.json()["error"]["type"] == "ServiceUnavailableError"

    held: list[Any] = []
    threads = [threading.Thread(target=_chat, args=(base, ZERO, held)) for _ in range(2)]
    for t in threads:
        t.start()
    # Both held at the ingress, and exported as held for the controller.
    wait_for(lambda: (_held(ZERO) or 0) >= 2, 30, "2 requests held for the model at zero")
    # A third finds the hold full: 503, Retry-After and an OpenAI error body, without waiting.
    refused: list[Any] = []
    t0 = time.monotonic()
    _chat(base, ZERO, refused)
    status, retry_after, body = refused[0]
    assert status == 503 and retry_after == "3" and time.monotonic() - t0 < 10, refused
    assert body["error"]["code"] == 503 and body["error"]["type"] == "ServiceUnavailableError"
    assert body["error"]["param"] == "model" and "no replica ready" in body["error"]["message"]
    assert not held  # the held two are still waiting

    # A replica, as the controller orders one: the held requests are then served.
    _scale(ray_cluster, 1)
    for t in threads:
        t.join(timeout=120)
    assert [s for s, _, _ in held] == [200, 200], held
    listed = {m["id"] for m in httpx.get(f"{base}/models", timeout=30).json()["data"]}
    assert listed == {READY, ZERO}
    wait_for(lambda: _held(ZERO) == 0, 30, "the held count back to 0")


# --- the controller's side: held requests are demand --------------------------------------------------------
def test_held_requests_of_a_model_at_zero_are_demand() -> None:
    from rayscale.config import load_catalog
    from rayscale.core.estimate import DemandState, estimate
    from rayscale.core.signals import Freshness
    from rayscale.signals.window import HELD, Scrape, aggregate, labels

    # A model at zero: no engine series at all, only the ingress's held gauge (5 requests).
    held = {(HELD, labels(model="mistral-7b", replica="i1")): 5.0}
    scrapes = [Scrape(t, dict(held)) for t in (0.0, 2.0, 4.0)]
    sig = aggregate(scrapes, now=4.0, window_s=10.0, stale_after_s=8.0, models=["mistral-7b"])["mistral-7b"]
    assert sig.freshness == Freshness.MISSING and sig.in_flight == 5.0 and sig.backlog == 5.0
    demand = estimate(load_catalog().subset(["mistral-7b"], ["a10g"]), {"mistral-7b": sig})["mistral-7b"]
    assert demand.state == DemandState.OK and demand.rps > 0, demand.reason  # not a hold at zero
    # With nothing held the same model is a hold (no engine metrics is not zero load, nor load).
    idle = aggregate([Scrape(t, {k: 0.0 for k in held}) for t in (0.0, 2.0, 4.0)], now=4.0, window_s=10.0,
                     stale_after_s=8.0, models=["mistral-7b"])["mistral-7b"]
    assert estimate(load_catalog().subset(["mistral-7b"], ["a10g"]), {"mistral-7b": idle})["mistral-7b"].state \
        == DemandState.HOLD
