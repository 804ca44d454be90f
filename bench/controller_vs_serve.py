"""Issue 5: one load step against rayscale's controller and against Ray Serve's built-in autoscaling.

    .venv/bin/python -m bench.controller_vs_serve --out bench/results/controller_vs_serve.md

The same seeded trace (0.4 req/s for 30 s, 3 req/s for 120 s, 0.4 req/s for 60 s; ~100-token prompts,
32 output tokens) against the emulated Mistral-7B (the local stand-in profile of
``rayscale.autoscale_demo``: one replica serves ~1.5 req/s within the TPOT SLO) on ``a10g`` stand-in
nodes, one policy per subprocess (one Ray cluster and connection each), one after the other:

- ``rayscale``: LocalCluster (each node a ``ray start`` process) + LocalActuator (launch delay 3 s) +
  the Controller, as ``rayscale.autoscale_demo.run`` sets them up (period 2 s, the demo's planner
  settings), Serve's external scaler API;
- ``stock``: Ray Serve autoscaling with Ray 2.60's defaults (target_ongoing_requests 2, upscale 30 s,
  downscale 600 s, max_ongoing_requests 5), min 1 / max 3 replicas, nodes from Ray's own autoscaler
  (v1, fake multi-node provider with the same 3 s launch delay: ``bench/fake_provider.py``);
- ``stock-mor256``: the same, but max_ongoing_requests 256 as in rayscale's deployment, so that only the
  autoscaling policy differs.

Measured on the client (per-request TTFT/TPOT by send time, sliding 10 s windows) and by sampling nodes
and replicas every second, over the same horizon for every policy (the trace plus 60 s).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rayscale_testing.waits import wait_for

from bench.common import git_state

ROOT = Path(__file__).resolve().parents[1]
NODE_IP = "127.0.0.2"
MODEL, FLAVOR = "mistral-7b", "a10g"
DEP = f"{MODEL}--{FLAVOR}"
APP = "bench"
# load step (seconds from the replay start)
STEP_START_S, STEP_END_S, LOAD_END_S = 30.0, 150.0, 210.0
HORIZON_S = LOAD_END_S + 60.0  # node-seconds and the timeline stop here for every policy
WINDOW_S = 10.0
LAUNCH_DELAY_S = 3.0
MAX_WORKERS = 3
REQUEST_TIMEOUT_S = 60.0
STOCK_AUTOSCALING = {  # Ray Serve 2.60 defaults, explicit; min/max as for rayscale
    "min_replicas": 1, "max_replicas": MAX_WORKERS, "target_ongoing_requests": 2,
    "upscale_delay_s": 30.0, "downscale_delay_s": 600.0,
}
POLICIES = ("rayscale", "stock", "stock-mor256")
RUN_TIMEOUT_S = 600


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((NODE_IP, 0))
        return int(s.getsockname()[1])


def step_trace() -> Any:
    from rayscale.sim.trace import LengthDist, poisson

    prompt, output = LengthDist(100, 0.3, 50, 200), LengthDist(32, 0.0, 32, 32)
    low1 = poisson(0.4, STEP_START_S, seed=11, prompt=prompt, output=output)
    high = poisson(3.0, STEP_END_S - STEP_START_S, seed=12, prompt=prompt, output=output)
    low2 = poisson(0.4, LOAD_END_S - STEP_END_S, seed=13, prompt=prompt, output=output)
    return low1.concat(high, offset_s=STEP_START_S).concat(low2, offset_s=STEP_END_S)


def catalog() -> Any:
    from rayscale.autoscale_demo import local_stand_in_catalog

    return local_stand_in_catalog(max_replicas=MAX_WORKERS)


# --- the sampler: nodes and replicas every second ---------------------------------------------------


class Sampler:
    def __init__(self, nodes_fn: Any, replicas_fn: Any) -> None:
        self.nodes_fn, self.replicas_fn = nodes_fn, replicas_fn
        self.rows: list[dict[str, Any]] = []
        self.t0 = time.time()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="sampler")

    def start(self, t0: float) -> Sampler:
        self.t0 = t0
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            row: dict[str, Any] = {"t": round(now - self.t0, 2)}
            for k, fn in (("nodes", self.nodes_fn), ("replicas", self.replicas_fn)):
                try:
                    row[k] = fn()
                except Exception as e:
                    row[k] = None
                    row.setdefault("errors", []).append(f"{k}: {e!r}"[:200])
            self.rows.append(row)
            self._stop.wait(max(0.0, 1.0 - (time.time() - now)))

    def stop(self) -> None:
        self._stop.set()
        self._t.join(10)


def serve_replicas() -> dict[str, int]:
    from ray import serve

    dep = serve.status().applications[APP].deployments[DEP]
    return {str(getattr(k, "value", k)): int(v) for k, v in dep.replica_states.items()}


def bounded(fn: Any, timeout_s: float) -> None:
    """Runs fn in a daemon thread for at most timeout_s (Serve's shutdown can hang)."""
    def go() -> None:
        with contextlib.suppress(Exception):
            fn()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout_s)


# --- one policy, in its own process ---------------------------------------------------------------


def warm_up(url: str) -> None:
    """A few sequential requests: the first ones through a fresh ingress/replica take seconds."""
    from rayscale.loadgen import LoadGenConfig, replay
    from rayscale.sim.trace import LengthDist, poisson

    tr = poisson(0.5, 12.0, seed=99, prompt=LengthDist(100, 0.0, 100, 100), output=LengthDist(32, 0.0, 32, 32))
    res = replay(tr, LoadGenConfig(base_url=url, model=MODEL, max_output_tokens=32, request_timeout_s=30,
                                   deadline_s=60, progress=False, seed=99))
    log(f"warm-up: {res.summary.ok}/{res.summary.requests} ok, TTFT p95 {res.summary.ttft_p95_s}")


def replay_step(url: str, sampler: Sampler) -> Any:
    from rayscale.loadgen import LoadGenConfig, replay

    warm_up(url)
    cfg = LoadGenConfig(base_url=url, model=MODEL, max_output_tokens=32, request_timeout_s=REQUEST_TIMEOUT_S,
                        deadline_s=HORIZON_S, progress=False, seed=0)
    t0 = time.time()
    sampler.start(t0)
    res = replay(step_trace(), cfg)
    rest = HORIZON_S - (time.time() - t0)
    if rest > 0:
        time.sleep(rest)
    sampler.stop()
    return res


def run_rayscale(root: Path) -> dict[str, Any]:
    import ray
    from ray import serve

    from rayscale.autoscale_demo import app_args
    from rayscale.cluster.local import LocalCluster, LocalClusterConfig
    from rayscale.cluster.local_actuator import LocalActuator, LocalActuatorConfig
    from rayscale.controller.loop import Controller, ControllerConfig
    from rayscale.controller.serve_client import ServeClient
    from rayscale.core.act import GangPhase
    from rayscale.core.estimate import EstimateSettings
    from rayscale.core.plan import PlannerSettings
    from rayscale.core.settings import Settings
    from rayscale.loadgen import wait_ready
    from rayscale.serve.app import build_app
    from rayscale.serve.weights import set_flavor_weights
    from rayscale.signals.scrape import MetricsScraper

    cat = catalog()
    cluster = LocalCluster(LocalClusterConfig(root_dir=root, head_num_cpus=2, dashboard_port=None,
                                              env={"RAY_metrics_report_interval_ms": "1000"}))
    ctl = actuator = None
    try:
        cluster.start()
        ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False, namespace="bench")
        port = free_port()
        serve.start(http_options={"host": NODE_IP, "port": port}, proxy_location="HeadOnly")
        serve.run_many([serve.RunTarget(target=build_app({**app_args(cat), "app_name": APP}), name=APP,
                                        route_prefix="/", external_scaler_enabled=True)],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        actuator = LocalActuator(cluster, LocalActuatorConfig(default_launch_delay_s=LAUNCH_DELAY_S,
                                                              max_worker_nodes=MAX_WORKERS))
        ctl = Controller(cat, actuator, ServeClient(cluster.dashboard_url or ""), MetricsScraper(),
                         ControllerConfig(Settings(period_s=2.0, window_s=10.0, fast_window_s=4.0, stale_after_s=8.0,
                                                   forecaster="last", estimate=EstimateSettings(),
                                                   planner=PlannerSettings(downscale_delay_s=10.0, min_dwell_s=5.0)),
                                          app_name=APP, decision_log=root / "decisions.jsonl"),
                         weights_sink=set_flavor_weights)
        ctl.start()
        url = f"http://{NODE_IP}:{port}"
        wait_ready(url, MODEL, timeout_s=180)
        wait_for(lambda: ctl.serve.snapshot().running.get((MODEL, FLAVOR), 0) >= 1
                 and any(g.phase == GangPhase.READY for g in ctl.gangs()), 180, "the first gang and replica")
        time.sleep(5.0)
        sampler = Sampler(lambda: sum(1 for n in cluster.nodes() if not n.is_head and n.alive), serve_replicas)
        log("rayscale: 1 node, 1 replica; replaying the step")
        res = replay_step(url, sampler)
        decisions = [{"t": r.t, "actions": r.actions} for r in ctl.records if r.actions]
        return {"results": [_asdict(r) for r in res.results],
                "samples": sampler.rows, "t0": sampler.t0, "decisions": decisions,
                "records": [json.loads(r.to_json()) for r in ctl.records],
                "summary": res.summary.to_dict()}
    finally:
        if ctl is not None:
            ctl.stop()
        bounded(serve.shutdown, 60)
        bounded(ray.shutdown, 30)
        if actuator is not None:
            bounded(actuator.close, 60)
        cluster.stop()


def _asdict(r: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(r)


def stock_app(max_ongoing: int | None) -> Any:
    """rayscale's ingress + the same emulated deployment, but with Serve's autoscaling_config."""
    from unittest import mock

    from ray import serve

    import rayscale.serve.app as app_mod
    from rayscale.autoscale_demo import app_args
    from rayscale.serve.config import deployment_name, parse_app_args
    from rayscale.serve.emulated_server import EmulatedLLMServer

    def emulated_autoscaled(model: Any, flavor: Any) -> Any:
        profile = flavor.profile.model_copy(update={"model": model.name, "flavor": flavor.flavor})
        res = flavor.bundles()[0]
        opts: dict[str, Any] = {"num_cpus": 0, "num_gpus": res.get("GPU", 0),
                                "resources": {k: v for k, v in res.items() if k not in ("CPU", "GPU")}}
        kw: dict[str, Any] = {} if max_ongoing is None else {"max_ongoing_requests": max_ongoing}
        dep: Any = serve.deployment(EmulatedLLMServer, name=deployment_name(model.name, flavor.flavor),
                                    autoscaling_config=dict(STOCK_AUTOSCALING), ray_actor_options=opts,
                                    health_check_period_s=5, **kw)
        return dep.bind(model_name=model.name, profile=profile.model_dump(), max_model_len=model.max_model_len,
                        stream_interval_s=0.0)

    cfg = parse_app_args({**app_args(catalog()), "app_name": APP}, source="bench")
    with mock.patch.object(app_mod, "_emulated_deployment", emulated_autoscaled):
        return app_mod.build_from_config(cfg, app_name=APP)


def _process_tree(pid: int) -> list[Any]:
    import psutil

    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _kill_tree(procs: list[Any], grace_s: float = 15.0) -> None:
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


def _autoscaler_config(root: Path, gcs_port: int, events: Path) -> dict[str, Any]:
    """The cluster config Ray's v1 monitor runs on: one head and up to MAX_WORKERS a10g stand-in nodes from
    bench.fake_provider, started LAUNCH_DELAY_S after they are asked for."""
    return {
        "cluster_name": "bench-stock",
        "max_workers": MAX_WORKERS,
        "provider": {"type": "external", "module": "bench.fake_provider.DelayedFakeProvider",
                     "use_node_id_as_ip": True, "disable_node_updaters": True, "disable_launch_config_check": True,
                     "gcs_address": f"{NODE_IP}:{gcs_port}", "node_ip": NODE_IP, "temp_dir": str(root),
                     "launch_delay_s": LAUNCH_DELAY_S, "event_log": str(events)},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 2}, "node_config": {}, "max_workers": 0},
            "a10g": {"resources": {"CPU": 1, "GPU": 1, "accelerator_type:A10G": 1,
                                   "object_store_memory": 256 * 1024**2},
                     "node_config": {}, "min_workers": 0, "max_workers": MAX_WORKERS},
        },
        "head_node_type": "ray.head.default",
        "auth": {}, "upscaling_speed": 1.0,
        "idle_timeout_minutes": 5,  # the cluster launcher's default (KubeRay's is 60 s); beyond the horizon
        "docker": {}, "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [],
    }


def _head_command(root: Path, gcs_port: int, cfg_path: Path) -> list[str]:
    """``ray start --head`` with the autoscaler config, on this machine's address and free ports."""
    return [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--node-ip-address={NODE_IP}",
            f"--port={gcs_port}", "--num-cpus=2", "--num-gpus=0", f"--temp-dir={root}",
            f"--object-store-memory={256 * 1024**2}", f"--autoscaling-config={cfg_path}",
            "--dashboard-host", NODE_IP, "--dashboard-port", str(free_port()), "--disable-usage-stats"]


def _live_nodes(events: Path) -> int:
    """Worker nodes started and not yet stopped, from the fake provider's event log."""
    live: set[str] = set()
    if events.exists():
        for line in events.read_text().splitlines():
            e = json.loads(line)
            (live.add if e["event"] == "start" else live.discard)(e["node"])
    return len(live)


def _stock_record(res: Any, sampler: Sampler, events: Path, max_ongoing: int | None) -> dict[str, Any]:
    """One stock run's raw record: the requests, the samples, the node events and the effective config."""
    import ray
    from ray.serve.config import AutoscalingConfig

    registered = [n for n in ray.nodes() if n.get("Alive") and n.get("NodeManagerAddress") and
                  "accelerator_type:A10G" in n.get("Resources", {})]
    eff = AutoscalingConfig(**STOCK_AUTOSCALING)
    return {"results": [_asdict(r) for r in res.results], "samples": sampler.rows, "t0": sampler.t0,
            "summary": res.summary.to_dict(), "workers_alive_at_end": len(registered),
            "node_events": [json.loads(x) for x in events.read_text().splitlines()] if events.exists() else [],
            "autoscaling_config": json.loads(eff.model_dump_json() if hasattr(eff, "model_dump_json")
                                             else eff.json()),
            "max_ongoing_requests": max_ongoing}


def run_stock(root: Path, max_ongoing: int | None) -> dict[str, Any]:
    """Ray's own autoscaler (v1 monitor, fake multi-node provider) + Serve autoscaling, on this machine.

    Started like ``ray.cluster_utils.AutoscalingCluster.start`` does, but without its ``ray stop --force``
    (which would kill every Ray process on the machine) and without its example.yaml, which the Ray 2.60
    wheel lacks; torn down by killing this head's process tree only.
    """
    import ray
    from ray import serve

    from rayscale.loadgen import wait_ready

    gcs_port = free_port()
    events = root / "nodes.jsonl"
    config = _autoscaler_config(root, gcs_port, events)
    cfg_path = root / "autoscaler.json"
    cfg_path.write_text(json.dumps(config))
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "RAY_AUTH_MODE": "disabled",
           "RAY_metrics_report_interval_ms": "1000",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    cmd = _head_command(root, gcs_port, cfg_path)
    head_log = open(root / "head.log", "w")  # noqa: SIM115 - closed in finally
    head = subprocess.Popen(cmd, env=env, stdout=head_log, stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)
    connected = False
    try:
        os.environ["RAY_AUTH_MODE"] = "disabled"
        wait_for(lambda: head.poll() is None and _gcs_up(gcs_port), 90, "the head's GCS")
        ray.init(address=f"{NODE_IP}:{gcs_port}", logging_level=logging.ERROR, log_to_driver=False, namespace="bench")
        connected = True
        port = free_port()
        serve.start(http_options={"host": NODE_IP, "port": port}, proxy_location="HeadOnly")
        serve.run_many([serve.RunTarget(target=stock_app(max_ongoing), name=APP, route_prefix="/")],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        url = f"http://{NODE_IP}:{port}"
        wait_for(lambda: serve_replicas().get("RUNNING", 0) >= 1, 240, "the first replica (node from Ray's autoscaler)")
        wait_ready(url, MODEL, timeout_s=120)
        time.sleep(5.0)

        def nodes() -> int:
            return _live_nodes(events)

        sampler = Sampler(nodes, serve_replicas)
        log(f"stock (max_ongoing_requests {max_ongoing or 'default'}): {nodes()} node, replicas "
            f"{serve_replicas()}; replaying the step")
        res = replay_step(url, sampler)
        return _stock_record(res, sampler, events, max_ongoing)
    finally:
        if connected:
            bounded(serve.shutdown, 60)
            bounded(ray.shutdown, 30)
        _kill_tree(_process_tree(head.pid))
        head_log.close()


def _gcs_up(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((NODE_IP, port)) == 0


def child(policy: str, out: Path) -> None:
    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(f"signal {signum}: cleaning up")

    signal.signal(signal.SIGTERM, on_term)  # run the finally blocks: they stop this run's cluster
    root = Path(tempfile.mkdtemp(prefix=f"rsb-{policy[:5]}-", dir="/tmp"))
    for name in ("httpx", "ray", "ray.serve"):
        import logging

        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        if policy == "rayscale":
            data = run_rayscale(root)
        elif policy == "stock":
            data = run_stock(root, None)
        elif policy == "stock-mor256":
            data = run_stock(root, 256)
        else:
            raise SystemExit(f"unknown policy {policy}")
        data["policy"] = policy
        out.write_text(json.dumps(data))
    finally:
        if os.environ.get("BENCH_KEEP_LOGS"):
            log(f"{policy}: logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


# --- analysis --------------------------------------------------------------------------------------


def windowed(results: list[dict[str, Any]], key: str, until_s: float, fail_value: float = float("inf")) -> \
        list[tuple[float, float | None]]:
    """(t, p95 of `key` over requests sent in (t - WINDOW_S, t]); failed requests count as fail_value."""
    import numpy as np

    sent = [(r["sent_s"] if r["sent_s"] is not None else r["scheduled_s"],
             (r[key] if r["error"] is None and r[key] is not None else fail_value)) for r in results]
    out: list[tuple[float, float | None]] = []
    t = WINDOW_S
    while t <= until_s + 1e-9:
        vals = [v for s, v in sent if t - WINDOW_S < s <= t]
        out.append((t, float(np.percentile(vals, 95, method="higher")) if vals else None))
        t += 1.0
    return out


def recovery_s(series: list[tuple[float, float | None]], slo: float) -> float | None:
    """Seconds from the step start until the windowed p95 is under the SLO and stays under it to the step end.

    0: never over the SLO during the step; None: still over it at the step's end."""
    inside = [(t, v) for t, v in series if STEP_START_S < t <= STEP_END_S and v is not None]
    bad = [t for t, v in inside if v > slo]
    if not bad:
        return 0.0
    last_bad = max(bad)
    if last_bad >= STEP_END_S:
        return None
    return last_bad + 1.0 - STEP_START_S


def analyse(data: dict[str, Any], slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
    import numpy as np

    res = data["results"]
    ttft = windowed(res, "ttft_s", HORIZON_S)
    tpot = windowed(res, "tpot_s", HORIZON_S)
    both = [(t, None if a is None else max(a / slo_ttft, (b or 0.0) / slo_tpot)) for (t, a), (_, b) in
            zip(ttft, tpot, strict=True)]
    step = [r for r in res if r["sent_s"] is not None and STEP_START_S <= r["sent_s"] < STEP_END_S]
    ok_step = [r for r in step if r["error"] is None]
    samples = [s for s in data["samples"] if s["t"] <= HORIZON_S]
    node_s = 0.0
    for a, b in itertools.pairwise(samples):
        node_s += (a["nodes"] or 0) * (b["t"] - a["t"])
    reps = [(s["t"], (s["replicas"] or {}).get("RUNNING", 0)) for s in samples]
    return {
        "policy": data["policy"],
        "requests": len(res),
        "failed": sum(1 for r in res if r["error"] is not None),
        "error_kinds": data["summary"].get("error_kinds", {}),
        "recovery_ttft_s": recovery_s(ttft, slo_ttft),
        "recovery_slo_s": recovery_s(both, 1.0),
        "ttft_p95_step_s": float(np.percentile([r["ttft_s"] for r in ok_step], 95)) if ok_step else None,
        "tpot_p95_step_s": float(np.percentile([r["tpot_s"] for r in ok_step if r["tpot_s"] is not None], 95))
        if ok_step else None,
        "max_window_ttft_p95_s": max((v for _, v in ttft if v is not None), default=None),
        "node_seconds": node_s,
        "nodes_at_horizon": samples[-1]["nodes"] if samples else None,
        "peak_nodes": max((s["nodes"] or 0 for s in samples), default=0),
        "peak_replicas": max((r for _, r in reps), default=0),
        "replicas": reps,
        "nodes": [(s["t"], s["nodes"]) for s in samples],
        "ttft": ttft,
        "tpot": tpot,
        "first_scale_up_s": next((t - STEP_START_S for t, r in reps if t > STEP_START_S and r >= 2), None),
        "full_scale_s": next((t - STEP_START_S for t, r in reps if t > STEP_START_S and r >= MAX_WORKERS), None),
    }


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    out += ["| " + " | ".join(str(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def fmt(v: Any, spec: str = ".1f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def plot(rows: list[dict[str, Any]], slo_ttft: float, slo_tpot: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    colors = {"rayscale": "tab:blue", "stock": "tab:red", "stock-mor256": "tab:orange"}
    for r in rows:
        c = colors.get(r["policy"])
        ax[0].plot([t for t, _ in r["ttft"]], [v if v is not None and v != float("inf") else float("nan")
                                                for _, v in r["ttft"]], color=c, label=r["policy"])
        ax[1].plot([t for t, _ in r["tpot"]], [v if v is not None and v != float("inf") else float("nan")
                                                for _, v in r["tpot"]], color=c, label=r["policy"])
        ax[2].step([t for t, _ in r["replicas"]], [v for _, v in r["replicas"]], where="post", color=c,
                   label=r["policy"])
        ax[3].step([t for t, _ in r["nodes"]], [v or 0 for _, v in r["nodes"]], where="post", color=c,
                   label=r["policy"])
    ax[0].axhline(slo_ttft, color="k", linestyle="--", label="SLO")
    ax[0].set_yscale("log")
    ax[0].set_ylabel(f"TTFT p95 s ({WINDOW_S:g} s window)")
    ax[1].axhline(slo_tpot, color="k", linestyle="--", label="SLO")
    ax[1].set_yscale("log")
    ax[1].set_ylabel("TPOT p95 s")
    ax[2].set_ylabel("running replicas")
    ax[3].set_ylabel("worker nodes")
    ax[3].set_xlabel("seconds since the replay started")
    for a in ax:
        a.axvspan(STEP_START_S, STEP_END_S, color="grey", alpha=0.12)
        a.grid(alpha=0.3)
        a.legend(loc="upper right", fontsize=8)
    fig.suptitle("Load step 0.4 -> 3 -> 0.4 req/s (grey: 3 req/s): rayscale vs Ray Serve autoscaling")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def machine() -> str:
    import ray

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    return (f"{platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB, {platform.system()} "
            f"{platform.release()}; Python {platform.python_version()}, Ray {ray.__version__}; rayscale git "
            f"{git_state()}; {time.strftime('%Y-%m-%d %H:%M %Z')}")


def _run_details(r: dict[str, Any], d: dict[str, Any]) -> str:
    """What one run did: Serve's effective autoscaling config and the node events, or the controller's actions;
    and the kinds of errors its requests met."""
    extra = ""
    if "autoscaling_config" in d:
        ac = d["autoscaling_config"]
        keys = ("min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s",
                "downscale_delay_s", "metrics_interval_s", "look_back_period_s", "upscaling_factor",
                "downscaling_factor")
        extra = ("effective autoscaling_config: " + ", ".join(f"{k}={ac.get(k)}" for k in keys if k in ac) +
                 f"; max_ongoing_requests {d.get('max_ongoing_requests') or '5 (default)'}; node events: " +
                 ", ".join(f"{e['event']} {e['node'][-3:]} at {e['t'] - d['t0']:.0f} s"
                           for e in d.get("node_events", [])))
    if "decisions" in d:
        extra = "controller actions: " + "; ".join(
            f"{dd['t'] - d['t0']:.0f} s " + ", ".join(
                f"{a['type']}" + (f"({a.get('replicas', a.get('name', ''))})") for a in dd["actions"])
            for dd in d["decisions"] if -60 < dd["t"] - d["t0"] <= HORIZON_S)
    if r["error_kinds"]:
        extra += f"; errors: {r['error_kinds']}"
    return extra


def report(rows: list[dict[str, Any]], raw: dict[str, dict[str, Any]], slo_ttft: float, slo_tpot: float,
           cmd: str, png: Path) -> str:
    tr = step_trace()
    st = tr.stats()
    table = md_table(
        ["policy", "recovery s (TTFT)", "recovery s (TTFT+TPOT)", "TTFT p95 in step s", "max 10s TTFT p95 s",
         "TPOT p95 in step s", "failed", f"node-s (0-{HORIZON_S:.0f} s)", f"nodes at {HORIZON_S:.0f} s", "peak replicas",
         "2nd replica at s", "3rd replica at s"],
        [[r["policy"], fmt(r["recovery_ttft_s"], ".0f", "not recovered"),
          fmt(r["recovery_slo_s"], ".0f", "not recovered"), fmt(r["ttft_p95_step_s"], ".2f"),
          fmt(r["max_window_ttft_p95_s"], ".2f"), fmt(r["tpot_p95_step_s"], ".3f"),
          f"{r['failed']}/{r['requests']}", f"{r['node_seconds']:.0f}", fmt(r["nodes_at_horizon"], "d"),
          r["peak_replicas"], fmt(r["first_scale_up_s"], ".0f"), fmt(r["full_scale_s"], ".0f")]
         for r in rows],
    )
    lines = [
        "# Load step: rayscale's controller vs Ray Serve's built-in autoscaling (issue 5)\n",
        f"Command: `{cmd}`\n",
        f"Machine: {machine()}\n",
        f"Trace (seeded, identical for every policy): {st.requests} requests; 0.4 req/s for "
        f"{STEP_START_S:.0f} s, 3 req/s from {STEP_START_S:.0f} to {STEP_END_S:.0f} s, 0.4 req/s to "
        f"{LOAD_END_S:.0f} s; prompts ~100 tokens (log-normal, 50-200), 32 output tokens, streamed, open loop, "
        f"request timeout {REQUEST_TIMEOUT_S:.0f} s. Model: emulated Mistral-7B, local stand-in profile "
        f"(`rayscale.autoscale_demo.local_stand_in_catalog`: ITL = 0.05 + 0.01 x running s, so one replica serves "
        f"~1.5 req/s within the TPOT SLO and at most ~3.1 req/s at any latency); SLO TTFT p95 {slo_ttft:g} s, "
        f"TPOT p95 {slo_tpot:g} s. One replica per `a10g` stand-in node (GPU 1, accelerator_type:A10G 1), at most "
        f"{MAX_WORKERS} worker nodes, launch delay {LAUNCH_DELAY_S:g} s before a node process starts. Every run "
        f"starts with 1 node and 1 running replica.\n",
        "## Results\n",
        table + "\n",
        f"![windowed TTFT/TPOT p95, replicas and nodes over time]({png.name})\n",
        f"Definitions: t = 0 is the replay start; the step is t = {STEP_START_S:.0f}-{STEP_END_S:.0f} s. Windowed p95 = p95 over the requests "
        f"*sent* in (t - {WINDOW_S:g} s, t], evaluated every second; a failed request counts as an SLO miss. "
        "Recovery = seconds from the step start until the windowed p95 is under the SLO and stays under it until "
        f"the step ends (0: never over it; \"not recovered\": still over it at t = {STEP_END_S:.0f} s). \"TTFT+TPOT\" "
        "requires both p95s under their SLOs. Node-seconds: worker nodes sampled every second from t = 0 to "
        f"t = {HORIZON_S:.0f} s (60 s after the load ends), counted from the node process start (after the launch "
        "delay) to its stop; the head is not counted. 2nd/3rd replica: seconds after the step start when Serve "
        "first reports 2/3 RUNNING replicas.\n",
    ]
    lines += ["## What differs structurally between the runs\n", STRUCTURAL + "\n"]
    lines += [f"- **{r['policy']}**: {_run_details(r, raw[r['policy']])}\n" for r in rows]
    lines += ["## Timeline (every 10 s)\n", timeline(rows) + "\n"]
    return "\n".join(lines)


def timeline(rows: list[dict[str, Any]]) -> str:
    def at(series: list[tuple[float, Any]], t: float) -> Any:
        best = None
        for ts, v in series:
            if ts <= t + 0.5:
                best = v
        return best

    hdr = ["t s"]
    for r in rows:
        hdr += [f"{r['policy']} TTFT p95", "TPOT p95", "replicas", "nodes"]
    body = []
    for t in range(10, int(HORIZON_S) + 1, 10):
        row: list[Any] = [t]
        for r in rows:
            tt, tp = at(r["ttft"], t), at(r["tpot"], t)
            row += ["inf" if tt == float("inf") else fmt(tt, ".2f"), "inf" if tp == float("inf") else fmt(tp, ".3f"),
                    fmt(at(r["replicas"], t), "d"), fmt(at(r["nodes"], t), "d")]
        body.append(row)
    return md_table(hdr, body)


STRUCTURAL = """\
- **Who scales.** rayscale: the controller (period 2 s) reads the engines' Prometheus metrics, plans with
  the catalog profile and sets `num_replicas` through Serve's external scaler API, and it starts and stops
  nodes itself (LocalActuator), whole nodes first, then replicas; it drains replicas before releasing nodes.
  Stock: Serve's controller scales replicas from ongoing requests (target 2 per replica, 30 s upscale delay,
  600 s downscale delay); pending replica actors are resource demand that Ray's autoscaler (v1 monitor,
  update interval 5 s, Ray's default) turns into nodes; idle nodes go after `idle_timeout_minutes` = 5.
- **Planner settings.** rayscale runs with the demo's settings (`PlannerSettings(downscale_delay_s=10,
  min_dwell_s=5)` as in `rayscale.autoscale_demo.run`), not with a 600 s downscale delay; that, not only the
  faster scale-up, is why it gives nodes back inside the horizon.
- **Queueing point.** rayscale's deployment has max_ongoing_requests 256 per replica, so requests go
  straight into the engine: overload shows as a longer batch (TPOT), not as queueing (TTFT). Stock with
  Ray's default max_ongoing_requests 5 queues excess requests in the ingress's handle, so overload shows as
  TTFT. `stock-mor256` uses 256 like rayscale, so that only the policy differs; compare it on the
  TTFT+TPOT recovery.
- **Node start.** rayscale's local nodes are `ray start --block` processes (a Python CLI start, then the
  raylet); the fake provider starts a raylet from inside the autoscaler's process (no CLI start), so a stock
  node registers a little sooner after the same 3 s launch delay. Both providers share the machine's 2 cores
  with the head, the load generator and the emulated replicas.
- **Horizon.** Node-seconds stop at t = 270 s (60 s after the load ends) for both. Stock would hold its
  nodes for the rest of the 600 s downscale delay plus the 5 min idle timeout (~15 more minutes of up to 3
  nodes) beyond the horizon; the horizon hides that cost. It also hides nothing for rayscale if it is back
  at 1 node by then (see "nodes at 270 s").
- **Replica start.** The emulated server imports Ray Serve LLM's request models (vLLM and torch) in its
  constructor, so a replica is RUNNING only once it answers at full speed; on this machine that takes
  10-30 s after `num_replicas` is raised, for both policies. A warm-up of 9 requests before t = 0 makes
  the first replica warm. rayscale sizes the model with its declared `request_mix` (~100-token prompts,
  32 out, `local_stand_in_catalog`) until requests finish, so the warm-up no longer orders nodes for the
  generic 1,024/128-token mix; the controller's decision records are in the raw JSON (`records`).
- **Ray's AutoscalingCluster.** `ray.cluster_utils.AutoscalingCluster` cannot be used as is: in the Ray 2.60
  wheel `ray/autoscaler/_private/fake_multi_node/example.yaml` is missing (FileNotFoundError), and its
  start/shutdown run `ray stop --force`, which kills every Ray process on the machine. The bench starts the
  same thing itself (`RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...`, the example config
  inline) with a subclass of the fake provider (`bench/fake_provider.py`) that adds the launch delay."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/controller_vs_serve.md")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, from {', '.join(POLICIES)}")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--raw-dir", help="each run's raw JSON goes here (default: /tmp/controller_vs_serve.raw)")
    ap.add_argument("--from-raw", action="store_true", help="only re-render the report from the raw JSON")
    ap.add_argument("--smoke", action="store_true", help="a 60 s step instead (checks the set-up, no results)")
    args = ap.parse_args()
    if args.smoke:
        global STEP_START_S, STEP_END_S, LOAD_END_S, HORIZON_S
        STEP_START_S, STEP_END_S, LOAD_END_S, HORIZON_S = 10.0, 40.0, 50.0, 60.0
    if args.child:
        child(args.child, Path(args.child_out))
        return
    out = Path(args.out)
    raw_dir = Path(args.raw_dir) if args.raw_dir else Path(tempfile.gettempdir()) / "controller_vs_serve.raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    policies = [p for p in args.policies.split(",") if p]
    cmd = ".venv/bin/python -m bench.controller_vs_serve " + " ".join(
        a for a in sys.argv[1:] if a != "--from-raw")
    raw: dict[str, dict[str, Any]] = {}
    for p in policies:
        path = raw_dir / f"{p}.json"
        if not args.from_raw:
            log(f"run {p} (at most {RUN_TIMEOUT_S} s)")
            path.unlink(missing_ok=True)
            proc = subprocess.Popen([sys.executable, "-m", "bench.controller_vs_serve", "--child", p,
                                     "--child-out", str(path), *(["--smoke"] if args.smoke else [])],
                                    cwd=ROOT, start_new_session=True)
            try:
                rc = proc.wait(RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log(f"{p}: over {RUN_TIMEOUT_S} s, stopping it")
                os.killpg(proc.pid, signal.SIGTERM)
                rc = proc.wait(60)
            log(f"{p}: exit {rc}")
        if path.exists():
            raw[p] = json.loads(path.read_text())
    cat = catalog()
    slo = cat.models[MODEL].slo
    rows = [analyse(raw[p], slo.ttft_p95_s, slo.tpot_p95_s) for p in policies if p in raw]
    png = out.with_suffix(".png")
    if rows:
        plot(rows, slo.ttft_p95_s, slo.tpot_p95_s, png)
    text = report(rows, raw, slo.ttft_p95_s, slo.tpot_p95_s, cmd, png)
    missing = [p for p in policies if p not in raw]
    if missing:
        text += f"\n**Runs that produced no result: {', '.join(missing)}** (see the log).\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
