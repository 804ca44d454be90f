"""The controller's checkpoint: what a restarted controller reads back is what it saved, field for field; a
checkpoint it cannot use is set aside with a message naming the source and the field, never half applied."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rayscale.core.checkpoint import Checkpoint, CheckpointError, dumps, loads, max_age_s
from rayscale.core.estimate import Correction
from rayscale.core.feedback import Delivered
from rayscale.core.plan import PlannerMemory
from rayscale.core.settings import Settings
from rayscale.core.signals import MIX_QUANTILES, RequestMix
from rayscale.core.spot import SpotPool, SpotRecord
from rayscale.core.step import StepState


def _state() -> StepState:
    """Every field of StepState away from its default (the estimator's demands and the horizon are never
    carried)."""
    q = tuple(float(100 * (i + 1)) for i in range(len(MIX_QUANTILES)))
    return StepState(
        memory=PlannerMemory({"m": 10.0}, {"m": 20.0}, {"m": {("m", "l40s", "on-demand"): 3, ("m", "a10g", "spot"): 1}}, 30.0),
        corrections={("m", "l40s"): Correction(1.2, 0.9, 0.05)},
        unavailable={("l40s", "us-east-1a", "spot"): 900.0},
        rate_history={"m": (1.0, 2.5, float("inf"))},
        next_history_s=60.0,
        last_mix={"m": RequestMix(800.0, 150.0, 1900.0, q, q)},
        horizon_s=210.0,
        delivered={"m": Delivered(4.0, 3.96, 500.0, 55.0, 0.9, 1.0)},
        spot=SpotRecord({"l40s": SpotPool(0.5, 12.0)}, {"g1": ("l40s", 1)}, 50.0),
    )


def test_a_checkpoint_reads_back_as_it_was_saved() -> None:
    cp = Checkpoint(1234.5, _state(), {"m": (3.0, 0.0, 7.0)})
    back = loads(dumps(cp), "store")
    assert back == replace(cp, state=replace(cp.state, horizon_s=None))
    assert isinstance(back.state.memory.targets["m"], dict) and back.state.demands is None


def test_an_unreadable_checkpoint_names_its_source_and_the_field() -> None:
    raw = json.loads(dumps(Checkpoint(1.0, _state())))
    raw["state"]["rate_history"][0][1][1] = "fast"
    with pytest.raises(CheckpointError, match=r"^cm/state: state\.rate_history\['m'\]\[1\]: expected float"):
        loads(json.dumps(raw), "cm/state")
    raw = json.loads(dumps(Checkpoint(1.0, _state())))
    raw["state"]["delivered"][0][1]["speed"] = 1.0
    with pytest.raises(CheckpointError, match=r"state\.delivered\['m'\]: unknown field\(s\) \['speed'\] for Delivered"):
        loads(json.dumps(raw), "f")
    raw["version"] = 99
    with pytest.raises(CheckpointError, match="f: version: expected 1, got 99"):
        loads(json.dumps(raw), "f")
    with pytest.raises(CheckpointError, match="f: not JSON"):
        loads("{", "f")


def test_a_field_the_text_lacks_keeps_its_default() -> None:
    """A checkpoint from before a field was added reads back; the new field starts as a fresh state's."""
    raw = json.loads(dumps(Checkpoint(1.0, _state())))
    del raw["state"]["spot"], raw["arrivals"]
    back = loads(json.dumps(raw), "f")
    assert back.state.spot == SpotRecord() and back.arrivals == {} and back.state.next_history_s == 60.0


def test_a_restored_checkpoint_works_the_horizon_out_again() -> None:
    """The horizon follows the catalog and the settings, which a restart may change: one saved by an older
    version is not restored."""
    raw = json.loads(dumps(Checkpoint(1.0, _state())))
    assert "horizon_s" not in raw["state"] or raw["state"]["horizon_s"] is None
    raw["state"]["horizon_s"] = 660.0
    assert loads(json.dumps(raw), "f").state.horizon_s is None


def test_a_checkpoint_older_than_its_rate_history_or_from_the_future_is_not_restored() -> None:
    s = Settings()
    cp = Checkpoint(10_000.0, StepState())
    assert cp.usable_at(10_060.0, max_age_s(s)) is None
    assert "older than the 7200 s of rate history" in str(cp.usable_at(10_000.0 + 7201, max_age_s(s)))
    assert "in the future" in str(cp.usable_at(9_000.0, max_age_s(s)))
