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
    SEP,
    SLOT_PREFIX,
    AppConfig,
    FlavorDeployment,
    ModelDeployment,
    deployment_name,
    parse_app_args,
    slot_deployment_name,
    slot_label_selector,
)
from rayscale.serve.readiness import HoldSettings

INGRESS_NAME = "ingress"


def routes(flavor: FlavorDeployment) -> list[tuple[str, int | None]]:
    """The ingress's routing keys of a flavor with their gang slot: the flavor itself, or for a
    multi-node flavor one key per slot (``{flavor}--slot{k}``, its deployment name without the model)."""
    if not flavor.gang_slots:
        return [(flavor.flavor, None)]
    return [(f"{flavor.flavor}{SEP}{SLOT_PREFIX}{k}", k) for k in range(flavor.gang_slots)]


def _slot_options(model: ModelDeployment, flavor: FlavorDeployment, slot: int | None) -> dict[str, Any]:
    """Serve options of a deployment: its name, and for a gang slot the replica's placement group
    confined to the nodes of the gang holding that slot (rayscale.serve.config.slot_label_selector)."""
    if slot is None:
        return {"name": deployment_name(model.name, flavor.flavor)}
    # Serve refuses 0 replicas at deploy time (serve.deployment, and PositiveInt in its config schema):
    # a slot starts at 1, its replica waiting for its gang's nodes, and the controller scales it to 0
    # through the external scaler while the slot has no gang.
    return {"name": slot_deployment_name(model.name, flavor.flavor, slot), "num_replicas": 1,
            "placement_group_bundle_label_selector": slot_label_selector(model.name, flavor.flavor, slot)}


def _emulated_deployment(model: ModelDeployment, flavor: FlavorDeployment, slot: int | None = None) -> Application:
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
    # A gang slot's replica holds every bundle of its gang (one per node), the actor in the first.
    pg: dict[str, Any] = {} if slot is None else {
        "placement_group_bundles": flavor.bundles(), "placement_group_strategy": flavor.placement_strategy}
    dep: Any = serve.deployment(
        EmulatedLLMServer,
        **{"num_replicas": flavor.num_replicas, **_slot_options(model, flavor, slot), **pg},
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


def _vllm_deployment(model: ModelDeployment, flavor: FlavorDeployment,
                     slot: int | None = None) -> tuple[Application, Any]:
    # No public API: ray.serve.llm does not export the model card Ray LLM's own builder derives.
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.serve.llm import build_llm_deployment

    from rayscale.engines.vllm_engine import RayscaleVLLMEngine, build_llm_config

    cfg = build_llm_config(model, flavor)
    app = build_llm_deployment(
        cfg,
        bind_kwargs={"engine_cls": RayscaleVLLMEngine},
        # build_llm_deployment prefixes names with "LLMServer:" unless the name is overridden here.
        override_serve_options=_slot_options(model, flavor, slot),
    )
    return app, to_model_metadata(model.name, cfg)


def build_from_config(cfg: AppConfig, app_name: str = "default") -> Application:
    try:  # Ray Serve LLM's OpenAI models import vLLM
        # No public API: ray.serve.llm.openai_api_models has no ModelCard (the /v1/models entry).
        from ray.llm._internal.serve.core.configs.openai_api_models import ModelCard

        from rayscale.engines.vllm_engine import SERVE_REPLICA_ENV
        from rayscale.serve.ingress import make_ingress_class
    except ImportError as e:
        from rayscale.extras import missing_vllm

        raise missing_vllm("the OpenAI ingress") from e

    flavor_apps: dict[str, dict[str, Application]] = {}
    cards: dict[str, Any] = {}
    for m in cfg.models:
        flavor_apps[m.name] = {}
        for f in m.flavors:
            # Serve deploys no deployment at zero replicas (its Python API refuses 0, and serve.status() and
            # the dashboard fail on a config of 0, while its scale API takes 0): a flavor at 0 is deployed at
            # one replica, which waits for a node of its flavor until the controller scales it to zero.
            zero = f.num_replicas == 0 and not f.gang_slots
            built = f.model_copy(update={"num_replicas": 1}) if zero else f
            for key, slot in routes(f):
                if m.engine == "vllm":
                    flavor_apps[m.name][key], cards[m.name] = _vllm_deployment(m, built, slot)
                else:
                    flavor_apps[m.name][key] = _emulated_deployment(m, built, slot)
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
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": dict(SERVE_REPLICA_ENV)}},
    )
    return dep.bind(
        flavor_deployments=flavor_apps,
        model_cards=cards,
        weights={m.name: {key: f.weight / max(f.gang_slots, 1) for f in m.flavors for key, _ in routes(f)}
                 for m in cfg.models},
        max_model_len={m.name: m.max_model_len for m in cfg.models},
        app_name=app_name,
        weights_refresh_s=cfg.ingress.weights_refresh_s,
        hold=HoldSettings.from_ingress(cfg.ingress),
    )


def build_app(args: dict[str, Any]) -> Application:
    """Serve's application builder entry point (``args`` is the app's ``args`` block)."""
    cfg = parse_app_args(args, source="serve application args")
    return build_from_config(cfg, app_name=cfg.app_name)
