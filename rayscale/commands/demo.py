"""`rayscale demo`: local cluster, tiny model on vLLM, a real trace replayed, summary table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run the end-to-end demo on this machine (a few minutes)",
        description="Start a local Ray cluster, serve the tiny Qwen2 model with vLLM on CPU, replay a slice "
        "of the Azure code trace against it and print TTFT/TPOT/throughput; stop everything at the end.",
    )
    p.add_argument("--trace", type=Path, help="trace file, Azure CSV or Mooncake JSONL (default: ../shared/traces/azure_llm_2023_code.csv)")
    p.add_argument("--serve-config", type=Path, help="serve config (default: deployments/local-tiny.yaml)")
    p.add_argument("--window", type=float, default=120.0, help="seconds of the trace to take (default 120)")
    p.add_argument("--start", type=float, default=180.0, help="where the slice starts in the trace (default 180 s)")
    p.add_argument("--rate-scale", type=float, default=0.2, help="keep this share of requests (default 0.2)")
    p.add_argument("--speedup", type=float, default=2.0, help="play the slice this much faster (default 2)")
    p.add_argument("--max-prompt", type=int, default=256, help="clip prompts to this many tokens (default 256)")
    p.add_argument("--max-output", type=int, default=32, help="clip outputs to this many tokens (default 32)")
    p.add_argument("--port", type=int, default=8000, help="Serve HTTP port if free (default 8000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-autoscale", action="store_true",
                   help="skip the controller phase (burst on the emulated Mistral-7B, scaled by rayscale)")
    p.add_argument("--out", type=Path, default=None, help="where the plot and decision log go (default: out/)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rayscale.demo import DEFAULT_SERVE_CONFIG, DEFAULT_TRACE, DemoConfig, main

    try:
        cfg = DemoConfig(
            trace=args.trace or DEFAULT_TRACE,
            serve_config=args.serve_config or DEFAULT_SERVE_CONFIG,
            window_start_s=args.start,
            window_s=args.window,
            rate_scale=args.rate_scale,
            speedup=args.speedup,
            max_prompt_tokens=args.max_prompt,
            max_output_tokens=args.max_output,
            http_port=args.port,
            seed=args.seed,
            progress=not args.no_progress,
            autoscale=not args.no_autoscale,
            **({"out_dir": args.out} if args.out else {}),
        )
    except ValueError as e:
        print(f"error: {e}")
        return 2
    return main(cfg)
