"""`rayscale plan` as a user runs it: a table, JSON, and clear errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rayscale.cli", "plan", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def test_table_and_json_agree() -> None:
    t = _run("--load", "examples/load.yaml")
    assert t.returncode == 0, t.stderr
    assert "model" in t.stdout and "$/h" in t.stdout and "mistral-7b" in t.stdout
    j = _run("--load", "examples/load.yaml", "--json")
    out = json.loads(j.stdout)
    assert out["method"] == "exact"
    assert out["demand"]["tiny-qwen2"]["state"] == "hold"
    total = sum(e["usd_per_h"] for e in out["entries"])
    assert abs(total - out["usd_per_h"]) < 0.01
    assert f"total ${out['usd_per_h']:.2f}/h" in t.stdout
    # The current 3 on-demand a10g replicas are kept: scale-up only adds.
    a10g = [e for e in out["entries"] if e["model"] == "mistral-7b" and e["flavor"] == "a10g"
            and e["capacity_type"] == "on-demand"]
    assert a10g and a10g[0]["replicas"] >= 3


def test_restricting_flavors(tmp_path: Path) -> None:
    j = _run("--load", "examples/load.yaml", "--flavor", "l4", "--model", "mistral-7b", "--json")
    out = json.loads(j.stdout)
    assert {e["flavor"] for e in out["entries"] if e["replicas"]} <= {"l4", "a10g"}


def test_bad_load_file_names_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "load.yaml"
    bad.write_text("models:\n  mistral-7b: {rate_rps: -3}\n")
    r = _run("--load", str(bad))
    assert r.returncode == 2
    assert str(bad) in r.stderr and "models.mistral-7b.rate_rps" in r.stderr
    bad.write_text("models:\n  llama-99b: {rate_rps: 3}\n")
    r = _run("--load", str(bad))
    assert r.returncode == 2 and "llama-99b" in r.stderr and "mistral-7b" in r.stderr


def test_a_floor_the_limits_forbid_is_printed_as_a_shortfall(tmp_path: Path) -> None:
    import yaml

    data = ROOT / "rayscale" / "data"
    models = yaml.safe_load((data / "models.yaml").read_text())
    flavors = yaml.safe_load((data / "flavors.yaml").read_text())
    for m in models["models"]:
        if m["name"] == "mistral-7b":
            m["min_replicas"] = 3
    for f in flavors["flavors"]:
        if f["name"] == "l4":
            f["limits"] = {"devices": 2}
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(models))
    (tmp_path / "flavors.yaml").write_text(yaml.safe_dump(flavors))
    load = tmp_path / "load.yaml"
    load.write_text("models:\n  mistral-7b: {rate_rps: 0.2, prompt_mean: 900, output_mean: 180}\n")
    args = ("--models", str(tmp_path / "models.yaml"), "--flavors", str(tmp_path / "flavors.yaml"),
            "--load", str(load), "--model", "mistral-7b", "--flavor", "l4")
    t = _run(*args)
    assert t.returncode == 0, t.stderr
    assert "SHORTFALL mistral-7b: 1 replica(s) below min_replicas: degraded" in t.stdout, t.stdout
    out = json.loads(_run(*args, "--json").stdout)
    assert out["shortfalls"] == [{"model": "mistral-7b", "unmet_rps": 0.0, "missing_replicas": 1,
                                  "reason": "degraded (priority 5): NodePool limits on l4", "best_effort": False}
                                 ], out["shortfalls"]
