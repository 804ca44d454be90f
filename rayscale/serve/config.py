"""Configuration of a rayscale serving application: models, their flavor deployments and engines.

It is the ``args`` of a Ray Serve application whose ``import_path`` is ``rayscale.serve.app:build_app``,
so one YAML file is both a valid ``serve run`` config and a validated rayscale config. The models come in
either of two shapes, side by side if need be:

- ``llm_configs``: Ray Serve LLM ``LLMConfig`` entries, as ``ray.serve.llm:build_openai_app`` takes them
  (a config users already have pastes in). rayscale's extension lives in each entry's
  ``experimental_configs.rayscale`` (``RayscaleExtension``): the flavors the model may run on, each
  overriding the entry's own accelerator, placement, replica count and engine kwargs. Without it the entry
  is one flavor, named after its accelerator type (or kind).
- ``models``: rayscale's own shape (``ModelDeployment``), one block per model with its ``flavors``.
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


# Ray node labels a multi-node replica's placement group selects on. Every rayscale node carries its
# flavor and model; the nodes of one gang also carry the gang's slot, a small number unique among the
# live gangs of its (model, flavor), which the actuator gives the gang when it orders it.
LABEL_FLAVOR = "rayscale.io/flavor"
LABEL_MODEL = "rayscale.io/model"
LABEL_GANG_SLOT = "rayscale.io/gang-slot"
SLOT_PREFIX = "slot"
_SLOT_RE = re.compile(rf"^{SLOT_PREFIX}(0|[1-9][0-9]*)$")


def deployment_name(model: str, flavor: str) -> str:
    """Serve deployment name of one (model, flavor): the controller sets its num_replicas by this name."""
    return f"{model}{SEP}{flavor}"


def slot_deployment_name(model: str, flavor: str, slot: int) -> str:
    """Serve deployment of one gang slot of a multi-node (model, flavor): ``{model}--{flavor}--slot{k}``
    (model and flavor names hold no '--', so the name splits back unambiguously)."""
    return f"{model}{SEP}{flavor}{SEP}{SLOT_PREFIX}{slot}"


def parse_deployment_name(name: str) -> tuple[str, str, int | None] | None:
    """(model, flavor, slot) of a rayscale flavor or slot deployment name (slot None for a flavor
    deployment); None for any other name (the ingress, other applications' deployments)."""
    parts = name.split(SEP)
    if len(parts) == 2 and all(parts):
        return parts[0], parts[1], None
    if len(parts) == 3 and all(parts[:2]) and (m := _SLOT_RE.match(parts[2])):
        return parts[0], parts[1], int(m.group(1))
    return None


def split_route_key(key: str) -> tuple[str, int | None]:
    """(flavor, slot) of one of the ingress's routing keys: a flavor (slot None), or ``{flavor}--slot{k}``,
    a gang slot's deployment without the model."""
    flavor, sep, tail = key.rpartition(SEP)
    m = _SLOT_RE.match(tail) if sep and flavor else None
    return (flavor, int(m.group(1))) if m else (key, None)


def split_deployment_name(name: str) -> tuple[str, str]:
    """(model, flavor) of a flavor deployment or of one of its gang slots."""
    parsed = parse_deployment_name(name)
    if parsed is None:
        raise ValueError(f"not a rayscale flavor deployment name: {name!r}")
    return parsed[0], parsed[1]


def slot_label_selector(model: str, flavor: str, slot: int) -> list[dict[str, str]]:
    """Serve's ``placement_group_bundle_label_selector`` of a slot deployment: one selector, which Serve
    applies to every bundle (ReplicaConfig._normalize_bundle_label_selector), so all bundles of the
    replica's placement group land on nodes of the one gang that holds this slot."""
    return [{LABEL_FLAVOR: flavor, LABEL_MODEL: model, LABEL_GANG_SLOT: str(slot)}]


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
    # Ray's accelerator type (A10G, L4, H100, ...): every device bundle asks for a sliver of the
    # "accelerator_type:<type>" resource Ray gives nodes of that type, as Ray Serve LLM does.
    accelerator_type: str | None = None
    # Multi-node flavors: how many gangs of this (model, flavor) may run at once (its max replicas, one
    # per gang). Ray can confine bundles to labelled nodes but cannot say "all bundles on nodes that share
    # one label value", so each gang gets a slot and each slot its own deployment, confined by label to
    # that gang's nodes (slot_label_selector); the controller runs 1 replica in a slot whose gang is up,
    # 0 otherwise (each slot deploys at 1: Serve refuses 0 at deploy time; the replica waits for its gang).
    # 0: a single-node flavor, one deployment whose replicas go to any node of the flavor.
    gang_slots: int = Field(default=0, ge=0)

    @field_validator("flavor")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v) or SEP in v:
            raise ValueError(f"flavor {v!r} must be lower-case letters, digits, '.', '-' (no '--')")
        return v

    @model_validator(mode="after")
    def _one_replica_per_slot(self) -> FlavorDeployment:
        # A gang holds one multi-node replica: a slot deployment runs 0 or 1.
        if self.gang_slots and self.num_replicas > 1:
            raise ValueError(f"num_replicas is per gang slot (0 or 1) when gang_slots is set, got {self.num_replicas}")
        return self

    def deployment_names(self, model: str) -> list[str]:
        """The Serve deployments of this flavor: one, or one per gang slot."""
        if self.gang_slots:
            return [slot_deployment_name(model, self.flavor, k) for k in range(self.gang_slots)]
        return [deployment_name(model, self.flavor)]

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
        """Bundles of one replica: explicit ones, or one device per parallel rank plus a CPU; with an
        accelerator type, each device bundle (or the first, where none holds a device) asks for it."""
        bundles = self._device_bundles()
        if self.accelerator_type:
            devices = [b for b in bundles if b.get("GPU") or b.get("neuron_cores")] or bundles[:1]
            for b in devices:
                b.setdefault(f"accelerator_type:{self.accelerator_type}", 0.001)
        return bundles

    def _device_bundles(self) -> list[dict[str, float]]:
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


# --- Ray Serve LLM's shape: LLMConfig entries with rayscale's extension ----------------------------

_DEVICE_FIELDS = {"accelerator", "accelerator_type", "placement_bundles", "placement_strategy"}
Accelerator = Literal["cpu", "gpu", "neuron"]
Strategy = Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"]


class FlavorSpec(_Strict):
    """One flavor of an ``llm_configs`` entry (``experimental_configs.rayscale.flavors``). Unset fields
    come from the entry; a flavor that names any device field (accelerator, accelerator_type, placement)
    takes none of the entry's, so a Neuron flavor does not inherit a GPU type."""

    flavor: str
    accelerator: Accelerator | None = None
    accelerator_type: str | None = None
    num_replicas: int | None = Field(default=None, ge=0)
    weight: float = Field(default=1.0, ge=0)
    tensor_parallel_size: int | None = Field(default=None, ge=1)
    pipeline_parallel_size: int | None = Field(default=None, ge=1)
    placement_bundles: list[PlacementBundle] | None = None
    placement_strategy: Strategy | None = None
    # Merged over the entry's engine_kwargs.
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    profile: EmulatedProfile | None = None
    max_ongoing_requests: int | None = Field(default=None, ge=1)
    stream_batching_interval_ms: float | None = Field(default=None, ge=0)
    gang_slots: int | None = Field(default=None, ge=0)


class RayscaleExtension(_Strict):
    """rayscale's part of an LLMConfig, under ``experimental_configs.rayscale`` (an LLMConfig forbids
    unknown top-level fields; experimental_configs is its free-form map, so the entry stays valid for Ray)."""

    engine: Literal["vllm", "emulated"] = "vllm"
    # Empty: the entry itself is the one flavor.
    flavors: list[FlavorSpec] = Field(default_factory=list)


class _ModelLoading(_Strict):
    model_id: str
    # Hub id, local path or "builtin:tiny-qwen2"; Ray's default: the model_id.
    model_source: str | None = None


class _PlacementGroup(_Strict):
    bundles: list[dict[str, float]] | None = None
    # Ray Serve LLM repeats it once per tensor x pipeline parallel rank.
    bundle_per_worker: dict[str, float] | None = None
    strategy: Strategy | None = None


class _Deployment(_Strict):
    num_replicas: int | None = Field(default=None, ge=0)
    max_ongoing_requests: int | None = Field(default=None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _owned_by_rayscale(cls, v: Any) -> Any:
        if isinstance(v, dict):
            if "autoscaling_config" in v or v.get("num_replicas") == "auto":
                raise ValueError("remove autoscaling_config / num_replicas: auto: the rayscale controller sets "
                                 "replica counts (num_replicas is the starting count)")
            if "name" in v:
                raise ValueError("remove name: rayscale names each deployment {model_id}--{flavor}")
        return v


class _Accelerator(_Strict):
    kind: Literal["cpu", "gpu"]


class _Experimental(BaseModel):
    # Ray's other experimental keys pass through unread.
    model_config = ConfigDict(extra="allow")
    stream_batching_interval_ms: float | None = Field(default=None, ge=0)
    rayscale: RayscaleExtension = Field(default_factory=RayscaleExtension)


# LLMConfig fields rayscale's builder sets itself or does not pass on.
_UNSUPPORTED = ("runtime_env", "lora_config", "server_cls", "callback_config")


class LLMConfigEntry(_Strict):
    """The part of Ray Serve LLM's ``LLMConfig`` rayscale builds from (same field names and meaning)."""

    model_loading_config: _ModelLoading
    llm_engine: Literal["vLLM"] = "vLLM"
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    accelerator_type: str | None = None
    accelerator_config: _Accelerator | None = None
    placement_group_config: _PlacementGroup | None = None
    deployment_config: _Deployment = Field(default_factory=_Deployment)
    # rayscale's signals read the engine metrics: they stay on.
    log_engine_metrics: Literal[True] = True
    experimental_configs: _Experimental = Field(default_factory=_Experimental)

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, v: Any) -> Any:
        if isinstance(v, dict):
            for k in _UNSUPPORTED:
                if k in v:
                    raise ValueError(f"{k}: rayscale's builder does not pass this LLMConfig field on; remove it")
        return v

    def accelerator(self) -> Accelerator:
        """The device kind as Ray Serve LLM infers it."""
        if self.accelerator_config is not None:
            return self.accelerator_config.kind
        pg = self.placement_group_config
        if pg is None:
            return "gpu"  # Ray's default, with or without an accelerator_type
        return _infer_accelerator([*(pg.bundles or []), *([pg.bundle_per_worker] if pg.bundle_per_worker else [])])


def _infer_accelerator(bundles: list[dict[str, float]] | None, accelerator_type: str | None = None) -> Accelerator:
    """Ray Serve LLM's rule (bundles with a GPU: gpu; bundles without: cpu; else an accelerator type: gpu)
    with Neuron bundles (neuron_cores) added."""
    if bundles:
        if any(b.get("GPU") for b in bundles):
            return "gpu"
        return "neuron" if any(b.get("neuron_cores") for b in bundles) else "cpu"
    return "gpu" if accelerator_type else "cpu"


def _entry_flavor(e: LLMConfigEntry, tp: int, pp: int) -> FlavorSpec:
    """The entry as a flavor: the defaults of its rayscale flavors, or its one flavor."""
    kind = e.accelerator()
    pg = e.placement_group_config or _PlacementGroup()
    bundles = pg.bundles or ([pg.bundle_per_worker] * (tp * pp) if pg.bundle_per_worker else None)
    return FlavorSpec(
        flavor=(e.accelerator_type or kind).lower(),
        accelerator=kind,
        accelerator_type=e.accelerator_type,
        num_replicas=e.deployment_config.num_replicas,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        placement_bundles=[PlacementBundle(resources=b) for b in bundles] if bundles else None,
        placement_strategy=pg.strategy,
        max_ongoing_requests=e.deployment_config.max_ongoing_requests,
        stream_batching_interval_ms=e.experimental_configs.stream_batching_interval_ms,
    )


def _flavor(base: FlavorSpec, spec: FlavorSpec) -> dict[str, Any]:
    """A FlavorDeployment's fields: the spec's where set, else the entry's (device fields as a group)."""
    inherit = set(type(base).model_fields) - spec.model_fields_set - {"flavor", "weight", "engine_kwargs"}
    merged = {**spec.model_dump(exclude_none=True), **base.model_dump(include=inherit, exclude_none=True)}
    if spec.model_fields_set & _DEVICE_FIELDS:
        for k in _DEVICE_FIELDS - spec.model_fields_set:
            merged.pop(k, None)
        if spec.accelerator is None:
            bundles = [b.resources for b in spec.placement_bundles or []]
            merged["accelerator"] = _infer_accelerator(bundles, spec.accelerator_type)
    kwargs = dict(spec.engine_kwargs)
    for k in ("tensor_parallel_size", "pipeline_parallel_size"):
        if k in kwargs and k not in spec.model_fields_set:
            merged[k] = kwargs.pop(k)
    merged["engine_kwargs"] = kwargs
    return merged


def _model_from_entry(e: LLMConfigEntry) -> dict[str, Any]:
    """ModelDeployment fields of one LLMConfig entry."""
    ext = e.experimental_configs.rayscale
    kwargs = dict(e.engine_kwargs)
    # Parallelism shapes the placement bundles: it lives on the flavor, not in the shared engine kwargs.
    tp, pp = int(kwargs.pop("tensor_parallel_size", 1)), int(kwargs.pop("pipeline_parallel_size", 1))
    max_len = kwargs.pop("max_model_len", None)
    base = _entry_flavor(e, tp, pp)
    model: dict[str, Any] = {
        "name": e.model_loading_config.model_id,
        "engine": ext.engine,
        "source": e.model_loading_config.model_source or e.model_loading_config.model_id,
        "engine_kwargs": kwargs,
        "flavors": [_flavor(base, spec) for spec in ext.flavors or [FlavorSpec(flavor=base.flavor)]],
    }
    if max_len is not None:
        model["max_model_len"] = max_len
    return model


# Where a ModelDeployment field comes from in an LLMConfig entry.
_ENTRY_LOC = {"name": "model_loading_config.model_id", "max_model_len": "engine_kwargs.max_model_len",
              "engine": "experimental_configs.rayscale.engine"}


def models_from_llm_configs(entries: list[LLMConfigEntry]) -> list[ModelDeployment]:
    """One model per entry; errors name the entry (``llm_configs.<i>``) and the field."""
    models = []
    for i, e in enumerate(entries):
        try:
            models.append(ModelDeployment.model_validate(_model_from_entry(e)))
        except ValidationError as err:
            found = []
            for x in err.errors():
                loc = ".".join(str(p) for p in x["loc"])
                loc = _ENTRY_LOC.get(loc, loc).replace("flavors.", "experimental_configs.rayscale.flavors.")
                found.append((f"llm_configs.{i}.{loc}".rstrip("."), x["msg"]))
            raise EntryErrors(found) from err
    return models


class EntryErrors(ValueError):
    """Errors of the rayscale model an LLMConfig entry becomes, each at its place in the entry (pydantic
    gives a model validator's error no location of its own)."""

    def __init__(self, found: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{loc}: {msg}" for loc, msg in found))
        self.found = found

    def __reduce__(self) -> tuple[type[EntryErrors], tuple[list[tuple[str, str]]]]:
        return (type(self), (self.found,))  # pickle rebuilds from args, the joined message alone


class IngressConfig(_Strict):
    num_replicas: int = Field(default=1, ge=1)
    max_ongoing_requests: int = Field(default=1024, ge=1)
    # Seconds between refreshes of the run-time flavor weights from the weight store.
    weights_refresh_s: float = Field(default=1.0, gt=0)
    # A model with no replica that can serve (starting, or at zero replicas) is not listed, and its requests
    # are held (rayscale.serve.readiness): at most hold_max_requests per model and ingress replica, each at
    # most hold_timeout_s; past either, 503 with Retry-After hold_retry_after_s.
    hold_max_requests: int = Field(default=256, ge=0)
    hold_timeout_s: float = Field(default=300.0, ge=0)
    hold_retry_after_s: float = Field(default=10.0, gt=0)
    # Seconds between reads of the replicas' states from Serve (serve.status()).
    readiness_poll_s: float = Field(default=1.0, gt=0)


class AppConfig(_Strict):
    """All models of one Serve application, behind one ingress. After validation ``models`` holds every
    model, those given as ``llm_configs`` included (and ``llm_configs`` is empty)."""

    models: list[ModelDeployment] = Field(default_factory=list)
    # Ray Serve LLM LLMConfig entries, read into ``models``.
    llm_configs: list[LLMConfigEntry] = Field(default_factory=list)
    # Serve application name; keys the run-time weight store (rayscale.serve.weights).
    app_name: str = "default"
    ingress: IngressConfig = Field(default_factory=IngressConfig)

    @model_validator(mode="after")
    def _unique(self) -> AppConfig:
        # Read once: llm_configs then stays empty, so validating this AppConfig again changes nothing.
        self.models = [*self.models, *models_from_llm_configs(self.llm_configs)]
        self.llm_configs = []
        if not self.models:
            raise ValueError("no models: list Ray Serve LLM configs under llm_configs (or models)")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique: {names}")
        return self

    def as_args(self) -> dict[str, Any]:
        """The same application as ``args`` in rayscale's own shape (every model under ``models``)."""
        return self.model_dump(mode="json", exclude={"llm_configs"})

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
        inner = (e.get("ctx") or {}).get("error")
        if isinstance(inner, EntryErrors):
            lines += [f"  {prefix}{loc}: {msg}" for loc, msg in inner.found]
            continue
        loc = ".".join(str(x) for x in e["loc"])
        lines.append(f"  {prefix}{loc}: {e['msg']}" if loc else f"  {prefix.rstrip('.')}: {e['msg']}")
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
    known = {d for m in cfg.models for f in m.flavors for d in f.deployment_names(m.name)} | {"ingress"}
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
