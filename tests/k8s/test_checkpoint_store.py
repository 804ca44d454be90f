"""The controller's checkpoint in a ConfigMap, over real HTTP with the official client: the holder of the
Lease creates and replaces it; a replica that lost the Lease mid-period gets 409, not its successor's
checkpoint overwritten; one over the 1 MiB an object may hold is refused with its size."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rayscale.cluster.kube.checkpoint import KEY, MAX_BYTES, ConfigMapStore


def test_the_checkpoint_is_created_replaced_and_read_back_by_another_replica(k8s: Any) -> None:
    core = client.CoreV1Api(k8s.api_client)
    a = ConfigMapStore(core, "default")
    assert a.read() is None
    a.write('{"n": 1}')
    a.write('{"n": 2}')
    cm = core.read_namespaced_config_map(a.name, "default")
    assert cm.data == {KEY: '{"n": 2}'} and cm.metadata.labels["app.kubernetes.io/managed-by"] == "rayscale"
    assert ConfigMapStore(core, "default").read() == '{"n": 2}'


def test_a_replica_writing_over_a_newer_checkpoint_gets_409_and_the_newer_one_stays(k8s: Any) -> None:
    core = client.CoreV1Api(k8s.api_client)
    old, new = ConfigMapStore(core, "default"), ConfigMapStore(core, "default")
    old.write('{"by": "old"}')
    assert new.read() == '{"by": "old"}'  # new took the Lease over and read what old saved
    new.write('{"by": "new"}')
    with pytest.raises(ApiException) as e:  # old, still in the period it lost the Lease in
        old.write('{"by": "old, late"}')
    assert e.value.status == 409
    assert new.read() == '{"by": "new"}'
    # A fresh replica that never read creates, finds it there (409), and replaces it at its next save.
    fresh = ConfigMapStore(core, "default")
    with pytest.raises(ApiException):
        fresh.write('{"by": "fresh"}')
    fresh.write('{"by": "fresh"}')
    assert new.read() == '{"by": "fresh"}'


def test_a_checkpoint_over_what_a_configmap_holds_is_refused_with_its_size(k8s: Any) -> None:
    store = ConfigMapStore(client.CoreV1Api(k8s.api_client), "default")
    with pytest.raises(ValueError, match=rf"ConfigMap default/{store.name} \({KEY}\): the checkpoint is "
                                         rf"{MAX_BYTES + 1} bytes, over the {MAX_BYTES}"):
        store.write("x" * (MAX_BYTES + 1))
    assert store.read() is None
