"""`rayscale serve CONFIG`: validate a serve config and deploy it on Ray Serve (like `serve run`)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve models from a Ray Serve config (deployments/*.yaml)",
        description="Validate CONFIG (Ray Serve's schema and rayscale's), then deploy it and block.",
    )
    p.add_argument("config", help="serve config YAML, e.g. deployments/local-tiny.yaml")
    p.add_argument("--address", default=None, help="Ray cluster address; default: start a local one")
    p.add_argument("--check", action="store_true", help="only validate the config and print its deployments")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for RUNNING (default 600)")
    p.add_argument(
        "--no-block",
        action="store_true",
        help="return once RUNNING (use with --address: a cluster started here stops when this exits)",
    )
    p.set_defaults(handler=run)


def _summary(loaded: Any) -> list[str]:
    from rayscale.serve.config import deployment_name

    lines = []
    for app_name, cfg in loaded.apps.items():
        for m in cfg.models:
            for f in m.flavors:
                lines.append(
                    f"{app_name}/{deployment_name(m.name, f.flavor)}: engine={m.engine} "
                    f"replicas={f.num_replicas} weight={f.weight} bundles={f.bundles()}"
                )
    return lines


def run(args: argparse.Namespace) -> int:
    from rayscale.serve.config import ConfigError, load_serve_config

    try:
        loaded = load_serve_config(args.config)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    for line in _summary(loaded):
        print(line)
    if args.check:
        return 0

    import ray
    from ray import serve

    # No public API deploys a whole ServeDeploySchema in-process (`serve run` uses this private client too).
    from ray.serve._private import api as serve_api
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ApplicationStatus

    if args.address:
        ray.init(address=args.address)
    else:
        # Loopback that Ray does not rewrite to the machine address.
        ray.init(_node_ip_address="127.0.0.2")
    schema = loaded.serve
    client = serve_api.serve_start(
        http_options=schema.http_options.model_dump(),
        proxy_location=schema.proxy_location,
        grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
        controller_options=schema.controller_options,
    )
    client.deploy_apps(schema, _blocking=False)
    names = [a.name for a in schema.applications]
    deadline = time.monotonic() + args.timeout
    while True:
        st = serve.status().applications
        states = {n: (st[n].status if n in st else None) for n in names}
        failed = [n for n, s in states.items() if s == ApplicationStatus.DEPLOY_FAILED]
        if failed:
            for n in failed:
                print(f"{n}: DEPLOY_FAILED: {st[n].message}", file=sys.stderr)
            return 1
        if all(s == ApplicationStatus.RUNNING for s in states.values()):
            break
        if time.monotonic() > deadline:
            print(f"not RUNNING after {args.timeout}s: {states}", file=sys.stderr)
            return 1
        time.sleep(2)
    http = schema.http_options
    print(f"serving: http://{http.host}:{http.port}/v1 (OpenAI API)")
    if args.no_block:
        return 0
    try:
        while True:
            time.sleep(10)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0
