"""Windowed aggregation: counters differenced, resets handled, quantiles as Prometheus, missing != zero."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rayscale.core.signals import MIX_QUANTILES, Freshness
from rayscale.signals.window import (
    E2E,
    GEN,
    GEN_HIST,
    KV,
    PREFILL,
    PREFIXES,
    PROMPT,
    PROMPT_HIST,
    RUNNING,
    TTFT,
    WAITING,
    Scrape,
    aggregate,
    exposition_of,
    histogram_quantile,
    labels,
    mix_only,
    parse_prometheus,
)


def _rep(model: str, flavor: str, rep: str, t: float, started: float, done: float, waiting: float,
         ttft_buckets: dict[float, float]) -> dict:
    lb = labels(model=model, flavor=flavor, ReplicaId=rep)
    s = {
        (TTFT + "_count", lb): started, (E2E + "_count", lb): done,
        (PROMPT, lb): started * 500, (GEN, lb): done * 100,
        (WAITING, lb): waiting, (RUNNING, lb): 4.0,
    }
    for le, c in ttft_buckets.items():
        s[(TTFT + "_bucket", tuple(sorted((*lb, ("le", str(le))))))] = c
    return s


def test_rates_mix_and_quantiles_over_the_window() -> None:
    a0 = _rep("m", "a10g", "r1", 0, 100, 90, 0, {0.1: 50, 1.0: 100, float("inf"): 100})
    a1 = _rep("m", "a10g", "r1", 10, 150, 140, 5, {0.1: 50, 1.0: 150, float("inf"): 150})
    sig = aggregate([Scrape(0.0, a0), Scrape(10.0, a1)], now=10.0)["m"]
    assert sig.freshness == Freshness.FRESH
    assert sig.arrival_rate_rps == pytest.approx((50 + 5) / 10)
    assert sig.mix is not None and sig.mix.prompt_mean == pytest.approx(500) and sig.mix.output_mean == 100
    assert sig.waiting == 5 and sig.running == 4
    # All 50 new first tokens fell in (0.1, 1.0]: p95 interpolates inside that bucket.
    assert sig.ttft_p95_s == pytest.approx(0.1 + 0.9 * 0.95)
    assert sig.per_flavor["a10g"].replicas == 1


def test_prefill_time_is_the_windows_exact_mean_and_absent_when_not_reported() -> None:
    def rep(t: float, n: float, total_s: float) -> dict:
        s = _rep("m", "a10g", "r1", t, n, n, 0, {})
        lb = labels(model="m", flavor="a10g", ReplicaId="r1")
        s[(PREFILL + "_count", lb)], s[(PREFILL + "_sum", lb)] = n, total_s
        return s

    # 40 requests in the window spent 2.0 s prefilling: 50 ms each (all below the first 0.3 s bucket).
    sig = aggregate([Scrape(0.0, rep(0, 100, 10.0)), Scrape(10.0, rep(10, 140, 12.0))], now=10.0)["m"]
    assert sig.per_flavor["a10g"].prefill_mean_s == pytest.approx(0.05)
    plain = [Scrape(0.0, _rep("m", "a10g", "r1", 0, 1, 1, 0, {})), Scrape(10.0, _rep("m", "a10g", "r1", 10, 5, 5, 0, {}))]
    assert aggregate(plain, now=10.0)["m"].per_flavor["a10g"].prefill_mean_s is None


def test_output_mean_counts_finished_requests_only_when_the_engine_reports_them() -> None:
    """In a ramp the generation counter includes tokens of requests still running: 40 finished requests
    of 32 tokens, while running ones produced 600 more, is a 32-token mix, not 47."""
    def rep(t: float, done: float) -> dict:
        s = _rep("m", "a10g", "r1", t, done, done, 0, {})
        lb = labels(model="m", flavor="a10g", ReplicaId="r1")
        s[(GEN, lb)] = done * 32 + (600 if t else 0)
        s[(GEN_HIST + "_count", lb)], s[(GEN_HIST + "_sum", lb)] = done, done * 32
        return s

    sig = aggregate([Scrape(0.0, rep(0, 10)), Scrape(10.0, rep(10, 50))], now=10.0)["m"]
    assert sig.mix is not None and sig.mix.output_mean == pytest.approx(32.0)


def _two_replicas(t: float, gauge: str, r1: float, r2: float) -> Scrape:
    """A scrape of two a10g replicas of model m whose ``gauge`` reads r1 and r2."""
    a = _rep("m", "a10g", "r1", t, t, t, 0, {})
    b = _rep("m", "a10g", "r2", t, t, t, 0, {})
    a[(gauge, labels(model="m", flavor="a10g", ReplicaId="r1"))] = r1
    b[(gauge, labels(model="m", flavor="a10g", ReplicaId="r2"))] = r2
    return Scrape(t, {**a, **b})


def test_busiest_replica_batch_is_its_mean_over_the_window() -> None:
    sig = aggregate([_two_replicas(0, RUNNING, 30, 0), _two_replicas(5, RUNNING, 40, 0),
                     _two_replicas(10, RUNNING, 20, 2)], now=10.0)["m"]
    obs = sig.per_flavor["a10g"]
    assert obs.running_max_replica == pytest.approx(30.0)  # r1's mean over the three scrapes
    assert obs.running_per_replica == pytest.approx(11.0)  # the last scrape, spread over both


def test_a_flavors_kv_usage_is_its_replicas_mean_at_the_last_scrape() -> None:
    """Read with running_per_replica (the last scrape, spread over the replicas) it gives the KV tokens a
    running sequence holds (rayscale.core.estimate's Correction.kv)."""
    sig = aggregate([_two_replicas(0, KV, 0.1, 0.1), _two_replicas(10, KV, 0.9, 0.5)], now=10.0)["m"]
    assert sig.per_flavor["a10g"].kv_usage == pytest.approx(0.7)
    assert sig.kv_usage == pytest.approx(0.9)  # the model's: its fullest replica
    plain = [Scrape(0.0, _rep("m", "a10g", "r1", 0, 1, 1, 0, {})), Scrape(10.0, _rep("m", "a10g", "r1", 10, 5, 5, 0, {}))]
    assert aggregate(plain, now=10.0)["m"].per_flavor["a10g"].kv_usage is None


def test_counter_reset_counts_from_zero() -> None:
    a0 = _rep("m", "a10g", "r1", 0, 1000, 1000, 0, {})
    a1 = _rep("m", "a10g", "r1", 10, 20, 20, 0, {})  # replica restarted
    sig = aggregate([Scrape(0.0, a0), Scrape(10.0, a1)], now=10.0)["m"]
    assert sig.arrival_rate_rps == pytest.approx(2.0)


def test_idle_is_zero_but_missing_and_stale_are_not() -> None:
    a = _rep("m", "a10g", "r1", 0, 100, 100, 0, {})
    idle = aggregate([Scrape(0.0, a), Scrape(10.0, a)], now=10.0, models=["m", "other"])
    assert idle["m"].freshness == Freshness.FRESH and idle["m"].arrival_rate_rps == 0.0
    assert idle["other"].freshness == Freshness.MISSING and idle["other"].arrival_rate_rps is None
    # The source went down: failed scrapes carry no series; the model turns stale, never zero.
    later = aggregate([Scrape(0.0, a), Scrape(10.0, a), Scrape(20.0, {}, ok=False), Scrape(40.0, {}, ok=False)],
                      now=40.0, stale_after_s=20.0)
    assert later["m"].freshness == Freshness.STALE and later["m"].arrival_rate_rps is None
    assert later["m"].age_s == pytest.approx(30.0)


def test_fast_window_sees_a_step_early_but_a_drop_takes_the_whole_window() -> None:
    # 0.5 req/s for 30 s, then 3 req/s: one scrape a second.
    def at(t: int) -> Scrape:
        n = 0.5 * min(t, 30) + 3.0 * max(0, t - 30)
        return Scrape(float(t), _rep("m", "a10g", "r1", t, n, n, 0, {}))

    step = [at(t) for t in range(0, 35)]
    slow = aggregate(step, now=34.0, window_s=30.0)["m"].arrival_rate_rps
    fast = aggregate(step, now=34.0, window_s=30.0, fast_window_s=4.0)["m"].arrival_rate_rps
    assert slow == pytest.approx((0.5 * 26 + 3 * 4) / 30)  # the step is diluted in the long window
    assert fast == pytest.approx(3.0)  # the last 4 s are all step
    # After a drop the long window still holds the load: the larger rate wins (slow down).
    def drop(t: int) -> Scrape:
        n = 3.0 * min(t, 30) + 0.5 * max(0, t - 30)
        return Scrape(float(t), _rep("m", "a10g", "r1", t, n, n, 0, {}))

    fell = [drop(t) for t in range(0, 35)]
    assert aggregate(fell, now=34.0, window_s=30.0, fast_window_s=4.0)["m"].arrival_rate_rps == pytest.approx(
        aggregate(fell, now=34.0, window_s=30.0)["m"].arrival_rate_rps)


def test_histogram_quantile_edges() -> None:
    assert histogram_quantile(0.95, {}) is None
    assert histogram_quantile(0.5, {1.0: 0.0, float("inf"): 0.0}) is None
    assert histogram_quantile(0.5, {1.0: 10, 2.0: 20, float("inf"): 20}) == pytest.approx(1.0)
    assert histogram_quantile(0.99, {1.0: 10, float("inf"): 20}) == 1.0


def test_parse_prometheus_text() -> None:
    text = (
        "# TYPE ray_vllm_num_requests_running gauge\n"
        'ray_vllm_num_requests_running{model="m",flavor="cpu",ReplicaId="x"} 3.0\n'
        "# TYPE ray_other gauge\nray_other 1.0\n"
    )
    s = parse_prometheus(text)
    assert s == {("ray_vllm_num_requests_running", (("ReplicaId", "x"), ("flavor", "cpu"), ("model", "m"))): 3.0}


def test_parse_reads_only_the_kept_families_and_keeps_what_a_full_parse_keeps() -> None:
    """exposition_of passes a kept family's HELP, TYPE and samples (a histogram's too) and nothing else; the
    parse of what it passes equals the full parse filtered by name, escapes and odd spacing included."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (
        "# HELP ray_grpc_server_req_total Ray's own: \\n not a line break\n"
        "# TYPE ray_grpc_server_req_total counter\n"
        'ray_grpc_server_req_total{Method="ray_vllm_fake"} 7.0\n'
        "# HELP ray_vllm_e2e_request_latency_seconds End to end,\\n escaped\n"
        "# TYPE ray_vllm_e2e_request_latency_seconds histogram\n"
        'ray_vllm_e2e_request_latency_seconds_bucket{le="1.0",model="m"} 2.0\n'
        'ray_vllm_e2e_request_latency_seconds_bucket{le="+Inf",model="m"} 3.0\n'
        'ray_vllm_e2e_request_latency_seconds_sum{model="m"} 4.5\n'
        'ray_vllm_e2e_request_latency_seconds_count{model="m"} 3.0\n'
        "# a comment\n"
        '  ray_rayscale_ingress_in_flight{model="m",note="# TYPE ray_x gauge"} 2.0\n'
        "# TYPE ray_vll gauge\nray_vll 1.0\n"
        "\n"
    )
    kept = exposition_of(text, PREFIXES)
    assert "ray_grpc" not in kept and "ray_vll " not in kept and "a comment" not in kept
    lines = kept.splitlines()
    assert [x.split()[1] for x in lines if x.startswith("#")] == ["HELP", "TYPE"] and len(lines) == 7
    full = {(s.name, tuple(sorted(s.labels.items()))): float(s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples if s.name.startswith(PREFIXES)}
    assert parse_prometheus(text) == full
    assert len(full) == 5
    assert exposition_of("# TYPE ray_other gauge\nray_other 1\n", PREFIXES) == ""


def test_length_quantiles_come_from_the_token_histograms_of_the_window() -> None:
    """The estimator's tail terms read the mix's lengths at MIX_QUANTILES: vLLM's prompt and generation
    token histograms, differenced over the window like every histogram, and none without them. The longest
    prompt is the highest bucket's bound that gained any, unknown when one went past the last bound."""
    def rep(t: float, n: float, past: float = 0.0) -> dict:
        s = _rep("m", "a10g", "r1", t, n, n, 0, {})
        lb = labels(model="m", flavor="a10g", ReplicaId="r1")
        # In the window: 40 prompts, half of 100-1,000 tokens and half of 1,000-10,000; 40 answers of 1-10.
        grow = (n - 100) / 40
        for name, edges in ((PROMPT_HIST, {1000.0: 20, 10000.0: 40, float("inf"): 40 + past}),
                            (GEN_HIST, {10.0: 40, float("inf"): 40})):
            for le, c in edges.items():
                s[(name + "_bucket", tuple(sorted((*lb, ("le", str(le))))))] = 100 + c * grow
            s[(name + "_count", lb)], s[(name + "_sum", lb)] = n, n * 10
        s[(GEN_HIST + "_sum", lb)] = n * 5
        return s

    sig = aggregate([Scrape(0.0, rep(0, 100)), Scrape(10.0, rep(10, 140))], now=10.0)["m"]
    assert sig.mix is not None and sig.mix.prompt_quantiles is not None and sig.mix.output_quantiles is not None
    # Prometheus' interpolation inside the bucket: the median prompt is 1,000 tokens, the 99.5th ~9,955.
    half = MIX_QUANTILES.index(0.5)
    assert sig.mix.prompt_quantiles[half] == pytest.approx(1000.0)
    assert sig.mix.prompt_quantiles[-1] == pytest.approx(1000 + 9000 * (0.995 * 40 - 20) / 20)
    assert all(1.0 <= o <= 10.0 for o in sig.mix.output_quantiles)
    assert sig.mix.prompt_max == 10000.0
    beyond = aggregate([Scrape(0.0, rep(0, 100, 1)), Scrape(10.0, rep(10, 140, 2))], now=10.0)["m"].mix
    assert beyond is not None and beyond.prompt_max is None
    plain = [Scrape(0.0, _rep("m", "a10g", "r1", 0, 1, 1, 0, {})), Scrape(10.0, _rep("m", "a10g", "r1", 10, 5, 5, 0, {}))]
    mix = aggregate(plain, now=10.0)["m"].mix
    assert mix is not None and mix.prompt_quantiles is None and mix.output_quantiles is None and mix.prompt_max is None


def _steady(t: float, prompt_of: Callable[[int], int]) -> Scrape:
    """One replica finishing 2 requests a second since t=0; request i had ``prompt_of(i)`` prompt tokens
    and 10 output tokens."""
    lb = labels(model="m", flavor="a10g", ReplicaId="r1")
    n = int(2 * t)
    return Scrape(t, {
        (TTFT + "_count", lb): n, (E2E + "_count", lb): n, (GEN_HIST + "_count", lb): n,
        (GEN_HIST + "_sum", lb): 10 * n, (GEN, lb): 10 * n, (PROMPT, lb): sum(prompt_of(i) for i in range(n)),
        (WAITING, lb): 0.0, (RUNNING, lb): 3.0,
    })


def test_the_mix_reaches_back_to_enough_finished_requests_and_no_further() -> None:
    """30 s at 2 req/s is 60 requests, too few for the tail quantiles the estimator reads. The mix starts
    at the latest older scrape after which ``mix_min_requests`` finished, read from scrapes trimmed to the
    mix's series, and never further back than ``mix_max_s``."""
    def prompt(i: int) -> int:  # the first 400 requests (t < 200 s) had 1,000-token prompts, later ones 100
        return 1000 if i < 400 else 100

    scrapes = [_steady(t, prompt) for t in range(0, 301, 10)]
    old = [mix_only(s) for s in scrapes[:-9]]
    assert all(k[0] not in (WAITING, RUNNING) for s in old for k in s.series) and old[0].series
    kept = old + scrapes[-9:]
    narrow = aggregate(kept, now=300.0)["m"].mix
    assert narrow is not None and narrow.prompt_mean == pytest.approx(100)
    # 300 requests reach back to t=150: 100 long prompts and 200 short ones.
    wide = aggregate(kept, now=300.0, mix_min_requests=300)["m"]
    assert wide.mix is not None and wide.mix.prompt_mean == pytest.approx((100 * 1000 + 200 * 100) / 300)
    assert wide.mix.output_mean == pytest.approx(10)
    # The rate and everything else is still the window's.
    assert wide.arrival_rate_rps == pytest.approx(2.0) and wide.running == 3.0
    # Only 100 s back: the 200 short ones, fewer than asked for.
    capped = aggregate(kept, now=300.0, mix_min_requests=300, mix_max_s=100)["m"].mix
    assert capped is not None and capped.prompt_mean == pytest.approx(100)
    # Everything kept holds fewer than asked for: the mix starts at the earliest scrape.
    everything = aggregate(kept, now=300.0, mix_min_requests=10_000, mix_max_s=1e9)["m"].mix
    assert everything is not None and everything.prompt_mean == pytest.approx((400 * 1000 + 200 * 100) / 600)
