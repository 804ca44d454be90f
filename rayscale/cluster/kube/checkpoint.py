"""The controller's checkpoint (rayscale.core.checkpoint) in a ConfigMap of its namespace.

Only the replica holding the Lease writes it (the controller saves only in periods it acts in), and each
write carries the resourceVersion last read or written, so a replica that lost the Lease mid-period gets
409 instead of overwriting its successor's. A ConfigMap holds at most 1 MiB (the API server's limit on an
object): a larger checkpoint is refused here with its size, and the controller goes on without one.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayscale.cluster.render import STATE_CONFIGMAP
from rayscale.extras import missing_extra

try:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
except ImportError as e:  # pragma: no cover - the [kube] extra
    raise missing_extra("kube", "the controller's checkpoint on Kubernetes") from e

KEY = "checkpoint.json"
MAX_BYTES = 1_000_000  # under the API server's 1 MiB per object, leaving room for the metadata


@dataclass
class ConfigMapStore:
    api: client.CoreV1Api
    namespace: str
    name: str = STATE_CONFIGMAP
    _version: str | None = None  # resourceVersion last read or written; None: not seen yet

    @property
    def where(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name} ({KEY})"

    def read(self) -> str | None:
        try:
            cm = self.api.read_namespaced_config_map(self.name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                self._version = None
                return None
            raise
        self._version = cm.metadata.resource_version if cm.metadata else None
        return (cm.data or {}).get(KEY)

    def write(self, text: str) -> None:
        size = len(text.encode())
        if size > MAX_BYTES:
            raise ValueError(f"{self.where}: the checkpoint is {size} bytes, over the {MAX_BYTES} a ConfigMap holds")
        meta = client.V1ObjectMeta(name=self.name, namespace=self.namespace, resource_version=self._version,
                                   labels={"app.kubernetes.io/managed-by": "rayscale"})
        body = client.V1ConfigMap(metadata=meta, data={KEY: text})
        try:
            if self._version is None:
                cm = self.api.create_namespaced_config_map(self.namespace, body)
            else:
                cm = self.api.replace_namespaced_config_map(self.name, self.namespace, body)
        except ApiException as e:
            if e.status == 409:  # written by another replica since: its version, for this one's next save
                self.read()
            raise
        self._version = cm.metadata.resource_version if cm.metadata else None
