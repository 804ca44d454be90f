"""What a step derives from the catalog alone, worked out once per catalog: a control loop plans with one
catalog every period, and at 1,000 models x 20 flavors its string keys, sorts and pydantic reads cost
milliseconds a step. Catalogs are frozen models (a new catalog is a new object); an entry keeps its catalog
alive, so an id in the cache is never another catalog's while the entry is there."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from rayscale.core.catalog import Catalog

T = TypeVar("T")

_CACHE: dict[tuple[int, str], tuple[Catalog, Any]] = {}
_ENTRIES = 16  # a few catalogs (tests build many; a process plans with one) times the few things derived


def derived(catalog: Catalog, what: str, build: Callable[[Catalog], T]) -> T:
    """``build(catalog)``, from the cache where ``what`` was built for this catalog object before. Callers
    must not change what it returns."""
    key = (id(catalog), what)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is catalog:
        value: T = hit[1]
        return value
    value = build(catalog)
    if len(_CACHE) >= _ENTRIES:
        del _CACHE[next(iter(_CACHE))]  # the oldest
    _CACHE[key] = (catalog, value)
    return value
