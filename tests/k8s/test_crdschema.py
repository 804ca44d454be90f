"""Manifest validation against the real CRD schemas (both Karpenter variants, KubeRay)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rayscale.cluster import crdschema
from rayscale.cluster.crdschema import validate_all

from .manifests import nodeclaim, raycluster

UPSTREAM = "karpenter.sh_nodepools.yaml"
VENDORED = "aws-vendored/karpenter.sh_nodepools.yaml"


def nodepool(**disruption: Any) -> dict[str, Any]:
    return {
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodePool",
        "metadata": {"name": "rayscale-a10g"},
        "spec": {
            "template": {
                "metadata": {"labels": {"rayscale.io/flavor": "a10g", "rayscale.io/managed-by": "rayscale"}},
                "spec": {
                    "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "gpu"},
                    "requirements": [
                        {
                            "key": "node.kubernetes.io/instance-type",
                            "operator": "In",
                            "values": ["g5.xlarge", "g5.2xlarge"],
                        },
                        {"key": "karpenter.k8s.aws/instance-gpu-count", "operator": "Gt", "values": ["0"]},
                        {
                            "key": "karpenter.sh/capacity-type",
                            "operator": "In",
                            "values": ["on-demand", "spot"],
                        },
                    ],
                    "taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}],
                    "expireAfter": "Never",
                },
            },
            "disruption": disruption or {"consolidationPolicy": "WhenEmpty", "consolidateAfter": "5m"},
            "limits": {"nvidia.com/gpu": 16},
        },
    }


def by_crd(errors: list[crdschema.SchemaError]) -> dict[str, list[crdschema.SchemaError]]:
    out: dict[str, list[crdschema.SchemaError]] = {}
    for e in errors:
        out.setdefault(e.crd, []).append(e)
    return out


def test_both_karpenter_variants_are_loaded_and_used() -> None:
    labels = {c.label for c in crdschema.find_crds("karpenter.sh/v1", "NodePool")}
    assert labels == {UPSTREAM, VENDORED}
    assert {c.label for c in crdschema.find_crds("karpenter.sh/v1", "NodeClaim")} == {
        "karpenter.sh_nodeclaims.yaml",
        "aws-vendored/karpenter.sh_nodeclaims.yaml",
    }


def test_valid_manifests_pass_every_matching_crd() -> None:
    assert validate_all(nodepool()) == []
    assert validate_all(nodeclaim("c")) == []
    assert validate_all(raycluster("rc")) == []


def test_missing_consolidate_after_fails_aws_vendored_only() -> None:
    errors = by_crd(validate_all(nodepool(consolidationPolicy="WhenEmpty")))
    assert set(errors) == {VENDORED}
    (err,) = errors[VENDORED]
    assert err.path == "spec.disruption.consolidateAfter" and err.rule == "required"


def test_restricted_aws_label_fails_aws_vendored_only() -> None:
    np = nodepool()
    np["spec"]["template"]["metadata"]["labels"]["karpenter.k8s.aws/team"] = "ml"
    errors = by_crd(validate_all(np))
    assert set(errors) == {VENDORED}
    assert errors[VENDORED][0].path == "spec.template.metadata.labels"
    assert 'label domain "karpenter.k8s.aws" is restricted' in errors[VENDORED][0].message
    # the same domain in a requirement key, on a NodeClaim
    nc = nodeclaim("c")
    nc["spec"]["requirements"].append({"key": "karpenter.k8s.aws/foo", "operator": "Exists"})
    errors = by_crd(validate_all(nc))
    assert set(errors) == {"aws-vendored/karpenter.sh_nodeclaims.yaml"}
    assert errors["aws-vendored/karpenter.sh_nodeclaims.yaml"][0].path == "spec.requirements[3].key"
    # an allow-listed key passes both
    ok = nodepool()
    ok["spec"]["template"]["spec"]["requirements"].append(
        {"key": "karpenter.k8s.aws/instance-family", "operator": "In", "values": ["g5"]}
    )
    assert validate_all(ok) == []


@pytest.mark.parametrize(
    ("mutate", "path", "needle"),
    [
        (
            lambda np: np["spec"]["template"]["spec"]["requirements"].append(
                {"key": "karpenter.sh/x", "operator": "Exists"}
            ),
            "spec.template.spec.requirements[3].key",
            'label domain "karpenter.sh" is restricted',
        ),
        (
            lambda np: np["spec"]["template"]["spec"]["requirements"].append(
                {"key": "a.io/b", "operator": "In", "values": []}
            ),
            "spec.template.spec.requirements",
            "must have a value defined",
        ),
        (
            lambda np: np["spec"]["template"]["spec"]["requirements"][1].update(values=["many"]),
            "spec.template.spec.requirements",
            "single positive integer",
        ),
        (
            lambda np: np["spec"]["template"]["spec"].update(expireAfter="forever"),
            "spec.template.spec.expireAfter",
            "does not match",
        ),
        (lambda np: np["spec"].update(weight=500), "spec.weight", "maximum"),
        (
            lambda np: np["spec"]["template"]["spec"].update(expiresAfter="Never"),
            "spec.template.spec.expiresAfter",
            "unknown field",
        ),
        (
            lambda np: np["spec"]["template"]["metadata"]["labels"].update({"kubernetes.io/hostname": "h"}),
            "spec.template.metadata.labels",
            'label "kubernetes.io/hostname" is restricted',
        ),
        (
            lambda np: np["spec"]["disruption"].update(consolidationPolicy="Sometimes"),
            "spec.disruption.consolidationPolicy",
            "is not one of",
        ),
    ],
)
def test_bad_nodepools_fail_both_variants_with_field_path(mutate: Any, path: str, needle: str) -> None:
    np = nodepool()
    mutate(np)
    errors = by_crd(validate_all(np, source="nodepools/a10g.yaml"))
    assert set(errors) == {UPSTREAM, VENDORED}, errors
    for errs in errors.values():
        assert any(e.path == path and needle in e.message for e in errs), [str(e) for e in errs]
        assert all(e.source == "nodepools/a10g.yaml" for e in errs)


def test_error_string_names_file_object_path_and_rule() -> None:
    np = nodepool(consolidationPolicy="WhenEmpty")
    (err,) = validate_all(np, source="nodepools/gpu.yaml")
    text = str(err)
    assert text.startswith("nodepools/gpu.yaml: NodePool/rayscale-a10g: spec.disruption.consolidateAfter:")
    assert "[rule: required]" in text and VENDORED in text


def test_int_or_string_and_quantities() -> None:
    np = nodepool()
    np["spec"]["limits"] = {"cpu": "1000", "memory": "1000Gi", "nvidia.com/gpu": 8}
    assert validate_all(np) == []
    np["spec"]["limits"]["cpu"] = "lots"
    assert {e.path for e in validate_all(np)} == {"spec.limits.cpu"}


def test_transition_rules_need_an_old_object() -> None:
    (crd,) = [
        c
        for c in crdschema.find_crds("karpenter.sh/v1", "NodeClaim")
        if c.label == "karpenter.sh_nodeclaims.yaml"
    ]
    old = nodeclaim("c")
    new = copy.deepcopy(old)
    new["spec"]["expireAfter"] = "24h"
    assert crd.validate(new) == []  # a create: no oldSelf
    errs = crd.validate(new, old=old)
    assert [(e.path, e.message) for e in errs] == [("spec", "spec is immutable")]
    assert crd.validate(old, old=old) == []


def test_raycluster_and_rayservice_schemas() -> None:
    rc = raycluster("rc")
    rc["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert [e.path for e in validate_all(rc)] == ["spec.workerGroupSpecs[0].replicas"]
    rc = raycluster("rc")
    rc["spec"]["workerGroupSpecs"][0]["scaleStrategy"] = {"workersToDelete": ["rc-a10g-worker-abcde"]}
    assert validate_all(rc) == []
    svc = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": "svc", "namespace": "default"},
        "spec": {"serveConfigV2": "applications: []\n", "rayClusterConfig": raycluster("x")["spec"]},
    }
    assert validate_all(svc) == []
    svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"] = [
        {"containerPort": "http"}
    ]
    assert [e.path for e in validate_all(svc)] == [
        "spec.rayClusterConfig.headGroupSpec.template.spec.containers[0].ports[0].containerPort"
    ]


def test_ec2nodeclass_cel_rules() -> None:
    nc = {
        "apiVersion": "karpenter.k8s.aws/v1",
        "kind": "EC2NodeClass",
        "metadata": {"name": "gpu"},
        "spec": {
            "amiSelectorTerms": [{"alias": "al2023@latest"}],
            "role": "KarpenterNodeRole-rayscale",
            "subnetSelectorTerms": [{"tags": {"karpenter.sh/discovery": "rayscale"}}],
            "securityGroupSelectorTerms": [{"tags": {"karpenter.sh/discovery": "rayscale"}}],
        },
    }
    assert validate_all(nc) == []
    both = copy.deepcopy(nc)
    both["spec"]["instanceProfile"] = "profile"
    assert any(
        "role" in e.message.lower() or "instanceprofile" in e.message.lower() for e in validate_all(both)
    )
    bad_alias = copy.deepcopy(nc)
    bad_alias["spec"]["amiSelectorTerms"] = [{"alias": "ubuntu@latest"}]
    assert [e.path for e in validate_all(bad_alias)] == ["spec.amiSelectorTerms[0].alias"]


def test_metadata_is_checked_for_every_kind() -> None:
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "ok", "labels": {"rayscale.io/model": "x" * 64}},
    }
    assert [e.path for e in validate_all(cm)] == ["metadata.labels[rayscale.io/model]"]
    np = nodepool()
    np["metadata"]["name"] = "Bad_Name"
    assert {e.path for e in validate_all(np)} == {"metadata.name"}
    unknown = {"apiVersion": "example.com/v1", "kind": "Thing", "metadata": {"name": "t"}}
    assert [e.rule for e in validate_all(unknown)] == ["crd"]


def test_every_cel_rule_in_the_crds_uses_supported_functions() -> None:
    used: set[str] = set()
    for path in crdschema.crd_dir().rglob("*.yaml"):
        for rule in re.findall(r"rule: (.*)", path.read_text()):
            used |= crdschema.cel_functions_used(yaml.safe_load(rule) if rule.startswith("'") else rule)
    assert used, "no CEL rules found"
    assert used <= crdschema.CEL_SUPPORTED_FUNCTIONS, used - crdschema.CEL_SUPPORTED_FUNCTIONS


def test_validate_file_reads_multi_document_yaml(tmp_path: Path) -> None:
    bad = nodepool(consolidationPolicy="WhenEmpty")
    f = tmp_path / "pools.yaml"
    f.write_text(yaml.safe_dump_all([nodepool(), bad, raycluster("rc")]))
    errors = crdschema.validate_file(f)
    assert [(e.source, e.path) for e in errors] == [(str(f), "spec.disruption.consolidateAfter")]
