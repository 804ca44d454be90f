"""The catalog: models, accelerator flavors and per-(model, flavor) performance profiles.

Validated with pydantic; rayscale.config loads them from YAML and turns a bad file into one
``CatalogError`` that names the file, the field path and what is allowed, before anything starts.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
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


_SOURCE_KINDS = ("published", "measured", "derived", "estimate")


class Timed(_Strict):
    """One part of a start-up, in seconds, with where the number comes from."""

    s: NonNegFloat = Field(description="seconds")
    source: str = Field(description="'published: <where>', 'measured: <how>', 'derived: <from what>' or "
                                    "'estimate: <why>'")

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if v.split(":", 1)[0].strip() not in _SOURCE_KINDS or not v.split(":", 1)[-1].strip():
            raise ValueError(f"must start with one of {', '.join(k + ':' for k in _SOURCE_KINDS)} and say where")
        return v

    def scaled(self, k: float, why: str) -> Timed:
        return Timed(s=self.s * k, source=f"{self.source} ({why})")


class NodeStartup(_Strict):
    """A flavor's part of a start-up: launch -> Ready with devices allocatable, then the serving image."""

    node_boot: Timed = Field(description="launch to Ready with devices allocatable (Flavor.node_startup_s)")
    image_pull: Timed = Field(description="pull and unpack the serving image on a node that lacks it")
    image_pull_snapshot: Timed | None = Field(
        default=None, description="the same with the node's data volume restored from an EBS snapshot that holds "
                                  "the image (None: the fast-start option is not offered for this flavor)")


class ReplicaStartup(_Strict):
    """A (model, flavor)'s part of a start-up once the image is on the node."""

    weight_load: Timed = Field(description="fetch the weights from the hub and load them onto the devices")
    engine_start: Timed = Field(description="engine start after the weights: compile, profile, graphs, warm-up")
    weight_load_stream: Timed | None = Field(
        default=None, description="weights streamed from S3 by vLLM's Run:ai streamer (load_format runai_streamer)")
    weight_load_cache: Timed | None = Field(
        default=None, description="weights read from a node-local cache (the snapshot data volume)")


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
    startup: NodeStartup | None = Field(
        default=None, description="node boot and image pull with their sources; node_startup_s is node_boot")

    _name = field_validator("name")(classmethod(lambda cls, v: _check_name(v)))

    @model_validator(mode="before")
    @classmethod
    def _boot_total(cls, data: Any) -> Any:
        # node_startup_s is the node_boot part: written, it must agree; left out, the part sets it.
        if isinstance(data, dict) and isinstance(data.get("startup"), dict):
            boot = data["startup"].get("node_boot")
            if isinstance(boot, dict) and isinstance(boot.get("s"), int | float):
                if "node_startup_s" not in data:
                    return {**data, "node_startup_s": boot["s"]}
                if abs(float(data["node_startup_s"]) - boot["s"]) > 0.5:
                    raise ValueError(f"node_startup_s ({data['node_startup_s']}) must equal startup.node_boot.s "
                                     f"({boot['s']}): it is the node boot part")
        return data

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
    startup_s: NonNegFloat = Field(description="replica start on a ready node: image pull + weight load + engine "
                                               "start (with the catalog's fast-start choices)")
    startup: ReplicaStartup | None = Field(
        default=None, description="weight load and engine start with their sources; with the flavor's image pull "
                                  "they sum to startup_s (rayscale.core.catalog.startup_parts)")
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

    def ttft_s(self, prompt_tokens: float, queue_wait_s: float = 0.0, prefill_scale: float = 1.0) -> float:
        """``prefill_scale``: prefill that many times as fast (a prefix-cache discount, estimate.prefix_scales)."""
        return (queue_wait_s + self.overhead_s + prompt_tokens / (self.prefill_tokens_per_s * prefill_scale)
                + self.prefill_quadratic_s * prompt_tokens * prompt_tokens)

    def prefill_engine_s(self, prompt_tokens: float) -> float:
        """Engine time one prompt takes from an iteration it shares (what it costs the requests decoding)."""
        return (self.prefill_seq_s + prompt_tokens / self.prefill_tokens_per_s
                + self.prefill_quadratic_s * prompt_tokens * prompt_tokens)


class WeightSource(StrEnum):
    DOWNLOAD = "download"  # from the hub on every start (vLLM's default)
    STREAM = "stream"  # streamed from S3 by vLLM's Run:ai streamer (load_format runai_streamer)
    CACHE = "cache"  # from a node-local cache on the node's data volume


_SNAPSHOT = re.compile(r"^snap-[0-9a-f]{8,17}$")


class FastStart(_Strict):
    """The fast-start choices of a deployment: rendered into the EC2NodeClasses and serve config
    (rayscale.cluster.render) and simulated through the start-up they imply (startup_parts)."""

    image_snapshots: dict[AcceleratorKind, str] = Field(
        default_factory=dict, description="EBS snapshot (snap-...) holding the serving image, per accelerator kind "
                                          "(gpu, neuron): restored as the nodes' data volume (Bottlerocket)")
    weights: WeightSource = WeightSource.DOWNLOAD
    weights_uri: str | None = Field(
        default=None, description="s3://bucket/prefix holding each model's safetensors under <prefix>/<model name>; "
                                  "required by weights: stream")

    @field_validator("image_snapshots")
    @classmethod
    def _snapshots(cls, v: dict[AcceleratorKind, str]) -> dict[AcceleratorKind, str]:
        for kind, snap in v.items():
            if kind == AcceleratorKind.CPU:
                raise ValueError("cpu: the local CPU flavor has no EC2NodeClass; allowed kinds: gpu, neuron")
            if not _SNAPSHOT.match(snap):
                raise ValueError(f"{kind.value}: {snap!r} is not an EBS snapshot id (snap- and 8-17 hex digits)")
        return v

    @model_validator(mode="after")
    def _uri(self) -> FastStart:
        if self.weights == WeightSource.STREAM and not (self.weights_uri or "").startswith("s3://"):
            raise ValueError("weights: stream needs weights_uri: s3://bucket/prefix (where the weights are streamed from)")
        return self

    def snapshot_for(self, kind: AcceleratorKind) -> str | None:
        return self.image_snapshots.get(kind)


@dataclass(frozen=True)
class StartupParts:
    """A replica's start-up from a launch, split as it happens: node boot, image pull, weight load, engine start."""

    node_boot_s: float
    image_pull_s: float
    weight_load_s: float
    engine_start_s: float

    def replica_s(self, image_cached: bool = False) -> float:
        """Replica start on a Ready node; a node that already holds the image skips the pull."""
        return (0.0 if image_cached else self.image_pull_s) + self.weight_load_s + self.engine_start_s

    @property
    def total_s(self) -> float:
        return self.node_boot_s + self.replica_s()


def startup_parts(flavor: Flavor, profile: Profile, fast: FastStart | None = None) -> StartupParts:
    """The one map from fast-start choices to start-up parts. Without published parts (a flavor or profile that
    declares none) the totals stand alone: the node boot is node_startup_s and all of startup_s is weight load,
    so no choice and no cached image shortens them."""
    fast = fast or FastStart()
    if flavor.startup is None or profile.startup is None:
        return StartupParts(flavor.node_startup_s, 0.0, profile.startup_s, 0.0)
    fs, ps = flavor.startup, profile.startup
    pull = fs.image_pull
    if fast.snapshot_for(flavor.kind) is not None and fs.image_pull_snapshot is not None:
        pull = fs.image_pull_snapshot
    load = {WeightSource.DOWNLOAD: ps.weight_load, WeightSource.STREAM: ps.weight_load_stream,
            WeightSource.CACHE: ps.weight_load_cache}[fast.weights] or ps.weight_load
    return StartupParts(fs.node_boot.s, pull.s, load.s, ps.engine_start.s)


class Catalog(_Strict):
    """Everything the core knows about models, flavors and their profiles."""

    models: dict[str, ModelSpec]
    flavors: dict[str, Flavor]
    profiles: dict[str, Profile] = Field(description="keyed 'model/flavor'")
    spot_default_discount: float = Field(default=0.6, ge=0, lt=1)
    fast_start: FastStart = Field(default_factory=FastStart, description="the deployment's fast-start choices; "
                                  "node_startup_s and startup_s are the start-up they imply (with_fast_start)")

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
            self._check_parts(k, p)
        return self

    def _check_parts(self, key: str, p: Profile) -> None:
        fl = self.flavors[p.flavor]
        if (fl.startup is None) != (p.startup is None):
            has, lacks = (f"flavors.{fl.name}", f"profiles.{key}") if p.startup is None \
                else (f"profiles.{key}", f"flavors.{fl.name}")
            raise ValueError(f"{lacks}.startup: missing, but {has} splits its start-up into parts; split both")
        parts = startup_parts(fl, p, self.fast_start)
        if abs(parts.replica_s() - p.startup_s) > 0.5:
            raise ValueError(
                f"profiles.{key}.startup_s ({p.startup_s:g}) must equal its parts: image pull {parts.image_pull_s:g} "
                f"(flavors.{fl.name}.startup) + weight load {parts.weight_load_s:g} + engine start "
                f"{parts.engine_start_s:g} = {parts.replica_s():g}")

    def startup(self, model: str, flavor: str) -> StartupParts:
        """The start-up parts of a replica of ``model`` on ``flavor`` under this catalog's fast-start choices."""
        return startup_parts(self.flavors[flavor], self.profile(model, flavor), self.fast_start)

    def with_fast_start(self, fast: FastStart) -> Catalog:
        """The catalog as deployed with ``fast``: every node_startup_s and startup_s is the start-up the choices
        imply, so the planner's lead times, the launch timeout and the simulator all use it."""
        profiles = {k: p.model_copy(update={"startup_s": startup_parts(self.flavors[p.flavor], p, fast).replica_s()})
                    for k, p in self.profiles.items()}
        return self.model_copy(update={"profiles": profiles, "fast_start": fast})

    def with_startup_total(self, total_s: float) -> Catalog:
        """Every start-up part (and total) scaled by one factor so the median cold start-up (node boot + image pull
        + weight load + engine start, no fast-start choice) of the catalog's offerings is ``total_s``: a sweep of
        how much the start-up time matters, keeping each offering's split and their order."""
        base = [startup_parts(self.flavors[p.flavor], p).total_s for p in self.profiles.values()]
        if not base or statistics.median(base) <= 0:
            raise CatalogError("no offering with a start-up time to scale")
        k = total_s / statistics.median(base)
        why = f"x{k:.3g} for a {total_s:g} s start-up sweep"
        flavors = {n: _scale_flavor(f, k, why) for n, f in self.flavors.items()}
        profiles = {key: _scale_profile(p, k, why) for key, p in self.profiles.items()}
        return self.model_copy(update={"flavors": flavors, "profiles": profiles}).with_fast_start(self.fast_start)

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
        return Catalog(models=ms, flavors=fs, profiles=prof, spot_default_discount=self.spot_default_discount,
                       fast_start=self.fast_start)


def _scale_flavor(f: Flavor, k: float, why: str) -> Flavor:
    st = f.startup
    if st is None:
        return f.model_copy(update={"node_startup_s": f.node_startup_s * k})
    snap = st.image_pull_snapshot.scaled(k, why) if st.image_pull_snapshot is not None else None
    parts = NodeStartup(node_boot=st.node_boot.scaled(k, why), image_pull=st.image_pull.scaled(k, why),
                        image_pull_snapshot=snap)
    return f.model_copy(update={"startup": parts, "node_startup_s": parts.node_boot.s})


def _scale_profile(p: Profile, k: float, why: str) -> Profile:
    st = p.startup
    if st is None:
        return p.model_copy(update={"startup_s": p.startup_s * k})
    opt = {name: (getattr(st, name).scaled(k, why) if getattr(st, name) is not None else None)
           for name in ("weight_load_stream", "weight_load_cache")}
    parts = ReplicaStartup(weight_load=st.weight_load.scaled(k, why), engine_start=st.engine_start.scaled(k, why),
                           **opt)
    return p.model_copy(update={"startup": parts})


def profile_key(model: str, flavor: str) -> str:
    return f"{model}/{flavor}"


def _pick(d: Mapping[str, Any], names: list[str] | None, what: str) -> dict[str, Any]:
    if names is None:
        return dict(d)
    unknown = [n for n in names if n not in d]
    if unknown:
        raise CatalogError(f"unknown {what}(s) {unknown}; allowed: {sorted(d)}")
    return {n: d[n] for n in names}
