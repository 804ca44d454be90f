"""A restarted controller reads back the memory the last one saved (rayscale.core.checkpoint): its rate
history, SLO feedback's record and planner timers, and the burst floor's arrivals. One it cannot read is set
aside with a message naming the file and the field; a store it cannot reach is retried, never saved over."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rayscale.config import load_catalog
from rayscale.controller.checkpoint import FileStore
from rayscale.controller.loop import Controller, ControllerConfig
from rayscale.core.checkpoint import loads
from rayscale.core.settings import Settings
from rayscale.core.signals import Freshness, ModelSignals
from rayscale.core.step import StepContext, StepState, step

MODEL = "mistral-7b"


def _controller(store: Any, every_s: float = 0.0) -> Controller:
    none: Any = None
    cat = load_catalog().subset([MODEL], ["a10g", "l40s"])
    return Controller(cat, none, none, none, ControllerConfig(Settings(), state_store=store, checkpoint_every_s=every_s))


def _warm_state(ctl: Controller, until: float) -> StepState:
    """The state an hour of steps at 3 req/s leaves (rate history, feedback's record, planner targets)."""
    state = StepState()
    for t in range(0, int(until), 5):
        sig = ModelSignals(MODEL, Freshness.FRESH, 1.0, 3.0, finished=15.0, slo_met=15.0,
                           arrival_counts=(15.0,) * 12, arrival_bin_s=5.0)
        state = step(StepContext(float(t), ctl.catalog, {MODEL: sig}, (), None, ctl.config.settings, state)).state
    return state


def test_a_restarted_controller_reads_back_what_the_last_one_saved(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "state" / "checkpoint.json")
    a = _controller(store, every_s=60.0)
    errors: list[str] = []
    assert a._restore(0.0, errors) == [f"no checkpoint in {store.where}: starting without history"]
    a.state = _warm_state(a, 3600.0)
    a.arrivals[MODEL].extend([15.0, 0.0, 30.0])
    assert a._save(3600.0) == [] and a._save(3630.0) == []  # once a minute
    saved = loads(store.read() or "", store.where)
    assert saved.t == 3600.0 and len(saved.state.rate_history[MODEL]) > 50

    b = _controller(store)
    assert b._restore(3650.0, errors) == [f"restored the checkpoint taken 50 s ago from {store.where}"]
    assert errors == []
    assert b.state.rate_history == a.state.rate_history and b.state.delivered == a.state.delivered
    assert b.state.memory == a.state.memory and list(b.arrivals[MODEL]) == [15.0, 0.0, 30.0]


def _saved_at(t: float, path: Path) -> FileStore:
    """A store holding the checkpoint a controller saved after ``t`` s of steps."""
    store = FileStore(path)
    a = _controller(store)
    a._restore(0.0, [])
    a.state = _warm_state(a, t)
    a._save(t)
    return store


def test_an_unreadable_checkpoint_is_set_aside_naming_the_file_and_field_then_saved_over(tmp_path: Path) -> None:
    store = _saved_at(120.0, tmp_path / "checkpoint.json")
    raw = json.loads(store.read() or "")
    raw["state"]["next_history_s"] = "soon"
    store.write(json.dumps(raw))
    b, errors = _controller(store), []
    assert b._restore(130.0, errors) == []
    assert len(errors) == 1 and str(store.path) in errors[0] and "state.next_history_s" in errors[0], errors
    assert b.state == StepState()  # nothing of it applied
    assert b._save(130.0) == []  # a fresh checkpoint replaces it
    assert loads(store.read() or "", store.where).t == 130.0


def test_a_checkpoint_older_than_its_rate_history_is_not_restored(tmp_path: Path) -> None:
    store = _saved_at(120.0, tmp_path / "checkpoint.json")
    b = _controller(store)
    notes = b._restore(120.0 + 3 * 3600, [])
    assert "older than the 7200 s of rate history it carries" in notes[0]
    assert b.state == StepState()


class _Unreachable:
    where = "ConfigMap ns/state"

    def __init__(self) -> None:
        self.writes = 0
        self.down = True

    def read(self) -> str | None:
        if self.down:
            raise ConnectionError("API server unreachable")
        return None

    def write(self, text: str) -> None:
        self.writes += 1


def test_a_store_that_cannot_be_read_is_retried_and_never_saved_over() -> None:
    store = _Unreachable()
    ctl, errors = _controller(store), []
    assert ctl._restore(0.0, errors) == [] and "unreachable" in errors[0]
    assert ctl._save(0.0) == [] and store.writes == 0  # the checkpoint there may be good: not overwritten
    store.down = False
    assert ctl._restore(5.0, []) == [f"no checkpoint in {store.where}: starting without history"]
    assert ctl._save(5.0) == [] and store.writes == 1


class _SlowStore(FileStore):
    """A store whose writes take ``delay_s`` (a large checkpoint, a busy API server)."""

    def __init__(self, path: Path, delay_s: float) -> None:
        super().__init__(path)
        self.delay_s, self.writes = delay_s, 0

    def write(self, text: str) -> None:
        time.sleep(self.delay_s)
        self.writes += 1
        super().write(text)


def test_saves_are_spaced_so_that_saving_takes_a_small_share_of_the_loop(tmp_path: Path) -> None:
    writes = {}
    for delay_s in (0.0, 0.3):
        store = _SlowStore(tmp_path / f"{delay_s}.json", delay_s)
        ctl = _controller(store)
        ctl._restore(0.0, [])
        assert [ctl._save(float(t)) for t in range(0, 30, 5)] == [[]] * 6  # a period of 5 s
        writes[delay_s] = store.writes
    # Quick saves: every period. Saves of 0.3 s: the next waits >= 0.3 / SAVE_TIME_SHARE = 6 s (t = 0, 10, 20).
    assert writes[0.0] == 6
    assert 1 <= writes[0.3] <= 3
