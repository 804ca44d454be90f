"""The controller's Ray driver follows Serve from one Ray cluster to another through Ray Client.

The rendered controller runs in its own pod, with no raylet: Ray 2.60 attaches a driver given a GCS address
to a raylet on the driver's own host (``get_node_to_connect_for_driver`` in ray/_private/services.py) and
fails without one. So on Kubernetes the controller connects with Ray Client (``ray://``, port ``client`` of
KubeRay's head Service), and after a RayService cut-over ``reconnect_ray`` moves it to the new cluster. Here
two real Ray clusters run side by side, each with its Ray Client server; the probe follows from one to the
other and back, in its own process (the session's driver stays on the session cluster).
"""

from __future__ import annotations

import json
import subprocess
import sys

FOLLOW_PROBE = """
import glob, json, sys, time
import ray
from rayscale_testing.rayheads import free_port, own_temp_dir, start_head
from rayscale.commands.controller import _connected_endpoints, reconnect_ray
from rayscale.serve.weights import get_store, set_flavor_weights

clusters, out = {}, {}
with own_temp_dir("rs-follow-") as tmp:
    try:
        for name in ("first", "second"):
            ports = {"client": free_port(), "metrics": free_port()}
            clusters[name] = (start_head(tmp, include_dashboard=False, ray_client_server_port=ports["client"],
                                         metrics_export_port=ports["metrics"]), ports)
        # A dashboard URL as Actuator.serve_dashboard names it: only its host is used.
        for name in ("first", "second", "first"):
            cluster, ports = clusters[name]
            for attempt in range(3):  # as the controller does: a failed follow is tried again next period
                try:
                    reconnect_ray("http://127.0.0.2:8265/", ports["client"])
                    break
                except ConnectionError as e:
                    print("retrying after:", e, file=sys.stderr)
                    time.sleep(2)
            step = {"client": ray.util.client.ray.is_connected(), "metrics": ports["metrics"],
                    "endpoints": _connected_endpoints(),  # what the controller's scraper asks for
                    "store": ray.get(get_store("rs-follow").get.remote(), timeout=60)[1]}
            set_flavor_weights("rs-follow", "m", {name: 1.0})
            out.setdefault(name, []).append(step)
        ray.shutdown()
        print("RESULT " + json.dumps(out))
    except Exception:  # what Ray Client's servers said, for the failure message
        for log in sorted(glob.glob(tmp + "/**/ray_client_server*.err", recursive=True)):
            print(log, open(log).read()[-1500:], file=sys.stderr)
        raise
    finally:
        for cluster, _ in clusters.values():
            cluster.shutdown()
"""


def test_reconnect_ray_moves_node_discovery_and_routing_weights_to_the_new_cluster() -> None:
    proc = subprocess.run([sys.executable, "-c", FOLLOW_PROBE], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-6000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    first, second, back = out["first"][0], out["second"][0], out["first"][1]
    assert first["client"] and second["client"] and back["client"]  # Ray Client, not a local raylet
    # Node discovery reads the cluster the driver follows, never the one it left.
    for step in (first, second, back):
        ports = {url.rsplit(":", 1)[1].split("/")[0] for url in step["endpoints"]}
        assert ports == {str(step["metrics"])}, step
    # Routing weights land in the followed cluster's store: the second starts empty, the first kept its own.
    assert first["store"] == {} and second["store"] == {}
    assert back["store"] == {"m": {"first": 1.0}}
