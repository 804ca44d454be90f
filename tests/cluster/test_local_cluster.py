"""The local cluster with real Ray: flavor nodes, scheduling on them, drain and removal, cleanup.

Ray work runs in a separate driver process so that this module does not depend on (or disturb) any
Ray connection the rest of the test session holds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from rayscale_testing.waits import wait_for

from rayscale.cluster import local as local_cluster
from rayscale.cluster.actuator import LABEL_CREATED, LABEL_GANG, LABEL_MODEL, LABEL_OWNER, LABEL_SIZE, OWNER
from rayscale.cluster.local import PAUSE_ENV, LocalCluster, LocalClusterConfig, LocalClusterError, free_port
from rayscale.cluster.local_actuator import LocalActuator, LocalActuatorConfig
from rayscale.cluster.ray_drain import GcsDrainer, RayDrainError
from rayscale.core.act import CreateGang, GangPhase

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


def _add_node_killed_at(point: str, flavor: str, ready: Callable[[], object]) -> None:
    """`rayscale local node add` in its own process, SIGKILLed while it pauses at ``point`` of the start."""
    env = {**os.environ, PAUSE_ENV: f"{point}:60"}
    cmd = [sys.executable, "-m", "rayscale.cli", "local", "node", "add", "--flavor", flavor, "--root", str(ROOT)]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: ready() or p.poll() is not None, 60, f"the start to reach {point}")
        assert p.poll() is None, p.stderr.read().decode()[-2000:] if p.stderr else ""
    finally:
        p.kill()
        p.communicate(timeout=10)


def _ray_start_of(node_id: str) -> list[psutil.Process]:
    flag = f"--temp-dir={ROOT}/{node_id}"
    return [q for q in processes_under(ROOT) if flag in q.cmdline()]


def _state() -> dict[str, Any]:
    return dict(json.loads((ROOT / "cluster.json").read_text()))


def test_start_killed_after_spawn_is_adopted_and_its_id_stays_taken(cluster: LocalCluster) -> None:
    # The starter dies after `ray start` is spawned, before its pid is recorded: the node runs on.
    _add_node_killed_at("after-spawn", "l40s", lambda: _ray_start_of("l40s-1"))
    (proc,) = _ray_start_of("l40s-1")
    assert [r["pid"] for r in _state()["nodes"] if r["id"] == "l40s-1"] == [0]
    # Reads see it (found by its temp dir) and write nothing, the actuator's gangs() included.
    before = (ROOT / "cluster.json").read_bytes()
    (seen,) = [n for n in cluster.nodes(include_dead=True) if n.id == "l40s-1"]
    assert seen.alive and seen.pid == proc.pid
    LocalActuator(cluster).gangs(time.time())
    assert (ROOT / "cluster.json").read_bytes() == before
    # The next start of the flavor takes a new id, whatever the old start left.
    assert cluster.add_node("l40s", wait=False) == "l40s-2"
    notes = cluster.recover()
    assert any(n.startswith("adopted l40s-1") for n in notes), notes
    assert [r["pid"] for r in _state()["nodes"] if r["id"] == "l40s-1"] == [proc.pid]
    assert cluster.recover() == []  # settled: nothing more to do
    adopted = cluster.wait_node("l40s-1", timeout_s=90)
    assert adopted.ray_node_id and adopted.pid == proc.pid
    for node_id in ("l40s-2", "l40s-1"):
        cluster.remove_node(node_id, grace_s=0)
    assert _ray_start_of("l40s-1") == [] and _ray_start_of("l40s-2") == []


def test_start_killed_before_spawn_is_removed_and_its_id_not_reused(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    # The starter dies after recording the node, before spawning it: nothing runs for that record.
    _add_node_killed_at("before-spawn", "trn1", lambda: any(r["id"] == "trn1-1" for r in _state()["nodes"]))
    assert _ray_start_of("trn1-1") == []
    (seen,) = [n for n in cluster.nodes(include_dead=True) if n.id == "trn1-1"]
    assert seen.state == "EXITED"
    assert main(["local", "node", "recover", "--root", str(ROOT)]) == 0
    assert capsys.readouterr().out.strip() == "removed trn1-1: recorded, but its starter died before spawning it"
    assert cluster.recover() == []
    assert "trn1-1" not in [n.id for n in cluster.nodes(include_dead=True)]
    assert not (ROOT / "trn1-1").exists()
    # The id stays spent although no node, record or directory carries it any more.
    assert cluster.add_node("trn1", wait=False) == "trn1-2"
    cluster.remove_node("trn1-2", grace_s=0)


def test_node_process_without_record_is_stopped_by_recover(cluster: LocalCluster) -> None:
    # A record lost while its process runs (what an unlocked reader's stale write used to do)
    node_id = cluster.add_node("h100", wait=False)
    (proc,) = _ray_start_of(node_id)
    with cluster._lock():
        state = _state()
        state["nodes"] = [r for r in state["nodes"] if r["id"] != node_id]
        (ROOT / "cluster.json").write_text(json.dumps(state))
    assert node_id not in [n.id for n in cluster.nodes(include_dead=True)]
    assert cluster.recover() == [f"stopped {node_id}: its process {proc.pid} ran with no record"]
    assert processes_under(ROOT / node_id) == [] and not (ROOT / node_id).exists()
    # the counter, not the node list, gives ids
    assert cluster.add_node("h100", wait=False) == "h100-2"
    cluster.remove_node("h100-2", grace_s=0)


def test_actuator_recover_starts_the_rest_of_a_partial_gang(cluster: LocalCluster) -> None:
    # A controller died between the two nodes of a gang: one runs, its launcher is gone.
    labels = {LABEL_OWNER: OWNER, LABEL_GANG: "g-a100", LABEL_MODEL: "m", LABEL_SIZE: "2",
              LABEL_CREATED: f"{time.time():.3f}"}
    cluster.add_node("a100", labels=labels, wait=False)
    act = LocalActuator(cluster, LocalActuatorConfig(max_worker_nodes=3, drain_grace_s=0))
    try:
        assert act.recover(time.time()) == ["resumed g-a100: 1 of 2 nodes had started"]
        (gang,) = wait_for(lambda: [g for g in act.gangs(time.time()) if g.phase == GangPhase.READY], 120,
                           "the resumed gang to be ready")
        assert gang.name == "g-a100" and gang.nodes == 2 and len(set(gang.node_ids)) == 2
        assert sorted(n.id for n in cluster.nodes() if not n.is_head) == ["a100-1", "a100-2"]
        assert act.recover(time.time()) == []  # whole now: nothing to resume
        act.delete_gang("g-a100")
        wait_for(lambda: [n.id for n in cluster.nodes(include_dead=True)] == ["head"], 60, "the gang to go")
    finally:
        act.close()


def test_actuator_drains_a_gang_through_ray_and_reads_it_draining_until_deleted(cluster: LocalCluster) -> None:
    """DrainGang: Ray's DrainNode (reason preemption) marks every member draining; the gang reads READY and
    draining while work runs there, and still after Ray stops the drained node once idle (its drain done, not
    a lost node, so no FAILED gang and no back-off)."""
    act = LocalActuator(cluster, LocalActuatorConfig(max_worker_nodes=3, drain_grace_s=0))
    try:
        act.create_gang(CreateGang("g-drain", "m", "a10g", "on-demand", "local", "local-a10g", 1, "test"),
                        time.time())
        (gang,) = wait_for(lambda: [g for g in act.gangs(time.time()) if g.phase == GangPhase.READY], 120,
                           "the gang to be ready")
        assert not gang.draining
        driver(cluster.address, """
            @ray.remote(num_gpus=1, num_cpus=0, lifetime="detached", name="busy", namespace="t")
            class Busy:
                def ok(self):
                    return 1
            print(json.dumps({"ok": ray.get(Busy.remote().ok.remote(), timeout=60)}))
            """)
        act.drain_gang("g-drain")
        node_id = next(n.id for n in cluster.nodes() if n.labels.get(LABEL_GANG) == "g-drain")
        wait_for(lambda: cluster.node(node_id).state == "DRAINING", 30, "Ray to mark the node draining")
        (gang,) = act.gangs(time.time())
        assert gang.draining and gang.phase == GangPhase.READY and gang.node_ids
        driver(cluster.address, 'ray.kill(ray.get_actor("busy", namespace="t")); print(json.dumps({}))')
        wait_for(lambda: not cluster.node(node_id).alive, 60, "Ray to stop the drained node once idle")
        (gang,) = act.gangs(time.time())
        assert gang.draining and gang.phase == GangPhase.READY
        # A restarted controller's actuator knows nothing of the drain: Ray's death reason tells it.
        assert cluster.node(node_id).drained
        (gang,) = LocalActuator(cluster, LocalActuatorConfig(max_worker_nodes=3)).gangs(time.time())
        assert gang.draining and gang.phase == GangPhase.READY
        act.delete_gang("g-drain")
        wait_for(lambda: [n.id for n in cluster.nodes(include_dead=True)] == ["head"], 60, "the gang to go")
    finally:
        act.close()


def test_reads_wait_for_the_state_lock(cluster: LocalCluster) -> None:
    # Another process holds the lock, as a writer does between reading and writing cluster.json: a
    # reader waits for it rather than act on a state about to change.
    code = (f"import fcntl, time; f = open({str(ROOT / '.lock')!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('locked', flush=True); time.sleep(2)")
    readers: list[Callable[[], object]] = [cluster.nodes, lambda: cluster.node("head"), lambda: LocalCluster.attach(ROOT)]
    for read in readers:
        holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
            start = time.monotonic()
            read()
            assert time.monotonic() - start > 1.0
        finally:
            holder.wait(10)


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


def test_gcs_drainer_drains_the_ray_node_at_an_ip(cluster: LocalCluster) -> None:
    """What the Kubernetes actuator drains a gang's pods through: each Ray node found by its IP (a pod's,
    on Kubernetes) in the GCS, and asked to drain there."""
    node_id = cluster.add_node("l40s", node_ip="127.0.0.9")
    drainer = GcsDrainer(address=cluster.address)
    with pytest.raises(RayDrainError, match=f"no alive Ray node at 127.0.0.99 in the GCS at {cluster.address}"):
        drainer.drain("rc", ["127.0.0.99"], "rayscale drain g")
    assert cluster.node(node_id).state != "DRAINING"
    drainer.drain("rc", ["127.0.0.9"], "rayscale drain g")
    # Idle, it exits once drained, and Ray records the drain as the reason it went.
    wait_for(lambda: cluster.node(node_id).state == "DRAINING" or cluster.node(node_id).drained, 30,
             "Ray to drain the node")
    cluster.remove_node(node_id, grace_s=0)


def test_gcs_drainer_names_an_unreachable_gcs_and_asks_anew() -> None:
    """A GCS that cannot be reached (a head pod restarting behind its Service) is a RayDrainError naming it,
    and no client is kept for it: the next period's drain connects again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    drainer = GcsDrainer(address=address)
    with pytest.raises(RayDrainError, match=f"the GCS at {address} could not be asked for cluster rc's nodes"):
        drainer.drain("rc", ["127.0.0.9"], "rayscale drain g")
    assert drainer._clients == {}

    class _Gone:  # a client kept from before the head restarted: its GCS no longer answers
        def get_all_node_info(self, timeout: float) -> dict[Any, Any]:
            raise ConnectionError("Failed to connect to GCS")

    drainer._clients[address] = _Gone()
    with pytest.raises(RayDrainError, match="Failed to connect to GCS"):
        drainer.drain("rc", ["127.0.0.9"], "rayscale drain g")
    assert drainer._clients == {}


def test_free_ports_come_from_outside_the_kernels_ephemeral_range_and_skip_held_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(20):
        port = free_port()
        assert port in local_cluster.PICKED_PORTS and not lo <= port <= hi
        with socket.socket() as s:
            s.bind(("127.0.0.2", port))
    with socket.socket() as held:
        held.bind(("127.0.0.2", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(local_cluster, "PICKED_PORTS", range(taken, taken + 2))
        assert {free_port() for _ in range(10)} == {taken + 1}
        monkeypatch.setattr(local_cluster, "PICKED_PORTS", range(taken, taken + 1))
        with pytest.raises(LocalClusterError, match="no free port"):
            free_port()
