"""The burst floor (rayscale.core.burst), the drain rate it is counted in (estimate.drain_rps), and how the
planner holds replicas for it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayscale.config import load_catalog
from rayscale.core.burst import BURST_BUDGET_SHARE, burst_rate, missed_share
from rayscale.core.catalog import Catalog, RequestMixSpec
from rayscale.core.estimate import Demand, EstimateSettings, drain_rps, estimate, tpot_at
from rayscale.core.plan import plan
from rayscale.core.signals import Freshness, ModelSignals, RequestMix

BIN = 5.0
HOUR = int(3600 / BIN)


def _poisson(rate: float, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).poisson(rate * BIN, HOUR).astype(float)


def _fifo_missed(counts: np.ndarray, bin_s: float, ttft_s: float, drain: float) -> float:
    """missed_share request by request: arrivals evenly spaced within each bin, one FIFO server that
    starts a request every 1/drain seconds."""
    arrivals = [i * bin_s + (j + 0.5) * bin_s / c for i, c in enumerate(counts.astype(int)) for j in range(c)]
    missed, free = 0, -np.inf
    for a in arrivals:
        start = max(a, free)
        missed += start - a > ttft_s + 1e-9
        free = start + 1.0 / drain
    return missed / max(len(arrivals), 1)


def test_missed_share_matches_a_request_by_request_fifo_queue() -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        counts = rng.poisson(rng.uniform(5, 30) * BIN, 60).astype(float)
        counts[rng.integers(0, 60, 3)] += rng.integers(100, 600, 3)  # a few bursts
        drain = rng.uniform(0.8, 2.0) * counts.sum() / (60 * BIN)
        ttft = float(rng.choice([0.5, 2.0, 4.0]))
        assert missed_share(counts, BIN, ttft, drain) == pytest.approx(_fifo_missed(counts, BIN, ttft, drain),
                                                                        abs=0.01)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=80), st.floats(0.1, 20), st.floats(1.05, 3))
def test_more_drain_misses_fewer(counts: list[int], drain: float, k: float) -> None:
    c = np.asarray(counts, dtype=float)
    assert missed_share(c, BIN, 2.0, k * drain) <= missed_share(c, BIN, 2.0, drain) + 1e-12


def test_poisson_load_needs_about_its_mean() -> None:
    # Queueing within Poisson load is the replica capacity model's business: the floor adds little to it.
    for rate in (2.0, 12.0, 100.0):
        assert 0.9 * rate <= burst_rate(_poisson(rate), BIN, 2.0, 0.99) <= (1 + 3 / np.sqrt(rate * BIN)) * rate


def test_the_floor_is_the_least_drain_within_the_budget() -> None:
    counts = _poisson(8.0)
    counts[[50, 51, 300, 500, 501, 502]] += [400, 300, 700, 200, 500, 300]
    for att in (0.9, 0.99, 0.999):
        f = burst_rate(counts, BIN, 2.0, att)
        assert missed_share(counts, BIN, 2.0, f) <= 1 - att + 1e-9 < missed_share(counts, BIN, 2.0, 0.99 * f)


def test_a_burst_with_more_than_the_miss_budget_sets_the_floor() -> None:
    base = np.full(HOUR, 5.0 * BIN)
    big = base.copy()
    big[100:102] = 100.0 * BIN  # 10 s at 100 req/s: 1,000 of ~19,000 requests, above 1%
    f = burst_rate(big, BIN, 2.0, 0.99)
    # Draining C req/s, the burst's requests arriving after 2C / (100 - C) s wait over 2 s: 1% of them, 190,
    # arrive in the last 1.9 s at C = 80, less the few base-rate requests that queue behind the burst.
    assert 78 <= f <= 82
    assert burst_rate(big, BIN, 6.0, 0.99) < f  # a looser TTFT target drains the same burst with less
    # A budget of 10% (1,900 requests) lets the burst queue: the floor only has to clear the backlog before
    # the requests arriving behind it have missed too (at 10 req/s, 900 queued clear in 3 min).
    assert 5.0 < burst_rate(big, BIN, 2.0, 0.9) < 12.0
    # The same burst in an hour twelve times busier holds under 1% of its requests, but the queue it leaves
    # drains with only the spare over 60 req/s, and the requests behind it wait: it still raises the floor,
    # by less than it does over a quiet hour.
    busy = np.full(HOUR, 60.0 * BIN)
    with_burst = busy.copy()
    with_burst[100:102] = 100.0 * BIN
    assert burst_rate(busy, BIN, 2.0, 0.99) == pytest.approx(60.0, rel=1e-3)
    assert 61.0 < burst_rate(with_burst, BIN, 2.0, 0.99) < f


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=200), st.floats(0.5, 10))
def test_floor_scales_with_the_load_and_never_exceeds_the_busiest_bin(counts: list[int], k: float) -> None:
    c = np.asarray(counts, dtype=float)
    f = burst_rate(c, BIN, 2.0, 0.99)
    assert f <= c.max() / BIN + 1e-9
    assert burst_rate(c * k, BIN, 2.0, 0.99) == pytest.approx(k * f, rel=3e-4, abs=1e-12)


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
                    # d.mix: the mix cut at the model's max_model_len, which the capacity is for.
                    tpot = cat.models[name].slo.tpot_p95_s
                    assert drain_rps(cat.profile(name, f), d.mix, c.batch, tpot) >= 0.98 * c.rps, (name, f, d.mix)
    assert seen > 20


def test_a_smaller_chunk_or_a_full_kv_cache_drains_slower() -> None:
    p = load_catalog().profile("mistral-7b", "l40s")
    mix = RequestMix(2048, 28, 7300)
    assert drain_rps(p.model_copy(update={"max_num_batched_tokens": 512}), mix, 4.0, 1.0) < drain_rps(p, mix, 4.0, 1.0)
    tiny_kv = p.model_copy(update={"kv_tokens": 3 * (2048 + 28)})  # three sequences fit
    assert drain_rps(tiny_kv, mix, 2.0, 1.0) < drain_rps(p, mix, 2.0, 1.0)


def test_a_burst_drains_at_a_batch_that_keeps_the_tpot_target() -> None:
    """Long prompts fill a batch whose decode misses TPOT: the drain rate is the one at the target's batch."""
    p = load_catalog().profile("mistral-7b", "l40s")
    mix = RequestMix(2048, 28, 7300)
    loose, tight = drain_rps(p, mix, 2.0, 10.0), drain_rps(p, mix, 2.0, 0.1)
    assert tight < 0.9 * loose
    # The batch behind ``tight``: requests/s x output tokens x TPOT; its TPOT meets the target.
    batch = tight * mix.output_mean * 0.1
    assert tpot_at(p, batch, mix) <= 0.1 + 1e-9
    assert tpot_at(p, 1.05 * batch, mix) > 0.1


def test_the_planner_holds_replicas_that_drain_the_bursts() -> None:
    cat = load_catalog().subset(["mistral-7b"])
    mix = RequestMix(2048, 28, 7300)
    counts = np.full(HOUR, 5.0 * BIN)
    counts[100:102] = 100.0 * BIN
    sig = ModelSignals("mistral-7b", Freshness.FRESH, 0.0, 5.0, mix, arrival_counts=tuple(counts), arrival_bin_s=BIN)
    plain = estimate(cat, {"mistral-7b": sig})["mistral-7b"]
    assert plain.burst_rps == 0.0  # off unless asked for
    d = estimate(cat, {"mistral-7b": sig}, settings=EstimateSettings(burst_floor=True))["mistral-7b"]
    assert d.burst_rps == pytest.approx(burst_rate(counts, BIN, 2.0, 1 - BURST_BUDGET_SHARE * 0.01))
    p0, _ = plan(cat, {"mistral-7b": plain})
    p1, _ = plan(cat, {"mistral-7b": d})
    drained = sum(e.replicas * drain_rps(cat.profile("mistral-7b", e.flavor), mix, d.capacity[e.flavor].batch,
                                    cat.models["mistral-7b"].slo.tpot_p95_s)
                  for e in p1.entries)
    assert drained >= d.burst_rps - 1e-6
    assert p1.usd_per_h > p0.usd_per_h
    assert all("burst floor" in e.reason for e in p1.entries if e.replicas)
    assert not p1.shortfalls


def test_a_declared_mix_keeps_the_floor_steady_while_the_minutes_mix_swings() -> None:
    # The floor covers an hour of bursts; the mix of the last minutes swings (Azure code x3: prompt mean
    # +-25%). Counted in the declared mix, the replicas it holds do not swing with it.
    counts = np.full(HOUR, 5.0 * BIN)
    counts[100:102] = 100.0 * BIN
    on = EstimateSettings(burst_floor=True)

    def replicas(cat: Catalog, prompt_mean: float) -> int:
        mix = RequestMix(prompt_mean, 28, 3.5 * prompt_mean)
        sig = ModelSignals("mistral-7b", Freshness.FRESH, 0.0, 5.0, mix, arrival_counts=tuple(counts),
                           arrival_bin_s=BIN)
        p, _ = plan(cat, estimate(cat, {"mistral-7b": sig}, settings=on))
        assert all("burst floor" in e.reason for e in p.entries if e.replicas)
        return sum(e.replicas for e in p.entries)

    cat = load_catalog().subset(["mistral-7b"])
    assert replicas(cat, 1500) < replicas(cat, 2600)  # undeclared: the observed mix it is
    declared = cat.with_request_mix("mistral-7b", RequestMixSpec(prompt_mean=2048, output_mean=28, prompt_p95=7300))
    assert replicas(declared, 1500) == replicas(declared, 2600)


def test_sharpness_tells_bursts_within_the_minute_from_a_level_that_moves() -> None:
    from rayscale.core.burst import sharpness

    rng = np.random.default_rng(0)
    # A ramp from 2 to 20 req/s over the hour, in 5-s bins: the load moves as a level.
    ramp = rng.poisson(np.linspace(2, 20, 720) * 5.0)
    level = sharpness(ramp, 5.0, burst_rate(ramp, 5.0, 2.0, 0.995))
    # 2 req/s with a 10-s spike of 60 req/s every 5 min: gone within the minute.
    spiky = rng.poisson(np.full(720, 10.0))
    spiky[::60] += rng.poisson(300.0, 12)
    sharp = sharpness(spiky, 5.0, burst_rate(spiky, 5.0, 2.0, 0.995))
    assert 0.8 < level < 1.2 and sharp > 2.0
    assert sharpness([], 5.0, 3.0) == 0.0 and sharpness(ramp, 5.0, 0.0) == 0.0


def test_sharpness_reads_a_minute_long_burst_as_a_level_wherever_it_starts() -> None:
    from rayscale.core.burst import sharpness

    # 1 req/s with 8 req/s for 60 s every 7 min, in 5-s bins, the bursts starting half-way into a minute:
    # a minute counted from the clock would hold half of each burst.
    counts = np.full(720, 5.0)
    for start in range(6, 720 - 12, 84):
        counts[start:start + 12] = 40.0
    got = sharpness(counts, 5.0, burst_rate(counts, 5.0, 2.0, 0.995))
    assert 0.9 < got < 1.2


def test_a_reading_within_a_burst_orders_no_more_than_the_hours_busiest_minute() -> None:
    # 5 req/s with a 30-s burst of 12 every 10 min, the last one under way: the 30-s reading says 12, any
    # minute of the hour at most 8.5. A level that has lasted a minute shows in the busiest minute.
    cat = load_catalog().subset(["mistral-7b"])
    mix = RequestMix(1000, 200, 2000)
    bursts = np.full(HOUR, 5.0 * BIN)
    for end in range(HOUR, 0, -120):
        bursts[end - 6:end] = 12.0 * BIN
    level = np.full(HOUR, 5.0 * BIN)
    level[-12:] = 12.0 * BIN
    capped = EstimateSettings(burst_floor=True, current_within_busiest_minute=True)

    def demand(counts: np.ndarray, settings: EstimateSettings) -> Demand:
        sig = ModelSignals("mistral-7b", Freshness.FRESH, 0.0, 12.0, mix, arrival_counts=tuple(counts),
                           arrival_bin_s=BIN)
        return estimate(cat, {"mistral-7b": sig}, settings=settings)["mistral-7b"]

    assert demand(bursts, EstimateSettings(burst_floor=True)).rps == pytest.approx(12.0)
    d = demand(bursts, capped)
    assert d.rps == pytest.approx(max(8.5, d.burst_rps)) and d.rps < 12.0
    assert "within the hour's busiest minute" in d.reason
    assert demand(level, capped).rps == pytest.approx(12.0)
