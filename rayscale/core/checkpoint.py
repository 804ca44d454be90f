"""The controller's memory as text: what a restarted controller reads back so it does not start blind.

A restart loses nothing that exists (gangs are read back from the cluster, replicas from Serve), but it does
lose what shapes how the controller moves: the forecaster's rate history (its peak hold looks back 30 min),
the burst floor's hour of arrivals, SLO feedback's record, latency corrections, back-offs and the planner's
scale-down timers. Without them the controller relearns for an hour, sizing from the defaults meanwhile
(bench/results/eval_split.md, ``rayscale, restarted blind``). A checkpoint carries them over: the controller
saves one every period (rayscale.controller.checkpoint: a file locally, a ConfigMap on Kubernetes) and reads
the last one back when it starts or takes the Lease over.

Losing a checkpoint only slows the controller down, as before: one that cannot be read, from another
version, or older than the rate history it carries is set aside with a message, never half applied.

The text is JSON, encoded from the records' own type hints (``encode``/``decode``): a field added to a
record is carried without code here, and one the text lacks keeps its default. The estimator's last
demands are left out (they only seed the next period's searches), and so is the forecast horizon: it is
worked out from the catalog and the settings, which a restart may have changed.
"""

from __future__ import annotations

import functools
import json
import math
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from enum import Enum
from typing import Any, Union, get_args, get_origin, get_type_hints

from rayscale.core.settings import Settings
from rayscale.core.step import StepState

VERSION = 1
# How often the controller saves one; 0: every period, after the step and before its actions (a crash in
# between leaves targets the next controller acts on). Rewound further, the planner's targets and timers
# disagree with the fleet the last minute built: on the dev diurnal trace a checkpoint a minute old met
# 99.40% (98.77% at worst) at 3.6% more, one from the last period the unbroken run's 99.73% to the cent
# (bench/results/restart.md).
CHECKPOINT_EVERY_S = 0.0
# ... but a save takes at most this share of the controller's time: the next one waits 1/share times as
# long as the last took (one model: every period; a thousand, ~0.9 s to encode and write on two cores:
# every ~20 s; bench/results/checkpoint_size.md).
SAVE_TIME_SHARE = 0.05


def max_age_s(settings: Settings) -> float:
    """A checkpoint older than the rate history it carries describes another load: it is not restored."""
    return settings.history_len * settings.history_window_s


class CheckpointError(ValueError):
    """A checkpoint that cannot be read back; the message names its source and the field."""


@dataclass(frozen=True)
class Checkpoint:
    t: float  # when it was taken (the controller's clock)
    state: StepState
    # Arrivals per control period per model, oldest first: the burst floor's input, which the controller
    # keeps beside the step's state.
    arrivals: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    def usable_at(self, now: float, max_age_s: float) -> str | None:
        """Why this checkpoint should not be restored at ``now`` (None: it should)."""
        age = now - self.t
        if age < -1.0:
            return f"taken {-age:.0f} s in the future (clock moved back?)"
        if age > max_age_s:
            return f"{age:.0f} s old, older than the {max_age_s:.0f} s of rate history it carries"
        return None


def encode(value: Any) -> Any:
    """JSON-ready form of a record: dataclasses as objects, mappings as [key, value] pairs (keys may be
    tuples), tuples as lists, enums as their values."""
    if value is None or type(value) in _PLAIN:  # most of a checkpoint: its rates and counts
        return value
    if isinstance(value, tuple | list) and _numbers(value):
        return list(value)
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return [[encode(k), encode(v)] for k, v in value.items()]
    if isinstance(value, tuple | list):
        return [encode(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise TypeError(f"checkpoint: cannot encode {type(value).__name__}")


def decode(tp: Any, value: Any, where: str) -> Any:
    """``value`` (from ``encode``) as type ``tp``; CheckpointError naming ``where`` on a mismatch."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return decode(inner[0], value, where)
    elif is_dataclass(tp) and isinstance(tp, type):
        return _decode_record(tp, value, where)
    elif origin in (dict, Mapping):
        if isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
            kt, vt = args
            return {decode(kt, k, f"{where} key"): decode(vt, v, f"{where}[{k!r}]") for k, v in value}
    elif origin is tuple:
        if isinstance(value, list):
            if len(args) == 2 and args[1] is Ellipsis:
                if args[0] is float and _numbers(value):
                    return tuple(map(float, value))
                return tuple(decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
            if len(value) == len(args):
                return tuple(decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    elif isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(value)
        except ValueError:
            pass
    elif tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    elif tp in (int, str, bool) and type(value) is tp:
        return value
    raise CheckpointError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {json.dumps(value)[:80]}")


_PLAIN = (str, int, float, bool)
_NUMBERS = frozenset((int, float))


def _numbers(values: tuple[Any, ...] | list[Any]) -> bool:
    return set(map(type, values)) <= _NUMBERS


@functools.lru_cache(maxsize=64)
def _hints(tp: type) -> tuple[dict[str, Any], frozenset[str]]:
    return get_type_hints(tp), frozenset(f.name for f in fields(tp))


def _decode_record(tp: type, value: Any, where: str) -> Any:
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: expected an object ({tp.__name__}), got {json.dumps(value)[:80]}")
    hints, known = _hints(tp)
    unknown = sorted(set(value) - known)
    if unknown:
        raise CheckpointError(f"{where}: unknown field(s) {unknown} for {tp.__name__}")
    try:
        return tp(**{k: decode(hints[k], v, f"{where}.{k}" if where else k) for k, v in value.items()})
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{where}: {e}") from e


def dumps(cp: Checkpoint) -> str:
    """The checkpoint as one line of JSON (the estimator's demands and the horizon left out)."""
    body = encode(replace(cp, state=replace(cp.state, demands=None, horizon_s=None)))
    return json.dumps({"version": VERSION, **body}, separators=(",", ":"), allow_nan=True)


def loads(text: str, source: str) -> Checkpoint:
    """The checkpoint in ``text``; CheckpointError naming ``source`` and the field when it cannot be read."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{source}: not JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: expected an object")
    version = raw.pop("version", None)
    if version != VERSION:
        raise CheckpointError(f"{source}: version: expected {VERSION}, got {version!r}")
    try:
        cp: Checkpoint = decode(Checkpoint, raw, "")
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from None
    if not math.isfinite(cp.t):
        raise CheckpointError(f"{source}: t: expected a finite time, got {cp.t}")
    return replace(cp, state=replace(cp.state, horizon_s=None))  # one saved before it was left out
