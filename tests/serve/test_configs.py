"""Every serve config loads with Ray Serve's schema and rayscale's, and maps to the right resources."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from rayscale_testing.waits import wait_for

from rayscale.serve.config import (
    ConfigError,
    deployment_name,
    load_serve_config,
    parse_app_args,
    validate_serve_config,
)

ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIGS = ["mistral-7b.yaml", "qwen2-7b.yaml"]
LOCAL_CONFIGS = ["local-tiny.yaml", "local-emulated/serve.yaml", "local-zero/serve.yaml"]
SHIPPED = sorted(str(p.relative_to(ROOT / "deployments")) for p in (ROOT / "deployments").rglob("*.yaml")
                 if p.parent.name != "k8s" and p.name not in ("models.yaml", "flavors.yaml", "profiles.yaml"))


def test_the_list_above_is_every_shipped_config() -> None:
    assert set(SHIPPED) == {*LOCAL_CONFIGS, *GPU_CONFIGS}


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


@pytest.mark.parametrize("name", [*LOCAL_CONFIGS, *GPU_CONFIGS])
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
        raw["applications"][0]["args"]["llm_configs"][0]["deployment_config"]["num_replicas"] = -1

    p = _write(tmp_path, neg)
    with pytest.raises(ConfigError) as e:
        load_serve_config(p)
    assert str(p) in str(e.value)
    assert "applications.0.args.llm_configs.0.deployment_config.num_replicas" in str(e.value)

    def typo(raw: dict) -> None:
        raw["applications"][0]["args"]["llm_configs"][0]["experimental_configs"] = {"rayscale": {"flavours": []}}

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
        raw["applications"][0]["args"]["llm_configs"][0]["llm_engine"] = "tensorrt"

    args = parser.parse_args(["serve", str(_write(tmp_path, bad)), "--check"])
    assert args.handler(args) == 2
    assert "llm_configs.0.llm_engine" in capsys.readouterr().err


# --- Ray Serve LLM's shape: llm_configs ----------------------------------------------------------

# As in Ray Serve LLM's documentation: one model on one accelerator type, nothing rayscale-specific.
PASTED: dict[str, Any] = {
    "model_loading_config": {"model_id": "qwen-0.5b", "model_source": "Qwen/Qwen2.5-0.5B-Instruct"},
    "accelerator_type": "A10G",
    "deployment_config": {"num_replicas": 1},
    "engine_kwargs": {"max_model_len": 4096, "tensor_parallel_size": 2},
}


def _llm_configs(name: str) -> list[dict[str, Any]]:
    raw = yaml.safe_load((ROOT / "deployments" / name).read_text())
    return list(raw["applications"][0]["args"]["llm_configs"])


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_entry_is_a_ray_serve_llm_config(name: str) -> None:
    """rayscale's extension sits in experimental_configs, so each entry is, as written, what Ray takes."""
    from ray.serve.llm import LLMConfig

    entries = _llm_configs(name)
    assert entries
    for e in entries:
        assert LLMConfig.model_validate(e).model_id == e["model_loading_config"]["model_id"]


def test_a_pasted_llm_config_is_one_flavor_placed_as_ray_places_it(ray_cluster: Any) -> None:
    from ray.serve.llm import LLMConfig, LLMServer

    from rayscale.engines.vllm_engine import build_llm_config

    (model,) = parse_app_args({"llm_configs": [PASTED]}).models
    (flavor,) = model.flavors
    assert (model.name, model.source, model.max_model_len) == ("qwen-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", 4096)
    assert (flavor.flavor, flavor.accelerator, flavor.tensor_parallel_size, flavor.num_replicas) == ("a10g", "gpu", 2, 1)
    ours = LLMServer.get_deployment_options(build_llm_config(model, flavor))["placement_group_bundles"]
    rays = LLMServer.get_deployment_options(LLMConfig.model_validate(PASTED))["placement_group_bundles"]
    assert ours == rays


def test_flavors_take_the_entrys_fields_unless_they_name_their_own_device() -> None:
    (model,) = load_serve_config(ROOT / "deployments" / "mistral-7b.yaml").apps["mistral-7b"].models
    f = {x.flavor: x for x in model.flavors}
    assert model.max_model_len == 8192 and model.engine_kwargs["max_num_seqs"] == 64
    assert (f["a10g"].num_replicas, f["a10g"].weight, f["l4"].num_replicas, f["l4"].weight) == (1, 1.0, 0, 0.0)
    assert f["a10g"].bundles() == [{"CPU": 1, "GPU": 1, "accelerator_type:A10G": 0.001}]
    assert f["l4"].bundles() == [{"CPU": 1, "GPU": 1, "accelerator_type:L4": 0.001}]
    # A Neuron flavor names its device: the entry's A10G type is not added to its bundles.
    assert f["inf2"].accelerator == "neuron" and f["inf2"].bundles() == [{"CPU": 1, "neuron_cores": 2}]
    assert f["inf2"].engine_kwargs == {"max_num_seqs": 8, "block_size": 32}


def test_the_old_models_shape_still_loads_as_the_same_app() -> None:
    old = {"app_name": "default", "models": [{
        "name": "tiny-qwen2", "engine": "vllm", "source": "builtin:tiny-qwen2", "max_model_len": 2048,
        "flavors": [{"flavor": "cpu", "accelerator": "cpu", "num_replicas": 1, "weight": 1.0,
                     "placement_bundles": [{"resources": {"CPU": 1}}]}],
    }]}
    new = load_serve_config(ROOT / "deployments" / "local-tiny.yaml").apps["default"]
    assert parse_app_args(old).as_args() == new.as_args()


@pytest.mark.parametrize(("mutate", "where", "says"), [
    (lambda e: e["deployment_config"].update(autoscaling_config={"min_replicas": 1}),
     "llm_configs.0.deployment_config", "controller sets replica counts"),
    (lambda e: e.update(runtime_env={"pip": ["x"]}), "llm_configs.0", "runtime_env"),
    (lambda e: e["model_loading_config"].update(model_id="Qwen/Qwen2"),
     "llm_configs.0.model_loading_config.model_id", "model name 'Qwen/Qwen2' must be lower-case"),
    (lambda e: e.update(experimental_configs={"rayscale": {"flavors": [{"flavor": "cpu"}, {"flavor": "A_B"}]}}),
     "llm_configs.0.experimental_configs.rayscale.flavors.1.flavor", "flavor 'A_B' must be lower-case"),
])
def test_llm_config_errors_name_the_entry_and_field(tmp_path: Path, mutate: Any, where: str, says: str) -> None:
    p = _write(tmp_path, lambda raw: mutate(raw["applications"][0]["args"]["llm_configs"][0]))
    with pytest.raises(ConfigError) as e:
        load_serve_config(p)
    assert str(e.value).startswith(f"{p}: invalid config")
    assert f"applications.0.args.{where}" in str(e.value) and says in str(e.value)


@pytest.mark.ray
@pytest.mark.vllm
def test_a_config_with_llm_configs_serves_openai_requests(deploy_app: Any, serve_url: str) -> None:
    """deployments/local-tiny.yaml built as `serve run` builds it (its import_path called with its args)
    on the shared cluster, then asked through the OpenAI client."""
    import importlib

    import openai
    from ray import serve

    loaded = load_serve_config(ROOT / "deployments" / "local-tiny.yaml")
    (app,) = loaded.serve.applications
    args = copy.deepcopy(app.args)
    args["app_name"] = name = "pasted"
    # The session's other vLLM app serves 1024 tokens: Ray keeps one histogram bucket list per metric name.
    args["llm_configs"][0]["engine_kwargs"]["max_model_len"] = 1024
    module, attr = app.import_path.split(":")
    builder = getattr(importlib.import_module(module), attr)
    try:
        deploy_app(builder(args), name, route_prefix=f"/{name}", timeout_s=420)
        deployments = serve.status().applications[name].deployments
        assert deployment_name("tiny-qwen2", "cpu") in deployments  # the name the controller scales
        c = openai.OpenAI(base_url=f"{serve_url}/{name}/v1", api_key="unused", max_retries=0, timeout=120)
        # listed once the ingress has seen the replica RUNNING (it reads Serve's status about once a second)
        wait_for(lambda: [m.id for m in c.models.list().data] == ["tiny-qwen2"], 30, "the model to be listed")
        r = c.completions.create(model="tiny-qwen2", prompt="hello", max_tokens=8, extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.completion_tokens == 8
    finally:
        serve.delete(name)
