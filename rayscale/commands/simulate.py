"""`rayscale simulate`: replay a trace against scaling policies on the simulated cloud."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rayscale.commands.settings_args import add_settings_args, settings_from_args

if TYPE_CHECKING:
    from rayscale.core.catalog import Catalog, RequestMixSpec
    from rayscale.core.settings import Settings
    from rayscale.sim.simulator import SimConfig
    from rayscale.sim.trace import Trace

POLICY_CHOICES = ("rayscale", "stock", "static-best", "clairvoyant", "fluid-bound", "static-peak", "oracle", "all")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "simulate", help="replay a request trace against scaling policies (simulated cloud and engines)",
        description="Simulate a trace with the rayscale core against baselines an operator would run: Ray "
                    "Serve's own autoscaler configured for the model (stock), the cheapest fixed fleet that "
                    "reaches the SLO (static-best), a clairvoyant per-minute plan with real start-up "
                    "(clairvoyant) and the fluid cost integral (fluid-bound, no SLO; alias oracle); "
                    "static-peak on request. --trace takes a file (Azure CSV "
                    "or Mooncake JSONL) or gen:poisson|diurnal|bursty[:key=value,...], e.g. "
                    "gen:diurnal:base=1,peak=12,hours=24 or gen:bursty:base=2,burst=12,every_s=1800,burst_s=300,hours=4.",
    )
    from rayscale.commands.plan import add_catalog_args

    add_catalog_args(p)
    add_settings_args(p)
    p.add_argument("--trace", help="trace file, or gen:KIND[:key=value,...] (one model: --model, default mistral-7b)")
    p.add_argument("--model-traces", metavar="MODEL=TRACE,...|FILE.yaml",
                   help="several models together, each with its own trace, on one simulated cloud with shared "
                        "NodePool limits and the catalog's priorities (instead of --trace), e.g. "
                        "mistral-7b=gen:poisson:rate=3,qwen2-7b=T.csv,qwen2-72b=gen:poisson:rate=0.5 (a new "
                        "entry starts at a catalog model name followed by '='), or a YAML file mapping model -> "
                        "trace. Prints a table per policy (a row per model and a total); --json one object per "
                        "(policy, model). Policies: rayscale (one step for all models), stock and static-best "
                        "(a fleet per model; limits they overrun are named), static-peak; clairvoyant and "
                        "fluid-bound run one model at a time")
    p.add_argument("--policy", choices=POLICY_CHOICES, action="append",
                   help="repeatable; all (the default): rayscale, stock, static-best, clairvoyant, fluid-bound")
    p.add_argument("--on-demand-only", action="store_true",
                   help="every policy plans and buys on-demand capacity only (the catalog without spot)")
    p.add_argument("--spot-interruptions", type=float, default=None, metavar="PER_NODE_H",
                   help="spot interruption notices per node-hour in the simulated cloud (default 0.01; AWS's advisor "
                        "puts GPU spot under 5%% a month); spot_stress's regimes are 0.1 and 1")
    p.add_argument("--stock-target", type=float, default=None, metavar="X",
                   help="the stock policy's target_ongoing_requests (max_ongoing_requests 2x); default: 75%% of "
                        "one replica's concurrency at the SLO on its flavor. A sweep draws a cost-vs-SLO curve")
    _add_traffic_args(p)
    _add_engine_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object per policy")
    p.add_argument("--plot", metavar="PNG", help="write load, replicas, latency and cost over time")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=run)


def _add_traffic_args(p: argparse.ArgumentParser) -> None:
    """How the trace is played: scaled, repeated, resampled per seed, warmed up, from which fleet."""
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (0.5: twice as fast)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply the request rate")
    p.add_argument("--repeat", type=int, default=1, help="play the trace this many times back to back")
    p.add_argument("--resample", action="store_true",
                   help="a trace file becomes the --seed-th draw of its traffic (per 10-s bin a Poisson count around "
                        "the file's, lengths drawn from the same bin): seeds change the arrivals, as generators' do")
    p.add_argument("--warmup", default="0", metavar="S|pass|draw",
                   help="serve the first S seconds but score neither their requests nor their cost; 'draw': "
                        "steady state without hindsight (warm up on another draw of the same traffic, then score the "
                        "--seed draw); 'pass' with --repeat N >= 2: warm up on the scored arrivals themselves")
    p.add_argument("--same-start", action=argparse.BooleanOptionalAction, default=True,
                   help="every policy starts from the same fleet (what the shipped step orders for the first "
                        "signal window, on-demand, live at t=0), then moves it where it wants: from cold on equal "
                        "footing, as a bound must be (default). --no-same-start: each policy starts from its own "
                        "fleet, the hindsight baselines from the one they size for the whole trace")
    p.add_argument("--seed", type=int, default=0)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The simulated engines: tick, declared request mix, prefill contention, engine model and routing."""
    p.add_argument("--tick", type=float, default=None, help="engine tick, seconds (default 0.25)")
    p.add_argument("--request-mix", metavar="trace|PROMPT,OUTPUT[,PROMPT_P95]",
                   help="declare the model's expected request shape, as models.yaml's request_mix: it sizes the "
                        "model before requests finish and picks each flavor's prefill chunk (vLLM "
                        "max_num_batched_tokens, rayscale.core.chunk); 'trace': the trace's own mean prompt, "
                        "mean output and p95 prompt. Default: the catalog's")
    p.add_argument("--prefill-contention", action=argparse.BooleanOptionalAction, default=True,
                   help="engines share prefill throughput with decode (chunked prefill, the default); "
                        "--no-prefill-contention gives the emulated engine's independent prefill")
    p.add_argument("--engine", choices=["fluid", "iteration"], default="fluid",
                   help="engine model: fluid (per-tick fluid model, the default, fast) or iteration (vLLM's scheduler "
                        "one engine iteration at a time: what bench/fidelity.py checks against real vLLM)")
    p.add_argument("--routing", choices=["flavor-weights", "flavor-two-choices", "least-loaded"], default=None,
                   help="flavor-weights (as rayscale's ingress: a flavor drawn by its routing weight, then that "
                        "flavor's least-loaded replica; the default), flavor-two-choices (two flavors drawn by "
                        "weight, the one with fewer requests in flight per unit of weight taken; not the "
                        "ingress's) or least-loaded (one queue, each request to the least-loaded replica of any "
                        "flavor; the iteration engine's only routing)")


def run(args: argparse.Namespace) -> int:
    if (args.trace is None) == (args.model_traces is None):
        print("error: give either --trace (one model) or --model-traces (several)", file=sys.stderr)
        return 2
    if args.model_traces is not None:
        from rayscale.commands.simulate_multi import run_multi

        return run_multi(args)
    return run_single(args)


def policy_names(chosen: list[str] | None, every: Sequence[str], aliases: Mapping[str, str] | None = None) -> list[str]:
    """The policies a repeatable ``--policy`` names, in order and once each; "all" (or none given) is ``every``."""
    out: list[str] = []
    for name in chosen or ["all"]:
        for n in every if name == "all" else [(aliases or {}).get(name, name)]:
            if n not in out:
                out.append(n)
    return out


def _single_setup(args: argparse.Namespace) -> tuple[Settings, Catalog, Trace, SimConfig]:
    """The settings, catalog, trace and simulator configuration ``args`` name; CatalogError, TraceSpecError,
    TraceFormatError or ValueError naming the flag that is wrong."""
    from dataclasses import replace

    from rayscale.config import load_catalog
    from rayscale.core.catalog import CatalogError
    from rayscale.sim.baselines import on_demand_only
    from rayscale.sim.engine import EngineConfig
    from rayscale.sim.simulator import SimConfig
    from rayscale.sim.sources import load_spec, with_warmup_draw

    # --model (shared with `plan`) names the simulated model; default: the project's default model.
    model = args.only_models[0] if args.only_models else "mistral-7b"
    settings = settings_from_args(args)
    cat = load_catalog(args.models, args.flavors, args.profiles)
    if model not in cat.models:
        raise CatalogError(f"--model: unknown model {model!r}; allowed: {sorted(cat.models)}")
    if args.only_flavors:
        cat = cat.subset(None, args.only_flavors)
        if model not in cat.models:
            raise CatalogError(f"--flavor {args.only_flavors}: model {model} runs on none of them")
    if args.warmup == "draw":  # steady state warmed up on other arrivals of the same traffic
        trace, warmup = with_warmup_draw(args.trace, args.seed, args.time_scale, args.rate_scale)
    else:
        trace = load_spec(args.trace, args.seed, args.time_scale, args.rate_scale, args.repeat, args.resample)
        warmup = _warmup(args.warmup, trace, args.repeat)
    if args.request_mix is not None:
        cat = cat.with_request_mix(model, request_mix_arg(args.request_mix, trace))
    if args.on_demand_only:
        cat = on_demand_only(cat)
    engine = EngineConfig(prefill_contention=args.prefill_contention, model=args.engine, routing=args.routing)
    if args.tick is not None:
        engine = replace(engine, tick_s=args.tick)
    cfg = SimConfig(model=model, seed=args.seed, settings=settings, engine=engine, warmup_s=warmup,
                    same_start=args.same_start)
    if args.spot_interruptions is not None:
        if args.spot_interruptions < 0:
            raise ValueError(f"--spot-interruptions must be >= 0, got {args.spot_interruptions}")
        cfg = replace(cfg, cloud=replace(cfg.cloud, spot_interruptions_per_node_h=args.spot_interruptions))
    return settings, cat, trace, cfg


def run_single(args: argparse.Namespace) -> int:
    from rayscale.core.catalog import CatalogError
    from rayscale.sim.policies import POLICIES, StockConfig, make_policy
    from rayscale.sim.simulator import simulate
    from rayscale.sim.sources import TraceSpecError
    from rayscale.sim.trace import TraceFormatError

    try:
        settings, cat, trace, cfg = _single_setup(args)
        stock = StockConfig(target_ongoing_requests=args.stock_target)
    except (CatalogError, TraceSpecError, TraceFormatError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = policy_names(args.policy, POLICIES)
    results = []
    progress = not args.no_progress and sys.stderr.isatty() and len(trace) > 50_000
    for name in names:
        try:
            results.append(simulate(cat, trace, make_policy(name, settings, stock), cfg, progress=progress))
        except ValueError as e:
            print(f"error: policy {name}: {e}", file=sys.stderr)
            return 2
    if args.json:
        for r in results:
            print(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                              for k, v in r.summary().items()}))
    else:
        print(render_table(results, trace.name))
    if args.plot:
        from rayscale.sim.plots import plot_results

        plot_results(results, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def request_mix_arg(value: str, trace: Trace) -> RequestMixSpec:
    """--request-mix: 'trace' (its lengths' means and p95) or PROMPT_MEAN,OUTPUT_MEAN[,PROMPT_P95] tokens."""
    from pydantic import ValidationError

    from rayscale.core.catalog import RequestMixSpec

    if value == "trace":
        return trace.request_mix()
    parts = value.split(",")
    try:
        if len(parts) not in (2, 3):
            raise ValueError("expected 2 or 3 numbers")
        nums = [float(x) for x in parts]
        return RequestMixSpec(prompt_mean=nums[0], output_mean=nums[1], prompt_p95=nums[2] if len(nums) == 3 else None)
    except (ValueError, ValidationError) as e:
        why = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()) \
            if isinstance(e, ValidationError) else str(e)
        raise ValueError(f"--request-mix: expected 'trace' or PROMPT_MEAN,OUTPUT_MEAN[,PROMPT_P95] (tokens > 0), "
                         f"got {value!r}: {why}") from None


def _warmup(value: str, trace: Any, repeat: int) -> float:
    if value == "pass":
        if repeat < 2:
            raise ValueError("--warmup pass needs --repeat 2 or more (the first pass is the warm-up)")
        return float(trace.arrival_s[len(trace) // repeat])  # the second pass's first arrival
    try:
        s = float(value)
    except ValueError:
        raise ValueError(f"--warmup: expected seconds or 'pass', got {value!r}") from None
    if not s >= 0:
        raise ValueError(f"--warmup must be >= 0 seconds, got {value}")
    return s


def render_table(results: list[Any], trace_name: str) -> str:
    from rayscale.tables import format_table

    clair = next((r for r in results if r.policy == "clairvoyant"), None)
    static = next((r for r in results if r.policy == "static-best"), None)

    def ratio(v: float, base: Any) -> str:
        return f"{v / base.cost_usd:.2f}x" if base is not None and base.cost_usd > 0 else "-"

    rows = [[r.policy, r.requests, f"{100 * r.slo_attainment:.2f}%", r.ttft_p95_s, r.tpot_p95_s, r.cost_usd,
             ratio(r.cost_usd, clair), ratio(r.cost_usd, static), r.accelerator_hours, r.idle_node_hours,
             r.failed_requests, r.rejected_requests, r.scale_up_events, r.wall_s] for r in results]
    head = ["policy", "requests", "SLO met", "TTFT p95 s", "TPOT p95 s", "cost $", "vs clairvoyant",
            "vs static-best", "accel h", "idle node h", "failed", "rejected", "scale-ups", "wall s"]
    title = f"trace {trace_name}"
    warm = results[0].extra.get("warmup_s") if results else None
    if warm:
        title += f", scored after a {warm:g} s warm-up ({results[0].extra['requests_warmup']} requests served unscored)"
    start = results[0].extra.get("start_fleet") if results else None
    title += (f"; every policy starts from the same on-demand fleet ({start or 'none'}) live at t=0"
              if results and "start_fleet" in results[0].extra else "; each policy starts from its own fleet")
    notes = [_note(r) for r in results]
    return "\n".join([format_table(head, rows, title=title), *(n for n in notes if n), *_rejected(results)])


def _rejected(results: list[Any]) -> list[str]:
    """A loud line where requests were refused: they are in no SLO column, and a user must not miss them."""
    worst = max(results, key=lambda r: r.rejected_requests, default=None)
    if worst is None or worst.rejected_requests == 0:
        return []
    n = worst.rejected_requests
    return [f"WARNING: {n} of {n + worst.requests} scored requests ({100 * n / (n + worst.requests):.1f}%) were "
            "rejected, not served: their prompt does not fit the model's context (max_model_len in models.yaml), "
            "as vLLM rejects them (HTTP 400). The SLO and cost columns count only the requests served."]


def _note(r: Any) -> str:
    """One line on what a baseline chose (and whether it reached its goal), or on the fluid bound."""
    x = r.extra
    if r.policy == "static-best":
        return f"static-best: fleet {x['fleet']}, {x['search_replays']} replays" + (f"; {x['note']}" if "note" in x else "")
    if r.policy == "clairvoyant":
        return (f"clairvoyant: {x['flavor']} at {x['capacity_rps']:.3g} req/s per replica (measured), headroom "
                f"x{x['headroom']:.3g}, ordered {x['lead_s']:.0f} s ahead, {x['search_replays']} replays"
                + (f"; {x['note']}" if "note" in x else ""))
    if r.policy == "stock":
        return (f"stock: {x['stock_flavor']}, target_ongoing_requests {x['stock_target_ongoing_requests']:.3g}, "
                f"max_ongoing_requests {x['stock_max_ongoing_requests']}, max_replicas {x['stock_max_replicas']} "
                f"(peak {x['stock_peak_replicas']})")
    if r.policy == "fluid-bound":
        return "fluid-bound: fractional replicas, instant nodes; its SLO column is another (integer) plan's"
    factors = {k.removeprefix("feedback_factor_"): v for k, v in x.items() if k.startswith("feedback_factor_")}
    if r.policy == "rayscale" and factors:
        return "rayscale: SLO feedback at the end: " + ", ".join(
            f"{m} x{f:.2f} on demand ({100 * (x[f'feedback_attainment_{m}'] or 0):.2f}% met, smoothed)"
            for m, f in factors.items())
    return ""
