"""The Serve part of each cluster's Ray dashboard, over HTTP, in front of a ``ServeModel``.

One local server stands in for every cluster's dashboard: ``{url}/clusters/{cluster}`` is the dashboard of
the RayCluster ``cluster`` (on Kubernetes, KubeRay's head Service of that cluster, port 8265), so a client
given ``template`` (``{url}/clusters/{cluster}``) reaches the cluster it names. Routes, as Ray's
``dashboard/modules/serve/serve_head.py`` serves them:

- ``POST /api/v1/applications/{app}/deployments/{dep}/scale`` with ``{"target_num_replicas": n}``:
  ``ServeModel.scale``; 200, or the code Ray answers (400 bad body, 404 no such application or
  deployment, 412 no ``external_scaler_enabled``); 503 ("Serve controller is not available") for a
  cluster nothing was submitted to yet;
- ``GET /api/serve/applications/``: ``ServeModel.details``.

With ``token`` set, a request without ``Authorization: Bearer <token>`` gets 401 (none) or 403 (another),
as Ray's token middleware answers (``ray/_private/authentication/http_token_authentication.py``).
Requests are served one at a time (the model is not shared with another writer while one runs).
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from rayscale_testing.rayservice import ServeHTTPError, ServeModel

_SCALE = re.compile(r"^/clusters/([^/]+)/api/v1/applications/([^/]+)/deployments/([^/]+)/scale/?$")
_DETAILS = re.compile(r"^/clusters/([^/]+)/api/serve/applications/?$")


class ServeDashboards:
    def __init__(self, model: ServeModel, token: str | None = None, host: str = "127.0.0.1") -> None:
        self.model = model
        self.token = token
        self.requests: list[tuple[str, str, Any]] = []  # (method, path, JSON body or None), as received
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer._serve(self, "GET")

            def do_POST(self) -> None:
                outer._serve(self, "POST")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = HTTPServer((host, 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="serve-dashboards", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def template(self) -> str:
        """The dashboard URL of a cluster, ``{cluster}`` to be filled in (KubeActuatorConfig's form)."""
        return f"{self.url}/clusters/{{cluster}}"

    def start(self) -> ServeDashboards:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def scales(self, cluster: str) -> list[tuple[str, str, Any]]:
        """(app, deployment, target_num_replicas as sent) of every scale request for ``cluster``, in order."""
        out: list[tuple[str, str, Any]] = []
        for method, path, body in self.requests:
            m = _SCALE.match(path)
            if method == "POST" and m and m.group(1) == cluster and isinstance(body, dict):
                out.append((m.group(2), m.group(3), body.get("target_num_replicas")))
        return out

    # -- one request -----------------------------------------------------------------------------------

    def _serve(self, req: BaseHTTPRequestHandler, method: str) -> None:
        length = int(req.headers.get("Content-Length") or 0)
        raw = req.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        self.requests.append((method, req.path, body))
        try:
            code, answer = self._answer(req, method, body)
        except ServeHTTPError as e:
            code, answer = e.code, {"error": e.message}
        data = json.dumps(answer).encode()
        req.send_response(code)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)

    def _answer(self, req: BaseHTTPRequestHandler, method: str, body: Any) -> tuple[int, Any]:
        if self.token is not None:
            auth = req.headers.get("Authorization") or ""
            if not auth:
                raise ServeHTTPError(401, "Unauthorized: Missing authentication token")
            if auth != f"Bearer {self.token}":
                raise ServeHTTPError(403, "Forbidden: Invalid authentication token")
        if method == "GET" and (m := _DETAILS.match(req.path)):
            return 200, self.model.details(m.group(1))
        if method == "POST" and (m := _SCALE.match(req.path)):
            cluster, app, dep = m.groups()
            n = body.get("target_num_replicas") if isinstance(body, dict) else None
            if not isinstance(n, int) or isinstance(n, bool):
                raise ServeHTTPError(400, f"Invalid request body: {body!r}")
            if cluster not in self.model.scalable:
                raise ServeHTTPError(503, "Serve controller is not available")
            self.model.scale(cluster, app, dep, n)
            return 200, {"message": "Scaling request received. Deployment will get scaled asynchronously."}
        raise ServeHTTPError(404, f"no route {method} {req.path}")
