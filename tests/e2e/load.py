"""Load for the end-to-end tests: a replay in the background, and a steady load that lasts until stopped."""

from __future__ import annotations

import threading
import time
from typing import Any

from rayscale.loadgen import LoadGenConfig, ReplayResult, replay
from rayscale.sim.trace import LengthDist, Trace, poisson
from tests.e2e.conftest import MODEL


def load(url: str, rate: float, duration_s: float, seed: int, model: str = MODEL) -> ReplayResult:
    """Poisson arrivals at ``rate`` for ``duration_s``: ~100-token prompts, 32 tokens out."""
    trace = poisson(rate, duration_s, seed=seed, prompt=LengthDist(100, 0.3, 50, 200),
                    output=LengthDist(32, 0.0, 32, 32))
    return replay(trace, LoadGenConfig(base_url=url, model=model, max_output_tokens=32, progress=False,
                                       request_timeout_s=60, seed=seed))


class Background:
    def __init__(self, fn: Any) -> None:
        self.result: Any = None
        self.t = threading.Thread(target=lambda: setattr(self, "result", fn()), daemon=True)
        self.t.start()

    def join(self, timeout_s: float) -> Any:
        self.t.join(timeout_s)
        assert not self.t.is_alive(), "load replay did not finish in time"
        return self.result


class SteadyLoad:
    """Load until ``stop()`` (at most ``max_s``): a replay started every ``every_s`` seconds, on schedule, so
    the rate stays steady while one replay's slow requests still finish. It lasts exactly as long as a step
    needs, however long replicas take to start on a busy machine.

    ``rate`` > 0: Poisson arrivals at ``rate`` (replays of ``every_s`` each). ``rate`` = 0: a trickle, one
    request per ``every_s``: at most one in any window shorter than that, so it never reads as a rise."""

    def __init__(self, url: str, rate: float, seed: int, every_s: float = 10.0, max_s: float = 300.0,
                 model: str = MODEL) -> None:
        self._stop = threading.Event()
        self.chunks: list[Background] = []

        def chunk(i: int) -> ReplayResult:
            if rate > 0:
                return load(url, rate, every_s, seed=seed * 1000 + i, model=model)
            one = Trace.from_arrays([0.0], [100], [32], name="trickle")
            return replay(one, LoadGenConfig(base_url=url, model=model, max_output_tokens=32, progress=False,
                                             request_timeout_s=60, seed=seed * 1000 + i))

        def run() -> None:
            end = time.monotonic() + max_s
            i = 0
            while not self._stop.is_set() and time.monotonic() < end:
                self.chunks.append(Background(lambda i=i: chunk(i)))
                i += 1
                self._stop.wait(every_s)

        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()

    def stop(self, timeout_s: float = 180.0) -> list[ReplayResult]:
        """Stop sending; the results of every replay, once all their requests are done."""
        self._stop.set()
        self._t.join(30)
        return [c.join(timeout_s) for c in self.chunks]


def errors(results: list[ReplayResult]) -> tuple[int, int, str]:
    """(requests, errors, the first failing replay's table)."""
    bad = [r.summary.table() for r in results if r.summary.errors]
    return (sum(r.summary.requests for r in results), sum(r.summary.errors for r in results),
            bad[0] if bad else "")
