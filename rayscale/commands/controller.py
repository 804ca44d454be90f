"""`rayscale controller`: the reconcile loop as a plain process, on the local cluster."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rayscale.commands.plan import add_catalog_args


def register(sub: Any) -> None:
    p = sub.add_parser("controller", help="run the reconcile loop (local cluster actuator)",
                       description="Observe, estimate, plan and act every period; one JSON decision record "
                                   "per period.")
    add_catalog_args(p)
    p.add_argument("--root", default=None, help="local cluster root dir (default: the one `rayscale up` made)")
    p.add_argument("--period", type=float, default=5.0, help="seconds between reconciles (default 5)")
    p.add_argument("--decision-log", default="rayscale-decisions.jsonl", help="JSON lines, one per period")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--launch-delay", type=float, default=5.0, help="seconds a local node takes to 'launch'")
    p.add_argument("--max-nodes", type=int, default=3, help="worker nodes this machine may run")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    import ray

    from rayscale.cluster.local import DEFAULT_ROOT, LocalCluster
    from rayscale.cluster.local_actuator import LocalActuator, LocalActuatorConfig
    from rayscale.config import load_catalog
    from rayscale.controller.loop import Controller, ControllerConfig
    from rayscale.controller.serve_client import ServeClient
    from rayscale.core.catalog import CatalogError
    from rayscale.signals.scrape import MetricsScraper

    try:
        cat = load_catalog(args.models, args.flavors, args.profiles)
        if args.only_models or args.only_flavors:
            cat = cat.subset(args.only_models, args.only_flavors)
    except CatalogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cluster = LocalCluster.attach(args.root or DEFAULT_ROOT)
    ray.init(address=cluster.address, logging_level=logging.ERROR)
    actuator = LocalActuator(cluster, LocalActuatorConfig(default_launch_delay_s=args.launch_delay,
                                                           max_worker_nodes=args.max_nodes))
    if not cluster.dashboard_url:
        print("error: the local cluster runs without a dashboard; start it with the dashboard on", file=sys.stderr)
        return 2
    ctl = Controller(cat, actuator, ServeClient(cluster.dashboard_url), MetricsScraper(),
                     ControllerConfig(period_s=args.period, decision_log=Path(args.decision_log)))
    ctl.on_record(lambda r: print(f"[{r.t:.0f}] ${r.plan.get('usd_per_h', 0):.2f}/h actions="
                                  f"{[a['type'] + ':' + str(a.get('name') or a.get('replicas')) for a in r.actions]}"
                                  f"{' errors=' + str(r.errors) if r.errors else ''}", flush=True))
    try:
        ctl.run(args.duration)
    except KeyboardInterrupt:
        pass
    finally:
        actuator.close()
    return 0
