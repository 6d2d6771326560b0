"""The import contract of pyproject.toml ([tool.importlinter]) holds: a request's path one way through the
engine's layers, kernels free of the engine, the operator on the engine's pure modules only (never torch), the
core below the front end, and no import cycle anywhere. `make lint` runs the same check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_lint_imports_passes() -> None:
    tool = Path(sys.executable).parent / "lint-imports"
    if not tool.exists():
        pytest.fail(f"{tool} is missing: install the dev extra (import-linter)")
    out = subprocess.run([str(tool), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout, out.stdout[-3000:]
