"""Every serve config loads with Ray Serve's schema and rayscale's, and maps to the right resources."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from rayscale.serve.config import ConfigError, deployment_name, load_serve_config, validate_serve_config

ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIGS = ["mistral-7b.yaml", "qwen2-7b.yaml"]
SHIPPED = sorted(p.name for p in (ROOT / "deployments").glob("*.yaml"))


def test_the_list_above_is_every_shipped_config() -> None:
    assert set(SHIPPED) == {"local-tiny.yaml", *GPU_CONFIGS}


@pytest.mark.parametrize("name", SHIPPED)
def test_ray_serve_itself_accepts_every_shipped_config_and_lets_rayscale_scale_it(name: str) -> None:
    """Ray's own schema on the raw file (what `serve deploy` and KubeRay run), not rayscale's wrapper; and
    Serve's scale API answers 412 for an application without external_scaler_enabled."""
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((ROOT / "deployments" / name).read_text())
    schema = ServeDeploySchema.model_validate(raw)
    ours = [a for a in schema.applications if a.import_path.startswith("rayscale.serve.app:")]
    assert ours and all(a.external_scaler_enabled for a in ours)
    assert all(a.args["app_name"] == a.name for a in ours)  # the weight store's key on both sides


@pytest.mark.parametrize("name", ["local-tiny.yaml", *GPU_CONFIGS])
def test_config_validates_with_serve_schema_and_rayscale(name: str) -> None:
    from ray.serve.schema import ServeDeploySchema

    loaded = load_serve_config(ROOT / "deployments" / name)
    assert isinstance(loaded.serve, ServeDeploySchema)
    assert loaded.apps, "no rayscale application in the config"
    for app in loaded.serve.applications:
        cfg = loaded.apps[app.name]
        names = {deployment_name(m.name, f.flavor) for m in cfg.models for f in m.flavors}
        # Serve-level overrides only name real flavor deployments, and stay plain replica counts.
        for d in app.deployments:
            assert d.name in names
            assert isinstance(d.num_replicas, int)
            assert "autoscaling_config" not in d.model_fields_set


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_and_neuron_flavors_request_their_devices(name: str, ray_cluster: Any) -> None:
    from ray.serve.llm import LLMServer

    from rayscale.engines.vllm_engine import build_llm_config

    loaded = load_serve_config(ROOT / "deployments" / name)
    (cfg,) = loaded.apps.values()
    (model,) = cfg.models
    flavors = {f.flavor: f for f in model.flavors}
    assert {"a10g", "l4", "inf2", "trn1"} <= set(flavors)
    assert model.source.count("/") == 1  # a hub id: weights come from the hub on GPU clusters
    for f in model.flavors:
        llm = build_llm_config(model, f)
        assert llm.model_id == model.name
        assert llm.deployment_config["name"] == f"{model.name}--{f.flavor}"
        assert "autoscaling_config" not in llm.deployment_config
        opts = LLMServer.get_deployment_options(llm)
        bundles = opts["placement_group_bundles"]
        tp = f.tensor_parallel_size
        if f.accelerator == "gpu":
            assert llm.accelerator_config is not None and llm.accelerator_config.kind == "gpu"
            assert sum(b.get("GPU", 0) for b in bundles) == tp
            acc = "A10G" if f.flavor.startswith("a10g") else "L4"
            assert all(b.get(f"accelerator_type:{acc}", 0) > 0 for b in bundles if b.get("GPU"))
            assert llm.engine_kwargs.get("tensor_parallel_size", 1) == tp
        else:
            assert sum(b.get("neuron_cores", 0) for b in bundles) == tp == 2
            assert not any(b.get("GPU") for b in bundles)
        assert llm.engine_kwargs["max_model_len"] <= model.max_model_len
    if "a10g-tp2" in flavors:
        assert flavors["a10g-tp2"].placement_strategy == "STRICT_PACK"


def _write(tmp_path: Path, mutate: Any) -> Path:
    raw = yaml.safe_load((ROOT / "deployments" / "local-tiny.yaml").read_text())
    mutate(raw)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_bad_config_errors_name_file_and_field(tmp_path: Path) -> None:
    def neg(raw: dict) -> None:
        raw["applications"][0]["args"]["models"][0]["flavors"][0]["num_replicas"] = -1

    p = _write(tmp_path, neg)
    with pytest.raises(ConfigError) as e:
        load_serve_config(p)
    assert str(p) in str(e.value)
    assert "applications.0.args.models.0.flavors.0.num_replicas" in str(e.value)

    def typo(raw: dict) -> None:
        raw["applications"][0]["args"]["models"][0]["flavours"] = []

    with pytest.raises(ConfigError, match="flavours"):
        load_serve_config(_write(tmp_path, typo))

    def unknown_override(raw: dict) -> None:
        raw["applications"][0]["deployments"][0]["name"] = "tiny-qwen2--gpu"

    with pytest.raises(ConfigError, match=r"deployments\.0\.name"):
        load_serve_config(_write(tmp_path, unknown_override))

    def not_serve(raw: dict) -> None:
        raw["applications"][0]["route_prefix"] = 5

    with pytest.raises(ConfigError, match="not a valid Ray Serve config"):
        load_serve_config(_write(tmp_path, not_serve))


def test_a_duplicate_route_prefix_is_rejected_by_rays_schema(tmp_path: Path) -> None:
    def second_app_at_root(raw: dict) -> None:
        twin = copy.deepcopy(raw["applications"][0])
        twin["name"] = twin["args"]["app_name"] = "twin"
        raw["applications"].append(twin)

    p = _write(tmp_path, second_app_at_root)
    with pytest.raises(ConfigError) as e:
        load_serve_config(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: not a valid Ray Serve config")
    assert 'applications: Value error, Found duplicate applications for route prefix "/"' in msg

    def twin_elsewhere(raw: dict) -> None:
        second_app_at_root(raw)
        raw["applications"][1]["route_prefix"] = "/twin"

    assert set(load_serve_config(_write(tmp_path, twin_elsewhere)).apps) == {"default", "twin"}


@pytest.mark.parametrize("value", [None, False])
def test_a_rayscale_app_without_the_external_scaler_flag_is_rejected(tmp_path: Path, value: bool | None) -> None:
    def unset(raw: dict) -> None:
        if value is None:
            del raw["applications"][0]["external_scaler_enabled"]
        else:
            raw["applications"][0]["external_scaler_enabled"] = value

    p = _write(tmp_path, unset)
    with pytest.raises(ConfigError) as e:
        load_serve_config(p)
    assert str(e.value).startswith(f"{p}: applications.0.external_scaler_enabled: must be true")
    # Ray's schema alone accepts it: the rule is rayscale's, for Serve's scale API.
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(yaml.safe_load(p.read_text()))


def test_other_applications_need_no_flag_and_app_name_must_match(tmp_path: Path) -> None:
    raw = yaml.safe_load((ROOT / "deployments" / "local-tiny.yaml").read_text())
    raw["applications"].append({"name": "other", "route_prefix": "/other", "import_path": "my.module:app"})
    assert set(validate_serve_config(raw, "<mem>").apps) == {"default"}
    raw["applications"][0]["args"]["app_name"] = "elsewhere"
    with pytest.raises(ConfigError, match=r"^<mem>: applications\.0\.args\.app_name: 'elsewhere'"):
        validate_serve_config(raw, "<mem>")


def test_cli_check_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rayscale.commands import serve as serve_cmd

    parser = argparse.ArgumentParser()
    serve_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["serve", str(ROOT / "deployments" / "mistral-7b.yaml"), "--check"])
    assert args.handler(args) == 0
    assert "mistral-7b/mistral-7b--inf2" in capsys.readouterr().out

    def bad(raw: dict) -> None:
        raw["applications"][0]["args"]["models"][0]["engine"] = "tensorrt"

    args = parser.parse_args(["serve", str(_write(tmp_path, bad)), "--check"])
    assert args.handler(args) == 2
    assert "models.0.engine" in capsys.readouterr().err
