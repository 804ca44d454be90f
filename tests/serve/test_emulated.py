"""The profile-driven emulated engine: latency model, KV capacity, scale; and served behind the ingress."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from rayscale.engines.emulated import EmulatedEngine, EngineOverloaded
from rayscale.engines.profile import EmulatedProfile, catalog_profile
from rayscale.serve.metrics import scrape_engine_metrics
from rayscale.serve.weights import set_flavor_weights
from tests.conftest import EMULATED_MODEL, TINY_APP, wait_for


def profile(**kw: float) -> EmulatedProfile:
    base = dict(
        model="m", flavor="f", prefill_tokens_per_s=10_000.0, overhead_s=0.05, itl_alpha_s=0.01,
        itl_beta_s=0.002, max_num_seqs=8, kv_tokens=100_000, startup_s=0.0, source="test",
    )  # fmt: skip
    base.update(kw)
    return EmulatedProfile.model_validate(base)


async def _timed(engine: EmulatedEngine, prompt: int, out: int) -> tuple[float, float, int]:
    t0 = time.monotonic()
    first = None
    n = 0
    async for ch in engine.generate(prompt, out):
        if first is None:
            first = time.monotonic() - t0
        n += ch.num_tokens
    assert first is not None
    return first, time.monotonic() - t0, n


def test_ttft_is_overhead_plus_prefill() -> None:
    eng = EmulatedEngine(profile(prefill_tokens_per_s=5000.0, overhead_s=0.05))
    ttft, _, n = asyncio.run(_timed(eng, 1000, 1))
    assert n == 1
    assert 0.25 - 0.01 <= ttft < 0.25 + 0.1  # 0.05 + 1000 / 5000


def test_inter_token_latency_grows_with_batch() -> None:
    p = profile(itl_alpha_s=0.01, itl_beta_s=0.004, overhead_s=0.0, max_num_seqs=64)

    async def run(batch: int) -> float:
        eng = EmulatedEngine(p)
        res = await asyncio.gather(*(_timed(eng, 10, 21) for _ in range(batch)))
        return max((total - ttft) / 20 for ttft, total, _ in res)

    solo, crowd = asyncio.run(run(1)), asyncio.run(run(16))
    # Sleeps never end early, and a busy machine makes them late: bounds below tight, above loose.
    assert 0.012 <= solo < 0.03  # alpha + beta * 1 = 0.014
    assert 0.070 <= crowd < 0.10  # alpha + beta * 16 = 0.074
    assert crowd > 3 * solo


def test_kv_capacity_caps_the_batch_and_requests_wait() -> None:
    # Each request reserves 100 prompt + 100 output tokens; 600 KV tokens fit three at a time.
    eng = EmulatedEngine(
        profile(kv_tokens=600, max_num_seqs=100, overhead_s=0.0, itl_alpha_s=0.01, itl_beta_s=0.0)
    )
    seen: list[tuple[int, int]] = []

    async def run() -> list[tuple[float, float, int]]:
        tasks = [asyncio.create_task(_timed(eng, 100, 100)) for _ in range(7)]
        await asyncio.sleep(0.2)
        seen.append((eng.num_running, eng.num_waiting))
        assert eng.kv_usage == pytest.approx(1.0)
        return await asyncio.gather(*tasks)

    res = asyncio.run(run())
    assert seen == [(3, 4)]
    ttfts = sorted(r[0] for r in res)
    # The last wave waited for two waves of ~1 s each before its first token.
    assert ttfts[:3] == pytest.approx([0.01] * 3, abs=0.05)
    assert ttfts[-1] > 1.8
    assert (eng.num_running, eng.num_waiting, eng.kv_usage) == (0, 0, 0.0)


def test_request_larger_than_context_or_kv_is_rejected() -> None:
    eng = EmulatedEngine(profile(kv_tokens=1000), max_model_len=4096)

    async def one(prompt: int, out: int) -> None:
        async for _ in eng.generate(prompt, out):
            pass

    with pytest.raises(EngineOverloaded, match="maximum context length"):
        asyncio.run(one(4000, 200))
    with pytest.raises(EngineOverloaded, match="KV"):
        asyncio.run(one(900, 200))


def test_hundreds_of_concurrent_streams_are_cheap() -> None:
    # The A10G profile's batch limits with a faster clock, so the test takes seconds, not minutes.
    fast = catalog_profile("mistral-7b", "a10g").model_copy(update={"itl_alpha_s": 0.005, "itl_beta_s": 0.00005})
    eng = EmulatedEngine(fast, max_model_len=8192, stream_interval_s=0.1)
    cpu0, t0 = time.process_time(), time.monotonic()

    async def run() -> list[tuple[float, float, int]]:
        return await asyncio.gather(*(_timed(eng, 500, 50) for _ in range(400)))

    res = asyncio.run(run())
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    assert all(n == 50 for _, _, n in res)
    # KV caps the batch before max_num_seqs does: kv_tokens // (500 + 50) run at once (100 with the
    # catalog's 55k tokens), the rest queue, so ~4 waves of 50 x (5 + 0.05 x batch) ms.
    # Relative, not absolute, times: a busy machine delays every stream alike, not the queue's wave gap.
    batch = fast.kv_tokens // 550
    assert batch < fast.max_num_seqs and batch < 400
    ttfts = sorted(r[0] for r in res)
    wave = 50 * (0.005 + 0.00005 * batch)
    # Counted, not indexed: on a busy machine a first-wave stream can see its first token late, and the
    # boundary of the sorted list then moves by one (CI: request 101 "did not wait", 0.75 s for both).
    first_wave = sum(1 for t in ttfts if t < ttfts[0] + 0.5 * wave)
    assert batch // 2 < first_wave <= batch, f"{first_wave} of 400 streams got a first token in the first wave"
    assert 1.5 < wall < 30
    assert cpu < 3.0, f"{cpu:.1f}s of CPU for 400 emulated streams"


def test_engine_accepts_the_core_catalog_profile() -> None:
    from rayscale.core.catalog import Profile

    core = Profile(
        model="mistral-7b", flavor="l4", prefill_tokens_per_s=4000.0, overhead_s=0.03, itl_alpha_s=0.035,
        itl_beta_s=0.001, max_num_seqs=128, kv_tokens=40_000, startup_s=100.0, source="estimate: test",
    )  # fmt: skip
    eng = EmulatedEngine(core)
    assert (eng.profile.flavor, eng.profile.kv_tokens, eng.profile.itl_beta_s) == ("l4", 40_000, 0.001)
    assert eng.itl() == pytest.approx(core.itl_s(1))


# --- served through Ray Serve, behind the same ingress as the real engine ---------------------


@pytest.mark.ray
def test_emulated_model_served_via_openai_client_and_weighted_routing(tiny_vllm_app: str) -> None:
    c = openai.OpenAI(base_url=tiny_vllm_app, api_key="unused", max_retries=0, timeout=60)
    r = c.chat.completions.create(
        model=EMULATED_MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=5
    )
    assert r.usage is not None and r.usage.completion_tokens == 5 and r.choices[0].message.content
    assert r.system_fingerprint == "rayscale-emulated:mistral-7b--a10g"  # l4 has weight 0

    chunks = list(c.completions.create(model=EMULATED_MODEL, prompt="x" * 400, max_tokens=6, stream=True))
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].text) == 6
    assert chunks[-1].choices[0].finish_reason == "length"

    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=EMULATED_MODEL, prompt="x", max_tokens=9000)

    # The controller shifts the model to l4 at run time; the ingress follows without a redeploy.
    set_flavor_weights(TINY_APP, EMULATED_MODEL, {"a10g": 0.0, "l4": 1.0})
    try:

        def on_l4() -> bool:
            fp = c.completions.create(model=EMULATED_MODEL, prompt="y", max_tokens=1).system_fingerprint
            return fp == "rayscale-emulated:mistral-7b--l4"

        wait_for(on_l4, timeout_s=30, what="routing to the l4 flavor")
        fps = {
            c.completions.create(model=EMULATED_MODEL, prompt="z", max_tokens=1).system_fingerprint
            for _ in range(10)
        }
        assert fps == {"rayscale-emulated:mistral-7b--l4"}
    finally:
        set_flavor_weights(TINY_APP, EMULATED_MODEL, {"a10g": 1.0, "l4": 0.0})

    def exported() -> bool:
        s = scrape_engine_metrics()
        names = {x[0] for x in s if x[1].get("model") == EMULATED_MODEL and x[1].get("flavor") == "l4"}
        return {
            "ray_vllm_generation_tokens_total",
            "ray_vllm_prompt_tokens_total",
            "ray_vllm_time_to_first_token_seconds_count",
            "ray_vllm_request_prefill_time_seconds_count",  # TTFT without the queue, for corrections
            "ray_vllm_request_generation_tokens_count",  # per finished request: the output mean
            "ray_vllm_num_requests_running",
            "ray_vllm_kv_cache_usage_perc",
        } <= names

    wait_for(exported, timeout_s=60, interval_s=1.0, what="emulated engine metrics for flavor l4")
