"""The real vLLM CPU engine's prefix-cache counters reach the controller's signals: the same prompt sent again is
found in the cache, and the scraped window's prefix hit rate says so."""

from __future__ import annotations

import time
from collections.abc import Callable

import openai
import pytest

from rayscale.signals.scrape import MetricsScraper
from rayscale.signals.window import PREFIX_HITS, PREFIX_QUERIES, Scrape, aggregate
from tests.conftest import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.vllm]

MODEL = "tiny-qwen2"


def _total(s: Scrape, name: str) -> float:
    return sum(v for (n, lb), v in s.series.items() if n == name and dict(lb).get("model") == MODEL)


def _twice(c: openai.OpenAI, prompt: str) -> None:
    for _ in range(2):
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True})


def test_repeated_prompt_reads_as_prefix_hits(tiny_vllm_app: str) -> None:
    c = openai.OpenAI(base_url=tiny_vllm_app, api_key="unused", max_retries=0, timeout=120)
    scraper = MetricsScraper()

    def grown(than: Scrape) -> Callable[[], Scrape | None]:
        def check() -> Scrape | None:
            s = scraper.scrape(time.time())
            more = _total(s, PREFIX_HITS) > _total(than, PREFIX_HITS)
            return s if s.ok and more and _total(s, PREFIX_QUERIES) > _total(than, PREFIX_QUERIES) else None
        return check

    try:
        # Ray exports a counter from its first increment and vLLM adds no zero hits: a first repeated prompt
        # makes both series exist, so that the window below differences them (a first sight counts from 0).
        empty = Scrape(0.0, {})
        _twice(c, "a warm-up prompt that is long enough to fill a few of vLLM's cache blocks " * 10)
        before = wait_for(grown(empty), timeout_s=60, interval_s=1.0, what="vLLM prefix cache counters exported")
        # A prompt of a few hundred tokens, several of vLLM's blocks; the second time its full blocks are cached.
        _twice(c, "the quick brown fox jumps over the lazy dog " * 40)
        after = wait_for(grown(before), timeout_s=60, interval_s=1.0, what="vLLM prefix cache hits counted")
    finally:
        scraper.close()
    sig = aggregate([before, after], now=after.t, window_s=after.t - before.t + 1.0, models=[MODEL])[MODEL]
    # Of two equal prompts the second finds all but its last block cached: close to half of all tokens.
    assert sig.prefix_hit_rate is not None
    assert 0.2 < sig.prefix_hit_rate < 0.5
    # The counters carry the replica's flavor: the one flavor serving has the model's rate.
    assert [o.prefix_hit_rate for o in sig.per_flavor.values()] == [sig.prefix_hit_rate]
