"""How the controller process sets up Python's garbage collector once its catalog is loaded."""

from __future__ import annotations

import gc

# Container allocations, net of frees, between two young collections. A step at 1,000 models x 20 flavors
# allocates some 10^5 that outlive it (each (model, flavor)'s capacity, the plan's offers, the next state):
# at CPython's default of 700 that is a young collection every few hundred microseconds of the step, each
# scanning what the last ones kept. bench/planner.py times the step both ways.
YOUNG_COLLECTION_EVERY = 50_000


def settle_heap() -> None:
    """Freeze what is loaded so far out of the collector's reach (the catalog lives as long as the process:
    a full collection no longer scans its profile records every period) and collect young objects in
    larger batches (YOUNG_COLLECTION_EVERY; the older generations' thresholds stay CPython's)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, older, oldest)
