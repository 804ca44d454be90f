"""Fixtures for the Kubernetes-facing tests: an emulator per test and official clients bound to it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client
from rayscale_testing.kubeapi import KubeAPIServer

from rayscale.config import load_catalog
from rayscale.core.catalog import Catalog

from .kubeworld import NS, World, make_world


@dataclass
class Clients:
    api_client: Any
    core: client.CoreV1Api
    custom: client.CustomObjectsApi
    apps: client.AppsV1Api


@pytest.fixture(scope="session")
def catalog() -> Catalog:
    """The shipped catalog (read-only in these tests)."""
    return load_catalog()


@pytest.fixture
def api() -> Iterator[KubeAPIServer]:
    server = KubeAPIServer(default_watch_timeout=10).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def k8s(api: KubeAPIServer) -> Iterator[Clients]:
    c = api.api_client()
    try:
        yield Clients(c, client.CoreV1Api(c), client.CustomObjectsApi(c), client.AppsV1Api(c))
    finally:
        c.close()


@pytest.fixture
def world(catalog: Catalog) -> Iterator[World]:
    """The rendered manifests on an emulator, with the Karpenter and KubeRay stand-ins and an actuator
    (a module may override it with its own set-up)."""
    api = KubeAPIServer(default_watch_timeout=10, namespaces=("default", NS)).start()
    w = make_world(api, catalog)
    try:
        yield w
    finally:
        w.close()
        api.stop()
