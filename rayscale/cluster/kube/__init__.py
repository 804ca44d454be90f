"""The Kubernetes actuator (Karpenter NodeClaims + KubeRay worker groups) and the names it shares with
`rayscale render`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rayscale.cluster.kube.actuator import KubeActuator, KubeActuatorConfig
    from rayscale.cluster.kube.client import KubeError, RetryPolicy

__all__ = ["KubeActuator", "KubeActuatorConfig", "KubeError", "RetryPolicy"]

# Imported on first use: `rayscale render` needs only kube.naming, not the kubernetes client ([kube] extra).
_HOME = {"KubeActuator": "actuator", "KubeActuatorConfig": "actuator", "KubeError": "client",
         "RetryPolicy": "client"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
