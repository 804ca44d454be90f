"""The catalog: models, accelerator flavors and per-(model, flavor) performance profiles.

Validated with pydantic; rayscale.config loads them from YAML and turns a bad file into one
``CatalogError`` that names the file, the field path and what is allowed, before anything starts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Names end up in Kubernetes labels and object names: DNS-1123 label rules.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
PositiveInt = Annotated[int, Field(gt=0)]


class CatalogError(ValueError):
    """A catalog file failed validation. The message names the file, the field and the allowed values."""


class CapacityType(StrEnum):
    ON_DEMAND = "on-demand"
    SPOT = "spot"


class AcceleratorKind(StrEnum):
    GPU = "gpu"
    NEURON = "neuron"
    CPU = "cpu"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_name(v: str) -> str:
    if not _NAME.match(v) or len(v) > 40:
        raise ValueError(f"{v!r} must be lowercase letters, digits and '-', at most 40 characters (DNS-1123)")
    return v


class SLO(_Strict):
    """Per-model latency objective, at the 95th percentile of requests."""

    ttft_p95_s: PositiveFloat = Field(description="time to first token, seconds")
    tpot_p95_s: PositiveFloat = Field(description="time per output token after the first, seconds")


class Parallelism(_Strict):
    """How one replica is split: TP within a node, PP across nodes (units of the flavor's device)."""

    tp: PositiveInt = 1
    pp: PositiveInt = 1


class RequestMixSpec(_Strict):
    """A model's expected request shape: sizes it before any request of it has finished, and picks each
    flavor's prefill chunk (rayscale.core.chunk)."""

    prompt_mean: PositiveFloat = Field(description="prompt tokens per request")
    output_mean: PositiveFloat = Field(description="output tokens per request")
    prompt_p95: PositiveFloat | None = Field(default=None, description="95th percentile prompt; default 2x mean")


class ModelSpec(_Strict):
    name: str
    model: str = Field(description="served model path or hub id")
    slo: SLO
    parallelism: dict[str, Parallelism] = Field(
        description="flavors this model may run on, with its parallel degree on each"
    )
    priority: int = Field(default=0, ge=0, le=9, description="higher keeps capacity when it runs short")
    min_replicas: int = Field(default=0, ge=0)
    max_replicas: int = Field(default=64, ge=0)
    request_mix: RequestMixSpec | None = Field(
        default=None, description="expected mix until one is observed (default: 1,024-token prompts, 128 out)")
    # The engine rejects a request whose prompt does not fit (vLLM: 400), so no capacity is sized for the
    # part of a mix beyond it (rayscale.core.estimate.within_context).
    max_model_len: PositiveInt | None = Field(
        default=None, description="longest prompt + output the engine accepts, tokens (vLLM max_model_len); "
                                  "None: no limit")

    _name = field_validator("name")(classmethod(lambda cls, v: _check_name(v)))

    @model_validator(mode="after")
    def _bounds(self) -> ModelSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        if not self.parallelism:
            raise ValueError("parallelism must list at least one flavor")
        return self


class InstanceType(_Strict):
    name: str
    devices: PositiveInt = Field(description="accelerator devices per node (GPUs, Neuron chips, CPU slots)")
    cores_per_device: PositiveInt = Field(default=1, description="NeuronCores per chip; 1 for GPUs")
    device_memory_gib: PositiveFloat
    vcpu: PositiveInt
    memory_gib: PositiveFloat
    on_demand_usd_per_h: NonNegFloat
    spot_usd_per_h: NonNegFloat | None = Field(default=None, description="None: catalog default discount")
    price_source: str = Field(description="'published: <where>', 'measured: <how>' or 'refreshed: <when>'")

    @field_validator("price_source")
    @classmethod
    def _source(cls, v: str) -> str:
        if v.split(":", 1)[0] not in {"published", "measured", "refreshed", "derived", "nominal"}:
            raise ValueError("must start with one of: published:, measured:, refreshed:, derived:, nominal:")
        return v


class Taint(_Strict):
    key: str
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"


class FlavorLimits(_Strict):
    """Caps that NodePool limits and account quotas put on a flavor (None: unlimited)."""

    devices: int | None = Field(default=None, ge=0)
    nodes: int | None = Field(default=None, ge=0)


class Flavor(_Strict):
    name: str
    accelerator: str = Field(description="human name, e.g. 'NVIDIA A10G'")
    kind: AcceleratorKind
    resource_name: str = Field(description="Kubernetes extended resource, e.g. nvidia.com/gpu")
    ray_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources every node of this flavor declares"
    )
    instance_types: list[InstanceType]
    labels: dict[str, str] = Field(default_factory=dict, description="node labels for nodeSelector")
    taints: list[Taint] = Field(default_factory=list)
    capacity_types: list[CapacityType] = Field(default_factory=lambda: [CapacityType.ON_DEMAND])
    zones: list[str] = Field(default_factory=lambda: ["us-east-1a", "us-east-1b", "us-east-1c"])
    limits: FlavorLimits = Field(default_factory=FlavorLimits)
    spot_max_share: float = Field(default=0.0, ge=0, le=1, description="most replicas of a model on spot")
    node_startup_s: NonNegFloat = Field(default=300.0, description="launch to Ready with devices allocatable")

    _name = field_validator("name")(classmethod(lambda cls, v: _check_name(v)))

    @model_validator(mode="after")
    def _consistent(self) -> Flavor:
        if not self.instance_types:
            raise ValueError("instance_types must list at least one instance type")
        names = [it.name for it in self.instance_types]
        if len(set(names)) != len(names):
            raise ValueError(f"instance_types has duplicate names: {names}")
        if not self.zones:
            raise ValueError("zones must list at least one zone")
        if not self.capacity_types:
            raise ValueError("capacity_types must list at least one of on-demand, spot")
        return self

    def instance(self, name: str) -> InstanceType:
        for it in self.instance_types:
            if it.name == name:
                return it
        raise KeyError(f"flavor {self.name} has no instance type {name}")


class Profile(_Strict):
    """Performance of one model on one flavor, per replica.

    Latency model (shared by the estimator, the emulated engine and the simulator):
    TTFT = queue wait + overhead_s + prompt_tokens / prefill_tokens_per_s + prefill_quadratic_s * prompt_tokens^2;
    inter-token latency = itl_alpha_s + itl_beta_s * running batch; KV capacity caps the batch.

    Two optional terms describe how prompts share an engine iteration (0 = not measured; the published GPU
    profiles leave them out). ``prefill_quadratic_s``: attention, which makes prefill cost convex in the
    prompt (clear on CPU); a prompt's chunks sum to the same P^2 however it is split, so it is per prompt.
    ``prefill_seq_s``: engine time per prompt in an iteration (input preparation, sampling the first token),
    which the lone-prompt TTFT folds into ``overhead_s`` but a batch of prompts pays once each.
    ``prefill_iteration_s``: what an iteration that carries prompt tokens costs beyond a decode-only one
    (prefill attention metadata and kernels), once per such iteration; only the iteration engine model
    (rayscale.sim.iteration) resolves iterations, so only it charges this.
    """

    model: str
    flavor: str
    prefill_tokens_per_s: PositiveFloat
    overhead_s: NonNegFloat = 0.03
    itl_alpha_s: PositiveFloat
    itl_beta_s: NonNegFloat
    prefill_quadratic_s: NonNegFloat = 0.0  # s per prompt token squared
    prefill_seq_s: NonNegFloat = 0.0  # s of engine time per prompt, included in overhead_s
    prefill_iteration_s: NonNegFloat = 0.0  # s per iteration that carries prompt tokens
    max_num_seqs: PositiveInt = 256
    # vLLM's max_num_batched_tokens (the prefill chunk) this profile's engine runs with; None: rayscale picks
    # it per deployment (rayscale.core.chunk). A measured profile pins the value it was measured at.
    max_num_batched_tokens: PositiveInt | None = None
    kv_tokens: PositiveInt
    startup_s: NonNegFloat = Field(description="replica start on a ready node: image pull + model load")
    source: str

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if v.split(":", 1)[0] not in {"published", "measured", "derived", "estimate"}:
            raise ValueError("must start with one of: published:, measured:, derived:, estimate:")
        return v

    def itl_s(self, batch: float) -> float:
        return self.itl_alpha_s + self.itl_beta_s * max(batch, 1.0)

    @model_validator(mode="after")
    def _engine_limits(self) -> Profile:
        if self.prefill_seq_s > self.overhead_s:
            raise ValueError(f"prefill_seq_s ({self.prefill_seq_s}) is part of overhead_s ({self.overhead_s}), "
                             "so it cannot exceed it")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): vLLM's token budget holds one token of every running sequence")
        return self

    def ttft_s(self, prompt_tokens: float, queue_wait_s: float = 0.0) -> float:
        return (queue_wait_s + self.overhead_s + prompt_tokens / self.prefill_tokens_per_s
                + self.prefill_quadratic_s * prompt_tokens * prompt_tokens)

    def prefill_engine_s(self, prompt_tokens: float) -> float:
        """Engine time one prompt takes from an iteration it shares (what it costs the requests decoding)."""
        return (self.prefill_seq_s + prompt_tokens / self.prefill_tokens_per_s
                + self.prefill_quadratic_s * prompt_tokens * prompt_tokens)


class Catalog(_Strict):
    """Everything the core knows about models, flavors and their profiles."""

    models: dict[str, ModelSpec]
    flavors: dict[str, Flavor]
    profiles: dict[str, Profile] = Field(description="keyed 'model/flavor'")
    spot_default_discount: float = Field(default=0.6, ge=0, lt=1)

    @model_validator(mode="after")
    def _cross_refs(self) -> Catalog:
        for m in self.models.values():
            for f in m.parallelism:
                if f not in self.flavors:
                    raise ValueError(
                        f"models.{m.name}.parallelism: unknown flavor {f!r}; allowed: {sorted(self.flavors)}"
                    )
                if profile_key(m.name, f) not in self.profiles:
                    raise ValueError(f"models.{m.name}.parallelism.{f}: no profile for {m.name}/{f}")
        for k, p in self.profiles.items():
            if k != profile_key(p.model, p.flavor):
                raise ValueError(f"profiles.{k}: key must be '{p.model}/{p.flavor}'")
            if p.flavor not in self.flavors:
                raise ValueError(f"profiles.{k}.flavor: unknown flavor {p.flavor!r}; allowed: {sorted(self.flavors)}")
        return self

    def profile(self, model: str, flavor: str) -> Profile:
        return self.profiles[profile_key(model, flavor)]

    def price(self, flavor: str, instance_type: str, capacity_type: CapacityType) -> float:
        it = self.flavors[flavor].instance(instance_type)
        if capacity_type == CapacityType.ON_DEMAND:
            return it.on_demand_usd_per_h
        if it.spot_usd_per_h is not None:
            return it.spot_usd_per_h
        return it.on_demand_usd_per_h * (1.0 - self.spot_default_discount)

    def with_request_mix(self, model: str, mix: RequestMixSpec) -> Catalog:
        """The catalog with ``model``'s declared request mix replaced (as if written in models.yaml)."""
        if model not in self.models:
            raise CatalogError(f"unknown model {model!r}; allowed: {sorted(self.models)}")
        spec = self.models[model].model_copy(update={"request_mix": mix})
        return self.model_copy(update={"models": {**self.models, model: spec}})

    def subset(self, models: list[str] | None = None, flavors: list[str] | None = None) -> Catalog:
        """A catalog restricted to some models and/or flavors (unknown names are an error)."""
        ms = _pick(self.models, models, "model")
        fs = _pick(self.flavors, flavors, "flavor")
        ms = {
            n: m.model_copy(update={"parallelism": {f: p for f, p in m.parallelism.items() if f in fs}})
            for n, m in ms.items()
        }
        ms = {n: m for n, m in ms.items() if m.parallelism}
        prof = {k: p for k, p in self.profiles.items() if p.model in ms and p.flavor in fs}
        return Catalog(models=ms, flavors=fs, profiles=prof, spot_default_discount=self.spot_default_discount)


def profile_key(model: str, flavor: str) -> str:
    return f"{model}/{flavor}"


def _pick(d: Mapping[str, Any], names: list[str] | None, what: str) -> dict[str, Any]:
    if names is None:
        return dict(d)
    unknown = [n for n in names if n not in d]
    if unknown:
        raise CatalogError(f"unknown {what}(s) {unknown}; allowed: {sorted(d)}")
    return {n: d[n] for n in names}
