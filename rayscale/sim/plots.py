"""Plots of simulation timelines: load, replicas per flavor, latency and cost over time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def plot_results(results: Sequence[Any], path: str | None = None, title: str | None = None) -> Any:
    """One column per policy: arrivals, live replicas per flavor, TTFT/TPOT p95, $/h. Returns the figure."""
    try:
        import matplotlib
    except ImportError as e:
        from rayscale.extras import missing_extra

        raise missing_extra("sim", "plotting simulation results") from e

    if path is not None:
        matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(4, n, figsize=(4.2 * n, 9), sharex="col", squeeze=False)
    for j, r in enumerate(results):
        tl = r.timeline
        tm = tl["t_s"] / 60.0
        sm = tl["sample_t_s"] / 60.0
        ax = axes[0][j]
        ax.plot(tm, tl["arrival_rps"], lw=0.8)
        ax.set_title(f"{r.policy}: SLO {100 * r.slo_attainment:.1f}%, ${r.cost_usd:.1f}")
        ax.set_ylabel("arrivals / s")
        ax = axes[1][j]
        for f, v in sorted(tl["replicas"].items()):
            ax.step(sm, v, where="post", label=f)
        ax.set_ylabel("live replicas")
        ax.legend(fontsize=7, loc="upper left")
        ax = axes[2][j]
        ax.plot(tm, tl["ttft_p95_s"], lw=0.8, label="TTFT p95")
        ax.plot(tm, tl["tpot_p95_s"] * 10, lw=0.8, label="TPOT p95 x10")
        ax.set_yscale("log")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7, loc="upper left")
        ax = axes[3][j]
        ax.step(sm, tl["usd_per_h"], where="post")
        ax.set_ylabel("$ / h")
        ax.set_xlabel("minutes")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=90)
        plt.close(fig)
    return fig
