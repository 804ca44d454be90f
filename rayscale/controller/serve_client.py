"""Serve as the controller sees it: replica targets and placements, read and set over the dashboard API.

rayscale sets replica counts through Serve's external scaler API (``external_scaler_enabled: true`` on
the application, ``POST /api/v1/applications/{app}/deployments/{dep}/scale``). Why that and not an
application-level autoscaling policy: the policy runs inside Serve's controller and can only move
replica counts, while rayscale must order replica changes against node provisioning (replicas only onto
ready gangs, drain before a gang is released). An external writer keeps that ordering in one place, and
Serve still owns replica placement, health checks and graceful shutdown (draining in-flight requests).
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rayscale.serve.config import parse_deployment_name, slot_deployment_name
from rayscale.serve.readiness import SERVING_STATES

# Serve deployment per (model, flavor): "{model}--{flavor}" (rayscale.serve names them so).
SEP = "--"


def deployment_name(model: str, flavor: str) -> str:
    return f"{model}{SEP}{flavor}"


def split_deployment(name: str) -> tuple[str, str] | None:
    """(model, flavor) of a flavor deployment or of one of its gang slots' deployments."""
    parsed = parse_deployment_name(name)
    return None if parsed is None else (parsed[0], parsed[1])


@dataclass(frozen=True)
class ServeSnapshot:
    target: dict[tuple[str, str], int] = field(default_factory=dict)  # (model, flavor) -> target replicas
    running: dict[tuple[str, str], int] = field(default_factory=dict)  # replicas alive, stopping ones too
    serving: dict[tuple[str, str], int] = field(default_factory=dict)  # replicas that take requests now
    per_node: dict[str, int] = field(default_factory=dict)  # Ray node id, and "ip:<node ip>" -> replicas
    app_of: dict[tuple[str, str], str] = field(default_factory=dict)
    ok: bool = True
    error: str = ""
    # Multi-node (model, flavor)s served by gang slot deployments: slot -> its target (0 or 1). ``target``
    # and ``running`` count all of a flavor's slots together, as the core decides per (model, flavor).
    slots: dict[tuple[str, str], dict[int, int]] = field(default_factory=dict)
    # The same slots' replicas that take requests now (slot -> 0 or 1): the ingress routes by these.
    slots_serving: dict[tuple[str, str], dict[int, int]] = field(default_factory=dict)


class ServeClientError(RuntimeError):
    pass


def ray_auth_token() -> str | None:
    """The token Ray's own clients send to a cluster with token auth (``RAY_AUTH_MODE=token``), found where
    Ray's AuthenticationTokenLoader looks, in its order: ``RAY_AUTH_TOKEN``, else the file
    ``RAY_AUTH_TOKEN_PATH`` names (an error if unreadable or empty, as in Ray), else ``~/.ray/auth_token``.
    None: no token configured."""
    env = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if env:
        return env
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            raise ServeClientError(f"RAY_AUTH_TOKEN_PATH is set but cannot be read: {e}") from e
        if not token:
            raise ServeClientError(f"RAY_AUTH_TOKEN_PATH is set but the file is empty: {path}")
        return token
    try:
        return Path.home().joinpath(".ray", "auth_token").read_text().strip() or None
    except (OSError, RuntimeError):  # no such file, or no home directory
        return None


class ServeClient:
    """Thin HTTP client of the Ray dashboard's Serve endpoints (bounded timeouts, no retries hidden).

    With a Ray auth token configured (``token``, else ray_auth_token()), every request carries
    ``Authorization: Bearer <token>``, the header the dashboard's token middleware checks; a dashboard
    without token auth ignores it."""

    def __init__(self, dashboard_url: str, timeout_s: float = 5.0, token: str | None = None):
        self.url = dashboard_url.rstrip("/")
        token = token or ray_auth_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(timeout=timeout_s, headers=headers)

    def close(self) -> None:
        self._http.close()

    def point_at(self, dashboard_url: str) -> None:
        """Read and scale Serve through another dashboard from now on (a RayService's driven cluster moved)."""
        self.url = dashboard_url.rstrip("/")

    def snapshot(self) -> ServeSnapshot:
        try:
            r = self._http.get(f"{self.url}/api/serve/applications/")
            r.raise_for_status()
            return parse_details(r.json())
        except (httpx.HTTPError, ValueError) as e:
            return ServeSnapshot(ok=False, error=f"serve details unavailable: {e}")

    def deployment_targets(self) -> dict[tuple[str, str], int]:
        """(application, deployment) -> target replicas of every deployment Serve has, any name
        (ServeClientError when the dashboard does not answer)."""
        try:
            r = self._http.get(f"{self.url}/api/serve/applications/")
            r.raise_for_status()
            apps = r.json().get("applications") or {}
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            raise ServeClientError(f"serve details unavailable: {e}") from e
        return {(a, d): int(dep.get("target_num_replicas") or 0)
                for a, app in apps.items() for d, dep in (app.get("deployments") or {}).items()}

    def scale(self, app: str, model: str, flavor: str, replicas: int) -> None:
        self.scale_deployment(app, deployment_name(model, flavor), replicas)

    def scale_slot(self, app: str, model: str, flavor: str, slot: int, replicas: int) -> None:
        """Sets one gang slot's deployment (0 or 1 replica) through the same external scaler endpoint."""
        self.scale_deployment(app, slot_deployment_name(model, flavor, slot), replicas)

    def scale_deployment(self, app: str, dep: str, replicas: int) -> None:
        r = self._http.post(f"{self.url}/api/v1/applications/{app}/deployments/{dep}/scale",
                            json={"target_num_replicas": int(replicas)})
        if r.status_code != 200:
            raise ServeClientError(f"scale {app}/{dep} to {replicas}: HTTP {r.status_code}: {r.text[:300]}")


def parse_details(details: dict[str, Any]) -> ServeSnapshot:
    target: dict[tuple[str, str], int] = {}
    running: dict[tuple[str, str], int] = defaultdict(int)
    serving: dict[tuple[str, str], int] = defaultdict(int)
    per_node: dict[str, int] = defaultdict(int)
    app_of: dict[tuple[str, str], str] = {}
    slots: dict[tuple[str, str], dict[int, int]] = defaultdict(dict)
    slots_serving: dict[tuple[str, str], dict[int, int]] = defaultdict(dict)
    for app_name, app in (details.get("applications") or {}).items():
        for dep_name, dep in (app.get("deployments") or {}).items():
            parsed = parse_deployment_name(dep_name)
            if parsed is None:
                continue
            mf, slot = (parsed[0], parsed[1]), parsed[2]
            app_of[mf] = app_name
            n = int(dep.get("target_num_replicas") or 0)
            if slot is None:
                target[mf] = n
            else:  # a gang slot: the flavor's target is the sum over its slots
                slots[mf][slot] = n
                target[mf] = target.get(mf, 0) + n
                slots_serving[mf][slot] = sum(r.get("state") in SERVING_STATES for r in dep.get("replicas") or [])
            # A STOPPING replica is still finishing in-flight requests: its node is not free yet.
            for rep in dep.get("replicas") or []:
                running[mf] += 1
                serving[mf] += rep.get("state") in SERVING_STATES
                if rep.get("node_id"):
                    per_node[rep["node_id"]] += 1
                # On Kubernetes a Ray node is a pod: actuators that know pods, not Ray ids, join by IP.
                if rep.get("node_ip"):
                    per_node[f"ip:{rep['node_ip']}"] += 1
    return ServeSnapshot(target, dict(running), dict(serving), dict(per_node), app_of, slots=dict(slots),
                         slots_serving=dict(slots_serving))
