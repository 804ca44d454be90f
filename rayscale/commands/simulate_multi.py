"""`rayscale simulate --model-traces`: several models together, each with its own trace (rayscale.sim.multi)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rayscale.core.catalog import Catalog
    from rayscale.sim.trace import Trace


def parse_model_traces(value: str, models: list[str]) -> dict[str, str]:
    """MODEL=TRACE,... (a trace spec may hold commas itself: a new entry starts only where a catalog model's
    name and '=' follow a comma), or a YAML file mapping model -> trace spec."""
    if value.endswith((".yaml", ".yml")) and os.path.isfile(value):
        return _from_yaml(value)
    out: dict[str, str] = {}
    current: str | None = None
    for part in value.split(","):
        name, eq, rest = part.partition("=")
        if eq and name.strip() in models:
            current = name.strip()
            if current in out:
                raise ValueError(f"--model-traces: model {current} named twice")
            out[current] = rest
        elif current is None:
            raise ValueError(f"--model-traces: expected MODEL=TRACE,... with MODEL one of {models}, got {part!r}")
        else:
            out[current] += "," + part
    empty = [m for m, t in out.items() if not t.strip()]
    if empty:
        raise ValueError(f"--model-traces: no trace for {empty}")
    return out


def _from_yaml(path: str) -> dict[str, str]:
    import yaml

    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    if not isinstance(data, dict) or not data or not all(isinstance(v, str) for v in data.values()):
        raise ValueError(f"{path}: expected a mapping of model name -> trace spec (file or gen:...)")
    return {str(k): v for k, v in data.items()}


def _load(args: argparse.Namespace, cat: Catalog, specs: dict[str, str]) -> tuple[dict[str, Trace], dict[str, float]]:
    """Each model's trace, and with --warmup draw when its scoring starts (after its own warm-up draw)."""
    from rayscale.sim.sources import load_spec, with_warmup_draw

    traces, warmups = {}, {}
    for m, spec in specs.items():
        if m not in cat.models:
            raise ValueError(f"--model-traces: unknown model {m!r} (after --flavor); allowed: {sorted(cat.models)}")
        if args.warmup == "draw":
            traces[m], warmups[m] = with_warmup_draw(spec, args.seed, args.time_scale, args.rate_scale)
        else:
            traces[m] = load_spec(spec, args.seed, args.time_scale, args.rate_scale, args.repeat, args.resample)
    return traces, warmups


def _checks(args: argparse.Namespace) -> None:
    if args.only_models:
        raise ValueError("--model and --model-traces: --model-traces names the models")
    if args.plot:
        raise ValueError("--plot draws one model's run; not with --model-traces")
    if args.warmup == "pass":
        raise ValueError("--warmup pass: one model's (--trace); with --model-traces give seconds or 'draw'")


def run_multi(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from rayscale.commands.settings_args import settings_from_args
    from rayscale.commands.simulate import _warmup, policy_names, request_mix_arg
    from rayscale.config import load_catalog
    from rayscale.core.catalog import CatalogError
    from rayscale.sim.baselines import on_demand_only
    from rayscale.sim.engine import EngineConfig
    from rayscale.sim.multi import MULTI_POLICIES, MultiConfig, check_models, render_multi, simulate_models
    from rayscale.sim.policies import ALIASES, StockConfig
    from rayscale.sim.simulator import SimConfig
    from rayscale.sim.sources import TraceSpecError
    from rayscale.sim.trace import TraceFormatError

    names = policy_names(args.policy, MULTI_POLICIES, ALIASES)
    try:
        _checks(args)
        settings = settings_from_args(args)
        cat = load_catalog(args.models, args.flavors, args.profiles)
        if args.only_flavors:
            cat = cat.subset(None, args.only_flavors)
        traces, warmups = _load(args, cat, parse_model_traces(args.model_traces, sorted(cat.models)))
        if args.request_mix is not None:
            for m, tr in traces.items():
                cat = cat.with_request_mix(m, request_mix_arg(args.request_mix, tr))
        if args.on_demand_only:
            cat = on_demand_only(cat)
        for name in names:
            check_models(cat, traces, name)
        engine = EngineConfig(prefill_contention=args.prefill_contention, model=args.engine, routing=args.routing)
        if args.tick is not None:
            engine = replace(engine, tick_s=args.tick)
        warm = 0.0 if args.warmup == "draw" else _warmup(args.warmup, None, 1)
        sim = SimConfig(seed=args.seed, settings=settings, engine=engine, warmup_s=warm, same_start=args.same_start)
        cfg = MultiConfig(sim, StockConfig(target_ongoing_requests=args.stock_target), warmups)
    except (CatalogError, TraceSpecError, TraceFormatError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = []
    for name in names:
        try:
            results.append(simulate_models(cat, traces, name, cfg))
        except ValueError as e:
            print(f"error: policy {name}: {e}", file=sys.stderr)
            return 2
    if args.json:
        for res in results:
            for d in res.summaries():
                print(json.dumps(_finite(d)))
    else:
        print(render_multi(results))
    return 0


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
