"""The controller's checkpoint (rayscale.core.checkpoint) in ConfigMaps of its namespace.

Only the replica holding the Lease writes it (the controller saves only in periods it acts in), and each
write carries the resourceVersion last read or written, so a replica that lost the Lease mid-period gets
409 instead of overwriting its successor's. The API server holds at most 1 MiB of values per ConfigMap
(pkg/apis/core/validation/validation.go ValidateConfigMap), and a thousand models' checkpoint is several
(each carries two hours of rate history and an hour of arrivals per period): the JSON is gzipped into
``binaryData`` and, past one object, split over ``<name>-1``, ``<name>-2``, ... (``state_configmaps``).
The first object says how many there are and the digest of the whole; the rest are written before it, so
a reader never takes a mix of two saves for one (it finds the digest wrong and sets the checkpoint aside).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
from dataclasses import dataclass, field
from typing import Any

from rayscale.cluster.render import MAX_STATE_SHARDS, STATE_CONFIGMAP, state_configmaps
from rayscale.core.checkpoint import CheckpointError
from rayscale.extras import missing_extra

try:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
except ImportError as e:  # pragma: no cover - the [kube] extra
    raise missing_extra("kube", "the controller's checkpoint on Kubernetes") from e

KEY = "checkpoint.json.gz"  # binaryData: this object's part of the gzipped checkpoint
SHARDS = "shards"  # data, on the first object: how many objects the checkpoint fills
DIGEST = "sha256"  # data, on every object: the digest of the whole gzipped checkpoint it is part of
SHARD_BYTES = 1_000_000  # gzipped bytes per object, under the 1 MiB its values may hold


@dataclass
class ConfigMapStore:
    api: client.CoreV1Api
    namespace: str
    name: str = STATE_CONFIGMAP
    # resourceVersion per object last read or written; absent: not seen yet (created at the next write)
    _versions: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name}"

    def read(self) -> str | None:
        names = state_configmaps(self.name)
        head = self._get(names[0])
        if head is None:
            return None
        data = head.data or {}
        n, digest = data.get(SHARDS, ""), data.get(DIGEST)
        if not n.isdigit() or not 1 <= int(n) <= len(names) or not digest:
            raise CheckpointError(f"{self.where}: data.{SHARDS}/{DIGEST}: expected 1 to {len(names)} objects and a "
                                  f"digest, got {n!r} and {digest!r}")
        parts = [head] + [self._get(name) for name in names[1:int(n)]]
        for name, cm in zip(names[:len(parts)], parts, strict=True):
            if cm is None or (cm.data or {}).get(DIGEST) != digest or KEY not in (cm.binary_data or {}):
                raise CheckpointError(f"{self.where}: ConfigMap {name} is missing or from another save "
                                      f"(its {DIGEST} is not the {DIGEST} of {self.name})")
        payload = b"".join(base64.b64decode(cm.binary_data[KEY]) for cm in parts if cm is not None)
        if hashlib.sha256(payload).hexdigest() != digest:
            raise CheckpointError(f"{self.where}: binaryData.{KEY}: the parts do not hash to data.{DIGEST}")
        return gzip.decompress(payload).decode()

    def write(self, text: str) -> None:
        # Level 1: a thousand models' 6 MB gzip in ~0.1 s to 1.6 MB; level 9 takes seconds for a fifth less.
        payload = gzip.compress(text.encode(), compresslevel=1, mtime=0)
        parts = [payload[i:i + SHARD_BYTES] for i in range(0, len(payload), SHARD_BYTES)] or [b""]
        if len(parts) > MAX_STATE_SHARDS:
            raise ValueError(f"{self.where}: the checkpoint is {len(payload)} bytes gzipped, over the "
                             f"{MAX_STATE_SHARDS} x {SHARD_BYTES} its ConfigMaps hold")
        digest = hashlib.sha256(payload).hexdigest()
        names = state_configmaps(self.name)
        # The first object last: until it is replaced, it names the previous save's digest, whose parts a
        # reader would find overwritten and set aside rather than misread.
        for i in reversed(range(len(parts))):
            data = {DIGEST: digest, **({SHARDS: str(len(parts))} if i == 0 else {})}
            self._put(names[i], data, parts[i])

    def _get(self, name: str) -> Any:
        try:
            cm = self.api.read_namespaced_config_map(name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                self._versions.pop(name, None)
                return None
            raise
        if cm.metadata and cm.metadata.resource_version:
            self._versions[name] = cm.metadata.resource_version
        return cm

    def _put(self, name: str, data: dict[str, str], part: bytes) -> None:
        version = self._versions.get(name)
        meta = client.V1ObjectMeta(name=name, namespace=self.namespace, resource_version=version,
                                   labels={"app.kubernetes.io/managed-by": "rayscale"})
        body = client.V1ConfigMap(metadata=meta, data=data, binary_data={KEY: base64.b64encode(part).decode()})
        try:
            if version is None:
                cm = self.api.create_namespaced_config_map(self.namespace, body)
            else:
                cm = self.api.replace_namespaced_config_map(name, self.namespace, body)
        except ApiException as e:
            if e.status == 409:  # written by another replica since: its version, for this one's next save
                self._get(name)
            raise
        if cm.metadata and cm.metadata.resource_version:
            self._versions[name] = cm.metadata.resource_version
