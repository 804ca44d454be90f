"""Gang slots in the serve config: names, validation, what Serve itself accepts, and the controller's mapping
of replicas and routing weights onto slot deployments."""

from __future__ import annotations

import copy
import random
from collections import Counter
from typing import Any

import pytest

from rayscale.autoscale_demo import app_args, local_stand_in_catalog
from rayscale.controller.serve_client import parse_details
from rayscale.controller.slots import slot_targets, slot_weights
from rayscale.core.act import Gang, GangPhase
from rayscale.serve.config import (
    LABEL_GANG_SLOT,
    ConfigError,
    parse_app_args,
    parse_deployment_name,
    slot_deployment_name,
    split_deployment_name,
    split_route_key,
    validate_serve_config,
)
from rayscale.serve.weights import pick_route

MODEL, FLAVOR = "mistral-7b", "a10g"
DEVICE = {"GPU": 1, "accelerator_type:A10G": 1}


def _args(slots: int = 3, **flavor: Any) -> dict[str, Any]:
    args = app_args(local_stand_in_catalog())
    f = args["models"][0]["flavors"][0]
    f.update(gang_slots=slots, placement_bundles=[{"resources": DEVICE}, {"resources": DEVICE}], **flavor)
    return args


def _serve_config(args: dict[str, Any], deployments: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    app = {"name": args["app_name"], "route_prefix": "/", "import_path": "rayscale.serve.app:build_app",
           "external_scaler_enabled": True, "args": args}
    if deployments is not None:
        app["deployments"] = deployments
    return {"applications": [app]}


def test_slot_deployment_names_split_back_and_other_names_do_not_parse() -> None:
    name = slot_deployment_name(MODEL, FLAVOR, 12)
    assert name == "mistral-7b--a10g--slot12"
    assert parse_deployment_name(name) == (MODEL, FLAVOR, 12)
    assert split_deployment_name(name) == (MODEL, FLAVOR)
    assert parse_deployment_name("mistral-7b--a10g") == (MODEL, FLAVOR, None)
    for other in ("ingress", "a--b--slot", "a--b--slot01", "a--b--x1", "a--b--slot1--c", "--a10g"):
        assert parse_deployment_name(other) is None, other
    # The ingress's routing keys: the deployment name without the model.
    assert split_route_key("a10g--slot12") == (FLAVOR, 12)
    for plain in ("a10g", "a10g--slot", "a10g--slot01", "--slot1"):
        assert split_route_key(plain) == (plain, None), plain


def test_a_slot_flavor_declares_one_deployment_per_slot_and_the_config_may_override_them() -> None:
    cfg = parse_app_args(_args())
    (f,) = cfg.models[0].flavors
    assert f.deployment_names(MODEL) == [slot_deployment_name(MODEL, FLAVOR, k) for k in range(3)]
    override = {"name": slot_deployment_name(MODEL, FLAVOR, 2), "num_replicas": 1}
    validate_serve_config(_serve_config(_args(), [override]), "<test>")
    with pytest.raises(ConfigError, match="is not a deployment"):  # no slot 3, and no plain flavor deployment
        validate_serve_config(_serve_config(_args(), [{**override, "name": slot_deployment_name(MODEL, FLAVOR, 3)}]),
                              "<test>")
    with pytest.raises(ConfigError, match="is not a deployment"):
        validate_serve_config(_serve_config(_args(), [{**override, "name": f"{MODEL}--{FLAVOR}"}]), "<test>")
    with pytest.raises(ConfigError, match="num_replicas is per gang slot"):
        parse_app_args(_args(num_replicas=2))


def test_the_built_app_gives_each_slot_a_selector_that_rays_schema_accepts() -> None:
    """The application as Serve builds it from the import path (ray/serve/_private/build_app.py): one
    deployment per slot, every bundle confined to the slot's nodes; each deployment, written out as
    `serve build` does (ray/serve/scripts.py) with its selector, passes Ray's ServeDeploySchema. (Ray's
    deployment_to_schema leaves the selector out, so `serve build` output would lose it; the import path
    keeps it, and a serve config may set it as a deployment override.)"""
    from ray.serve._private.build_app import build_app as serve_build
    from ray.serve.deployment import deployment_to_schema
    from ray.serve.schema import ServeDeploySchema

    from rayscale.serve.app import build_app

    built = {d.name: d for d in serve_build(build_app(_args()), name="slots").deployments}
    assert set(built) == {"ingress", *(slot_deployment_name(MODEL, FLAVOR, k) for k in range(3))}
    written = []
    for name, d in built.items():
        entry = deployment_to_schema(d).model_dump(exclude_unset=True)
        if name != "ingress":
            k = parse_deployment_name(name)[2]  # type: ignore[index]
            selector = {"rayscale.io/flavor": FLAVOR, "rayscale.io/model": MODEL, LABEL_GANG_SLOT: str(k)}
            assert entry["num_replicas"] == 1  # Serve's floor at deploy time; the controller scales it to 0
            assert entry["placement_group_bundles"] == [DEVICE, DEVICE]
            # Serve repeats the one selector for every bundle (ReplicaConfig._normalize_bundle_label_selector)
            assert d._replica_config.placement_group_bundle_label_selector == [selector, selector]
            entry["placement_group_bundle_label_selector"] = [selector]
        written.append(entry)
    schema = ServeDeploySchema.model_validate(
        {"applications": [{"name": "slots", "import_path": "rayscale.serve.app:build_app", "deployments": written}]})
    assert all(d.placement_group_bundle_label_selector for d in schema.applications[0].deployments
               if d.name != "ingress")


def _gang(name: str, slot: int | None, phase: GangPhase = GangPhase.READY, created: float = 0.0) -> Gang:
    return Gang(name, MODEL, FLAVOR, "on-demand", "local", "local-a10g", 2, phase, created, slot=slot)


def test_slot_targets_put_replicas_only_on_ready_gangs_and_keep_running_ones() -> None:
    gangs = [_gang("old", 2, created=1), _gang("new", 0, created=5), _gang("up", 1, GangPhase.PENDING, 0)]
    floors = {0: 1, 1: 1, 2: 1}  # as deployed: one waiting replica per slot
    assert slot_targets(0, gangs, floors) == {0: 0, 1: 0, 2: 0}
    assert slot_targets(1, gangs, {0: 0, 1: 0, 2: 0}) == {0: 0, 1: 0, 2: 1}  # the oldest ready gang
    assert slot_targets(1, gangs, {0: 1, 1: 0, 2: 0}) == {0: 1, 1: 0, 2: 0}  # a running replica stays
    assert slot_targets(5, gangs, floors) == {0: 1, 1: 0, 2: 1}  # never onto a pending gang
    # a scale-down empties the newest gang (the one act releases once it serves nothing)
    assert slot_targets(1, gangs, {0: 1, 1: 0, 2: 1}) == {0: 0, 1: 0, 2: 1}
    # a gang whose slot has no deployment (more gangs than slots) gets nothing
    assert slot_targets(2, [_gang("x", 7)], {0: 0}) == {0: 0}


def test_slot_weights_split_a_flavor_over_its_running_slots() -> None:
    w = slot_weights({"a10g": 0.6, "l4": 0.4}, {"a10g": {0: 1, 1: 0, 2: 1}})
    assert w == {"a10g--slot0": 0.3, "a10g--slot1": 0.0, "a10g--slot2": 0.3, "l4": 0.4}


def test_the_ingress_sends_a_slot_flavors_request_to_its_least_busy_slot() -> None:
    # A flavor's share is the sum of its slots' weights; within it the request takes the slot this ingress
    # has fewest requests in flight on (a slot that weighs nothing has no replica serving: never taken).
    rng = random.Random(0)
    w = {"l4": 2.0, "a10g--slot0": 1.0, "a10g--slot1": 1.0, "a10g--slot2": 0.0}
    busy = {"a10g--slot0": 3, "a10g--slot1": 1, "a10g--slot2": 0}
    picks = Counter(pick_route(w, busy, rng) for _ in range(4000))
    assert set(picks) == {"l4", "a10g--slot1"}
    assert 0.45 < picks["l4"] / 4000 < 0.55
    # Among equally busy slots, the drawn one: each about half of the flavor's share.
    even = Counter(pick_route(w, {}, rng) for _ in range(4000))
    assert 0.2 < even["a10g--slot0"] / 4000 < 0.3 and 0.2 < even["a10g--slot1"] / 4000 < 0.3
    # Requests that stay in flight spread evenly over the slots, whatever the draws.
    in_flight: dict[str, int] = {}
    for _ in range(100):
        key = pick_route({"a10g--slot0": 1.0, "a10g--slot1": 1.0}, in_flight, rng)
        in_flight[key] = in_flight.get(key, 0) + 1
    assert in_flight == {"a10g--slot0": 50, "a10g--slot1": 50}


def test_a_request_counts_on_its_slot_until_it_finishes_however_it_ends(ray_cluster: Any) -> None:
    from rayscale.serve.ingress import _Tracked
    from rayscale.serve.metrics import IngressMetrics

    metrics = IngressMetrics([MODEL], replica="test-ingress")
    in_flight = {"a10g--slot0": 0, "a10g--slot1": 0}
    a, b = _Tracked(metrics, MODEL), _Tracked(metrics, MODEL)
    a.route(in_flight, "a10g--slot0")
    b.route(in_flight, "a10g--slot0")
    b.route(in_flight, "a10g--slot1")  # routed again: counted on the new slot only
    assert in_flight == {"a10g--slot0": 1, "a10g--slot1": 1}
    a.finish()
    a.finish()
    b.answer(False)
    assert in_flight == {"a10g--slot0": 0, "a10g--slot1": 1}
    b.finish()
    assert in_flight == {"a10g--slot0": 0, "a10g--slot1": 0} and metrics.in_flight[MODEL] == 0


def test_serve_details_count_a_slot_flavor_per_flavor_and_per_slot() -> None:
    rep = {"node_id": "n1", "node_ip": "10.0.0.1", "state": "RUNNING"}
    details = {"applications": {"llm": {"deployments": {
        "ingress": {"target_num_replicas": 1, "replicas": [rep]},
        slot_deployment_name(MODEL, FLAVOR, 0): {"target_num_replicas": 1, "replicas": [rep]},
        slot_deployment_name(MODEL, FLAVOR, 1): {"target_num_replicas": 0, "replicas": []},
        f"{MODEL}--l4": {"target_num_replicas": 2, "replicas": [copy.deepcopy(rep), {**rep, "state": "STARTING"}]},
    }}}}
    snap = parse_details(details)
    assert snap.target == {(MODEL, FLAVOR): 1, (MODEL, "l4"): 2}
    assert snap.running == {(MODEL, FLAVOR): 1, (MODEL, "l4"): 2}
    assert snap.serving == {(MODEL, FLAVOR): 1, (MODEL, "l4"): 1}  # a starting replica takes no requests
    assert snap.slots == {(MODEL, FLAVOR): {0: 1, 1: 0}}
    assert snap.app_of[(MODEL, FLAVOR)] == "llm"


def test_the_controller_routes_a_slot_flavor_only_to_the_slots_whose_replica_serves() -> None:
    """Two gang slots told to run a replica, one still starting: the flavor's whole weight goes to the slot
    that serves (Serve's router would queue the other slot's share behind a replica that takes nothing)."""
    from rayscale.config import load_catalog
    from rayscale.controller.loop import Controller, ControllerConfig
    from rayscale.core.estimate import estimate
    from rayscale.core.signals import Freshness, ModelSignals, RequestMix

    cat = load_catalog().subset([MODEL], [FLAVOR, "l4"])
    mix = RequestMix(prompt_mean=1000, output_mean=200, prompt_p95=3000)
    demands = estimate(cat, {MODEL: ModelSignals(MODEL, Freshness.FRESH, 1.0, 2.0, mix)})
    rep = {"node_id": "n1", "state": "RUNNING"}
    details = {"applications": {"llm": {"deployments": {
        slot_deployment_name(MODEL, FLAVOR, 0): {"target_num_replicas": 1, "replicas": [rep]},
        slot_deployment_name(MODEL, FLAVOR, 1): {"target_num_replicas": 1, "replicas": [{**rep, "state": "STARTING"}]},
        slot_deployment_name(MODEL, FLAVOR, 2): {"target_num_replicas": 0, "replicas": []},
        f"{MODEL}--l4": {"target_num_replicas": 1, "replicas": [rep]},
    }}}}
    snap = parse_details(details)
    assert snap.slots == {(MODEL, FLAVOR): {0: 1, 1: 1, 2: 0}}
    assert snap.slots_serving == {(MODEL, FLAVOR): {0: 1, 1: 0, 2: 0}}
    pushed: list[dict[str, float]] = []
    none: Any = None
    ctl = Controller(cat, none, none, none, ControllerConfig(), weights_sink=lambda a, m, w: pushed.append(w))
    assert ctl._route(dict(demands), snap) == []
    (w,) = pushed
    caps = demands[MODEL].capacity
    assert w[f"{FLAVOR}--slot0"] == pytest.approx(caps[FLAVOR].rps, rel=1e-3)
    assert w[f"{FLAVOR}--slot1"] == 0.0 and w[f"{FLAVOR}--slot2"] == 0.0
    assert w["l4"] == pytest.approx(caps["l4"].rps, rel=1e-3)
