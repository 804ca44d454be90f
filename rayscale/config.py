"""Loading configuration files: the catalog (models, flavors, profiles), the settings and LOAD.yaml snapshots.

The only place that reads these files; the core receives validated objects. Every error names the
file and the field, and lists the allowed values where there is a fixed set.
"""

from __future__ import annotations

import dataclasses
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from rayscale.core.catalog import Catalog, CatalogError, FastStart, Flavor, ModelSpec, Profile, profile_key
from rayscale.core.loadfile import LoadFile
from rayscale.core.settings import Settings

DEFAULT_DIR = "rayscale.data"
T = typing.TypeVar("T")


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as e:
        raise CatalogError(f"{path}: cannot read: {e.strerror}") from e
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise CatalogError(f"{path}: not valid YAML: {e}") from e


def _format_error(path: Path, section: str, err: ValidationError) -> CatalogError:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (section, *e["loc"]) if p not in ("", "__root__"))
        msg = e["msg"]
        ctx = e.get("ctx") or {}
        if "expected" in ctx:
            msg += f" (allowed: {ctx['expected']})"
        lines.append(f"{path}: {loc}: {msg}")
    return CatalogError("\n".join(lines))


def _section(path: Path, data: Any, key: str) -> list[Any]:
    if not isinstance(data, dict) or key not in data:
        raise CatalogError(f"{path}: top-level key {key!r} is missing (expected a mapping with '{key}: [...]')")
    items = data[key]
    if not isinstance(items, list):
        raise CatalogError(f"{path}: {key}: must be a list")
    return items


def _build(path: Path, key: str, items: list[Any], cls: type[BaseModel]) -> list[Any]:
    out = []
    for i, raw in enumerate(items):
        try:
            out.append(cls.model_validate(raw))
        except ValidationError as e:
            name = raw.get("name") if isinstance(raw, dict) else None
            raise _format_error(path, f"{key}[{i}]" + (f"({name})" if name else ""), e) from None
    return out


def default_paths() -> dict[str, Path]:
    base = Path(str(resources.files(DEFAULT_DIR)))
    return {k: base / f"{k}.yaml" for k in ("models", "flavors", "profiles")}


def load_catalog(
    models: str | Path | None = None,
    flavors: str | Path | None = None,
    profiles: str | Path | None = None,
) -> Catalog:
    """Load and cross-check the three catalog files (shipped defaults where a path is None)."""
    d = default_paths()
    mp, fp, pp = Path(models or d["models"]), Path(flavors or d["flavors"]), Path(profiles or d["profiles"])
    fl = _build(fp, "flavors", _section(fp, _read_yaml(fp), "flavors"), Flavor)
    flavor_data = _read_yaml(fp)
    discount = flavor_data.get("spot_default_discount", 0.6) if isinstance(flavor_data, dict) else 0.6
    ms = _build(mp, "models", _section(mp, _read_yaml(mp), "models"), ModelSpec)
    ps = _build(pp, "profiles", _section(pp, _read_yaml(pp), "profiles"), Profile)
    for what, path, items in (("flavor", fp, fl), ("model", mp, ms)):
        names = [x.name for x in items]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise CatalogError(f"{path}: duplicate {what} names: {dup}")
    try:
        fast = FastStart.model_validate((flavor_data.get("fast_start") if isinstance(flavor_data, dict) else None) or {})
    except ValidationError as e:
        raise _format_error(fp, "fast_start", e) from None
    try:
        # Checked as written (each startup_s the sum of its cold parts), then deployed with the fast-start choices.
        cat = Catalog(
            models={m.name: m for m in ms},
            flavors={f.name: f for f in fl},
            profiles={profile_key(p.model, p.flavor): p for p in ps},
            spot_default_discount=discount,
        )
    except ValidationError as e:
        msgs = "; ".join(str(x["msg"]).removeprefix("Value error, ") for x in e.errors())
        raise CatalogError(f"{mp} / {fp} / {pp}: {msgs}") from None
    return cat.with_fast_start(fast) if fast != FastStart() else cat


def load_loadfile(path: str | Path) -> LoadFile:
    p = Path(path)
    raw = _read_yaml(p) or {}
    try:
        return LoadFile.model_validate(raw)
    except ValidationError as e:
        raise CatalogError("\n".join(
            f"{p}: {'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())) from None


def default_settings_path() -> Path:
    return Path(str(resources.files(DEFAULT_DIR))) / "settings.yaml"


def settings_from_mapping(data: Any, source: str = "settings") -> Settings:
    """Settings from a mapping shaped like the record (``estimate:``, ``planner:``, ``act:`` nested); a
    section overrides the keys it names and the rest keep the shipped values. Unknown keys, wrong types
    and out-of-range values raise CatalogError naming ``source`` and the field."""
    return _record(Settings(), {} if data is None else data, source, "")


def _record(shipped: T, data: Any, source: str, at: str) -> T:
    where = at or "(top level)"
    if not isinstance(data, dict):
        raise CatalogError(f"{source}: {where}: must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(type(shipped))
    names = [f.name for f in dataclasses.fields(shipped)]  # type: ignore[arg-type]
    changes: dict[str, Any] = {}
    for key, value in data.items():
        field = f"{at}.{key}" if at else str(key)
        if key not in names:
            raise CatalogError(f"{source}: {field}: unknown setting (allowed: {', '.join(names)})")
        if dataclasses.is_dataclass(hints[key]):
            changes[key] = _record(getattr(shipped, key), value, source, field)
            continue
        try:
            changes[key] = TypeAdapter(hints[key]).validate_python(value, strict=isinstance(value, str))
        except ValidationError as e:
            raise CatalogError(f"{source}: {field}: {e.errors()[0]['msg']}, got {value!r}") from None
    try:
        return dataclasses.replace(shipped, **changes)  # type: ignore[type-var]
    except ValueError as e:  # the record's own range checks name the field
        raise CatalogError(f"{source}: {where}: {e}") from None


def load_settings(path: str | Path | None = None) -> Settings:
    """The settings file (the shipped one when ``path`` is None); every error names the file and field."""
    p = Path(path) if path is not None else default_settings_path()
    return settings_from_mapping(_read_yaml(p), str(p))


def override_settings(base: Settings, changes: dict[str, Any], source: str) -> Settings:
    """``base`` with the settings ``changes`` names (a nested mapping, as in the file), checked the same way."""
    return _record(base, changes, source, "")
