"""The one OpenAI-compatible ingress: routes by model name, then spreads over flavors by weight.

Extends Ray Serve LLM's ``OpenAiIngress`` (request models, SSE framing) instead of rewriting it: handle
selection, response handling for the emulated engine's plain-JSON responses and errors differ. Errors
are vLLM's (rayscale.serve.errors): typed, short, without internals or the request echoed. It counts the
load as clients bring it (rayscale.serve.metrics.IngressMetrics): requests in flight and waiting for a first
byte, wherever they wait on the way (Serve's routers, a replica's queue, the engine), and TTFT from arrival
at the ingress to the first byte. Ready means ready (rayscale.serve.readiness): a model is listed and routed
only while a replica of it can serve; until then its requests are held (bounded) and counted as held.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import random
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

from fastapi import HTTPException, Request
from ray.serve.handle import DeploymentHandle
from starlette.responses import JSONResponse, Response, StreamingResponse

from rayscale.extras import missing_vllm
from rayscale.serve.errors import ApiError, make_app, openai_error_body
from rayscale.serve.metrics import IngressMetrics
from rayscale.serve.readiness import HeldMetric, HoldSettings, ReadinessGate, poll_readiness
from rayscale.serve.weights import get_store, pick_route, validate_weights

# Ray Serve LLM's ingress and OpenAI models import vLLM; the controller's image (no vLLM) never loads this.
# OpenAiIngress and make_fastapi_ingress come from the public ray.serve.llm.ingress. No public API for the
# rest: ray.serve.llm.openai_api_models exports public subclasses of the request and error models, but
# FastAPI and the engines build the private classes, which isinstance must match; ModelCard/ModelList, the
# endpoint map, the router timeout, the stream helpers and replace_prefix are not exported at all.
try:
    from ray.llm._internal.serve.constants import DEFAULT_LLM_ROUTER_HTTP_TIMEOUT
    from ray.llm._internal.serve.core.configs.openai_api_models import (
        ChatCompletionRequest,
        CompletionRequest,
        ErrorResponse,
        ModelCard,
        ModelList,
    )
    from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, router_request_timeout
    from ray.llm._internal.serve.core.ingress.utils import (
        NON_STREAMING_RESPONSE_TYPES,
        _openai_json_wrapper,
        _peek_at_generator,
    )
    from ray.llm._internal.serve.utils.server_utils import replace_prefix
    from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress
except ImportError as e:
    raise missing_vllm("the OpenAI ingress") from e

# How often the ingress writes its in-flight and waiting counts to Ray's gauges (the controller's period is
# seconds; Ray exports every metrics_report_interval_ms).
INGRESS_REPORT_INTERVAL_S = 0.5


def _engine_error(head: Any) -> ApiError | None:
    """The error an engine answered with instead of a response (vLLM's ErrorResponse or a JSON body)."""
    if isinstance(head, ErrorResponse):
        return ApiError(int(head.error.code), head.error.message, head.error.param)
    if isinstance(head, dict) and isinstance(head.get("error"), dict):
        err = head["error"]
        return ApiError(int(err.get("code") or 400), str(err.get("message", "")), err.get("param"))
    return None


class _Tracked:
    """One request in the ingress's counts (IngressMetrics): arrived, answered, finished, each counted once
    however the request ends (error, timeout, client gone); and in flight on the routing key it took."""

    def __init__(self, metrics: IngressMetrics, model: str) -> None:
        self.metrics, self.model, self.t0 = metrics, model, time.monotonic()
        self.answered = self.finished = False
        self._on: tuple[dict[str, int], str] | None = None
        metrics.arrive(model)

    def route(self, in_flight: dict[str, int], key: str) -> None:
        """Counts the request in ``in_flight[key]`` until it finishes (in place of an earlier key)."""
        self._leave()
        in_flight[key] = in_flight.get(key, 0) + 1
        self._on = (in_flight, key)

    def _leave(self) -> None:
        if self._on is not None:
            in_flight, key = self._on
            in_flight[key] -= 1
            self._on = None

    def answer(self, ok: bool) -> None:
        if not self.answered:
            self.answered = True
            self.metrics.first_byte(self.model, time.monotonic() - self.t0 if ok else None)

    def finish(self) -> None:
        self.answer(False)
        if not self.finished:
            self.finished = True
            self.metrics.finish(self.model)
            self._leave()


def _counted(stream: AsyncIterator[Any], req: _Tracked) -> AsyncIterator[Any]:
    """``stream``, finishing ``req`` when it ends, fails or is dropped unread (a client gone before the
    body started: the generator never runs, so its ``finally`` would not either)."""

    async def gen() -> AsyncIterator[Any]:
        try:
            async for item in stream:
                yield item
        finally:
            req.finish()

    out = gen()
    weakref.finalize(out, req.finish)
    return out


def is_length_rejection(e: ApiError) -> bool:
    """vLLM's 400s for a prompt or max_tokens over max_model_len (its messages name one or the other)."""
    return e.status_code == 400 and ("maximum context length" in e.message or "max_model_len" in e.message)


# The request being routed: the parent's _get_response picks its handle inside the request's own task.
_CURRENT: contextvars.ContextVar[_Tracked | None] = contextvars.ContextVar("rayscale_ingress_request", default=None)


class RayscaleIngress(OpenAiIngress):
    def __init__(
        self,
        flavor_deployments: dict[str, dict[str, DeploymentHandle]],
        model_cards: dict[str, ModelCard],
        weights: dict[str, dict[str, float]],
        max_model_len: dict[str, int],
        app_name: str = "default",
        weights_refresh_s: float = 1.0,
        hold: HoldSettings | None = None,
    ) -> None:
        # The parent keeps one handle per model for its own bookkeeping; routing goes through ours.
        super().__init__({m: next(iter(h.values())) for m, h in flavor_deployments.items()}, model_cards)
        self._flavors = flavor_deployments
        self._config_weights = {m: dict(w) for m, w in weights.items()}
        self._weights = {m: dict(w) for m, w in weights.items()}
        self._max_model_len = max_model_len
        self._streaming: dict[tuple[str, str], DeploymentHandle] = {}
        self._rng = random.Random()
        self._app_name = app_name
        self._refresh_s = weights_refresh_s
        self._version = -1
        self._refresher: asyncio.Task[None] | None = None
        self.routed: dict[str, dict[str, int]] = {
            m: dict.fromkeys(f, 0) for m, f in flavor_deployments.items()
        }
        self._in_flight: dict[str, dict[str, int]] = {m: dict.fromkeys(f, 0) for m, f in flavor_deployments.items()}
        self._metrics = IngressMetrics(list(flavor_deployments))
        self._metrics.report()
        self._reporter: asyncio.Task[None] | None = None
        self._gate = ReadinessGate(list(flavor_deployments), hold or HoldSettings())
        self._held = HeldMetric(self._metrics.replica)
        self._held.report(self._gate.held)
        self._readiness: asyncio.Task[None] | None = None

    # --- load metrics ------------------------------------------------------------------------------
    async def _report_loop(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a failed export must not end the reporting
                self._metrics.report()
                self._held.report(self._gate.held)
            await asyncio.sleep(INGRESS_REPORT_INTERVAL_S)

    def _ensure_reporter(self) -> None:
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    async def check_health(self) -> None:
        # Serve calls this every few seconds: the reporter and the readiness poll start before the first
        # request.
        self._ensure_reporter()
        self._ensure_readiness()

    # --- readiness (rayscale.serve.readiness) ------------------------------------------------------
    def _ensure_readiness(self) -> None:
        if self._readiness is None or self._readiness.done():
            names = {m: {f: h.deployment_name for f, h in fl.items()} for m, fl in self._flavors.items()}
            app = next(iter(next(iter(self._flavors.values())).values())).app_name
            self._readiness = asyncio.get_running_loop().create_task(poll_readiness(self._gate, app, names))

    async def _await_readiness(self) -> None:
        """Serve's replica states read at least once (bounded): a fresh ingress lists nothing before."""
        self._ensure_readiness()
        await self._gate.wait_known(5 * self._gate.settings.poll_s)

    async def models(self) -> ModelList:
        """Only models that a replica can serve now (a model starting or at zero is not listed)."""
        await self._await_readiness()
        listed = await super().models()
        return ModelList(data=[card for card in listed.data if self._gate.is_ready(card.id)])

    # --- weights ---------------------------------------------------------------------------------
    async def _refresh_loop(self) -> None:
        store = get_store(self._app_name)
        while True:
            with contextlib.suppress(Exception):  # store restarting: keep the last weights
                version, weights = await store.get.remote(self._version)
                if weights is not None:
                    self._apply(weights)
                self._version = version
            await asyncio.sleep(self._refresh_s)

    def _apply(self, weights: dict[str, dict[str, float]]) -> None:
        for model, w in weights.items():
            if model not in self._flavors:
                continue
            known = list(self._flavors[model])
            try:
                w = validate_weights({f: x for f, x in w.items() if f in known}, known)
            except ValueError:
                continue
            # Flavors the store does not mention keep their configured weight.
            self._weights[model] = {f: w.get(f, self._config_weights[model].get(f, 0.0)) for f in known}

    def _ensure_refresher(self) -> None:
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def get_weights(self) -> dict[str, dict[str, float]]:
        self._ensure_refresher()
        return {m: dict(w) for m, w in self._weights.items()}

    async def get_routed(self) -> dict[str, dict[str, int]]:
        return {m: dict(c) for m, c in self.routed.items()}

    # --- routing -----------------------------------------------------------------------------------
    async def _get_model_id(self, model: str | None) -> str:
        try:
            return str(await super()._get_model_id(model))
        except HTTPException as e:
            # vLLM's words for an unknown model (the parent's speak of Ray's internal base-model lookup).
            message = f"The model `{model}` does not exist." if e.status_code == 404 else str(e.detail)
            raise ApiError(e.status_code, message, param="model") from None

    async def model_data(self, model: str) -> ModelCard:
        card = await self.model(replace_prefix(model))
        if card is None:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model")
        await self._await_readiness()
        if not self._gate.is_ready(card.id):
            raise self._gate.not_ready(card.id, "it is starting or scaled to zero")
        return card

    def _get_configured_serve_handle(self, model_id: str) -> DeploymentHandle:
        self._ensure_refresher()
        if model_id not in self._flavors:
            raise ApiError(404, f"The model `{model_id}` does not exist.", param="model")
        flavor = pick_route(self._gate.ready_weights(model_id, self._weights[model_id]), self._in_flight[model_id],
                            self._rng)
        self.routed[model_id][flavor] += 1
        if (req := _CURRENT.get()) is not None:
            req.route(self._in_flight[model_id], flavor)
        key = (model_id, flavor)
        if key not in self._streaming:
            self._streaming[key] = self._flavors[model_id][flavor].options(stream=True)
        return self._streaming[key]

    @staticmethod
    def _check_request(body: Any) -> None:
        """Rejections vLLM would not make itself. Lengths are the engines' to check (both do, as vLLM)."""
        if isinstance(body, ChatCompletionRequest) and not body.messages:
            raise ApiError(400, "'messages' must contain at least one message", param="messages")

    async def _process_llm_request(
        self, body: Any, call_method: str, raw_request: Request | None = None
    ) -> Response:
        model_id = await self._get_model_id(body.model)  # 404 for unknown models before anything else
        self._check_request(body)
        self._ensure_reporter()
        req = _Tracked(self._metrics, model_id)
        token = _CURRENT.set(req)
        streaming = False
        try:
            # Held (in flight, waiting: the controller's demand) until a replica can serve, or 503.
            self._ensure_readiness()
            await self._gate.wait_ready(model_id)
            async with router_request_timeout(DEFAULT_LLM_ROUTER_HTTP_TIMEOUT):
                gen = self._get_response(body=body, call_method=call_method, raw_request=raw_request)
                first, gen = await _peek_at_generator(gen)
                head = first[0] if isinstance(first, list) and first else first
                error = _engine_error(head)
                req.answer(error is None)
                if error is not None:
                    if is_length_rejection(error):
                        self._metrics.reject(model_id)
                    raise error
                if isinstance(head, NON_STREAMING_RESPONSE_TYPES):
                    return JSONResponse(content=head.model_dump())
                if isinstance(head, dict):
                    return JSONResponse(content=head)
                stream: Any = gen  # chunks are lists of SSE strings from either engine
                body_stream = _counted(_openai_json_wrapper(stream), req)
                streaming = True
                return StreamingResponse(body_stream, media_type="text/event-stream")
        finally:
            _CURRENT.reset(token)
            if not streaming:
                req.finish()


def make_ingress_class() -> Any:
    """The FastAPI-wrapped ingress class, with the standard OpenAI routes plus weight inspection."""
    app = make_app()
    endpoints = {k: DEFAULT_ENDPOINTS[k] for k in ("models", "model_data", "completions", "chat")}
    endpoints["get_weights"] = lambda a: a.get("/rayscale/weights")
    endpoints["get_routed"] = lambda a: a.get("/rayscale/routed")
    return make_fastapi_ingress(RayscaleIngress, endpoint_map=endpoints, app=app)


__all__ = ["ApiError", "CompletionRequest", "RayscaleIngress", "make_ingress_class", "openai_error_body"]
