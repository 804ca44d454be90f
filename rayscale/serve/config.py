"""Configuration of a rayscale serving application: models, their flavor deployments and engines.

It is the ``args`` of a Ray Serve application whose ``import_path`` is ``rayscale.serve.app:build_app``,
so one YAML file is both a valid ``serve run`` config and a validated rayscale config.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rayscale.engines.profile import EmulatedProfile

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*[a-z0-9]$")
SEP = "--"


def deployment_name(model: str, flavor: str) -> str:
    """Serve deployment name of one (model, flavor): the controller sets its num_replicas by this name."""
    return f"{model}{SEP}{flavor}"


def split_deployment_name(name: str) -> tuple[str, str]:
    model, sep, flavor = name.rpartition(SEP)
    if not sep:
        raise ValueError(f"not a rayscale flavor deployment name: {name!r}")
    return model, flavor


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class PlacementBundle(_Strict):
    """One bundle of a replica's placement group (a gang member): resources by name."""

    resources: dict[str, float]

    @field_validator("resources")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("a bundle needs at least one resource")
        for k, x in v.items():
            if x <= 0:
                raise ValueError(f"resource {k!r} must be > 0, got {x}")
        return v


class FlavorDeployment(_Strict):
    """The deployment of one model on one accelerator flavor."""

    flavor: str
    # Kind of device vLLM runs on; "cpu" is this machine, "gpu" the CUDA build, "neuron" Inferentia/Trainium.
    accelerator: Literal["cpu", "gpu", "neuron"] = "cpu"
    # Plain replica count: the rayscale controller owns it, Serve autoscaling stays off.
    num_replicas: int = Field(default=1, ge=0)
    # Share of the model's requests sent here; the controller updates it at run time (by capacity).
    weight: float = Field(default=1.0, ge=0)
    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    # Resources of each bundle of the replica's placement group. Empty: derived from the accelerator.
    placement_bundles: list[PlacementBundle] = Field(default_factory=list)
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    # Extra vLLM engine arguments for this flavor (max_model_len, gpu_memory_utilization, ...).
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    # For the emulated engine: latency and capacity model of this (model, flavor).
    profile: EmulatedProfile | None = None
    max_ongoing_requests: int = Field(default=256, ge=1)
    # Ray Serve LLM holds streamed chunks for this long to send them together (its default: 50 ms).
    # None: 0 on CPU, where vLLM's stream_interval already coalesces tokens; Ray's default elsewhere.
    stream_batching_interval_ms: float | None = Field(default=None, ge=0)

    @field_validator("flavor")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v) or SEP in v:
            raise ValueError(f"flavor {v!r} must be lower-case letters, digits, '.', '-' (no '--')")
        return v

    @model_validator(mode="after")
    def _bundles_match_parallelism(self) -> FlavorDeployment:
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.placement_bundles and self.accelerator == "gpu":
            gpus = sum(b.resources.get("GPU", 0) for b in self.placement_bundles)
            if gpus < world:
                raise ValueError(
                    f"placement_bundles give {gpus} GPU but tensor x pipeline parallel needs {world}"
                )
        if self.accelerator == "neuron" and self.placement_bundles:
            cores = sum(b.resources.get("neuron_cores", 0) for b in self.placement_bundles)
            if cores < world:
                raise ValueError(
                    f"placement_bundles give {cores} neuron_cores but tensor parallel needs {world}"
                )
        return self

    def bundles(self) -> list[dict[str, float]]:
        """Bundles of one replica: explicit ones, or one device per parallel rank plus a CPU."""
        if self.placement_bundles:
            return [dict(b.resources) for b in self.placement_bundles]
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.accelerator == "gpu":
            return [{"CPU": 1.0, "GPU": 1.0}] + [{"GPU": 1.0} for _ in range(world - 1)]
        if self.accelerator == "neuron":
            return [{"CPU": 1.0, "neuron_cores": float(world)}]
        return [{"CPU": 1.0}]


class ModelDeployment(_Strict):
    name: str
    engine: Literal["vllm", "emulated"] = "vllm"
    # Weights and tokenizer: a local path, a hub id (on machines with network), or "builtin:tiny-qwen2"
    # which the project writes itself (rayscale.engines.tiny_model).
    source: str = "builtin:tiny-qwen2"
    max_model_len: int = Field(default=2048, ge=16)
    # Common vLLM engine arguments; a flavor's engine_kwargs override these.
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    flavors: list[FlavorDeployment]

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v) or SEP in v:
            raise ValueError(f"model name {v!r} must be lower-case letters, digits, '.', '-' (no '--')")
        return v

    @model_validator(mode="after")
    def _check(self) -> ModelDeployment:
        names = [f.flavor for f in self.flavors]
        if not names:
            raise ValueError(f"model {self.name!r} has no flavors")
        if len(set(names)) != len(names):
            raise ValueError(f"model {self.name!r} lists a flavor twice: {names}")
        if self.engine == "emulated":
            for f in self.flavors:
                if f.profile is None:
                    raise ValueError(f"emulated model {self.name!r} flavor {f.flavor!r} needs a profile")
        return self


class IngressConfig(_Strict):
    num_replicas: int = Field(default=1, ge=1)
    max_ongoing_requests: int = Field(default=1024, ge=1)
    # Seconds between refreshes of the run-time flavor weights from the weight store.
    weights_refresh_s: float = Field(default=1.0, gt=0)


class AppConfig(_Strict):
    """All models of one Serve application, behind one ingress."""

    models: list[ModelDeployment]
    # Serve application name; keys the run-time weight store (rayscale.serve.weights).
    app_name: str = "default"
    ingress: IngressConfig = Field(default_factory=IngressConfig)

    @model_validator(mode="after")
    def _unique(self) -> AppConfig:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique: {names}")
        return self

    def model(self, name: str) -> ModelDeployment:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)


class ConfigError(ValueError):
    """A config file failed validation; the message names the file and the field."""


def _fmt_errors(path: str, err: ValidationError, prefix: str = "") -> str:
    lines = [f"{path}: invalid config"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        lines.append(f"  {prefix}{loc}: {e['msg']}")
    return "\n".join(lines)


def parse_app_args(args: dict[str, Any], source: str = "<args>") -> AppConfig:
    try:
        return AppConfig.model_validate(args)
    except ValidationError as e:
        raise ConfigError(_fmt_errors(source, e, prefix="args.")) from e


class LoadedServeConfig(BaseModel):
    """A `serve run` YAML: Ray Serve's own schema plus each rayscale application's AppConfig."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    path: str
    serve: Any  # ray.serve.schema.ServeDeploySchema
    apps: dict[str, AppConfig]


# Applications built by this import path are rayscale's: the controller sets their replica counts.
RAYSCALE_IMPORT_PREFIX = "rayscale.serve.app:"


def _ray_schema(raw: dict[str, Any], source: str) -> Any:
    """Ray Serve's own validation of a serve config (what `serve deploy` and KubeRay's serveConfigV2 go
    through); each error names the source and the field path."""
    from ray.serve.schema import ServeDeploySchema

    try:
        return ServeDeploySchema.model_validate(raw)
    except ValidationError as e:  # Ray 2.60's schema is pydantic v2
        lines = [f"{source}: not a valid Ray Serve config"]
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "<top level>"
            lines.append(f"  {loc}: {err['msg']}")
        raise ConfigError("\n".join(lines)) from e


def _check_rayscale_app(app: dict[str, Any], i: int, source: str) -> AppConfig:
    """rayscale's rules for one of its applications, beyond Ray's schema."""
    where = f"{source}: applications.{i}"
    # Serve's scale endpoint (POST /api/v1/applications/{app}/deployments/{dep}/scale) answers 412 for an
    # application deployed without it, so the controller could never set a replica count.
    if app.get("external_scaler_enabled") is not True:
        raise ConfigError(f"{where}.external_scaler_enabled: must be true (the rayscale controller sets "
                          f"replica counts through Serve's external scaler API)")
    try:
        cfg = AppConfig.model_validate(app.get("args") or {})
    except ValidationError as e:
        raise ConfigError(_fmt_errors(source, e, prefix=f"applications.{i}.args.")) from e
    name = app.get("name", "default")
    # The controller writes flavor weights under the Serve application name; the ingress reads them
    # under args.app_name: apart, weights never reach the ingress.
    if cfg.app_name != name:
        raise ConfigError(f"{where}.args.app_name: {cfg.app_name!r} must equal the application name {name!r}")
    known = {deployment_name(m.name, f.flavor) for m in cfg.models for f in m.flavors} | {"ingress"}
    for j, d in enumerate(app.get("deployments") or []):
        if d.get("name") not in known:
            raise ConfigError(
                f"{where}.deployments.{j}.name: {d.get('name')!r} is not a deployment "
                f"of this app (known: {sorted(known)})"
            )
    return cfg


def validate_serve_config(raw: Any, source: str) -> LoadedServeConfig:
    """Check a parsed serve config as the servers that load it would: Ray Serve's ServeDeploySchema, then
    for every rayscale application ``external_scaler_enabled: true`` and its ``args`` as AppConfig. Errors
    are ConfigError naming ``source`` and the field."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: top level must be a mapping")
    schema = _ray_schema(raw, source)
    apps: dict[str, AppConfig] = {}
    for i, app in enumerate(raw.get("applications") or []):
        if str(app.get("import_path", "")).startswith(RAYSCALE_IMPORT_PREFIX):
            apps[app.get("name", "default")] = _check_rayscale_app(app, i, source)
    return LoadedServeConfig(path=source, serve=schema, apps=apps)


def load_serve_config(path: str | Path) -> LoadedServeConfig:
    """Read and validate a serve config file (validate_serve_config); errors name file and field."""
    p = str(path)
    try:
        raw = yaml.safe_load(Path(p).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{p}: cannot read YAML: {e}") from e
    return validate_serve_config(raw, p)
