"""Reading engine metrics: every Ray node's Prometheus endpoint (``MetricsExportPort`` in ray.nodes()).

The only I/O of observe; aggregation is rayscale.signals.window. A node that does not answer makes the
scrape partial, and a scrape where no endpoint answers is marked failed so its absence is never read
as zero load.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from rayscale.signals.window import Scrape, SeriesKey, parse_prometheus

Endpoints = Callable[[], list[str]]


def ray_metrics_endpoints() -> list[str]:
    """Metrics URLs of the live nodes of the Ray cluster this process is connected to."""
    import ray

    out = []
    for n in ray.nodes():
        if n.get("Alive") and n.get("MetricsExportPort"):
            out.append(f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics")
    return out


class MetricsScraper:
    def __init__(self, endpoints: Endpoints = ray_metrics_endpoints, timeout_s: float = 3.0):
        self.endpoints = endpoints
        self._http = httpx.Client(timeout=timeout_s)
        self.errors: list[str] = []

    def scrape(self, t: float) -> Scrape:
        self.errors = []
        series: dict[SeriesKey, float] = {}
        try:
            urls = self.endpoints()
        except Exception as e:
            self.errors.append(f"endpoint discovery failed: {e}")
            return Scrape(t, {}, ok=False)
        answered = 0
        for url in urls:
            try:
                r = self._http.get(url)
                r.raise_for_status()
                series.update(parse_prometheus(r.text))
                answered += 1
            except (httpx.HTTPError, ValueError) as e:
                self.errors.append(f"{url}: {e}")
        return Scrape(t, series, ok=answered > 0)

    def close(self) -> None:
        self._http.close()
