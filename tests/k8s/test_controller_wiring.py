"""`rayscale controller --actuator kube` wired as a pod runs it: the official client configured from a
kubeconfig (off the cluster; in a pod `load_incluster_config` reads the same server and token from the
service account), the actuator, the Lease that picks
the acting replica and the ConfigMap checkpoint, all over real HTTP to the API emulator."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.config import kube_config
from rayscale_testing.kubeapi import KubeAPIServer

from rayscale.cli import build_parser
from rayscale.cluster.kube.actuator import KubeActuator
from rayscale.commands.controller import _kube_wiring, _Usage
from rayscale.core.catalog import Catalog
from rayscale.core.settings import Settings

NS = "serving"


def _kubeconfig(tmp_path: Path, server: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": server}}],
        "users": [{"name": "t", "user": {"token": "t"}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
    return str(path)


@pytest.fixture
def kube_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeAPIServer]:
    api = KubeAPIServer(default_watch_timeout=10, namespaces=("default", NS)).start()
    # The client reads $KUBECONFIG once, when it is imported: the default location is what a later one sets.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", _kubeconfig(tmp_path, api.url))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: the kubeconfig is read
    monkeypatch.setenv("POD_NAME", "rayscale-controller-0")
    yield api
    client.Configuration.set_default(client.Configuration())  # load_kube_config set the process's default
    api.stop()


def test_the_kube_controller_acts_through_the_configured_api_server(kube_env: KubeAPIServer,
                                                                    catalog: Catalog) -> None:
    args = build_parser().parse_args(["controller", "--actuator", "kube", "--namespace", NS, "--rayservice", "llm",
                                      "--dashboard", f"http://llm-head-svc.{NS}:8265", "--ray-gcs", "none"])
    wiring = _kube_wiring(args, catalog, Settings())
    try:
        assert isinstance(wiring.actuator, KubeActuator)
        # The driver reaches the cluster through Ray Client on the dashboard's head Service.
        assert wiring.address == f"ray://llm-head-svc.{NS}:10001"
        assert wiring.leader is not None and wiring.leader()
        seen = kube_env.api_client()
        lease = client.CoordinationV1Api(seen).read_namespaced_lease("rayscale-controller", NS)
        assert lease.spec is not None and lease.spec.holder_identity == "rayscale-controller-0"
        assert wiring.store is not None and wiring.store.read() is None
        wiring.store.write('{"version": 1}')
        assert wiring.store.read() == '{"version": 1}'
        assert client.CoreV1Api(seen).list_namespaced_config_map(NS).items, "the checkpoint: a ConfigMap there"
    finally:
        wiring.actuator.close()


def test_the_kube_controller_without_a_dashboard_is_a_usage_error_and_checkpoint_none_keeps_none(
        kube_env: KubeAPIServer, catalog: Catalog) -> None:
    parse = build_parser().parse_args
    with pytest.raises(_Usage, match="--dashboard is required"):
        _kube_wiring(parse(["controller", "--actuator", "kube", "--namespace", NS]), catalog, Settings())
    wiring = _kube_wiring(parse(["controller", "--actuator", "kube", "--namespace", NS, "--dashboard",
                                 "http://head:8265", "--checkpoint", "none", "--ray-gcs", "none"]),
                          catalog, Settings())
    try:
        assert wiring.store is None and wiring.address == "ray://head:10001"
    finally:
        wiring.actuator.close()
