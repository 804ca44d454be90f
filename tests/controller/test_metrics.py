"""The controller's own metrics on a real Prometheus endpoint, and the Grafana dashboard reads them."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

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


def test_grafana_dashboard_queries_only_exported_series() -> None:
    dash = json.loads((ROOT / "deployments/grafana/rayscale.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {"ray_" + PREFIX + n for n in ("desired_replicas", "actual_replicas", "gangs", "nodes", "slo_attainment",
                                           "slo_delivered", "demand_factor",
                                           "usd_per_hour", "decision_latency_seconds_bucket")}
    used = {w for e in exprs for w in names if w in e}
    assert used == names
