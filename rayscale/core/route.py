"""Routing weights: how the ingress spreads one model's requests over its flavor deployments.

A flavor's weight is the capacity it serves now: its Serve replicas that take requests (RUNNING) times
what one replica sustains within the SLO (the estimator's per-replica req/s for the current request mix).
Equal weights would overload the slower flavor of a mixed fleet while the faster one idles; weights of the
replicas Serve was told to run would send a flavor that is scaling up the share of replicas still starting,
and Serve's router queues it behind the one that runs (a dev chat hour: one inf2 of three up took a third of
the requests, TTFT p95 10-27 s for three minutes; bench/README.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from rayscale.core.estimate import Demand


def flavor_weights(replicas: Mapping[tuple[str, str], int], demands: Mapping[str, Demand]) -> dict[str, dict[str, float]]:
    """model -> flavor -> replicas x per-replica req/s, ``replicas``: those serving now, per (model, flavor). A
    flavor the estimator knows nothing of weighs 0."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for (m, f), n in sorted(replicas.items()):
        d = demands.get(m)
        cap = d.capacity[f].rps if d is not None and f in d.capacity else 0.0
        out[m][f] = round(n * cap, 4)
    return dict(out)
