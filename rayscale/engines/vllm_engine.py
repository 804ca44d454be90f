"""vLLM through Ray Serve LLM: one LLMConfig per (model, flavor), a thin engine subclass for metrics.

Ray Serve LLM's ``LLMServer`` + ``VLLMEngine`` do the serving; rayscale adds:
- the builtin tiny model, written on the replica's node before vLLM reads it (``LocalModelCallback``);
- per-flavor labels on vLLM's Ray metrics (``RayscaleVLLMEngine``; see rayscale.serve.metrics for why);
- deployment names ``{model}--{flavor}`` and flavor resources (see rayscale.serve.app).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rayscale.engines.tiny_model import ensure_tiny_model
from rayscale.extras import missing_vllm

try:  # Ray Serve LLM imports vLLM: this module subclasses its engine
    # No public API: LLMConfig.callback_config takes a class path, but ray.serve.llm exports neither the
    # callback base class nor the engine class (LLMServer's engine_cls) subclassed here.
    from ray.llm._internal.common.callbacks.base import CallbackBase
    from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine
except ImportError as e:
    raise missing_vllm("serving with vLLM") from e

if TYPE_CHECKING:
    from ray.serve.llm import LLMConfig

    from rayscale.serve.config import FlavorDeployment, ModelDeployment

BUILTIN_PREFIX = "builtin:"

# Engine defaults for vLLM's CPU build on a small machine: no torch.compile (slow to start on two cores),
# a fixed small KV cache instead of a fraction of host memory (other processes share this machine), and
# output streamed every 8 tokens (the first at once): a tiny model decodes faster than the per-chunk
# host work of the OpenAI layer and Serve's hops, which would otherwise steal the engine's cores.
CPU_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_memory_bytes": 64 * 2**20,
    "max_num_seqs": 64,
    "stream_interval": 8,
}


# Ray Serve's per-process switches for throughput (part of what RAY_SERVE_THROUGHPUT_OPTIMIZED sets
# cluster-wide; the proxy's gRPC and direct ingress only the cluster can change), set on the replicas of
# the serving path: requests run on the replica's own event loop instead of a second thread's, and the
# router on that loop too, so each hop pays no thread handoffs on the engine's cores. Request logs stay
# flushed per line (buffering them hides a request's log line until a thousand more arrive).
SERVE_REPLICA_ENV: dict[str, str] = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


def resolve_source(source: str) -> tuple[str, dict[str, Any]]:
    """Model path or hub id for vLLM, and engine kwargs the source implies."""
    if source.startswith(BUILTIN_PREFIX):
        name = source[len(BUILTIN_PREFIX) :]
        if name != "tiny-qwen2":
            raise ValueError(f"unknown builtin model {name!r} (known: tiny-qwen2)")
        # Weights are random: the config and tokenizer are all there is.
        return str(ensure_tiny_model()), {"load_format": "dummy"}
    return source, {}


class LocalModelCallback(CallbackBase):
    """Writes the builtin tiny model on this node and skips Ray LLM's download step for local paths."""

    async def on_before_node_init(self) -> None:
        source = self.kwargs.get("source", "")
        if source.startswith(BUILTIN_PREFIX):
            ensure_tiny_model()
            self.ctx.run_init_node = False
        elif Path(source).exists():
            self.ctx.run_init_node = False


@contextlib.contextmanager
def _stat_logger_override(cls: type) -> Iterator[None]:
    # VLLMEngine._start_async_llm_engine imports RayPrometheusStatLogger from this module at call time;
    # swapping the attribute for that one call installs rayscale's tagged subclass without copying it.
    # No public API: vLLM offers no hook to label its Ray stat logger's series.
    from vllm.v1.metrics import ray_wrappers

    original = ray_wrappers.RayPrometheusStatLogger
    ray_wrappers.RayPrometheusStatLogger = cls  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        ray_wrappers.RayPrometheusStatLogger = original  # type: ignore[misc]


class RayscaleVLLMEngine(VLLMEngine):
    """VLLMEngine whose Ray metrics carry model, flavor and deployment tags."""

    def _start_async_llm_engine(self, *args: Any, **kwargs: Any) -> Any:
        from rayscale.serve.metrics import rayscale_stat_logger_cls

        with _stat_logger_override(rayscale_stat_logger_cls()):
            return super()._start_async_llm_engine(*args, **kwargs)


def build_llm_config(model: ModelDeployment, flavor: FlavorDeployment) -> LLMConfig:
    """The Ray Serve LLM config of one (model, flavor) deployment."""
    from ray.serve.llm import LLMConfig

    from rayscale.serve.config import deployment_name

    model_path, source_kwargs = resolve_source(model.source)
    engine_kwargs: dict[str, Any] = {}
    if flavor.accelerator == "cpu":
        engine_kwargs.update(CPU_ENGINE_DEFAULTS)
    engine_kwargs.update(source_kwargs)
    engine_kwargs["max_model_len"] = model.max_model_len
    if flavor.tensor_parallel_size > 1:
        engine_kwargs["tensor_parallel_size"] = flavor.tensor_parallel_size
    if flavor.pipeline_parallel_size > 1:
        engine_kwargs["pipeline_parallel_size"] = flavor.pipeline_parallel_size
    engine_kwargs.update(model.engine_kwargs)
    engine_kwargs.update(flavor.engine_kwargs)

    # Ray Serve LLM knows "cpu", "gpu" and "tpu" backends. Neuron runs vLLM's neuron platform in-process
    # like the CPU backend (multiprocessing executor, no remote init), so it uses kind "cpu" with the
    # neuron_cores bundles that place it on an Inferentia/Trainium node.
    kind = "gpu" if flavor.accelerator == "gpu" else "cpu"
    experimental: dict[str, Any] = {}
    interval = flavor.stream_batching_interval_ms
    if interval is None and flavor.accelerator == "cpu":
        # Holding chunks adds up to the interval to TTFT and to the end of every stream; with short
        # requests on a fast tiny model that halves closed-loop throughput.
        interval = 0
    if interval is not None:
        experimental["stream_batching_interval_ms"] = interval
    return LLMConfig(
        model_loading_config={"model_id": model.name, "model_source": model_path},
        engine_kwargs=engine_kwargs,
        accelerator_config={"kind": kind},
        placement_group_config={"bundles": flavor.bundles(), "strategy": flavor.placement_strategy},
        deployment_config={
            "name": deployment_name(model.name, flavor.flavor),
            # A plain count: the rayscale controller sets it; Serve autoscaling stays off.
            "num_replicas": flavor.num_replicas,
            "max_ongoing_requests": flavor.max_ongoing_requests,
            # The replica actor itself needs no CPU of its own: the engine's bundle holds it.
            "ray_actor_options": {"num_cpus": 0},
        },
        callback_config={
            "callback_class": "rayscale.engines.vllm_engine.LocalModelCallback",
            "callback_kwargs": {"source": model.source},
        },
        log_engine_metrics=True,
        experimental_configs=experimental,
        runtime_env={"env_vars": dict(SERVE_REPLICA_ENV)},
    )
