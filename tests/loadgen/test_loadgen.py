"""The load generator against a real HTTP server that streams SSE (tests/loadgen/conftest.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from loadgen.fake_openai import MODEL, FakeServer
from rayscale.loadgen import LoadGenConfig, PromptFactory, Summary, replay
from rayscale.sim.trace import Trace


def cfg(server: FakeServer | str, **kw: object) -> LoadGenConfig:
    base = server if isinstance(server, str) else server.base_url
    kw.setdefault("progress", False)
    kw.setdefault("request_timeout_s", 10.0)
    return LoadGenConfig(base_url=base, model=MODEL, **kw)  # type: ignore[arg-type]


def uniform(n: int, gap_s: float, prompt: int = 20, output: int = 5) -> Trace:
    return Trace.from_arrays(np.arange(n) * gap_s, [prompt] * n, [output] * n, "uniform")


def test_ttft_and_tpot_measured_from_the_stream(fake_server: FakeServer) -> None:
    fake_server.behaviour.ttft_s = 0.3
    fake_server.behaviour.itl_s = 0.05
    out = replay(uniform(3, 0.1, output=6), cfg(fake_server))
    assert not out.deadline_hit
    for r in out.results:
        assert r.ok, r.error
        assert r.status == 200
        assert r.output_tokens == 6 and r.max_tokens == 6
        assert r.ttft_s is not None and 0.3 <= r.ttft_s < 0.5
        assert r.tpot_s is not None and 0.045 <= r.tpot_s < 0.1
        assert r.latency_s is not None and r.latency_s >= 0.3 + 5 * 0.05
    s = out.summary
    assert (s.requests, s.ok, s.errors) == (3, 3, 0)
    assert s.ttft_p50_s is not None and 0.3 <= s.ttft_p50_s < 0.5
    assert s.output_tokens == 18 and s.output_tokens_per_s > 0
    table = s.table()
    for word in ("requests", "errors", "TTFT p50", "TTFT p95", "TPOT p50", "TPOT p95", "output tokens/s"):
        assert word in table


def test_chat_role_chunk_is_not_the_first_token(fake_server: FakeServer) -> None:
    # the server sends an empty role chunk at once and the first token 0.3 s later
    fake_server.behaviour.ttft_s = 0.3
    out = replay(uniform(2, 0.05, output=3), cfg(fake_server, api="chat"))
    assert [r.ok for r in out.results] == [True, True]
    assert all(r.ttft_s is not None and r.ttft_s >= 0.3 for r in out.results)
    assert fake_server.received[0].path == "/v1/chat/completions"
    assert fake_server.received[0].body["messages"][0]["role"] == "user"


def test_token_count_without_usage_counts_chunks(fake_server: FakeServer) -> None:
    fake_server.behaviour.report_usage = False
    out = replay(uniform(1, 0.0, output=4), cfg(fake_server))
    assert out.results[0].output_tokens == 4


def test_open_loop_keeps_trace_arrival_times(fake_server: FakeServer) -> None:
    """A slow server must not delay later sends: arrivals follow the trace, not completions."""
    fake_server.behaviour.ttft_s = 1.0
    trace = Trace.from_arrays([0.0, 0.2, 0.4, 0.6, 1.2], [10] * 5, [2] * 5)
    start = time.perf_counter()
    out = replay(trace, cfg(fake_server))
    elapsed = time.perf_counter() - start
    assert all(r.ok for r in out.results)
    got = np.array(sorted(r.t for r in fake_server.received))
    lag = got - np.array([0.0, 0.2, 0.4, 0.6, 1.2])
    assert lag.max() - lag.min() < 0.1, f"server saw arrivals {got - got[0]}"
    for r in out.results:
        assert r.sent_s is not None and abs(r.sent_s - r.scheduled_s) < 0.08
    # all overlap: the replay takes ~ last arrival + one request, not the sum of requests
    assert elapsed < 1.2 + 1.0 + 1.0


def test_prompts_follow_trace_lengths_and_clipping(fake_server: FakeServer) -> None:
    fake_server.behaviour.itl_s = 0.0005
    trace = Trace.from_arrays([0.0, 0.0, 0.0], [50, 3000, 400], [10, 10, 900])
    out = replay(trace, cfg(fake_server, max_prompt_tokens=1000, max_output_tokens=500, max_model_len=600))
    bodies = sorted(fake_server.received, key=lambda x: len(x.body["prompt"]))
    words = [len(b.body["prompt"].split()) for b in bodies]
    assert words[0] == 50  # one word per token without a tokenizer
    for b in bodies:
        assert len(b.body["prompt"].split()) + b.body["max_tokens"] <= 600
        assert b.body["stream"] is True and b.body["ignore_eos"] is True
    assert max(r.max_tokens for r in out.results) <= 500
    # prompts differ, so a prefix cache cannot serve them for free
    assert len({b.body["prompt"][:40] for b in bodies}) == 3


def test_prompt_factory_is_deterministic_and_sized() -> None:
    a, b = PromptFactory(seed=1), PromptFactory(seed=1)
    assert a.make(5, 100) == b.make(5, 100)
    assert a.make(5, 100) != a.make(6, 100)
    assert len(a.make(3, 777).split()) == 777


def test_http_errors_are_recorded_not_raised(fake_server: FakeServer) -> None:
    fake_server.behaviour.status = 503
    out = replay(uniform(3, 0.01), cfg(fake_server))
    assert out.summary.errors == 3 and out.summary.ok == 0
    assert all(r.status == 503 and r.error is not None and "overloaded" in r.error for r in out.results)
    assert out.summary.error_kinds == {"http 503": 3}
    assert out.summary.ttft_p50_s is None
    assert "-" in out.summary.table()


def test_unknown_model_is_an_error(fake_server: FakeServer) -> None:
    c = LoadGenConfig(base_url=fake_server.base_url, model="other", progress=False, request_timeout_s=5)
    out = replay(uniform(1, 0.0), c)
    assert out.results[0].status == 404 and not out.results[0].ok


def test_request_timeout_bounds_a_hanging_server(fake_server: FakeServer) -> None:
    fake_server.behaviour.hang = True
    start = time.perf_counter()
    out = replay(uniform(2, 0.1), cfg(fake_server, request_timeout_s=0.5))
    assert time.perf_counter() - start < 3.0
    assert all(r.error is not None and r.error.startswith("timeout") for r in out.results)


def test_deadline_ends_the_replay(fake_server: FakeServer) -> None:
    fake_server.behaviour.hang = True
    trace = uniform(20, 0.5)  # 9.5 s of arrivals
    start = time.perf_counter()
    out = replay(trace, cfg(fake_server, deadline_s=1.2, request_timeout_s=30))
    assert time.perf_counter() - start < 4.0
    assert out.deadline_hit
    kinds = out.summary.error_kinds
    assert kinds.get("deadline", 0) == 20
    sent = [r for r in out.results if r.sent_s is not None]
    assert 2 <= len(sent) <= 4  # arrivals at 0, 0.5, 1.0 were sent; the rest never were


def test_connection_refused_is_an_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        out = replay(uniform(2, 0.01), cfg(f"http://127.0.0.1:{port}", request_timeout_s=5))
    assert out.summary.errors == 2
    assert all(r.status is None for r in out.results)


def test_summary_percentiles() -> None:
    from rayscale.loadgen import RequestResult

    rs = [
        RequestResult(i, 0.0, 0.0, 10, 10, 10, ttft_s=float(i), tpot_s=0.01, latency_s=1.0, status=200, error=None)
        for i in range(1, 101)
    ]
    s = Summary.of(rs, duration_s=10.0)
    assert s.ttft_p50_s == pytest.approx(50.5)
    assert s.ttft_p95_s == pytest.approx(95.05)
    assert s.output_tokens_per_s == pytest.approx(100.0)
