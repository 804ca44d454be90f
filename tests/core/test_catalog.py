"""The shipped catalog loads; bad files fail with one error naming the file, the field and the choices."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rayscale.config import default_paths, load_catalog
from rayscale.core.catalog import CapacityType, CatalogError


def test_default_catalog_has_required_flavors_and_sources() -> None:
    cat = load_catalog()
    assert {"a10g", "l4", "l40s", "a100", "h100", "inf2", "trn1", "cpu"} <= set(cat.flavors)
    for f in cat.flavors.values():
        for it in f.instance_types:
            assert it.price_source.split(":")[0] in {"published", "measured", "refreshed", "derived", "nominal"}
    for p in cat.profiles.values():
        assert p.source.split(":")[0] in {"published", "measured", "derived", "estimate"}
    # FACTS.md numbers are carried exactly.
    assert cat.flavors["a10g"].instance("g5.xlarge").on_demand_usd_per_h == 1.006
    assert cat.flavors["trn1"].instance("trn1.32xlarge").on_demand_usd_per_h == 21.50
    # Spot falls back to the documented default discount when no spot price is known.
    assert cat.price("a10g", "g5.xlarge", CapacityType.SPOT) == pytest.approx(1.006 * 0.4)


def _write(tmp: Path, name: str, data: object) -> Path:
    p = tmp / name
    p.write_text(yaml.safe_dump(data))
    return p


def _copy_defaults(tmp: Path) -> dict[str, dict]:
    return {k: yaml.safe_load(v.read_text()) for k, v in default_paths().items()}


def test_unknown_flavor_in_model_names_file_field_and_allowed(tmp_path: Path) -> None:
    d = _copy_defaults(tmp_path)
    d["models"]["models"][0]["parallelism"]["tpu"] = {"tp": 1}
    m = _write(tmp_path, "models.yaml", d["models"])
    with pytest.raises(CatalogError) as e:
        load_catalog(models=m)
    msg = str(e.value)
    assert "models.yaml" in msg and "mistral-7b" in msg and "'tpu'" in msg and "a10g" in msg


def test_bad_capacity_type_lists_allowed_values(tmp_path: Path) -> None:
    d = _copy_defaults(tmp_path)
    d["flavors"]["flavors"][0]["capacity_types"] = ["reserved"]
    f = _write(tmp_path, "flavors.yaml", d["flavors"])
    with pytest.raises(CatalogError) as e:
        load_catalog(flavors=f)
    msg = str(e.value)
    assert "flavors.yaml" in msg and "flavors[0](a10g).capacity_types.0" in msg
    assert "on-demand" in msg and "spot" in msg


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d["flavors"]["flavors"][0]["instance_types"][0].update(on_demand_usd_per_h=-1), "on_demand_usd_per_h"),
        (lambda d: d["flavors"]["flavors"][0]["instance_types"][0].update(price_source="guess"), "price_source"),
        (lambda d: d["flavors"]["flavors"][0].update(name="A10G"), "name"),
        (lambda d: d["flavors"]["flavors"][0].update(colour="red"), "colour"),
        (lambda d: d["flavors"]["flavors"][1].update(name="a10g"), "duplicate"),
    ],
)
def test_flavor_errors(tmp_path: Path, mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    d = _copy_defaults(tmp_path)
    mutate(d)
    f = _write(tmp_path, "flavors.yaml", d["flavors"])
    with pytest.raises(CatalogError) as e:
        load_catalog(flavors=f)
    assert str(f) in str(e.value) and needle in str(e.value)


def test_model_min_above_max_and_missing_profile(tmp_path: Path) -> None:
    d = _copy_defaults(tmp_path)
    d["models"]["models"][0]["min_replicas"] = 9
    d["models"]["models"][0]["max_replicas"] = 2
    m = _write(tmp_path, "models.yaml", d["models"])
    with pytest.raises(CatalogError, match="min_replicas"):
        load_catalog(models=m)
    d = _copy_defaults(tmp_path)
    d["profiles"]["profiles"] = [p for p in d["profiles"]["profiles"] if p["flavor"] != "l4"]
    p = _write(tmp_path, "profiles.yaml", d["profiles"])
    with pytest.raises(CatalogError, match="no profile for mistral-7b/l4"):
        load_catalog(profiles=p)


def test_not_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "flavors.yaml"
    bad.write_text("flavors: [unclosed")
    with pytest.raises(CatalogError, match="not valid YAML"):
        load_catalog(flavors=bad)
    with pytest.raises(CatalogError, match="cannot read"):
        load_catalog(flavors=tmp_path / "nope.yaml")
    empty = _write(tmp_path, "models.yaml", {"model": []})
    with pytest.raises(CatalogError, match="top-level key 'models'"):
        load_catalog(models=empty)
