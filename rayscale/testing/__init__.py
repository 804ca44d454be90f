"""Test infrastructure: a Kubernetes API emulator and stand-ins for Karpenter and KubeRay.

Nothing here talks to a real cluster; the stand-ins drive objects in the emulator's store the way the
real controllers would, so rayscale's actuator can be tested over HTTP with the official client.
"""

from rayscale.testing.kubeapi import ApiError, Fault, KubeAPIServer, LabelSelector, Store

__all__ = ["ApiError", "Fault", "KubeAPIServer", "LabelSelector", "Store"]
