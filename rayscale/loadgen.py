"""Open-loop trace replay against an OpenAI-compatible endpoint, measuring TTFT and TPOT per request.

Each request of the trace is sent at its arrival time whether or not earlier ones have finished (open
loop: a slow server sees its queue grow, as it would in production), streams its answer over SSE and is
timed on the client: TTFT is the time from sending to the first non-empty token, TPOT the mean gap
between the following tokens. Every request has a total timeout and the whole replay a deadline, so a
replay always ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rayscale.sim.trace import Trace

Api = Literal["completions", "chat"]


@dataclass(frozen=True)
class LoadGenConfig:
    """How to replay a trace. ``base_url`` is the server root, e.g. ``http://127.0.0.2:8000``."""

    base_url: str
    model: str
    api: Api = "completions"
    request_timeout_s: float = 120.0
    deadline_s: float | None = None  # whole replay, from the first send; None: trace duration + 2 timeouts
    max_prompt_tokens: int = 2048
    max_output_tokens: int = 512
    max_model_len: int | None = None  # prompt + output are clipped to fit
    ignore_eos: bool = True  # vLLM extension: generate exactly the trace's output length
    max_connections: int = 512
    tokenizer_path: str | None = None  # a tokenizer.json for exact prompt lengths; else ~1 token a word
    api_key: str | None = None
    seed: int = 0
    progress: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.api not in ("completions", "chat"):
            raise ValueError(f"api must be 'completions' or 'chat', got {self.api!r}")
        if not self.model:
            raise ValueError("model must be set")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError("deadline_s must be > 0")
        if self.max_prompt_tokens < 1 or self.max_output_tokens < 1 or self.max_connections < 1:
            raise ValueError("max_prompt_tokens, max_output_tokens and max_connections must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")


@dataclass(frozen=True, slots=True)
class RequestResult:
    index: int
    scheduled_s: float  # arrival time in the trace
    sent_s: float | None  # when it was actually sent, from the replay start; None: never sent
    prompt_tokens: int  # as requested (the synthesised prompt is approximately this long)
    max_tokens: int
    output_tokens: int  # received (server usage when reported, else token chunks)
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float | None
    status: int | None  # HTTP status; None when no response came
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


@dataclass(frozen=True)
class Summary:
    requests: int
    ok: int
    errors: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    tpot_p50_s: float | None
    tpot_p95_s: float | None
    latency_p50_s: float | None
    latency_p95_s: float | None
    output_tokens: int
    duration_s: float
    output_tokens_per_s: float
    error_kinds: dict[str, int]

    @classmethod
    def of(cls, results: Sequence[RequestResult], duration_s: float) -> Summary:
        ok = [r for r in results if r.ok]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
        lat = [r.latency_s for r in ok if r.latency_s is not None]
        tokens = sum(r.output_tokens for r in results)
        kinds: dict[str, int] = {}
        for r in results:
            if r.error is not None:
                kind = r.error.split(":", 1)[0]
                kinds[kind] = kinds.get(kind, 0) + 1
        return cls(
            requests=len(results),
            ok=len(ok),
            errors=len(results) - len(ok),
            ttft_p50_s=_pct(ttft, 50),
            ttft_p95_s=_pct(ttft, 95),
            tpot_p50_s=_pct(tpot, 50),
            tpot_p95_s=_pct(tpot, 95),
            latency_p50_s=_pct(lat, 50),
            latency_p95_s=_pct(lat, 95),
            output_tokens=tokens,
            duration_s=duration_s,
            output_tokens_per_s=tokens / duration_s if duration_s > 0 else 0.0,
            error_kinds=kinds,
        )

    def rows(self) -> list[tuple[str, str]]:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1000:.1f} ms"

        rows = [
            ("requests", str(self.requests)),
            ("ok", str(self.ok)),
            ("errors", str(self.errors)),
            ("TTFT p50", ms(self.ttft_p50_s)),
            ("TTFT p95", ms(self.ttft_p95_s)),
            ("TPOT p50", ms(self.tpot_p50_s)),
            ("TPOT p95", ms(self.tpot_p95_s)),
            ("latency p50", ms(self.latency_p50_s)),
            ("latency p95", ms(self.latency_p95_s)),
            ("output tokens", str(self.output_tokens)),
            ("duration", f"{self.duration_s:.1f} s"),
            ("output tokens/s", f"{self.output_tokens_per_s:.1f}"),
        ]
        rows += [(f"errors: {k}", str(v)) for k, v in sorted(self.error_kinds.items())]
        return rows

    def table(self, title: str | None = None) -> str:
        from rayscale.tables import format_table

        return format_table(["metric", "value"], [list(r) for r in self.rows()], title=title)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Attainment:
    """How many requests met an SLO as the client measured them (TTFT from sending to the first token, TPOT
    between the following ones), and the client-side p95s of those counted."""

    requests: int  # counted: sent (or due) in the span asked for
    met: int  # succeeded with TTFT <= the target and TPOT <= the target (no TPOT: one token, met)
    ttft_p95_s: float | None
    tpot_p95_s: float | None

    @property
    def share(self) -> float | None:
        return self.met / self.requests if self.requests else None

    def p95s_within(self, ttft_target_s: float, tpot_target_s: float) -> bool:
        """Whether the SLO as stated (p95 targets) holds: both p95s within target, and no request failed
        beyond the 5% a p95 allows (a failed request has no TTFT, so it would not move the p95 itself)."""
        if self.requests == 0:
            return True
        ttft_ok = self.ttft_p95_s is not None and self.ttft_p95_s <= ttft_target_s
        tpot_ok = self.tpot_p95_s is None or self.tpot_p95_s <= tpot_target_s
        return ttft_ok and tpot_ok


def slo_attainment(results: Sequence[RequestResult], ttft_target_s: float, tpot_target_s: float,
                   keep: Callable[[RequestResult], bool] = lambda r: True) -> Attainment:
    """The client-side attainment of the requests ``keep`` selects. A failed or unsent request missed; its
    TTFT counts as infinite in the p95, so failures cannot hide a miss."""
    rs = [r for r in results if keep(r)]
    met = sum(1 for r in rs if r.ok and r.ttft_s is not None and r.ttft_s <= ttft_target_s
              and (r.tpot_s is None or r.tpot_s <= tpot_target_s))
    ttft = [r.ttft_s if r.ok and r.ttft_s is not None else math.inf for r in rs]
    tpot = [r.tpot_s for r in rs if r.ok and r.tpot_s is not None]
    ttft_p95 = float(np.percentile(ttft, 95, method="higher")) if ttft else None
    return Attainment(len(rs), met, ttft_p95, _pct(tpot, 95))


@dataclass(frozen=True)
class ReplayResult:
    results: list[RequestResult]
    summary: Summary
    deadline_hit: bool


# --- prompts --------------------------------------------------------------------------------------

# Short common words: each is one token in most BPE vocabularies, so n words ~ n tokens.
_WORDS = ["the", "of", "and", "to", "in", "is", "for", "on", "that", "with", "as", "it", "at", "by", "from", "this", "be", "are", "was", "or", "an", "not", "but", "all", "can", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "time", "model", "token", "serve", "ray", "request", "reply", "code", "data", "file", "line", "value", "name", "list", "type", "class", "def", "return", "import", "print", "self", "port", "node", "fast", "slow", "small", "large", "first", "last", "next", "more", "less", "over", "under", "up", "down", "left", "right", "old", "new"]


class PromptFactory:
    """Synthesises prompts of roughly a requested token count, different per request.

    Different start offsets into one long random text keep prompts from sharing prefixes, so the
    server's prefix cache does not make the replay unrealistically cheap.
    """

    def __init__(self, seed: int = 0, tokenizer_path: str | None = None, max_tokens: int = 8192):
        rng = np.random.default_rng(seed)
        self._n = max_tokens * 2 + 1024
        words = rng.choice(np.array(_WORDS), size=self._n)
        self._words: list[str] = words.tolist()
        self._rng = rng
        self._tok: Any = None
        self._ids: list[int] = []
        if tokenizer_path is not None:
            from tokenizers import Tokenizer  # only when asked: exact lengths need the model's tokenizer

            self._tok = Tokenizer.from_file(str(tokenizer_path))
            self._ids = self._tok.encode(" ".join(self._words), add_special_tokens=False).ids

    def make(self, index: int, tokens: int) -> str:
        tokens = max(1, tokens)
        if self._tok is not None and len(self._ids) >= tokens:
            start = (index * 7919) % (len(self._ids) - tokens + 1)
            return str(self._tok.decode(self._ids[start : start + tokens]))
        start = (index * 7919) % max(1, self._n - tokens)
        return " ".join(self._words[start : start + tokens])


# --- replay ---------------------------------------------------------------------------------------


def _clip(cfg: LoadGenConfig, prompt: int, output: int) -> tuple[int, int]:
    p = max(1, min(prompt, cfg.max_prompt_tokens))
    o = max(1, min(output, cfg.max_output_tokens))
    if cfg.max_model_len is not None:
        # leave a margin: the synthesised prompt is only approximately p tokens, chat adds a template
        room = cfg.max_model_len - 16 if cfg.max_model_len > 64 else cfg.max_model_len - 1
        o = min(o, max(1, room - 1))
        p = max(1, min(p, room - o))
    return p, o


def _body(cfg: LoadGenConfig, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(cfg.extra_body)
    return body


def _chunk_text(api: Api, chunk: dict[str, Any]) -> str:
    parts = []
    for choice in chunk.get("choices") or ():
        if api == "chat":
            delta = choice.get("delta") or {}
            parts.append(delta.get("content") or delta.get("reasoning_content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


@dataclass
class _Stream:
    """What one response's server-sent events carried: token chunk times, the usage count, an error."""

    first: float | None = None
    last: float | None = None
    chunks: int = 0
    usage_tokens: int | None = None
    error: str | None = None

    async def read(self, resp: Any, api: Api) -> None:
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, event names
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                err = chunk["error"]
                msg = err.get("message", err) if isinstance(err, dict) else err
                self.error = f"stream error: {msg}"
                break
            if chunk.get("usage"):
                self.usage_tokens = chunk["usage"].get("completion_tokens", self.usage_tokens)
            if _chunk_text(api, chunk):
                now = time.perf_counter()
                self.first = now if self.first is None else self.first
                self.last = now
                self.chunks += 1
        if self.error is None and self.first is None:
            self.error = "empty: no tokens in response"


async def _one(
    client: Any,
    cfg: LoadGenConfig,
    index: int,
    scheduled_s: float,
    prompt_text: str,
    prompt_tokens: int,
    max_tokens: int,
    t0: float,
) -> RequestResult:
    path = "/v1/chat/completions" if cfg.api == "chat" else "/v1/completions"
    body = _body(cfg, prompt_text, max_tokens)
    sent = time.perf_counter()
    st = _Stream()
    status: int | None = None
    try:
        async with asyncio.timeout(cfg.request_timeout_s), client.stream("POST", path, json=body) as resp:
            status = resp.status_code
            if status != 200:
                text = (await resp.aread())[:300].decode("utf-8", "replace")
                st.error = f"http {status}: {text.strip()}"
            else:
                await st.read(resp, cfg.api)
    except TimeoutError:
        st.error = f"timeout: no complete response in {cfg.request_timeout_s:g} s"
    except asyncio.CancelledError:
        st.error = "deadline: replay deadline reached while in flight"
    except json.JSONDecodeError as e:
        st.error = f"protocol: bad SSE data ({e.msg})"
    except Exception as e:  # connection refused, reset, ...: recorded, the replay goes on
        st.error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    first, last = st.first, st.last
    tokens = st.usage_tokens if st.usage_tokens is not None else st.chunks
    tpot = (last - first) / (tokens - 1) if first is not None and last is not None and tokens > 1 else None
    return RequestResult(index=index, scheduled_s=scheduled_s, sent_s=sent - t0, prompt_tokens=prompt_tokens,
                         max_tokens=max_tokens, output_tokens=tokens if first is not None else 0,
                         ttft_s=first - sent if first is not None else None, tpot_s=tpot,
                         latency_s=end - sent if st.error is None else None, status=status, error=st.error)


class _Collected:
    """Results by trace index as requests finish, with the progress bar and its error count."""

    def __init__(self, n: int, progress: bool, on_result: Callable[[RequestResult], None] | None) -> None:
        from tqdm import tqdm

        self.results: list[RequestResult | None] = [None] * n
        self.errors = 0
        self.on_result = on_result
        self.bar = tqdm(total=n, unit="req", desc="replay", disable=not progress, file=sys.stderr, smoothing=0.1)

    def done(self, task: asyncio.Task[RequestResult]) -> None:
        if task.cancelled():
            return
        res = task.result()
        self.results[res.index] = res
        self.errors += 0 if res.ok else 1
        self.bar.update(1)
        if self.errors:
            self.bar.set_postfix(errors=self.errors, refresh=False)
        if self.on_result is not None:
            self.on_result(res)


async def replay_async(
    trace: Trace, cfg: LoadGenConfig, on_result: Callable[[RequestResult], None] | None = None
) -> ReplayResult:
    """Replays ``trace`` against ``cfg.base_url``; returns one result per trace request, in trace order."""
    import httpx  # imported here so that `import rayscale.loadgen` stays light

    sizes = [_clip(cfg, int(p), int(o)) for p, o in zip(trace.prompt_tokens, trace.output_tokens, strict=True)]
    factory = PromptFactory(cfg.seed, cfg.tokenizer_path, max(max((s[0] for s in sizes), default=1), 1))
    deadline = cfg.deadline_s if cfg.deadline_s is not None else trace.duration_s + 2 * cfg.request_timeout_s
    got = _Collected(len(trace), cfg.progress, on_result)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections)
    # per-request time is bounded by asyncio.timeout in _one; httpx's own timeouts only catch stalls
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=min(10.0, cfg.request_timeout_s))
    tasks: dict[asyncio.Task[RequestResult], int] = {}
    deadline_hit = False

    async def schedule(client: httpx.AsyncClient, t0: float) -> None:
        for i, arrival in enumerate(trace.arrival_s.tolist()):
            delay = t0 + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            p, o = sizes[i]
            task = asyncio.create_task(_one(client, cfg, i, arrival, factory.make(i, p), p, o, t0))
            tasks[task] = i
            task.add_done_callback(got.done)

    async with httpx.AsyncClient(
        base_url=cfg.base_url.rstrip("/"), headers=headers, limits=limits, timeout=timeout
    ) as client:
        # warm up before the clock starts: the first request otherwise pays for httpx's lazy setup
        with contextlib.suppress(httpx.HTTPError):
            await client.get("/v1/models", timeout=5.0)
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(deadline):
                await schedule(client, t0)
                if tasks:
                    await asyncio.wait(list(tasks))
        except TimeoutError:
            deadline_hit = True
        # in-flight requests end with a "deadline" result; unsent ones are recorded below
        for i in await _cancel_in_flight(tasks):
            got.results[i] = _unsent(i, float(trace.arrival_s[i]), sizes[i], "deadline: cancelled in flight")
        duration = time.perf_counter() - t0
    got.bar.close()
    final = [r if r is not None else _unsent(i, float(trace.arrival_s[i]), sizes[i], "deadline: not sent")
             for i, r in enumerate(got.results)]
    return ReplayResult(final, Summary.of(final, duration), deadline_hit)


async def _cancel_in_flight(tasks: dict[asyncio.Task[RequestResult], int]) -> list[int]:
    """Cancels the requests still in flight; the trace indices of those that ended cancelled."""
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    if not pending:
        return []
    await asyncio.wait(pending)
    return [tasks[t] for t in pending if t.cancelled()]


def _unsent(i: int, arrival: float, size: tuple[int, int], why: str) -> RequestResult:
    return RequestResult(i, arrival, None, size[0], size[1], 0, None, None, None, None, why)


def replay(trace: Trace, cfg: LoadGenConfig) -> ReplayResult:
    """Synchronous :func:`replay_async`."""
    return asyncio.run(replay_async(trace, cfg))


def wait_ready(base_url: str, model: str, timeout_s: float = 300.0, interval_s: float = 1.0) -> float:
    """Waits until ``GET /v1/models`` lists ``model``; returns the seconds waited, raises TimeoutError."""
    import httpx

    start = time.perf_counter()
    last = "no answer yet"
    while True:
        try:
            r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=5.0)
            if r.status_code == 200:
                ids = [m.get("id") for m in r.json().get("data", [])]
                if model in ids:
                    return time.perf_counter() - start
                last = f"model {model!r} not listed (have {ids})"
            else:
                last = f"http {r.status_code}"
        except (httpx.HTTPError, ValueError) as e:
            last = f"{type(e).__name__}: {e}"
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"{base_url} not serving {model!r} after {timeout_s:g} s ({last})")
        time.sleep(interval_s)


def write_results_jsonl(path: str | Path, results: Sequence[RequestResult]) -> None:
    """One JSON object per request, for later analysis."""
    with open(path, "w", encoding="utf-8") as f:
        for r in results:
            d = asdict(r)
            d = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}
            f.write(json.dumps(d) + "\n")


__all__ = [
    "Attainment",
    "LoadGenConfig",
    "PromptFactory",
    "ReplayResult",
    "RequestResult",
    "Summary",
    "replay",
    "replay_async",
    "slo_attainment",
    "wait_ready",
    "write_results_jsonl",
]
