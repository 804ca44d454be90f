"""One writer: two controller replicas race for one Lease over real HTTP; one acts, the other waits, and takes
over only once the holder stops renewing for a whole lease (client-go's leaderelection rules)."""

from __future__ import annotations

from typing import Any

from kubernetes import client

from rayscale.cluster.kube.lease import LeaderElection


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def test_one_replica_holds_the_lease_and_the_other_takes_over_only_when_it_lapses(k8s: Any) -> None:
    api, clock = client.CoordinationV1Api(k8s.api_client), Clock()
    a = LeaderElection(api, "default", "pod-a", clock=clock)
    b = LeaderElection(api, "default", "pod-b", clock=clock)
    assert a.hold() and not b.hold()
    for _ in range(5):  # a renews every period; b keeps waiting however long that goes on
        clock.t += 10
        assert a.hold() and not b.hold()
    lease = api.read_namespaced_lease("rayscale-controller", "default")
    assert lease.spec.holder_identity == "pod-a" and lease.spec.lease_transitions == 0
    clock.t += 14  # a stopped renewing: within the lease, b still waits
    assert not b.hold()
    clock.t += 2
    assert b.hold() and b.holding
    assert not a.hold() and not a.holding  # the old holder sees it lost and stops acting
    lease = api.read_namespaced_lease("rayscale-controller", "default")
    assert lease.spec.holder_identity == "pod-b" and lease.spec.lease_transitions == 1


def test_of_two_candidates_writing_the_same_version_one_wins(k8s: Any) -> None:
    """The API server's optimistic concurrency (409 on a stale resourceVersion) picks one."""
    api, clock = client.CoordinationV1Api(k8s.api_client), Clock()
    first = LeaderElection(api, "default", "pod-a", clock=clock, lease_s=5)
    assert first.hold()
    clock.t += 60  # lapsed: both see it free and both try, from the same read
    stale = api.read_namespaced_lease("rayscale-controller", "default")
    b = LeaderElection(api, "default", "pod-b", clock=clock)
    c = LeaderElection(api, "default", "pod-c", clock=clock)
    assert b._write(stale, clock.t, taken=True)
    assert not c._write(stale, clock.t, taken=True)
    assert api.read_namespaced_lease("rayscale-controller", "default").spec.holder_identity == "pod-b"
