"""The controller image the manifests name can be built from the repository (the build itself needs Docker,
which this machine lacks): every file it copies exists, it installs the extras the controller imports, and
its entry point is the CLI the Deployment calls."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_the_dockerfile_builds_what_the_rendered_deployment_runs() -> None:
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.strip() and ln[0] != "#"]
    assert lines[0].startswith("FROM python:3.11")
    for ln in lines:
        if ln.startswith("COPY "):
            for src in ln.split()[1:-1]:
                assert (ROOT / src).exists(), src
    run = next(ln for ln in lines if ln.startswith("RUN pip install"))
    assert '".[kube,aws]"' in run and "vllm" not in run and "[cpu" not in run
    assert 'ENTRYPOINT ["rayscale"]' in lines
    docs = list(yaml.safe_load_all((ROOT / "deployments" / "k8s" / "controller.yaml").read_text()))
    dep = next(d for d in docs if d and d["kind"] == "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["command"][0] == "rayscale" and container["image"] == "rayscale:0.1.0"
