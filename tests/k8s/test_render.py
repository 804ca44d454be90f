"""`rayscale render`: every manifest validates against the real CRDs, and the checked-in files are current."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from rayscale.cluster import crdschema
from rayscale.cluster.render import (
    LLM_APP,
    RenderSettings,
    check_serve_configs,
    default_serve_configs,
    render,
    serve_config_from_files,
)
from rayscale.commands import render as render_cmd
from rayscale.core.catalog import AcceleratorKind, Catalog
from rayscale.serve.config import ConfigError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(catalog: Catalog) -> dict[str, str]:
    serve = tuple(str(p) for p in default_serve_configs(REPO))
    return render(catalog, RenderSettings(serve_configs=serve))


@pytest.fixture(scope="module")
def crds() -> list[crdschema.CRDSchema]:
    return crdschema.load_crds()


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_PARSED: dict[str, list[dict[str, Any]]] = {}


def docs(text: str) -> list[dict[str, Any]]:
    if text not in _PARSED:  # the RayService is ~100 kB of YAML: parse each file once
        _PARSED[text] = [d for d in yaml.load_all(text, Loader=_LOADER) if d]
    return copy.deepcopy(_PARSED[text])


def by_kind(files: dict[str, str], kind: str) -> list[dict[str, Any]]:
    return [d for t in files.values() for d in docs(t) if d["kind"] == kind]


def test_every_rendered_manifest_validates_against_the_crds(files: dict[str, str], crds: Any) -> None:
    errors = [str(e) for rel, text in files.items() for d in docs(text)
              for e in crdschema.validate_all(d, source=rel, crds=crds)]
    assert errors == []
    # Both Karpenter variants (upstream main and the AWS-vendored v1.14.0 copy) were checked.
    assert len(crdschema.find_crds("karpenter.sh/v1", "NodePool", crds)) == 2
    assert {d["kind"] for t in files.values() for d in docs(t)} >= {
        "NodePool", "EC2NodeClass", "RayCluster", "RayService", "Deployment", "ClusterRole", "ServiceAccount"}


def test_checked_in_manifests_are_what_render_produces(files: dict[str, str]) -> None:
    # Byte-equal to the rendered text, which the test above validates: so the checked-in files are valid.
    for rel, text in files.items():
        p = REPO / rel
        assert p.is_file(), f"{rel} is not checked in: run `rayscale render`"
        assert p.read_text() == text, f"{rel} is stale: run `rayscale render`"
    generated = {str(p.relative_to(REPO)) for d in ("nodepools", "deployments/k8s")
                 for p in (REPO / d).rglob("*.yaml")}
    assert generated == set(files), "a file there that render does not produce"


def test_an_invalid_manifest_is_caught(files: dict[str, str], crds: Any) -> None:
    (pool,) = docs(files["nodepools/a10g.yaml"])
    del pool["spec"]["disruption"]["consolidateAfter"]  # required by the AWS-vendored CRD
    assert any("consolidateAfter" in str(e) for e in crdschema.validate_all(pool, crds=crds))


def test_pools_follow_the_catalog_and_never_consolidate_serving_nodes(files: dict[str, str],
                                                                       catalog: Catalog) -> None:
    pools = {p["metadata"]["name"]: p for p in by_kind(files, "NodePool")}
    gpu = [f for f in catalog.flavors.values() if f.kind == AcceleratorKind.GPU]
    assert set(pools) == {"ray-head", "neuron", *(f.name for f in gpu)}
    for p in pools.values():
        d = p["spec"]["disruption"]
        assert d["consolidationPolicy"] == "WhenEmpty" and d["consolidateAfter"]
        assert {"nodes": "0", "reasons": ["Drifted", "Underutilized"]} in d["budgets"]
        assert p["spec"]["template"]["spec"]["expireAfter"] == "Never" and p["spec"]["limits"]
    for f in gpu:
        spec = pools[f.name]["spec"]["template"]["spec"]
        reqs = {r["key"]: r["values"] for r in spec["requirements"]}
        assert reqs["node.kubernetes.io/instance-type"] == sorted(it.name for it in f.instance_types)
        assert reqs["karpenter.sh/capacity-type"] == sorted(c.value for c in f.capacity_types)
        assert spec["taints"] == [{"key": t.key, "effect": t.effect} for t in f.taints]
        assert pools[f.name]["spec"]["limits"]["nvidia.com/gpu"] == str(f.limits.devices)
    neuron_types = {r["key"]: r["values"] for r in pools["neuron"]["spec"]["template"]["spec"]["requirements"]}
    assert {"inf2.xlarge", "trn1.32xlarge"} <= set(neuron_types["node.kubernetes.io/instance-type"])


def test_raycluster_head_on_the_x86_pool_and_a_worker_group_per_flavor(files: dict[str, str],
                                                                       catalog: Catalog) -> None:
    (rc,) = by_kind(files, "RayCluster")
    (svc,) = by_kind(files, "RayService")
    spec = rc["spec"]
    assert spec["enableInTreeAutoscaling"] is False and svc["spec"]["rayClusterConfig"] == spec
    assert spec["headGroupSpec"]["template"]["spec"]["nodeSelector"] == {"karpenter.sh/nodepool": "ray-head"}
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    flavors = {g["template"]["spec"]["nodeSelector"]["rayscale.io/flavor"] for g in groups.values()}
    assert flavors == {f.name for f in catalog.flavors.values() if f.kind != AcceleratorKind.CPU}
    g = groups["a10g-g5-12xlarge"]
    assert g["replicas"] == 0 and g["rayStartParams"]["num-gpus"] == "4"
    assert "accelerator_type:A10G" in g["rayStartParams"]["resources"]
    assert g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert g["template"]["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                     "effect": "NoSchedule"}]
    n = groups["inf2-inf2-xlarge"]
    assert "neuron_cores" in n["rayStartParams"]["resources"]
    # A Ray node that exits (a drained raylet) is not restarted in place: KubeRay replaces its pod.
    assert {g["template"]["spec"]["restartPolicy"] for g in groups.values()} == {"Never"}
    serve = yaml.safe_load(svc["spec"]["serveConfigV2"])
    assert serve["applications"] and all(a["import_path"].startswith("rayscale.") for a in serve["applications"])


def test_rbac_has_no_wildcards(files: dict[str, str]) -> None:
    for kind in ("ClusterRole", "Role"):
        for role in by_kind(files, kind):
            for rule in role["rules"]:
                assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]


def test_cli_writes_and_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    render_cmd.register(sub)
    monkeypatch.chdir(REPO)  # default serve configs come from ./deployments
    out = tmp_path / "out"

    def run(*argv: str) -> int:
        args = parser.parse_args(["render", *argv])
        return int(args.handler(args))

    assert run("--out", str(out), "--no-validate") == 0
    assert (out / "nodepools/a10g.yaml").read_text() == (REPO / "nodepools/a10g.yaml").read_text()
    assert run("--out", str(out), "--check", "--no-validate") == 0
    (out / "nodepools/a10g.yaml").write_text("# edited\n")
    assert run("--out", str(out), "--check", "--no-validate") == 1


@pytest.fixture(scope="module")
def catalog_files(catalog: Catalog) -> dict[str, str]:
    """What render writes with no serve config files: one generated from the catalog."""
    return render(catalog, RenderSettings())


def serve_config(files: dict[str, str]) -> dict[str, Any]:
    (svc,) = by_kind(files, "RayService")
    return dict(yaml.safe_load(svc["spec"]["serveConfigV2"]))


@pytest.mark.parametrize("which", ["files", "catalog_files"])
def test_every_rendered_serve_config_is_what_ray_serve_accepts_and_rayscale_can_scale(
        which: str, request: pytest.FixtureRequest) -> None:
    from ray.serve.schema import ServeDeploySchema

    files = request.getfixturevalue(which)
    schema = ServeDeploySchema.model_validate(serve_config(files))  # Ray's own code, as KubeRay submits it
    (app,) = schema.applications
    assert (app.name, app.route_prefix, app.args["app_name"]) == (LLM_APP, "/", LLM_APP)
    assert app.external_scaler_enabled is True  # else Serve's scale API answers 412
    assert check_serve_configs(files) == []


def test_shipped_configs_become_one_app_with_every_model_and_override() -> None:
    cfg = serve_config_from_files(default_serve_configs(REPO))
    (app,) = cfg["applications"]
    ids = [e["model_loading_config"]["model_id"] for e in app["args"]["llm_configs"]]
    assert ids == ["mistral-7b", "qwen2-7b"]
    assert [d["name"] for d in app["deployments"]] == ["mistral-7b--a10g", "qwen2-7b--a10g"]


def _serve_file(tmp_path: Path, name: str, mutate: Any) -> Path:
    raw = yaml.safe_load((REPO / "deployments" / "mistral-7b.yaml").read_text())
    mutate(raw["applications"][0])
    p = tmp_path / name
    p.write_text(yaml.safe_dump(raw))
    return p


def test_files_whose_apps_cannot_become_one_are_refused(tmp_path: Path) -> None:
    a = _serve_file(tmp_path, "a.yaml", lambda app: None)

    def other_ingress(app: dict[str, Any]) -> None:
        app["args"]["ingress"] = {"num_replicas": 2}
        app["args"]["llm_configs"][0]["model_loading_config"]["model_id"] = "other"

    b = _serve_file(tmp_path, "b.yaml", other_ingress)
    with pytest.raises(ConfigError, match=rf"^{b}: applications\.mistral-7b: args\.ingress"):
        serve_config_from_files([a, b])


def test_check_catches_a_duplicate_route_prefix_in_a_rendered_rayservice(files: dict[str, str]) -> None:
    (svc,) = by_kind(files, "RayService")
    cfg = serve_config(files)
    twin = copy.deepcopy(cfg["applications"][0])
    twin["name"] = twin["args"]["app_name"] = "twin"  # a second application at "/", as render once wrote
    cfg["applications"].append(twin)
    svc["spec"]["serveConfigV2"] = yaml.safe_dump(cfg)
    (err,) = check_serve_configs({"x.yaml": yaml.safe_dump(svc)})
    assert err.startswith("x.yaml: RayService rayscale spec.serveConfigV2: not a valid Ray Serve config")
    assert 'Found duplicate applications for route prefix "/"' in err


def test_the_controller_deployment_follows_the_rendered_rayservice(files: dict[str, str]) -> None:
    (svc,) = by_kind(files, "RayService")
    (dep,) = by_kind(files, "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    name = svc["metadata"]["name"]
    assert args[args.index("--rayservice") + 1] == name and "--raycluster" not in args
    # KubeRay's RayService head Service, which follows the active cluster.
    assert args[args.index("--dashboard") + 1] == f"http://{name}-head-svc.{svc['metadata']['namespace']}:8265"
    assert args[args.index("--app") + 1] == LLM_APP
    # The controller's own parser takes these args.
    from rayscale.commands import controller as controller_cmd

    parser = argparse.ArgumentParser()
    controller_cmd.register(parser.add_subparsers())
    parsed = parser.parse_args(container["command"][1:] + args)
    assert (parsed.rayservice, parsed.actuator, parsed.app) == (name, "kube", LLM_APP)


def test_the_controller_pod_is_scraped_on_the_port_its_metrics_server_binds_on_all_interfaces(
        files: dict[str, str]) -> None:
    """Prometheus finds the pod by its annotations (or a PodMonitor by the port's name) and scrapes the pod
    IP, so the endpoint must listen there, not on loopback, at the port both name."""
    from rayscale.commands import controller as controller_cmd

    (dep,) = by_kind(files, "Deployment")
    template = dep["spec"]["template"]
    (container,) = template["spec"]["containers"]
    parser = argparse.ArgumentParser()
    controller_cmd.register(parser.add_subparsers())
    parsed = parser.parse_args(container["command"][1:] + container["args"])
    assert (parsed.metrics_address, parsed.metrics_port) == ("0.0.0.0", 9108)
    assert template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "9108", "prometheus.io/path": "/metrics"}
    assert {"name": "metrics", "containerPort": 9108, "protocol": "TCP"} in container["ports"]
    # Only the pod template: annotations on the Deployment itself are not what kubernetes_sd's pod role reads.
    assert "annotations" not in dep["metadata"]


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    render_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["render", *argv])
    return int(args.handler(args))


def test_cli_check_validates_serve_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)  # shipped serve configs come from ./deployments
    assert _cli("--out", str(REPO), "--check") == 0  # checked-in files valid and current
    capsys.readouterr()

    def unflagged(app: dict[str, Any]) -> None:
        del app["external_scaler_enabled"]

    bad = _serve_file(tmp_path, "unflagged.yaml", unflagged)
    assert _cli("--out", str(tmp_path), "--check", "--serve-config", str(bad)) == 1
    err = capsys.readouterr().err
    assert f"invalid: {bad}: applications.0.external_scaler_enabled: must be true" in err
    assert "stale:" not in err  # validation fails before the comparison

    def at_root(app: dict[str, Any]) -> None:  # not rayscale's: kept as is, beside the merged app at "/"
        app.update(name="other", import_path="my.module:app", args={})
        app.pop("deployments")

    other = _serve_file(tmp_path, "other.yaml", at_root)
    good = REPO / "deployments" / "mistral-7b.yaml"
    assert _cli("--out", str(tmp_path), "--serve-config", str(good), "--serve-config", str(other)) == 1
    err = capsys.readouterr().err
    assert "invalid: deployments/k8s/rayservice.yaml: RayService rayscale spec.serveConfigV2" in err
    assert 'Found duplicate applications for route prefix "/"' in err
    assert not (tmp_path / "deployments").exists()  # nothing written


def test_the_controller_deployment_runs_the_shipped_settings_file_from_its_configmap(
        files: dict[str, str], tmp_path: Path) -> None:
    from rayscale.cluster.render import RenderSettings, render
    from rayscale.config import load_catalog, settings_from_mapping
    from rayscale.core.catalog import CatalogError
    from rayscale.core.settings import Settings

    dep = by_kind(files, "Deployment")[0]["spec"]["template"]["spec"]
    args = dep["containers"][0]["args"]
    path = args[args.index("--settings") + 1]
    mount = dep["containers"][0]["volumeMounts"][0]
    assert path.startswith(mount["mountPath"] + "/")
    vol = next(v for v in dep["volumes"] if v["name"] == mount["name"])
    cm = next(c for c in by_kind(files, "ConfigMap") if c["metadata"]["name"] == vol["configMap"]["name"])
    text = cm["data"][path.rsplit("/", 1)[1]]
    assert settings_from_mapping(yaml.safe_load(text), "configmap") == Settings()
    bad = tmp_path / "bad.yaml"
    bad.write_text("planner:\n  solver: quantum\n")
    with pytest.raises(CatalogError, match="solver must be auto, exact or greedy"):
        render(load_catalog(), RenderSettings(settings_file=str(bad)))
