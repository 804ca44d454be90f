"""KubeActuator against the HTTP emulator with the Karpenter and KubeRay stand-ins (official client)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import yaml

from rayscale.cluster.kube import KubeActuator, KubeError
from rayscale.cluster.render import CLUSTER_RULES, NAMESPACE_RULES
from rayscale.core.act import BackOff, CreateGang, DeleteGang, Gang, GangPhase, decide

from .kubeworld import NS, RC, World, rendered

BIG = ("qwen2-72b", "a10g", "on-demand")  # TP4 x PP2 on A10G: two g5.12xlarge per gang
# A gang of BIG spans nodes: it runs in the worker group of its gang slot (rayscale.cluster.kube.slots).
GROUP = "a10g-g5-12xlarge-qwen2-72b-slot0"  # the first gang's
GROUP1 = "a10g-g5-12xlarge-qwen2-72b-slot1"  # a second gang's


def created_claims(w: World) -> int:
    """Successful NodeClaim creates (POSTs carry no name; a double create shows as one too many)."""
    return sum(1 for r in w.api.requests_for("create", "nodeclaims") if r.code == 201)


def act(w: World, target: dict[tuple[str, str, str], int], gangs: list[Gang],
        unavailable: dict[tuple[str, str, str], float] | None = None) -> list[object]:
    """One controller step on the real decide(): apply gang actions as the controller does."""
    unavailable = unavailable if unavailable is not None else {}
    actions = decide(w.catalog, target, gangs, {}, {}, unavailable, w.clock.now())
    assert w.act is not None
    for a in actions:
        if isinstance(a, CreateGang):
            w.act.create_gang(a, w.clock.now())
        elif isinstance(a, DeleteGang):
            w.act.delete_gang(a.name)
        elif isinstance(a, BackOff):
            unavailable[(a.flavor, a.zone, a.capacity_type)] = a.until_s
    return actions


def ready(name: str) -> Callable[[list[Gang]], bool]:
    return lambda gs: any(g.name == name and g.phase == GangPhase.READY for g in gs)


def up(w: World, n: int = 1) -> list[Gang]:
    gangs: list[Gang] = []
    act(w, {BIG: n}, gangs)
    return w.until(lambda gs: len(gs) == n and all(g.phase == GangPhase.READY for g in gs), what="gangs ready")


def test_gang_up_is_whole_and_workers_come_only_after_every_member_is_initialized(world: World) -> None:
    w = world
    actions = act(w, {BIG: 1}, [])
    (create,) = actions
    assert isinstance(create, CreateGang) and create.instance_type == "g5.12xlarge" and create.nodes == 2
    claims = w.claims(create.name)
    assert [c["metadata"]["name"] for c in claims] == [f"{create.name}-0", f"{create.name}-1"]
    for c in claims:
        lb = c["metadata"]["labels"]
        assert lb["rayscale.io/owned-by"] == "rayscale" and lb["rayscale.io/gang"] == create.name
        assert lb["rayscale.io/model"] == "qwen2-72b" and lb["rayscale.io/flavor"] == "a10g"
        assert lb["karpenter.sh/nodepool"] == "a10g"
        assert c["spec"]["expireAfter"] == "Never"
        # protected from emptiness consolidation from creation on; owned by its NodePool
        assert c["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
        pool = w.api.store.get("nodepools", "a10g")
        assert [(r["kind"], r["name"], r["uid"]) for r in c["metadata"]["ownerReferences"]] == [
            ("NodePool", "a10g", pool["metadata"]["uid"])]
        assert c["spec"]["nodeClassRef"] == {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "gpu"}
        reqs = {r["key"]: r["values"] for r in c["spec"]["requirements"]}
        assert reqs == {"node.kubernetes.io/instance-type": ["g5.12xlarge"],
                        "topology.kubernetes.io/zone": [create.zone], "karpenter.sh/capacity-type": ["on-demand"]}

    # One member is slow: the other one initializes, yet no Ray worker is asked for.
    w.karpenter.config.held.add(f"{create.name}-1")
    w.until(lambda gs: gs[0].reason == "1/2 nodes initialized", what="first member initialized")
    for _ in range(3):
        (g,) = w.tick()
        assert g.phase == GangPhase.PENDING and g.node_ids == ()
        assert w.group(GROUP)["replicas"] == 0 and w.workers() == []
        assert not any("rayscale.io/ray-worker" in n["metadata"]["labels"] for n in w.api.store.list("nodes")[0])
    w.karpenter.config.held.clear()
    (g,) = w.until(ready(create.name), what="gang ready")
    nodes = sorted(c["status"]["nodeName"] for c in w.claims(create.name))
    assert sorted(n for n in g.node_ids if not n.startswith("ip:")) == nodes
    # and the worker pods' IPs, which is how Serve's replica placement joins to gangs
    assert len([n for n in g.node_ids if n.startswith("ip:")]) == len(nodes)
    assert w.group(GROUP)["replicas"] == 2
    assert sorted(p["spec"]["nodeName"] for p in w.workers()) == nodes  # one worker pod per gang node
    for n in nodes:  # the ownership labels reached the Nodes through the NodeClaims
        assert w.api.store.get("nodes", n)["metadata"]["labels"]["rayscale.io/gang"] == create.name
    assert created_claims(w) == 2


def test_capacity_error_fails_the_gang_which_is_deleted_whole_and_decide_moves_zones(world: World) -> None:
    w = world
    w.karpenter.set_capacity_error("g5.12xlarge", zone="us-east-1a")
    unavailable: dict[tuple[str, str, str], float] = {}
    (first,) = act(w, {BIG: 1}, [], unavailable)
    assert isinstance(first, CreateGang) and first.zone == "us-east-1a"
    gangs = w.until(lambda gs: any(g.phase == GangPhase.FAILED for g in gs), what="gang failed")
    (failed,) = gangs
    assert failed.name == first.name and "InsufficientCapacityError" in failed.reason, failed.reason
    # what Karpenter did (launch.go): an Event and a delete, never Launched=False
    assert {c for c, why in w.karpenter.deleted if why == "insufficient_capacity"} == {
        f"{first.name}-0", f"{first.name}-1"}
    assert all(c["status"] != "False" for cl in w.claims(first.name)
               for c in (cl.get("status") or {}).get("conditions") or () if c["type"] == "Launched")
    actions = act(w, {BIG: 1}, gangs, unavailable)
    kinds = [type(a).__name__ for a in actions]
    assert kinds == ["DeleteGang", "BackOff", "CreateGang"], actions
    new = actions[2]
    assert isinstance(new, CreateGang) and new.zone == "us-east-1b" and new.name != first.name
    gangs = w.until(ready(new.name), what="fallback gang ready")
    assert [g.name for g in gangs] == [new.name]
    assert w.claims(first.name) == []  # nothing of the failed gang is left
    assert {c["metadata"]["labels"]["rayscale.io/zone"] for c in w.claims()} == {"us-east-1b"}
    assert created_claims(w) == 4  # two gangs of two, each created once


def test_a_lost_member_fails_the_gang_and_the_rest_is_drained_then_released(world: World) -> None:
    w = world
    (g,) = up(w)
    victim = w.claims(g.name)[1]
    w.api.store.delete("nodes", victim["status"]["nodeName"])  # spot interruption of one member
    gangs = w.until(lambda gs: gs and gs[0].phase == GangPhase.FAILED, what="gang failed")
    assert victim["metadata"]["name"] in gangs[0].reason
    act(w, {BIG: 1}, gangs)
    survivor = w.claims(g.name)[0]["status"]["nodeName"]
    w.until(lambda gs: w.claims(g.name) == [] and any(x.phase == GangPhase.READY for x in gs), ticks=60,
            what="failed gang released, replacement ready")
    assert survivor not in {p["spec"]["nodeName"] for p in w.workers()}


def test_scale_down_names_exactly_the_gangs_pods_and_deletes_claims_only_after_they_are_gone(
    world: World,
) -> None:
    w = world
    gangs = up(w, 2)
    keep, drop = sorted(gangs, key=lambda g: g.name)
    drop_pods = sorted(p["metadata"]["name"] for p in w.workers() if p["spec"]["nodeName"] in drop.node_ids)
    keep_pods = sorted(p["metadata"]["name"] for p in w.workers() if p["spec"]["nodeName"] in keep.node_ids)
    assert (keep.slot, drop.slot) == (0, 1)  # each gang in its own slot's worker group
    assert len(drop_pods) == len(keep_pods) == 2 and w.group(GROUP)["replicas"] == w.group(GROUP1)["replicas"] == 2
    assert w.act is not None
    w.act.delete_gang(drop.name)  # the controller calls it after Serve drained the gang
    w.act.gangs(w.clock.now())
    g = w.group(GROUP1)
    assert g["replicas"] == 0 and sorted(g["scaleStrategy"]["workersToDelete"]) == drop_pods
    assert w.group(GROUP)["replicas"] == 2 and not (w.group(GROUP).get("scaleStrategy") or {}).get("workersToDelete")
    assert all(not c["metadata"].get("deletionTimestamp") for c in w.claims(drop.name))  # pods still there
    assert w.api.requests_for("delete", "nodeclaims") == []
    for n in (x for x in drop.node_ids if not x.startswith("ip:")):
        assert "rayscale.io/ray-worker" not in w.api.store.get("nodes", n)["metadata"]["labels"]
    w.kuberay.step()  # KubeRay deletes the named pods
    n_updates = len(w.api.requests_for("update", "rayclusters"))
    gangs = w.act.gangs(w.clock.now())
    assert [x.name for x in gangs] == [keep.name]
    assert w.group(GROUP1)["scaleStrategy"]["workersToDelete"] == []
    # Order: the write that clears workersToDelete comes before the first NodeClaim delete.
    log = w.api.requests
    clear_at = max(i for i, r in enumerate(log) if r.verb == "update" and r.resource.startswith("rayclusters"))
    first_delete = min(i for i, r in enumerate(log) if r.verb == "delete" and r.resource.startswith("nodeclaims"))
    assert len(w.api.requests_for("update", "rayclusters")) == n_updates + 1 and clear_at < first_delete
    w.until(lambda gs: w.claims(drop.name) == [], what="claims gone")
    assert sorted(p["metadata"]["name"] for p in w.workers()) == keep_pods  # the kept gang never moved
    assert w.group(GROUP)["replicas"] == 2


def conds(w: World, claim: str) -> dict[str, str]:
    c = w.api.store.get("nodeclaims", claim)
    return {x["type"]: x["status"] for x in (c.get("status") or {}).get("conditions") or ()}


def test_an_assembling_gang_survives_emptiness_consolidation(world: World) -> None:
    """A member initialized while its sibling is still coming up has no pod for longer than the pool's
    consolidateAfter (10 min rendered): do-not-disrupt from creation keeps it; the gang comes up whole."""
    w = world
    (create,) = act(w, {BIG: 1}, [])
    slow = f"{create.name}-1"
    for _ in range(10):  # hold the sibling once registered: no liveness deadline applies any more
        w.tick()
        if conds(w, slow).get("Registered") == "True":
            break
    w.karpenter.config.held.add(slow)
    # a claim of the same pool without the annotation, to show the pool does consolidate empty nodes
    bare = w.act.nodeclaim(create, 0, w.clock.now(), w.api.store.get("nodepools", "a10g")) if w.act else {}
    bare["metadata"].update(name="bare", annotations={}, labels={"karpenter.sh/nodepool": "a10g"})
    w.api.store.create("nodeclaims", bare)
    for _ in range(28):  # 700 s: past consolidateAfter, within the gang's own 900 s init timeout
        (g,) = w.tick(25.0)
        assert g.phase == GangPhase.PENDING, g.reason
    first = w.api.store.get("nodeclaims", f"{create.name}-0")
    assert conds(w, first["metadata"]["name"])["Initialized"] == "True"
    node = w.api.store.get("nodes", first["status"]["nodeName"])
    assert node["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    assert w.api.store.list("pods", field_selector=f"spec.nodeName={node['metadata']['name']}")[0] == []
    assert w.karpenter.disruptions == [("bare", "Empty")]  # only the unprotected one went
    w.karpenter.config.held.clear()
    (g,) = w.until(ready(create.name), what="gang ready")
    assert created_claims(w) == 2


def test_do_not_disrupt_stays_until_the_gang_is_released(world: World) -> None:
    w = world
    (g,) = up(w)
    assert w.act is not None
    claim = w.claims(g.name)[0]["metadata"]["name"]
    node = g.node_ids[0]
    w.api.store.patch("nodes", node, {"metadata": {"annotations": {"karpenter.sh/do-not-disrupt": None}}})
    w.tick()  # a pass puts back what someone removed, serving or not
    assert w.api.store.get("nodes", node)["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    assert not w.karpenter.disrupt(claim)
    w.act.delete_gang(g.name)
    w.act.gangs(w.clock.now())  # released: Karpenter may now terminate it
    assert "karpenter.sh/do-not-disrupt" not in (w.api.store.get("nodes", node)["metadata"].get("annotations") or {})
    assert all("karpenter.sh/do-not-disrupt" not in (c["metadata"].get("annotations") or {})
               for c in w.claims(g.name))


def test_liveness_deletion_fails_the_gang_and_decide_replaces_it(world: World) -> None:
    """lifecycle/liveness.go: a member not launched in 5 min is deleted, with no Event."""
    w = world
    unavailable: dict[tuple[str, str, str], float] = {}
    (create,) = act(w, {BIG: 1}, [], unavailable)
    w.tick()
    w.karpenter.config.held.add(f"{create.name}-1")  # the cloud never answers for this member
    gangs = w.until(lambda gs: gs[0].phase == GangPhase.FAILED, ticks=70, what="gang failed")
    assert (f"{create.name}-1", "launch_timeout") in w.karpenter.deleted
    assert "no Event" in gangs[0].reason and f"{create.name}-1" in gangs[0].reason, gangs[0].reason
    assert w.clock.now() >= 300
    kinds = [type(a).__name__ for a in act(w, {BIG: 1}, gangs, unavailable)]
    assert kinds == ["DeleteGang", "BackOff", "CreateGang"]


def test_deleting_the_nodepool_takes_the_gangs_claims_which_fails_the_gang(world: World) -> None:
    """The claims' ownerReferences to their NodePool: Kubernetes' garbage collector deletes them."""
    w = world
    (g,) = up(w)
    w.api.store.delete("nodepools", "a10g")
    gangs = w.until(lambda gs: gs[0].phase == GangPhase.FAILED, what="gang failed")
    assert "deleted by Karpenter" in gangs[0].reason
    w.tick()
    assert w.claims(g.name) == [] and w.api.store.list("nodes")[0] == []


def test_nodepool_limits_are_enforced_for_rayscales_own_claims(world: World) -> None:
    """Karpenter checks limits only for claims it creates (provisioner.go): the actuator checks its own."""
    w = world
    pool = w.api.store.get("nodepools", "a10g")
    pool["spec"]["limits"] = {"nvidia.com/gpu": "12"}  # one gang of two g5.12xlarge (8 GPUs), not two
    w.api.store.update("nodepools", pool)
    a, b = act(w, {BIG: 2}, [])
    assert isinstance(a, CreateGang) and isinstance(b, CreateGang)
    gangs = w.until(lambda gs: len(gs) == 2 and {g.phase for g in gs} == {GangPhase.READY, GangPhase.FAILED},
                    what="one ready, one refused")
    (refused,) = [g for g in gangs if g.phase == GangPhase.FAILED]
    assert refused.name == b.name and "NodePool a10g limits: nvidia.com/gpu 8+8 > 12" in refused.reason
    assert w.claims(b.name) == [] and created_claims(w) == 2
    act(w, {BIG: 2}, gangs)  # decide deletes the refused gang and tries elsewhere: refused again
    assert created_claims(w) == 2


def test_kill_and_restart_at_every_step_leaves_no_duplicate_and_no_orphan(world: World) -> None:
    w = world
    # Crash between the two creates: the process died right after the first POST.
    (create,) = decide(w.catalog, {BIG: 1}, [], {}, {}, {}, w.clock.now())
    assert isinstance(create, CreateGang) and w.act is not None
    # as create_gang writes it: with the gang's slot, which the members made after the restart copy
    w.api.store.create("nodeclaims", w.act.nodeclaim(create, 0, w.clock.now(), extra={"rayscale.io/gang-slot": "0"}))
    assert [c["metadata"]["name"] for c in w.claims()] == ["qwen2-72b-a10g-od-0-0"]
    phases = []
    # Every step from here on runs in a fresh actuator (a restarted controller) that re-plans with decide().
    for _ in range(12):
        w.actuator()
        gangs = w.tick()
        phases.append([g.phase for g in gangs])
        act(w, {BIG: 1}, gangs)
        if gangs and gangs[0].phase == GangPhase.READY:
            break
    assert gangs[0].phase == GangPhase.READY and len(gangs) == 1 and gangs[0].slot == 0, phases
    assert created_claims(w) == 1  # only the missing member was created after the restart
    assert {c["metadata"]["labels"]["rayscale.io/gang-slot"] for c in w.claims()} == {"0"}
    assert w.group(GROUP)["replicas"] == 2
    # Down, with a crash after only one claim got its deleting mark.
    w.api.faults.inject("patch", "nodeclaims", 503, times=5, name="qwen2-72b-a10g-od-0-1")
    w.actuator()
    with pytest.raises(Exception):  # noqa: B017
        act(w, {BIG: 0}, gangs)
    for _ in range(10):
        w.actuator()
        gangs = w.tick()
        act(w, {BIG: 0}, gangs)
        if not w.claims():
            break
    assert gangs == [] and w.claims() == [] and w.workers() == []
    assert w.api.store.list("nodes")[0] == []  # no orphaned instance
    assert w.group(GROUP)["replicas"] == 0 and w.group(GROUP)["scaleStrategy"]["workersToDelete"] == []
    assert created_claims(w) == 1


def test_conflicts_throttling_and_outages_converge_without_double_create(world: World) -> None:
    w = world
    w.api.faults.inject("create", "nodeclaims", 503, times=2)
    w.api.faults.inject("list", "nodeclaims", 429, times=2, retry_after=0.01)
    w.api.faults.inject("update", "rayclusters", 409, times=2)
    w.api.faults.inject("list", "pods", 500, times=1)
    (_g,) = up(w)
    assert created_claims(w) == 2
    assert [r.code for r in w.api.requests_for("update", "rayclusters")][:3] == [409, 409, 200]
    # A long outage: gangs() raises (the loop skips the period), nothing is written, then it recovers.
    w.api.faults.inject("list", "nodeclaims", 503, times=None)
    writes = len([r for r in w.api.requests if r.verb in ("create", "update", "patch", "delete")])
    with pytest.raises(KubeError):
        w.tick()
    assert len([r for r in w.api.requests if r.verb in ("create", "update", "patch", "delete")]) == writes
    w.api.faults.clear()
    (again,) = w.tick()
    assert again.phase == GangPhase.READY and created_claims(w) == 2


def test_rbac_in_the_rendered_manifests_is_exactly_what_the_actuator_uses(world: World) -> None:
    w = world
    w.karpenter.set_capacity_error("g5.12xlarge", zone="us-east-1a")  # a failure: its reason is read
    unavailable: dict[tuple[str, str, str], float] = {}
    act(w, {BIG: 1}, [], unavailable)
    gangs = w.until(lambda gs: any(g.phase == GangPhase.FAILED for g in gs), what="gang failed")
    act(w, {BIG: 1}, gangs, unavailable)
    (g,) = w.until(lambda gs: len(gs) == 1 and gs[0].phase == GangPhase.READY, what="replacement ready")
    assert w.act is not None
    w.act.delete_gang(g.name)
    w.until(lambda gs: w.claims() == [], what="released")
    # `--rayservice`: the actuator reads the RayService to find the cluster it drives.
    from dataclasses import replace

    rs = rendered(w.catalog, "deployments/k8s/rayservice.yaml")[0]
    rs["metadata"]["name"] = "llm"
    w.api.store.create("rayservices", rs, NS)
    w.api.store.patch("rayservices", "llm", {"status": {"activeServiceStatus": {"rayClusterName": RC}}}, NS,
                      subresource="status")
    w.config = replace(w.config, rayservice="llm")
    w.actuator().gangs(w.clock.now())
    assert w.act is not None and w.act.sync_serve_targets({"llm": {"mistral-7b--a10g": 2}}) == []
    # The Deployment's replicas elect one writer: create the Lease, then read and renew it.
    from kubernetes import client

    from rayscale.cluster.kube.checkpoint import ConfigMapStore
    from rayscale.cluster.kube.lease import LeaderElection

    api = w.api.api_client()
    try:
        elect = LeaderElection(client.CoordinationV1Api(api), NS, "pod-a", clock=w.clock.now)
        assert elect.hold() and elect.hold()
        # The holder saves its checkpoint (create, then update) and a successor reads it back.
        store = ConfigMapStore(client.CoreV1Api(api), NS)
        store.write("{}")
        store.write("{}")
        assert ConfigMapStore(client.CoreV1Api(api), NS).read() == "{}"
    finally:
        api.close()
    used = {(r.verb, r.resource.split("/")[0].split(".", 1)[0]) for r in w.api.requests}
    declared = {(v, res) for rule in CLUSTER_RULES + NAMESPACE_RULES for res in rule["resources"]
                for v in rule["verbs"]}
    assert used == declared
    assert "*" not in yaml.safe_dump(CLUSTER_RULES + NAMESPACE_RULES)


def test_a_ready_gang_whose_worker_pod_restarts_gets_a_fresh_timeout_not_deleted(world: World) -> None:
    """A worker pod that crashes long after the gang came up makes it PENDING again; its launch timeout
    counts from then (kept on the NodeClaim), so decide() waits for KubeRay's new pod instead of deleting
    a gang that was serving."""
    w = world
    (g,) = up(w)
    ann = "rayscale.io/phase-since"
    assert w.claims(g.name)[0]["metadata"]["annotations"][ann].startswith("ready@")
    w.clock.advance(10 * w.catalog.flavors["a10g"].node_startup_s)  # created long ago
    victim = w.workers(GROUP)[0]
    w.api.store.delete("pods", victim["metadata"]["name"], NS)
    gangs = w.act.gangs(w.clock.now()) if w.act else []
    (g2,) = gangs
    assert g2.phase == GangPhase.PENDING and g2.since_s == pytest.approx(w.clock.now())
    assert w.claims(g.name)[0]["metadata"]["annotations"][ann] == f"pending@{w.clock.now():.3f}"
    assert not [a for a in act(w, {BIG: 1}, gangs) if isinstance(a, DeleteGang)]
    # A restarted controller reads the same phase entry from the cluster.
    w.actuator()
    (g3,) = w.tick()
    assert g3.phase == GangPhase.READY or g3.since_s == pytest.approx(g2.since_s)
    (g4,) = w.until(ready(g.name), what="gang ready again on KubeRay's new pod")
    assert g4.since_s is not None and g4.since_s >= g2.since_s
    assert w.claims(g.name)[0]["metadata"]["annotations"][ann].startswith("ready@")


def test_a_spot_notice_fails_the_gang_and_orders_its_replacement_while_the_node_still_runs(world: World) -> None:
    """karpenter-provider-aws pkg/controllers/interruption/controller.go: on a spot interruption warning Karpenter
    deletes the NodeClaim at once; its termination finalizer holds the node until it is drained (here: the
    two-minute notice). The deleting claim is the notice: the gang fails and the step orders its replacement
    in the same period, while the interrupted node still runs."""
    w = world
    w.karpenter.config.termination_delay = 120.0
    (g,) = up(w)
    victim = w.claims(g.name)[1]
    node = victim["status"]["nodeName"]
    w.api.store.delete("nodeclaims", victim["metadata"]["name"])
    gangs = w.until(lambda gs: gs[0].phase == GangPhase.FAILED, ticks=5, what="gang failed at the notice")
    assert victim["metadata"]["name"] in gangs[0].reason
    kinds = [type(a).__name__ for a in act(w, {BIG: 1}, gangs)]
    assert kinds == ["DeleteGang", "BackOff", "CreateGang"]
    assert w.api.store.get("nodes", node) is not None  # the replacement is on order before the node goes


class _Gcs:
    """The driven cluster's GCS as the actuator sees it through its drainer: what it was asked to drain
    (rayscale.cluster.ray_drain.GcsDrainer, tested against real Ray in tests/cluster, asks the real one)."""

    def __init__(self, refuse: bool = False) -> None:
        self.asked: list[tuple[str, tuple[str, ...], str]] = []
        self.refuse = refuse

    def drain(self, cluster: str, ips: Iterable[str], reason: str) -> None:
        if self.refuse:
            raise RuntimeError("Ray refused to drain")
        self.asked.append((cluster, tuple(ips), reason))


def test_a_gang_is_drained_through_ray_by_its_pods_ips_and_stays_draining_for_a_restarted_controller(
        world: World) -> None:
    w = world
    assert not w.act.can_drain  # type: ignore[union-attr]
    with pytest.raises(NotImplementedError):
        w.act.drain_gang("any")  # type: ignore[union-attr]
    gcs = _Gcs()
    w.act = KubeActuator(w.catalog, w.api.api_client(), w.config, seed=1, drainer=gcs)
    assert w.act.can_drain
    (g,) = up(w)
    ips = tuple(sorted(n.removeprefix("ip:") for n in g.node_ids if n.startswith("ip:")))
    assert len(ips) == 2 and not g.draining  # one worker pod on each of the gang's two nodes
    w.act.drain_gang(g.name)
    assert gcs.asked == [(RC, ips, f"rayscale drain {g.name}")]
    (g,) = w.tick()
    assert g.draining and g.phase == GangPhase.READY  # serving until Serve moved its replicas
    (g,) = w.actuator().gangs(w.clock.now())  # read back from its claims
    assert g.draining


def test_a_drain_ray_refused_marks_nothing_so_the_next_period_asks_again(world: World) -> None:
    w = world
    w.act = KubeActuator(w.catalog, w.api.api_client(), w.config, seed=1, drainer=_Gcs(refuse=True))
    (g,) = up(w)
    with pytest.raises(RuntimeError, match="refused"):
        w.act.drain_gang(g.name)
    (g,) = w.tick()
    assert not g.draining
    assert all("rayscale.io/draining" not in (c["metadata"].get("annotations") or {}) for c in w.claims(g.name))


def test_a_drained_gangs_nodes_are_cordoned_so_kuberays_replacement_pod_waits_for_the_release(
        world: World) -> None:
    """A drained raylet exits once idle. Under the rendered ``restartPolicy: Never`` its pod turns Failed
    (the kubelet's part, played here), KubeRay deletes it and creates another (``shouldDeletePod``), and
    the cordoned Nodes do not take it: no Ray node comes back on a gang being let go. The release then
    names the waiting pod in ``workersToDelete``, and the gang's claims go."""
    w = world
    w.act = KubeActuator(w.catalog, w.api.api_client(), w.config, seed=1, drainer=_Gcs())
    (g,) = up(w)
    assert all(p["spec"]["restartPolicy"] == "Never" for p in w.workers())
    group = w.workers()[0]["metadata"]["labels"]["ray.io/group"]
    nodes = {c["status"]["nodeName"] for c in w.claims(g.name)}
    w.act.drain_gang(g.name)
    assert all(w.api.store.get("nodes", n)["spec"].get("unschedulable") for n in nodes)
    one = sorted(nodes)[0]
    w.api.store.patch("nodes", one, {"spec": {"unschedulable": False}})  # someone uncordons it
    w.tick()
    assert w.api.store.get("nodes", one)["spec"]["unschedulable"]  # every pass cordons it again
    drained = next(p for p in w.workers(group) if p["spec"]["nodeName"] in nodes)
    w.api.store.patch("pods", drained["metadata"]["name"], {"status": {"phase": "Failed"}}, NS,
                      subresource="status")
    w.tick()
    w.tick()
    pods = w.workers(group)
    assert drained["metadata"]["name"] not in {p["metadata"]["name"] for p in pods}
    waiting = [p for p in pods if not p["spec"].get("nodeName")]
    assert len(waiting) == 1 and len(pods) == 2  # the replacement, unbound; the other member's pod runs
    (g,) = w.tick()
    assert g.draining and g.phase == GangPhase.PENDING  # no worker on one node: nothing serves there
    assert all(w.api.store.get("nodes", n)["spec"].get("unschedulable") for n in nodes)
    w.act.delete_gang(g.name)  # the step releases a drained gang that serves nothing
    gangs = w.until(lambda gs: not gs and not w.claims(g.name), what="the drained gang released")
    assert gangs == [] and w.workers(group) == []
    assert w.group(group)["replicas"] == 0
