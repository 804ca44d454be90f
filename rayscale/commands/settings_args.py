"""The settings flags `controller` and `simulate` share: a settings file, and a few single settings on top."""

from __future__ import annotations

import argparse
from typing import Any

from rayscale.core.settings import MIX_MIN_REQUESTS, Settings


def add_settings_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--settings", default=None, metavar="FILE",
                   help="the settings file (the shape of rayscale/data/settings.yaml; default: the shipped "
                        "settings); the flags below override single settings")
    p.add_argument("--period", "--control-period", dest="period", type=float, default=None, metavar="S",
                   help="period_s: seconds between control steps (shipped 5)")
    p.add_argument("--mix-min-requests", type=int, default=None, metavar="N",
                   help="mix_min_requests: the request mix spans at least N finished requests, reaching back up "
                        f"to mix_max_s when the window holds fewer (0: the window only; shipped {MIX_MIN_REQUESTS})")
    p.add_argument("--burst-floor", action=argparse.BooleanOptionalAction, default=None,
                   help="estimate.burst_floor: hold replicas that drain the last hour's bursts within each "
                        "model's TTFT target (rayscale.core.burst; shipped on)")
    p.add_argument("--solver", choices=["auto", "exact", "greedy"], default=None,
                   help="planner.solver (shipped greedy)")
    p.add_argument("--launch-timeout-factor", type=float, default=None, metavar="X",
                   help="act.launch_timeout_factor: a gang still pending after X times its flavor's "
                        "node_startup_s is deleted whole and its flavor backed off (raise it on a busy machine)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings file (or the shipped one) with the flags that name a single setting applied on top;
    rayscale.core.catalog.CatalogError names the file or the flag and the field."""
    from rayscale.config import load_settings, override_settings

    flags: list[tuple[str, Any, dict[str, Any]]] = [
        ("--period", args.period, {"period_s": args.period}),
        ("--mix-min-requests", args.mix_min_requests, {"mix_min_requests": args.mix_min_requests}),
        ("--burst-floor", args.burst_floor, {"estimate": {"burst_floor": args.burst_floor}}),
        ("--solver", args.solver, {"planner": {"solver": args.solver}}),
        ("--launch-timeout-factor", args.launch_timeout_factor,
         {"act": {"launch_timeout_factor": args.launch_timeout_factor}}),
    ]
    settings = load_settings(args.settings)
    for flag, value, change in flags:
        if value is not None:
            settings = override_settings(settings, change, flag)
    return settings
