"""How the controller process sets up Python's garbage collector once its catalog is loaded."""

from __future__ import annotations

import gc

# Container allocations, net of frees, between two young collections. A step at 1,000 models x 20 flavors
# (10,000 nodes in the view) holds between 50,000 and 100,000 new ones at its peak (each (model, flavor)'s
# capacity, the plan's offers, the next state) and frees the last step's state when it ends. At CPython's
# default of 700 that is a young collection every few hundred microseconds of the step, each scanning what
# the last ones kept; at 50,000, one in every step (~20 ms of a 300-ms step scanning what the step has built);
# at 200,000 the count falls back before it gets there, and a young collection comes once in some 30 steps.
# bench/planner.py times the step both ways.
YOUNG_COLLECTION_EVERY = 200_000


def settle_heap() -> None:
    """Freeze what is loaded so far out of the collector's reach (the catalog lives as long as the process:
    a full collection no longer scans its profile records every period) and collect young objects in
    larger batches (YOUNG_COLLECTION_EVERY; the older generations' thresholds stay CPython's)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, older, oldest)
