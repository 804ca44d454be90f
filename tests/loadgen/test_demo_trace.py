"""The demo's trace step: the shared Azure slice, or a generated trace when the file is missing."""

from __future__ import annotations

from pathlib import Path

from rayscale.demo import DEFAULT_TRACE, DemoConfig, demo_trace, serve_app_args


def test_demo_slice_fits_two_cores() -> None:
    lines: list[str] = []
    tr = demo_trace(DemoConfig(), lines.append)
    s = tr.stats()
    assert str(DEFAULT_TRACE) in lines[0]
    assert 50 < s.requests < 250  # a few requests per second for about a minute
    assert s.duration_s <= 60
    assert tr.prompt_tokens.max() <= 256 and tr.output_tokens.max() <= 32


def test_missing_trace_says_so_and_generates_one(tmp_path: Path) -> None:
    lines: list[str] = []
    missing = tmp_path / "nope.csv"
    tr = demo_trace(DemoConfig(trace=missing), lines.append)
    assert "not found" in lines[0] and str(missing) in lines[0]
    assert len(tr) > 20 and tr.duration_s <= 60


def test_replica_is_pinned_to_the_flavor_node() -> None:
    app, args, model = serve_app_args(DemoConfig())
    assert (app, model) == ("default", "tiny-qwen2")
    bundles = args["models"][0]["flavors"][0]["placement_bundles"]
    assert bundles[0]["resources"]["accelerator_type:CPU"] == 1
