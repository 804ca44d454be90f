"""Ray's fake multi-node provider with a launch delay and a node log, for the stock-autoscaling benchmark.

Loaded by Ray's autoscaler (monitor process) as an ``external`` provider:
``provider: {type: external, module: bench.fake_provider.DelayedFakeProvider, ...}``. It is
``ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider`` (nodes are raylets on
this machine, started in the monitor process) with three changes:

- ``launch_delay_s``: each launch sleeps this long before the node starts (as rayscale's LocalActuator
  does before ``ray start``), outside the provider lock so the autoscaler keeps running;
- ``node_ip`` and ``temp_dir``: new nodes use the head's address and temp dir (the stock provider uses
  the machine's address and Ray's default ``/tmp/ray``);
- ``event_log``: one JSON line per node start and stop, so the benchmark counts node-seconds from the
  process start, as it does for rayscale's local nodes.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import ray
from ray._common.network_utils import build_address
from ray._private import ray_constants
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
from ray.autoscaler.tags import (
    NODE_KIND_WORKER,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_NAME,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)


class DelayedFakeProvider(FakeMultiNodeProvider):
    def _event(self, kind: str, node_id: str) -> None:
        path = self.provider_config.get("event_log")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"t": time.time(), "event": kind, "node": node_id}) + "\n")

    def _create_node_with_resources_and_labels(
        self, node_config: Any, tags: dict[str, str], count: int, resources: dict[str, Any],
        labels: dict[str, str],
    ) -> None:
        time.sleep(float(self.provider_config.get("launch_delay_s", 0.0)))
        resources = copy.deepcopy(resources)
        with self.lock:
            node_type = tags[TAG_RAY_USER_NODE_TYPE]
            next_id = self._next_hex_node_id()
            self._event("start", next_id)
            ip = self.provider_config.get("node_ip") or ray._private.services.get_node_ip_address()
            gcs = self._gcs_address or build_address(ip, 6379)
            ray_params = ray._private.parameter.RayParams(
                node_ip_address=ip,
                temp_dir=self.provider_config.get("temp_dir"),
                min_worker_port=0,
                max_worker_port=0,
                dashboard_port=None,
                dashboard_agent_listen_port=0,
                num_cpus=resources.pop("CPU", 0),
                num_gpus=resources.pop("GPU", 0),
                object_store_memory=resources.pop("object_store_memory", None),
                resources=resources,
                labels=labels,
                redis_address=gcs,
                gcs_address=gcs,
                env_vars={
                    "RAY_OVERRIDE_NODE_ID_FOR_TESTING": next_id,
                    "RAY_CLOUD_INSTANCE_ID": next_id,
                    "RAY_NODE_TYPE_NAME": node_type,
                    ray_constants.RESOURCES_ENVIRONMENT_VARIABLE: json.dumps(resources),
                    ray_constants.LABELS_ENVIRONMENT_VARIABLE: json.dumps(labels),
                },
            )
            node = ray._private.node.Node(ray_params, head=False, shutdown_at_exit=False, spawn_reaper=False)
            all_tags = {
                TAG_RAY_NODE_KIND: NODE_KIND_WORKER,
                TAG_RAY_USER_NODE_TYPE: node_type,
                TAG_RAY_NODE_NAME: next_id,
                TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE,
            }
            all_tags.update(tags)
            self._nodes[next_id] = {"tags": all_tags, "node": node}  # type: ignore[dict-item]

    def terminate_node(self, node_id: str) -> None:
        super().terminate_node(node_id)
        self._event("stop", node_id)
