"""The ingress exports the load as clients bring it: requests in flight, waiting for a first byte, accepted,
and TTFT from arrival to first byte; the controller's scraper and window read them back per model."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from rayscale.serve.metrics import INGRESS_EXPORTED, INGRESS_IN_FLIGHT, INGRESS_TTFT, scrape_metrics
from rayscale.signals.scrape import MetricsScraper
from rayscale.signals.window import ACCEPTED, CLIENT_TTFT, IN_FLIGHT, TPOT, aggregate
from tests.conftest import EMULATED_MODEL, wait_for

SLOW_TOKENS = 300  # ~10 s on the emulated A10G profile: long enough to be seen in flight


def _ingress_totals(model: str) -> dict[str, float]:
    """Per exported ingress series name (buckets by "le"), summed over ingress replicas."""
    out: dict[str, float] = {}
    for name, labels, value in scrape_metrics("ray_rayscale_ingress_"):
        if labels.get("model") != model:
            continue
        key = name + (f"@{float(labels['le'])}" if "le" in labels else "")
        out[key] = out.get(key, 0.0) + value
    return out


def _stream(base: str, max_tokens: int, results: list[Any]) -> None:
    body = {"model": EMULATED_MODEL, "prompt": "hello " * 20, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{base}/completions", json=body, timeout=120) as r:
        results.append((r.status_code, sum(1 for line in r.iter_lines() if line.startswith("data:"))))


@pytest.mark.ray
@pytest.mark.vllm
def test_ingress_exports_in_flight_accepted_and_client_ttft(tiny_vllm_app: str) -> None:
    base = tiny_vllm_app
    # The series exist (as zeros) before this test's requests: idle is not missing.
    wait_for(lambda: INGRESS_EXPORTED[INGRESS_IN_FLIGHT] in {k.split("@")[0] for k in _ingress_totals(
        EMULATED_MODEL)}, timeout_s=60, what="ingress series exported")
    before = _ingress_totals(EMULATED_MODEL)
    results: list[Any] = []
    n = 6
    threads = [threading.Thread(target=_stream, args=(base, SLOW_TOKENS, results)) for _ in range(n)]
    for t in threads:
        t.start()
    try:
        # While they stream, the ingress reports them in flight, and so do the controller's signals.
        wait_for(lambda: _ingress_totals(EMULATED_MODEL).get(IN_FLIGHT, 0.0) >= n, timeout_s=30,
                 what=f"{n} requests in flight at the ingress")
        scraper = MetricsScraper()
        try:
            first = scraper.scrape(time.time())
            time.sleep(2.0)
            last = scraper.scrape(time.time())
        finally:
            scraper.close()
        sig = aggregate([first, last], now=last.t, models=[EMULATED_MODEL])[EMULATED_MODEL]
        assert sig.in_flight is not None and sig.in_flight >= n
    finally:
        for t in threads:
            t.join(timeout=120)
    assert len(results) == n and all(status == 200 and lines > 10 for status, lines in results), results

    def settled() -> dict[str, float] | None:
        now = _ingress_totals(EMULATED_MODEL)
        done = now.get(CLIENT_TTFT + "_count", 0.0) - before.get(CLIENT_TTFT + "_count", 0.0) >= n
        return now if done and now.get(IN_FLIGHT) == 0.0 else None

    after = wait_for(settled, timeout_s=30, what="requests finished at the ingress")
    assert after[ACCEPTED] - before.get(ACCEPTED, 0.0) >= n
    assert after[INGRESS_EXPORTED[INGRESS_TTFT] + "_count"] - before.get(CLIENT_TTFT + "_count", 0.0) >= n
    # First bytes came within a second of arrival on an idle replica (the emulated prefill is milliseconds).
    under_1s = after.get(CLIENT_TTFT + "_bucket@1.0", 0.0) - before.get(CLIENT_TTFT + "_bucket@1.0", 0.0)
    assert under_1s >= n

    # What the fleet delivered against the model's SLO, read back from the same series by the controller, over
    # a window in which n short requests finished (a counter first seen inside a window counts from there, so
    # the window opens once the engines export the TPOT histogram): every first byte within the TTFT target,
    # every answer's time per token within the TPOT target.
    scraper = MetricsScraper()

    def with_tpot() -> Any:
        x = scraper.scrape(time.time())
        return x if any(name == TPOT + "_count" and dict(lb).get("model") == EMULATED_MODEL
                        for name, lb in x.series) else None

    try:
        start = wait_for(with_tpot, timeout_s=30, what="the engines' TPOT histogram exported")
        short: list[Any] = []
        batch = [threading.Thread(target=_stream, args=(base, 30, short)) for _ in range(n)]
        for t in batch:
            t.start()
        for t in batch:
            t.join(timeout=120)
        assert len(short) == n and all(status == 200 for status, _ in short), short

        def delivered(targets: tuple[float, float]) -> Any:
            end = scraper.scrape(time.time())
            return aggregate([start, end], now=end.t, window_s=end.t - start.t + 1.0, models=[EMULATED_MODEL],
                             slo_targets={EMULATED_MODEL: targets})[EMULATED_MODEL]

        sig = wait_for(lambda: (x := delivered((2.0, 0.1))).finished is not None and x.finished >= n and x,
                       timeout_s=30, what="the engines' finished requests exported")
        assert sig.slo_met == pytest.approx(1.0)
        # A TTFT target no first byte met: the same window reads as all missed.
        assert delivered((1e-4, 0.1)).slo_met == pytest.approx(0.0, abs=0.05)
    finally:
        scraper.close()


@pytest.mark.ray
@pytest.mark.vllm
def test_the_scraper_reads_real_ray_expositions_as_a_full_parse_would(tiny_vllm_app: str) -> None:
    """parse_prometheus reads only the lines of the series it keeps (exposition_of); on every node's real
    exposition, with Ray's own metrics beside the engines' and the ingress's, it keeps exactly what
    prometheus_client's parser of the whole text keeps."""
    from prometheus_client.parser import text_string_to_metric_families

    from rayscale.signals.scrape import ray_metrics_endpoints
    from rayscale.signals.window import PREFIXES, exposition_of, parse_prometheus

    wait_for(lambda: _ingress_totals(EMULATED_MODEL), timeout_s=60, what="ingress series exported")
    kept = 0
    for url in ray_metrics_endpoints():
        text = httpx.get(url, timeout=10).text
        full = {(s.name, tuple(sorted(s.labels.items()))): float(s.value)
                for fam in text_string_to_metric_families(text) for s in fam.samples if s.name.startswith(PREFIXES)}
        assert parse_prometheus(text) == full, url
        kept += len(full)
        assert len(exposition_of(text, PREFIXES)) < len(text) / 2, url  # Ray's own metrics are most of it
    assert kept > 0
