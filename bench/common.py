"""What every benchmark report states about where it ran (CPU, cores, memory, OS, the code's git state), and
the min / mean / max of runs over seeds."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "unknown CPU"


def git_state() -> str:
    """``<short sha>`` plus `` + uncommitted changes`` when the tree is dirty ("?" outside git)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return f"{rev or '?'}{' + uncommitted changes' if dirty else ''}"


def machine(with_git: bool = True) -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    line = f"{cpu_model()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"
    if with_git:
        line += f"; rayscale git {git_state()}; {time.strftime('%Y-%m-%d %H:%M %Z')}"
    return line


def span(xs: list[float], pct: bool) -> str:
    """min / mean / max of a bench's runs over seeds, as percentages or to two decimals."""
    f = (lambda x: f"{100 * x:.2f}%") if pct else (lambda x: f"{x:.2f}")
    return f"{f(min(xs))} / {f(statistics.mean(xs))} / {f(max(xs))}"


def emit(text: str, out: str | None) -> int:
    """Print a bench's record, write it to ``out`` when given; the exit status."""
    print(text)
    if out:
        Path(out).write_text(text)
    return 0
