"""Routing weights: how the ingress spreads one model's requests over its flavor deployments.

A flavor's weight is the capacity it serves now: its Serve replicas that take requests (RUNNING) times
what one replica sustains within the SLO (the estimator's per-replica req/s for the current request mix).
Equal weights would overload the slower flavor of a mixed fleet while the faster one idles; weights of the
replicas Serve was told to run would send a flavor that is scaling up the share of replicas still starting,
and Serve's router queues it behind the one that runs (a dev chat hour: one inf2 of three up took a third of
the requests, TTFT p95 10-27 s for three minutes; bench/README.md).

Upstream (ray 2.60): a deployment broadcasts to its routers only the replicas in RUNNING (or
PENDING_MIGRATION) state (``DeploymentState.get_running_replica_infos`` and
``broadcast_running_replicas_if_changed`` in ``ray/serve/_private/deployment_state.py``); the router's
``update_deployment_targets`` (``ray/serve/_private/router.py``) hands only those to the request router,
which holds the rest of the requests in ``_pending_requests_to_fulfill`` and retries with back-off until a
replica under ``max_ongoing_requests`` accepts one (``ray/serve/_private/request_router/request_router.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from rayscale.core.estimate import Demand


def flavor_weights(replicas: Mapping[tuple[str, str], int], demands: Mapping[str, Demand]) -> dict[str, dict[str, float]]:
    """model -> flavor -> replicas x per-replica req/s, ``replicas``: those serving now, per (model, flavor); a
    flavor serving on one replica counts what it serves alone (Demand.alone_share, where known). A flavor the
    estimator knows nothing of weighs 0."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for (m, f), n in sorted(replicas.items()):
        d = demands.get(m)
        cap = d.capacity[f].rps if d is not None and f in d.capacity else 0.0
        if n == 1 and d is not None:
            cap *= d.alone_share.get(f, 1.0)
        out[m][f] = round(n * cap, 4)
    return dict(out)
