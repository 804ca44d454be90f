"""The README's quick commands run as shown, its model declaration loads, and the files it links exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RAYSCALE = str(Path(sys.executable).with_name("rayscale"))
# Commands that need a running cluster or take minutes (`make demo` and `make test` cover those).
SLOW = ("rayscale local", "rayscale controller", "rayscale demo", "rayscale prices", "rayscale serve")
# Placeholders in the commands table, filled with something that exists here.
FILL = {" --settings F": " --settings rayscale/data/settings.yaml", "--trace T": "--trace gen:poisson:rate=1,hours=0.05",
        "render --out . [--check]": "render --out {tmp} --check", "[--json]": "--json"}


def quick_commands() -> list[str]:
    cmds = []
    for raw in re.findall(r"`(rayscale [^`]+ [^`]+)`", README):  # a command with arguments, not a name
        cmd = raw.split(" / ")[0].replace("\\|", "|")
        if cmd.startswith(SLOW):
            continue
        for k, v in FILL.items():
            cmd = cmd.replace(k, v)
        cmd = re.sub(r"\s*\[[^\]]*\]", "", cmd)  # optional flags left in brackets
        cmds.append(cmd)
    return sorted(set(cmds))


def test_the_readme_is_one_short_page_whose_links_exist() -> None:
    assert len(README.split()) < 900
    for link in re.findall(r"\]\(([^)#]+)\)", README):
        assert (ROOT / link).exists(), link
    for path in ("deployments/local-tiny.yaml", "examples/load.yaml", "rayscale/data/settings.yaml"):
        assert path in README and (ROOT / path).exists()


def test_the_model_declaration_in_the_readme_loads(tmp_path: Path) -> None:
    from rayscale.config import load_catalog

    block = next(b for b in re.findall(r"```yaml\n(.*?)```", README, re.S) if "models:" in b)
    shipped = yaml.safe_load((ROOT / "rayscale" / "data" / "models.yaml").read_text())
    mine = yaml.safe_load(block)
    names = {m["name"] for m in mine["models"]}
    rest = [m for m in shipped["models"] if m["name"] not in names]
    (tmp_path / "models.yaml").write_text(yaml.safe_dump({"models": mine["models"] + rest}))
    cat = load_catalog(models=tmp_path / "models.yaml")
    assert cat.models["mistral-7b"].max_model_len == 32768


@pytest.mark.parametrize("cmd", quick_commands())
def test_a_quick_readme_command_runs_as_shown(cmd: str, tmp_path: Path) -> None:
    argv = [RAYSCALE, *cmd.format(tmp=tmp_path).split()[1:]]
    if "render" in argv and "--check" in argv:  # a check needs the files written first
        subprocess.run([a for a in argv if a != "--check"], cwd=ROOT, capture_output=True, timeout=300, check=True)
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{cmd}: {r.stderr[-2000:]}"
    assert r.stdout.strip() or "--check" in argv  # a passing check prints nothing
