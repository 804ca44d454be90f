"""Reading a Ray node's metrics each period: the whole exposition parsed, then filtered (the baseline), against
only the lines of the series the controller keeps parsed (rayscale.signals.window.exposition_of).

    .venv/bin/python -m bench.parse_metrics [--out bench/results/parse_metrics.md]

A local Ray node serving the emulated Mistral-7B through rayscale's ingress (the tests' emulated model, one
replica), after a few requests so that the engine's and the ingress's series are exported beside Ray's own.
Both readers parse the same texts, fetched once from the node's metrics port; the median of repeated parses.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.common import machine
from rayscale.signals.window import PREFIXES, SeriesKey, exposition_of, parse_prometheus
from rayscale.tables import format_table

MODEL = "mistral-7b"
APP = "parse-bench"


def full_parse(text: str) -> dict[SeriesKey, float]:
    """The baseline: prometheus_client's parser over the whole text, then the kept series by name."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): float(s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples if s.name.startswith(PREFIXES)}


def _app() -> Any:
    from rayscale.engines.profile import catalog_profile
    from rayscale.serve.app import build_from_config
    from rayscale.serve.config import parse_app_args

    profile = catalog_profile(MODEL, "a10g").model_dump()
    cfg = parse_app_args({"app_name": APP, "models": [{
        "name": MODEL, "engine": "emulated", "max_model_len": 1024,
        "flavors": [{"flavor": "a10g", "accelerator": "cpu", "weight": 1.0, "profile": profile}]}]})
    return build_from_config(cfg, app_name=APP)


def node_texts(requests: int = 8, timeout_s: float = 300.0) -> list[str]:
    """Every node's exposition once the emulated model has served ``requests`` requests."""
    import ray
    from ray import serve

    from rayscale.signals.scrape import ray_metrics_endpoints

    ray.init(num_cpus=2, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8123})
        serve.run(_app(), name=APP, route_prefix=f"/{APP}", blocking=False)
        url = f"http://127.0.0.1:8123/{APP}/v1/completions"
        deadline = time.monotonic() + timeout_s
        done = 0
        while done < requests:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{done} of {requests} requests served in {timeout_s:.0f} s")
            try:
                r = httpx.post(url, json={"model": MODEL, "prompt": "hello " * 50, "max_tokens": 20}, timeout=30)
                done += r.status_code == 200
            except httpx.HTTPError:
                pass
            if done == 0:
                time.sleep(2.0)
        time.sleep(12.0)  # Ray exports its metrics every few seconds (metrics_report_interval_ms)
        return [httpx.get(u, timeout=10).text for u in ray_metrics_endpoints()]
    finally:
        serve.shutdown()
        ray.shutdown()


def timed_ms(f: Callable[[str], object], texts: list[str], repeats: int) -> float:
    """Median time to read every node's text once."""
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for x in texts:
            f(x)
        runs.append((time.perf_counter() - t) * 1000)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    texts = node_texts()
    kept = [parse_prometheus(t) for t in texts]
    if any(k != full_parse(t) for k, t in zip(kept, texts, strict=True)):
        raise SystemExit("the filtered parse keeps other series than the full parse")
    full_ms = timed_ms(full_parse, texts, args.repeats)
    kept_ms = timed_ms(parse_prometheus, texts, args.repeats)
    rows = [["whole text parsed, then filtered (baseline)", f"{full_ms:.1f}", "1.00x"],
            ["kept series' lines parsed (shipped)", f"{kept_ms:.1f}", f"{full_ms / kept_ms:.1f}x faster"]]
    size = sum(len(t) for t in texts)
    lines = sum(t.count("\n") for t in texts)
    kept_lines = sum(exposition_of(t, PREFIXES).count("\n") for t in texts)
    body = (f"# Reading Ray's metrics exposition each control period\n\n{machine()}; "
            f"`python -m bench.parse_metrics` ({args.repeats} repeats, median).\n\n"
            f"{len(texts)} Ray node(s) serving the emulated {MODEL} through rayscale's ingress: {size / 1000:.0f} KB, "
            f"{lines} lines, of which {kept_lines} belong to the {sum(len(k) for k in kept)} series the controller "
            f"keeps (both readers keep the same series, checked).\n\n```\n"
            + format_table(["reader", "ms per scrape of every node", "vs baseline"], rows) + "\n```\n")
    print(body)
    if args.out:
        args.out.write_text(body)


if __name__ == "__main__":
    main()
