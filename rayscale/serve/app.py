"""Ray Serve application builder: ``import_path: rayscale.serve.app:build_app`` in a serve config.

One deployment per (model, flavor), named ``{model}--{flavor}``, behind one ingress deployment
named ``ingress``. ``args`` lists the models as Ray Serve LLM ``llm_configs`` or in rayscale's own
``models`` shape (rayscale.serve.config). Replica counts are plain ``num_replicas`` values that the controller (or a
``deployments:`` override in the serve config) sets.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.deployment import Application

from rayscale.serve.config import (
    AppConfig,
    FlavorDeployment,
    ModelDeployment,
    deployment_name,
    parse_app_args,
)

INGRESS_NAME = "ingress"


def _emulated_deployment(model: ModelDeployment, flavor: FlavorDeployment) -> Application:
    from rayscale.serve.emulated_server import EmulatedLLMServer

    assert flavor.profile is not None  # checked by ModelDeployment
    profile = flavor.profile.model_copy(
        update={"model": flavor.profile.model or model.name, "flavor": flavor.profile.flavor or flavor.flavor}
    )
    resources = flavor.bundles()[0]
    opts: dict[str, Any] = {
        "num_cpus": 0,  # no compute: an emulated replica must not hold a core
        "resources": {k: v for k, v in resources.items() if k not in ("CPU", "GPU")},
    }
    if resources.get("GPU"):
        opts["num_gpus"] = resources["GPU"]
    dep: Any = serve.deployment(
        EmulatedLLMServer,
        name=deployment_name(model.name, flavor.flavor),
        num_replicas=flavor.num_replicas,
        max_ongoing_requests=flavor.max_ongoing_requests,
        ray_actor_options=opts,
        health_check_period_s=5,
    )
    return dep.bind(
        model_name=model.name,
        profile=profile.model_dump(),
        max_model_len=model.max_model_len,
        stream_interval_s=float(flavor.engine_kwargs.get("stream_interval_s", 0.0)),
    )


def _vllm_deployment(model: ModelDeployment, flavor: FlavorDeployment) -> tuple[Application, Any]:
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.serve.llm import build_llm_deployment

    from rayscale.engines.vllm_engine import RayscaleVLLMEngine, build_llm_config

    cfg = build_llm_config(model, flavor)
    app = build_llm_deployment(
        cfg,
        bind_kwargs={"engine_cls": RayscaleVLLMEngine},
        # build_llm_deployment prefixes names with "LLMServer:" unless the name is overridden here.
        override_serve_options={"name": deployment_name(model.name, flavor.flavor)},
    )
    return app, to_model_metadata(model.name, cfg)


def build_from_config(cfg: AppConfig, app_name: str = "default") -> Application:
    try:  # Ray Serve LLM's OpenAI models import vLLM
        from ray.llm._internal.serve.core.configs.openai_api_models import ModelCard

        from rayscale.serve.ingress import make_ingress_class
    except ImportError as e:
        from rayscale.extras import missing_vllm

        raise missing_vllm("the OpenAI ingress") from e

    flavor_apps: dict[str, dict[str, Application]] = {}
    cards: dict[str, Any] = {}
    for m in cfg.models:
        flavor_apps[m.name] = {}
        for f in m.flavors:
            if m.engine == "vllm":
                flavor_apps[m.name][f.flavor], cards[m.name] = _vllm_deployment(m, f)
            else:
                flavor_apps[m.name][f.flavor] = _emulated_deployment(m, f)
                cards[m.name] = ModelCard(
                    id=m.name,
                    object="model",
                    owned_by="rayscale",
                    permission=[],
                    metadata={
                        "model_id": m.name,
                        "engine": "emulated",
                        "max_request_context_length": m.max_model_len,
                    },
                )
    ingress_cls = make_ingress_class()
    dep: Any = serve.deployment(
        ingress_cls,
        name=INGRESS_NAME,
        num_replicas=cfg.ingress.num_replicas,
        max_ongoing_requests=cfg.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
    )
    return dep.bind(
        flavor_deployments=flavor_apps,
        model_cards=cards,
        weights={m.name: {f.flavor: f.weight for f in m.flavors} for m in cfg.models},
        max_model_len={m.name: m.max_model_len for m in cfg.models},
        app_name=app_name,
        weights_refresh_s=cfg.ingress.weights_refresh_s,
    )


def build_app(args: dict[str, Any]) -> Application:
    """Serve's application builder entry point (``args`` is the app's ``args`` block)."""
    cfg = parse_app_args(args, source="serve application args")
    return build_from_config(cfg, app_name=cfg.app_name)
