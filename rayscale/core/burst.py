"""Burst floor: the sustained rate at which the queue a burst builds drains within the TTFT target.

Load that swings within seconds cannot be followed by capacity that takes minutes to start: it has to be
there already. The Azure code trace (x3) has a mean of 7.7 req/s, a 1-min peak of 32 and 10-s peaks near
100; a fleet held at its 1-min peak queues every burst above it (simulated, 95% SLO attainment), and one
that chases each spike orders capacity that lands after it.

A burst of w seconds at rate r on a fleet that drains C requests/s builds a queue of (r - C) w requests,
which the fleet clears (r / C - 1) w seconds after the burst: within a TTFT target T when
C >= r w / (w + T). ``burst_rate`` is the largest such C over windows w, at the rate all but
(1 - attainment) of the requests arrived under (a request-weighted quantile: a burst that holds under 1% of
the requests may queue), over a history of arrival counts per bin (the last hour, in the simulator).
C is a drain rate: what replicas start once a queue has built, flat out (rayscale.core.estimate.drain_rps),
not their capacity at the SLO, which keeps latency margin for Poisson arrivals. rayscale.core.estimate
reports it as ``Demand.burst_rps`` (with ``EstimateSettings.burst_floor``) and rayscale.core.plan holds
replicas that drain it. On Poisson load it is about the mean plus a few standard deviations of a minute's
count, what the peak hold of the 1-min history already gives; it matters for load burstier than Poisson on
the scale of seconds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Window lengths, in bins (5 s each in the simulator: 5 s to 1 min). Shorter bursts than one bin are
# absorbed in the engines' batches and queues at the TTFT target; longer ones the forecaster follows.
BURST_WINDOWS = (1, 2, 3, 4, 6, 12)


def burst_rate(counts: Sequence[float], bin_s: float, ttft_s: float, attainment: float,
               windows: Sequence[int] = BURST_WINDOWS) -> float:
    """Sustained req/s that clears every burst in ``counts`` (arrivals per ``bin_s``-long bin, oldest first)
    within ``ttft_s``, for all but ``1 - attainment`` of the requests; 0 with no arrivals."""
    if bin_s <= 0 or ttft_s < 0 or not 0 < attainment <= 1:
        raise ValueError(f"burst_rate: bin_s > 0, ttft_s >= 0 and 0 < attainment <= 1 (got {bin_s}, {ttft_s}, "
                         f"{attainment})")
    c = np.asarray(counts, dtype=float)
    n = c.size
    ks = [k for k in windows if k <= n]
    if not ks or c.sum() <= 0:
        return 0.0
    # All windows at once (the simulator asks every period): row i holds the rate of every window of ks[i]
    # bins, by the bin it ends at; the requests of a window's last bin queue behind the whole window, so
    # they carry its weight. Bins before a full window have weight 0 and sort first.
    cum = np.concatenate([[0.0], np.cumsum(c)])
    rate, weight = np.zeros((len(ks), n)), np.zeros((len(ks), n))
    for i, k in enumerate(ks):
        rate[i, k - 1:] = (cum[k:] - cum[:-k]) / (k * bin_s)
        weight[i, k - 1:] = c[k - 1:]
    order = np.argsort(rate, axis=1)
    rate = np.take_along_axis(rate, order, axis=1)
    cw = np.cumsum(np.take_along_axis(weight, order, axis=1), axis=1)
    # The request-weighted quantile: the first window rate with at least `attainment` of the weight at or below.
    at = np.minimum((cw < attainment * cw[:, -1:]).sum(axis=1), n - 1)
    q = rate[np.arange(len(ks)), at]
    w = np.asarray(ks, dtype=float) * bin_s
    return float(np.max(q * w / (w + ttft_s)))
