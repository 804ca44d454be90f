"""Best effort, loudly: when no flavor meets a model's SLO for its mix (or the ones that do are capped by
limits), the planner still serves the demand on the flavors that come closest, and says so; requests past
the model's max_model_len are not sized for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rayscale.config import load_catalog
from rayscale.core.attainment import mix_quantiles, prompt_end
from rayscale.core.catalog import Catalog, FlavorLimits
from rayscale.core.chunk import pin_chunks
from rayscale.core.estimate import EstimateSettings, estimate, within_context
from rayscale.core.plan import plan
from rayscale.core.signals import Freshness, ModelSignals, RequestMix

ROOT = Path(__file__).resolve().parents[2]
M = "mistral-7b"
# The issue's load: conversation traffic with long prompts (mean 12k tokens, p95 39k).
LONG = RequestMix(12000, 340, 39000)
SHORT = RequestMix(1000, 200, 3000)
RUNNING = {(M, "l40s", "on-demand"): 1}
FULL = pin_chunks(load_catalog()).subset([M])
# What a user without H100 quota has: no flavor meets a 2 s TTFT for a 32k-token prompt.
NO_H100 = FULL.subset([M], [f for f in FULL.models[M].parallelism if f != "h100"])


def _sig(rate: float, mix: RequestMix = LONG) -> dict[str, ModelSignals]:
    return {M: ModelSignals(M, Freshness.FRESH, 0.0, rate, mix)}


def _limit(cat: Catalog, flavor: str, devices: int) -> Catalog:
    fl = cat.flavors[flavor].model_copy(update={"limits": FlavorLimits(devices=devices)})
    return cat.model_copy(update={"flavors": {**cat.flavors, flavor: fl}})


def _with_model(cat: Catalog, **update: object) -> Catalog:
    return cat.model_copy(update={"models": {**cat.models, M: cat.models[M].model_copy(update=update)}})


def test_no_flavor_meets_the_slo_yet_the_demand_is_served_and_reported() -> None:
    d = estimate(NO_H100, _sig(3.4))[M]
    assert "no flavor meets TTFT p95 2 s" in d.best_effort and "max_model_len 32768" in d.best_effort
    assert all(c.best_effort and not c.feasible and "TTFT SLO" in c.reason for c in d.capacity.values())
    assert all(0 < c.miss < 1 for c in d.capacity.values() if c.rps > 0)
    p, _ = plan(NO_H100, {M: d}, RUNNING)
    served = sum(e.rps_capacity for e in p.entries)
    assert p.replicas(M) > 1 and served >= 3.4 - 1e-3
    (s,) = p.shortfalls
    assert s.best_effort and s.unmet_rps == 0 and s.reason.startswith("best effort: no flavor meets")
    assert "of requests miss" in s.reason
    assert all("best effort" in e.reason for e in p.entries)
    assert p.to_dict()["shortfalls"][0]["best_effort"] is True
    # Without best effort (the old behaviour) the same load orders nothing: every request would fail.
    off = estimate(NO_H100, _sig(3.4), settings=EstimateSettings(best_effort=False))
    old, _ = plan(NO_H100, off, RUNNING)
    assert old.replicas(M) == 1 and old.shortfalls[0].unmet_rps == pytest.approx(3.4)


def test_the_issue_load_on_the_full_catalog_serves_what_limits_leave_best_effort() -> None:
    # H100 meets the SLO once the tail past max_model_len is cut, but its NodePool limit caps it: the
    # rest runs best effort on the other flavors instead of failing. Eight TP=1 replicas pack one
    # p5.48xlarge, so the cap is one node and the load more than its eight replicas serve.
    cat = _limit(FULL, "h100", 8)
    d = estimate(cat, _sig(8.0))[M]
    assert d.capacity["h100"].feasible and not d.best_effort and d.fallback["l40s"].rps > 0
    p, _ = plan(cat, {M: d}, RUNNING)
    h100 = [e for e in p.entries if e.flavor == "h100"]
    assert p.replicas(M, "h100") == 8 and sum(e.nodes for e in h100) * 8 <= 8
    assert sum(e.rps_capacity for e in p.entries) >= 8.0 - 1e-3
    (s,) = p.shortfalls
    assert s.best_effort and s.unmet_rps == 0 and "cannot cover the demand within limits" in s.reason


def test_a_feasible_load_reports_no_best_effort() -> None:
    d = estimate(FULL, _sig(3.4, SHORT))[M]
    assert not d.best_effort and all(not c.best_effort for c in d.capacity.values())
    p, _ = plan(FULL, {M: d}, RUNNING)
    assert p.replicas(M) > 0 and not p.shortfalls


def test_limits_still_bind_best_effort() -> None:
    cat = _limit(NO_H100.subset([M], ["l40s"]), "l40s", 4)
    p, _ = plan(cat, estimate(cat, _sig(3.4)), RUNNING)
    assert p.replicas(M) == 4
    (s,) = p.shortfalls
    assert s.best_effort and s.unmet_rps > 0 and "NodePool limits on l40s" in s.reason


def test_min_replicas_is_kept_best_effort() -> None:
    cat = _with_model(NO_H100, min_replicas=3)
    p, _ = plan(cat, estimate(cat, _sig(0.0)))
    assert p.replicas(M) == 3
    (s,) = p.shortfalls
    assert s.best_effort and s.missing_replicas == 0


def test_requests_past_max_model_len_are_not_sized_for() -> None:
    cut = within_context(LONG, 32768)
    assert cut.prompt_p95 == 32768 and max(mix_quantiles(cut)[0]) == 32768 and prompt_end(cut) == 32768
    assert cut.prompt_mean < LONG.prompt_mean
    assert within_context(SHORT, 32768) is SHORT and within_context(LONG, None) is LONG
    # With the 39k tail sized for, no flavor meets the SLO; cut at the context, H100 does.
    unbounded = _with_model(FULL, max_model_len=None)
    assert not estimate(unbounded, _sig(3.4))[M].capacity["h100"].feasible
    assert estimate(FULL, _sig(3.4))[M].capacity["h100"].feasible
    assert FULL.models[M].max_model_len == 32768


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rayscale.cli", "plan", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def test_rayscale_plan_shows_the_best_effort_shortfall(tmp_path: Path) -> None:
    load = tmp_path / "load.yaml"
    load.write_text("models:\n  mistral-7b: {rate_rps: 3.4, prompt_mean: 12000, output_mean: 340, prompt_p95: 39000}\n"
                    "current:\n  - {model: mistral-7b, flavor: l40s, replicas: 1}\n")
    flavors = [a for f in NO_H100.flavors for a in ("--flavor", f)]
    out = json.loads(_cli("--load", str(load), "--model", M, *flavors, "--json").stdout)
    assert sum(e["replicas"] for e in out["entries"]) > 1
    (s,) = out["shortfalls"]
    assert s["best_effort"] is True and s["reason"].startswith("best effort: no flavor meets TTFT p95 2 s")
    assert out["demand"][M]["best_effort"].startswith("no flavor meets")
    t = _cli("--load", str(load), "--model", M, *flavors)
    assert t.returncode == 0, t.stderr
    assert f"BEST EFFORT {M}: best effort: no flavor meets" in t.stdout, t.stdout
    assert "SHORTFALL" not in t.stdout


def test_best_effort_replicas_are_kept_steady_and_let_go_when_the_slo_flavors_suffice() -> None:
    p1, mem = plan(FULL, estimate(FULL, _sig(3.4)), RUNNING, now=0.0)
    fleet = p1.target()
    assert fleet.get((M, "l40s", "on-demand"), 0) > 0
    # Next period, same load: nothing changes, and the model is not read as short again.
    p2, mem = plan(FULL, estimate(FULL, _sig(3.4)), fleet, now=5.0, memory=mem)
    assert p2.target() == fleet and not p2.changes() and "steady" in p2.entries[0].reason
    # The load falls to what the H100s serve within the SLO: once the scale-down waits are over, the
    # best-effort replicas go and no best-effort shortfall is left.
    low = estimate(FULL, _sig(1.0))
    p3 = p2
    for t in (10.0, 2000.0, 4000.0):
        p3, mem = plan(FULL, low, fleet, now=t, memory=mem)
        fleet = p3.target()
    assert {k[1] for k in fleet} == {"h100"} and not p3.shortfalls
