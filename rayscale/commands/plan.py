"""`rayscale plan`: what the core would decide for a load snapshot, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


class _CatalogDir(argparse.Action):
    """--catalog DIR: DIR/models.yaml, flavors.yaml and profiles.yaml, unless a file flag names its own."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, value: Any,
                 option: str | None = None) -> None:
        from pathlib import Path

        d = Path(value)
        if not d.is_dir():
            parser.error(f"--catalog {value}: not a directory (it holds models.yaml, flavors.yaml, profiles.yaml)")
        for k in ("models", "flavors", "profiles"):
            if getattr(ns, k, None) is None:
                setattr(ns, k, str(d / f"{k}.yaml"))


def add_catalog_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--catalog", metavar="DIR", action=_CatalogDir,
                   help="a folder with models.yaml, flavors.yaml and profiles.yaml (e.g. deployments/local-emulated)")
    p.add_argument("--models", help="models YAML (default: the shipped catalog)")
    p.add_argument("--flavors", help="flavors YAML (default: the shipped catalog)")
    p.add_argument("--profiles", help="profiles YAML (default: the shipped catalog)")
    p.add_argument("--model", dest="only_models", action="append", help="restrict to this model (repeatable)")
    p.add_argument("--flavor", dest="only_flavors", action="append", help="restrict to this flavor (repeatable)")


def catalog_from_args(args: argparse.Namespace) -> Any:
    """The catalog the catalog flags name, restricted by --model/--flavor; raises CatalogError."""
    from rayscale.config import load_catalog

    cat = load_catalog(args.models, args.flavors, args.profiles)
    if args.only_models or args.only_flavors:
        cat = cat.subset(args.only_models, args.only_flavors)
    return cat


def register(sub: Any) -> None:
    p = sub.add_parser("plan", help="print the plan for a load snapshot (LOAD.yaml)",
                       description="Estimate demand and plan replicas per (model, flavor) for a load snapshot.")
    add_catalog_args(p)
    p.add_argument("--load", required=True, help="LOAD.yaml: per-model rates, current replicas, back-offs")
    p.add_argument("--solver", choices=["auto", "exact", "greedy"], default="auto")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(handler=run)


def _gangs(e: Any) -> str:
    """The gangs a plan entry orders: '2x 1xg5.12xlarge', or for packed replicas how full they are:
    '1x 1xp5.48xlarge (3/8 replicas)'."""
    out = f"{e.gangs}x {e.gang.nodes}x{e.gang.instance_type}"
    if e.gang.slots > 1:
        out += f" ({e.replicas}/{e.gangs * e.gang.slots} replicas)"
    return out


def run(args: argparse.Namespace) -> int:
    from rayscale.config import load_catalog, load_loadfile
    from rayscale.core.catalog import CatalogError
    from rayscale.core.chunk import pin_chunks
    from rayscale.core.estimate import estimate
    from rayscale.core.plan import PlannerSettings, plan
    from rayscale.tables import format_table

    try:
        full = load_catalog(args.models, args.flavors, args.profiles)
        load = load_loadfile(args.load)
        unknown = sorted(set(load.models) - set(full.models))
        if unknown:
            raise CatalogError(f"{args.load}: models: unknown model(s) {unknown}; allowed: {sorted(full.models)}")
        cat = pin_chunks(catalog_from_args(args))  # capacities at the prefill chunk rayscale deploys
    except CatalogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    demands = estimate(cat, load.signals())
    result, _ = plan(cat, demands, load.current_map(), load.unavailable_map(), load.now_s,
                     settings=PlannerSettings(solver=args.solver))
    def chunk(model: str, flavor: str) -> int | None:  # vLLM max_num_batched_tokens the serve config should set
        return cat.profile(model, flavor).max_num_batched_tokens

    if args.json:
        out = result.to_dict()
        out["demand"] = {m: {"state": d.state.value, "rps": round(d.rps, 4), "reason": d.reason,
                             "best_effort": d.best_effort}
                         for m, d in demands.items()}
        out["max_num_batched_tokens"] = {m: {f: chunk(m, f) for f in spec.parallelism}
                                         for m, spec in cat.models.items()}
        print(json.dumps(out, indent=2))
        return 0
    rows = [
        [e.model, e.flavor, e.capacity_type, f"{e.current}->{e.replicas}" if e.current != e.replicas else e.replicas,
         _gangs(e), e.nodes, chunk(e.model, e.flavor),
         f"{e.usd_per_h:.2f}", e.reason]
        for e in result.entries
    ]
    print(format_table(["model", "flavor", "capacity", "replicas", "gangs", "nodes", "chunk", "$/h", "reason"],
                       rows))
    print(f"\ntotal ${result.usd_per_h:.2f}/h  solver={result.method}")
    for s in result.shortfalls:
        what = [f"{s.unmet_rps:.2f} req/s unmet"] if s.unmet_rps > 0 else []
        what += [f"{s.missing_replicas} replica(s) below min_replicas"] if s.missing_replicas else []
        # A best-effort model is served, but its requests miss the SLO: its own line, even with nothing unmet.
        label = "BEST EFFORT" if s.best_effort else "SHORTFALL"
        print(f"{label} {s.model}: " + "".join(f"{w}: " for w in [", ".join(what)] if w) + s.reason)
    for n in result.notes:
        print(f"note: {n}")
    return 0
