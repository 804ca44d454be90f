"""`rayscale render` with the fast-start choices: a snapshot data volume on the EC2NodeClasses and weights
streamed from S3 (or a node-local cache); every manifest still validates against the real CRDs and every
serve config against Ray Serve's schema."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from rayscale.cluster import crdschema
from rayscale.cluster.render import (
    STREAM_LOAD_FORMAT,
    WEIGHT_CACHE_MOUNT,
    RenderSettings,
    check_serve_configs,
    default_serve_configs,
    render,
)
from rayscale.core.catalog import AcceleratorKind, Catalog, FastStart, WeightSource

REPO = Path(__file__).resolve().parents[2]
GPU_SNAP, NEURON_SNAP = "snap-0123456789abcdef0", "snap-0fedcba9876543210"


def _render(catalog: Catalog, fast: FastStart, from_files: bool = True) -> dict[str, str]:
    serve = tuple(str(p) for p in default_serve_configs(REPO)) if from_files else ()
    return render(catalog.with_fast_start(fast), RenderSettings(serve_configs=serve))


def _docs(files: dict[str, str], kind: str) -> list[dict[str, Any]]:
    return [d for t in files.values() for d in yaml.safe_load_all(t) if d and d["kind"] == kind]


def _serve(files: dict[str, str]) -> dict[str, Any]:
    (rs,) = _docs(files, "RayService")
    return typing.cast(dict[str, Any], yaml.safe_load(rs["spec"]["serveConfigV2"]))


@pytest.fixture(scope="module")
def crds() -> list[crdschema.CRDSchema]:
    return crdschema.load_crds()


@pytest.mark.parametrize("from_files", [True, False])
def test_snapshot_and_streamed_weights_render_valid_manifests(catalog: Catalog, crds: Any, from_files: bool) -> None:
    fast = FastStart(image_snapshots={AcceleratorKind.GPU: GPU_SNAP, AcceleratorKind.NEURON: NEURON_SNAP},
                     weights=WeightSource.STREAM, weights_uri="s3://my-bucket/models/")
    files = _render(catalog, fast, from_files)
    errors = [str(e) for rel, text in files.items() for d in yaml.safe_load_all(text) if d
              for e in crdschema.validate_all(d, source=rel, crds=crds)]
    assert errors == []
    assert check_serve_configs(files) == []
    classes = {d["metadata"]["name"]: d["spec"] for d in _docs(files, "EC2NodeClass")}
    for name, snap in (("gpu", GPU_SNAP), ("neuron", NEURON_SNAP)):
        spec = classes[name]
        assert spec["amiSelectorTerms"] == [{"alias": "bottlerocket@latest"}]
        data = next(b for b in spec["blockDeviceMappings"] if b["deviceName"] == "/dev/xvdb")
        assert data["ebs"]["snapshotID"] == snap and "encrypted" not in data["ebs"]
    assert classes["ray-head"]["amiSelectorTerms"] == [{"alias": "al2023@latest"}]  # no serving image there
    entries = [e for app in _serve(files)["applications"] for e in app["args"].get("llm_configs") or []]
    assert entries
    for e in entries:
        name = e["model_loading_config"]["model_id"]
        assert e["model_loading_config"]["model_source"] == f"s3://my-bucket/models/{name}"
        assert e["engine_kwargs"]["load_format"] == STREAM_LOAD_FORMAT


def test_the_vllm_build_knows_the_streaming_load_format() -> None:
    from vllm.model_executor.model_loader import LoadFormats, get_model_loader

    assert STREAM_LOAD_FORMAT in typing.get_args(LoadFormats)
    from vllm.config.load import LoadConfig

    assert type(get_model_loader(LoadConfig(load_format=STREAM_LOAD_FORMAT))).__name__ == "RunaiModelStreamerLoader"


def test_a_node_local_weight_cache_mounts_on_every_worker_and_vllm_downloads_into_it(catalog: Catalog,
                                                                                     crds: Any) -> None:
    files = _render(catalog, FastStart(weights=WeightSource.CACHE))
    assert [e for rel, t in files.items() for d in yaml.safe_load_all(t) if d
            for e in crdschema.validate_all(d, source=rel, crds=crds)] == []
    (rc,) = _docs(files, "RayCluster")
    for group in rc["spec"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        assert any(v.get("hostPath", {}).get("path", "").startswith("/local/") for v in pod["volumes"])
        assert {"name": "weights", "mountPath": WEIGHT_CACHE_MOUNT} in pod["containers"][0]["volumeMounts"]
    entries = [e for app in _serve(files)["applications"] for e in app["args"].get("llm_configs") or []]
    assert entries and all(e["engine_kwargs"]["download_dir"] == WEIGHT_CACHE_MOUNT for e in entries)
    # Weights still come from the hub: the cache only keeps them on the node.
    assert all(not e["model_loading_config"]["model_source"].startswith("s3://") for e in entries)


def test_without_choices_the_render_is_the_shipped_one(catalog: Catalog) -> None:
    serve = tuple(str(p) for p in default_serve_configs(REPO))
    assert _render(catalog, FastStart()) == render(catalog, RenderSettings(serve_configs=serve))
    assert "snapshotID" not in render(catalog, RenderSettings(serve_configs=serve))["nodepools/ec2nodeclasses.yaml"]
