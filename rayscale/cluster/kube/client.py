"""Calls to the Kubernetes API with bounded retries: 429 and 5xx back off with jitter, connection errors too.

Conflicts (409) and NotFound (404) are not retried here: they mean the world moved, so the caller
re-reads and decides again. Every call has a client-side timeout, so nothing blocks a period for long.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import urllib3

from rayscale.extras import missing_extra

try:
    from kubernetes.client.exceptions import ApiException
except ImportError as e:
    raise missing_extra("kube", "the Kubernetes client") from e

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRIABLE = frozenset({429, 500, 502, 503, 504})


class KubeError(RuntimeError):
    """The API stayed unavailable after the retries (or answered something unexpected)."""


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    base_s: float = 0.05
    max_s: float = 1.0  # caps Retry-After too: a period must stay short
    request_timeout_s: float = 5.0


def _retry_after(e: ApiException) -> float | None:
    headers = getattr(e, "headers", None) or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def call(policy: RetryPolicy, fn: Callable[..., T], *args: Any, rng: random.Random | None = None,
         **kwargs: Any) -> T:
    rng = rng or random.Random()
    kwargs.setdefault("_request_timeout", policy.request_timeout_s)
    for attempt in range(policy.attempts):
        last = attempt == policy.attempts - 1
        try:
            return fn(*args, **kwargs)
        except ApiException as e:
            if e.status not in RETRIABLE or last:
                raise
            wait = _retry_after(e) or policy.base_s * 2**attempt
            log.debug("%s answered %s; retrying", getattr(fn, "__name__", fn), e.status)
        except (urllib3.exceptions.HTTPError, OSError) as e:
            if last:
                raise KubeError(f"API unreachable: {e}") from e
            wait = policy.base_s * 2**attempt
        # Full jitter in [wait/2, wait]: many controllers retrying together do not stay in step.
        time.sleep(min(policy.max_s, wait) * rng.uniform(0.5, 1.0))
    raise AssertionError("unreachable")
