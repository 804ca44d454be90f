"""Draining Ray nodes through a cluster's GCS, as Ray's autoscaler does before it removes a node.

``DrainNode`` (reason preemption, with a deadline) marks the node DRAINING: the raylet takes no new work,
Serve starts a replacement of each replica on it elsewhere and stops the old one once the replacement runs
(``migrate_replicas_on_draining_nodes`` in ray/serve/_private/deployment_state.py), and the raylet exits once
idle. The GCS client is Ray's own (``ray._raylet.GcsClient``, which the autoscaler v2 and ``ray drain-node``
use); there is no public Python API for it.

On Kubernetes a Ray node is its pod's IP (``GcsNodeInfo.node_manager_address``), so ``GcsDrainer`` finds the
nodes to drain by IP, in the GCS of the RayCluster the actuator drives (KubeRay's head Service).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

# KubeRay's head Service of a RayCluster (``<cluster>-head-svc``) serves the GCS on 6379.
KUBERAY_GCS = "{cluster}-head-svc.{namespace}.svc:6379"


class Drainer(Protocol):
    def drain(self, cluster: str, ips: Iterable[str], reason: str) -> None:
        """Drain the Ray nodes at ``ips`` of RayCluster ``cluster``; raises when Ray was not asked or refused."""
        ...


class RayDrainError(RuntimeError):
    """A drain the GCS refused or could not be asked for; the message names the node."""


def gcs_client(address: str, timeout_s: float = 2.0) -> Any:
    """Ray's GCS client for ``address`` (host:port), after checking something listens there (the client
    itself retries for minutes when nothing does)."""
    from ray._raylet import GcsClient  # type: ignore[attr-defined]

    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s):
        pass
    return GcsClient(address=address)


def drain_node(gcs: Any, ray_node_id: str, reason: str, deadline_s: float | None) -> None:
    """Asks the GCS to drain one Ray node (hex id); RayDrainError when it refuses."""
    from ray.core.generated import autoscaler_pb2

    deadline_ms = 0 if deadline_s is None else int((time.time() + deadline_s) * 1000)
    accepted, why = gcs.drain_node(
        ray_node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),  # type: ignore[attr-defined]
        reason,
        deadline_ms,
    )
    if not accepted:
        raise RayDrainError(f"Ray refused to drain node {ray_node_id}: {why}")


@dataclass
class GcsDrainer:
    """Drains the Ray nodes at given IPs in the GCS of a cluster: ``address`` (host:port), where
    ``{cluster}`` and ``{namespace}`` are filled in per call (KUBERAY_GCS for KubeRay's head Service)."""

    address: str = KUBERAY_GCS
    namespace: str = "default"
    deadline_s: float = 600.0  # a replacement replica's start-up: then Serve stops what is left
    _clients: dict[str, Any] = field(default_factory=dict)

    def drain(self, cluster: str, ips: Iterable[str], reason: str) -> None:
        """Drains every alive Ray node at ``ips`` (a node already draining is asked again: Ray accepts it);
        RayDrainError naming the IP when no alive node has it or Ray refuses."""
        from ray.core.generated import gcs_pb2

        address = self.address.format(cluster=cluster, namespace=self.namespace)
        try:
            gcs = self._clients.get(address) or self._clients.setdefault(address, gcs_client(address))
            nodes = gcs.get_all_node_info(timeout=10)
        except Exception as e:
            # A head pod restarted behind the Service leaves a client bound to the old GCS: ask anew next time.
            self._clients.pop(address, None)
            raise RayDrainError(f"the GCS at {address} could not be asked for cluster {cluster}'s nodes: {e}") from e
        alive = {info.node_manager_address: nid.hex() for nid, info in nodes.items()
                 if info.state == gcs_pb2.GcsNodeInfo.ALIVE}  # type: ignore[attr-defined]
        for ip in ips:
            if ip not in alive:
                raise RayDrainError(f"no alive Ray node at {ip} in the GCS at {address}")
            drain_node(gcs, alive[ip], reason, self.deadline_s)
