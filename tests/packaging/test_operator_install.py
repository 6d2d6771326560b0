"""What ships is what runs: with only `pagoda[operator]` installed (no dev extras, no torch), every module of
pagoda.operator imports and the operator's commands run.

The environment is a fresh virtual environment without the system's site-packages. Pagoda goes in as the
wheel built from this checkout (`pip install --no-deps`); the operator extra's requirements, resolved from that
wheel's metadata, are linked in from the test environment instead of downloaded, so the check runs offline
and in seconds while seeing exactly those distributions and nothing else.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "engine", "kernels", "operator", "router", "cli")
FORBIDDEN = ("torch", "fastapi", "transformers", "kmock", "pytest", "hypothesis", "triton", "numpy")

pytestmark = pytest.mark.timeout(600)


def run(*cmd: str | Path, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def build_wheel(tmp: Path) -> Path:
    """The wheel of this checkout, built from a copy so no build output lands in the working tree."""
    src = tmp / "src"
    for name in SOURCES:
        path = REPO / name
        if not path.exists():
            continue  # a folder this checkout does not have
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        tmp / "wheel",
        src,
    )
    [wheel] = (tmp / "wheel").glob("pagoda-*.whl")
    return wheel


def closure(requirements: list[str], extras: tuple[str, ...]) -> set[str]:
    """Names of the installed distributions `requirements` (with `extras` active) pull in, transitively."""
    env = default_environment()
    seen: set[str] = set()
    todo = [(Requirement(r), extra) for r in requirements for extra in ("", *extras)]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
            continue
        name = metadata.distribution(req.name).metadata["Name"].lower().replace("_", "-")
        key = f"{name}[{','.join(sorted(req.extras))}]"
        if key in seen:
            continue
        seen.add(key)
        todo += [(Requirement(r), e) for r in metadata.requires(req.name) or [] for e in ("", *req.extras)]
    return {k.split("[")[0] for k in seen}


def link_distributions(names: set[str], into: Path) -> None:
    """Symlink each distribution's top-level modules and metadata from the test environment into `into`."""
    into.mkdir()
    for name in names:
        dist = metadata.distribution(name)
        root = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"bin", "__pycache__"}:
            if (root / top).exists() and not (into / top).exists():
                (into / top).symlink_to(root / top)


@pytest.fixture(scope="module")
def operator_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("operator-env")
    wheel = build_wheel(tmp)
    venv = tmp / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel)
    dist_info = next((venv / "lib").glob("python3*/site-packages/pagoda-*.dist-info"))
    wanted = [
        line.split(":", 1)[1].strip()
        for line in (dist_info / "METADATA").read_text().splitlines()
        if line.startswith("Requires-Dist:")
    ]
    names = closure(wanted, ("operator",))
    assert "kopf" in names and "torch" not in names and "kmock" not in names, names
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    link_distributions(names, tmp / "deps")
    (site / "operator-extra.pth").write_text(str(tmp / "deps") + "\n")
    return venv


def test_every_shipped_operator_module_imports_without_the_dev_extras(operator_env: Path) -> None:
    code = f"""
import importlib, importlib.util, pkgutil, sys
import pagoda.operator
names = [m.name for m in pkgutil.walk_packages(pagoda.operator.__path__, "pagoda.operator.")]
for name in names:
    importlib.import_module(name)
for extra in ("pagoda.engine.sizing", "pagoda.engine.cli.dry_run", "pagoda.cli.main"):
    importlib.import_module(extra)
loaded = [m for m in {FORBIDDEN!r} if m in sys.modules or importlib.util.find_spec(m) is not None]
assert not loaded, f"visible without being required: {{loaded}}"
assert "testkit" not in " ".join(names) and "emulator" not in " ".join(names), names
print(len(names), pagoda.operator.__file__)
"""
    out = run(operator_env / "bin" / "python", "-c", code, cwd=operator_env, env=_clean_env()).stdout.split()
    assert int(out[0]) >= 15 and str(operator_env) in out[1]  # the installed copy, not the checkout


def test_the_operator_commands_run_from_the_install(operator_env: Path) -> None:
    env = _clean_env()
    example = REPO / "examples" / "llama-3.1-70b-h100x2-tp.yaml"
    out = run(operator_env / "bin" / "pagoda", "render", example, cwd=operator_env, env=env).stdout
    assert "kind: StatefulSet" in out and "--tensor-parallel-size" in out
    assert "usage: pagoda-operator" in run(operator_env / "bin" / "pagoda-operator", "--help", env=env).stdout


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH or the test environment's paths leaking into the install under test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if sysconfig.get_paths()["scripts"] != p
    )
    env["PYTHONSAFEPATH"] = "1"
    return env
