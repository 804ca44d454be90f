"""The local cluster with real Ray: flavor nodes, scheduling on them, drain and removal, cleanup.

Ray work runs in a separate driver process so that this module does not depend on (or disturb) any
Ray connection the rest of the test session holds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from rayscale.cluster.local import LocalCluster, LocalClusterConfig, LocalClusterError

ROOT = Path("/tmp/rs-test-local")


def main(argv: list[str]) -> int:
    """`rayscale local ...` through the command module's own parser."""
    from rayscale.commands import local

    parser = argparse.ArgumentParser(prog="rayscale")
    local.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.handler(args))


def processes_under(root: Path) -> list[psutil.Process]:
    mark = str(root) + "/"
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(mark in (a or "") for a in (p.info["cmdline"] or [])):
                out.append(p)
        except psutil.Error:
            pass
    return out


def driver(address: str, body: str, timeout_s: float = 90.0) -> dict[str, object]:
    """Runs ``body`` as a Ray driver against ``address``; it prints one JSON line as its result."""
    code = "import json, ray\n" f"ray.init(address={address!r}, logging_level='ERROR')\n" + textwrap.dedent(body)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(LocalClusterConfig(root_dir=ROOT, include_dashboard=False, drain_timeout_s=10))
    c.start()
    try:
        yield c
    finally:
        c.stop()
        # stop() leaves nothing: no process started from the root, no files
        assert processes_under(ROOT) == []
        assert not ROOT.exists()


def test_head_is_cpu_only_and_labelled(cluster: LocalCluster) -> None:
    (head,) = [n for n in cluster.nodes() if n.is_head]
    assert head.alive and head.ray_node_id
    assert head.resources.get("CPU") == 1.0 and "GPU" not in head.resources
    assert head.labels["rayscale.io/node"] == "head"
    with pytest.raises(LocalClusterError, match="already runs"):
        LocalCluster(LocalClusterConfig(root_dir=ROOT)).start()


def test_flavor_node_takes_flavor_work_then_drains_and_goes(cluster: LocalCluster) -> None:
    node_id = cluster.add_node("a10g", labels={"zone": "local-a"}, resources={"slots": 3})
    assert node_id == "a10g-1"
    node = cluster.node(node_id)
    assert node.alive and node.ray_node_id
    assert node.resources["GPU"] == 1.0 and node.resources["accelerator_type:A10G"] == 1.0
    assert node.resources["slots"] == 3.0
    assert node.labels["rayscale.io/flavor"] == "a10g" and node.labels["zone"] == "local-a"

    # the flavor's resource and its label both steer work onto that node, and nowhere else
    got = driver(
        cluster.address,
        """
        where = lambda: ray.get_runtime_context().get_node_id()
        task = ray.remote(resources={"accelerator_type:A10G": 1}, num_cpus=0)(where)
        by_label = ray.remote(num_cpus=0, label_selector={"rayscale.io/flavor": "a10g"})(where)

        @ray.remote(num_gpus=1, num_cpus=0, lifetime="detached", name="holder", namespace="t")
        class Holder:
            def where(self):
                return ray.get_runtime_context().get_node_id()

        h = Holder.remote()
        print(json.dumps({
            "task": ray.get(task.remote(), timeout=60),
            "label": ray.get(by_label.remote(), timeout=60),
            "actor": ray.get(h.where.remote(), timeout=60),
        }))
        """,
    )
    assert got == {"task": node.ray_node_id, "label": node.ray_node_id, "actor": node.ray_node_id}

    # the detached actor keeps the node busy: a drain is accepted and the node stays, draining
    assert cluster.drain_node(node_id, deadline_s=60)
    deadline = time.monotonic() + 20
    while cluster.node(node_id).state != "DRAINING":
        assert time.monotonic() < deadline, cluster.node(node_id)
        time.sleep(0.5)
    pid = node.pid
    before = set(processes_under(Path(node.temp_dir)))
    assert before

    start = time.monotonic()
    cluster.remove_node(node_id, grace_s=2)  # the actor never leaves: the grace period ends it
    assert time.monotonic() - start < 25
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert processes_under(Path(node.temp_dir)) == []
    assert not Path(node.temp_dir).exists()
    assert node_id not in [n.id for n in cluster.nodes(include_dead=True)]
    # Ray agrees: the node is dead, so nothing can run on A10G any more
    assert cluster._ray_nodes()[node_id]["alive"] is False


def test_idle_node_removal_is_quick_and_ids_do_not_repeat(cluster: LocalCluster) -> None:
    node_id = cluster.add_node("inf2")
    assert node_id == "inf2-1"
    assert cluster.node(node_id).resources["neuron_cores"] == 2.0
    start = time.monotonic()
    cluster.remove_node(node_id)  # idle: the drain completes at once
    assert time.monotonic() - start < 10
    assert cluster.add_node("inf2", wait=False) == "inf2-2"
    cluster.wait_node("inf2-2", timeout_s=60)
    cluster.remove_node("inf2-2", grace_s=0)


def test_node_that_cannot_start_reports_its_log(cluster: LocalCluster) -> None:
    with pytest.raises(LocalClusterError, match="exited while starting") as ei:
        cluster.add_node("cpu", labels={"bad key!": "x"})  # Ray rejects the label
    assert "cpu-1" in str(ei.value)
    assert "cpu-1" not in [n.id for n in cluster.nodes(include_dead=True)]
    with pytest.raises(ValueError, match="GPU"):
        cluster.add_node("cpu", num_gpus=-1)
    with pytest.raises(ValueError, match="whole number"):
        cluster.add_node("cpu", resources={"slots": 0.5})


def test_cli_drives_the_same_cluster(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    root = ["--root", str(ROOT)]
    assert main(["local", "node", "add", "--flavor", "l4", "--gpus", "2", "--labels", "team=a", *root]) == 0
    node_id = capsys.readouterr().out.strip()
    assert node_id == "l4-1"
    assert main(["local", "node", "list", *root]) == 0
    table = capsys.readouterr().out
    assert "l4-1" in table and "head" in table and "accelerator_type:L4=1" in table
    assert main(["local", "node", "list", "--json", *root]) == 0
    listed = {n["id"]: n for n in json.loads(capsys.readouterr().out)}
    assert listed["l4-1"]["resources"]["GPU"] == 2.0 and listed["l4-1"]["labels"]["team"] == "a"
    assert main(["local", "node", "remove", "l4-1", *root]) == 0
    assert main(["local", "node", "remove", "l4-1", *root]) == 1
    assert "no node 'l4-1'" in capsys.readouterr().err
    assert main(["local", "node", "add", "--flavor", "x", "--resources", "[1]", *root]) == 1
    assert [n.id for n in cluster.nodes()] == ["head"]


def test_cli_without_cluster_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["local", "node", "list", "--root", str(tmp_path / "none")]) == 1
    assert "no local cluster" in capsys.readouterr().err
