"""The burst floor (rayscale.core.burst), the drain rate it is counted in (estimate.drain_rps), and how the
planner holds replicas for it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayscale.config import load_catalog
from rayscale.core.burst import BURST_WINDOWS, burst_rate
from rayscale.core.estimate import EstimateSettings, drain_rps, estimate
from rayscale.core.plan import plan
from rayscale.core.signals import Freshness, ModelSignals, RequestMix

BIN = 5.0
HOUR = int(3600 / BIN)


def _poisson(rate: float, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).poisson(rate * BIN, HOUR).astype(float)


def _reference(counts: np.ndarray, bin_s: float, ttft_s: float, q: float) -> float:
    """burst_rate spelled out one window length and one window at a time."""
    best = 0.0
    for k in BURST_WINDOWS:
        if k > len(counts):
            break
        pairs = sorted((counts[j - k + 1:j + 1].sum() / (k * bin_s), counts[j]) for j in range(k - 1, len(counts)))
        total = sum(wt for _, wt in pairs)
        if total <= 0:
            continue
        acc, i = 0.0, 0
        while acc + pairs[i][1] < q * total - 1e-9:  # the smallest rate with q of the weight at or below it
            acc += pairs[i][1]
            i += 1
        best = max(best, pairs[i][0] * k * bin_s / (k * bin_s + ttft_s))
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=60), st.sampled_from([0.5, 0.9, 0.99, 1.0]))
def test_matches_the_definition_window_by_window(counts: list[int], q: float) -> None:
    c = np.asarray(counts, dtype=float)
    assert burst_rate(c, BIN, 2.0, q) == pytest.approx(_reference(c, BIN, 2.0, q), rel=1e-9, abs=1e-12)


def test_the_quantile_counts_requests_not_windows() -> None:
    # One bin of 98 requests and two of one: the 50% request sees the busy bin's rate, the median window not.
    c = np.array([1.0, 98.0, 1.0])
    assert burst_rate(c, 1.0, 0.0, 0.5, windows=(1,)) == 98.0


def test_poisson_load_needs_about_its_mean() -> None:
    # Queueing within Poisson load is the replica capacity model's business: the floor adds little to it.
    # A few standard deviations of a bin's count above the mean, less the drain the TTFT target allows.
    for rate in (2.0, 12.0, 100.0):
        assert 0.9 * rate <= burst_rate(_poisson(rate), BIN, 2.0, 0.99) <= (1 + 3 / np.sqrt(rate * BIN)) * rate


def test_a_burst_with_more_than_the_miss_budget_sets_the_floor() -> None:
    base = np.full(HOUR, 5.0 * BIN)
    big = base.copy()
    big[100:102] = 100.0 * BIN  # 10 s at 100 req/s: 1,000 of ~19,000 requests, above 1%
    f = burst_rate(big, BIN, 2.0, 0.99)
    assert f == pytest.approx(100.0 * 10 / 12, rel=0.02)  # the 10-s window, drained within the 2 s target
    # A looser TTFT target drains the same burst with less.
    assert burst_rate(big, BIN, 6.0, 0.99) < f
    # The same burst in an hour twelve times busier holds under 1% of its requests: it may queue, and it
    # moves the floor only through the requests that arrive behind it.
    busy = np.full(HOUR, 60.0 * BIN)
    with_burst = busy.copy()
    with_burst[100:102] = 100.0 * BIN
    assert burst_rate(with_burst, BIN, 2.0, 0.99) < min(1.15 * burst_rate(busy, BIN, 2.0, 0.99), 0.8 * f)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=200), st.floats(0.5, 10))
def test_floor_scales_with_the_load_and_never_exceeds_the_busiest_bin(counts: list[int], k: float) -> None:
    c = np.asarray(counts, dtype=float)
    f = burst_rate(c, BIN, 2.0, 0.99)
    assert f <= c.max() / BIN + 1e-9
    assert burst_rate(c * k, BIN, 2.0, 0.99) == pytest.approx(k * f, rel=1e-9, abs=1e-12)


def test_bad_arguments_are_named() -> None:
    assert burst_rate([], BIN, 2.0, 0.99) == 0.0
    with pytest.raises(ValueError, match="bin_s"):
        burst_rate([1.0], 0.0, 2.0, 0.99)
    with pytest.raises(ValueError, match="attainment"):
        burst_rate([1.0], BIN, 2.0, 1.5)


def test_a_replica_drains_a_queue_faster_than_its_capacity_at_the_slo() -> None:
    # The capacity at the SLO keeps latency margin; a queue drains at the engine's full rate.
    cat = load_catalog()
    mixes = [RequestMix(2048, 28, 7300), RequestMix(1571, 149, 5200), RequestMix(300, 600, 900)]
    seen = 0
    for mix in mixes:
        for name, d in estimate(cat, {m: ModelSignals(m, Freshness.FRESH, 0.0, 1.0, mix) for m in cat.models},
                                settings=EstimateSettings(target_utilization=1.0)).items():
            for f, c in d.capacity.items():
                if c.feasible:
                    seen += 1
                    # Equal where the KV cache bounds both (long answers): the batch at capacity is already full.
                    assert drain_rps(cat.profile(name, f), mix, c.batch) >= 0.98 * c.rps, (name, f, mix)
    assert seen > 20


def test_a_smaller_chunk_or_a_full_kv_cache_drains_slower() -> None:
    p = load_catalog().profile("mistral-7b", "l40s")
    mix = RequestMix(2048, 28, 7300)
    assert drain_rps(p.model_copy(update={"max_num_batched_tokens": 512}), mix, 4.0) < drain_rps(p, mix, 4.0)
    tiny_kv = p.model_copy(update={"kv_tokens": 3 * (2048 + 28)})  # three sequences fit
    assert drain_rps(tiny_kv, mix, 2.0) < drain_rps(p, mix, 2.0)


def test_the_planner_holds_replicas_that_drain_the_bursts() -> None:
    cat = load_catalog().subset(["mistral-7b"])
    mix = RequestMix(2048, 28, 7300)
    counts = np.full(HOUR, 5.0 * BIN)
    counts[100:102] = 100.0 * BIN
    sig = ModelSignals("mistral-7b", Freshness.FRESH, 0.0, 5.0, mix, arrival_counts=tuple(counts), arrival_bin_s=BIN)
    plain = estimate(cat, {"mistral-7b": sig})["mistral-7b"]
    assert plain.burst_rps == 0.0  # off unless asked for
    d = estimate(cat, {"mistral-7b": sig}, settings=EstimateSettings(burst_floor=True))["mistral-7b"]
    assert d.burst_rps == pytest.approx(burst_rate(counts, BIN, 2.0, 0.99))
    p0, _ = plan(cat, {"mistral-7b": plain})
    p1, _ = plan(cat, {"mistral-7b": d})
    drained = sum(e.replicas * drain_rps(cat.profile("mistral-7b", e.flavor), mix, d.capacity[e.flavor].batch)
                  for e in p1.entries)
    assert drained >= d.burst_rps - 1e-6
    assert p1.usd_per_h > p0.usd_per_h
    assert all("burst floor" in e.reason for e in p1.entries if e.replicas)
    assert not p1.shortfalls
