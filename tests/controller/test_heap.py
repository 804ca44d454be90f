"""The controller process's collector set-up (rayscale.controller.heap), checked in a fresh interpreter: it
changes process-wide state that the test session's own must not carry."""

from __future__ import annotations

import json
import subprocess
import sys

from rayscale.controller.heap import YOUNG_COLLECTION_EVERY


def test_settle_heap_freezes_what_is_loaded_and_batches_young_collections() -> None:
    code = ("import gc, json; before = gc.get_threshold(); data = [[i] for i in range(1000)]; "
            "from rayscale.controller.heap import settle_heap; settle_heap(); "
            "print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    before, after, frozen = json.loads(out.stdout)
    assert after == [YOUNG_COLLECTION_EVERY, before[1], before[2]]  # the older generations keep CPython's
    assert frozen >= 1000  # the lists loaded before it, out of every later collection's scan
