"""bench/gpu_step.py on its tiny shape on the CPU: the GPU run gets one short lease, so the script's whole path
(weights, attention choice, decode, prefill, fit, report) must already work here.

No ``__init__.py`` in this folder on purpose: with one, pytest would import it as a top-level package named
``bench`` (tests/ has no ``__init__.py``) and shadow the repository's ``bench`` package."""

from __future__ import annotations

import ast
import json
import time
from pathlib import Path

import torch  # the CPU build the project installs for vLLM

from bench import gpu_step

SCRIPT = Path(gpu_step.__file__)


def test_tiny_cpu_run_writes_report_and_json(tmp_path: Path) -> None:
    md, js = tmp_path / "x.md", tmp_path / "x.json"
    t0 = time.perf_counter()
    assert gpu_step.main(["--tiny", "--device", "cpu", "--out", str(md), "--json", str(js)]) == 0
    assert time.perf_counter() - t0 < 30
    data = json.loads(js.read_text())
    decode = data["decode"]
    assert sorted(r["batch"] for r in decode) == [1, 4]
    assert all(r["eager_ms"] > 0 and r["graph_ms"] is None for r in decode)  # no CUDA graphs on the CPU
    (fit,) = data["fits"]
    assert fit["source"] == "eager" and fit["points"] == 2
    assert isinstance(fit["alpha_s"], float) and isinstance(fit["beta_s"], float)
    assert {(r["sequences"], r["tokens_each"]) for r in data["prefill"]} == {(1, 64), (1, 128), (2, 64)}
    assert all(r["tokens_per_s"] > 0 for r in data["prefill"])
    assert data["meta"]["device"] == "cpu" and data["meta"]["shape"] == "tiny"
    assert data["profile"]["prefill_tokens_per_s"] == 30000  # mistral-7b on h100, read from profiles.yaml
    text = md.read_text()
    assert "lower bound" in text and "itl_alpha_s" in text and "prefill_tokens_per_s" in text


def test_decode_attention_forms_agree() -> None:
    """The "fold" form (a KV head's query group as query rows) is exact GQA for one new token."""
    s = gpu_step.TINY
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, s.heads, s.head_dim, generator=g)
    kc, vc = (torch.randn(3, s.kv_heads, 17, s.head_dim, generator=g) for _ in range(2))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), kc.repeat_interleave(s.group, 1), vc.repeat_interleave(s.group, 1)).reshape(3, -1)
    torch.testing.assert_close(gpu_step.decode_attention(q, kc, vc, s, "fold"), ref)
    if gpu_step.native_gqa_supported(torch.device("cpu")):
        torch.testing.assert_close(gpu_step.decode_attention(q, kc, vc, s, "native"), ref)


def test_budget_spent_still_writes_a_report(tmp_path: Path) -> None:
    md = tmp_path / "b.md"
    gpu_step.main(["--tiny", "--device", "cpu", "--budget-s", "0", "--out", str(md)])
    data = json.loads(md.with_suffix(".json").read_text())
    assert any("budget spent" in s for s in data["skipped"])
    assert "lower bound" in md.read_text()


def test_script_imports_only_torch_and_stdlib_at_top() -> None:
    """The GPU machine has torch and pyyaml only: nothing from rayscale (or numpy) may load with the module."""
    allowed = {"torch", "__future__", "argparse", "json", "math", "shlex", "statistics", "sys", "time",
               "warnings",
               "collections", "dataclasses", "pathlib", "typing"}
    tree = ast.parse(SCRIPT.read_text())
    names = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert {n.split(".")[0] for n in names} <= allowed, names
