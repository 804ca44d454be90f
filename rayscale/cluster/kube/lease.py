"""One writer: a coordination.k8s.io Lease elects the controller replica that acts; the others wait.

The rules are client-go's (tools/leaderelection/leaderelection.go, resourcelock/leaselock.go): the holder
renews ``renewTime`` every period; anyone may take the Lease over once ``renewTime + leaseDurationSeconds``
has passed; every write carries the resourceVersion it read, so of two candidates racing for one Lease the
API server accepts one and answers the other 409. A holder that cannot renew stops acting at once (it may
already have lost the Lease), so at most one replica acts at any moment.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rayscale.extras import missing_extra

try:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
except ImportError as e:  # pragma: no cover - the [kube] extra
    raise missing_extra("kube", "leader election on Kubernetes") from e


def _utc(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, tz=dt.UTC)


@dataclass
class LeaderElection:
    api: client.CoordinationV1Api
    namespace: str
    identity: str
    name: str = "rayscale-controller"
    lease_s: int = 15  # client-go's default LeaseDuration
    clock: Callable[[], float] = field(default=time.time)
    holding: bool = False

    def hold(self) -> bool:
        """Take or renew the Lease; True while this replica may act. Never raises on a lost race."""
        now = self.clock()
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as e:
            if e.status != 404:
                return self._lost()
            return self._write(None, now)
        spec = lease.spec or client.V1LeaseSpec()
        mine = spec.holder_identity == self.identity
        renewed = spec.renew_time.timestamp() if spec.renew_time else 0.0
        expired = renewed + (spec.lease_duration_seconds or self.lease_s) < now
        if not (mine or expired):
            return self._lost()
        return self._write(lease, now, taken=not mine)

    def _write(self, lease: Any, now: float, taken: bool = False) -> bool:
        spec = client.V1LeaseSpec(holder_identity=self.identity, lease_duration_seconds=self.lease_s,
                                  renew_time=_utc(now))
        try:
            if lease is None:
                spec.acquire_time, spec.lease_transitions = _utc(now), 0
                body = client.V1Lease(metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                                      spec=spec)
                self.api.create_namespaced_lease(self.namespace, body)
            else:
                old = lease.spec or client.V1LeaseSpec()
                spec.acquire_time = _utc(now) if taken else old.acquire_time
                spec.lease_transitions = (old.lease_transitions or 0) + (1 if taken else 0)
                body = client.V1Lease(metadata=client.V1ObjectMeta(
                    name=self.name, namespace=self.namespace, resource_version=lease.metadata.resource_version),
                    spec=spec)
                self.api.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException:  # 409: another candidate wrote first; anything else: cannot say we hold it
            return self._lost()
        self.holding = True
        return True

    def _lost(self) -> bool:
        self.holding = False
        return False
