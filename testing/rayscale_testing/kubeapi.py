"""A local Kubernetes API server emulator over real HTTP, for tests, the simulator and the demo.

Why not kmock: kmock (``KubernetesEmulator``) is an aiohttp mock whose emulation answers create with
200, ignores label selectors, keeps no resourceVersion, uid or generation, never conflicts and has no
PUT. Those are exactly the semantics a controller depends on, so most of it would have to be replaced,
and it would bring an asyncio loop into a thread next to the synchronous ``kubernetes`` client. This
module is written on the standard library instead (``http.server.ThreadingHTTPServer``, one thread per
connection, chunked responses for watches): no extra dependency, and every behaviour is ours to test.

What it keeps, as a kube-apiserver does:
- core/v1 namespaces, pods, nodes, services, configmaps, secrets, events; apps/v1 deployments; and any
  CRD file given (default: Karpenter NodePool/NodeClaim, EC2NodeClass, KubeRay RayCluster/RayService
  from ``shared/crds``), with the ``/status`` subresource where the CRD declares it;
- discovery (``/api``, ``/apis``, ``/apis/{group}/{version}``, ``/version``);
- create answers 201 with uid, resourceVersion (one global counter), generation and creationTimestamp;
  409 AlreadyExists on a duplicate; ``generateName``; the namespace must exist;
- get, list and watch with ``labelSelector`` (=, ==, !=, in, notin, exists, !exists) and
  ``fieldSelector`` (metadata.name, metadata.namespace; spec.nodeName and status.phase for pods),
  list ``limit``/``continue``;
- PUT with 409 Conflict on a stale resourceVersion; PATCH as JSON merge patch, JSON patch (RFC 6902)
  and strategic merge patch (built-in kinds only, with the merge keys of the fields controllers
  touch; a CRD answers 415 as the apiserver does); a no-op write bumps nothing and sends no event;
- status is ignored on main-resource writes and everything but status on ``/status`` writes;
  generation moves only when something outside metadata and status changes;
- DELETE honours finalizers (deletionTimestamp set, 202, removed once the finalizers are gone; no new
  finalizers on a terminating object), preconditions, 404 when missing, and garbage-collects
  dependents by ownerReferences; deleting a namespace deletes its objects;
- watch from a resourceVersion (or the current state as ADDED events when none or "0" is given) with
  ADDED/MODIFIED/DELETED, selector transitions (an object leaving the selector is DELETED for that
  watcher), ``timeoutSeconds``, and an ERROR event with a 410 Expired Status when the resourceVersion is
  older than the bounded event history, exactly what ``kubernetes.watch.Watch`` handles;
- errors as ``Status`` objects in the real shape (kind, status Failure, message, reason, details, code);
- custom resources are defaulted and validated against every CRD variant loaded for their kind (both
  Karpenter variants when given), incl. CEL rules and transition rules; failures answer 422 Invalid
  with causes. Unknown fields answer 422 (``fieldValidation=Strict`` is this server's default, so that
  typos fail tests); ``fieldValidation=Warn``/``Ignore`` prune them instead.

Test hooks: ``faults`` (the next N requests matching verb/resource answer 429 with Retry-After, 5xx or
409, or are delayed), ``requests`` (a log of every request and its answer), ``break_watches()`` (drop
every open watch, like a connection reset), ``compact()`` (forget event history, so older
resourceVersions answer 410), and ``store`` for in-process access by the test stand-ins.

Not emulated: authentication, admission webhooks, server-side apply, protobuf, resourceVersionMatch,
bookmarks, pod graceful termination (pods without finalizers go at once; there is no kubelet).
"""

from __future__ import annotations

import base64
import binascii
import bisect
import builtins
import copy
import json
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from rayscale.cluster import crdschema

__all__ = [
    "ApiError",
    "Fault",
    "FaultInjector",
    "KubeAPIServer",
    "LabelSelector",
    "RequestRecord",
    "ResourceType",
    "Store",
    "WatchEvent",
    "now_rfc3339",
]

Obj = dict[str, Any]


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------------------------------
# errors


class ApiError(Exception):
    """An error answered as a Kubernetes ``Status`` object."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = dict(details or {})
        self.headers = dict(headers or {})

    def status(self) -> Obj:
        out: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            out["details"] = self.details
        return out


def _details(rt: ResourceType, name: str | None) -> dict[str, Any]:
    d: dict[str, Any] = {"kind": rt.plural}
    if rt.group:
        d["group"] = rt.group
    if name:
        d["name"] = name
    return d


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.qualified} "{name}" not found', details=_details(rt, name))


def conflict(rt: ResourceType, name: str, why: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rt.qualified} "{name}": {why}',
        details=_details(rt, name),
    )


def invalid(rt: ResourceType, name: str, causes: list[tuple[str, str]]) -> ApiError:
    text = ", ".join(f"{f}: {m}" for f, m in causes)
    return ApiError(
        422,
        "Invalid",
        f'{rt.kind}.{rt.group or "core"} "{name}" is invalid: {text}',
        details={
            **_details(rt, name),
            "kind": rt.kind,
            "causes": [{"reason": "FieldValueInvalid", "message": m, "field": f} for f, m in causes],
        },
    )


# kubernetes pkg/apis/core/validation/validation.go ValidateConfigMap: the values of data and binaryData
# (binaryData decoded from base64) may total at most core.MaxSecretSize, 1 MiB, per object.
MAX_CONFIGMAP_BYTES = 1024 * 1024


def _configmap_size(obj: Mapping[str, Any]) -> list[tuple[str, str]]:
    total = sum(len(str(v).encode()) for v in (obj.get("data") or {}).values())
    try:
        total += sum(len(base64.b64decode(v, validate=True)) for v in (obj.get("binaryData") or {}).values())
    except (binascii.Error, TypeError) as e:
        return [("binaryData", f"Invalid value: not base64 ({e})")]
    if total > MAX_CONFIGMAP_BYTES:
        return [("", f"Too long: may not be more than {MAX_CONFIGMAP_BYTES} bytes")]
    return []


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


# ---------------------------------------------------------------------------------------------------
# resource types


@dataclass(frozen=True)
class ResourceType:
    group: str
    versions: tuple[str, ...]
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    status_subresource: bool = True
    # Nodes may carry status on create (kubelet registers that way); pods and CRs may not.
    status_on_create: bool = False
    crds: tuple[crdschema.CRDSchema, ...] = ()

    @property
    def key(self) -> str:
        """``plural.group`` (``plural`` for core), the name used by Store and the fault rules."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified(self) -> str:
        return self.key

    @property
    def list_kind(self) -> str:
        return self.kind + "List"

    def api_version(self, version: str | None = None) -> str:
        v = version or self.versions[0]
        return f"{self.group}/{v}" if self.group else v


def _core(plural: str, kind: str, namespaced: bool, status: bool = True, **kw: Any) -> ResourceType:
    return ResourceType("", ("v1",), plural, kind, namespaced, kind.lower(), status_subresource=status, **kw)


BUILTIN_TYPES: tuple[ResourceType, ...] = (
    _core("namespaces", "Namespace", False, short_names=("ns",)),
    _core("pods", "Pod", True, short_names=("po",)),
    _core("nodes", "Node", False, short_names=("no",), status_on_create=True),
    _core("services", "Service", True, short_names=("svc",)),
    _core("configmaps", "ConfigMap", True, status=False, short_names=("cm",)),
    _core("secrets", "Secret", True, status=False),
    _core("events", "Event", True, status=False, short_names=("ev",)),
    ResourceType("apps", ("v1",), "deployments", "Deployment", True, "deployment", ("deploy",)),
    # Leader election (client-go's leaderelection, resourcelock/leaselock.go): a Lease has a spec, no status.
    ResourceType("coordination.k8s.io", ("v1",), "leases", "Lease", True, "lease", status_subresource=False),
)

# The CRD files a default server serves. Karpenter kinds are validated against both variants.
DEFAULT_CRD_FILES = (
    "karpenter.sh_nodepools.yaml",
    "karpenter.sh_nodeclaims.yaml",
    "karpenter.k8s.aws_ec2nodeclasses.yaml",
    "ray.io_rayclusters.yaml",
    "ray.io_rayservices.yaml",
    "aws-vendored/karpenter.sh_nodepools.yaml",
    "aws-vendored/karpenter.sh_nodeclaims.yaml",
)


def resource_types_from_crds(paths: Iterable[str | Path]) -> list[ResourceType]:
    """One ResourceType per group/kind; the first file for a kind is primary (storage, defaults)."""
    by_kind: dict[tuple[str, str], list[crdschema.CRDSchema]] = {}
    for p in paths:
        crd = crdschema.load_crd(Path(p))
        by_kind.setdefault((crd.group, crd.kind), []).append(crd)
    out = []
    for crds in by_kind.values():
        c = crds[0]
        versions = (c.storage_version, *[v for v in c.versions if v != c.storage_version])
        out.append(
            ResourceType(
                c.group,
                versions,
                c.plural,
                c.kind,
                c.namespaced,
                c.singular,
                c.short_names,
                status_subresource=c.has_status_subresource(c.storage_version),
                crds=tuple(crds),
            )
        )
    return out


# ---------------------------------------------------------------------------------------------------
# selectors


_SEL_TOKEN = re.compile(r"\s*(!=|==|=|\(|\)|,|!|[A-Za-z0-9_./-]+)")


@dataclass(frozen=True)
class _Req:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        has = self.key in labels
        val = labels.get(self.key)
        if self.op == "exists":
            return has
        if self.op == "!exists":
            return not has
        if self.op == "=":
            return has and val == self.values[0]
        if self.op == "!=":
            return not has or val != self.values[0]
        if self.op == "in":
            return has and val in self.values
        return not has or val not in self.values  # notin


@dataclass(frozen=True)
class LabelSelector:
    """A parsed label selector in the string syntax of the API (``a=b,c!=d,e in (f,g),!h``)."""

    requirements: tuple[_Req, ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> LabelSelector:
        if not text or not text.strip():
            return cls()
        tokens = _SEL_TOKEN.findall(text)
        if "".join(tokens).replace(" ", "") != text.replace(" ", ""):
            raise bad_request(f"unable to parse requirement: invalid label selector {text!r}")
        reqs: list[_Req] = []
        i = 0

        def take() -> str:
            nonlocal i
            if i >= len(tokens):
                raise bad_request(f"unable to parse requirement: unexpected end of selector {text!r}")
            i += 1
            return tokens[i - 1]

        while i < len(tokens):
            tok = take()
            if tok == "!":
                reqs.append(_Req(_check_key(take(), text), "!exists"))
            else:
                key = _check_key(tok, text)
                nxt = tokens[i] if i < len(tokens) else ","
                if nxt == ",":
                    reqs.append(_Req(key, "exists"))
                elif nxt in ("=", "==", "!="):
                    take()
                    value = take()
                    if value in ("(", ")", ",", "!", "=", "==", "!="):
                        raise bad_request(f"unable to parse requirement: invalid value in {text!r}")
                    reqs.append(_Req(key, "!=" if nxt == "!=" else "=", (value,)))
                elif nxt in ("in", "notin"):
                    take()
                    if take() != "(":
                        raise bad_request(f"unable to parse requirement: expected '(' in {text!r}")
                    values: list[str] = []
                    while True:
                        v = take()
                        if v == ")":
                            break
                        if v == ",":
                            continue
                        values.append(v)
                    reqs.append(_Req(key, nxt, tuple(values)))
                else:
                    raise bad_request(f"unable to parse requirement: unexpected {nxt!r} in {text!r}")
            if i < len(tokens) and take() != ",":
                raise bad_request(f"unable to parse requirement: expected ',' in {text!r}")
        return cls(tuple(reqs))

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        lab = labels or {}
        return all(r.matches(lab) for r in self.requirements)


def _check_key(key: str, text: str) -> str:
    if key in ("in", "notin", "(", ")", ",", "=", "==", "!=", "!"):
        raise bad_request(f"unable to parse requirement: invalid key {key!r} in {text!r}")
    return key


def _involved(field: str) -> Callable[[Obj], str]:
    return lambda o: str((o.get("involvedObject") or {}).get(field, ""))


_FIELD_PATHS: dict[str, Callable[[Obj], str]] = {
    "metadata.name": lambda o: o.get("metadata", {}).get("name", ""),
    "metadata.namespace": lambda o: o.get("metadata", {}).get("namespace", ""),
    "spec.nodeName": lambda o: (o.get("spec") or {}).get("nodeName", ""),
    "status.phase": lambda o: (o.get("status") or {}).get("phase", ""),
    **{f"involvedObject.{f}": _involved(f) for f in ("kind", "name", "namespace", "uid", "apiVersion")},
    "reason": lambda o: str(o.get("reason", "")),
    "type": lambda o: str(o.get("type", "")),
}
# The field selectors the real apiserver accepts beyond metadata.name/namespace (pkg/registry/core/
# pod/strategy.go and event/strategy.go ToSelectableFields).
_FIELDS_FOR = {
    "pods": ("spec.nodeName", "status.phase"),
    "events": (
        "involvedObject.kind", "involvedObject.name", "involvedObject.namespace", "involvedObject.uid",
        "involvedObject.apiVersion", "reason", "type",
    ),
}


@dataclass(frozen=True)
class FieldSelector:
    requirements: tuple[tuple[str, bool, str], ...] = ()  # (path, equal, value)

    @classmethod
    def parse(cls, text: str | None, rt: ResourceType) -> FieldSelector:
        if not text or not text.strip():
            return cls()
        reqs = []
        allowed = {"metadata.name", "metadata.namespace", *_FIELDS_FOR.get(rt.key, ())}
        for part in text.split(","):
            m = re.fullmatch(r"\s*([A-Za-z.]+)\s*(==|!=|=)\s*([^,]*)\s*", part)
            if not m:
                raise bad_request(f"invalid field selector: {part!r}")
            if m.group(1) not in allowed:
                raise bad_request(f'field label not supported: "{m.group(1)}"')
            reqs.append((m.group(1), m.group(2) != "!=", m.group(3)))
        return cls(tuple(reqs))

    def matches(self, obj: Obj) -> bool:
        return all((_FIELD_PATHS[p](obj) == v) == eq for p, eq, v in self.requirements)


# ---------------------------------------------------------------------------------------------------
# patches


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


# Merge keys of the built-in list fields a controller patches (from the Kubernetes API types).
_SMP_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "conditions": "type",
    "ownerReferences": "uid",
    "imagePullSecrets": "name",
}
_SMP_SET_LISTS = {"finalizers"}


def strategic_merge_patch(target: Any, patch: Any, key: str = "") -> Any:
    """Strategic merge patch for the fields above; other lists are replaced, as their strategy says."""
    if isinstance(patch, dict) and (isinstance(target, dict) or target is None):
        out = copy.deepcopy(target) if isinstance(target, dict) else {}
        for k, v in patch.items():
            if k.startswith("$"):
                continue  # directives ($patch, $retainKeys, $setElementOrder) are not emulated
            if v is None:
                out.pop(k, None)
            else:
                out[k] = strategic_merge_patch(out.get(k), v, k)
        return out
    if isinstance(patch, list) and isinstance(target, list):
        if key in _SMP_SET_LISTS:
            return [*target, *[x for x in patch if x not in target]]
        mkey = _SMP_KEYS.get(key)
        if mkey and all(isinstance(x, dict) for x in patch):
            out_list = copy.deepcopy(target)
            for item in patch:
                idx = next(
                    (
                        i
                        for i, t in enumerate(out_list)
                        if isinstance(t, dict) and t.get(mkey) == item.get(mkey)
                    ),
                    None,
                )
                if item.get("$patch") == "delete":
                    if idx is not None:
                        out_list.pop(idx)
                elif idx is None:
                    out_list.append(copy.deepcopy(item))
                else:
                    out_list[idx] = strategic_merge_patch(out_list[idx], item)
            return out_list
    return copy.deepcopy(patch)


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ValueError(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(doc: Any, ops: list[Mapping[str, Any]]) -> Any:
    """RFC 6902 JSON patch; raises ValueError on a failed op or test."""
    doc = copy.deepcopy(doc)

    def parent(parts: list[str]) -> tuple[Any, str]:
        cur = doc
        for p in parts[:-1]:
            cur = cur[int(p)] if isinstance(cur, list) else cur[p]
        return cur, parts[-1]

    def get(parts: list[str]) -> Any:
        cur = doc
        for p in parts:
            cur = cur[int(p)] if isinstance(cur, list) else cur[p]
        return cur

    def add(parts: list[str], value: Any) -> None:
        nonlocal doc
        if not parts:
            doc = value
            return
        cont, last = parent(parts)
        if isinstance(cont, list):
            idx = len(cont) if last == "-" else int(last)
            if idx > len(cont):
                raise ValueError("index out of range")
            cont.insert(idx, value)
        else:
            cont[last] = value

    def remove(parts: list[str]) -> Any:
        cont, last = parent(parts)
        return cont.pop(int(last)) if isinstance(cont, list) else cont.pop(last)

    for op in ops:
        try:
            kind = op["op"]
            parts = _pointer(op["path"])
            if kind == "add":
                add(parts, copy.deepcopy(op["value"]))
            elif kind == "remove":
                remove(parts)
            elif kind == "replace":
                get(parts)  # must exist
                remove(parts)
                add(parts, copy.deepcopy(op["value"]))
            elif kind == "move":
                add(parts, remove(_pointer(op["from"])))
            elif kind == "copy":
                add(parts, copy.deepcopy(get(_pointer(op["from"]))))
            elif kind == "test":
                if get(parts) != op["value"]:
                    raise ValueError(f"test failed at {op['path']}")
            else:
                raise ValueError(f"unknown op {kind!r}")
        except (KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"{op.get('op')} {op.get('path')}: {exc!r}") from exc
    return doc


# ---------------------------------------------------------------------------------------------------
# store


@dataclass(frozen=True)
class WatchEvent:
    rv: int
    type_key: str
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj
    old: Obj | None


_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # what apiserver's generateName uses


def _to_create(rt: ResourceType, body: Any, namespace: str | None, version: str | None) -> tuple[Obj, str]:
    """A create's body checked as the apiserver checks it before storage (kind, apiVersion, no
    resourceVersion, the namespace of the URL), as a copy with those set; and its namespace ("" if none)."""
    if not isinstance(body, Mapping):
        raise bad_request("the body of a create must be an object")
    obj: Obj = copy.deepcopy(dict(body))
    meta = obj.setdefault("metadata", {})
    if not isinstance(meta, dict):
        raise bad_request("metadata must be an object")
    api_version = rt.api_version(version)
    if obj.get("apiVersion") not in (None, api_version) or obj.get("kind") not in (None, rt.kind):
        raise bad_request(
            f"the API version in the data ({obj.get('apiVersion')}) or kind ({obj.get('kind')}) "
            f"does not match the expected {api_version} {rt.kind}"
        )
    obj["apiVersion"], obj["kind"] = api_version, rt.kind
    if meta.get("resourceVersion"):
        raise bad_request("resourceVersion should not be set on objects to be created")
    if not rt.namespaced:
        meta.pop("namespace", None)
        return obj, ""
    ns = namespace or meta.get("namespace") or ""
    if not ns:
        raise bad_request("the namespace of the object is required")
    if meta.get("namespace") not in (None, "", ns):
        raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
    meta["namespace"] = ns
    return obj, ns


def _check_update(rt: ResourceType, name: str, nmeta: Mapping[str, Any], cmeta: Mapping[str, Any]) -> None:
    """A PUT's preconditions: 409 on a stale resourceVersion or another object's uid."""
    if nmeta.get("resourceVersion") and nmeta["resourceVersion"] != cmeta["resourceVersion"]:
        raise conflict(
            rt, name, "the object has been modified; please apply your changes to the latest version and try again"
        )
    if nmeta.get("uid") and nmeta["uid"] != cmeta["uid"]:
        raise conflict(
            rt, name, f"Precondition failed: UID in precondition: {nmeta['uid']}, UID in object meta: {cmeta['uid']}"
        )


def _updated(rt: ResourceType, name: str, new: Obj, cur: Obj, subresource: str | None) -> Obj:
    """What a PUT stores before validation: on /status the current object with the new status; on the main
    resource the new object with the current status (where status is a subresource) and the metadata the
    server owns; no finalizer may be added to an object being deleted."""
    if subresource == "status":
        merged = copy.deepcopy(cur)
        if "status" in new:
            merged["status"] = new["status"]
        else:
            merged.pop("status", None)
        return merged
    if subresource:
        raise ApiError(404, "NotFound", f"the server could not find the requested resource ({subresource})")
    nmeta, cmeta = new["metadata"], cur["metadata"]
    new["apiVersion"], new["kind"] = cur["apiVersion"], rt.kind
    if rt.status_subresource:
        if "status" in cur:
            new["status"] = copy.deepcopy(cur["status"])
        else:
            new.pop("status", None)
    for k in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds",
              "generation"):
        if k in cmeta:
            nmeta[k] = cmeta[k]
        else:
            nmeta.pop(k, None)
    if cmeta.get("deletionTimestamp"):
        added = set(nmeta.get("finalizers") or ()) - set(cmeta.get("finalizers") or ())
        if added:
            raise invalid(rt, name, [("metadata.finalizers", "Forbidden: no new finalizers can be added if the "
                                      f"object is being deleted, found new finalizers {sorted(added)}")])
    return new


class Store:
    """Objects, the resourceVersion counter and the event history. Thread-safe; HTTP-free.

    The test stand-ins use it in process (they are other controllers, not the code under test), so they
    are never hit by fault injection; every write keeps the same semantics as over HTTP.
    """

    def __init__(
        self,
        types: Iterable[ResourceType],
        *,
        history_size: int = 2000,
        validate: bool = True,
        seed: int | None = 0,
    ) -> None:
        self.types: dict[str, ResourceType] = {}
        for t in types:
            self.types[t.key] = t
        self._objects: dict[str, dict[tuple[str, str], Obj]] = {k: {} for k in self.types}
        self.rv = 0
        self._history: builtins.list[WatchEvent] = []
        self._history_rvs: builtins.list[int] = []
        self.history_size = history_size
        self.compacted_rv = 0  # events at or below this resourceVersion may be gone
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.validate = validate
        self._rng = random.Random(seed)
        self._listeners: builtins.list[Callable[[WatchEvent], None]] = []

    # -- lookup ----------------------------------------------------------------------------------

    def type_for(self, name: str) -> ResourceType:
        """Find a type by key (``nodeclaims.karpenter.sh``), plural, kind or short name."""
        if name in self.types:
            return self.types[name]
        for t in self.types.values():
            if name in (t.plural, t.kind, t.singular, *t.short_names):
                return t
        raise KeyError(name)

    def add_listener(self, fn: Callable[[WatchEvent], None]) -> None:
        """fn(event) runs after every change, under the store lock: keep it short (set an Event)."""
        with self.lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[WatchEvent], None]) -> None:
        with self.lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    # -- reads -----------------------------------------------------------------------------------

    def get(self, type_name: str, name: str, namespace: str | None = None) -> Obj:
        rt = self.type_for(type_name)
        with self.lock:
            obj = self._objects[rt.key].get((self._ns(rt, namespace), name))
            if obj is None:
                raise not_found(rt, name)
            return copy.deepcopy(obj)

    def try_get(self, type_name: str, name: str, namespace: str | None = None) -> Obj | None:
        try:
            return self.get(type_name, name, namespace)
        except ApiError as e:
            if e.code == 404:
                return None
            raise

    def list(
        self,
        type_name: str,
        namespace: str | None = None,
        label_selector: str | LabelSelector | None = None,
        field_selector: str | FieldSelector | None = None,
    ) -> tuple[builtins.list[Obj], int]:
        """Objects sorted by (namespace, name), and the resourceVersion of the snapshot."""
        rt = self.type_for(type_name)
        ls = (
            label_selector
            if isinstance(label_selector, LabelSelector)
            else LabelSelector.parse(label_selector)
        )
        fs = (
            field_selector
            if isinstance(field_selector, FieldSelector)
            else FieldSelector.parse(field_selector, rt)
        )
        with self.lock:
            items = [
                copy.deepcopy(o)
                for (ns, _), o in sorted(self._objects[rt.key].items())
                if (namespace is None or ns == namespace)
                and ls.matches(o["metadata"].get("labels"))
                and fs.matches(o)
            ]
            return items, self.rv

    def events_after(self, rv: int) -> builtins.list[WatchEvent]:
        """Events with resourceVersion > rv; raises 410 Gone when some may have been forgotten."""
        with self.lock:
            if rv < self.compacted_rv:
                raise ApiError(
                    410,
                    "Expired",
                    f"too old resource version: {rv} ({self.compacted_rv + 1})",
                )
            i = bisect.bisect_right(self._history_rvs, rv)
            return self._history[i:]

    def compact(self) -> None:
        """Forget all event history: watches from any earlier resourceVersion get 410 Gone."""
        with self.lock:
            self._history.clear()
            self._history_rvs.clear()
            self.compacted_rv = self.rv

    # -- writes ----------------------------------------------------------------------------------

    def _ns(self, rt: ResourceType, namespace: str | None) -> str:
        return (namespace or "") if rt.namespaced else ""

    def _emit(self, rt: ResourceType, type_: str, obj: Obj, old: Obj | None) -> None:
        ev = WatchEvent(self.rv, rt.key, type_, copy.deepcopy(obj), old)
        self._history.append(ev)
        self._history_rvs.append(ev.rv)
        if len(self._history) > self.history_size:
            drop = len(self._history) - self.history_size
            self.compacted_rv = self._history_rvs[drop - 1]
            del self._history[:drop]
            del self._history_rvs[:drop]
        for fn in list(self._listeners):
            fn(ev)
        self.changed.notify_all()

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _validate(
        self, rt: ResourceType, obj: Obj, old: Obj | None, name: str, field_validation: str
    ) -> tuple[Obj, builtins.list[str]]:
        """Default, prune (or reject) unknown fields and validate a custom resource; (obj, warnings)."""
        if not rt.crds:
            errs = [(p, m) for p, _, m in crdschema.validate_metadata(obj)]
            if rt.kind == "ConfigMap":
                errs += _configmap_size(obj)
            if errs:
                raise invalid(rt, name, errs)
            return obj, []
        primary = rt.crds[0]
        version = obj["apiVersion"].rpartition("/")[2]
        obj = primary.apply_defaults(obj, version)
        warnings: builtins.list[str] = []
        if field_validation != "Strict":
            obj, removed = primary.prune(obj, version)
            warnings = [f'unknown field "{p}"' for p in removed] if field_validation == "Warn" else []
        if self.validate:
            causes: builtins.list[tuple[str, str]] = []
            for crd in rt.crds:
                for e in crd.validate(obj, old=old, strict=True, defaults=False):
                    detail = f"{e.message} [{e.crd}]" if len(rt.crds) > 1 else e.message
                    if (e.path, detail) not in causes:
                        causes.append((e.path, detail))
            if causes:
                raise invalid(rt, name, causes)
        return obj, warnings

    def create(
        self,
        type_name: str,
        body: Mapping[str, Any],
        namespace: str | None = None,
        *,
        field_validation: str = "Strict",
        version: str | None = None,
    ) -> Obj:
        obj, _ = self.create_ex(
            type_name, body, namespace, field_validation=field_validation, version=version
        )
        return obj

    def create_ex(
        self,
        type_name: str,
        body: Mapping[str, Any],
        namespace: str | None = None,
        *,
        field_validation: str = "Strict",
        version: str | None = None,
    ) -> tuple[Obj, builtins.list[str]]:
        rt = self.type_for(type_name)
        obj, ns = _to_create(rt, body, namespace, version)
        meta = obj["metadata"]
        with self.lock:
            if not meta.get("name") and meta.get("generateName"):
                for _ in range(100):
                    cand = meta["generateName"] + "".join(self._rng.choice(_NAME_ALPHABET) for _ in range(5))
                    if (ns, cand) not in self._objects[rt.key]:
                        meta["name"] = cand
                        break
            name = meta.get("name") or ""
            if not name:
                raise invalid(rt, "", [("metadata.name", "Required value: name or generateName is required")])
            if rt.namespaced and ("", ns) not in self._objects["namespaces"]:
                raise ApiError(
                    404,
                    "NotFound",
                    f'namespaces "{ns}" not found',
                    details={"name": ns, "kind": "namespaces"},
                )
            for k in ("uid", "deletionTimestamp", "deletionGracePeriodSeconds", "managedFields"):
                meta.pop(k, None)
            if rt.status_subresource and not rt.status_on_create:
                obj.pop("status", None)
            if rt.key == "pods":
                obj["status"] = {"phase": "Pending"}
            elif rt.key == "namespaces":
                obj["status"] = {"phase": "Active"}
            obj, warnings = self._validate(rt, obj, None, name, field_validation)
            meta = obj["metadata"]
            if (ns, name) in self._objects[rt.key]:
                raise ApiError(
                    409,
                    "AlreadyExists",
                    f'{rt.qualified} "{name}" already exists',
                    details=_details(rt, name),
                )
            meta["uid"] = str(uuid.UUID(int=self._rng.getrandbits(128), version=4))
            meta["creationTimestamp"] = now_rfc3339()
            meta["generation"] = 1
            meta["resourceVersion"] = self._next_rv()
            self._objects[rt.key][(ns, name)] = obj
            self._emit(rt, "ADDED", obj, None)
            return copy.deepcopy(obj), warnings

    def update(
        self,
        type_name: str,
        body: Mapping[str, Any],
        namespace: str | None = None,
        *,
        name: str | None = None,
        subresource: str | None = None,
        field_validation: str = "Strict",
    ) -> Obj:
        """PUT semantics: 409 on a stale metadata.resourceVersion, none given means unconditional."""
        obj, _ = self.update_ex(
            type_name, body, namespace, name=name, subresource=subresource, field_validation=field_validation
        )
        return obj

    def update_ex(
        self,
        type_name: str,
        body: Mapping[str, Any],
        namespace: str | None = None,
        *,
        name: str | None = None,
        subresource: str | None = None,
        field_validation: str = "Strict",
    ) -> tuple[Obj, builtins.list[str]]:
        rt = self.type_for(type_name)
        if not isinstance(body, Mapping) or not isinstance(body.get("metadata", {}), Mapping):
            raise bad_request("the body of an update must be an object")
        new: Obj = copy.deepcopy(dict(body))
        nmeta = new.setdefault("metadata", {})
        name = name or nmeta.get("name")
        if not name:
            raise bad_request("name is required")
        if nmeta.get("name") not in (None, name):
            raise bad_request(
                f"the name of the object ({nmeta.get('name')}) does not match the name on the URL ({name})"
            )
        ns = self._ns(rt, namespace or nmeta.get("namespace"))
        with self.lock:
            cur = self._objects[rt.key].get((ns, name))
            if cur is None:
                raise not_found(rt, name)
            cmeta = cur["metadata"]
            _check_update(rt, name, nmeta, cmeta)
            new = _updated(rt, name, new, cur, subresource)
            new["metadata"]["resourceVersion"] = cmeta["resourceVersion"]
            new, warnings = self._validate(rt, new, cur, name, field_validation)
            if new == cur:
                return copy.deepcopy(cur), warnings  # a no-op write changes nothing and sends no event
            if _spec_of(new) != _spec_of(cur):
                new["metadata"]["generation"] = cmeta.get("generation", 1) + 1
            new["metadata"]["resourceVersion"] = self._next_rv()
            self._objects[rt.key][(ns, name)] = new
            self._emit(rt, "MODIFIED", new, cur)
            if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
                return self._remove(rt, ns, name), warnings
            return copy.deepcopy(new), warnings

    def patch(
        self,
        type_name: str,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        patch_type: str = "merge",
        subresource: str | None = None,
        field_validation: str = "Strict",
    ) -> Obj:
        obj, _ = self.patch_ex(
            type_name,
            name,
            patch,
            namespace,
            patch_type=patch_type,
            subresource=subresource,
            field_validation=field_validation,
        )
        return obj

    def patch_ex(
        self,
        type_name: str,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        patch_type: str = "merge",
        subresource: str | None = None,
        field_validation: str = "Strict",
    ) -> tuple[Obj, builtins.list[str]]:
        """patch_type: ``merge`` (RFC 7386), ``json`` (RFC 6902) or ``strategic``."""
        rt = self.type_for(type_name)
        with self.lock:
            cur = self.get(rt.key, name, namespace)
            if patch_type == "json":
                if not isinstance(patch, list):
                    raise bad_request("a JSON patch must be a list of operations")
                try:
                    new = json_patch(cur, patch)
                except ValueError as exc:
                    raise ApiError(422, "Invalid", f"the JSON patch could not be applied: {exc}") from exc
            elif patch_type == "strategic":
                if rt.crds:
                    raise ApiError(
                        415,
                        "UnsupportedMediaType",
                        "strategic merge patch is not supported for custom resources; use merge or JSON patch",
                    )
                new = strategic_merge_patch(cur, patch)
            elif patch_type == "merge":
                if not isinstance(patch, dict):
                    raise bad_request("a merge patch must be an object")
                new = merge_patch(cur, patch)
            else:
                raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {patch_type!r}")
            if not isinstance(new, dict) or not isinstance(new.get("metadata"), dict):
                raise ApiError(422, "Invalid", "the patched object is not an object with metadata")
            return self.update_ex(
                rt.key, new, namespace, name=name, subresource=subresource, field_validation=field_validation
            )

    def delete(
        self,
        type_name: str,
        name: str,
        namespace: str | None = None,
        *,
        preconditions: Mapping[str, Any] | None = None,
        propagation: str = "Background",
    ) -> tuple[Obj, bool]:
        """Delete; (object, gone). With finalizers the object stays, with deletionTimestamp set."""
        rt = self.type_for(type_name)
        ns = self._ns(rt, namespace)
        with self.lock:
            cur = self._objects[rt.key].get((ns, name))
            if cur is None:
                raise not_found(rt, name)
            cmeta = cur["metadata"]
            pre = preconditions or {}
            if pre.get("uid") and pre["uid"] != cmeta["uid"]:
                raise conflict(
                    rt,
                    name,
                    f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: {cmeta['uid']}",
                )
            if pre.get("resourceVersion") and pre["resourceVersion"] != cmeta["resourceVersion"]:
                raise conflict(
                    rt,
                    name,
                    f"Precondition failed: ResourceVersion in precondition: {pre['resourceVersion']}, "
                    f"ResourceVersion in object meta: {cmeta['resourceVersion']}",
                )
            if rt.key == "namespaces":
                for key, objs in self._objects.items():
                    if self.types[key].namespaced:
                        for ons, oname in [k for k in objs if k[0] == name]:
                            self._remove(self.types[key], ons, oname, force=True)
            if cmeta.get("finalizers"):
                if cmeta.get("deletionTimestamp"):
                    return copy.deepcopy(cur), False
                new = copy.deepcopy(cur)
                new["metadata"]["deletionTimestamp"] = now_rfc3339()
                new["metadata"]["deletionGracePeriodSeconds"] = 0
                new["metadata"]["generation"] = cmeta.get("generation", 1) + 1
                new["metadata"]["resourceVersion"] = self._next_rv()
                self._objects[rt.key][(ns, name)] = new
                self._emit(rt, "MODIFIED", new, cur)
                return copy.deepcopy(new), False
            return self._remove(rt, ns, name, orphan=propagation == "Orphan"), True

    def _remove(
        self, rt: ResourceType, ns: str, name: str, *, force: bool = False, orphan: bool = False
    ) -> Obj:
        cur = self._objects[rt.key].pop((ns, name))
        gone = copy.deepcopy(cur)
        gone["metadata"]["resourceVersion"] = self._next_rv()
        self._emit(rt, "DELETED", gone, cur)
        if not orphan:
            self._collect_dependents(cur["metadata"]["uid"])
        return gone

    def _collect_dependents(self, owner_uid: str) -> None:
        """Garbage collection: delete objects whose ownerReferences point at a removed owner."""
        for key, objs in self._objects.items():
            for (ns, name), o in list(objs.items()):
                refs = o["metadata"].get("ownerReferences") or ()
                if any(r.get("uid") == owner_uid for r in refs) and (ns, name) in objs:
                    self.delete(key, name, ns)

    def snapshot_rv(self) -> int:
        with self.lock:
            return self.rv


def _spec_of(obj: Obj) -> Obj:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


# ---------------------------------------------------------------------------------------------------
# fault injection and request log


@dataclass
class Fault:
    """Answer the next ``times`` requests matching verb/resource/name with ``status`` (or delay them).

    verb: get, list, watch, create, update, patch, delete, deletecollection or ``*``;
    resource: a type key or plural (``nodeclaims``, ``nodeclaims.karpenter.sh``, ``rayclusters/status``)
    or ``*``; name: an object name or None for any; times: None for every matching request.
    status 0 with latency > 0 only delays the request.
    """

    verb: str
    resource: str
    status: int = 0
    times: int | None = 1
    retry_after: float | None = None
    latency: float = 0.0
    name: str | None = None
    message: str = ""
    hits: int = 0

    def matches(self, verb: str, rt: ResourceType, subresource: str | None, name: str | None) -> bool:
        if self.verb not in ("*", verb):
            return False
        res = self.resource
        sub = None
        if "/" in res:
            res, sub = res.split("/", 1)
        if res != "*" and res not in (rt.plural, rt.key):
            return False
        if sub != subresource and not (sub is None and res == "*"):
            return False
        return self.name is None or self.name == name


_REASONS = {
    409: "Conflict",
    429: "TooManyRequests",
    500: "InternalError",
    502: "BadGateway",
    503: "ServiceUnavailable",
    504: "Timeout",
    404: "NotFound",
    410: "Expired",
}


class FaultInjector:
    def __init__(self) -> None:
        self._rules: list[Fault] = []
        self._lock = threading.Lock()

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self._rules.append(fault)
        return fault

    def inject(
        self,
        verb: str,
        resource: str,
        status: int,
        *,
        times: int | None = 1,
        retry_after: float | None = None,
        name: str | None = None,
        message: str = "",
    ) -> Fault:
        """The next ``times`` matching requests fail with ``status`` (429 gets Retry-After)."""
        if status == 429 and retry_after is None:
            retry_after = 1
        return self.add(Fault(verb, resource, status, times, retry_after, 0.0, name, message))

    def latency(self, verb: str, resource: str, seconds: float, *, times: int | None = None) -> Fault:
        return self.add(Fault(verb, resource, 0, times, None, seconds))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def take(
        self, verb: str, rt: ResourceType, subresource: str | None, name: str | None
    ) -> tuple[float, Fault | None]:
        """(total delay, the fault to answer with or None) for one request; consumes counts."""
        delay = 0.0
        with self._lock:
            failing = None
            for f in self._rules:
                if f.times is not None and f.hits >= f.times:
                    continue
                if not f.matches(verb, rt, subresource, name):
                    continue
                if f.status == 0:
                    delay += f.latency
                    f.hits += 1
                elif failing is None:
                    failing = f
                    f.hits += 1
            self._rules = [f for f in self._rules if f.times is None or f.hits < f.times]
            return delay, failing

    def error_for(self, fault: Fault, rt: ResourceType, name: str | None) -> ApiError:
        reason = _REASONS.get(fault.status, "InternalError")
        msg = fault.message or f"injected fault: {fault.status} {reason}"
        headers: dict[str, str] = {}
        details: dict[str, Any] = _details(rt, name)
        if fault.retry_after is not None:
            headers["Retry-After"] = str(
                int(fault.retry_after) if float(fault.retry_after).is_integer() else fault.retry_after
            )
            details["retryAfterSeconds"] = max(1, round(fault.retry_after))
        if fault.status == 409:
            return conflict(rt, name or "", msg)
        return ApiError(fault.status, reason, msg, details=details, headers=headers)


@dataclass(frozen=True)
class RequestRecord:
    verb: str
    resource: str  # type key, with /subresource
    namespace: str | None
    name: str | None
    code: int
    at: float = field(default_factory=time.monotonic)
    user_agent: str = ""


# ---------------------------------------------------------------------------------------------------
# HTTP


_PATCH_TYPES = {
    "application/merge-patch+json": "merge",
    "application/json-patch+json": "json",
    "application/strategic-merge-patch+json": "strategic",
}


def _watch_start(store: Store, rt: ResourceType, ns: str | None, ls: LabelSelector, fs: FieldSelector,
                 rv_param: str) -> tuple[list[tuple[str, Obj]], int, bool]:
    """A watch's start: with no resourceVersion (or "0") the current objects as ADDED events and the list's
    resourceVersion; else none, the given one, and whether it was compacted away (410 Expired)."""
    with store.lock:
        if rv_param in ("", "0"):
            items, cursor = store.list(rt.key, ns, ls, fs)
            return [("ADDED", o) for o in items], cursor, False
        try:
            cursor = int(rv_param)
        except ValueError as exc:
            raise bad_request(f"invalid resourceVersion {rv_param!r}") from exc
        return [], cursor, cursor < store.compacted_rv


def _stream_events(api: KubeAPIServer, generation: int, rt: ResourceType, ns: str | None, ls: LabelSelector,
                   fs: FieldSelector, cursor: int, deadline: float, send: Callable[[str, Any], None]) -> None:
    """The events after ``cursor`` that match the watch, as they happen, until the deadline, the server
    stops or watches are cut (``api.watch_generation`` moves past ``generation``); an ERROR event where the
    cursor was compacted away."""
    store = api.store
    while not api.stopping and api.watch_generation == generation:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        with store.lock:
            try:
                events = store.events_after(cursor)
            except ApiError as e:
                send("ERROR", e.status())
                return
            if not events:
                store.changed.wait(min(remaining, 0.25))
                continue
            cursor = events[-1].rv
        for ev in events:
            if ev.type_key != rt.key:
                continue
            out = _filter_event(ev, ns, ls, fs)
            if out is not None:
                send(out, ev.obj)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read server.requests instead
        pass

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    # -- plumbing ----------------------------------------------------------------------------------

    def _send_json(self, code: int, body: Any, headers: Mapping[str, str] | None = None) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raw = b""
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                raw += self.rfile.read(size)
                self.rfile.readline()
        else:
            raw = self.rfile.read(length) if length else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise bad_request(f"invalid JSON body: {exc}") from exc

    def _handle(self, method: str) -> None:
        api: KubeAPIServer = self.server.api
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        ua = self.headers.get("User-Agent", "")
        verb, rt, ns, name, sub = "unknown", None, None, None, None
        try:
            body = self._read_body() if method in ("POST", "PUT", "PATCH", "DELETE") else None
            disc = api.discovery(url.path)
            if disc is not None:
                if method != "GET":
                    raise ApiError(
                        405,
                        "MethodNotAllowed",
                        "the server does not allow this method on the requested resource",
                    )
                self._send_json(200, disc)
                return
            rt, version, ns, name, sub = api.route(url.path)
            verb = _verb(method, name, query)
            delay, fault = api.faults.take(verb, rt, sub, name)
            if delay:
                time.sleep(delay)
            if fault is not None:
                raise api.faults.error_for(fault, rt, name)
            if verb == "watch":
                api.record(verb, rt, sub, ns, name, 200, ua)
                self._watch(api, rt, version, ns, query)
                return
            code, out, headers = api.dispatch(
                verb, rt, version, ns, name, sub, query, body, self.headers.get("Content-Type", "")
            )
            api.record(verb, rt, sub, ns, name, code, ua)
            self._send_json(code, out, headers)
        except ApiError as e:
            if rt is not None:
                api.record(verb, rt, sub, ns, name, e.code, ua)
            self._send_json(e.code, e.status(), e.headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # a bug in the emulator must still answer like an apiserver
            err = ApiError(500, "InternalError", f"emulator error: {exc!r}")
            self._send_json(500, err.status())

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _watch(
        self, api: KubeAPIServer, rt: ResourceType, version: str, ns: str | None, query: Mapping[str, str]
    ) -> None:
        ls = LabelSelector.parse(query.get("labelSelector"))
        fs = FieldSelector.parse(query.get("fieldSelector"), rt)
        timeout = float(query.get("timeoutSeconds") or api.default_watch_timeout)
        deadline = time.monotonic() + timeout
        store = api.store
        rv_param = query.get("resourceVersion", "")
        initial, cursor, expired = _watch_start(store, rt, ns, ls, fs, rv_param)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True
        generation = api.watch_generation

        def send(type_: str, obj: Any) -> None:
            o = copy.deepcopy(obj)
            if isinstance(o, dict) and o.get("kind") == rt.kind:
                o["apiVersion"] = rt.api_version(version)
            self._write_chunk(
                json.dumps({"type": type_, "object": o}, separators=(",", ":")).encode() + b"\n"
            )

        try:
            if rv_param not in ("", "0") and expired:
                send(
                    "ERROR",
                    ApiError(
                        410, "Expired", f"too old resource version: {cursor} ({store.compacted_rv + 1})"
                    ).status(),
                )
                return
            for type_, o in initial:
                send(type_, o)
            _stream_events(api, generation, rt, ns, ls, fs, cursor, deadline, send)
        except (BrokenPipeError, ConnectionResetError, OSError):
            return
        finally:
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                pass


def _filter_event(ev: WatchEvent, ns: str | None, ls: LabelSelector, fs: FieldSelector) -> str | None:
    """Event type for a selective watcher: objects entering or leaving the selection too."""

    def sel(o: Obj | None) -> bool:
        return (
            o is not None
            and (ns is None or o["metadata"].get("namespace", "") == ns)
            and ls.matches(o["metadata"].get("labels"))
            and fs.matches(o)
        )

    now, before = sel(ev.obj), sel(ev.old)
    if ev.type == "DELETED":
        return "DELETED" if before else None
    if ev.type == "ADDED":
        return "ADDED" if now else None
    if now and before:
        return "MODIFIED"
    if now:
        return "ADDED"
    if before:
        return "DELETED"
    return None


def _same_resource(logged: str, wanted: str) -> bool:
    """``nodeclaims.karpenter.sh/status`` is also ``nodeclaims/status``; ``pods`` is ``pods``."""
    if logged == wanted:
        return True
    typ, _, sub = logged.partition("/")
    short = typ.split(".", 1)[0] + (f"/{sub}" if sub else "")
    return short == wanted


def _verb(method: str, name: str | None, query: Mapping[str, str]) -> str:
    if method == "GET":
        if name:
            return "get"
        return "watch" if query.get("watch", "").lower() in ("1", "true") else "list"
    return {
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if name else "deletecollection",
    }[method]


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    api: KubeAPIServer


def _api_resources(t: ResourceType) -> list[Obj]:
    """A type's entries in its group version's APIResourceList: the resource, and its status subresource."""
    verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
    out: list[Obj] = [{"name": t.plural, "singularName": t.singular, "namespaced": t.namespaced, "kind": t.kind,
                       "verbs": verbs, "shortNames": list(t.short_names)}]
    if t.status_subresource:
        out.append({"name": f"{t.plural}/status", "singularName": "", "namespaced": t.namespaced, "kind": t.kind,
                    "verbs": ["get", "patch", "update"]})
    return out


@dataclass
class _Call:
    """One API request as KubeAPIServer.dispatch serves it, and the response headers it gathers."""

    rt: ResourceType
    version: str
    ns: str | None
    name: str | None
    sub: str | None
    query: Mapping[str, str]
    body: Any
    content_type: str
    field_validation: str
    headers: dict[str, str] = field(default_factory=dict)

    def out(self, o: Obj) -> Obj:
        """An object as served: its apiVersion the one the request named."""
        o = dict(o)
        if o.get("kind") == self.rt.kind:
            o["apiVersion"] = self.rt.api_version(self.version)
        return o

    def warn(self, warnings: list[str]) -> None:
        if warnings:
            self.headers["Warning"] = ", ".join(f'299 - "{w}"' for w in warnings)


def _page(items: list[Obj], query: Mapping[str, str]) -> tuple[list[Obj], Obj]:
    """A list's page after the ``continue`` token, at most ``limit`` items, and its list metadata."""
    meta: Obj = {}
    cont = query.get("continue")
    if cont:
        try:
            after = tuple(json.loads(base64.urlsafe_b64decode(cont.encode())))
        except (ValueError, TypeError) as exc:
            raise bad_request("invalid continue token") from exc
        items = [o for o in items if (o["metadata"].get("namespace", ""), o["metadata"]["name"]) > after]
    limit = int(query.get("limit") or 0)
    if limit and len(items) > limit:
        last = items[limit - 1]["metadata"]
        meta["continue"] = base64.urlsafe_b64encode(json.dumps([last.get("namespace", ""), last["name"]]).encode()).decode()
        meta["remainingItemCount"] = len(items) - limit
        items = items[:limit]
    return items, meta


class KubeAPIServer:
    """The emulator: ``with KubeAPIServer() as api: client = api.api_client()``.

    crd_files: CRD YAML paths (or names relative to crdschema.crd_dir()); files for the same kind
    are all used for validation, the first one for defaults. validate: check custom resources
    against their CRDs (422 on failure). field_validation: the default for requests that do not say.
    """

    def __init__(
        self,
        *,
        crd_files: Iterable[str | Path] | None = None,
        validate: bool = True,
        history_size: int = 2000,
        seed: int | None = 0,
        namespaces: Iterable[str] = ("default", "kube-system"),
        field_validation: str = "Strict",
        default_watch_timeout: float = 300.0,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        root = crdschema.crd_dir()
        files = [
            Path(f) if Path(f).is_absolute() else root / f
            for f in (crd_files if crd_files is not None else DEFAULT_CRD_FILES)
        ]
        types = [*BUILTIN_TYPES, *resource_types_from_crds(files)]
        self.store = Store(types, history_size=history_size, validate=validate, seed=seed)
        self.faults = FaultInjector()
        self.requests: list[RequestRecord] = []
        self._requests_lock = threading.Lock()
        self.field_validation = field_validation
        self.default_watch_timeout = default_watch_timeout
        self.stopping = False
        self.watch_generation = 0
        self._host, self._port = host, port
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        for ns in namespaces:
            self.store.create("namespaces", {"metadata": {"name": ns}})

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> KubeAPIServer:
        self._httpd = _HTTPServer((self._host, self._port), _Handler)
        self._httpd.api = self
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="kubeapi", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping = True
        with self.store.lock:
            self.store.changed.notify_all()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = None

    def __enter__(self) -> KubeAPIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def configuration(self) -> Any:
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return cfg

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` talking to this server."""
        from kubernetes import client

        return client.ApiClient(self.configuration())

    # -- test hooks --------------------------------------------------------------------------------

    def break_watches(self) -> None:
        """End every open watch stream now (the client sees the connection close)."""
        with self.store.lock:
            self.watch_generation += 1
            self.store.changed.notify_all()

    def compact(self) -> None:
        """Forget event history: watches from an older resourceVersion get 410 Gone."""
        self.store.compact()
        self.break_watches()

    def record(
        self,
        verb: str,
        rt: ResourceType,
        sub: str | None,
        ns: str | None,
        name: str | None,
        code: int,
        ua: str,
    ) -> None:
        with self._requests_lock:
            self.requests.append(
                RequestRecord(verb, rt.key + (f"/{sub}" if sub else ""), ns, name, code, user_agent=ua)
            )

    def requests_for(self, verb: str | None = None, resource: str | None = None) -> list[RequestRecord]:
        """Logged requests filtered by verb and resource (type key or plural, optional /subresource)."""
        with self._requests_lock:
            out = list(self.requests)
        return [
            r
            for r in out
            if (verb is None or r.verb == verb) and (resource is None or _same_resource(r.resource, resource))
        ]

    # -- routing -----------------------------------------------------------------------------------

    def _group_versions(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for t in self.store.types.values():
            vs = out.setdefault(t.group, [])
            for v in t.versions:
                if v not in vs:
                    vs.append(v)
        return out

    def discovery(self, path: str) -> Obj | None:
        path = path.rstrip("/")
        gvs = self._group_versions()
        if path == "/version":
            return {
                "major": "1",
                "minor": "33",
                "gitVersion": "v1.33.0-rayscale-emulator",
                "platform": "linux/amd64",
            }
        if path == "/api":
            return {
                "kind": "APIVersions",
                "apiVersion": "v1",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [],
            }
        if path == "/apis":
            groups = []
            for g, vs in gvs.items():
                if not g:
                    continue
                versions = [{"groupVersion": f"{g}/{v}", "version": v} for v in vs]
                groups.append({"name": g, "versions": versions, "preferredVersion": versions[0]})
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
        m = re.fullmatch(r"/api/(v1)|/apis/([^/]+)/([^/]+)", path)
        if m:
            group, version = ("", "v1") if m.group(1) else (m.group(2), m.group(3))
            if version not in gvs.get(group, []):
                return None
            types = [t for t in self.store.types.values() if t.group == group and version in t.versions]
            return {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else "v1",
                "resources": [r for t in types for r in _api_resources(t)],
            }
        return None

    def route(self, path: str) -> tuple[ResourceType, str, str | None, str | None, str | None]:
        """(type, version, namespace, name, subresource) for a resource URL; 404 when unknown."""
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")

        def find(plural: str) -> ResourceType | None:
            for t in self.store.types.values():
                if t.group == group and t.plural == plural and version in t.versions:
                    return t
            return None

        ns = None
        if len(rest) >= 3 and rest[0] == "namespaces" and (t := find(rest[2])) is not None and t.namespaced:
            ns, rest = rest[1], rest[2:]
        if not rest or (rt := find(rest[0])) is None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        if rt.namespaced and ns is None and len(rest) > 1:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if sub is not None and (sub != "status" or not rt.status_subresource or len(rest) > 3):
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        return rt, version, ns, name, sub

    def dispatch(
        self,
        verb: str,
        rt: ResourceType,
        version: str,
        ns: str | None,
        name: str | None,
        sub: str | None,
        query: Mapping[str, str],
        body: Any,
        content_type: str,
    ) -> tuple[int, Any, dict[str, str]]:
        fv = query.get("fieldValidation") or self.field_validation
        if fv not in ("Strict", "Warn", "Ignore"):
            raise bad_request(f"invalid fieldValidation {fv!r}")
        handler: Callable[[_Call], tuple[int, Any]] | None = getattr(self, f"_on_{verb}", None)
        if handler is None:
            raise ApiError(405, "MethodNotAllowed", f"verb {verb} is not supported")
        call = _Call(rt, version, ns, name, sub, query, body, content_type, fv)
        code, obj = handler(call)
        return code, obj, call.headers

    def _on_get(self, c: _Call) -> tuple[int, Any]:
        assert c.name is not None
        return 200, c.out(self.store.get(c.rt.key, c.name, c.ns))

    def _on_list(self, c: _Call) -> tuple[int, Any]:
        items, rv = self.store.list(c.rt.key, c.ns, c.query.get("labelSelector"), c.query.get("fieldSelector"))
        items, page = _page(items, c.query)
        meta = {"resourceVersion": str(rv), **page}
        if not c.rt.crds:
            # Typed lists from the apiserver carry no kind/apiVersion on their items.
            for o in items:
                o.pop("kind", None)
                o.pop("apiVersion", None)
        else:
            items = [c.out(o) for o in items]
        return 200, {"kind": c.rt.list_kind, "apiVersion": c.rt.api_version(c.version), "metadata": meta,
                     "items": items}

    def _on_create(self, c: _Call) -> tuple[int, Any]:
        if c.sub:
            raise ApiError(405, "MethodNotAllowed", "create is not allowed on a subresource")
        obj, ws = self.store.create_ex(c.rt.key, c.body or {}, c.ns, field_validation=c.field_validation,
                                       version=c.version)
        c.warn(ws)
        return 201, c.out(obj)

    def _on_update(self, c: _Call) -> tuple[int, Any]:
        assert c.name is not None
        obj, ws = self.store.update_ex(c.rt.key, c.body or {}, c.ns, name=c.name, subresource=c.sub,
                                       field_validation=c.field_validation)
        c.warn(ws)
        return 200, c.out(obj)

    def _on_patch(self, c: _Call) -> tuple[int, Any]:
        assert c.name is not None
        ctype = c.content_type.split(";")[0].strip()
        if ctype not in _PATCH_TYPES:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types include: {', '.join(_PATCH_TYPES)}",
            )
        obj, ws = self.store.patch_ex(c.rt.key, c.name, c.body, c.ns, patch_type=_PATCH_TYPES[ctype],
                                      subresource=c.sub, field_validation=c.field_validation)
        c.warn(ws)
        return 200, c.out(obj)

    def _on_delete(self, c: _Call) -> tuple[int, Any]:
        assert c.name is not None
        opts = c.body if isinstance(c.body, dict) else {}
        propagation = opts.get("propagationPolicy") or c.query.get("propagationPolicy") or "Background"
        obj, gone = self.store.delete(c.rt.key, c.name, c.ns, preconditions=opts.get("preconditions"),
                                      propagation=propagation)
        return (200 if gone else 202), c.out(obj)

    def _on_deletecollection(self, c: _Call) -> tuple[int, Any]:
        items, _ = self.store.list(c.rt.key, c.ns, c.query.get("labelSelector"), c.query.get("fieldSelector"))
        deleted = []
        for o in items:
            try:
                d, _ = self.store.delete(c.rt.key, o["metadata"]["name"], o["metadata"].get("namespace"))
                deleted.append(c.out(d))
            except ApiError as e:
                if e.code != 404:
                    raise
        return 200, {"kind": c.rt.list_kind, "apiVersion": c.rt.api_version(c.version), "metadata": {},
                     "items": deleted}
