"""Bounded polling for tests and benchmarks: every wait has a deadline and says what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str = "condition", interval_s: float = 0.5) -> Any:
    """Poll ``predicate`` until it returns something truthy and return it; TimeoutError after ``timeout_s``.

    Exceptions from the predicate count as "not yet" (the thing may not exist yet); the last one is
    reported with the timeout.
    """
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:
            last = e
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}" + (f": {last!r}" if last else ""))
