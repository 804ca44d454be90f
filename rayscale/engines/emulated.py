"""Profile-driven emulated LLM engine: vLLM's timing behaviour without any compute.

Latency model (FACTS.md):
  TTFT = queue wait + overhead_s + prompt_tokens / prefill_tokens_per_s + prefill_quadratic_s x prompt_tokens^2
  inter-token latency = itl_alpha_s + itl_beta_s * running batch
Admission is continuous batching: a request runs when fewer than ``max_num_seqs`` run and its KV
reservation (prompt + max_tokens) fits in ``kv_tokens``; otherwise it waits, FIFO like vLLM's scheduler.

Every request is one asyncio task that sleeps; tokens are produced in "flushes" of at most
``stream_interval_s`` so hundreds of concurrent streams cost little CPU.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rayscale.engines.profile import EmulatedProfile, ProfileLike

# Same words the tiny tokenizer knows; only used to make readable filler text.
_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "ray",
    "serve",
    "routes",
    "tokens",
    "to",
    "replicas",
    "and",
    "streams",
    "them",
    "back",
    "while",
    "the",
    "autoscaler",
    "plans",
    "flavors",
]


class EngineMetricsSink(Protocol):
    def set_queue(self, waiting: int, running: int, kv_usage: float) -> None: ...
    def observe_ttft(self, seconds: float) -> None: ...
    def observe_itl(self, seconds: float) -> None: ...
    def observe_tpot(self, seconds: float) -> None: ...
    def observe_e2e(self, seconds: float) -> None: ...
    def observe_phases(self, queued_s: float, prefill_s: float) -> None: ...
    def observe_request_tokens(self, prompt: int, generation: int) -> None: ...
    def add_tokens(self, prompt: int, generation: int) -> None: ...


class NullMetrics:
    def set_queue(self, waiting: int, running: int, kv_usage: float) -> None:
        pass

    def observe_ttft(self, seconds: float) -> None:
        pass

    def observe_itl(self, seconds: float) -> None:
        pass

    def observe_tpot(self, seconds: float) -> None:
        pass

    def observe_e2e(self, seconds: float) -> None:
        pass

    def observe_phases(self, queued_s: float, prefill_s: float) -> None:
        pass

    def observe_request_tokens(self, prompt: int, generation: int) -> None:
        pass

    def add_tokens(self, prompt: int, generation: int) -> None:
        pass


class EngineOverloaded(Exception):
    """A request can never fit: its prompt + max_tokens exceed the KV capacity or max_model_len."""


class ContextLengthExceeded(EngineOverloaded):
    """vLLM's 400 for a request longer than max_model_len; the text and ``param`` are vLLM's own."""

    def __init__(self, message: str, param: str, value: int) -> None:
        # vLLM's VLLMValidationError appends the parameter and value to its message the same way.
        super().__init__(f"{message} (parameter={param}, value={value})")
        self.param = param
        self.value = value


def fit_max_tokens(
    max_model_len: int, prompt_tokens: int, max_tokens: int | None, max_tokens_param: str = "max_tokens"
) -> int:
    """The length checks vLLM 0.32's OpenAI server makes, and the max_tokens it then generates up to.

    As vLLM (renderers/params.py, entrypoints/serve/utils/api_utils.get_max_tokens): max_tokens over
    max_model_len and a prompt over max_model_len are rejected; a prompt that fits but leaves less room
    than max_tokens is not rejected, its output stops at max_model_len (finish_reason "length").
    """
    if max_tokens is not None and max_tokens > max_model_len:
        raise ContextLengthExceeded(
            f"{max_tokens_param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            max_tokens_param,
            max_tokens,
        )
    if prompt_tokens > max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"contains {prompt_tokens} input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            prompt_tokens,
        )
    room = max_model_len - prompt_tokens
    fitted = room if max_tokens is None else min(max_tokens, room)
    if fitted < 1:
        # A prompt of exactly max_model_len leaves no room; vLLM's SamplingParams says so this way.
        raise ContextLengthExceeded(f"max_tokens must be at least 1, got {fitted}.", "max_tokens", fitted)
    return fitted


@dataclass
class TokenChunk:
    """Tokens produced since the last chunk; ``finish_reason`` set on the last one."""

    text: str
    num_tokens: int
    finish_reason: str | None = None


@dataclass
class _Req:
    prompt_tokens: int
    max_tokens: int
    arrival: float
    admitted: asyncio.Event

    @property
    def kv(self) -> int:
        return self.prompt_tokens + self.max_tokens


class EmulatedEngine:
    def __init__(
        self,
        profile: ProfileLike | EmulatedProfile | dict[str, Any],
        max_model_len: int = 32768,
        stream_interval_s: float = 0.0,
        metrics: EngineMetricsSink | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.profile = EmulatedProfile.from_profile(profile)
        self.max_model_len = max_model_len
        self.stream_interval_s = stream_interval_s
        self.metrics: EngineMetricsSink = metrics or NullMetrics()
        self._clock = clock
        self._waiting: collections.deque[_Req] = collections.deque()
        self._running = 0
        self._kv_used = 0

    # --- state, for metrics and tests ---
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def kv_usage(self) -> float:
        return self._kv_used / self.profile.kv_tokens

    def _publish(self) -> None:
        self.metrics.set_queue(len(self._waiting), self._running, self.kv_usage)

    def report(self) -> None:
        """Publish the queue gauges now (a heartbeat while idle)."""
        self._publish()

    def _admit(self) -> None:
        p = self.profile
        while self._waiting:
            head = self._waiting[0]
            if self._running >= p.max_num_seqs or self._kv_used + head.kv > p.kv_tokens:
                break  # FIFO: the head blocks the rest, as in vLLM's scheduler
            self._waiting.popleft()
            self._running += 1
            self._kv_used += head.kv
            head.admitted.set()
        self._publish()

    def itl(self) -> float:
        return self.profile.itl_alpha_s + self.profile.itl_beta_s * max(self._running, 1)

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + max_tokens > self.max_model_len:
            # Servers fit max_tokens first (fit_max_tokens); this guards direct callers.
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion).",
                "max_tokens",
                max_tokens,
            )
        if prompt_tokens + max_tokens > self.profile.kv_tokens:
            raise EngineOverloaded(
                f"request needs {prompt_tokens + max_tokens} KV tokens, capacity is {self.profile.kv_tokens}"
            )

    async def generate(self, prompt_tokens: int, max_tokens: int) -> AsyncIterator[TokenChunk]:
        """Yield token chunks on the profile's schedule; the first chunk holds exactly the first token."""
        self.check(prompt_tokens, max_tokens)
        p = self.profile
        req = _Req(prompt_tokens, max_tokens, self._clock(), asyncio.Event())
        self._waiting.append(req)
        self._admit()
        admitted = False
        start = req.arrival
        try:
            await req.admitted.wait()
            admitted = True
            scheduled = self._clock()
            await asyncio.sleep(p.overhead_s + prompt_tokens / p.prefill_tokens_per_s
                                + p.prefill_quadratic_s * prompt_tokens * prompt_tokens)
            first = self._clock()
            self.metrics.observe_ttft(first - start)
            self.metrics.add_tokens(prompt_tokens, 1)
            done = 1
            yield TokenChunk(_word(0), 1, "length" if done >= max_tokens else None)
            last = first
            while done < max_tokens:
                # Tokens due in the next flush at the current batch's inter-token latency.
                itl = self.itl()
                n = max(1, min(max_tokens - done, int(self.stream_interval_s / itl) if itl > 0 else 1))
                await asyncio.sleep(n * itl)
                now = self._clock()
                for _ in range(n):
                    self.metrics.observe_itl((now - last) / n)
                last = now
                text = "".join(_word(done + i) for i in range(n))
                done += n
                self.metrics.add_tokens(0, n)
                yield TokenChunk(text, n, "length" if done >= max_tokens else None)
            end = self._clock()
            if done > 1:
                # vLLM's request_time_per_output_token: decode time over tokens after the first.
                self.metrics.observe_tpot((end - first) / (done - 1))
            self.metrics.observe_e2e(end - start)
            # As vLLM: queued = arrival -> scheduled, prefill = scheduled -> first token, at finish.
            self.metrics.observe_phases(scheduled - start, first - scheduled)
            self.metrics.observe_request_tokens(prompt_tokens, done)
        finally:
            if admitted:
                self._running -= 1
                self._kv_used -= req.kv
            else:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(req)
            self._admit()


def _word(i: int) -> str:
    return " " + _WORDS[i % len(_WORDS)]


def count_tokens(text: str) -> int:
    """Rough token count for emulated prompts: ~4 characters per token, like English BPE."""
    return max(1, (len(text) + 3) // 4)
