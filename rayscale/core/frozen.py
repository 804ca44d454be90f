"""Frozen dataclasses built without their ``__init__``: the hot paths' escape from one
``object.__setattr__`` per field (the estimator builds thousands per reconcile)."""

from __future__ import annotations

from typing import Any


def frozen_without_init(cls: type, fields: dict[str, Any]) -> Any:
    """An instance of ``cls`` with ``fields`` as its attributes, no ``__init__`` run: only for dataclasses
    without ``__post_init__`` or validation, given every field."""
    obj: Any = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj
