"""`rayscale local`: a Ray cluster of flavor nodes on this machine (up, down, node add/remove/list)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

DEFAULT_ROOT = "/tmp/rayscale-local"  # = rayscale.cluster.local.DEFAULT_ROOT, without importing it here


def register(sub: Any) -> None:
    p = sub.add_parser(
        "local",
        help="run a Ray cluster of flavor nodes on this machine",
        description="A local Ray cluster whose nodes stand in for cloud nodes of accelerator flavors.",
    )
    p.set_defaults(handler=lambda _args: (p.print_help(), 2)[1])
    lsub = p.add_subparsers(dest="local_command", metavar="SUBCOMMAND")

    def root(q: argparse.ArgumentParser) -> None:
        q.add_argument("--root", default=DEFAULT_ROOT, help=f"cluster state and temp dir (default {DEFAULT_ROOT})")

    up = lsub.add_parser("up", help="start the head node (and optional worker nodes)")
    root(up)
    up.add_argument("--head-cpus", type=float, default=1.0, help="CPUs the head declares (default 1)")
    up.add_argument("--no-dashboard", action="store_true", help="do not start the Ray dashboard")
    up.add_argument("--node", action="append", default=[], metavar="FLAVOR", help="also add a node (repeatable)")
    up.set_defaults(handler=run_up)

    down = lsub.add_parser("down", help="stop every node and remove the cluster's files")
    root(down)
    down.set_defaults(handler=run_down)

    node = lsub.add_parser("node", help="add, remove or list nodes")
    node.set_defaults(handler=lambda _args: (node.print_help(), 2)[1])
    nsub = node.add_subparsers(dest="node_command", metavar="ACTION")
    add = nsub.add_parser("add", help="start a worker node of a flavor")
    root(add)
    add.add_argument("--flavor", required=True, help="a10g, l4, l40s, a100, h100, inf2, trn1, cpu, or a new name")
    add.add_argument("--gpus", type=float, help="GPUs to declare (default: the flavor's)")
    add.add_argument("--cpus", type=float, help="CPUs to declare (default: the flavor's)")
    add.add_argument("--resources", default="{}", help='extra custom resources as JSON, e.g. \'{"neuron_cores": 2}\'')
    add.add_argument("--labels", default="", help="extra node labels, k=v,k2=v2")
    add.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the node (default 120)")
    add.set_defaults(handler=run_node_add)
    rm = nsub.add_parser("remove", help="drain a node, then stop it")
    root(rm)
    rm.add_argument("id", help="node id as `node list` shows it, e.g. a10g-1")
    rm.add_argument("--grace", type=float, help="seconds to wait for the drain (default 30)")
    rm.set_defaults(handler=run_node_remove)
    ls = nsub.add_parser("list", help="list the nodes and their state in Ray")
    root(ls)
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(handler=run_node_list)
    rec = nsub.add_parser("recover", help="settle node starts a killed process left half-done (adopt or remove)")
    root(rec)
    rec.set_defaults(handler=run_node_recover)


def _err(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 1


def parse_labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, sep, v = part.partition("=")
        if not sep or not k:
            raise ValueError(f"label {part!r} is not key=value")
        out[k.strip()] = v.strip()
    return out


def parse_resources(text: str) -> dict[str, float]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--resources is not JSON: {e.msg}") from None
    if not isinstance(data, dict) or not all(isinstance(v, int | float) and v >= 0 for v in data.values()):
        raise ValueError('--resources must be a JSON object of non-negative numbers, e.g. {"neuron_cores": 2}')
    return {str(k): float(v) for k, v in data.items()}


def run_up(args: argparse.Namespace) -> int:
    from rayscale.cluster.local import LocalCluster, LocalClusterConfig, LocalClusterError

    cfg = LocalClusterConfig(root_dir=args.root, head_num_cpus=args.head_cpus, include_dashboard=not args.no_dashboard)
    cluster = LocalCluster(cfg)
    try:
        cluster.start()
        for flavor in args.node:
            print(f"added {cluster.add_node(flavor)}")
    except (LocalClusterError, ValueError) as e:
        return _err(str(e))
    except KeyboardInterrupt:
        cluster.stop()
        return 130
    print(f"Ray address: {cluster.address}")
    if cluster.dashboard_url:
        print(f"dashboard:   {cluster.dashboard_url}")
    print(f"state:       {cfg.root_dir}/cluster.json  (stop with `rayscale local down --root {cfg.root_dir}`)")
    return 0


def run_down(args: argparse.Namespace) -> int:
    from rayscale.cluster.local import LocalCluster, LocalClusterError

    try:
        LocalCluster.attach(args.root).stop()
    except LocalClusterError as e:
        return _err(str(e))
    print(f"stopped the local cluster under {args.root}")
    return 0


def run_node_add(args: argparse.Namespace) -> int:
    from rayscale.cluster.local import LocalCluster, LocalClusterError

    try:
        resources = parse_resources(args.resources)
        labels = parse_labels(args.labels)
        cluster = LocalCluster.attach(args.root)
        node_id = cluster.add_node(
            args.flavor, resources=resources, labels=labels, num_cpus=args.cpus, num_gpus=args.gpus,
            timeout_s=args.timeout,
        )
    except (LocalClusterError, ValueError) as e:
        return _err(str(e))
    print(node_id)
    return 0


def run_node_remove(args: argparse.Namespace) -> int:
    from rayscale.cluster.local import LocalCluster, LocalClusterError

    try:
        LocalCluster.attach(args.root).remove_node(args.id, grace_s=args.grace)
    except LocalClusterError as e:
        return _err(str(e))
    print(f"removed {args.id}")
    return 0


def run_node_recover(args: argparse.Namespace) -> int:
    from rayscale.cluster.local import LocalCluster, LocalClusterError

    try:
        notes = LocalCluster.attach(args.root).recover()
    except LocalClusterError as e:
        return _err(str(e))
    print("\n".join(notes) or "nothing to recover")
    return 0


def run_node_list(args: argparse.Namespace) -> int:
    from rayscale.cluster.local import LocalCluster, LocalClusterError
    from rayscale.tables import format_table

    try:
        nodes = LocalCluster.attach(args.root).nodes(include_dead=True)
    except LocalClusterError as e:
        return _err(str(e))
    if args.json:
        print(json.dumps([n.__dict__ for n in nodes], indent=2))
        return 0
    skip = ("CPU", "GPU", "memory", "object_store_memory")
    rows = [
        [
            n.id,
            n.flavor,
            n.state,
            (n.ray_node_id or "-")[:12],
            f"{n.num_cpus:g}",
            f"{n.num_gpus:g}",
            ",".join(f"{k}={v:g}" for k, v in sorted(n.resources.items()) if k not in skip and not k.startswith("node:"))
            or "-",
            n.pid,
        ]
        for n in nodes
    ]
    print(format_table(["id", "flavor", "state", "ray node", "cpus", "gpus", "resources", "pid"], rows))
    return 0
