"""The controller's checkpoint in ConfigMaps, over real HTTP with the official client: the holder of the
Lease creates and replaces it; a replica that lost the Lease mid-period gets 409, not its successor's
checkpoint overwritten; one larger than an object holds is gzipped and split over several, each within the
API server's 1 MiB (which the emulator enforces as upstream's ValidateConfigMap does), and a set whose parts
come from different saves is set aside with the object named, never misread."""

from __future__ import annotations

import base64
import random
import string
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from rayscale_testing.kubeapi import MAX_CONFIGMAP_BYTES

from rayscale.cluster.kube.checkpoint import DIGEST, KEY, SHARD_BYTES, SHARDS, ConfigMapStore
from rayscale.cluster.render import MAX_STATE_SHARDS
from rayscale.core.checkpoint import CheckpointError


def _noise(n: int, seed: int = 0) -> str:
    """Text gzip cannot shrink much: about 0.75 bytes gzipped per character."""
    rng = random.Random(seed)
    return "".join(rng.choices(string.ascii_letters + string.digits, k=n))


def test_the_checkpoint_is_created_replaced_and_read_back_by_another_replica(k8s: Any) -> None:
    core = client.CoreV1Api(k8s.api_client)
    a = ConfigMapStore(core, "default")
    assert a.read() is None
    a.write('{"n": 1}')
    a.write('{"n": 2}')
    cm = core.read_namespaced_config_map(a.name, "default")
    assert cm.data[SHARDS] == "1" and set(cm.binary_data) == {KEY}
    assert cm.metadata.labels["app.kubernetes.io/managed-by"] == "rayscale"
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


def test_the_api_server_refuses_a_configmap_over_1_mib(k8s: Any) -> None:
    """What the split exists for: one object may not hold more (the emulator follows upstream)."""
    core = client.CoreV1Api(k8s.api_client)
    big = base64.b64encode(b"x" * (MAX_CONFIGMAP_BYTES + 1)).decode()
    body = client.V1ConfigMap(metadata=client.V1ObjectMeta(name="too-big"), binary_data={"k": big})
    with pytest.raises(ApiException) as e:
        core.create_namespaced_config_map("default", body)
    assert e.value.status == 422 and "Too long" in e.value.body


def test_a_large_checkpoint_is_split_over_several_configmaps_and_read_back_whole(k8s: Any) -> None:
    core = client.CoreV1Api(k8s.api_client)
    text = _noise(3 * SHARD_BYTES)
    store = ConfigMapStore(core, "default")
    store.write(text)
    store.write(text + "!")  # replaced: every part carries its version
    names = [store.name] + [f"{store.name}-{i}" for i in range(1, MAX_STATE_SHARDS)]
    n = int(core.read_namespaced_config_map(store.name, "default").data[SHARDS])
    assert 2 <= n < MAX_STATE_SHARDS
    for name in names[:n]:
        part = base64.b64decode(core.read_namespaced_config_map(name, "default").binary_data[KEY])
        assert 0 < len(part) <= SHARD_BYTES
    assert ConfigMapStore(core, "default").read() == text + "!"
    # A smaller save fills fewer objects; the ones it no longer needs are left and not read.
    store.write('{"n": 1}')
    assert ConfigMapStore(core, "default").read() == '{"n": 1}'


def test_parts_from_another_save_are_set_aside_with_the_object_named(k8s: Any) -> None:
    core = client.CoreV1Api(k8s.api_client)
    store = ConfigMapStore(core, "default")
    store.write(_noise(2 * SHARD_BYTES, seed=1))
    # A save that died after its later parts: the first object still names the earlier digest.
    second = f"{store.name}-1"
    cm = core.read_namespaced_config_map(second, "default")
    cm.data[DIGEST] = "0" * 64
    core.replace_namespaced_config_map(second, "default", cm)
    with pytest.raises(CheckpointError, match=rf"ConfigMap default/{store.name}: ConfigMap {second} is missing or "
                                              "from another save"):
        ConfigMapStore(core, "default").read()


def test_a_checkpoint_over_what_its_configmaps_hold_is_refused_with_its_size(k8s: Any) -> None:
    store = ConfigMapStore(client.CoreV1Api(k8s.api_client), "default")
    with pytest.raises(ValueError, match=rf"ConfigMap default/{store.name}: the checkpoint is \d+ bytes gzipped, "
                                         rf"over the {MAX_STATE_SHARDS} x {SHARD_BYTES}"):
        store.write(_noise(MAX_STATE_SHARDS * SHARD_BYTES * 4 // 3 + SHARD_BYTES))
    assert store.read() is None
