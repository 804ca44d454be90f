"""Validate manifests against the real CustomResourceDefinition schemas.

A kube-apiserver checks a custom resource in three steps, and so does this module:

1. defaulting: ``default`` values of the structural schema fill absent fields (the apiserver does
   this before validating, and CEL rules see the defaulted object);
2. the OpenAPI v3 schema, converted to JSON Schema and checked with ``jsonschema``: types, required,
   enum, pattern, min/max, ``x-kubernetes-int-or-string``, ``nullable``, ``x-kubernetes-list-type``
   (``set`` and ``map`` uniqueness), ``format`` (int32/int64 ranges, date-time, duration) and, in strict
   mode (the default here, like ``kubectl --validate=strict``), unknown fields where
   ``x-kubernetes-preserve-unknown-fields`` does not allow them;
3. ``x-kubernetes-validations`` CEL rules, evaluated with ``cel-python`` plus the Kubernetes CEL
   extension functions the shipped CRDs use (``find``, ``split``, and a few string helpers).
   Transition rules (those naming ``oldSelf``) run only when an old object is given.

Object metadata (name, label and annotation syntax) is checked the way the apiserver does for every
kind. Errors name the manifest, the field path and the failed rule.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rayscale.extras import missing_extra

try:  # CRD schemas are checked with jsonschema, their CEL rules with cel-python
    import jsonschema
except ImportError as e:
    raise missing_extra("kube", "checking manifests against CRD schemas") from e

__all__ = [
    "CRDSchema",
    "SchemaError",
    "crd_dir",
    "find_crds",
    "load_crd",
    "load_crds",
    "validate_all",
    "validate_file",
    "validate_metadata",
]

# Groups served by the apiserver itself: no CRD to check against, only metadata.
BUILTIN_GROUPS = frozenset(
    {
        "",
        "apps",
        "batch",
        "policy",
        "autoscaling",
        "networking.k8s.io",
        "rbac.authorization.k8s.io",
        "storage.k8s.io",
        "scheduling.k8s.io",
        "coordination.k8s.io",
        "apiextensions.k8s.io",
    }
)


def crd_dir() -> Path:
    """Where the CRD YAMLs live: $RAYSCALE_CRDS, else ``shared/crds`` beside the repository."""
    env = os.environ.get("RAYSCALE_CRDS")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    for candidate in (repo.parent / "shared" / "crds", repo / "shared" / "crds"):
        if candidate.is_dir():
            return candidate
    return repo.parent / "shared" / "crds"


@dataclass(frozen=True)
class SchemaError:
    """One validation failure: where (manifest, object, field path), what rule, against which CRD."""

    source: str
    obj: str
    path: str
    rule: str
    message: str
    crd: str = ""

    def __str__(self) -> str:
        against = f" (against {self.crd})" if self.crd else ""
        return (
            f"{self.source}: {self.obj}: {self.path or '<root>'}: {self.message} [rule: {self.rule}]{against}"
        )


# ---------------------------------------------------------------------------------------------------
# metadata checks (apimachinery validation, same for every kind)

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _check_qualified_key(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        return f"prefix of key {key!r} must be a DNS-1123 subdomain of at most 253 characters"
    if not name or len(name) > 63 or not _QUALIFIED_NAME.match(name):
        return f"name part of key {key!r} must be at most 63 alphanumeric characters, '-', '_' or '.'"
    return None


def validate_metadata(obj: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """Return (path, rule, message) for invalid object metadata, as the apiserver would reject it."""
    errs: list[tuple[str, str, str]] = []
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        return [("metadata", "required", "metadata is required")]
    name = meta.get("name")
    if name is None and not meta.get("generateName"):
        errs.append(("metadata.name", "required", "name or generateName is required"))
    elif name is not None and (
        not isinstance(name, str) or len(name) > 253 or not _DNS1123_SUBDOMAIN.match(name)
    ):
        errs.append(
            (
                "metadata.name",
                "dns1123-subdomain",
                f"invalid name {name!r}: must be a lowercase RFC 1123 subdomain",
            )
        )
    ns = meta.get("namespace")
    if ns is not None and (not isinstance(ns, str) or len(ns) > 63 or not _DNS1123_LABEL.match(ns)):
        errs.append(("metadata.namespace", "dns1123-label", f"invalid namespace {ns!r}"))
    for kind in ("labels", "annotations"):
        entries = meta.get(kind)
        if entries is None:
            continue
        if not isinstance(entries, Mapping):
            errs.append((f"metadata.{kind}", "type", f"{kind} must be a map of strings"))
            continue
        for key, value in entries.items():
            msg = _check_qualified_key(str(key))
            if msg:
                errs.append((f"metadata.{kind}[{key}]", "qualified-name", msg))
            if not isinstance(value, str):
                errs.append((f"metadata.{kind}[{key}]", "type", f"value of {key!r} must be a string"))
            elif kind == "labels" and (len(value) > 63 or not _LABEL_VALUE.match(value)):
                errs.append(
                    (
                        f"metadata.labels[{key}]",
                        "label-value",
                        f"invalid label value {value!r}: at most 63 alphanumeric, '-', '_' or '.'",
                    )
                )
    return errs


# ---------------------------------------------------------------------------------------------------
# structural schema -> JSON Schema

_PASSTHROUGH = (
    "type",
    "enum",
    "pattern",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "required",
    "multipleOf",
    "uniqueItems",
    "format",
)
_INT_BOUNDS = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def _to_jsonschema(s: Mapping[str, Any], strict: bool) -> dict[str, Any]:
    out: dict[str, Any] = {k: copy.deepcopy(s[k]) for k in _PASSTHROUGH if k in s}
    # OpenAPI v3.0 exclusiveMinimum/Maximum are booleans; JSON Schema draft 7 wants numbers.
    for excl, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if s.get(excl) is True and bound in out:
            out[excl] = out.pop(bound)
    if s.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        if "anyOf" not in s:
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    fmt = s.get("format")
    if fmt in _INT_BOUNDS and s.get("type") == "integer":
        lo, hi = _INT_BOUNDS[fmt]
        out.setdefault("minimum", lo)
        out.setdefault("maximum", hi)
    if "properties" in s:
        out["properties"] = {k: _to_jsonschema(v, strict) for k, v in s["properties"].items()}
    if isinstance(s.get("additionalProperties"), Mapping):
        out["additionalProperties"] = _to_jsonschema(s["additionalProperties"], strict)
    elif "additionalProperties" in s:
        out["additionalProperties"] = s["additionalProperties"]
    if isinstance(s.get("items"), Mapping):
        out["items"] = _to_jsonschema(s["items"], strict)
    for key in ("allOf", "anyOf", "oneOf"):
        if key in s:
            out[key] = [_to_jsonschema(x, strict) for x in s[key]]
    if "not" in s:
        out["not"] = _to_jsonschema(s["not"], strict)
    if s.get("x-kubernetes-embedded-resource"):
        props = out.setdefault("properties", {})
        props.setdefault("apiVersion", {"type": "string"})
        props.setdefault("kind", {"type": "string"})
        props.setdefault("metadata", {"type": "object"})
    if (
        strict
        and s.get("type") == "object"
        and "additionalProperties" not in s
        and not s.get("x-kubernetes-preserve-unknown-fields")
    ):
        # Structural schemas prune unknown fields; strict validation reports them instead.
        out["additionalProperties"] = False
    if s.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    if s.get("nullable"):
        t = out.get("type")
        if isinstance(t, str):
            out["type"] = [t, "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


_GO_DURATION = re.compile(r"^[-+]?((\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h))+$|^0$")
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
_FORMATS = jsonschema.FormatChecker(formats=())
_FORMATS.checks("date-time")(lambda v: not isinstance(v, str) or bool(_RFC3339.match(v)))
_FORMATS.checks("duration")(lambda v: not isinstance(v, str) or bool(_GO_DURATION.match(v)))


def _fmt_path(parts: Iterable[Any]) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += f".{p}" if out else str(p)
    return out


# ---------------------------------------------------------------------------------------------------
# CEL (x-kubernetes-validations)

_CEL_ENV: Any = None


def _celpy() -> Any:
    try:
        import celpy
    except ImportError as e:
        raise missing_extra("kube", "checking CRD validation rules (CEL)") from e
    return celpy


def _k8s_cel_functions() -> dict[str, Any]:
    from celpy import celtypes

    def find(s: Any, pattern: Any) -> Any:
        m = re.search(str(pattern), str(s))
        return celtypes.StringType(m.group(0) if m else "")

    def find_all(s: Any, pattern: Any, *limit: Any) -> Any:
        found = [m.group(0) for m in re.finditer(str(pattern), str(s))]
        if limit:
            found = found[: int(limit[0])] if int(limit[0]) >= 0 else found
        return celtypes.ListType([celtypes.StringType(x) for x in found])

    def split(s: Any, sep: Any, *limit: Any) -> Any:
        parts = (
            str(s).split(str(sep), int(limit[0]) - 1)
            if limit and int(limit[0]) > 0
            else str(s).split(str(sep))
        )
        return celtypes.ListType([celtypes.StringType(x) for x in parts])

    def index_of(s: Any, sub: Any) -> Any:
        return celtypes.IntType(str(s).find(str(sub)))

    def join(lst: Any, sep: Any = "") -> Any:
        return celtypes.StringType(str(sep).join(str(x) for x in lst))

    return {
        "find": find,
        "findAll": find_all,
        "split": split,
        "indexOf": index_of,
        "join": join,
        "lowerAscii": lambda s: celtypes.StringType(str(s).lower()),
        "upperAscii": lambda s: celtypes.StringType(str(s).upper()),
        "trim": lambda s: celtypes.StringType(str(s).strip()),
        "replace": lambda s, a, b: celtypes.StringType(str(s).replace(str(a), str(b))),
    }


# cel-python built-ins plus the extensions above; a rule calling anything else cannot be checked here.
CEL_SUPPORTED_FUNCTIONS = frozenset(
    {
        "all",
        "exists",
        "exists_one",
        "filter",
        "map",
        "has",
        "size",
        "int",
        "uint",
        "double",
        "string",
        "bool",
        "bytes",
        "duration",
        "timestamp",
        "matches",
        "startsWith",
        "endsWith",
        "contains",
        "type",
        "find",
        "findAll",
        "split",
        "indexOf",
        "join",
        "lowerAscii",
        "upperAscii",
        "trim",
        "replace",
    }
)


def cel_functions_used(rule: str) -> set[str]:
    """Function and macro names a CEL rule calls (string literals are ignored)."""
    code = re.sub(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", "''", rule)
    return set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*\(", code))


@functools.lru_cache(maxsize=4096)
def _cel_program(rule: str) -> Any:
    global _CEL_ENV
    celpy = _celpy()

    if _CEL_ENV is None:
        _CEL_ENV = celpy.Environment()
    return _CEL_ENV.program(_CEL_ENV.compile(rule), functions=_k8s_cel_functions())


def eval_cel(rule: str, value: Any, old: Any = None, has_old: bool = False) -> tuple[bool, str]:
    """Evaluate one rule; (passed, error detail). A runtime error fails the rule, as in Kubernetes."""
    # cel-python evaluates slowly (milliseconds a rule); the same rule on the same value repeats a lot.
    key = (
        rule,
        json.dumps(value, sort_keys=True, default=str),
        json.dumps(old, sort_keys=True, default=str) if has_old else None,
    )
    return _eval_cel_cached(*key, value, old, has_old)


def _eval_cel_cached(
    rule: str, value_key: str, old_key: str | None, value: Any, old: Any, has_old: bool
) -> tuple[bool, str]:
    cache_key = (rule, value_key, old_key)
    hit = _CEL_RESULTS.get(cache_key)
    if hit is not None:
        return hit
    result = _eval_cel_uncached(rule, value, old, has_old)
    if len(_CEL_RESULTS) > 20000:
        _CEL_RESULTS.clear()
    _CEL_RESULTS[cache_key] = result
    return result


_CEL_RESULTS: dict[tuple[str, str, str | None], tuple[bool, str]] = {}


def _eval_cel_uncached(rule: str, value: Any, old: Any, has_old: bool) -> tuple[bool, str]:
    celpy = _celpy()

    unsupported = cel_functions_used(rule) - CEL_SUPPORTED_FUNCTIONS
    if unsupported:
        return True, f"not checked: unsupported CEL functions {sorted(unsupported)}"
    activation = {"self": celpy.json_to_cel(value)}
    if has_old:
        activation["oldSelf"] = celpy.json_to_cel(old)
    try:
        result = _cel_program(rule).evaluate(activation)
    except Exception as exc:  # cel-python raises CELEvalError (and others) on runtime errors
        return False, f"evaluation error: {exc.args[0] if exc.args else exc}"
    if isinstance(result, celpy.CELEvalError):
        return False, f"evaluation error: {result.args[0] if result.args else result}"
    return bool(result), ""


# ---------------------------------------------------------------------------------------------------
# one CRD


@dataclass
class _Version:
    name: str
    schema: dict[str, Any]
    subresources: dict[str, Any]
    validator_strict: Any = None
    validator_lax: Any = None


@dataclass
class CRDSchema:
    """A CustomResourceDefinition file and the schemas of its served versions."""

    path: Path
    group: str
    kind: str
    plural: str
    singular: str
    list_kind: str
    scope: str
    versions: dict[str, _Version] = field(default_factory=dict)
    storage_version: str = ""
    short_names: tuple[str, ...] = ()

    @property
    def namespaced(self) -> bool:
        return self.scope == "Namespaced"

    @property
    def label(self) -> str:
        """A short name for error messages, e.g. ``aws-vendored/karpenter.sh_nodepools.yaml``."""
        return (
            f"{self.path.parent.name}/{self.path.name}" if self.path.parent.name != "crds" else self.path.name
        )

    def has_status_subresource(self, version: str) -> bool:
        return "status" in self.versions[version].subresources

    # -- defaulting and pruning --------------------------------------------------------------------

    def apply_defaults(self, obj: dict[str, Any], version: str | None = None) -> dict[str, Any]:
        """Return a copy of obj with schema defaults filled in (what the apiserver stores)."""
        v = self.versions[version or _version_of(obj) or self.storage_version]
        out = copy.deepcopy(obj)
        _default(v.schema, out)
        return out

    def prune(self, obj: dict[str, Any], version: str | None = None) -> tuple[dict[str, Any], list[str]]:
        """Return a copy of obj without fields the schema does not know, and their paths."""
        v = self.versions[version or _version_of(obj) or self.storage_version]
        out = copy.deepcopy(obj)
        removed: list[str] = []
        _prune(v.schema, out, [], removed, root=True)
        return out, removed

    # -- validation --------------------------------------------------------------------------------

    def _validator(self, version: str, strict: bool) -> Any:
        v = self.versions[version]
        attr = "validator_strict" if strict else "validator_lax"
        if getattr(v, attr) is None:
            js = _to_jsonschema(v.schema, strict)
            props = js.setdefault("properties", {})
            # The apiserver checks metadata itself (validate_metadata); the CRD says only "object".
            props["metadata"] = {"type": "object"}
            props["apiVersion"] = {"type": "string"}
            props["kind"] = {"type": "string"}
            setattr(v, attr, jsonschema.Draft7Validator(js, format_checker=_FORMATS))
        return getattr(v, attr)

    def validate(
        self,
        obj: Mapping[str, Any],
        *,
        old: Mapping[str, Any] | None = None,
        source: str = "<manifest>",
        strict: bool = True,
        defaults: bool = True,
        cel: bool = True,
    ) -> list[SchemaError]:
        """Check obj (and, for transition rules, old) against this CRD; empty list when valid."""
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
        assert isinstance(meta, Mapping)
        label = f"{obj.get('kind', '?')}/{meta.get('name') or meta.get('generateName') or '?'}"

        def err(path: str, rule: str, message: str) -> SchemaError:
            return SchemaError(source, label, path, rule, message, self.label)

        group, _, version = str(obj.get("apiVersion", "")).rpartition("/")
        if group != self.group or obj.get("kind") != self.kind:
            return [
                err(
                    "apiVersion",
                    "kind",
                    f"{obj.get('apiVersion')}/{obj.get('kind')} is not {self.group}/{self.kind}",
                )
            ]
        if version not in self.versions:
            return [
                err(
                    "apiVersion",
                    "served-version",
                    f"version {version!r} is not served (have {sorted(self.versions)})",
                )
            ]
        errors = [err(p, r, m) for p, r, m in validate_metadata(obj)]
        if self.namespaced is False and meta.get("namespace"):
            errors.append(
                err("metadata.namespace", "cluster-scoped", f"{self.kind} is cluster-scoped: no namespace")
            )
        data: dict[str, Any] = dict(copy.deepcopy(obj))
        if defaults:
            _default(self.versions[version].schema, data)
        for e in sorted(
            self._validator(version, strict).iter_errors(data), key=lambda e: list(e.absolute_path)
        ):
            errors.extend(_js_error(e, err))
        errors.extend(err(p, r, m) for p, r, m in _check_list_maps(self.versions[version].schema, data, []))
        # Like the apiserver, skip CEL when the structure is already wrong (rules assume their types).
        if cel and not errors:
            old_data = None
            if old is not None:
                old_data = dict(copy.deepcopy(old))
                if defaults:
                    _default(self.versions[version].schema, old_data)
            for path, rule, message in _walk_cel(
                self.versions[version].schema, data, [], old_data, old is not None
            ):
                errors.append(err(path, rule, message))
        return errors


def _js_error(e: Any, err: Any) -> list[SchemaError]:
    parts = list(e.absolute_path)
    if e.validator == "required" and isinstance(e.instance, Mapping):
        return [
            err(_fmt_path([*parts, r]), "required", f"Required value: {r!r} is required")
            for r in e.validator_value
            if r not in e.instance
        ]
    if (
        e.validator == "additionalProperties"
        and e.validator_value is False
        and isinstance(e.instance, Mapping)
    ):
        known = set(e.schema.get("properties", {}))
        return [
            err(_fmt_path([*parts, k]), "unknown-field", f"unknown field {k!r}")
            for k in e.instance
            if k not in known
        ]
    rule = (
        f"{e.validator}: {e.validator_value!r}"
        if e.validator in ("pattern", "enum", "format")
        else str(e.validator)
    )
    message = e.message if len(e.message) < 300 else e.message[:300] + "..."
    return [err(_fmt_path(parts), rule, message)]


def _version_of(obj: Mapping[str, Any]) -> str:
    return str(obj.get("apiVersion", "")).rpartition("/")[2]


def _default(schema: Mapping[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for k, sub in props.items():
            if k not in value and "default" in sub:
                value[k] = copy.deepcopy(sub["default"])
            if k in value:
                _default(sub, value[k])
        addl = schema.get("additionalProperties")
        if isinstance(addl, Mapping):
            for k, v in value.items():
                if k not in props:
                    _default(addl, v)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for item in value:
            _default(schema["items"], item)


def _prune(
    schema: Mapping[str, Any], value: Any, path: list[Any], removed: list[str], root: bool = False
) -> None:
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        keep_unknown = bool(schema.get("x-kubernetes-preserve-unknown-fields")) or addl is not None
        embedded = schema.get("x-kubernetes-embedded-resource") or root
        for k in list(value):
            if embedded and k in ("apiVersion", "kind", "metadata"):
                continue  # ObjectMeta is the apiserver's, never pruned by the CRD schema
            if k in props:
                _prune(props[k], value[k], [*path, k], removed)
            elif isinstance(addl, Mapping):
                _prune(addl, value[k], [*path, k], removed)
            elif not keep_unknown:
                removed.append(_fmt_path([*path, k]))
                del value[k]
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            _prune(schema["items"], item, [*path, i], removed)


def _walk_cel(
    schema: Mapping[str, Any], value: Any, path: list[Any], old: Any, has_old: bool
) -> Iterator[tuple[str, str, str]]:
    if has_old and value == old:
        # Validation ratcheting (KEP-4008, on by default since Kubernetes 1.30): an unchanged value
        # is not re-checked on update, so an old object stays writable after a CRD tightens.
        return
    for rule_spec in schema.get("x-kubernetes-validations") or ():
        rule = rule_spec["rule"]
        is_transition = re.search(r"\boldSelf\b", rule) is not None
        if is_transition and not has_old and not rule_spec.get("optionalOldSelf"):
            continue
        ok, detail = eval_cel(rule, value, old, has_old and is_transition)
        if not ok:
            at = _fmt_path(path)
            if rule_spec.get("fieldPath"):
                at = at + str(rule_spec["fieldPath"]) if at else str(rule_spec["fieldPath"]).lstrip(".")
            message = str(rule_spec.get("message") or f"failed rule: {rule}")
            yield at, rule, f"{message} ({detail})" if detail else message
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        old_map = old if isinstance(old, dict) else {}
        for k, v in value.items():
            sub = props.get(k) if k in props else (addl if isinstance(addl, Mapping) else None)
            if sub is not None:
                yield from _walk_cel(sub, v, [*path, k], old_map.get(k), has_old and k in old_map)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        items = schema["items"]
        keys = (
            schema.get("x-kubernetes-list-map-keys")
            if schema.get("x-kubernetes-list-type") == "map"
            else None
        )
        old_list = old if isinstance(old, list) else []
        for i, v in enumerate(value):
            # Only map-lists correlate old and new elements (by key), as in Kubernetes.
            match = None
            if keys and isinstance(v, dict):
                match = next(
                    (o for o in old_list if isinstance(o, dict) and all(o.get(k) == v.get(k) for k in keys)),
                    None,
                )
            yield from _walk_cel(items, v, [*path, i], match, has_old and match is not None)


def _check_list_maps(
    schema: Mapping[str, Any], value: Any, path: list[Any]
) -> Iterator[tuple[str, str, str]]:
    """Duplicate keys in ``x-kubernetes-list-type: map`` lists (JSON Schema cannot say this)."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        for k, v in value.items():
            sub = props.get(k) if k in props else (addl if isinstance(addl, Mapping) else None)
            if sub is not None:
                yield from _check_list_maps(sub, v, [*path, k])
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        keys = (
            schema.get("x-kubernetes-list-map-keys")
            if schema.get("x-kubernetes-list-type") == "map"
            else None
        )
        seen: set[tuple[Any, ...]] = set()
        for i, v in enumerate(value):
            if keys and isinstance(v, dict):
                key = tuple(repr(v.get(k)) for k in keys)
                if key in seen:
                    yield (
                        _fmt_path([*path, i]),
                        "x-kubernetes-list-type: map",
                        f"Duplicate value: {dict(zip(keys, key, strict=True))}",
                    )
                seen.add(key)
            yield from _check_list_maps(schema["items"], v, [*path, i])


# ---------------------------------------------------------------------------------------------------
# loading and lookup


@functools.lru_cache(maxsize=64)
def load_crd(path: str | Path) -> CRDSchema:
    """Load one CRD YAML file (cached: the KubeRay ones are about 1 MB)."""
    p = Path(path)
    with p.open() as f:
        doc = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"{p}: not a CustomResourceDefinition")
    spec = doc["spec"]
    names = spec["names"]
    crd = CRDSchema(
        path=p,
        group=spec["group"],
        kind=names["kind"],
        plural=names["plural"],
        singular=names.get("singular", names["kind"].lower()),
        list_kind=names.get("listKind", names["kind"] + "List"),
        scope=spec.get("scope", "Namespaced"),
        short_names=tuple(names.get("shortNames") or ()),
    )
    for v in spec["versions"]:
        if not v.get("served", True):
            continue
        schema = (v.get("schema") or {}).get("openAPIV3Schema") or {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
        }
        crd.versions[v["name"]] = _Version(v["name"], schema, v.get("subresources") or {})
        if v.get("storage"):
            crd.storage_version = v["name"]
    if not crd.storage_version:
        crd.storage_version = next(iter(crd.versions))
    return crd


def load_crds(directory: str | Path | None = None) -> list[CRDSchema]:
    """Every CRD below directory (default crd_dir()), including the aws-vendored Karpenter copies."""
    root = Path(directory) if directory else crd_dir()
    return [load_crd(p) for p in sorted(root.rglob("*.yaml")) if _is_crd_file(p)]


@functools.lru_cache(maxsize=256)
def _is_crd_file(p: Path) -> bool:
    with p.open() as f:
        head = f.read(512)
    return "kind: CustomResourceDefinition" in head


def find_crds(api_version: str, kind: str, crds: Iterable[CRDSchema] | None = None) -> list[CRDSchema]:
    group = api_version.rpartition("/")[0]
    return [c for c in (crds if crds is not None else load_crds()) if c.group == group and c.kind == kind]


def validate_all(
    manifest: Mapping[str, Any],
    *,
    source: str = "<manifest>",
    crds: Iterable[CRDSchema] | None = None,
    strict: bool = True,
) -> list[SchemaError]:
    """Validate against every CRD whose group and kind match (both Karpenter variants for karpenter.sh).

    Built-in kinds (core, apps, ...) get the metadata checks only. An unknown custom kind is an error.
    """
    api_version = str(manifest.get("apiVersion", ""))
    kind = str(manifest.get("kind", ""))
    meta = manifest.get("metadata") if isinstance(manifest.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    label = f"{kind or '?'}/{meta.get('name', '?')}"
    group = api_version.rpartition("/")[0]
    if not api_version or not kind:
        return [SchemaError(source, label, "", "apiVersion/kind", "apiVersion and kind are required")]
    if group in BUILTIN_GROUPS:
        return [SchemaError(source, label, p, r, m, "apiserver") for p, r, m in validate_metadata(manifest)]
    matching = find_crds(api_version, kind, crds)
    if not matching:
        return [SchemaError(source, label, "apiVersion", "crd", f"no CRD for {api_version} {kind}")]
    errors: list[SchemaError] = []
    for crd in matching:
        errors.extend(crd.validate(manifest, source=source, strict=strict))
    return errors


def validate_file(
    path: str | Path, crds: Iterable[CRDSchema] | None = None, strict: bool = True
) -> list[SchemaError]:
    """Validate every document of a (multi-document) YAML manifest file."""
    p = Path(path)
    crd_list = list(crds) if crds is not None else load_crds()
    errors: list[SchemaError] = []
    with p.open() as f:
        for i, doc in enumerate(yaml.safe_load_all(f)):
            if doc is None:
                continue
            if not isinstance(doc, Mapping):
                errors.append(
                    SchemaError(str(p), f"document {i}", "", "object", "a manifest must be a mapping")
                )
                continue
            errors.extend(validate_all(doc, source=str(p), crds=crd_list, strict=strict))
    return errors
