"""The Kubernetes actuator (Karpenter NodeClaims + KubeRay worker groups) and the names it shares with
`rayscale render`."""

from rayscale.cluster.kube.actuator import KubeActuator, KubeActuatorConfig
from rayscale.cluster.kube.client import KubeError, RetryPolicy

__all__ = ["KubeActuator", "KubeActuatorConfig", "KubeError", "RetryPolicy"]
