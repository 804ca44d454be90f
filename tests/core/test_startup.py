"""Start-up split into parts with sources: parts sum to the totals, bad parts are clear errors, the fast-start
choices map to the start-up they imply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rayscale.config import default_paths, load_catalog
from rayscale.core.catalog import AcceleratorKind, CatalogError, FastStart, WeightSource, startup_parts

CAT = load_catalog()
SNAP = "snap-0123456789abcdef0"
FAST = FastStart(image_snapshots={AcceleratorKind.GPU: SNAP}, weights=WeightSource.STREAM,
                 weights_uri="s3://bucket/models")


def test_every_shipped_offering_splits_its_start_up_into_sourced_parts_that_sum_to_the_totals() -> None:
    for p in CAT.profiles.values():
        fl = CAT.flavors[p.flavor]
        assert fl.startup is not None and p.startup is not None, p
        parts = CAT.startup(p.model, p.flavor)
        assert parts.node_boot_s == fl.node_startup_s
        assert parts.image_pull_s + parts.weight_load_s + parts.engine_start_s == pytest.approx(p.startup_s)
        assert parts.total_s == pytest.approx(fl.node_startup_s + p.startup_s)
        for part in (fl.startup.node_boot, fl.startup.image_pull, p.startup.weight_load, p.startup.engine_start):
            assert part.source.split(":")[0] in {"published", "measured", "derived", "estimate"}
    # The GPU parts cite what they come from.
    assert "kuberay#4226" in CAT.flavors["a10g"].startup.image_pull.source  # type: ignore[union-attr]


def _write_catalog(tmp: Path, edit_profile=None, edit_flavor=None, edit_both=None) -> dict[str, Path]:
    """The shipped profiles and flavors files, edited, in ``tmp`` (``edit_both`` sees both: key -> data)."""
    paths = default_paths()
    data = {key: yaml.safe_load(paths[key].read_text()) for key in ("profiles", "flavors")}
    for key, edit in (("profiles", edit_profile), ("flavors", edit_flavor)):
        if edit is not None:
            edit(data[key])
    if edit_both is not None:
        edit_both(data)
    out = {}
    for key, d in data.items():
        out[key] = tmp / f"{key}.yaml"
        out[key].write_text(yaml.safe_dump(d))
    return out


def _profile(data: dict, model: str, flavor: str) -> dict:
    return next(p for p in data["profiles"] if p["model"] == model and p["flavor"] == flavor)


def test_parts_that_do_not_sum_to_startup_s_are_refused_naming_the_profile(tmp_path: Path) -> None:
    def bump(d: dict) -> None:
        _profile(d, "mistral-7b", "l4")["startup_s"] = 300
    p = _write_catalog(tmp_path, edit_profile=bump)
    with pytest.raises(CatalogError, match=r"profiles\.mistral-7b/l4\.startup_s \(300\) must equal its parts.*= 270"):
        load_catalog(profiles=p["profiles"], flavors=p["flavors"])


def _negative_engine_start(d: dict) -> None:
    st = dict(_profile(d["profiles"], "mistral-7b", "l4")["startup"])
    st["engine_start"] = {"s": -5, "source": "estimate: a typo"}
    _profile(d["profiles"], "mistral-7b", "l4")["startup"] = st


def _l4_image_pull(part: dict) -> object:
    def edit(d: dict) -> None:
        fl = next(f for f in d["flavors"]["flavors"] if f["name"] == "l4")
        fl["startup"] = {**fl["startup"], "image_pull": part}
    return edit


@pytest.mark.parametrize(("edit", "error"), [
    (_negative_engine_start,
     r"profiles\.yaml: profiles\[\d+\]\.startup\.engine_start\.s: Input should be greater than or equal to 0"),
    (_l4_image_pull({"s": 120}), r"flavors\.yaml: flavors\[\d+\]\(l4\)\.startup\.image_pull\.source: Field required"),
    (_l4_image_pull({"s": 120, "source": "trust me"}), r"\(l4\)\.startup\.image_pull\.source: .*must start with one of"),
], ids=["negative", "unsourced", "vague source"])
def test_a_negative_part_or_a_part_without_source_is_an_error_naming_file_and_field(
        tmp_path: Path, edit: Any, error: str) -> None:
    p = _write_catalog(tmp_path, edit_both=edit)
    with pytest.raises(CatalogError, match=error):
        load_catalog(profiles=p["profiles"], flavors=p["flavors"])


def test_node_startup_s_must_be_the_node_boot_part(tmp_path: Path) -> None:
    def disagree(d: dict) -> None:
        next(f for f in d["flavors"] if f["name"] == "l4")["node_startup_s"] = 200
    p = _write_catalog(tmp_path, edit_flavor=disagree)
    with pytest.raises(CatalogError, match=r"\(l4\): .*node_startup_s \(200\) must equal startup\.node_boot\.s"):
        load_catalog(profiles=p["profiles"], flavors=p["flavors"])


def test_fast_start_choices_shorten_exactly_the_parts_they_replace() -> None:
    cold = CAT.startup("mistral-7b", "a10g")
    fast = CAT.with_fast_start(FAST)
    got = fast.startup("mistral-7b", "a10g")
    st = CAT.profile("mistral-7b", "a10g").startup
    assert st is not None and st.weight_load_stream is not None
    assert (got.node_boot_s, got.engine_start_s) == (cold.node_boot_s, cold.engine_start_s)
    assert got.image_pull_s == CAT.flavors["a10g"].startup.image_pull_snapshot.s < cold.image_pull_s  # type: ignore[union-attr]
    assert got.weight_load_s == st.weight_load_stream.s < cold.weight_load_s
    # The totals every planner and the simulator read follow the choices, and survive a subset.
    assert fast.profile("mistral-7b", "a10g").startup_s == pytest.approx(got.replica_s())
    assert fast.subset(["mistral-7b"]).profile("mistral-7b", "a10g").startup_s == pytest.approx(got.replica_s())
    # No snapshot for Neuron and no streaming there: inf2 keeps its pull and its download.
    assert fast.startup("mistral-7b", "inf2") == CAT.startup("mistral-7b", "inf2")
    # A node that holds the image already skips the pull, with or without the choices.
    assert cold.replica_s(image_cached=True) == cold.replica_s() - cold.image_pull_s
    assert startup_parts(CAT.flavors["a10g"], CAT.profile("mistral-7b", "a10g"), FAST) == got


def test_fast_start_is_validated_and_read_from_the_flavors_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="weights_uri"):
        FastStart(weights=WeightSource.STREAM)
    with pytest.raises(ValueError, match="not an EBS snapshot id"):
        FastStart(image_snapshots={AcceleratorKind.GPU: "ami-123"})

    def choose(d: dict) -> None:
        d["fast_start"] = {"image_snapshots": {"gpu": SNAP}, "weights": "cache"}
    p = _write_catalog(tmp_path, edit_flavor=choose)
    cat = load_catalog(profiles=p["profiles"], flavors=p["flavors"])
    assert cat.fast_start.weights == WeightSource.CACHE
    assert cat.profile("mistral-7b", "l4").startup_s == pytest.approx(10 + 15 + 90)

    def bad(d: dict) -> None:
        d["fast_start"] = {"weights": "teleport"}
    p = _write_catalog(tmp_path, edit_flavor=bad)
    with pytest.raises(CatalogError, match=r"flavors\.yaml: fast_start\.weights: "):
        load_catalog(profiles=p["profiles"], flavors=p["flavors"])


def test_a_start_up_sweep_scales_every_part_to_the_median_total() -> None:
    for total in (120.0, 300.0, 600.0):
        cat = CAT.subset(["mistral-7b"]).with_startup_total(total)
        totals = sorted(cat.startup("mistral-7b", f).total_s for f in cat.models["mistral-7b"].parallelism)
        assert totals[len(totals) // 2] == pytest.approx(total)
        a10g = cat.startup("mistral-7b", "a10g")
        assert cat.flavors["a10g"].node_startup_s == pytest.approx(a10g.node_boot_s)
        assert cat.profile("mistral-7b", "a10g").startup_s == pytest.approx(a10g.replica_s())
        assert "start-up sweep" in cat.flavors["a10g"].startup.image_pull.source  # type: ignore[union-attr]
