"""Plain-text tables for the CLI (no dependency, aligned columns, numbers right-aligned)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.2f}" if abs(v) < 1000 else f"{v:,.0f}"
    return "" if v is None else str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(r[i], int | float) for r in rows if r[i] is not None) and bool(rows)
               for i in range(len(headers))]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric, strict=True))

    out = [title] if title else []
    out += [line(list(headers)), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(s.rstrip() for s in out)
