"""The controller's Serve client authenticates to a Ray dashboard with token auth as Ray's own clients do.

Ray 2.60's dashboard (``RAY_AUTH_MODE=token``) answers 401 to a request without ``Authorization: Bearer
<token>`` and 403 to a wrong token (ray/_private/authentication/http_token_authentication.py). The token
comes from where Ray's C++ AuthenticationTokenLoader looks; the tests compare with that loader itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rayscale.controller.serve_client import ServeClientError, ray_auth_token

ENV_KEYS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "HOME", "RAY_AUTH_MODE")

# What Ray's own HTTP clients would send, from a fresh process (the loader caches its token).
RAY_LOADER = """
from ray._raylet import AuthenticationTokenLoader
try:
    h = AuthenticationTokenLoader.instance().get_token_for_http_header(ignore_auth_mode=True)
    print(h.get("authorization", "") or "NONE")
except Exception as e:
    print("ERROR", type(e).__name__)
"""


def _env(tmp_path: Path, case: str) -> dict[str, str]:
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True, exist_ok=True)
    token_file = tmp_path / "token"
    token_file.write_text("file-token\n")
    if case == "env":  # the variable wins over the file
        return {"HOME": str(home), "RAY_AUTH_TOKEN": " env-token ", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    if case == "path":  # the file the variable names wins over ~/.ray/auth_token
        (home / ".ray" / "auth_token").write_text("home-token")
        return {"HOME": str(home), "RAY_AUTH_TOKEN_PATH": str(token_file)}
    if case == "home":
        (home / ".ray" / "auth_token").write_text("  home-token\n")
        return {"HOME": str(home)}
    if case == "missing-path":
        return {"HOME": str(home), "RAY_AUTH_TOKEN_PATH": str(tmp_path / "absent")}
    return {"HOME": str(home)}


@pytest.mark.parametrize("case", ["env", "path", "home", "none", "missing-path"])
def test_the_token_is_the_one_rays_loader_finds(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env(tmp_path, case)
    base = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    out = subprocess.run([sys.executable, "-c", RAY_LOADER], env={**base, **env}, capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip().splitlines()[-1]
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if out.startswith("ERROR"):
        assert case == "missing-path"
        with pytest.raises(ServeClientError, match="RAY_AUTH_TOKEN_PATH"):
            ray_auth_token()
        return
    ours = ray_auth_token()
    assert (f"Bearer {ours}" if ours else "NONE") == out
    assert case == "none" or ours  # each other case does configure a token


# A Ray head with token auth in its own process: token mode is process-wide state in Ray.
DASHBOARD_PROBE = """
import json
import httpx
from rayscale_testing.rayheads import free_port, own_temp_dir, start_head
from rayscale.controller.serve_client import ServeClient, ServeClientError
from rayscale_testing.waits import wait_for

with own_temp_dir("rs-auth-") as tmp:
    dash = free_port()
    cluster = start_head(tmp, include_dashboard=True, dashboard_host="127.0.0.2", dashboard_port=dash)
    try:
        url = f"http://127.0.0.2:{dash}"
        bare = wait_for(lambda: httpx.get(url + "/api/serve/applications/", timeout=5).status_code, 120,
                        "the dashboard")
        out = {"bare": bare, "ok": ServeClient(url).snapshot().ok,
               "wrong": ServeClient(url, token="wrong").snapshot().error}
        try:
            ServeClient(url).scale("nope", "m", "f", 1)
        except ServeClientError as e:
            out["scale"] = str(e)
        print("RESULT " + json.dumps(out))
    finally:
        cluster.shutdown()
"""


def test_a_dashboard_with_token_auth_serves_the_client_its_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="s3cret", HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", DASHBOARD_PROBE], env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["bare"] == 401  # the dashboard does require the token
    assert out["ok"] is True  # the client's snapshot got through with the token from RAY_AUTH_TOKEN
    assert "403" in out["wrong"]  # an explicit token replaces it, and a wrong one is refused
    # The scale POST passed authentication too: Serve itself answered (no Serve controller runs).
    assert "HTTP 401" not in out["scale"] and "HTTP 403" not in out["scale"]
