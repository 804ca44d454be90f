"""Reading engine metrics: every Ray node's Prometheus endpoint (``MetricsExportPort`` in ray.nodes()).

The only I/O of observe; aggregation is rayscale.signals.window. A node that does not answer makes the
scrape partial, and a scrape where no endpoint answers is marked failed so its absence is never read
as zero load. Nodes are read in parallel: most of a scrape is each node's exporter building its page (Ray's
metrics agent, ~850 KB on a node serving a 7B model), and a period cannot wait for them one by one.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

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
    def __init__(self, endpoints: Endpoints = ray_metrics_endpoints, timeout_s: float = 3.0, parallel: int = 16):
        self.endpoints = endpoints
        self._http = httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=parallel))
        self._pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="rayscale-scrape")
        self.errors: list[str] = []

    def _read(self, url: str) -> dict[SeriesKey, float] | str:
        """One node's series, or why it gave none."""
        try:
            r = self._http.get(url)
            r.raise_for_status()
            return parse_prometheus(r.text)
        except (httpx.HTTPError, ValueError) as e:
            return f"{url}: {e}"

    def scrape(self, t: float) -> Scrape:
        self.errors = []
        series: dict[SeriesKey, float] = {}
        try:
            urls = self.endpoints()
        except Exception as e:
            self.errors.append(f"endpoint discovery failed: {e}")
            return Scrape(t, {}, ok=False)
        try:
            answers = list(self._pool.map(self._read, urls))  # in the endpoints' order, whichever answers first
        except RuntimeError as e:  # closed (the process stops) while a period was still running
            self.errors.append(f"scraper closed: {e}")
            return Scrape(t, {}, ok=False)
        answered = 0
        for got in answers:
            if isinstance(got, str):
                self.errors.append(got)
            else:
                series.update(got)
                answered += 1
        return Scrape(t, series, ok=answered > 0)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()
