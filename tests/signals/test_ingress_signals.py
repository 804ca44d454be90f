"""What waits before the engines: the ingress's in-flight, waiting, accepted and client TTFT series and
Serve's router queues, aggregated into ModelSignals whatever the engines' freshness."""

from __future__ import annotations

import pytest

from rayscale.core.signals import Freshness
from rayscale.signals.window import (
    ACCEPTED,
    CLIENT_TTFT,
    IN_FLIGHT,
    ING_WAITING,
    RUNNING,
    SERVE_QUEUED,
    TPOT,
    TTFT,
    WAITING,
    Scrape,
    SeriesKey,
    aggregate,
    histogram_quantile,
    histogram_share,
    labels,
    parse_prometheus,
)


def _ingress(model: str, replica: str, in_flight: float, waiting: float, accepted: float,
             ttft: dict[float, float] | None = None) -> dict[SeriesKey, float]:
    lb = labels(model=model, replica=replica)
    s = {(IN_FLIGHT, lb): in_flight, (ING_WAITING, lb): waiting, (ACCEPTED, lb): accepted}
    for le, c in (ttft or {}).items():
        s[(CLIENT_TTFT + "_bucket", tuple(sorted((*lb, ("le", str(le))))))] = c
    return s


def _engine(model: str, started: float, waiting: float) -> dict[SeriesKey, float]:
    lb = labels(model=model, flavor="a10g", ReplicaId="r1")
    return {(TTFT + "_count", lb): started, (WAITING, lb): waiting, (RUNNING, lb): 4.0}


def _queued(deployment: str, handle: str, v: float) -> dict[SeriesKey, float]:
    return {(SERVE_QUEUED, labels(deployment=deployment, application="app", handle=handle, actor_id="a")): v}


def test_ingress_series_sum_over_replicas_and_count_arrivals_the_engines_never_saw() -> None:
    # Two ingress replicas; the engine started 5 requests in 10 s while the ingress accepted 40.
    t0 = {**_ingress("m", "i1", 2, 0, 100, {1.0: 50, 10.0: 50, float("inf"): 50}),
          **_ingress("m", "i2", 1, 0, 50), **_engine("m", 100, 0)}
    t1 = {**_ingress("m", "i1", 20, 15, 125, {1.0: 50, 10.0: 70, float("inf"): 70}),
          **_ingress("m", "i2", 12, 10, 65), **_engine("m", 105, 2)}
    sig = aggregate([Scrape(0.0, t0), Scrape(10.0, t1)], now=10.0)["m"]
    assert sig.freshness == Freshness.FRESH
    assert sig.in_flight == 32
    # The ingress's 25 without a first byte hold the engines' 2 queued: counted once, not 27.
    assert sig.waiting == 25
    assert sig.arrival_rate_rps == pytest.approx(40 / 10)  # not the engines' (5 + 2) / 10
    # All 20 new first bytes fell in (1, 10] s: the clients' p95, where the engines' TTFT shows none.
    assert sig.client_ttft_p95_s == pytest.approx(1.0 + 9.0 * 0.95)
    assert sig.per_flavor["a10g"].replicas == 1  # ingress replicas are not engine replicas


def test_serve_router_queues_add_to_the_engines_and_the_proxy_queue_splits_by_in_flight() -> None:
    def scrape(t: float, accepted: float) -> Scrape:
        return Scrape(t, {**_ingress("m", "i1", 30, 0, accepted), **_ingress("n", "i1", 10, 0, accepted),
                          **_engine("m", 10, 3), **_engine("n", 10, 0),
                          # the ingress's handles to m's flavor deployment; the proxy's to the ingress
                          **_queued("m--a10g", "h1", 5), **_queued("m--a10g", "h2", 2),
                          **_queued("ingress", "proxy", 8)})

    sigs = aggregate([scrape(0.0, 0), scrape(10.0, 10)], now=10.0)
    assert sigs["m"].waiting == 3 + 5 + 2 + 8 * 30 / 40
    assert sigs["m"].in_flight == 30 + 6
    assert sigs["n"].waiting == 8 * 10 / 40 and sigs["n"].in_flight == 10 + 2


def test_engines_missing_while_the_ingress_holds_requests_is_a_visible_backlog() -> None:
    scrapes = [Scrape(t, _ingress("m", "i1", 3 * t, 3 * t, 4 * t)) for t in (0.0, 2.0, 4.0)]
    sig = aggregate(scrapes, now=4.0, window_s=20.0, models=["m"])["m"]
    # The ingress's series do not make the engines fresh: freshness stays theirs.
    assert sig.freshness == Freshness.MISSING and not sig.usable
    assert sig.in_flight == 12 and sig.waiting == 12 and sig.backlog == 12
    assert sig.arrival_rate_rps == pytest.approx(4.0)
    # One scrape only: the gauges are there, a rate is not.
    one = aggregate(scrapes[-1:], now=4.0, models=["m"])["m"]
    assert one.freshness == Freshness.MISSING and one.in_flight == 12 and one.arrival_rate_rps is None
    # Stale ingress series are not a backlog.
    old = aggregate(scrapes, now=40.0, window_s=20.0, stale_after_s=8.0, models=["m"])["m"]
    assert old.in_flight is None and old.backlog == 0


def test_the_scraper_keeps_ingress_and_serve_series() -> None:
    text = "\n".join([
        "# TYPE ray_rayscale_ingress_requests_in_flight gauge",
        'ray_rayscale_ingress_requests_in_flight{model="m",replica="i1"} 7.0',
        "# TYPE ray_serve_deployment_queued_queries gauge",
        'ray_serve_deployment_queued_queries{deployment="m--a10g",application="a",handle="h",actor_id="x"} 2.0',
        "# TYPE ray_serve_num_router_requests_total counter",
        'ray_serve_num_router_requests_total{deployment="m--a10g"} 9.0',
    ])
    series = parse_prometheus(text)
    assert series[(IN_FLIGHT, labels(model="m", replica="i1"))] == 7.0
    assert sum(1 for name, _ in series if name == SERVE_QUEUED) == 1
    assert not [name for name, _ in series if name.startswith("ray_serve_num_router")]


def test_histogram_share_is_the_inverse_of_histogram_quantile() -> None:
    buckets = {0.1: 10.0, 0.5: 60.0, 1.0: 90.0, float("inf"): 100.0}
    for x in (0.05, 0.3, 0.5, 0.9):
        share = histogram_share(x, buckets)
        assert share is not None and histogram_quantile(share, buckets) == pytest.approx(x)
    assert histogram_share(5.0, buckets) == pytest.approx(0.9)  # past the last finite bucket: unknown, a miss
    assert histogram_share(0.3, {}) is None and histogram_share(0.3, {1.0: 0.0}) is None


def test_the_met_share_reads_the_clients_ttft_and_the_engines_tpot_against_the_model_slo() -> None:
    def engine(t: float, n: float, tpot_slow: float) -> dict[SeriesKey, float]:
        lb = labels(model="m", flavor="l40s", ReplicaId="r1")
        out = {(TTFT + "_count", lb): n, (TPOT + "_count", lb): n, (RUNNING, lb): 4.0}
        for le, c in ((0.05, n - tpot_slow), (0.2, n), (float("inf"), n)):
            out[(TPOT + "_bucket", tuple(sorted((*lb, ("le", str(le))))))] = c
        for le, c in ((0.5, n), (float("inf"), n)):  # every engine TTFT fast: the queue before is not in it
            out[(TTFT + "_bucket", tuple(sorted((*lb, ("le", str(le))))))] = c
        return out

    # 100 requests in the window; the clients saw 4 first bytes past 1 s, the engines 2 slow TPOTs.
    t0 = {**_ingress("m", "i1", 0, 0, 0, {1.0: 0, float("inf"): 0}), **engine(0.0, 0, 0)}
    t1 = {**_ingress("m", "i1", 0, 0, 100, {1.0: 96, float("inf"): 100}), **engine(10.0, 100, 2)}
    scrapes = [Scrape(0.0, t0), Scrape(10.0, t1)]
    sig = aggregate(scrapes, now=10.0, slo_targets={"m": (1.0, 0.05)})["m"]
    assert sig.finished == 100 and sig.slo_met == pytest.approx(0.94)
    plain = aggregate(scrapes, now=10.0)["m"]
    assert plain.slo_met is None and plain.finished is None
