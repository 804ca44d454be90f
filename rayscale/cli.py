"""One command line: up, serve, plan, render, simulate, bench, demo, controller."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from rayscale.commands import COMMAND_MODULES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayscale", description="Ray-native autoscaler for LLM serving on accelerator flavors."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(f"rayscale.commands.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rc = args.handler(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
