"""Manifests the k8s tests create (valid against the real CRDs)."""

from __future__ import annotations

from typing import Any


def nodeclaim(
    name: str,
    *,
    instance_types: tuple[str, ...] = ("g5.xlarge",),
    zones: tuple[str, ...] = ("us-east-1a",),
    labels: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "gpu"},
        "requirements": [
            {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": list(instance_types)},
            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": list(zones)},
            {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
        ],
        "expireAfter": "Never",
    }
    if taints:
        spec["taints"] = taints
    return {
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodeClaim",
        "metadata": {"name": name, "labels": {"rayscale.io/flavor": "a10g", **(labels or {})}},
        "spec": spec,
    }


def raycluster(
    name: str,
    *,
    replicas: int = 1,
    autoscaling: bool = False,
    flavor: str = "a10g",
    namespace: str = "default",
    restart_policy: str | None = None,
) -> dict[str, Any]:
    rc: dict[str, Any] = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "enableInTreeAutoscaling": autoscaling,
            "headGroupSpec": {
                "rayStartParams": {},
                "template": {
                    "spec": {"containers": [{"name": "ray-head", "image": "rayproject/ray:2.60.0"}]}
                },
            },
            "workerGroupSpecs": [
                {
                    "groupName": flavor,
                    "replicas": replicas,
                    "minReplicas": 0,
                    "maxReplicas": 8,
                    "rayStartParams": {},
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "ray-worker",
                                    "image": "rayproject/ray:2.60.0",
                                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                                }
                            ],
                            "nodeSelector": {"rayscale.io/flavor": flavor},
                            "tolerations": [
                                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
                            ],
                        }
                    },
                }
            ],
        },
    }
    if restart_policy is not None:
        rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["restartPolicy"] = restart_policy
    return rc
