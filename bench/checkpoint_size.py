"""The controller's checkpoint at 1, 100 and 1,000 models: bytes of JSON, gzipped, and the ConfigMaps it fills.

    .venv/bin/python -m bench.checkpoint_size [--out bench/results/checkpoint_size.md]

bench.planner's synthetic catalogs (20 flavors, 0.5-40 req/s a model). The state is the shipped step's after
it planned for those rates, with what two hours of traffic leave in it filled in: a full rate history
(Settings.history_len windows of Poisson arrivals at each model's rate), an hour of arrivals per control
period (the burst floor's, as the controller rounds them), an SLO feedback record per model and a latency
correction per (model, flavor) the plan runs. Encoded by rayscale.core.checkpoint.dumps, then gzipped and
split as rayscale.cluster.kube.checkpoint.ConfigMapStore writes it: a ConfigMap holds at most 1 MiB of values
(Kubernetes' ValidateConfigMap), so the store puts 1 MB of gzip in each, in up to 8.
"""

from __future__ import annotations

import argparse
import gzip
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench.common import machine
from bench.planner import synthetic
from rayscale.cluster.render import MAX_STATE_SHARDS
from rayscale.core.checkpoint import Checkpoint, dumps
from rayscale.core.estimate import Correction
from rayscale.core.feedback import Delivered
from rayscale.core.settings import Settings
from rayscale.core.step import ServeView, StepContext, StepState, step
from rayscale.tables import format_table


def two_hours_in(n_models: int, seed: int = 0) -> Checkpoint:
    """The checkpoint of a controller of ``n_models`` after two hours of Poisson traffic at their rates."""
    cat, sig = synthetic(n_models, seed=seed)
    cfg = Settings()
    state = step(StepContext(0.0, cat, sig, (), ServeView({}, {}), cfg, StepState())).state
    rng = np.random.default_rng(seed)
    now = 7200.0
    history, arrivals, delivered, corrections = {}, {}, {}, {}
    for name, s in sig.items():
        rate = float(s.arrival_rate_rps or 0.0)
        windows = rng.poisson(rate * cfg.history_window_s, cfg.history_len) / cfg.history_window_s
        history[name] = tuple(float(x) for x in windows)
        periods = round(cfg.burst_history_s / cfg.period_s)
        arrivals[name] = tuple(round(float(c), 3) for c in rng.poisson(rate * cfg.period_s, periods))
        delivered[name] = Delivered(rate, rate * rng.uniform(0.98, 1.0), 1e5, now - rng.uniform(0, 5),
                                    float(rng.uniform(0.8, 1.1)), since_s=0.0)
    for e in step(StepContext(5.0, cat, sig, (), ServeView({}, {}), cfg, state)).plan.entries:
        if e.replicas:
            corrections[(e.model, e.flavor)] = Correction(float(rng.uniform(0.8, 1.3)), float(rng.uniform(0.8, 1.3)),
                                                          float(rng.uniform(0.02, 0.1)))
    state = replace(state, rate_history=history, delivered=delivered, corrections=corrections,
                    next_history_s=now + cfg.history_window_s)
    return Checkpoint(now, state, arrivals)


def through_configmaps(text: str) -> tuple[int, float, float]:
    """(ConfigMaps filled, ms to write, ms to read back) through ConfigMapStore, the official client and
    the API server emulator (which holds each ConfigMap to Kubernetes' 1 MiB)."""
    from kubernetes import client
    from rayscale_testing.kubeapi import KubeAPIServer

    from rayscale.cluster.kube.checkpoint import SHARDS, ConfigMapStore

    server = KubeAPIServer().start()
    api = server.api_client()
    try:
        core = client.CoreV1Api(api)
        store = ConfigMapStore(core, "default")
        t = time.perf_counter()
        store.write(text)
        write_ms = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        back = ConfigMapStore(core, "default").read()
        read_ms = (time.perf_counter() - t) * 1000
        assert back == text, "the checkpoint read back differs from the one written"
        data = core.read_namespaced_config_map(store.name, "default").data or {}
        return int(data[SHARDS]), write_ms, read_ms
    finally:
        api.close()
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="1,100,1000")
    ap.add_argument("--out", default="bench/results/checkpoint_size.md")
    args = ap.parse_args()
    rows = []
    for n in [int(x) for x in args.models.split(",")]:
        cp = two_hours_in(n)
        t = time.perf_counter()
        text = dumps(cp)
        encode_s = time.perf_counter() - t
        packed = len(gzip.compress(text.encode(), compresslevel=1, mtime=0))
        maps, write_ms, read_ms = through_configmaps(text)
        rows.append([n, f"{len(text):,}", f"{packed:,}", f"{maps} of {MAX_STATE_SHARDS}", f"{encode_s * 1000:.0f}",
                     f"{write_ms:.0f}", f"{read_ms:.0f}"])
        print(f"{n} models: {len(text):,} bytes JSON, {packed:,} gzipped, {maps} ConfigMap(s)", flush=True)
    table = format_table(["models", "JSON bytes", "gzipped bytes", "ConfigMaps", "encode ms", "write ms",
                          "read ms"], rows)
    Path(args.out).write_text(
        "# The controller's checkpoint by number of models\n\n"
        f"Command: `.venv/bin/python -m bench.checkpoint_size --models {args.models}`\n\n{machine()}\n\n"
        + (__doc__ or "").split("\n\n", 2)[2] + "\n"
        "encode: rayscale.core.checkpoint.dumps; write and read: ConfigMapStore over the official client to the "
        "API server emulator (rayscale_testing.kubeapi, on this machine), read back and compared.\n\n"
        f"```\n{table}\n```\n")
    print(table)


if __name__ == "__main__":
    main()
