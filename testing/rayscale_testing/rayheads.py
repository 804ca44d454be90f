"""Ray heads of their own, for probes that need a cluster beside the session's.

A probe runs in a subprocess (a driver's Ray state and Ray's auth mode are per process), in a temp dir of
its own so that its sessions, sockets and address file never meet the session cluster's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rayscale.cluster.local import free_port  # re-exported to the probes

NODE_IP = "127.0.0.2"  # Ray rewrites 127.0.0.1 to the machine address; 127.0.0.2 stays loopback


@contextmanager
def own_temp_dir(prefix: str) -> Iterator[str]:
    """A temp dir for Ray (RAY_TMPDIR, TMPDIR) for the rest of this process, removed at the end."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.makedirs(os.path.join(tmp, "ray"))
    os.environ["RAY_TMPDIR"] = os.environ["TMPDIR"] = tmp
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def start_head(tmp: str, **args: Any) -> Any:
    """A one-CPU Ray head on NODE_IP with free ports (``args`` override or add head node arguments)."""
    from ray.cluster_utils import Cluster

    return Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 0, "node_ip_address": NODE_IP, "temp_dir": tmp, "gcs_server_port": free_port(),
        "metrics_export_port": free_port(), "object_store_memory": 80 * 2**20, **args})
