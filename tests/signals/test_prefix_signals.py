"""The controller's prefix-cache hit rate from vLLM's counters as Ray exports them: differenced over the window,
summed over replicas, and absent (never 0 or guessed) when a counter is missing or nothing was looked up."""

from __future__ import annotations

from collections.abc import Mapping

from rayscale.signals.window import Scrape, aggregate, parse_prometheus

MODEL = "mistral-7b"


def exposition(replicas: Mapping[str, tuple[float, float | None]], started: float) -> str:
    """Ray's Prometheus text for the engines of MODEL: per replica (queries, hits), hits None = not exported."""
    lines = ["# HELP ray_vllm_prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
             "# TYPE ray_vllm_prefix_cache_queries_total counter"]
    for rep, (q, _) in replicas.items():
        lines.append(f'ray_vllm_prefix_cache_queries_total{{ReplicaId="{rep}",flavor="a10g",model="{MODEL}",'
                     f'model_name="{MODEL}"}} {q}')
    lines += ["# HELP ray_vllm_prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
              "# TYPE ray_vllm_prefix_cache_hits_total counter"]
    for rep, (_, h) in replicas.items():
        if h is not None:
            lines.append(f'ray_vllm_prefix_cache_hits_total{{ReplicaId="{rep}",flavor="a10g",model="{MODEL}",'
                         f'model_name="{MODEL}"}} {h}')
    lines += ["# TYPE ray_vllm_time_to_first_token_seconds histogram",
              f'ray_vllm_time_to_first_token_seconds_count{{ReplicaId="r1",flavor="a10g",model="{MODEL}"}} {started}',
              f'ray_vllm_time_to_first_token_seconds_sum{{ReplicaId="r1",flavor="a10g",model="{MODEL}"}} 1.0']
    return "\n".join(lines) + "\n"


Counters = Mapping[str, tuple[float, float | None]]


def rate(before: Counters, after: Counters) -> float | None:
    scrapes = [Scrape(0.0, parse_prometheus(exposition(before, 10))), Scrape(30.0, parse_prometheus(exposition(after, 40)))]
    return aggregate(scrapes, now=30.0, window_s=60.0)[MODEL].prefix_hit_rate


def test_hit_rate_is_the_windows_hits_over_queries_over_replicas() -> None:
    # Replica r1 looked up 10,000 tokens in the window and found 6,000; r2 10,000 and found 2,000.
    before = {"r1": (50_000.0, 1_000.0), "r2": (20_000.0, 0.0)}
    after = {"r1": (60_000.0, 7_000.0), "r2": (30_000.0, 2_000.0)}
    assert rate(before, after) == 0.4


def test_a_restarted_counter_counts_from_zero() -> None:
    assert rate({"r1": (50_000.0, 40_000.0)}, {"r1": (8_000.0, 2_000.0)}) == 0.25


def test_missing_or_idle_counters_are_not_a_hit_rate() -> None:
    assert rate({"r1": (1_000.0, None)}, {"r1": (9_000.0, None)}) is None  # hits not exported
    assert rate({"r1": (1_000.0, 500.0)}, {"r1": (1_000.0, 500.0)}) is None  # nothing looked up
    # An engine without the counters at all (prefix caching off): no field, no discount.
    scrapes = [Scrape(0.0, parse_prometheus(exposition({}, 10))), Scrape(30.0, parse_prometheus(exposition({}, 40)))]
    assert aggregate(scrapes, now=30.0, window_s=60.0)[MODEL].prefix_hit_rate is None


def test_each_flavor_has_its_own_hit_rate() -> None:
    # r1 on a10g found 6,000 of 10,000 tokens, r2 on l4 2,000 of 10,000: the model's rate blends them.
    def on_flavors(counters: Counters, started: float) -> str:
        return exposition(counters, started).replace('ReplicaId="r2",flavor="a10g"', 'ReplicaId="r2",flavor="l4"')
    before = {"r1": (50_000.0, 1_000.0), "r2": (20_000.0, 0.0)}
    after = {"r1": (60_000.0, 7_000.0), "r2": (30_000.0, 2_000.0)}
    scrapes = [Scrape(0.0, parse_prometheus(on_flavors(before, 10))), Scrape(30.0, parse_prometheus(on_flavors(after, 40)))]
    sig = aggregate(scrapes, now=30.0, window_s=60.0)[MODEL]
    assert sig.prefix_hit_rate == 0.4
    assert sig.per_flavor["a10g"].prefix_hit_rate == 0.6
    assert sig.per_flavor["l4"].prefix_hit_rate == 0.2
