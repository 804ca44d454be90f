"""The real vLLM CPU engine behind the rayscale ingress, driven by the official openai client."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from rayscale.serve.metrics import scrape_engine_metrics
from tests.conftest import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.vllm]

MODEL = "tiny-qwen2"
# Dummy weights sample random tokens, EOS included; ignore_eos makes lengths exact.
EXACT = {"ignore_eos": True}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def test_models_endpoint_lists_every_model(tiny_vllm_app: str) -> None:
    ids = sorted(m.id for m in client(tiny_vllm_app).models.list().data)
    assert ids == ["mistral-7b", MODEL]
    assert client(tiny_vllm_app).models.retrieve(MODEL).id == MODEL


def test_completion_and_chat(tiny_vllm_app: str) -> None:
    c = client(tiny_vllm_app)
    r = c.completions.create(model=MODEL, prompt="hello world", max_tokens=12, extra_body=EXACT)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.usage is not None and r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    assert r.choices[0].finish_reason == "length" and r.choices[0].text

    ch = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "count to ten"}],
        max_tokens=10,
        extra_body=EXACT,
    )
    assert ch.object == "chat.completion"
    assert ch.choices[0].message.role == "assistant" and ch.choices[0].message.content
    assert ch.usage is not None and ch.usage.completion_tokens == 10
    # The chat template wraps both messages: more prompt tokens than the bare text.
    assert ch.usage.prompt_tokens > 10


def test_streaming_completion_and_chat(tiny_vllm_app: str) -> None:
    c = client(tiny_vllm_app)
    chunks = list(
        c.completions.create(
            model=MODEL, prompt="the quick brown fox", max_tokens=16, stream=True,
            stream_options={"include_usage": True}, extra_body=EXACT,
        )
    )  # fmt: skip
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text
    assert len([ch for ch in chunks if ch.choices]) >= 2, "stream arrived in one piece"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16

    stream = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=16, stream=True,
        stream_options={"include_usage": True}, extra_body=EXACT,
    )  # fmt: skip
    chat_chunks = list(stream)
    content = "".join((ch.choices[0].delta.content or "") for ch in chat_chunks if ch.choices)
    assert content
    finishes = [
        ch.choices[0].finish_reason for ch in chat_chunks if ch.choices and ch.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert chat_chunks[-1].usage is not None and chat_chunks[-1].usage.completion_tokens == 16


def test_concurrent_streams_all_complete(tiny_vllm_app: str) -> None:
    async def run() -> list[int]:
        ac = openai.AsyncOpenAI(base_url=tiny_vllm_app, api_key="unused", max_retries=0, timeout=120)

        async def one(i: int) -> int:
            s = await ac.completions.create(
                model=MODEL, prompt=f"request {i}", max_tokens=20, stream=True,
                stream_options={"include_usage": True}, extra_body=EXACT,
            )  # fmt: skip
            usage = 0
            async for ch in s:
                if ch.usage:
                    usage = ch.usage.completion_tokens
            return usage

        try:
            return await asyncio.gather(*(one(i) for i in range(8)))
        finally:
            await ac.close()

    assert asyncio.run(run()) == [20] * 8


def _assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert err["message"] and err["type"]
    # vLLM-style errors carry the HTTP status as code; request-validation errors a string code.
    assert err["code"] == status or isinstance(err["code"], str)
    return err


def test_bad_requests_get_openai_errors_and_server_keeps_serving(tiny_vllm_app: str) -> None:
    base = tiny_vllm_app
    with httpx.Client(timeout=60) as h:
        err = _assert_openai_error(
            h.post(
                f"{base}/chat/completions",
                json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
            ),
            404,
        )
        assert "no-such-model" in err["message"]
        _assert_openai_error(
            h.post(
                f"{base}/completions",
                content=b'{"model": "tiny-qwen2", "prompt": ',
                headers={"content-type": "application/json"},
            ),
            400,
        )
        _assert_openai_error(
            h.post(f"{base}/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 100_000}), 400
        )
        _assert_openai_error(h.post(f"{base}/chat/completions", json={"model": MODEL, "messages": []}), 400)
        _assert_openai_error(
            h.post(
                f"{base}/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000},
            ),
            400,
        )
    # The official client maps them to its exception types.
    c = client(base)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    # ... and the server is still serving.
    r = c.completions.create(model=MODEL, prompt="still there?", max_tokens=4, extra_body=EXACT)
    assert r.usage is not None and r.usage.completion_tokens == 4


def _series(samples: list, name: str, **labels: str) -> list:
    return [s for s in samples if s[0] == name and all(s[1].get(k) == v for k, v in labels.items())]


def test_engine_metrics_per_model_flavor_replica(tiny_vllm_app: str) -> None:
    c = client(tiny_vllm_app)
    for _ in range(3):
        c.completions.create(model=MODEL, prompt="metrics please", max_tokens=8, extra_body=EXACT)
    want = {"model": MODEL, "flavor": "cpu", "deployment": "tiny-qwen2--cpu", "model_name": MODEL}

    def exported() -> list | None:
        samples = scrape_engine_metrics()
        gen = _series(samples, "ray_vllm_generation_tokens_total", **want)
        return samples if gen and sum(s[2] for s in gen) >= 24 else None

    samples = wait_for(
        exported, timeout_s=60, interval_s=1.0, what="vLLM metrics on Ray's Prometheus endpoint"
    )
    for name in (
        "ray_vllm_num_requests_running",
        "ray_vllm_num_requests_waiting",
        "ray_vllm_kv_cache_usage_perc",
        "ray_vllm_prompt_tokens_total",
        "ray_vllm_time_to_first_token_seconds_count",
        "ray_vllm_request_time_per_output_token_seconds_count",
        "ray_vllm_request_prefill_time_seconds_count",  # the controller's TTFT correction reads it
        "ray_vllm_request_generation_tokens_count",  # and the window's output mean
    ):
        found = _series(samples, name, **want)
        assert found, f"{name} missing for {want}"
        assert all(s[1].get("ReplicaId") for s in found), f"{name} has no replica label"
    ttft = _series(samples, "ray_vllm_time_to_first_token_seconds_count", **want)
    assert sum(s[2] for s in ttft) >= 3
