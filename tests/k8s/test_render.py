"""`rayscale render`: every manifest validates against the real CRDs, and the checked-in files are current."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from rayscale.cluster import crdschema
from rayscale.cluster.render import RenderSettings, default_serve_configs, render
from rayscale.commands import render as render_cmd
from rayscale.core.catalog import AcceleratorKind, Catalog

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
