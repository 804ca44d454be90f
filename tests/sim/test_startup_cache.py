"""The simulated cloud starts a replica faster where the serving image is already on the node: a reused node,
a second replica on a gang, or every node when the data volume comes from a snapshot holding the image."""

from __future__ import annotations

import numpy as np
import pytest

from rayscale.config import load_catalog
from rayscale.core.catalog import AcceleratorKind, Catalog, FastStart
from rayscale.sim.cloud import ActuatorConfig, CloudConfig, Cluster, GangState
from rayscale.sim.engine import Engine

CAT = load_catalog()
# No spread around the catalog's means and no capacity errors: every delay is the catalog's number.
EXACT = CloudConfig(capacity_error_rate=0.0, spot_capacity_error_rate=0.0, node_startup_sigma=0.0,
                    replica_startup_sigma=0.0)


def cluster(cat: Catalog, flavor: str, act: ActuatorConfig | None = None) -> Cluster:
    eng = Engine(np.array([0.0]), np.array([10]), np.array([10]))
    return Cluster(cat, "mistral-7b", eng, [flavor], np.random.default_rng(0), EXACT, act or ActuatorConfig())


def run(cl: Cluster, t: float, until: float) -> float:
    while t <= until:
        cl.advance(t)
        t += 1.0
    return t


def test_a_reused_node_skips_the_image_pull() -> None:
    parts = CAT.startup("mistral-7b", "a10g")
    cl = cluster(CAT, "a10g", ActuatorConfig(reuse_idle_nodes=True, node_linger_s=600.0))
    cl.set_target("a10g", "on-demand", 1, 0.0)
    t = run(cl, 0.0, 1500.0)
    (first,) = cl.gangs.values()
    (node,) = first.nodes
    assert first.state == GangState.LIVE and node.t_ready is not None and first.t_live is not None
    assert first.t_live - node.t_ready == pytest.approx(parts.replica_s(), abs=1e-6)  # a fresh node pulls
    cl.set_target("a10g", "on-demand", 0, t)
    t = run(cl, t, t + 5.0)  # idle: it drains at once and its node lingers
    assert cl.lingering == [node]
    start = t
    cl.set_target("a10g", "on-demand", 1, start)
    t = run(cl, t, t + 1000.0)
    (second,) = [g for g in cl.gangs.values() if g.state == GangState.LIVE]
    assert second.nodes == [node] and second.t_live is not None
    assert second.t_live - start == pytest.approx(parts.replica_s(image_cached=True), abs=1e-6)
    assert parts.replica_s(image_cached=True) == parts.replica_s() - parts.image_pull_s < parts.replica_s()


def test_a_second_replica_on_a_gang_that_served_skips_the_pull() -> None:
    parts = CAT.startup("mistral-7b", "h100")
    cl = cluster(CAT, "h100")
    cl.create_named("g0", "h100", "on-demand", "us-east-1a", 0.0)
    t = run(cl, 0.0, 1000.0)
    g0 = cl.by_name["g0"]
    assert g0.state == GangState.READY
    cl.set_serve_target("h100", 1, t)
    t0 = t
    t = run(cl, t, t + 1000.0)
    (r0,) = g0.replicas
    assert r0.state == GangState.LIVE and g0.t_live == pytest.approx(t0 + parts.replica_s())
    cl.set_serve_target("h100", 2, t)
    r1 = next(r for r in g0.replicas if r is not r0)
    t1 = t
    while r1.state != GangState.LIVE:
        t += 1.0
        cl.advance(t)
        assert t < t1 + parts.replica_s()  # live before a pull could even have finished
    assert t - t1 == pytest.approx(parts.replica_s(image_cached=True), abs=1.0)


def test_with_the_snapshot_option_every_new_node_starts_with_the_short_pull() -> None:
    snap = CAT.with_fast_start(FastStart(image_snapshots={AcceleratorKind.GPU: "snap-0123456789abcdef0"}))
    cold, fast = CAT.startup("mistral-7b", "a10g"), snap.startup("mistral-7b", "a10g")
    assert fast.image_pull_s < cold.image_pull_s
    cl = cluster(snap, "a10g")
    cl.set_target("a10g", "on-demand", 1, 0.0)
    run(cl, 0.0, 1500.0)
    (g,) = cl.gangs.values()
    assert g.state == GangState.LIVE and g.t_live is not None and g.nodes[0].t_ready is not None
    assert g.t_live - g.nodes[0].t_ready == pytest.approx(fast.replica_s(), abs=1e-6)
    assert fast.replica_s() == cold.replica_s() - cold.image_pull_s + fast.image_pull_s
