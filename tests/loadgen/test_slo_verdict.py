"""The demo's client-side SLO verdict: attainment from the load generator's own measurements, the burst's
start-up window excused and nothing else, failures counted as misses."""

from __future__ import annotations

import math

from rayscale.autoscale_demo import burst_start_s, local_stand_in_catalog, slo_verdict
from rayscale.loadgen import RequestResult, slo_attainment


def _res(i: int, at: float, ttft: float | None, tpot: float | None = 0.05, error: str | None = None) -> RequestResult:
    return RequestResult(i, at, at, 100, 32, 32 if error is None else 0, ttft, tpot, None, 200, error)


def test_attainment_counts_both_targets_and_failures_miss() -> None:
    rs = [_res(0, 0, 0.1), _res(1, 1, 3.0), _res(2, 2, 0.1, tpot=0.2), _res(3, 3, None, None, "timeout: x"),
          _res(4, 4, 0.2, tpot=None)]  # a one-token answer has no TPOT: TTFT decides
    a = slo_attainment(rs, 2.0, 0.1)
    assert (a.requests, a.met) == (5, 2) and a.share == 0.4
    assert a.ttft_p95_s == math.inf  # the failed request's TTFT counts as never
    assert not a.p95s_within(2.0, 0.1)
    ok = slo_attainment(rs, 2.0, 0.1, keep=lambda r: r.index in (0, 4))
    assert ok.p95s_within(2.0, 0.1) and ok.share == 1.0


def test_the_start_up_window_after_the_burst_is_excused_and_nothing_else() -> None:
    cat = local_stand_in_catalog()
    # 0.5 req/s for 30 s (one replica serves ~1), then 4 req/s: the burst starts at 30 s.
    arrivals = [i * 2.0 for i in range(15)] + [30.0 + i * 0.25 for i in range(160)]
    assert burst_start_s(arrivals, 1.0) == 30.0 and burst_start_s(arrivals[:15], 1.0) is None
    startup = 25.0  # the stand-in a10g: node 20 s + replica 5 s
    slow_in_window = [_res(i, t, 8.0 if 30 <= t < 30 + startup else 0.2) for i, t in enumerate(arrivals)]
    v = slo_verdict(cat, slow_in_window, arrivals)
    assert v.burst_start_s == 30.0 and v.startup_s == startup
    assert v.met and v.overall.share is not None and v.overall.share < 0.7
    assert "SLO met outside the start-up window" in v.lines()[-1]
    # Slow past the window: the verdict says so plainly.
    late = [_res(i, t, 8.0 if 30 <= t < 30 + 2 * startup else 0.2) for i, t in enumerate(arrivals)]
    missed = slo_verdict(cat, late, arrivals)
    assert not missed.met and missed.lines()[-1].startswith("WARNING: the SLO was MISSED")
