"""The end-to-end demo: a local Ray cluster, the tiny Qwen2 model on vLLM (CPU), a real trace replayed.

Steps, each timed and printed:
1. cluster: a head node and one ``cpu`` flavor worker node (``rayscale.cluster.local``);
2. serve:   Ray Serve with the app of ``deployments/local-tiny.yaml``, its vLLM replica pinned to the
            flavor node by the flavor's resource;
3. ready:   wait until the OpenAI endpoint lists the model;
4. replay:  a slice of the Azure code trace, thinned, compressed and clipped to what two cores serve;
5. report:  the summary table.
Everything started is stopped at the end, also on errors, Ctrl-C and SIGTERM. Later issues add steps
(the controller, autoscaling) between ``ready`` and ``report``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import rayscale

if TYPE_CHECKING:
    from rayscale.cluster.local import LocalCluster

REPO_ROOT = Path(rayscale.__file__).resolve().parents[1]
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "azure_llm_2023_code.csv"
DEFAULT_SERVE_CONFIG = REPO_ROOT / "deployments" / "local-tiny.yaml"
NODE_IP = "127.0.0.2"


@dataclass(frozen=True)
class DemoConfig:
    trace: Path = DEFAULT_TRACE
    serve_config: Path = DEFAULT_SERVE_CONFIG
    root_dir: Path = Path("/tmp/rayscale-demo")
    # the trace slice: [start, start + window) of the trace, thinned, then played `speedup` times faster
    # minutes 3-5 of the Azure trace: a burst (~9 requests/s) then a calmer stretch; a fifth of it,
    # twice as fast, is what the tiny model on two cores serves with TTFT rising under the burst
    window_start_s: float = 180.0
    window_s: float = 120.0
    rate_scale: float = 0.2
    speedup: float = 2.0
    max_prompt_tokens: int = 256
    max_output_tokens: int = 32
    seed: int = 0
    http_port: int = 8000  # taken if free, else any free port
    flavor: str = "cpu"
    deploy_timeout_s: float = 420.0  # vLLM's CPU build imports slowly on two busy cores
    request_timeout_s: float = 60.0
    replay_deadline_s: float = 240.0
    progress: bool = True
    autoscale: bool = True  # the controller phase: a burst on the emulated Mistral-7B, scaled by rayscale
    out_dir: Path = REPO_ROOT / "out"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.speedup <= 0 or not self.rate_scale > 0:
            raise ValueError("window_s, speedup and rate_scale must be > 0")
        if self.max_prompt_tokens < 1 or self.max_output_tokens < 1:
            raise ValueError("token limits must be >= 1")


class Step:
    """Prints ``[i/n] what ...`` and how long it took."""

    def __init__(self, total: int, out: Callable[[str], None]):
        self.total, self.i, self.out = total, 0, out

    @contextlib.contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        self.i += 1
        self.out(f"[{self.i}/{self.total}] {what} ...")
        start = time.perf_counter()
        yield
        self.out(f"[{self.i}/{self.total}] {what}: done in {time.perf_counter() - start:.1f} s")


def _port(ip: str, preferred: int) -> int:
    from rayscale.cluster.local import free_port, port_free

    return preferred if port_free(ip, preferred) else free_port()


def demo_trace(cfg: DemoConfig, out: Callable[[str], None]) -> Any:
    """The trace to replay: the shared Azure sample if present, else a generated one of the same shape."""
    from rayscale.sim import trace as T

    if cfg.trace.exists():
        full = T.load_trace(cfg.trace)
        out(f"    trace: {cfg.trace} ({len(full)} requests over {full.duration_s:.0f} s)")
    else:
        out(f"    trace {cfg.trace} not found: using a generated Poisson trace instead")
        full = T.poisson(
            2.5, cfg.window_start_s + cfg.window_s, seed=cfg.seed,
            prompt=T.LengthDist(1500, 1.0, 8, 8000), output=T.LengthDist(13, 1.0, 1, 500),
        )
    tr = (
        full.window(cfg.window_start_s, cfg.window_start_s + cfg.window_s)
        .rate_scale(cfg.rate_scale, seed=cfg.seed)
        .compress(cfg.speedup)
        .clip_tokens(max_prompt=cfg.max_prompt_tokens, max_output=cfg.max_output_tokens)
    )
    s = tr.stats()
    out(
        f"    slice: {s.requests} requests over {s.duration_s:.0f} s ({s.rate_per_s:.2f}/s), "
        f"prompt p50 {s.prompt_tokens_p50:.0f} tokens, output p50 {s.output_tokens_p50:.0f} tokens"
    )
    return tr


def serve_app_args(cfg: DemoConfig) -> tuple[str, dict[str, Any], str]:
    """(app name, app args, model name) from the serve config, with the replica pinned to the flavor."""
    from rayscale.serve.config import PlacementBundle, load_serve_config

    loaded = load_serve_config(cfg.serve_config)  # validates the whole file; errors name file and field
    name = loaded.serve.applications[0].name
    app = loaded.apps[name]
    for model in app.models:
        for fl in model.flavors:
            bundles = fl.bundles()
            # the flavor's resource makes Ray place the replica on a node of that flavor, as on a cloud
            bundles[0][f"accelerator_type:{cfg.flavor.upper()}"] = 1
            fl.placement_bundles = [PlacementBundle(resources=b) for b in bundles]
    return name, app.as_args(), app.models[0].name


def deploy(app_name: str, args: dict[str, Any], port: int, timeout_s: float) -> None:
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    from rayscale.serve.app import build_app

    serve.start(http_options={"host": NODE_IP, "port": port}, proxy_location="HeadOnly")
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # serve.start sets up its own logger
    # Serve's own waits are unbounded: submit, then poll with a deadline
    serve.run_many(
        [serve.RunTarget(target=build_app(args), name=app_name, route_prefix="/")],
        wait_for_ingress_deployment_creation=False,
        wait_for_applications_running=False,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        st = serve.status().applications.get(app_name)
        if st is not None and st.status == ApplicationStatus.RUNNING:
            return
        if st is not None and st.status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"app {app_name} failed to deploy: {st.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"app {app_name} not running after {timeout_s:g} s: {st}")
        time.sleep(2.0)


class _Terminated(Exception):
    pass


def run_demo(cfg: DemoConfig, out: Callable[[str], None] = print) -> int:
    from rayscale.cluster.local import LocalCluster, LocalClusterConfig

    # Engine metrics reach Ray's Prometheus endpoints within ~1 s (default ~10 s): the controller reads them.
    cluster = LocalCluster(LocalClusterConfig(root_dir=cfg.root_dir, head_num_cpus=1,
                                              env={"RAY_metrics_report_interval_ms": "1000"}))
    old_term = signal.signal(signal.SIGTERM, _on_term)
    # one line per HTTP request and Serve's config dumps would bury the progress bar
    for name in ("httpx", "ray.serve", "ray"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        return _stages(cfg, cluster, out)
    except (KeyboardInterrupt, _Terminated):
        out("interrupted: stopping everything the demo started")
        return 130
    finally:
        _clean_up(cluster, old_term, out)


def _on_term(signum: int, frame: Any) -> None:
    raise _Terminated()


def _stages(cfg: DemoConfig, cluster: LocalCluster, out: Callable[[str], None]) -> int:
    """The demo's steps, each timed; 0 when every one served its requests."""
    from rayscale.loadgen import LoadGenConfig, replay, wait_ready

    step = Step(6 if cfg.autoscale else 5, out)
    trace = demo_trace(cfg, out)
    app_name, args, model = serve_app_args(cfg)
    with step("cluster: head + one worker node of flavor " + repr(cfg.flavor)):
        cluster.start()
        node_id = cluster.add_node(cfg.flavor)
        out(f"    Ray at {cluster.address}, dashboard {cluster.dashboard_url}, nodes: head, {node_id}")
    port = _port(NODE_IP, cfg.http_port)
    base_url = f"http://{NODE_IP}:{port}"
    with step(f"serve: {model} on vLLM (CPU) from {cfg.serve_config.name}"):
        import ray

        ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
        deploy(app_name, args, port, cfg.deploy_timeout_s)
    with step(f"ready: {base_url}/v1 lists {model!r}"):
        wait_ready(base_url, model, timeout_s=120)
    lg = LoadGenConfig(base_url=base_url, model=model, request_timeout_s=cfg.request_timeout_s,
                       deadline_s=cfg.replay_deadline_s, max_prompt_tokens=cfg.max_prompt_tokens,
                       max_output_tokens=cfg.max_output_tokens,
                       max_model_len=int(args["models"][0].get("max_model_len", 2048)), seed=cfg.seed,
                       progress=cfg.progress)
    with step(f"replay: {len(trace)} requests, open loop"):
        result = replay(trace, lg)
    with step("report"):
        out(result.summary.table(title=f"{model} on {cfg.flavor} (vLLM CPU), {trace.name}"))
    rc = 0 if result.summary.ok > 0 else 1
    if cfg.autoscale:
        from rayscale import autoscale_demo

        with step("autoscale: the controller scales the emulated Mistral-7B on a10g nodes through a burst"):
            rc = max(rc, autoscale_demo.run(cluster, base_url, cfg.trace, out, cfg.out_dir, cfg.progress))
    return rc


def _clean_up(cluster: LocalCluster, old_term: Any, out: Callable[[str], None]) -> None:
    """Serve, the Ray driver and every node the demo started; a second Ctrl-C must not cut it short and leave
    nodes running."""
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out("cleanup: Serve, Ray driver, cluster nodes, files ...")
    start = time.perf_counter()
    try:
        ray = sys.modules.get("ray")  # imported and connected by the serve step, if it got that far
        if ray is not None and ray.is_initialized():
            from ray import serve

            with contextlib.suppress(Exception):
                serve.shutdown()
            with contextlib.suppress(Exception):
                ray.shutdown()
    finally:
        cluster.stop()
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    out(f"cleanup: done in {time.perf_counter() - start:.1f} s")


def main(cfg: DemoConfig | None = None) -> int:
    try:
        return run_demo(cfg or DemoConfig(), out=lambda s: print(s, flush=True))
    except Exception as e:
        print(f"demo failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
