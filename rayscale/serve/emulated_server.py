"""Serve deployment class for the emulated engine, with the call interface of Ray Serve LLM's LLMServer.

The ingress calls ``chat`` / ``completions`` on either server the same way. Responses here are plain
OpenAI JSON (dicts, and SSE strings when streaming). The requests it receives are Ray Serve LLM's request
models, whose module imports vLLM and torch: the replica imports it while starting (not on its first
request), so it is RUNNING only once it can answer at full speed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from rayscale.engines.emulated import (
    ContextLengthExceeded,
    EmulatedEngine,
    EngineOverloaded,
    TokenChunk,
    count_tokens,
    fit_max_tokens,
)
from rayscale.engines.profile import EmulatedProfile


def _get(req: Any, key: str, default: Any = None) -> Any:
    if isinstance(req, dict):
        return req.get(key, default)
    return getattr(req, key, default)


def _sse(obj: dict[str, Any]) -> str:
    import json

    return f"data: {json.dumps(obj)}\n\n"


def error_body(
    message: str, code: int = 400, type_: str = "BadRequestError", param: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class EmulatedLLMServer:
    """One replica of an emulated (model, flavor): latency from the profile, no compute."""

    def __init__(
        self,
        model_name: str,
        profile: dict[str, Any],
        max_model_len: int = 32768,
        stream_interval_s: float = 0.0,
    ) -> None:
        # The ingress hands requests over as Ray Serve LLM's request models, whose unpickling imports
        # vLLM and torch (10-20 s on two cores). Do it now, before Serve marks the replica RUNNING, so
        # the first requests of a new replica do not stall (and its metrics do not go quiet) mid scale-up.
        import ray.llm._internal.serve.core.configs.openai_api_models  # noqa: F401

        from rayscale.serve.metrics import EmulatedEngineMetrics, serve_identity

        # Says which flavor deployment answered (responses carry it as system_fingerprint).
        self.fingerprint = f"rayscale-emulated:{serve_identity()['deployment'] or model_name}"
        self.model_name = model_name
        self.profile = EmulatedProfile.from_profile(profile)
        self.engine = EmulatedEngine(
            self.profile,
            max_model_len=max_model_len,
            stream_interval_s=stream_interval_s,
            metrics=EmulatedEngineMetrics(model_name, max_model_len),
        )

    async def check_health(self) -> None:
        # Serve calls this every health_check_period_s: re-report the gauges so an idle replica's series
        # stay alive in Ray's exporter, and idle (zero load) never looks like missing metrics.
        self.engine.report()

    async def stats(self) -> dict[str, float]:
        e = self.engine
        return {"waiting": e.num_waiting, "running": e.num_running, "kv_usage": e.kv_usage}

    def _max_tokens(self, request: Any, prompt_tokens: int) -> int:
        """max_tokens as vLLM runs it (default and clamp: the room the context leaves), or its 400."""
        param, mt = "max_completion_tokens", _get(request, "max_completion_tokens")
        if mt is None:
            param, mt = "max_tokens", _get(request, "max_tokens")
        return fit_max_tokens(
            self.engine.max_model_len, prompt_tokens, None if mt is None else int(mt), param
        )

    async def chat(self, request: Any, raw_request_info: Any = None) -> AsyncIterator[Any]:
        messages = _get(request, "messages") or []
        text = "".join(str(_get(m, "content", "") or "") for m in messages)
        async for item in self._run(request, count_tokens(text) + 3 * len(messages), chat=True):
            yield item

    async def completions(self, request: Any, raw_request_info: Any = None) -> AsyncIterator[Any]:
        prompt = _get(request, "prompt")
        if isinstance(prompt, list):
            n = (
                len(prompt)
                if prompt and isinstance(prompt[0], int)
                else count_tokens(" ".join(map(str, prompt)))
            )
        else:
            n = count_tokens(str(prompt or ""))
        async for item in self._run(request, n, chat=False):
            yield item

    async def _run(self, request: Any, prompt_tokens: int, chat: bool) -> AsyncIterator[Any]:
        try:
            max_tokens = self._max_tokens(request, prompt_tokens)
            self.engine.check(prompt_tokens, max_tokens)
        except ContextLengthExceeded as e:
            yield error_body(str(e), 400, "BadRequestError", e.param)
            return
        except EngineOverloaded as e:
            yield error_body(str(e), 400, "BadRequestError", "max_tokens")
            return
        reply = _Reply(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), self.model_name,
                       self.fingerprint, chat, prompt_tokens)
        gen = self.engine.generate(prompt_tokens, max_tokens)
        if not _get(request, "stream"):
            yield await reply.whole(gen)
            return
        include_usage = bool(_get(_get(request, "stream_options") or {}, "include_usage", False))
        async for lines in reply.streamed(gen, include_usage):
            yield lines


@dataclass(frozen=True)
class _Reply:
    """One completion's OpenAI response body (``whole``) or server-sent events (``streamed``), shaped as
    vLLM's OpenAI server writes them."""

    id: str
    created: int
    model: str
    fingerprint: str
    chat: bool
    prompt_tokens: int

    def usage(self, done: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    async def whole(self, gen: AsyncIterator[TokenChunk]) -> dict[str, Any]:
        parts: list[str] = []
        done = 0
        finish = "length"
        async for ch in gen:
            parts.append(ch.text)
            done += ch.num_tokens
            finish = ch.finish_reason or finish
        text = "".join(parts)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint,
                "choices": [choice], "usage": self.usage(done)}

    async def streamed(self, gen: AsyncIterator[TokenChunk], include_usage: bool) -> AsyncIterator[list[str]]:
        done = 0
        if self.chat:
            yield [self._chunk(None, first=True)]
        async for ch in gen:
            done += ch.num_tokens
            yield [self._chunk(ch)]
        if include_usage:
            yield [_sse({"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                         "choices": [], "usage": self.usage(done)})]
        yield ["data: [DONE]\n\n"]

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, ch: TokenChunk | None, first: bool = False) -> str:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if ch is not None:
                delta["content"] = ch.text
            c: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}
        else:
            c = {"index": 0, "text": ch.text if ch else "", "finish_reason": None, "logprobs": None}
        if ch is not None and ch.finish_reason:
            c["finish_reason"] = ch.finish_reason
        return _sse({"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                     "system_fingerprint": self.fingerprint, "choices": [c]})
