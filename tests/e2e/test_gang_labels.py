"""Gangs reach Ray: a multi-node replica's placement group lands on the nodes of exactly one gang.

Real `ray start` nodes: the local actuator starts gangs of a two-node flavor (one device per node, so a
replica's two bundles need two nodes) and gives each a gang slot, a Ray node label. The application is
built by rayscale's own builder from a config with ``gang_slots``: one Serve deployment per slot, whose
``placement_group_bundle_label_selector`` names the slot. Ray alone would put a replica on any two free
nodes of the flavor; the first test shows slot 1's replica waiting while gang 0's two nodes are free, and
slot 0's replica on exactly them; the second, with the controller ordering two gangs, that each replica's
bundles sit on exactly the nodes of the gang holding its slot.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from rayscale_testing.waits import wait_for

from rayscale.autoscale_demo import app_args
from rayscale.cluster.actuator import LABEL_GANG
from rayscale.cluster.local import LocalCluster
from rayscale.cluster.local_actuator import LocalActuator, LocalActuatorConfig
from rayscale.controller.loop import Controller, ControllerConfig
from rayscale.controller.serve_client import ServeClient
from rayscale.core.act import ActSettings, CreateGang, Gang, GangPhase
from rayscale.core.catalog import Catalog, FlavorLimits, Parallelism
from rayscale.core.gangs import gang_shape
from rayscale.core.settings import Settings
from rayscale.serve.config import LABEL_GANG_SLOT, slot_deployment_name
from rayscale.signals.scrape import MetricsScraper, ray_metrics_endpoints
from tests.e2e.conftest import local_catalog, serve_http_url

APP = "gangs"
MODEL = "mistral-7b"
# No other e2e test runs l40s nodes, so no other application's replica can take this test's devices.
FLAVOR = "l40s"
DEVICE = {"GPU": 1, "accelerator_type:L40S": 1}  # a whole local l40s node


def _args() -> dict[str, Any]:
    args = app_args(local_catalog())
    (model,) = args["models"]
    (flavor,) = model["flavors"]
    flavor.update(flavor=FLAVOR, gang_slots=2,
                  # a two-node replica (pipeline stages on two nodes), as Ray Serve LLM's default strategy
                  # places it: PACK, which spreads over nodes when one cannot hold every bundle
                  placement_bundles=[{"resources": DEVICE}, {"resources": DEVICE}], placement_strategy="PACK")
    flavor["profile"].update(model=MODEL, flavor=FLAVOR)
    return {**args, "app_name": APP}


def _gang(name: str) -> CreateGang:
    return CreateGang(name, MODEL, FLAVOR, "on-demand", "local", "local-" + FLAVOR, 2, "test")


def _ready(actuator: LocalActuator, name: str) -> Gang | None:
    return next((g for g in actuator.gangs(time.time()) if g.name == name and g.phase == GangPhase.READY), None)


def _try_scale(dashboard: str, slot: int, replicas: int) -> bool:
    """Serve's external scaler API, as the controller calls it; False while the deployment is not known yet."""
    dep = slot_deployment_name(MODEL, FLAVOR, slot)
    r = httpx.post(f"{dashboard}/api/v1/applications/{APP}/deployments/{dep}/scale",
                   json={"target_num_replicas": replicas}, timeout=10)
    return r.status_code == 200


def _scale(dashboard: str, slot: int, replicas: int) -> None:
    assert _try_scale(dashboard, slot, replicas)


def _replica_pgs(slot: int) -> list[dict[str, Any]]:
    """The placement groups of the slot deployment's replicas (Serve names each after its replica actor,
    ``SERVE_REPLICA::<app>#<deployment>#<id>``)."""
    import ray

    mark = f"{APP}#{slot_deployment_name(MODEL, FLAVOR, slot)}#"
    return [pg for pg in ray.util.placement_group_table().values()
            if mark in (pg.get("name") or "") and pg["state"] != "REMOVED"]


def _placed(slot: int) -> set[str] | None:
    """The Ray node ids holding the bundles of the slot's one replica, once its placement group is created."""
    pgs = _replica_pgs(slot)
    if len(pgs) != 1 or pgs[0]["state"] != "CREATED":
        return None
    return set(pgs[0]["bundles_to_node_id"].values())


def _state(cluster: LocalCluster) -> str:
    """What a failure report needs: the slot placement groups and the nodes' gang labels."""
    pgs = [(pg["name"], pg["state"], pg["bundles_to_node_id"]) for k in (0, 1) for pg in _replica_pgs(k)]
    nodes = [(n.id, n.ray_node_id, n.labels.get(LABEL_GANG), n.labels.get(LABEL_GANG_SLOT)) for n in cluster.nodes()]
    return f"placement groups: {pgs}\nnodes: {nodes}"


def _wait(cluster: LocalCluster, predicate: Any, timeout_s: float, what: str) -> Any:
    try:
        return wait_for(predicate, timeout_s, what)
    except TimeoutError as e:
        raise AssertionError(f"{e}\n{_state(cluster)}") from None


def test_each_multi_node_replica_sits_inside_one_gang(cluster: LocalCluster) -> None:
    from ray import serve

    from rayscale.serve.app import build_app

    assert cluster.dashboard_url
    actuator = LocalActuator(cluster, LocalActuatorConfig(max_worker_nodes=6, node_start_timeout_s=180))
    try:
        serve_http_url(cluster.dashboard_url)
        serve.run_many([serve.RunTarget(target=build_app(_args()), name=APP, route_prefix=f"/{APP}",
                                        external_scaler_enabled=True)],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        # Each slot deploys at one replica (Serve's floor), waiting for its gang; slot 0 waits at 0 here.
        wait_for(lambda: APP in serve.status().applications, 120, "the application deployed")
        wait_for(lambda: _try_scale(cluster.dashboard_url, 0, 0), 120, "slot 0 scaled to 0")
        actuator.create_gang(_gang("g-a"), time.time())
        gang_a = wait_for(lambda: _ready(actuator, "g-a"), 300, "gang g-a up")
        assert gang_a.slot == 0 and len(gang_a.node_ids) == 2
        by_id = {n.ray_node_id: n for n in cluster.nodes()}
        assert {by_id[i].labels[LABEL_GANG_SLOT] for i in gang_a.node_ids} == {"0"}

        # Slot 1 has no gang yet. Its replica fits gang g-a's two free nodes by resources alone, but the
        # slot's label selector keeps it off them: its placement group stays pending.
        _wait(cluster, lambda: _replica_pgs(1), 60, "slot 1's placement group")
        time.sleep(10)
        (pg,) = _replica_pgs(1)
        assert pg["state"] == "PENDING", pg

        # Slot 0's replica, once asked for, is placed on exactly gang g-a's nodes, all carrying its label. (Two
        # gangs, each serving its own slot's replica, are the controller's test below.)
        _scale(cluster.dashboard_url, 0, 1)
        on_a = _wait(cluster, lambda: _placed(0), 180, "slot 0's replica placed")
        assert on_a == set(gang_a.node_ids)
        by_id = {n.ray_node_id: n for n in cluster.nodes()}
        assert {by_id[i].labels[LABEL_GANG] for i in on_a} == {"g-a"}
        # Serve deletes a replica still starting only after its start (~20 s): let it start.
        wait_for(lambda: serve.status().applications[APP].deployments[slot_deployment_name(MODEL, FLAVOR, 0)]
                 .status == "HEALTHY", 180, "slot 0's replica healthy")
    finally:
        serve.delete(APP)
        actuator.delete_gang("g-a")
        actuator.close()
        wait_for(lambda: not [n for n in cluster.nodes() if n.labels.get(LABEL_GANG) == "g-a"], 120,
                 "the gangs' nodes gone")


def _two_node_catalog() -> Catalog:
    """The local mistral-7b as a two-node replica (pipeline stages on two one-GPU l40s nodes), at least and
    at most two replicas: two gangs, so two gang slots."""
    cat = local_catalog()
    a10g = cat.flavors["a10g"]
    one_gpu = [it for it in a10g.instance_types if it.devices == 1][:1]
    fl = a10g.model_copy(update={"name": FLAVOR, "instance_types": one_gpu, "limits": FlavorLimits(nodes=4)})
    m = cat.models[MODEL].model_copy(update={"parallelism": {FLAVOR: Parallelism(tp=1, pp=2)},
                                             "min_replicas": 2, "max_replicas": 2})
    p = cat.profile(MODEL, "a10g").model_copy(update={"flavor": FLAVOR})
    return cat.model_copy(update={"flavors": {FLAVOR: fl}, "models": {MODEL: m}, "profiles": {f"{MODEL}/{FLAVOR}": p}})


def test_the_controller_gives_each_gang_a_slot_and_runs_one_replica_inside_each(cluster: LocalCluster) -> None:
    """The whole path: the plan wants two replicas, decide orders two gangs, the actuator gives them slots
    0 and 1, the controller turns Serve's slot deployments (deployed at one waiting replica each) to one
    replica per ready gang, and each replica's bundles sit on its own gang's nodes. Then requests through
    the ingress: the controller weights the flavor's slots by the replicas serving there, and both slot
    deployments answer, none fails."""
    from ray import serve

    from rayscale.serve.app import build_app
    from rayscale.serve.weights import set_flavor_weights

    cat = _two_node_catalog()
    assert gang_shape(cat, MODEL, FLAVOR).nodes == 2
    assert cluster.dashboard_url
    assert not [n for n in cluster.nodes() if n.flavor == FLAVOR], _state(cluster)
    act = LocalActuator(cluster, LocalActuatorConfig(default_launch_delay_s=0.5, max_worker_nodes=6,
                                                     node_start_timeout_s=180, drain_grace_s=5.0))
    settings = Settings(period_s=2.0, window_s=10.0, fast_window_s=4.0, stale_after_s=8.0, forecaster="last",
                        # four `ray start` nodes, one at a time, on two busy cores
                        act=ActSettings(backoff_s=30.0, launch_timeout_factor=9.0))
    ctl = Controller(cat, act, ServeClient(cluster.dashboard_url), MetricsScraper(ray_metrics_endpoints),
                     ControllerConfig(settings, app_name=APP), weights_sink=set_flavor_weights)
    try:
        ingress = serve_http_url(cluster.dashboard_url)
        serve.run_many([serve.RunTarget(target=build_app(_args()), name=APP, route_prefix=f"/{APP}",
                                        external_scaler_enabled=True)],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        wait_for(lambda: ctl.serve.snapshot().slots.get((MODEL, FLAVOR)), 120, "the slot deployments in Serve")
        ctl.start()

        def both_placed() -> tuple[dict[int, Gang], dict[int, set[str]]] | None:
            ready = {g.slot: g for g in ctl.gangs()
                     if g.phase == GangPhase.READY and g.slot is not None and g.name.startswith(MODEL)}
            placed = {k: _placed(k) for k in (0, 1)}
            if set(ready) != {0, 1} or not all(placed.values()):
                return None
            return ready, {k: v for k, v in placed.items() if v}

        gangs, placed = _wait(cluster, both_placed, 420, "two gangs in slots 0 and 1, each running its replica")
        for k in (0, 1):
            assert placed[k] == set(gangs[k].node_ids), (k, placed, gangs, _state(cluster))
        _wait(cluster, lambda: ctl.serve.snapshot().slots[(MODEL, FLAVOR)] == {0: 1, 1: 1}, 30,
              "Serve's targets: one replica per slot")
        assert not [r.errors for r in ctl.records if any("slot" in e for e in r.errors)]
        _wait(cluster, lambda: ctl.serve.snapshot().slots_serving.get((MODEL, FLAVOR)) == {0: 1, 1: 1}, 120,
              "both slot replicas serving")
        answered = _answering_slots(f"{ingress}/{APP}", within_s=30.0)
        assert answered == {slot_deployment_name(MODEL, FLAVOR, k) for k in (0, 1)}, answered
    finally:
        ctl.stop()
        serve.delete(APP)
        for g in act.gangs(time.time()):
            act.delete_gang(g.name)
        act.close()
        wait_for(lambda: not [n for n in cluster.nodes() if n.flavor == FLAVOR], 120, "the gangs' nodes gone")


def _answering_slots(url: str, within_s: float, concurrent: int = 8) -> set[str]:
    """The slot deployments that answer waves of ``concurrent`` completions sent together through the
    ingress (each names its deployment in system_fingerprint), until both have or ``within_s`` passed; every
    request must succeed. Bounded by time, not waves: the controller publishes the slots' weights to the
    ingress once a period after Serve reports both replicas serving, and a few fast waves can all land
    before that."""
    import asyncio

    async def wave(client: httpx.AsyncClient) -> list[httpx.Response]:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        return await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body) for _ in range(concurrent)))

    async def run() -> set[str]:
        seen: set[str] = set()
        async with httpx.AsyncClient(timeout=60) as client:
            deadline = time.monotonic() + within_s
            while len(seen) < 2 and time.monotonic() < deadline:
                for r in await wave(client):
                    assert r.status_code == 200, r.text
                    seen.add(r.json()["system_fingerprint"].removeprefix("rayscale-emulated:"))
                await asyncio.sleep(0.5)
        return seen

    return asyncio.run(run())
