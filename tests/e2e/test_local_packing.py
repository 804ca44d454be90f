"""Packing on a real local cluster: Ray Serve places several replicas on one node that declares several GPUs
(as a p5.48xlarge worker declares eight), the controller's view counts them per node (Gang.serving), and a
Serve downscale stops the replicas of the node with the fewest first, emptying whole nodes
(DeploymentScheduler._get_replicas_to_stop in ray/serve/_private/deployment_scheduler.py) for act to release."""

from __future__ import annotations

from typing import Any

from rayscale_testing.waits import wait_for

from rayscale.cluster.local import LocalCluster
from rayscale.controller.serve_client import ServeClient, deployment_name
from tests.e2e.conftest import NODE_IP, free_port

APP = "packing"


def _per_node(client: ServeClient, nodes: dict[str, str]) -> dict[str, int]:
    """Running replicas per local node id (only the nodes of this test)."""
    snap = client.snapshot()
    assert snap.ok, snap.error
    return {name: snap.per_node.get(ray_id, 0) for name, ray_id in nodes.items()}


def _when_total(per: dict[str, int], n: int) -> dict[str, int] | None:
    return per if sum(per.values()) == n else None


def test_serve_packs_tp1_replicas_on_a_multi_gpu_node_and_a_downscale_empties_a_node(cluster: LocalCluster) -> None:
    from ray import serve

    assert cluster.dashboard_url
    # Two "h100" nodes with four GPUs each (the shipped local stand-in declares one per node).
    ids = [cluster.add_node("h100", num_gpus=4, wait=True, timeout_s=180) for _ in range(2)]
    nodes = {n.id: n.ray_node_id for n in cluster.nodes() if n.id in ids}
    assert all(nodes.values())
    client = ServeClient(cluster.dashboard_url)

    # A TP=1 replica as rayscale deploys one on h100 (one GPU, the flavor's accelerator type), named as the
    # controller reads Serve's deployments.
    @serve.deployment(name=deployment_name("mistral-7b", "h100"),
                      ray_actor_options={"num_cpus": 0, "num_gpus": 1, "resources": {"accelerator_type:H100": 0.001}})
    class Replica:
        def __call__(self, request: Any) -> str:
            return "ok"

    def deploy(n: int) -> None:  # Serve's own wait is unbounded: deploy without it, poll with a deadline
        serve.run_many([serve.RunTarget(Replica.options(num_replicas=n).bind(), name=APP, route_prefix=f"/{APP}")],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)

    try:
        serve.start(http_options={"host": NODE_IP, "port": free_port()}, proxy_location="HeadOnly")
        deploy(6)
        per = wait_for(lambda: _when_total(_per_node(client, nodes), 6), 180, "six replicas running")
        assert max(per.values()) >= 3 and all(v <= 4 for v in per.values())  # several per node, within its GPUs
        # One fewer than the fuller node holds: Serve stops first the replicas its scheduler does not yet count
        # as running (priority 1 of _get_replicas_to_stop); two such, one per node, leave [1, 2] from [3, 3]
        # down to 3 (a loaded CI machine ended there), while down to 2 the emptier node's rest follows them.
        keep = max(per.values()) - 1
        deploy(keep)
        after = wait_for(lambda: _when_total(_per_node(client, nodes), keep), 180, "the downscale")
        # Serve stopped the replicas of the emptier node (on a tie, all of one node's first): a node serves
        # nothing and act can release its gang.
        assert sorted(after.values()) == [0, keep]
    finally:
        serve.delete(APP)
        for i in ids:
            cluster.remove_node(i, grace_s=0)
