"""A Ray cluster of several nodes on this machine, standing in for cloud nodes of accelerator flavors.

Each node is one ``ray start --block`` process with its own temp dir under one root dir, so that one
node can be stopped without touching the others and ``stop()`` leaves nothing behind. The head is CPU
only; worker nodes declare a flavor's resources (GPU counts, ``accelerator_type:A10G``, ...) and
labels (``rayscale.io/flavor``), which Ray schedules on as if the devices were there.

State lives in ``<root>/cluster.json`` so that separate processes (``rayscale local up`` and a later
``rayscale local node add``) drive the same cluster; ``LocalCluster.attach(root)`` reads it. Every read
and every change of it holds one file lock (``<root>/.lock``), which also orders the threads of one
process. A node id is taken from a per-flavor counter in the state file, and the node is recorded
before its process is spawned, so an id is never handed out twice even when the process that started
a node was killed half-way; ``recover()`` then adopts or removes what such a crash left behind.

Removing a node is graceful: the node is drained through the GCS (Ray's autoscaler drain API: no new
work is scheduled there, Serve moves its replicas away), and stopped once idle or when the grace
period ends, whichever is first.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

LABEL_NODE = "rayscale.io/node"
LABEL_FLAVOR = "rayscale.io/flavor"
LABEL_MANAGED_BY = "rayscale.io/managed-by"
HEAD = "head"
# Test hook: "<point>:<seconds>" pauses every node start at a crash point ("before-spawn": the node is recorded,
# no process yet; "after-spawn": the process runs, its pid is not recorded yet), holding the state lock
# as a real start does there, so that a test can kill the starting process at that very point.
PAUSE_ENV = "RAYSCALE_LOCAL_TEST_PAUSE"
DEFAULT_ROOT = Path("/tmp/rayscale-local")  # short: Ray's unix socket paths must stay under 108 bytes


class LocalClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class LocalFlavor:
    """What one local node of a flavor declares to Ray (no real device is needed)."""

    name: str
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in " /,="):
            raise ValueError(f"flavor name {self.name!r} must be non-empty without spaces, '/', ',' or '='")
        amounts = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        for key, v in amounts.items():
            # Ray refuses fractional node resources; say so before a node fails to start
            if v < 0 or v != int(v):
                raise ValueError(f"flavor {self.name}: {key} must be a whole number >= 0, got {v}")


# One device per node, as the flavors' smallest instance types (rayscale/data/flavors.yaml) have;
# the custom resource names match the catalog's ray_resources.
LOCAL_FLAVORS: dict[str, LocalFlavor] = {
    f.name: f
    for f in (
        LocalFlavor("cpu", 1, 0, {"accelerator_type:CPU": 1}),
        LocalFlavor("a10g", 1, 1, {"accelerator_type:A10G": 1}),
        LocalFlavor("l4", 1, 1, {"accelerator_type:L4": 1}),
        LocalFlavor("l40s", 1, 1, {"accelerator_type:L40S": 1}),
        LocalFlavor("a100", 1, 1, {"accelerator_type:A100": 1}),
        LocalFlavor("h100", 1, 1, {"accelerator_type:H100": 1}),
        LocalFlavor("inf2", 1, 0, {"accelerator_type:Inferentia2": 1, "neuron_cores": 2}),
        LocalFlavor("trn1", 1, 0, {"accelerator_type:Trainium1": 1, "neuron_cores": 2}),
    )
}


def flavor_spec(
    flavor: str | LocalFlavor,
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    resources: Mapping[str, float] | None = None,
    labels: Mapping[str, str] | None = None,
) -> LocalFlavor:
    """A known flavor (or a new name) with overrides; given resources and labels add to the flavor's."""
    base = flavor if isinstance(flavor, LocalFlavor) else LOCAL_FLAVORS.get(flavor, LocalFlavor(flavor))
    return replace(
        base,
        num_cpus=base.num_cpus if num_cpus is None else num_cpus,
        num_gpus=base.num_gpus if num_gpus is None else num_gpus,
        resources={**base.resources, **(resources or {})},
        labels={**base.labels, **(labels or {})},
    )


@dataclass(frozen=True)
class LocalClusterConfig:
    root_dir: Path = DEFAULT_ROOT
    node_ip: str = "127.0.0.2"  # Ray rewrites 127.0.0.1 to the machine's address; .2 stays local
    head_num_cpus: float = 1.0
    head_resources: dict[str, float] = field(default_factory=dict)
    include_dashboard: bool = True
    dashboard_port: int | None = 8265  # taken if free, else any free port; None: any free port
    object_store_memory: int = 256 * 1024**2  # per node: the default, 30% of RAM each, is far too much
    drain_timeout_s: float = 30.0  # how long remove_node waits for a draining node to go idle
    start_timeout_s: float = 120.0
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "root_dir", Path(self.root_dir))
        if len(str(self.root_dir)) > 40:
            raise ValueError(f"root_dir {self.root_dir} is too long for Ray's unix sockets (at most 40 chars)")
        if self.object_store_memory < 80 * 1024**2:
            raise ValueError("object_store_memory must be at least 80 MiB (Ray's minimum is 75 MiB)")
        if self.head_num_cpus < 0 or self.drain_timeout_s < 0 or self.start_timeout_s <= 0:
            raise ValueError("head_num_cpus, drain_timeout_s must be >= 0 and start_timeout_s > 0")


@dataclass
class _NodeRecord:
    id: str
    flavor: str
    # 0: recorded, its process not (yet). Records change under the lock only, so a lock holder that
    # sees 0 knows the starter died between its two saves; the process is then found by its temp dir
    # (``_process``) and ``recover()`` records or removes it.
    pid: int
    create_time: float  # psutil's: tells our process from a later one that reuses the pid
    temp_dir: str
    log: str
    num_cpus: float
    num_gpus: float
    resources: dict[str, float]
    labels: dict[str, str]
    started_at: float
    node_ip: str = ""  # "" (state files from before per-node IPs): the cluster's node_ip


@dataclass(frozen=True)
class LocalNode:
    """A node as the cluster sees it now."""

    id: str  # rayscale's name, e.g. "a10g-1"; "head" for the head
    flavor: str
    is_head: bool
    state: str  # STARTING, ALIVE, IDLE, ACTIVE, DRAINING, DEAD (Ray), EXITED (process gone)
    ray_node_id: str | None
    pid: int
    num_cpus: float
    num_gpus: float
    resources: dict[str, float]
    labels: dict[str, str]
    temp_dir: str
    log: str
    node_ip: str = ""  # the address Ray knows the node by
    # Ray ended it after a drain (its death reason AUTOSCALER_DRAIN_PREEMPTED): it was let go, not lost.
    drained: bool = False

    @property
    def alive(self) -> bool:
        return self.state not in ("DEAD", "EXITED")


# Ports for the nodes' servers come from below the kernel's ephemeral range (ip_local_port_range, 32768-60999 by
# default) and above Ray's worker ports (10002-19999). A port the kernel hands out for ``bind(0)`` and released
# goes back to that range, where every outgoing connection and every Ray process of another cluster on the
# machine (a second test worker's) draws its own: one of them may hold it before `ray start` binds it.
PICKED_PORTS = range(20000, 32000)


def free_port() -> int:
    """A port no socket on any address holds now, picked at random from PICKED_PORTS."""
    rnd = random.SystemRandom()
    for _ in range(200):
        port = rnd.choice(PICKED_PORTS)
        if port_free("", port):
            return port
    raise LocalClusterError(f"no free port in {PICKED_PORTS.start}-{PICKED_PORTS.stop - 1} after 200 tries")


def port_free(ip: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
        return True


def _ray_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "ray"
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]


def _pause(point: str) -> None:
    spec = os.environ.get(PAUSE_ENV, "")
    where, _, seconds = spec.partition(":")
    if where == point:
        time.sleep(float(seconds or 0))


def _create_time(pid: int) -> float:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except psutil.NoSuchProcess:
        return 0.0


def _kill_tree(p: Any, mark: str) -> None:
    """Kills ``p``, its descendants and any process started from ``mark`` (its temp dir, with a slash)."""
    import psutil

    procs = [p]
    with contextlib.suppress(psutil.Error):
        procs += p.children(recursive=True)
    for q in procs:
        with contextlib.suppress(psutil.Error):
            q.kill()
    psutil.wait_procs(procs, timeout=5)
    for q in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(mark in (a or "") for a in (q.info["cmdline"] or [])):
                q.kill()


def _tail(path: str | Path, n: int = 30) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


@contextlib.contextmanager
def _flock(root: Path) -> Iterator[None]:
    """Orders every read and change of cluster.json: between processes (a CLI and a controller, say)
    and between threads of one (each holder opens the file anew, and flock excludes two open files)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class LocalCluster:
    """A head and flavor worker nodes on this machine. Use ``start()`` or ``attach(root)``."""

    def __init__(self, config: LocalClusterConfig | None = None):
        self.config = config or LocalClusterConfig()
        self.root = self.config.root_dir
        self._state_path = self.root / "cluster.json"
        self._gcs: Any = None
        self.address: str = ""  # GCS address, host:port, what ray.init(address=...) takes
        self.dashboard_url: str | None = None
        self._records: dict[str, _NodeRecord] = {}
        self._counter: dict[str, int] = {}
        self._children: dict[str, subprocess.Popen[bytes]] = {}  # nodes this process started
        self._trees: dict[str, list[Any]] = {}  # processes of a node being stopped

    # --- lifecycle ----------------------------------------------------------------------------

    @classmethod
    def attach(cls, root_dir: str | Path = DEFAULT_ROOT) -> LocalCluster:
        """The cluster a previous ``start()`` (maybe in another process) left running under ``root_dir``."""
        state_path = Path(root_dir) / "cluster.json"
        if not state_path.exists():  # looked at first: attaching to nothing must not create the root
            raise LocalClusterError(f"no local cluster at {root_dir} (start one with `rayscale local up`)")
        with _flock(Path(root_dir)):
            try:
                state = json.loads(state_path.read_text())
            except FileNotFoundError:
                raise LocalClusterError(f"no local cluster at {root_dir} (start one with `rayscale local up`)") from None
        cfg = state["config"]
        cfg["root_dir"] = Path(cfg["root_dir"])
        cluster = cls(LocalClusterConfig(**cfg))
        cluster._load(state)
        return cluster

    def start(self) -> LocalCluster:
        """Starts the head and waits until it is up; raises if a cluster already runs under root_dir."""
        if self._state_path.exists():
            try:
                other = LocalCluster.attach(self.root)
            except (LocalClusterError, ValueError, KeyError, TypeError):
                other = None
            if other is not None and other._process_alive(other._records.get(HEAD)):
                raise LocalClusterError(
                    f"a local cluster already runs under {self.root} at {other.address}; "
                    "stop it first (`rayscale local down`)"
                )
            self._cleanup_root()
        self.root.mkdir(parents=True, exist_ok=True)
        ip = self.config.node_ip
        port = free_port()
        self.address = f"{ip}:{port}"
        args = ["--head", f"--port={port}", f"--ray-client-server-port={free_port()}"]
        if self.config.include_dashboard:
            dport = self.config.dashboard_port
            if dport is None or not port_free(ip, dport):
                dport = free_port()
            args += ["--include-dashboard=true", f"--dashboard-host={ip}", f"--dashboard-port={dport}"]
            self.dashboard_url = f"http://{ip}:{dport}"
        else:
            args += ["--include-dashboard=false"]
        head = LocalFlavor(HEAD, self.config.head_num_cpus, 0.0, dict(self.config.head_resources))
        try:
            with self._lock():
                self._records, self._counter = {}, {}
                self._start_locked(HEAD, head, args, ip)
            self.wait_node(HEAD, self.config.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stops every node (workers first, no drain) and removes the root dir; safe to call twice."""
        if self._state_path.exists():
            self._snapshot()  # nodes other processes added since this one last looked
        workers = [r for r in self._records.values() if r.id != HEAD]
        for rec in workers:
            self._signal(rec, signal.SIGTERM)
        for rec in workers:
            self._reap(rec, timeout_s=15.0)
        head = self._records.get(HEAD)
        if head is not None:
            self._signal(head, signal.SIGTERM)
            self._reap(head, timeout_s=20.0)
        self._records.clear()
        self._gcs = None
        self._cleanup_root()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- nodes --------------------------------------------------------------------------------

    def add_node(
        self,
        flavor: str | LocalFlavor,
        resources: Mapping[str, float] | None = None,
        labels: Mapping[str, str] | None = None,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        wait: bool = True,
        timeout_s: float | None = None,
        node_ip: str | None = None,
    ) -> str:
        """Starts a worker node of ``flavor``; returns its id (``<flavor>-<n>``).

        With ``wait`` it returns once the node is registered with Ray (else call ``wait_node``).
        ``node_ip`` gives the node its own address (any 127/8 address is this machine's loopback), so
        that it can be told from the others by IP as a pod is on Kubernetes; the head and the GCS stay
        on ``config.node_ip``. Default: ``config.node_ip``, shared by every node.
        """
        spec = flavor_spec(flavor, num_cpus, num_gpus, resources, labels)
        with self._lock():
            self._reload()
            node_id = self._next_id(spec.name)
            self._start_locked(node_id, spec, [f"--address={self.address}"], node_ip or self.config.node_ip)
        if wait:
            try:
                self.wait_node(node_id, timeout_s or self.config.start_timeout_s)
            except BaseException:
                self.remove_node(node_id, grace_s=0)
                raise
        return node_id

    def wait_node(self, node_id: str, timeout_s: float = 120.0) -> LocalNode:
        """Waits until the node is registered and alive in Ray; raises with its log tail if it dies."""
        rec = self._snapshot_record(node_id)
        deadline = time.monotonic() + timeout_s
        while True:
            if not self._process_alive(rec):
                raise LocalClusterError(f"node {node_id} exited while starting; log {rec.log}:\n{_tail(rec.log)}")
            info = self._ray_nodes(timeout_s=5.0).get(node_id)
            if info is not None and info["alive"]:
                return self._view(rec, info)
            if time.monotonic() > deadline:
                raise LocalClusterError(
                    f"node {node_id} not up after {timeout_s:g} s; log {rec.log}:\n{_tail(rec.log)}"
                )
            time.sleep(0.5)

    def drain_node(self, node_id: str, deadline_s: float | None = None, reason: str = "rayscale remove") -> bool:
        """Asks Ray to drain the node (no new work; Serve moves replicas off); True if accepted."""
        from rayscale.cluster.ray_drain import RayDrainError, drain_node

        if node_id == HEAD:
            raise LocalClusterError("the head cannot be drained; use stop()")
        info = self._ray_nodes().get(node_id)
        if info is None or not info["alive"]:
            return False
        try:
            drain_node(self._gcs_client(), info["ray_node_id"], reason, deadline_s)
        except RayDrainError as e:
            raise LocalClusterError(f"{node_id}: {e}") from e
        return True

    def remove_node(self, node_id: str, grace_s: float | None = None) -> None:
        """Drains the node, waits up to ``grace_s`` (default: config.drain_timeout_s) for it to go idle
        (Ray then stops its raylet), then stops its processes and deletes its files."""
        if node_id == HEAD:
            raise LocalClusterError("the head is removed by stop()")
        rec = self._snapshot_record(node_id)
        grace = self.config.drain_timeout_s if grace_s is None else grace_s
        drained = False
        if grace > 0 and self._process_alive(rec):
            with contextlib.suppress(Exception):  # a node that never registered has nothing to drain
                if self.drain_node(node_id, deadline_s=grace):
                    deadline = time.monotonic() + grace
                    while time.monotonic() < deadline:
                        info = self._ray_nodes().get(node_id)
                        if info is None or not info["alive"]:
                            drained = True
                            break
                        time.sleep(0.5)
        # A drained node's raylet has exited; what is left (`ray start`, log monitor, agents) holds no
        # work, and `ray start` can hang in its SIGTERM handler then, so it is killed outright.
        self._signal(rec, signal.SIGKILL if drained else signal.SIGTERM, whole_tree=drained)
        self._reap(rec, timeout_s=15.0)
        with self._lock():
            self._reload()
            self._records.pop(node_id, None)
            self._save()
        shutil.rmtree(rec.temp_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            Path(rec.log).unlink()

    def nodes(self, include_dead: bool = False) -> list[LocalNode]:
        """Nodes this cluster started, with their state in Ray (head first). Reads only."""
        records = self._snapshot()
        ray_nodes = self._ray_nodes() if records else {}
        out = []
        for rec in sorted(records.values(), key=lambda r: (r.id != HEAD, r.started_at)):
            view = self._view(rec, ray_nodes.get(rec.id))
            if include_dead or view.alive:
                out.append(view)
        return out

    def node(self, node_id: str) -> LocalNode:
        return self._view(self._snapshot_record(node_id), self._ray_nodes().get(node_id))

    def recover(self) -> list[str]:
        """Settles what a killed node start left behind; one line per change. Call it when a controller
        (or anything else that starts nodes) starts: a node whose process runs but was not recorded is
        adopted, one recorded but never started or dead before it joined Ray is removed, and a node
        process no record names is killed. A node that joined Ray and died stays, as EXITED, for its
        owner to replace whole."""
        notes: list[str] = []
        gone: list[str] = []  # node ids whose files go
        with self._lock():
            self._reload()
            ray_nodes = self._ray_nodes()
            for rec in list(self._records.values()):
                p = self._process(rec)
                if rec.pid == 0 and p is not None:
                    rec.pid, rec.create_time = p.pid, _create_time(p.pid)
                    notes.append(f"adopted {rec.id}: its process {p.pid} ran unrecorded (its starter died)")
                elif p is None and rec.id != HEAD and (rec.pid == 0 or (HEAD in ray_nodes and rec.id not in ray_nodes)):
                    self._records.pop(rec.id)
                    gone.append(rec.id)
                    notes.append(f"removed {rec.id}: " + ("recorded, but its starter died before spawning it"
                                                          if rec.pid == 0 else "its process died before it joined Ray"))
            for node_id, p in self._orphans():
                _kill_tree(p, str(self.root / node_id) + "/")
                gone.append(node_id)
                notes.append(f"stopped {node_id}: its process {p.pid} ran with no record")
            if notes:
                self._save()
        for node_id in gone:  # the same paths _new_record gives a node
            shutil.rmtree(self.root / node_id, ignore_errors=True)
            with contextlib.suppress(OSError):
                (self.root / f"{node_id}.log").unlink()
        return notes

    # --- internals ----------------------------------------------------------------------------

    def _snapshot(self) -> dict[str, _NodeRecord]:
        """The records as the state file has them now, read under the lock (a copy: callers iterate it
        while another thread may change the cluster)."""
        with self._lock():
            self._reload()
            return dict(self._records)

    def _snapshot_record(self, node_id: str) -> _NodeRecord:
        records = self._snapshot()
        try:
            return records[node_id]
        except KeyError:
            raise LocalClusterError(f"no node {node_id!r} (have {', '.join(records) or 'none'})") from None

    def _next_id(self, flavor: str) -> str:
        """The flavor's next id from the persisted counter (lock held). Ids of the current nodes do not
        decide it: a node removed, or one whose record a crash lost, must not lend its id to a new one.
        A temp dir on disk (a node the state file does not list) also keeps its id taken."""
        n = self._counter.get(flavor, 0)
        while True:
            n += 1
            node_id = f"{flavor}-{n}"
            if node_id not in self._records and not (self.root / node_id).exists():
                self._counter[flavor] = n
                return node_id

    def _start_locked(self, node_id: str, spec: LocalFlavor, args: list[str], ip: str) -> None:
        """Records the node, spawns it, records its pid (lock held). Saved before the spawn: a crash
        at any point leaves either no process or a record that names it (found by its temp dir)."""
        rec = self._new_record(node_id, spec, ip)
        self._records[node_id] = rec
        self._save()
        _pause("before-spawn")
        try:
            proc = self._spawn(rec, args)
        except BaseException:
            self._records.pop(node_id, None)
            self._save()
            raise
        _pause("after-spawn")
        rec.pid, rec.create_time = proc.pid, _create_time(proc.pid)
        self._save()

    def _orphans(self) -> list[tuple[str, Any]]:
        """`ray start` processes of this root that no record names (lock held): (node id, process)."""
        import psutil

        flag = f"--temp-dir={self.root}/"
        out = []
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                args = p.info["cmdline"] or []
                name = next((a[len(flag):] for a in args if a.startswith(flag)), None)
                if name and "start" in args and name not in self._records:
                    out.append((name, p))
        return out

    def _new_record(self, node_id: str, spec: LocalFlavor, ip: str) -> _NodeRecord:
        labels = {**spec.labels, LABEL_NODE: node_id, LABEL_FLAVOR: spec.name, LABEL_MANAGED_BY: "rayscale"}
        return _NodeRecord(
            id=node_id,
            flavor=spec.name,
            pid=0,
            create_time=0.0,
            temp_dir=str(self.root / node_id),
            log=str(self.root / f"{node_id}.log"),
            num_cpus=spec.num_cpus,
            num_gpus=spec.num_gpus,
            resources=dict(spec.resources),
            labels=labels,
            started_at=time.time(),
            node_ip=ip,
        )

    def _spawn(self, rec: _NodeRecord, args: list[str]) -> subprocess.Popen[bytes]:
        cfg = self.config
        ip, temp_dir, labels = rec.node_ip, Path(rec.temp_dir), rec.labels
        temp_dir.mkdir(parents=True, exist_ok=True)
        (self.root / "tmp").mkdir(exist_ok=True)
        cmd = [
            *_ray_cmd(),
            "start",
            "--block",
            *args,
            f"--node-ip-address={ip}",
            f"--temp-dir={temp_dir}",
            f"--num-cpus={rec.num_cpus:g}",
            f"--num-gpus={rec.num_gpus:g}",
            f"--resources={json.dumps(rec.resources)}",
            f"--labels={','.join(f'{k}={v}' for k, v in labels.items())}",
            f"--object-store-memory={cfg.object_store_memory}",
            # several nodes share one address: let each pick its own ports
            "--min-worker-port=0",
            "--max-worker-port=0",
            "--dashboard-agent-listen-port=0",
            "--disable-usage-stats",
        ]
        env = {
            **os.environ,
            **cfg.env,
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray turns token auth on whenever ~/.ray/auth_token exists (any earlier ray.init() writes
            # it); then clients need the token too. The cluster listens on a loopback address only, so
            # it runs without, and every client works whatever its own auth mode.
            "RAY_AUTH_MODE": "disabled",
            # Ray workers and vLLM write scratch files under TMPDIR: keep them in the root, which stop() removes
            "TMPDIR": str(self.root / "tmp"),
            # remove_node drains through the GCS itself; the SIGTERM handler's own drain would wait on
            # a raylet that is already gone
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        }
        with open(rec.log, "ab") as out:
            # own session: the node outlives this process (CLI `up`), and Ctrl-C here does not reach it
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._children[rec.id] = proc  # waited for in _reap so no zombie is left behind
        return proc

    def _process(self, rec: _NodeRecord | None) -> Any:
        import psutil

        if rec is None:
            return None
        if rec.pid == 0:  # recorded, pid not (its starter died, or a reader looks at a crash's leftover)
            flag = f"--temp-dir={rec.temp_dir}"
            for q in psutil.process_iter(["cmdline"]):
                with contextlib.suppress(psutil.Error):
                    if flag in (q.info["cmdline"] or []) and q.status() != psutil.STATUS_ZOMBIE:
                        return q
            return None
        try:
            p = psutil.Process(rec.pid)
            if rec.create_time and abs(p.create_time() - rec.create_time) > 1.0:
                return None  # the pid now belongs to someone else
            if p.status() == psutil.STATUS_ZOMBIE:
                return None
            return p
        except psutil.NoSuchProcess:
            return None

    def _process_alive(self, rec: _NodeRecord | None) -> bool:
        return self._process(rec) is not None

    def _signal(self, rec: _NodeRecord, sig: signal.Signals, whole_tree: bool = False) -> None:
        p = self._process(rec)
        if p is None:
            return
        # remember the tree now: Ray workers start their own process groups, so killpg would miss them
        tree = [p]
        with contextlib.suppress(Exception):
            tree += p.children(recursive=True)
        self._trees[rec.id] = tree
        for q in tree if whole_tree else [p]:
            with contextlib.suppress(Exception):
                q.send_signal(sig)

    def _reap(self, rec: _NodeRecord, timeout_s: float) -> None:
        import psutil

        procs = self._trees.pop(rec.id, None)
        if procs is None:
            p = self._process(rec)
            procs = [] if p is None else [p, *p.children(recursive=True)]
        child = self._children.pop(rec.id, None)
        _, alive = psutil.wait_procs(procs, timeout=timeout_s)
        for p in alive:  # graceful stop overran: force it
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
        # children spawned after we looked (raylet starting a worker while stopping)
        mark = rec.temp_dir.rstrip("/") + "/"
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if any(mark in (a or "") for a in (p.info["cmdline"] or [])):
                    p.kill()
        if child is not None:
            with contextlib.suppress(Exception):
                child.wait(timeout=5)

    def _gcs_client(self) -> Any:
        if self._gcs is None:
            from rayscale.cluster.ray_drain import gcs_client

            self._gcs = gcs_client(self.address)
        return self._gcs

    def _ray_nodes(self, timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
        """Nodes in the GCS keyed by our node id (from the label); the newest entry wins."""
        from ray.core.generated import gcs_pb2

        try:
            infos = self._gcs_client().get_all_node_info(timeout=timeout_s)
        except Exception:
            return {}  # GCS not (yet) reachable: nodes show as STARTING or EXITED
        out: dict[str, dict[str, Any]] = {}
        for nid, info in infos.items():
            name = info.labels.get(LABEL_NODE)
            if name is None:
                continue
            alive = info.state == gcs_pb2.GcsNodeInfo.ALIVE  # type: ignore[attr-defined]
            snap = info.state_snapshot.state if info.HasField("state_snapshot") else None
            state = "DEAD"
            if alive:
                state = "ALIVE"
                if snap is not None:
                    state = gcs_pb2.NodeSnapshot.State.Name(snap)  # type: ignore[attr-defined]
                    state = "ALIVE" if state == "UNDEFINED" else state
            entry = {
                "ray_node_id": nid.hex(),
                "alive": alive,
                "state": state,
                "start_ms": info.start_time_ms,
                "resources": dict(info.resources_total),
                "labels": dict(info.labels),
                "drained": not alive and info.HasField("death_info")
                and info.death_info.Reason.Name(info.death_info.reason) == "AUTOSCALER_DRAIN_PREEMPTED",
            }
            prev = out.get(name)
            if prev is None or (entry["alive"], entry["start_ms"]) > (prev["alive"], prev["start_ms"]):
                out[name] = entry
        return out

    def _view(self, rec: _NodeRecord, info: dict[str, Any] | None) -> LocalNode:
        proc = self._process(rec)
        if proc is None:
            state = "EXITED"
        elif info is None:
            state = "STARTING"
        else:
            state = info["state"]
        return LocalNode(
            id=rec.id,
            flavor=rec.flavor,
            is_head=rec.id == HEAD,
            state=state,
            ray_node_id=info["ray_node_id"] if info else None,
            pid=proc.pid if proc is not None else rec.pid,
            num_cpus=rec.num_cpus,
            num_gpus=rec.num_gpus,
            resources=dict(info["resources"]) if info else dict(rec.resources),
            labels=dict(info["labels"]) if info else dict(rec.labels),
            temp_dir=rec.temp_dir,
            log=rec.log,
            node_ip=rec.node_ip or self.config.node_ip,
            drained=bool(info and info.get("drained")),
        )

    def _lock(self) -> contextlib.AbstractContextManager[None]:
        """Not reentrant: a holder must not take it again (that would wait for itself)."""
        return _flock(self.root)

    def _save(self) -> None:
        cfg = asdict(self.config)
        cfg["root_dir"] = str(self.config.root_dir)
        state = {
            "config": cfg,
            "address": self.address,
            "dashboard_url": self.dashboard_url,
            "counter": self._counter,
            "nodes": [asdict(r) for r in self._records.values()],
        }
        tmp = self._state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self._state_path)  # atomic: a reader never sees half a file

    def _load(self, state: dict[str, Any]) -> None:
        self.address = state["address"]
        self.dashboard_url = state.get("dashboard_url")
        self._counter = dict(state.get("counter", {}))
        self._records = {r["id"]: _NodeRecord(**r) for r in state["nodes"]}

    def _reload(self) -> None:
        """Lock held: the caller's view becomes the file's (never merged with what this process had)."""
        if self._state_path.exists():
            self._load(json.loads(self._state_path.read_text()))

    def _cleanup_root(self) -> None:
        if self.root.exists():
            # leftovers of an earlier run that died without stop(): end what still runs from here
            import psutil

            root = str(self.root) + "/"
            for p in psutil.process_iter(["cmdline"]):
                with contextlib.suppress(psutil.Error):
                    if p.pid != os.getpid() and any(root in (a or "") for a in (p.info["cmdline"] or [])):
                        p.kill()
            shutil.rmtree(self.root, ignore_errors=True)


__all__ = [
    "DEFAULT_ROOT",
    "LABEL_FLAVOR",
    "LABEL_NODE",
    "LOCAL_FLAVORS",
    "LocalCluster",
    "LocalClusterConfig",
    "LocalClusterError",
    "LocalFlavor",
    "LocalNode",
    "flavor_spec",
]
