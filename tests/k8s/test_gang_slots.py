"""Gang slots on Kubernetes (rayscale.cluster.kube.slots): a multi-node replica's placement group can only
land on the nodes of one gang, because each gang slot has its own worker group whose Ray node labels are
the ones the slot's Serve deployment selects, and whose pods select the Nodes of the gang holding it."""

from __future__ import annotations

from ray._private.label_utils import parse_node_labels_string, validate_node_labels
from rayscale_testing.raypods import ray_node_labels

from rayscale.cluster import crdschema
from rayscale.cluster.kube.slots import SlotFlavor, slot_flavor, slot_group_name
from rayscale.cluster.render import RenderSettings, check_serve_configs, render, serve_config_from_catalog
from rayscale.core.act import CreateGang, GangPhase
from rayscale.core.catalog import Catalog
from rayscale.serve.config import slot_deployment_name, slot_label_selector, validate_serve_config

from .kubeworld import World, rendered, rendered_raycluster
from .test_actuator import BIG, act, created_claims

SLOT = "rayscale.io/gang-slot"
MODEL, FLAVOR, ITYPE = "qwen2-72b", "a10g", "g5.12xlarge"


def group_of(k: int) -> str:
    return slot_group_name(FLAVOR, ITYPE, MODEL, k)


# --- render ----------------------------------------------------------------------------------------


def test_each_gang_slot_gets_a_worker_group_whose_ray_labels_are_what_its_serve_deployment_selects(
    catalog: Catalog,
) -> None:
    # 64 A10G in the pool's limits, 8 per gang of two g5.12xlarge: at most 8 gangs, so 8 slots.
    assert slot_flavor(catalog, MODEL, FLAVOR) == SlotFlavor(MODEL, FLAVOR, ITYPE, 2, 8)
    assert slot_flavor(catalog, "mistral-7b", FLAVOR) is None  # one node per gang: no slots
    groups = {g["groupName"]: g for g in rendered_raycluster(catalog)["spec"]["workerGroupSpecs"]}
    slots = [g for g in groups.values() if SLOT in (g.get("labels") or {})]
    assert [g["groupName"] for g in slots] == [group_of(k) for k in range(8)]
    for k, g in enumerate(slots):
        want = {"rayscale.io/flavor": FLAVOR, "rayscale.io/model": MODEL, SLOT: str(k)}
        assert g["labels"] == want and slot_label_selector(MODEL, FLAVOR, k) == [want]
        # KubeRay writes them as `ray start --labels` (updateRayStartParamsLabels: sorted, "k=v" joined
        # by ","), and refuses rayStartParams.labels beside them; Ray parses and accepts what it gets.
        assert "labels" not in g["rayStartParams"]
        arg = ",".join(f"{key}={value}" for key, value in sorted(g["labels"].items()))
        assert parse_node_labels_string(arg) == want
        validate_node_labels(want)
        sel = g["template"]["spec"]["nodeSelector"]
        assert {key: sel.get(key) for key in ("rayscale.io/model", SLOT, "node.kubernetes.io/instance-type",
                                              "rayscale.io/ray-worker")} == {
            "rayscale.io/model": MODEL, SLOT: str(k), "node.kubernetes.io/instance-type": ITYPE,
            "rayscale.io/ray-worker": "true"}
        assert g["replicas"] == 0 and g["maxReplicas"] == 2  # room for its one gang
    # The (flavor, instance type)'s shared group keeps off every slot's Nodes; other groups are as before.
    shared = groups[f"{FLAVOR}-g5-12xlarge"]
    terms = shared["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchExpressions": [{"key": SLOT, "operator": "DoesNotExist"}]}]
    assert "labels" not in shared and "affinity" not in groups["l4-g6-xlarge"]["template"]["spec"]
    rs = rendered(catalog, "deployments/k8s/rayservice.yaml")[0]
    assert rs["spec"]["rayClusterConfig"] == rendered_raycluster(catalog)["spec"]


def test_the_catalogs_serve_config_runs_a_deployment_per_slot_and_everything_rendered_validates(
    catalog: Catalog,
) -> None:
    """serve_config_from_catalog sets gang_slots for the slot flavors; the render from the catalog passes
    Ray's ServeDeploySchema (check_serve_configs) and the CRD schemas."""
    loaded = validate_serve_config(serve_config_from_catalog(catalog), "<catalog>")
    models = {m.name: {f.flavor: f for f in m.flavors} for m in loaded.apps["llm"].models}
    big = models[MODEL][FLAVOR]
    assert big.gang_slots == 8
    assert big.deployment_names(MODEL) == [slot_deployment_name(MODEL, FLAVOR, k) for k in range(8)]
    assert models["mistral-7b"][FLAVOR].gang_slots == 0
    files = render(catalog, RenderSettings())  # serveConfigV2 from the catalog, not from files
    assert check_serve_configs(files) == []
    crds = crdschema.load_crds()
    errors = [str(e) for rel in ("deployments/k8s/raycluster.yaml", "deployments/k8s/rayservice.yaml")
              for d in rendered(catalog, rel) for e in crdschema.validate_all(d, source=rel, crds=crds)]
    assert errors == []


def test_a_long_name_still_makes_a_valid_group_name() -> None:
    name = slot_group_name("a10g", "g5.12xlarge", "a-very-long-model-name-that-goes-on-and-on-and-on", 11)
    assert len(name) <= 63 and name.endswith("-slot11") and name[0].isalnum()
    assert name != slot_group_name("a10g", "g5.12xlarge", "a-very-long-model-name-that-goes-on-and-on-and-om", 11)


# --- the actuator ----------------------------------------------------------------------------------


def test_two_gangs_get_slots_0_and_1_their_nodes_carry_them_and_each_slot_group_runs_its_gang(world: World) -> None:
    w = world
    a, b = act(w, {BIG: 2}, [])
    assert isinstance(a, CreateGang) and isinstance(b, CreateGang)
    gangs = w.until(lambda gs: len(gs) == 2 and all(g.phase == GangPhase.READY for g in gs), what="both ready")
    assert {g.name: g.slot for g in gangs} == {a.name: 0, b.name: 1}
    for g in gangs:
        assert g.slot is not None
        nodes = sorted(c["status"]["nodeName"] for c in w.claims(g.name))
        for c in w.claims(g.name):  # the claim carries the slot; Karpenter copies it to the Node
            for obj in (c, w.api.store.get("nodes", c["status"]["nodeName"])):
                lb = obj["metadata"]["labels"]
                assert (lb[SLOT], lb["rayscale.io/model"], lb["rayscale.io/flavor"]) == (str(g.slot), MODEL, FLAVOR)
        group = w.group(group_of(g.slot))
        assert group["replicas"] == 2
        pods = w.workers(group_of(g.slot))
        assert sorted(p["spec"]["nodeName"] for p in pods) == nodes  # the slot's pods on its gang only
        # KubeRay puts the group's labels on its pods and gives them to `ray start`.
        assert all(p["metadata"]["labels"][SLOT] == str(g.slot) for p in pods)
        assert [ray_node_labels(group)] == slot_label_selector(MODEL, FLAVOR, g.slot)
    assert all(w.group(group_of(k))["replicas"] == 0 for k in range(2, 8))
    assert w.group(f"{FLAVOR}-g5-12xlarge")["replicas"] == 0
    assert created_claims(w) == 4

    # A restarted controller reads the slots back from the cluster.
    w.actuator()
    assert {g.name: g.slot for g in w.tick()} == {a.name: 0, b.name: 1}

    # A released gang's slot stays held while any of its claims is listed: a new gang takes slot 2...
    assert w.act is not None
    w.act.delete_gang(a.name)
    w.tick()
    assert w.claims(a.name)
    c = CreateGang(f"{MODEL}-{FLAVOR}-od-7", MODEL, FLAVOR, "on-demand", a.zone, ITYPE, 2, "test")
    w.act.create_gang(c, w.clock.now())
    assert {x["metadata"]["labels"][SLOT] for x in w.claims(c.name)} == {"2"}
    # ... and once its claims are gone, the next new gang gets slot 0 back.
    w.until(lambda gs: w.claims(a.name) == [], what="released gang's claims gone")
    d = CreateGang(f"{MODEL}-{FLAVOR}-od-8", MODEL, FLAVOR, "on-demand", a.zone, ITYPE, 2, "test")
    w.act.create_gang(d, w.clock.now())
    assert {x["metadata"]["labels"][SLOT] for x in w.claims(d.name)} == {"0"}
    gangs = w.until(lambda gs: {g.name for g in gs if g.phase == GangPhase.READY} == {b.name, c.name, d.name},
                    what="three gangs ready")
    assert {g.name: g.slot for g in gangs} == {b.name: 1, c.name: 2, d.name: 0}
    assert [w.group(group_of(k))["replicas"] for k in range(4)] == [2, 2, 2, 0]


def test_a_gang_is_refused_when_every_slot_is_held(world: World) -> None:
    """As many gangs as slots hold them all: a further one is not created and is reported FAILED, so
    decide() deletes it and looks elsewhere (never a gang whose replica could not be placed)."""
    w = world
    assert w.act is not None
    for k in range(8):  # the claims of eight gangs, one member each is enough to hold a slot
        held = CreateGang(f"held-{k}", MODEL, FLAVOR, "on-demand", "us-east-1a", ITYPE, 2, "test")
        claim = w.act.nodeclaim(held, 0, w.clock.now(), extra={SLOT: str(k)})
        w.api.store.create("nodeclaims", claim)
    before = created_claims(w)
    extra = CreateGang(f"{MODEL}-{FLAVOR}-od-0", MODEL, FLAVOR, "on-demand", "us-east-1b", ITYPE, 2, "test")
    w.act.create_gang(extra, w.clock.now())
    assert w.claims(extra.name) == [] and created_claims(w) == before
    (g,) = [g for g in w.act.gangs(w.clock.now()) if g.name == extra.name]
    assert g.phase == GangPhase.FAILED and "every gang slot of qwen2-72b on a10g is held" in g.reason


def test_serve_targets_of_a_slot_flavor_are_not_written_as_a_deployment_serve_would_refuse(catalog: Catalog) -> None:
    """The controller's per-(model, flavor) target of a slot flavor names no deployment of the application
    (its replicas are per slot deployment): Serve refuses an override of a deployment the application does
    not build (override_deployment_info, ray/serve/_private/application_state.py), so KubeRay could not
    submit the config. It is left out; the other targets are written."""
    import yaml

    from rayscale.cluster.kube.rayservice import with_serve_targets

    text = yaml.safe_dump(serve_config_from_catalog(catalog), sort_keys=False)
    out = with_serve_targets(text, {"llm": {f"{MODEL}--{FLAVOR}": 2, "mistral-7b--a10g": 3}})
    assert out is not None
    raw = yaml.safe_load(out)
    (app,) = raw["applications"]
    assert app["deployments"] == [{"name": "mistral-7b--a10g", "num_replicas": 3}]
    validate_serve_config(raw, "serveConfigV2")
    assert with_serve_targets(out, {"llm": {f"{MODEL}--{FLAVOR}": 2, "mistral-7b--a10g": 3}}) is None
