"""Errors as vLLM's server gives them: typed, short, no internals, no echo; length limits as vLLM's.

The first tests drive the error handling in-process (a FastAPI app with rayscale's handlers); the rest
send hostile requests to the shared serving app (real vLLM tiny model and the emulated Mistral-7B, both
with max_model_len 1024) and compare the two engines' answers.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from pydantic import BaseModel
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rayscale.engines.emulated import ContextLengthExceeded, fit_max_tokens
from rayscale.serve import errors
from rayscale.serve.errors import ApiError, CatchErrors, classify, error_response, error_type
from rayscale.serve.metrics import REJECTED_REQUESTS_EXPORTED, scrape_metrics
from tests.conftest import EMULATED_MODEL, wait_for

VLLM_MODEL = "tiny-qwen2"
MAX_MODEL_LEN = 1024  # both models in the shared app
INTERNALS = ("ray.llm._internal", "Internal exception", "OpenAIHTTPException", "Traceback")
BIG = "lorem ipsum dolor " * 6000  # ~100 KB


def assert_clean(r: Any, status: int, type_: str) -> dict:
    """An OpenAI error body as vLLM writes it, small, with nothing internal and nothing echoed.

    ``r``: an httpx response (Starlette's TestClient answers with its own httpx build's class)."""
    assert r.status_code == status, r.text[:500]
    assert len(r.content) < 2000, f"{len(r.content)} byte error body"
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["type"] == type_ and err["code"] == status and err["message"], err
    assert len(err["message"]) <= errors.MAX_MESSAGE_CHARS
    for word in INTERNALS:
        assert word not in r.text, f"{word!r} in {r.text[:300]}"
    assert "lorem ipsum dolor lorem" not in r.text, "request echoed"
    return dict(err)


# --- vLLM's length rules, as the emulated engine applies them ------------------------------------------


def test_fit_max_tokens_follows_vllm() -> None:
    # A prompt that fits leaves the rest of the context to the output, capped by max_tokens.
    assert fit_max_tokens(1024, 1000, 100) == 24
    assert fit_max_tokens(1024, 1000, None) == 24
    assert fit_max_tokens(1024, 10, 100) == 100
    with pytest.raises(ContextLengthExceeded) as e:
        fit_max_tokens(1024, 2000, 10)
    assert e.value.param == "input_tokens" and e.value.value == 2000
    assert str(e.value).startswith("This model's maximum context length is 1024 tokens. However, your prompt")
    with pytest.raises(ContextLengthExceeded) as e:
        fit_max_tokens(1024, 10, 5000, "max_completion_tokens")
    assert str(e.value) == (
        "max_completion_tokens=5000 cannot be greater than max_model_len=1024. Please request fewer output "
        "tokens. (parameter=max_completion_tokens, value=5000)"
    )
    with pytest.raises(ContextLengthExceeded, match="at least 1, got 0"):
        fit_max_tokens(1024, 1024, None)


# --- the handlers, in-process ------------------------------------------------------------------------


class Body(BaseModel):
    model: str
    prompt: str
    max_tokens: int = 16


def _app() -> FastAPI:
    app = FastAPI()
    app.add_exception_handler(RequestValidationError, errors._handle)
    app.add_exception_handler(StarletteHTTPException, errors._handle)
    app.add_middleware(CatchErrors)

    @app.post("/v1/completions")
    async def completions(body: Body) -> dict:
        if body.prompt == "crash":
            raise RuntimeError("ray.llm._internal.serve.core.thing.Broken at 0x7f00> in /work/main/x.py")
        if body.prompt == "busy":
            raise BackPressureError(num_queued_requests=9, max_queued_requests=8)
        raise ApiError(404, f"The model `{body.model}` does not exist.", param="model")

    return app


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def logged() -> Iterator[Records]:
    # Serve's logger does not propagate to the root logger once Serve configured it: listen on it directly.
    handler = Records()
    errors.logger.addHandler(handler)
    old = errors.logger.level
    errors.logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        errors.logger.removeHandler(handler)
        errors.logger.setLevel(old)


def test_client_errors_are_typed_short_and_log_one_line(logged: Records) -> None:
    c = TestClient(_app(), raise_server_exceptions=False)
    err = assert_clean(
        c.post("/v1/completions", json={"model": "nope", "prompt": "hi"}), 404, "NotFoundError"
    )
    assert err == {
        "message": "The model `nope` does not exist.", "type": "NotFoundError", "param": "model", "code": 404,
    }  # fmt: skip
    err = assert_clean(
        c.post("/v1/completions", content=b'{"model": "m", "prompt": ', headers={"content-type": "application/json"}),
        400, "BadRequestError",
    )  # fmt: skip
    assert err["message"].startswith("Invalid JSON")
    err = assert_clean(c.post("/v1/completions", json={"model": "m"}), 400, "BadRequestError")
    assert err["param"] == "body.prompt" and "Field required" in err["message"]
    # A 100 KB value of the wrong type is named, not repeated.
    err = assert_clean(c.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": BIG}), 400,
                       "BadRequestError")  # fmt: skip
    assert err["param"] == "body.max_tokens"
    assert_clean(c.get("/v1/nothing-here"), 404, "NotFoundError")
    assert_clean(c.post("/v1/completions", json={"model": "m" * 100_000, "prompt": "x"}), 404, "NotFoundError")
    records = logged.records
    assert len(records) == 6
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in records)
    assert all("\n" not in r.getMessage() and len(r.getMessage()) < 400 for r in records)


def test_server_faults_are_500_without_internals_and_overload_is_503(logged: Records) -> None:
    c = TestClient(_app(), raise_server_exceptions=False)
    err = assert_clean(c.post("/v1/completions", json={"model": "m", "prompt": "crash"}), 500,
                       "InternalServerError")  # fmt: skip
    assert err["message"] == "Internal Server Error"
    # The fault itself is logged, traceback and all, for the operator.
    faults = [r for r in logged.records if r.levelno == logging.ERROR]
    assert len(faults) == 1 and faults[0].exc_info is not None
    r = c.post("/v1/completions", json={"model": "m", "prompt": "busy"})
    assert_clean(r, 503, "ServiceUnavailableError")
    assert r.headers["retry-after"] == "1"


def test_error_types_and_sanitizing() -> None:
    assert [error_type(s) for s in (400, 404, 422, 500, 501, 503)] == [
        "BadRequestError", "NotFoundError", "UnprocessableEntityError", "InternalServerError",
        "NotImplementedError", "ServiceUnavailableError",
    ]  # fmt: skip
    from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException

    # Ray Serve LLM's own exception, with its own type name: typed by status like everything else.
    info = classify(OpenAIHTTPException(404, "Unable to find m.", type="InvalidModel"))
    assert (info.status, info.type) == (404, "NotFoundError")
    info = classify(ApiError(400, "bad value at ray.llm._internal.serve.x.Y in /usr/lib/python3/z.py " * 50))
    assert "ray.llm" not in info.message and "/usr/lib" not in info.message
    assert len(info.message) <= errors.MAX_MESSAGE_CHARS and info.message.endswith("...[truncated]")
    assert error_response(ApiError(503, "wait", retry_after_s=2.5)).headers["retry-after"] == "3"


# --- the serving app: both engines -------------------------------------------------------------------


def _post(base: str, path: str, headers: dict[str, str] | None = None, **body: object) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, headers=headers, timeout=120)


@pytest.mark.ray
@pytest.mark.vllm
def test_hostile_requests_get_clean_errors(tiny_vllm_app: str) -> None:
    base = tiny_vllm_app
    msgs = [{"role": "user", "content": "hi"}]
    for path, extra in (("/chat/completions", {"messages": msgs}), ("/completions", {"prompt": "hi"})):
        err = assert_clean(_post(base, path, model="no-such-model", **extra), 404, "NotFoundError")
        assert err["message"] == "The model `no-such-model` does not exist." and err["param"] == "model"
    assert_clean(_post(base, "/completions", model="m" * 100_000, prompt="x"), 404, "NotFoundError")
    assert_clean(httpx.get(f"{base}/models/no-such-model", timeout=60), 404, "NotFoundError")
    r = httpx.post(f"{base}/chat/completions", content=b'{"model": "tiny-qwen2", "messages": [',
                   headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
    assert assert_clean(r, 400, "BadRequestError")["message"].startswith("Invalid JSON")
    err = assert_clean(_post(base, "/chat/completions", model=EMULATED_MODEL), 400, "BadRequestError")
    assert err["param"] == "body.messages"
    # A 100 KB value where a list belongs.
    err = assert_clean(_post(base, "/chat/completions", model=VLLM_MODEL, messages=BIG), 400, "BadRequestError")
    assert err["param"] and err["param"].startswith("body.messages")
    # 100 KB prompts, far over max_model_len, on both engines, streamed or not.
    for model in (VLLM_MODEL, EMULATED_MODEL):
        for stream in (False, True):
            big = [{"role": "user", "content": BIG}]
            err = assert_clean(
                _post(base, "/chat/completions", model=model, messages=big, max_tokens=8, stream=stream),
                400, "BadRequestError",
            )  # fmt: skip
            assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"], err
            err = assert_clean(_post(base, "/completions", model=model, prompt=BIG, max_tokens=8), 400,
                               "BadRequestError")  # fmt: skip
            assert err["param"] in ("input_tokens", "input_text"), err


@pytest.mark.ray
@pytest.mark.vllm
def test_length_limits_match_vllm_and_rejections_are_counted(tiny_vllm_app: str) -> None:
    base = tiny_vllm_app

    def rejected() -> dict[str, float]:
        out: dict[str, float] = {}
        for name, labels, value in scrape_metrics(REJECTED_REQUESTS_EXPORTED):
            if name == REJECTED_REQUESTS_EXPORTED and labels.get("reason") == "max_model_len":
                out[labels["model"]] = out.get(labels["model"], 0.0) + value
        return out

    before = rejected()
    answers: dict[str, list[dict]] = {}
    for model in (VLLM_MODEL, EMULATED_MODEL):
        # Token-id prompts: both engines count exactly these tokens, so their answers must be identical.
        over = _post(base, "/completions", model=model, prompt=[5] * 2000, max_tokens=8)
        too_many = _post(base, "/completions", model=model, prompt=[5] * 10, max_tokens=5000)
        chat_too_many = _post(base, "/chat/completions", model=model, max_completion_tokens=5000,
                              messages=[{"role": "user", "content": "hi"}])  # fmt: skip
        answers[model] = [assert_clean(r, 400, "BadRequestError") for r in (over, too_many, chat_too_many)]
        # Fits, but not with all of max_tokens: vLLM generates up to max_model_len instead of refusing.
        ok = _post(base, "/completions", model=model, prompt=[5] * 1000, max_tokens=100, ignore_eos=True)
        assert ok.status_code == 200, ok.text[:300]
        usage = ok.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (1000, 24, 1024)
        assert ok.json()["choices"][0]["finish_reason"] == "length"
    assert answers[EMULATED_MODEL] == answers[VLLM_MODEL]
    assert answers[VLLM_MODEL][0]["message"].startswith(
        "This model's maximum context length is 1024 tokens. However, your prompt contains 2000 input tokens"
    )
    assert [a["param"] for a in answers[VLLM_MODEL]] == ["input_tokens", "max_tokens", "max_completion_tokens"]

    def counted() -> dict[str, float] | None:
        now = rejected()
        grew = {m: now.get(m, 0.0) - before.get(m, 0.0) for m in (VLLM_MODEL, EMULATED_MODEL)}
        return grew if all(v >= 3 for v in grew.values()) else None

    wait_for(counted, timeout_s=60, interval_s=1.0, what="rejected_requests counted per model")
    # ... and both still serve.
    for model in (VLLM_MODEL, EMULATED_MODEL):
        r = _post(base, "/completions", model=model, prompt="still there?", max_tokens=4, ignore_eos=True)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def _ingress_logs() -> list[str]:
    session = os.path.join(os.environ["RAY_TMPDIR"], "session_latest", "logs", "serve")
    return glob.glob(os.path.join(session, "replica_*ingress*.log"))


@pytest.mark.ray
@pytest.mark.vllm
def test_client_errors_log_one_line_not_a_traceback(tiny_vllm_app: str) -> None:
    base = tiny_vllm_app
    marks = {kind: f"rs-{kind}-{uuid.uuid4().hex[:12]}" for kind in ("model", "json", "length")}
    _post(base, "/completions", headers={"x-request-id": marks["model"]}, model="no-such-model", prompt="x")
    httpx.post(f"{base}/completions", content=b"{", timeout=60,
               headers={"content-type": "application/json", "x-request-id": marks["json"]})  # fmt: skip
    _post(base, "/completions", headers={"x-request-id": marks["length"]}, model=EMULATED_MODEL, prompt=BIG)

    def lines() -> dict[str, list[tuple[str, str]]] | None:
        """Per request, each log line naming it and the line after it ("" at the end of the file)."""
        found: dict[str, list[tuple[str, str]]] = {}
        for path in _ingress_logs():
            with open(path, errors="replace") as f:
                text = [*f.read().splitlines(), ""]
            for i, line in enumerate(text[:-1]):
                for kind, mark in marks.items():
                    if mark in line:
                        found.setdefault(kind, []).append((line, text[i + 1]))
        return found if set(found) == set(marks) else None

    found = wait_for(lines, timeout_s=60, interval_s=1.0, what="the ingress's log lines for the bad requests")
    for kind, pairs in found.items():
        for line, after in pairs:
            # The next line is another log record (or nothing yet), not this one's traceback.
            assert after == "" or re.match(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) ", after), (kind, line, after)
        assert any(" 400 " in line or " 404 " in line for line, _ in pairs), (kind, pairs)


def test_errors_that_cross_a_process_keep_every_field_through_pickle() -> None:
    """Ray hands a replica's exception to its caller pickled, and a process pool its worker's: pickle
    rebuilds an exception from its args (the message alone), which these errors' constructors refuse."""
    import pickle

    from rayscale.serve.config import EntryErrors
    from rayscale.sim.trace import TraceFormatError

    api = pickle.loads(pickle.dumps(ApiError(429, "queue full", param="model", retry_after_s=2.0)))
    assert (api.status_code, api.message, api.param, api.retry_after_s) == (429, "queue full", "model", 2.0)
    trace = pickle.loads(pickle.dumps(TraceFormatError("t.csv", 3, "TIMESTAMP", "not a time")))
    assert (trace.path, trace.line, trace.field, str(trace)) == (
        "t.csv", 3, "TIMESTAMP", "bad trace t.csv, line 3, field 'TIMESTAMP': not a time")
    entry = pickle.loads(pickle.dumps(EntryErrors([("llm_configs[0].model_loading_config", "missing")])))
    assert entry.found == [("llm_configs[0].model_loading_config", "missing")]
