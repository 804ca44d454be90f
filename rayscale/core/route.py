"""Routing weights: how the ingress spreads one model's requests over its flavor deployments.

A flavor's weight is the capacity it serves now: its Serve replicas times what one replica sustains
within the SLO (the estimator's per-replica req/s for the current request mix). Equal weights would
overload the slower flavor of a mixed fleet while the faster one idles.
"""

from __future__ import annotations

from collections import defaultdict

from rayscale.core.estimate import Demand


def flavor_weights(replicas: dict[tuple[str, str], int], demands: dict[str, Demand]) -> dict[str, dict[str, float]]:
    """model -> flavor -> replicas x per-replica req/s. A flavor the estimator knows nothing of weighs 0."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for (m, f), n in sorted(replicas.items()):
        d = demands.get(m)
        cap = d.capacity[f].rps if d is not None and f in d.capacity else 0.0
        out[m][f] = round(n * cap, 4)
    return dict(out)
