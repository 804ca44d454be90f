"""OpenAI error bodies the way vLLM's own server writes them, for everything the ingress answers.

vLLM 0.32 (``vllm/entrypoints/serve/exception_handling``) answers ``{"error": {"message", "type", "param",
"code"}}`` with ``code`` the HTTP status and ``type`` the class the OpenAI client raises for it
("BadRequestError", "NotFoundError", "ServiceUnavailableError", "InternalServerError"). Ray Serve LLM's
ingress middleware writes its own exception class as ``type``, its internal class path in ``message``, the
rejected request itself as ``param`` and a traceback per client error; the ingress app is built here
without it.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Serve writes the "ray.serve" logger (and its children) into the replica's log file.
logger = logging.getLogger("ray.serve.rayscale")

MAX_MESSAGE_CHARS = 500
_MAX_PARAM_CHARS = 100
_MAX_REPORTED = 3
# Retry-After for a replica that went away or a full queue: a new replica or a free slot is seconds away.
DEFAULT_RETRY_AFTER_S = 1.0


class ApiError(Exception):
    """An error to answer the client with; ``status_code`` picks ``type`` (see ``error_type``)."""

    def __init__(
        self, status_code: int, message: str, param: str | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[type[ApiError], tuple[int, str, str | None, float | None]]:
        # Ray pickles an exception raised in a replica to hand it to the caller; the default rebuilds it
        # from its args (the message alone) and fails.
        return (type(self), (self.status_code, self.message, self.param, self.retry_after_s))


@dataclass(frozen=True)
class ErrorInfo:
    status: int
    message: str
    type: str
    param: str | None = None
    retry_after_s: float | None = None
    unexpected: bool = False  # a server fault, not a rejection: logged with its traceback

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


def error_type(status: int) -> str:
    """The OpenAI client's class name for a status, as vLLM names it: 400 -> "BadRequestError"."""
    try:
        name = "".join(HTTPStatus(status).phrase.title().split())
    except ValueError:
        return "APIError"
    return name if name.endswith("Error") else f"{name}Error"


_INTERNAL_PATH = re.compile(r"\b(?:ray|vllm|starlette|fastapi|pydantic)(?:\.\w+){2,}")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")
_TRACE_LINE = re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?')
_FILE_PATH = re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv|work)(?:/[\w.\-]+)+")


def sanitize(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """No internal module paths, addresses, stack frames or file paths, and at most ``limit`` chars."""
    message = _TRACE_LINE.sub("", message)
    message = _INTERNAL_PATH.sub("<internal>", message)
    message = _ADDRESS.sub(">", message)
    message = _FILE_PATH.sub("<path>", message).strip()
    if len(message) > limit:
        message = message[: limit - 15].rstrip() + "...[truncated]"
    return message


# Pydantic's wrapper and union-branch names in an error location; vLLM drops them from ``param`` too.
_LOC_MARKERS = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python", "lax-or-strict",
    "chain", "default", "nullable", "tagged-union", "union", "typed-dict", "call", "arguments", "is-instance",
    "list", "dict", "str", "int",
})  # fmt: skip


def _loc(loc: Any) -> str:
    parts = [
        str(p) for p in (loc or ()) if not re.search(r"[\[\]{}()]", str(p)) and str(p) not in _LOC_MARKERS
    ]
    return ".".join(parts)[:_MAX_PARAM_CHARS]


def _validation_error(e: RequestValidationError) -> ApiError:
    """FastAPI's request validation as one short message; the rejected input is never repeated."""
    errors = list(e.errors())
    if not errors:
        return ApiError(400, "Invalid request")
    first = errors[0]
    ctx = first.get("ctx") or {}
    if first.get("type") == "json_invalid":
        return ApiError(400, f"Invalid JSON in the request body: {ctx.get('error', 'decode error')}")
    # vLLM's own validators name the offending parameter themselves.
    param = getattr(ctx.get("error"), "parameter", None) or _loc(first.get("loc")) or None
    parts = [
        f"{_loc(err.get('loc')) or 'body'}: {str(err.get('msg', ''))[:200]}" for err in errors[:_MAX_REPORTED]
    ]
    more = f"; and {len(errors) - _MAX_REPORTED} more" if len(errors) > _MAX_REPORTED else ""
    label = "error" if len(errors) == 1 else "errors"
    return ApiError(400, f"{len(errors)} validation {label}: " + "; ".join(parts) + more, param=param)


def _known(e: BaseException) -> ApiError | None:
    """The client-facing error for exceptions with a meaning; None for a server fault."""
    from ray.exceptions import RayActorError

    # No public API: ray.serve.llm.openai_api_models does not export the exception Ray LLM raises.
    from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestValidationError):
        return _validation_error(e)
    if isinstance(e, OpenAIHTTPException):
        return ApiError(e.status_code, e.message)
    if isinstance(e, StarletteHTTPException):
        return ApiError(e.status_code, str(e.detail))
    if isinstance(e, BackPressureError):
        return ApiError(
            e.status_code,
            "The server is overloaded: too many requests are queued for this model. Retry later.",
            retry_after_s=e.retry_after_s or DEFAULT_RETRY_AFTER_S,
        )
    if isinstance(e, DeploymentUnavailableError | ReplicaUnavailableError | RayActorError):
        return ApiError(
            503, "No replica of this model is available right now. Retry later.",
            retry_after_s=DEFAULT_RETRY_AFTER_S,
        )  # fmt: skip
    return None


def classify(e: BaseException) -> ErrorInfo:
    known = _known(e)
    if known is None:
        return ErrorInfo(500, "Internal Server Error", error_type(500), unexpected=True)
    param = sanitize(known.param, _MAX_PARAM_CHARS) if known.param else None
    return ErrorInfo(
        known.status_code, sanitize(known.message) or HTTPStatus(known.status_code).phrase,
        error_type(known.status_code), param, known.retry_after_s,
    )  # fmt: skip


def openai_error_body(e: BaseException) -> dict[str, Any]:
    return classify(e).body()


def error_response(e: BaseException, request_id: str = "") -> Response:
    """The response for ``e``; a client error logs one line, a server fault its traceback."""
    info = classify(e)
    if info.unexpected:
        logger.error("request %s failed: %d %s", request_id, info.status, info.type, exc_info=e)
    else:
        log = logger.info if info.status < 500 else logger.warning
        log("request %s: %d %s: %s", request_id, info.status, info.type, info.message[:200])
    return JSONResponse(info.body(), status_code=info.status, headers=info.headers())


def _request_id(scope: Scope) -> str:
    return str((scope.get("state") or {}).get("request_id", ""))


class CatchErrors:
    """Answers any exception a route raises with an OpenAI error body (Starlette would send a bare 500)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            if started:  # the status line is out: nothing left to answer with
                raise
            await error_response(e, _request_id(scope))(scope, receive, send)


async def _handle(request: Request, exc: Exception) -> Response:
    return error_response(exc, _request_id(request.scope))


def make_app() -> FastAPI:
    """Ray Serve LLM's ingress app (``ingress.init``), with the error handling above in place of its own."""
    from fastapi.middleware.cors import CORSMiddleware

    # No public API: ray.serve.llm.ingress exports the ingress class but not the middleware and metrics
    # lifespan its own app (ingress.init) installs.
    from ray.llm._internal.serve.core.ingress.middleware import SetRequestIdMiddleware
    from ray.llm._internal.serve.observability.metrics.fast_api_metrics import (
        add_http_metrics_middleware,
        metrics_lifespan,
    )

    app = FastAPI(lifespan=metrics_lifespan)
    # FastAPI's defaults answer these two with {"detail": ...}; they run before any middleware sees them.
    app.add_exception_handler(RequestValidationError, _handle)
    app.add_exception_handler(StarletteHTTPException, _handle)
    # Middleware added later wraps what came before: the request id is set before errors are caught.
    app.add_middleware(CatchErrors)
    app.add_middleware(
        CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"], allow_headers=["*"]
    )
    add_http_metrics_middleware(app)
    app.add_middleware(SetRequestIdMiddleware)
    return app
