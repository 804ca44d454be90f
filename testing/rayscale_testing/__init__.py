"""Test stand-ins for rayscale (the ``rayscale-testing`` distribution; never shipped in rayscale's wheel).

A Kubernetes API emulator (``kubeapi``) and stand-ins for the controllers rayscale works with, each
following the upstream source it names: Karpenter (``karpenter``), KubeRay's RayCluster
(``kuberay``) and RayService (``rayservice``) controllers, a scheduler (``scheduler``) and a kubelet
that backs Ray worker pods with real Ray nodes (``raypods``). Nothing here talks to a real cluster; the
stand-ins drive objects in the emulator's store the way the real controllers would, so rayscale's
actuator can be tested over HTTP with the official client.
"""

from rayscale_testing.kubeapi import ApiError, Fault, KubeAPIServer, LabelSelector, Store

__all__ = ["ApiError", "Fault", "KubeAPIServer", "LabelSelector", "Store"]
