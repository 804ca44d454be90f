"""The controller's own metrics on a real Prometheus endpoint, and the Grafana dashboard reads them."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rayscale.config import load_catalog
from rayscale.controller.loop import DecisionRecord
from rayscale.controller.metrics import PREFIX, ControllerMetrics

ROOT = Path(__file__).resolve().parents[2]


def test_record_becomes_series_on_the_endpoint() -> None:
    cat = load_catalog().subset(["mistral-7b"], ["a10g", "l4"])
    m = ControllerMetrics(cat, port=0, ray_metrics=False)
    assert m.port
    rec = DecisionRecord(
        t=1.0,
        signals={"mistral-7b": {"freshness": "fresh", "ttft_p95_s": 3.0, "tpot_p95_s": 0.05,
                                "slo_delivered": 0.9975, "demand_factor": 0.92}},
        plan={"usd_per_h": 4.02, "entries": [{"model": "mistral-7b", "flavor": "a10g", "replicas": 3},
                                             {"model": "mistral-7b", "flavor": "l4", "replicas": 1}]},
        actions=[], errors=["x"], durations_ms={"observe": 20.0, "plan": 5.0}, gangs={},
        serve={"mistral-7b--a10g": 2}, by_flavor={"a10g": {"ready": 2, "pending": 1, "failed": 0, "nodes": 2}},
    )
    m.update(rec)
    text = httpx.get(f"http://127.0.0.1:{m.port}/metrics", timeout=5).text
    assert 'rayscale_desired_replicas{flavor="a10g",model="mistral-7b"} 3.0' in text
    assert 'rayscale_actual_replicas{flavor="a10g",model="mistral-7b"} 2.0' in text
    assert 'rayscale_actual_replicas{flavor="l4",model="mistral-7b"} 0.0' in text
    assert 'rayscale_gangs{flavor="a10g",phase="pending"} 1.0' in text
    assert 'rayscale_nodes{flavor="a10g"} 2.0' in text
    assert 'rayscale_slo_attainment{model="mistral-7b"} 0.0' in text  # TTFT p95 3 s > 2 s SLO
    assert 'rayscale_slo_delivered{model="mistral-7b"} 0.9975' in text
    assert 'rayscale_demand_factor{model="mistral-7b"} 0.92' in text
    assert "rayscale_usd_per_hour 4.02" in text and "rayscale_errors 1.0" in text
    assert "rayscale_decision_latency_seconds_count 1.0" in text
    assert "rayscale_leader 1.0" in text
    # The replica loses the Lease: it shows no decisions of its own (they would be stale beside the acting
    # replica's), until it acts again.
    m.standby()
    text = httpx.get(f"http://127.0.0.1:{m.port}/metrics", timeout=5).text
    assert "rayscale_leader 0.0" in text and "rayscale_usd_per_hour NaN" in text
    assert "rayscale_desired_replicas{" not in text and "rayscale_slo_delivered{" not in text
    m.update(rec)
    text = httpx.get(f"http://127.0.0.1:{m.port}/metrics", timeout=5).text
    assert "rayscale_leader 1.0" in text and 'rayscale_desired_replicas{flavor="a10g",model="mistral-7b"} 3.0' in text


# A selector on the metric name: `{__name__=~"RE"}` (Prometheus anchors RE at both ends) or a bare name.
_NAME_RE = re.compile(r'__name__=~"([^"]+)"')
_BARE = re.compile(r"\b(\w*rayscale_\w+)\b")
# What the dashboard shows of the controller: every series but errors (in the decision log).
SHOWN = ("desired_replicas", "actual_replicas", "gangs", "nodes", "slo_attainment", "slo_delivered",
         "demand_factor", "usd_per_hour", "decision_latency_seconds_bucket")


def dashboard_selectors() -> list[str]:
    """Each rayscale metric selector of the Grafana dashboard, as an anchored regex over metric names."""
    dash = json.loads((ROOT / "deployments/grafana/rayscale.json").read_text())
    out = []
    for expr in (t["expr"] for p in dash["panels"] for t in p["targets"]):
        out += [r for r in _NAME_RE.findall(expr) if PREFIX in r]
        out += [re.escape(n) for n in _BARE.findall(_NAME_RE.sub("", expr))]
    return out


def exported_samples(m: ControllerMetrics) -> set[str]:
    url = f"http://127.0.0.1:{m.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_grafana_dashboard_queries_series_the_endpoint_serves_under_both_names() -> None:
    """On Kubernetes the controller exports only through its endpoint (``rayscale_*``); in local mode Ray
    also exports ``ray_rayscale_*``: each selector must match a sample the endpoint serves, and its
    ``ray_`` twin."""
    cat = load_catalog().subset(["mistral-7b"], ["a10g"])
    m = ControllerMetrics(cat, port=0, ray_metrics=False)
    m.update(DecisionRecord(
        t=1.0, signals={"mistral-7b": {"freshness": "fresh", "ttft_p95_s": 1.0, "tpot_p95_s": 0.05,
                                       "slo_delivered": 1.0, "demand_factor": 1.0}},
        plan={"usd_per_h": 1.0, "entries": [{"model": "mistral-7b", "flavor": "a10g", "replicas": 1}]},
        actions=[], errors=[], durations_ms={"plan": 5.0}, gangs={}, serve={"mistral-7b--a10g": 1},
        by_flavor={"a10g": {"ready": 1, "nodes": 1}}))
    samples = exported_samples(m)
    selectors = dashboard_selectors()
    assert selectors
    for sel in selectors:
        served = {n for n in samples if re.fullmatch(sel, n)}
        assert served, f"dashboard queries {sel!r}; the endpoint serves none of it"
        assert all(re.fullmatch(sel, "ray_" + n) for n in served), f"{sel!r} misses Ray's ray_ name"
    shown = {PREFIX + n for n in SHOWN}
    assert {n for n in shown for sel in selectors if re.fullmatch(sel, n)} == shown


def test_the_terminal_line_says_each_models_load_or_that_it_is_unknown() -> None:
    """A model whose metrics the controller cannot read shows as such, not as a quiet unchanged plan."""
    from rayscale.controller.loop import record_line

    rec = DecisionRecord(
        t=1.0, signals={"mistral-7b": {"freshness": "fresh", "arrival_rate_rps": 3.6663},
                        "qwen2-7b": {"freshness": "missing"}, "qwen2-72b": {"freshness": "stale"}},
        plan={"usd_per_h": 1.0, "entries": []}, actions=[], errors=[], durations_ms={}, gangs={},
        serve={"mistral-7b--a10g": 1}, by_flavor={"a10g": {"ready": 1, "pending": 0, "failed": 0, "nodes": 1}})
    line = record_line(rec)
    assert "load mistral-7b=3.67req/s qwen2-72b=stale qwen2-7b=missing plan $1.00/h" in line, line
