"""Frozen dataclasses built without their ``__init__``: the hot paths' escape from one
``object.__setattr__`` per field (the estimator builds thousands per reconcile)."""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


def frozen_without_init(cls: type, fields: dict[str, Any]) -> Any:
    """An instance of ``cls`` with ``fields`` as its attributes, no ``__init__`` run: only for dataclasses
    without ``__post_init__`` or validation, given every field."""
    obj: Any = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def replaced(obj: T, **changes: Any) -> T:
    """``dataclasses.replace`` without ``__init__`` (a fifth of its cost): the same restrictions as
    ``frozen_without_init``."""
    out: T = frozen_without_init(type(obj), {**vars(obj), **changes})
    return out
