"""The checkout importable as `pagoda.*` without installing it: a folder of links, mapped as setup.py maps them."""

from __future__ import annotations

import ast
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def folders(repo: Path = REPO) -> dict[str, str]:
    """setup.py's FOLDERS (folder -> package name), read without running setup.py."""
    tree = ast.parse((repo / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FOLDERS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError("setup.py defines no FOLDERS mapping")


def make_shim(dest: Path, repo: Path = REPO) -> Path:
    """dest/pagoda/<sub> -> repo/<folder> for every mapped folder; returns dest (the PYTHONPATH entry).

    `pagoda` stays a namespace package (no __init__.py), as in the installed distribution."""
    for folder, name in folders(repo).items():
        top, _, sub = name.partition(".")
        link = dest / top / sub
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(repo / folder, link, target_is_directory=True)
    return dest
