"""Engine metrics in vLLM's names, labelled per (model, flavor, replica), exported through Ray.

vLLM's own ``RayPrometheusStatLogger`` (what Ray Serve LLM installs with ``log_engine_metrics``)
labels series with ``model_name``, ``engine`` and ``ReplicaId`` only. The controller needs the flavor
too, so both engines here add ``model``, ``flavor`` and ``deployment`` tags, read from the Serve
replica context (deployment name ``{model}--{flavor}``). vLLM's stat logger takes no extra labels,
so rayscale subclasses it (``rayscale_stat_logger_cls``); joining vLLM's ReplicaId with Serve's
replica gauge instead did not yield labelled series in the live test. Ray exports them on each node's
metrics port as ``ray_vllm_<name>`` (``:`` is not allowed in Ray metric names).
"""

from __future__ import annotations

import re
from typing import Any

# Extra tags rayscale adds to every engine series; vLLM's own are model_name, engine, ReplicaId.
EXTRA_TAG_KEYS: tuple[str, ...] = ("model", "flavor", "deployment")
VLLM_TAG_KEYS: tuple[str, ...] = ("model_name", "engine", "ReplicaId")
ALL_TAG_KEYS: tuple[str, ...] = VLLM_TAG_KEYS + EXTRA_TAG_KEYS

# vLLM 0.32 defaults (vllm/v1/metrics/buckets.py), copied so the emulated engine need not import vllm.
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
E2E_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip

def tokens_buckets(max_value: int) -> list[float]:
    """vLLM's 1-2-5 series for per-request token counts (buckets.build_1_2_5_buckets).

    vLLM derives these buckets from max_model_len, and Ray keeps the first bucket list registered for a
    metric name in the cluster: with two max_model_len values only one model exports the histogram. The
    signal window then falls back to the token counter for the other (see rayscale.signals.window)."""
    out: list[float] = []
    exp = 1
    while True:
        for m in (1, 2, 5):
            v = m * exp
            if v > max_value:
                return out
            out.append(float(v))
        exp *= 10


# vLLM metric name -> name as Ray's Prometheus endpoint shows it (counters gain "_total").
EXPORTED = {
    "vllm:num_requests_running": "ray_vllm_num_requests_running",
    "vllm:num_requests_waiting": "ray_vllm_num_requests_waiting",
    "vllm:kv_cache_usage_perc": "ray_vllm_kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds": "ray_vllm_time_to_first_token_seconds",
    "vllm:request_time_per_output_token_seconds": "ray_vllm_request_time_per_output_token_seconds",
    "vllm:inter_token_latency_seconds": "ray_vllm_inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds": "ray_vllm_e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "ray_vllm_request_queue_time_seconds",
    "vllm:request_prefill_time_seconds": "ray_vllm_request_prefill_time_seconds",
    "vllm:request_prompt_tokens": "ray_vllm_request_prompt_tokens",
    "vllm:request_generation_tokens": "ray_vllm_request_generation_tokens",
    "vllm:prompt_tokens": "ray_vllm_prompt_tokens_total",
    "vllm:generation_tokens": "ray_vllm_generation_tokens_total",
}


def sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def engine_identity(deployment: str) -> dict[str, str]:
    """model, flavor and deployment tags of a Serve deployment (flavor "" for one that is not a rayscale
    flavor or gang-slot deployment, such as Ray Serve LLM's own ``LLMServer:...``)."""
    from rayscale.serve.config import parse_deployment_name

    parsed = parse_deployment_name(deployment)
    model, flavor = (parsed[0], parsed[1]) if parsed else (deployment, "")
    return {"model": model, "flavor": flavor, "deployment": deployment}


def serve_identity() -> dict[str, str]:
    """model, flavor, deployment and replica id of the Serve replica this runs in ("" outside Serve)."""
    ident = {"model": "", "flavor": "", "deployment": "", "ReplicaId": ""}
    try:
        from ray import serve

        ctx = serve.get_replica_context()
    except Exception:
        return ident
    return {**engine_identity(ctx.deployment), "ReplicaId": ctx.replica_id.unique_id}


def rayscale_stat_logger_cls() -> type:
    """vLLM's RayPrometheusStatLogger with rayscale's extra tags on every series (imports vllm)."""
    # No public API: vLLM's stat logger takes no extra labels and its Ray wrappers live in vllm.v1 only.
    from vllm.v1.metrics import ray_wrappers as rw

    ident = serve_identity()
    extra = {k: ident[k] for k in EXTRA_TAG_KEYS}

    class _Tagged:
        # Mixed in before vLLM's wrapper: tag keys and values get rayscale's extra tags.
        metric: Any
        _tags: dict[str, str]

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._tags = {**self._tags, **extra}

        @staticmethod
        def _get_tag_keys(labelnames: list[str] | None) -> tuple[str, ...]:
            return (*(labelnames or []), "ReplicaId", *EXTRA_TAG_KEYS)

        def _build_tags(self, *labels: Any, **kw: Any) -> dict[str, str]:
            if labels:
                keys = [k for k in self.metric._tag_keys if k != "ReplicaId" and k not in EXTRA_TAG_KEYS]
                if len(labels) != len(keys):
                    raise ValueError(f"expected {len(keys)} labels, got {len(labels)}")
                kw.update(zip(keys, labels, strict=True))
            kw["ReplicaId"] = rw._get_replica_id() or ""
            kw.update(extra)
            return {k: v if isinstance(v, str) else str(v) for k, v in kw.items()}

    class Gauge(_Tagged, rw.RayGaugeWrapper):
        pass

    class Counter(_Tagged, rw.RayCounterWrapper):
        pass

    class Histogram(_Tagged, rw.RayHistogramWrapper):
        pass

    class SpecDecoding(rw.RaySpecDecodingProm):
        _counter_cls = Counter

    class KVConnector(rw.RayKVConnectorProm):
        _gauge_cls = Gauge
        _counter_cls = Counter
        _histogram_cls = Histogram

    class Perf(rw.RayPerfMetricsProm):
        _counter_cls = Counter

    class RayscaleStatLogger(rw.RayPrometheusStatLogger):
        _gauge_cls = Gauge
        _counter_cls = Counter
        _histogram_cls = Histogram
        _spec_decoding_cls = SpecDecoding
        _kv_connector_cls = KVConnector
        _perf_metrics_cls = Perf

    return RayscaleStatLogger


class EmulatedEngineMetrics:
    """The emulated engine's metrics: same names, tag keys and buckets as the vLLM path."""

    def __init__(self, served_model_name: str, max_model_len: int = 32768) -> None:
        from ray.util import metrics as rm

        ident = serve_identity()
        self._tags = {
            "model_name": served_model_name,
            "engine": "0",
            "ReplicaId": ident["ReplicaId"],
            **{k: ident[k] for k in EXTRA_TAG_KEYS},
        }
        if not self._tags["model"]:
            self._tags["model"] = served_model_name
        keys = ALL_TAG_KEYS

        def g(name: str, doc: str) -> Any:
            return rm.Gauge(sanitize(name), description=doc, tag_keys=keys)

        def c(name: str, doc: str) -> Any:
            return rm.Counter(sanitize(name), description=doc, tag_keys=keys)

        def h(name: str, doc: str, b: list[float]) -> Any:
            return rm.Histogram(sanitize(name), description=doc, boundaries=b, tag_keys=keys)

        self.running = g("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = g("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prompt = c("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.gen = c("vllm:generation_tokens", "Number of generation tokens processed.")
        self.ttft = h("vllm:time_to_first_token_seconds", "Histogram of time to first token.", TTFT_BUCKETS)
        self.tpot = h(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.itl = h("vllm:inter_token_latency_seconds", "Histogram of inter-token latency.", ITL_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency.", E2E_BUCKETS)
        # Per finished request, as vLLM: the window's exact output mean comes from these (the generation
        # counter also counts tokens of requests still running, which overstates it in a ramp).
        self.req_prompt = h("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                            tokens_buckets(max_model_len))
        self.req_gen = h("vllm:request_generation_tokens", "Number of generation tokens processed.",
                         tokens_buckets(max_model_len))
        # vLLM records both when a request finishes, with its request-latency buckets (= E2E_BUCKETS).
        self.queued = h("vllm:request_queue_time_seconds",
                        "Histogram of time spent in WAITING phase for request.", E2E_BUCKETS)
        self.prefill = h("vllm:request_prefill_time_seconds",
                         "Histogram of time spent in PREFILL phase for request.", E2E_BUCKETS)
        self.set_queue(0, 0, 0.0)

    def set_queue(self, waiting: int, running: int, kv_usage: float) -> None:
        self.waiting.set(waiting, tags=self._tags)
        self.running.set(running, tags=self._tags)
        self.kv.set(kv_usage, tags=self._tags)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds, tags=self._tags)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds, tags=self._tags)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.observe(seconds, tags=self._tags)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.observe(seconds, tags=self._tags)

    def observe_phases(self, queued_s: float, prefill_s: float) -> None:
        self.queued.observe(queued_s, tags=self._tags)
        self.prefill.observe(prefill_s, tags=self._tags)

    def observe_request_tokens(self, prompt: int, generation: int) -> None:
        self.req_prompt.observe(prompt, tags=self._tags)
        self.req_gen.observe(generation, tags=self._tags)

    def add_tokens(self, prompt: int, generation: int) -> None:
        if prompt:
            self.prompt.inc(prompt, tags=self._tags)
        if generation:
            self.gen.inc(generation, tags=self._tags)


# Requests an engine refuses for their length (prompt or max_tokens over max_model_len), per model. They
# are counted apart so that they read as refused, not as SLO misses or load. Counted at the ingress, which
# sees both engines' 400s; Ray exports the counter as REJECTED_REQUESTS_EXPORTED.
REJECTED_REQUESTS = "rayscale_rejected_requests"
REJECTED_REQUESTS_EXPORTED = "ray_rayscale_rejected_requests_total"
REJECTED_TAG_KEYS: tuple[str, ...] = ("model", "reason")
REJECT_MAX_MODEL_LEN = "max_model_len"


# The load as clients bring it, per model and ingress replica: requests wait in Serve (the proxy's and the
# ingress's routers, max_ongoing_requests) and in the ingress where no engine metric sees them. Ray exports
# them as INGRESS_EXPORTED[...] (rayscale.signals.window reads them).
INGRESS_IN_FLIGHT = "rayscale_ingress_requests_in_flight"  # accepted, not finished
INGRESS_WAITING = "rayscale_ingress_requests_waiting"  # accepted, no first byte from an engine yet
# Requests accepted since the replica started, as a gauge: Ray's Counter cannot export a 0, and a counter
# that appears with the first requests would lose them from the window's difference.
INGRESS_ARRIVALS = "rayscale_ingress_requests_accepted"
INGRESS_TTFT = "rayscale_ingress_time_to_first_token_seconds"  # arrival at the ingress -> first byte
INGRESS_TAG_KEYS: tuple[str, ...] = ("model", "replica")
INGRESS_PREFIX = "ray_rayscale_ingress_"
INGRESS_EXPORTED = {
    INGRESS_IN_FLIGHT: "ray_" + INGRESS_IN_FLIGHT,
    INGRESS_WAITING: "ray_" + INGRESS_WAITING,
    INGRESS_ARRIVALS: "ray_" + INGRESS_ARRIVALS,
    INGRESS_TTFT: "ray_" + INGRESS_TTFT,
}
# Serve's own router gauge (ray/serve/_private/router.py, RouterMetricsManager): requests a handle holds
# because every replica of the deployment is at max_ongoing_requests. Tags: deployment, application,
# handle, actor_id; one series per handle (the proxy's for the ingress, the ingress's for each flavor).
SERVE_QUEUED_EXPORTED = "ray_serve_deployment_queued_queries"


class IngressMetrics:
    """The ingress's own series (created in the ingress replica).

    In-flight and waiting are counted here and written to Ray's gauges by ``report`` (the ingress calls it
    every ``report_interval_s`` and from Serve's health check), not per request: a gauge set per request
    costs the hot path, and a reported idle zero keeps the series alive so idle never reads as missing."""

    def __init__(self, models: list[str] | tuple[str, ...] = (), replica: str | None = None) -> None:
        from ray.util import metrics as rm

        self.rejected = rm.Counter(
            REJECTED_REQUESTS,
            description="Requests rejected with 400 because they exceed the model's max_model_len.",
            tag_keys=REJECTED_TAG_KEYS,
        )
        self.replica = serve_identity()["ReplicaId"] if replica is None else replica
        self._in_flight_g = rm.Gauge(INGRESS_IN_FLIGHT, description="Requests the ingress accepted and has not "
                                     "finished (waiting for a replica, queued, running).", tag_keys=INGRESS_TAG_KEYS)
        self._waiting_g = rm.Gauge(INGRESS_WAITING, description="Requests the ingress accepted that have no first "
                                   "byte from an engine yet.", tag_keys=INGRESS_TAG_KEYS)
        self._arrivals_g = rm.Gauge(INGRESS_ARRIVALS, description="Requests the ingress accepted since its "
                                    "replica started (cumulative).", tag_keys=INGRESS_TAG_KEYS)
        self._ttft_h = rm.Histogram(INGRESS_TTFT, description="Seconds from a request's arrival at the ingress "
                                    "to its first byte from an engine (TTFT as the client sees it).",
                                    boundaries=TTFT_BUCKETS, tag_keys=INGRESS_TAG_KEYS)
        self.in_flight: dict[str, int] = dict.fromkeys(models, 0)
        self.waiting: dict[str, int] = dict.fromkeys(models, 0)
        self.arrived: dict[str, int] = dict.fromkeys(models, 0)

    def _tags(self, model: str) -> dict[str, str]:
        return {"model": model, "replica": self.replica}

    def reject(self, model: str, reason: str = REJECT_MAX_MODEL_LEN) -> None:
        self.rejected.inc(1, tags={"model": model, "reason": reason})

    def arrive(self, model: str) -> None:
        self.in_flight[model] = self.in_flight.get(model, 0) + 1
        self.waiting[model] = self.waiting.get(model, 0) + 1
        self.arrived[model] = self.arrived.get(model, 0) + 1

    def first_byte(self, model: str, seconds: float | None) -> None:
        """The engine answered (or failed) a request: it waits no longer; ``seconds``: its TTFT, if it streams
        or answered at all (None for an error)."""
        self.waiting[model] -= 1
        if seconds is not None:
            self._ttft_h.observe(seconds, tags=self._tags(model))

    def finish(self, model: str) -> None:
        self.in_flight[model] -= 1

    def report(self) -> None:
        for model, n in self.in_flight.items():
            tags = self._tags(model)
            self._in_flight_g.set(n, tags=tags)
            self._waiting_g.set(self.waiting.get(model, 0), tags=tags)
            self._arrivals_g.set(self.arrived.get(model, 0), tags=tags)


# --- reading them back --------------------------------------------------------------------------


def scrape_metrics(prefix: str, timeout_s: float = 5.0) -> list[tuple[str, dict[str, str], float]]:
    """All samples whose name starts with ``prefix`` from all nodes of the connected Ray cluster."""
    import httpx

    from rayscale.signals.scrape import ray_metrics_endpoints  # signals read this module's names
    from rayscale.signals.window import parse_prometheus

    samples = []
    for url in ray_metrics_endpoints():
        try:
            r = httpx.get(url, timeout=timeout_s)
        except httpx.HTTPError:
            continue  # a node going away; its series are simply missing this round
        samples += [(name, dict(labels), v) for (name, labels), v in parse_prometheus(r.text, prefix).items()]
    return samples


def scrape_engine_metrics(timeout_s: float = 5.0) -> list[tuple[str, dict[str, str], float]]:
    """All ``ray_vllm_*`` samples from all nodes of the connected Ray cluster."""
    return scrape_metrics("ray_vllm_", timeout_s)
