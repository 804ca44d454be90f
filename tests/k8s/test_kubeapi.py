"""Kubernetes semantics of the emulator, exercised with the official client over HTTP."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException
from rayscale_testing.kubeapi import KubeAPIServer, LabelSelector

from .conftest import Clients
from .manifests import nodeclaim, raycluster

NC = ("karpenter.sh", "v1", "nodeclaims")
RC = ("ray.io", "v1")


def status_of(exc: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(exc.body)
    return body


def pod(name: str, labels: dict[str, str] | None = None, **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels or {}, **meta},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }


# -- create / get / errors ---------------------------------------------------------------------------


def test_create_answers_201_with_server_fields(api: KubeAPIServer, k8s: Clients) -> None:
    data, code, _ = k8s.custom.create_cluster_custom_object_with_http_info(*NC, nodeclaim("a"))
    assert code == 201
    meta = data["metadata"]
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert meta["generation"] == 1
    first_rv = int(meta["resourceVersion"])
    second = k8s.custom.create_cluster_custom_object(*NC, nodeclaim("b"))
    assert int(second["metadata"]["resourceVersion"]) > first_rv  # one global, monotonic counter
    assert second["metadata"]["uid"] != meta["uid"]
    got = k8s.custom.get_cluster_custom_object(*NC, "a")
    assert got["metadata"]["resourceVersion"] == meta["resourceVersion"]
    assert got["kind"] == "NodeClaim" and got["apiVersion"] == "karpenter.sh/v1"


def test_duplicate_create_is_409_already_exists(k8s: Clients) -> None:
    k8s.custom.create_cluster_custom_object(*NC, nodeclaim("dup"))
    with pytest.raises(ApiException) as err:
        k8s.custom.create_cluster_custom_object(*NC, nodeclaim("dup"))
    assert err.value.status == 409
    st = status_of(err.value)
    assert st["kind"] == "Status" and st["status"] == "Failure" and st["reason"] == "AlreadyExists"
    assert st["details"] == {"name": "dup", "group": "karpenter.sh", "kind": "nodeclaims"}
    assert st["message"] == 'nodeclaims.karpenter.sh "dup" already exists'


def test_missing_object_is_404_status(k8s: Clients) -> None:
    with pytest.raises(ApiException) as err:
        k8s.core.read_namespaced_pod("nope", "default")
    assert err.value.status == 404
    st = status_of(err.value)
    assert (st["reason"], st["code"], st["details"]["name"]) == ("NotFound", 404, "nope")
    with pytest.raises(ApiException) as err:
        k8s.custom.delete_cluster_custom_object(*NC, "nope")
    assert err.value.status == 404


def test_namespace_must_exist_and_generate_name(k8s: Clients) -> None:
    with pytest.raises(ApiException) as err:
        k8s.core.create_namespaced_pod("missing", pod("p"))
    assert err.value.status == 404
    created = k8s.core.create_namespaced_pod(
        "default", {"metadata": {"generateName": "w-"}, "spec": {"containers": []}}
    )
    assert created.metadata.name.startswith("w-") and len(created.metadata.name) == 7
    assert created.status.phase == "Pending"


def test_invalid_custom_resource_is_422_with_field_causes(k8s: Clients) -> None:
    bad = nodeclaim("bad")
    bad["spec"]["requirements"].append({"key": "karpenter.sh/custom", "operator": "In", "values": ["x"]})
    with pytest.raises(ApiException) as err:
        k8s.custom.create_cluster_custom_object(*NC, bad)
    assert err.value.status == 422
    st = status_of(err.value)
    assert st["reason"] == "Invalid"
    fields = {c["field"] for c in st["details"]["causes"]}
    assert "spec.requirements[3].key" in fields
    assert any('label domain "karpenter.sh" is restricted' in c["message"] for c in st["details"]["causes"])
    bad_name = nodeclaim("Upper_Case")
    with pytest.raises(ApiException) as err:
        k8s.custom.create_cluster_custom_object(*NC, bad_name)
    assert err.value.status == 422


def test_unknown_fields_strict_by_default_pruned_when_warn(k8s: Clients) -> None:
    body = nodeclaim("typo")
    body["spec"]["expiresAfter"] = "Never"
    with pytest.raises(ApiException) as err:
        k8s.custom.create_cluster_custom_object(*NC, body)
    assert err.value.status == 422 and "expiresAfter" in err.value.body
    data, code, headers = k8s.custom.create_cluster_custom_object_with_http_info(
        *NC, body, field_validation="Warn"
    )
    assert code == 201 and "expiresAfter" not in data["spec"]
    assert "unknown field" in headers["Warning"]


def test_defaults_are_applied_like_the_apiserver(k8s: Clients) -> None:
    pool = {
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodePool",
        "metadata": {"name": "gpu"},
        "spec": {
            "template": {
                "spec": {
                    "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "gpu"},
                    "requirements": [],
                }
            },
            "disruption": {"consolidateAfter": "30s"},
        },
    }
    out = k8s.custom.create_cluster_custom_object("karpenter.sh", "v1", "nodepools", pool)
    assert out["spec"]["disruption"]["consolidationPolicy"] == "WhenEmptyOrUnderutilized"
    assert out["spec"]["disruption"]["budgets"] == [{"nodes": "10%"}]
    assert out["spec"]["template"]["spec"]["expireAfter"] == "720h"


# -- selectors ---------------------------------------------------------------------------------------


def test_label_selectors_all_operators(k8s: Clients) -> None:
    k8s.core.create_namespaced_pod("default", pod("a", {"app": "x", "tier": "web"}))
    k8s.core.create_namespaced_pod("default", pod("b", {"app": "y", "tier": "db"}))
    k8s.core.create_namespaced_pod("default", pod("c", {"app": "z"}))

    def names(sel: str) -> list[str]:
        return sorted(
            p.metadata.name for p in k8s.core.list_namespaced_pod("default", label_selector=sel).items
        )

    assert names("app=x") == ["a"]
    assert names("app==y") == ["b"]
    assert names("app!=x") == ["b", "c"]
    assert names("app in (x, z)") == ["a", "c"]
    assert names("app notin (x)") == ["b", "c"]
    assert names("tier") == ["a", "b"]
    assert names("!tier") == ["c"]
    assert names("app in (x,y),tier!=web") == ["b"]
    assert names("") == ["a", "b", "c"]
    with pytest.raises(ApiException) as err:
        k8s.core.list_namespaced_pod("default", label_selector="app in x")
    assert err.value.status == 400


def test_label_selector_parser_matches_kubernetes_rules() -> None:
    sel = LabelSelector.parse("a=1,b!=2,c in (3,4),d notin (5),e,!f")
    assert sel.matches({"a": "1", "b": "9", "c": "4", "e": ""})
    assert not sel.matches({"a": "1", "c": "4", "e": "", "f": "x"})
    assert not sel.matches({"a": "1", "c": "4", "d": "5", "e": ""})
    assert LabelSelector.parse("b!=2").matches({})  # != and notin match a missing key


def test_field_selector_metadata_name_and_pod_fields(k8s: Clients, api: KubeAPIServer) -> None:
    k8s.custom.create_cluster_custom_object(*NC, nodeclaim("n1"))
    k8s.custom.create_cluster_custom_object(*NC, nodeclaim("n2"))
    got = k8s.custom.list_cluster_custom_object(*NC, field_selector="metadata.name=n2")
    assert [o["metadata"]["name"] for o in got["items"]] == ["n2"]
    got = k8s.custom.list_cluster_custom_object(*NC, field_selector="metadata.name!=n2")
    assert [o["metadata"]["name"] for o in got["items"]] == ["n1"]
    k8s.core.create_namespaced_pod(
        "default", {"metadata": {"name": "p"}, "spec": {"nodeName": "node-1", "containers": []}}
    )
    assert [
        p.metadata.name
        for p in k8s.core.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-1").items
    ] == ["p"]
    with pytest.raises(ApiException) as err:
        k8s.custom.list_cluster_custom_object(*NC, field_selector="spec.nodeName=x")
    assert err.value.status == 400


def test_list_pagination_with_limit_and_continue(k8s: Clients) -> None:
    for i in range(5):
        k8s.core.create_namespaced_config_map("default", {"metadata": {"name": f"cm-{i}"}})
    page = k8s.core.list_namespaced_config_map("default", limit=2)
    seen = [c.metadata.name for c in page.items]
    assert page.metadata.remaining_item_count == 3
    while page.metadata._continue:
        page = k8s.core.list_namespaced_config_map("default", limit=2, _continue=page.metadata._continue)
        seen += [c.metadata.name for c in page.items]
    assert seen == [f"cm-{i}" for i in range(5)]


# -- update / patch ----------------------------------------------------------------------------------


def test_put_with_stale_resource_version_is_409_conflict(k8s: Clients) -> None:
    k8s.custom.create_namespaced_custom_object(*RC, "default", "rayclusters", raycluster("rc"))
    first = k8s.custom.get_namespaced_custom_object(*RC, "default", "rayclusters", "rc")
    stale = json.loads(json.dumps(first))
    first["spec"]["workerGroupSpecs"][0]["replicas"] = 2
    updated = k8s.custom.replace_namespaced_custom_object(*RC, "default", "rayclusters", "rc", first)
    assert int(updated["metadata"]["resourceVersion"]) > int(stale["metadata"]["resourceVersion"])
    assert updated["metadata"]["generation"] == 2
    stale["spec"]["workerGroupSpecs"][0]["replicas"] = 3
    with pytest.raises(ApiException) as err:
        k8s.custom.replace_namespaced_custom_object(*RC, "default", "rayclusters", "rc", stale)
    assert err.value.status == 409
    st = status_of(err.value)
    assert st["reason"] == "Conflict" and "the object has been modified" in st["message"]
    # re-read and retry succeeds
    fresh = k8s.custom.get_namespaced_custom_object(*RC, "default", "rayclusters", "rc")
    fresh["spec"]["workerGroupSpecs"][0]["replicas"] = 3
    assert (
        k8s.custom.replace_namespaced_custom_object(*RC, "default", "rayclusters", "rc", fresh)["spec"][
            "workerGroupSpecs"
        ][0]["replicas"]
        == 3
    )


def test_put_on_missing_object_is_404(k8s: Clients) -> None:
    with pytest.raises(ApiException) as err:
        k8s.custom.replace_cluster_custom_object(*NC, "ghost", nodeclaim("ghost"))
    assert err.value.status == 404


def test_generation_moves_on_spec_changes_only_and_noop_writes_change_nothing(k8s: Clients) -> None:
    k8s.custom.create_namespaced_custom_object(*RC, "default", "rayclusters", raycluster("rc"))
    lab = k8s.custom.patch_namespaced_custom_object(
        *RC, "default", "rayclusters", "rc", {"metadata": {"labels": {"x": "1"}}}
    )
    assert lab["metadata"]["generation"] == 1
    st = k8s.custom.patch_namespaced_custom_object_status(
        *RC, "default", "rayclusters", "rc", {"status": {"readyWorkerReplicas": 1}}
    )
    assert st["metadata"]["generation"] == 1 and st["status"]["readyWorkerReplicas"] == 1
    same = k8s.custom.patch_namespaced_custom_object(
        *RC, "default", "rayclusters", "rc", {"metadata": {"labels": {"x": "1"}}}
    )
    assert same["metadata"]["resourceVersion"] == st["metadata"]["resourceVersion"]
    spec = k8s.custom.patch_namespaced_custom_object(
        *RC,
        "default",
        "rayclusters",
        "rc",
        [{"op": "replace", "path": "/spec/workerGroupSpecs/0/replicas", "value": 4}],
        _content_type="application/json-patch+json",
    )
    assert spec["metadata"]["generation"] == 2


def test_status_subresource_separation(k8s: Clients) -> None:
    k8s.custom.create_cluster_custom_object(*NC, nodeclaim("s"))
    # status on the main resource is ignored ...
    out = k8s.custom.patch_cluster_custom_object(
        *NC, "s", {"metadata": {"labels": {"k": "v"}}, "status": {"nodeName": "x"}}
    )
    assert "nodeName" not in (out.get("status") or {})
    # ... and everything but status is ignored on /status
    out = k8s.custom.patch_cluster_custom_object_status(
        *NC, "s", {"metadata": {"labels": {"k": "w"}}, "status": {"nodeName": "x"}}
    )
    assert out["status"]["nodeName"] == "x" and out["metadata"]["labels"]["k"] == "v"


def test_patch_flavours(k8s: Clients, api: KubeAPIServer) -> None:
    k8s.core.create_namespaced_pod("default", pod("p", {"a": "1", "b": "2"}, finalizers=["x/one"]))
    # merge patch: null deletes
    out = k8s.core.patch_namespaced_pod(
        "p", "default", {"metadata": {"labels": {"a": None}}}, _content_type="application/merge-patch+json"
    )
    assert out.metadata.labels == {"b": "2"}
    # strategic merge (the client's default for dicts on built-ins): finalizers merge as a set
    out = k8s.core.patch_namespaced_pod("p", "default", {"metadata": {"finalizers": ["x/two"]}})
    assert out.metadata.finalizers == ["x/one", "x/two"]
    # JSON patch, with a failing test op
    out = k8s.core.patch_namespaced_pod("p", "default", [{"op": "remove", "path": "/metadata/finalizers/0"}])
    assert out.metadata.finalizers == ["x/two"]
    with pytest.raises(ApiException) as err:
        k8s.core.patch_namespaced_pod(
            "p", "default", [{"op": "test", "path": "/metadata/labels/b", "value": "nope"}]
        )
    assert err.value.status == 422
    # strategic merge is refused for custom resources, like the apiserver does
    k8s.custom.create_cluster_custom_object(*NC, nodeclaim("n"))
    with pytest.raises(ApiException) as err:
        k8s.custom.patch_cluster_custom_object(
            *NC,
            "n",
            {"metadata": {"labels": {"a": "b"}}},
            _content_type="application/strategic-merge-patch+json",
        )
    assert err.value.status == 415
    # a merge patch carrying a stale resourceVersion conflicts
    with pytest.raises(ApiException) as err:
        k8s.custom.patch_cluster_custom_object(
            *NC, "n", {"metadata": {"resourceVersion": "1", "labels": {"a": "b"}}}
        )
    assert err.value.status == 409


def test_transition_rule_nodeclaim_spec_is_immutable(k8s: Clients) -> None:
    k8s.custom.create_cluster_custom_object(*NC, nodeclaim("imm"))
    with pytest.raises(ApiException) as err:
        k8s.custom.patch_cluster_custom_object(*NC, "imm", {"spec": {"expireAfter": "1h"}})
    assert err.value.status == 422 and "spec is immutable" in err.value.body


# -- delete / finalizers / GC -------------------------------------------------------------------------


def test_delete_with_finalizers_waits_for_their_removal(k8s: Clients) -> None:
    body = nodeclaim("f")
    body["metadata"]["finalizers"] = ["karpenter.sh/termination"]
    k8s.custom.create_cluster_custom_object(*NC, body)
    _, code, _ = k8s.custom.delete_cluster_custom_object_with_http_info(*NC, "f")
    assert code == 202
    obj = k8s.custom.get_cluster_custom_object(*NC, "f")
    assert obj["metadata"]["deletionTimestamp"]
    # a terminating object takes no new finalizers
    with pytest.raises(ApiException) as err:
        k8s.custom.patch_cluster_custom_object(
            *NC, "f", {"metadata": {"finalizers": ["karpenter.sh/termination", "other/x"]}}
        )
    assert err.value.status == 422
    k8s.custom.patch_cluster_custom_object(*NC, "f", {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as err:
        k8s.custom.get_cluster_custom_object(*NC, "f")
    assert err.value.status == 404


def test_delete_preconditions_and_owner_garbage_collection(k8s: Clients, api: KubeAPIServer) -> None:
    rc = k8s.custom.create_namespaced_custom_object(*RC, "default", "rayclusters", raycluster("owner"))
    owned = pod(
        "child",
        ownerReferences=[
            {"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": "owner", "uid": rc["metadata"]["uid"]}
        ],
    )
    k8s.core.create_namespaced_pod("default", owned)
    with pytest.raises(ApiException) as err:
        k8s.custom.delete_namespaced_custom_object(
            *RC, "default", "rayclusters", "owner", body={"preconditions": {"resourceVersion": "1"}}
        )
    assert err.value.status == 409
    k8s.custom.delete_namespaced_custom_object(*RC, "default", "rayclusters", "owner")
    assert k8s.core.list_namespaced_pod("default").items == []


def test_deleting_a_namespace_deletes_its_objects(k8s: Clients) -> None:
    k8s.core.create_namespace({"metadata": {"name": "tmp"}})
    k8s.core.create_namespaced_pod("tmp", pod("p"))
    k8s.core.delete_namespace("tmp")
    assert k8s.core.list_pod_for_all_namespaces().items == []


# -- watch ----------------------------------------------------------------------------------------------


def test_watch_from_resource_version_sees_each_change_in_order(k8s: Clients) -> None:
    start = k8s.custom.list_cluster_custom_object(*NC)["metadata"]["resourceVersion"]
    body = nodeclaim("w")
    body["metadata"]["finalizers"] = ["karpenter.sh/termination"]
    k8s.custom.create_cluster_custom_object(*NC, body)
    k8s.custom.patch_cluster_custom_object(*NC, "w", {"metadata": {"labels": {"step": "2"}}})
    k8s.custom.delete_cluster_custom_object(*NC, "w")
    k8s.custom.patch_cluster_custom_object(*NC, "w", {"metadata": {"finalizers": None}})
    events = [
        (
            e["type"],
            int(e["object"]["metadata"]["resourceVersion"]),
            bool(e["object"]["metadata"].get("deletionTimestamp")),
        )
        for e in watch.Watch().stream(
            k8s.custom.list_cluster_custom_object, *NC, resource_version=start, timeout_seconds=1
        )
    ]
    assert [t for t, _, _ in events] == ["ADDED", "MODIFIED", "MODIFIED", "MODIFIED", "DELETED"]
    assert [rv for _, rv, _ in events] == sorted(rv for _, rv, _ in events)
    assert events[2][2]  # the delete request only set deletionTimestamp


def test_watch_without_resource_version_lists_then_streams(k8s: Clients) -> None:
    k8s.core.create_namespaced_pod("default", pod("old"))
    got: list[tuple[str, str]] = []
    w = watch.Watch()

    def later() -> None:
        time.sleep(0.3)
        k8s.core.create_namespaced_pod("default", pod("new"))

    t = threading.Thread(target=later)
    t.start()
    for e in w.stream(k8s.core.list_namespaced_pod, "default", timeout_seconds=2):
        got.append((e["type"], e["object"].metadata.name))
        if len(got) == 2:
            w.stop()
    t.join(5)
    assert got == [("ADDED", "old"), ("ADDED", "new")]


def test_watch_label_selector_sends_deleted_when_object_leaves_the_selection(k8s: Clients) -> None:
    start = k8s.core.list_namespaced_pod("default").metadata.resource_version
    k8s.core.create_namespaced_pod("default", pod("p", {"role": "a"}))
    k8s.core.create_namespaced_pod("default", pod("q", {"role": "b"}))
    k8s.core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"role": "b"}}})
    k8s.core.patch_namespaced_pod("q", "default", {"metadata": {"labels": {"role": "a"}}})
    seen = [
        (e["type"], e["object"].metadata.name)
        for e in watch.Watch().stream(
            k8s.core.list_namespaced_pod,
            "default",
            label_selector="role=a",
            resource_version=start,
            timeout_seconds=1,
        )
    ]
    assert seen == [("ADDED", "p"), ("DELETED", "p"), ("ADDED", "q")]


def test_watch_with_too_old_resource_version_gets_410(api: KubeAPIServer, k8s: Clients) -> None:
    start = k8s.custom.list_cluster_custom_object(*NC)["metadata"]["resourceVersion"]
    k8s.custom.create_cluster_custom_object(*NC, nodeclaim("x"))
    api.compact()
    with pytest.raises(ApiException) as err:
        list(
            watch.Watch().stream(
                k8s.custom.list_cluster_custom_object, *NC, resource_version=start, timeout_seconds=1
            )
        )
    assert err.value.status == 410


def test_bounded_history_expires_old_resource_versions() -> None:
    with KubeAPIServer(history_size=5) as small:
        c = small.api_client()
        core = client.CoreV1Api(c)
        start = core.list_namespaced_config_map("default").metadata.resource_version
        for i in range(10):
            core.create_namespaced_config_map("default", {"metadata": {"name": f"c{i}"}})
        with pytest.raises(ApiException) as err:
            list(
                watch.Watch().stream(
                    core.list_namespaced_config_map, "default", resource_version=start, timeout_seconds=1
                )
            )
        assert err.value.status == 410
        recent = str(small.store.rv - 2)
        names = [
            e["object"].metadata.name
            for e in watch.Watch().stream(
                core.list_namespaced_config_map, "default", resource_version=recent, timeout_seconds=1
            )
        ]
        assert names == ["c8", "c9"]
        c.close()


def test_broken_watch_resumes_from_last_resource_version_without_duplicates(
    api: KubeAPIServer, k8s: Clients
) -> None:
    w = watch.Watch()
    got: list[str] = []
    start = k8s.core.list_namespaced_config_map("default").metadata.resource_version

    def writer() -> None:
        for i in range(6):
            k8s.core.create_namespaced_config_map("default", {"metadata": {"name": f"c{i}"}})
            if i == 2:
                time.sleep(0.2)
                api.break_watches()  # the stream closes, the client reconnects from its last RV
            time.sleep(0.05)

    t = threading.Thread(target=writer)
    t.start()
    deadline = time.monotonic() + 10
    for e in w.stream(k8s.core.list_namespaced_config_map, "default", resource_version=start):
        got.append(e["object"].metadata.name)
        if len(got) == 6 or time.monotonic() > deadline:
            w.stop()
    t.join(5)
    assert got == [f"c{i}" for i in range(6)]
    assert len([r for r in api.requests_for("watch", "configmaps")]) >= 2


def test_watch_timeout_seconds_ends_the_stream(k8s: Clients) -> None:
    t0 = time.monotonic()
    assert (
        list(
            watch.Watch().stream(
                k8s.core.list_namespaced_pod, "default", resource_version="1", timeout_seconds=1
            )
        )
        == []
    )
    assert 0.9 <= time.monotonic() - t0 < 5


# -- fault injection --------------------------------------------------------------------------------------


def test_injected_429_carries_retry_after_then_clears(api: KubeAPIServer, k8s: Clients) -> None:
    api.faults.inject("create", "nodeclaims", 429, times=2, retry_after=3)
    for _ in range(2):
        with pytest.raises(ApiException) as err:
            k8s.custom.create_cluster_custom_object(*NC, nodeclaim("r"))
        assert err.value.status == 429
        assert err.value.headers["Retry-After"] == "3"
        assert status_of(err.value)["details"]["retryAfterSeconds"] == 3
    assert k8s.custom.create_cluster_custom_object(*NC, nodeclaim("r"))["metadata"]["name"] == "r"
    assert [r.code for r in api.requests_for("create", "nodeclaims")] == [429, 429, 201]


def test_injected_5xx_and_409_match_verb_and_resource(api: KubeAPIServer, k8s: Clients) -> None:
    k8s.custom.create_namespaced_custom_object(*RC, "default", "rayclusters", raycluster("rc"))
    api.faults.inject("patch", "rayclusters", 503)
    api.faults.inject("update", "rayclusters", 409)
    api.faults.inject("get", "pods", 500)
    # a GET of a RayCluster is not affected by the pod rule
    obj = k8s.custom.get_namespaced_custom_object(*RC, "default", "rayclusters", "rc")
    with pytest.raises(ApiException) as err:
        k8s.custom.patch_namespaced_custom_object(
            *RC, "default", "rayclusters", "rc", {"metadata": {"labels": {"a": "b"}}}
        )
    assert err.value.status == 503 and status_of(err.value)["reason"] == "ServiceUnavailable"
    with pytest.raises(ApiException) as err:
        k8s.custom.replace_namespaced_custom_object(*RC, "default", "rayclusters", "rc", obj)
    assert err.value.status == 409 and status_of(err.value)["reason"] == "Conflict"
    with pytest.raises(ApiException) as err:
        k8s.core.read_namespaced_pod("any", "default")
    assert err.value.status == 500
    # each rule fired once; the same calls now succeed (or 404 for the missing pod)
    k8s.custom.patch_namespaced_custom_object(
        *RC, "default", "rayclusters", "rc", {"metadata": {"labels": {"a": "b"}}}
    )
    with pytest.raises(ApiException) as err:
        k8s.core.read_namespaced_pod("any", "default")
    assert err.value.status == 404


def test_injected_latency_delays_requests(api: KubeAPIServer, k8s: Clients) -> None:
    api.faults.latency("list", "pods", 0.3, times=1)
    t0 = time.monotonic()
    k8s.core.list_namespaced_pod("default")
    assert time.monotonic() - t0 >= 0.3
    t0 = time.monotonic()
    k8s.core.list_namespaced_pod("default")
    assert time.monotonic() - t0 < 0.3


# -- discovery ---------------------------------------------------------------------------------------------


def test_discovery_serves_the_dynamic_client(k8s: Clients) -> None:
    from kubernetes.dynamic import DynamicClient

    dyn = DynamicClient(k8s.api_client)
    nodeclaims = dyn.resources.get(api_version="karpenter.sh/v1", kind="NodeClaim")
    assert nodeclaims.namespaced is False
    nodeclaims.create(body=nodeclaim("dyn"))
    assert [o.metadata.name for o in nodeclaims.get().items] == ["dyn"]
    rayclusters = dyn.resources.get(api_version="ray.io/v1", kind="RayCluster")
    assert rayclusters.namespaced is True
    groups = {g.name for g in client.ApisApi(k8s.api_client).get_api_versions().groups}
    assert {"karpenter.sh", "karpenter.k8s.aws", "ray.io", "apps"} <= groups
