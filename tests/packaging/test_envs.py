"""Every PAGODA_* environment variable is read in one module (engine/envs.py), and its table lists them all."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READ = re.compile(r"""(?:environ\.get|environ\[|getenv)\(?\s*["'](PAGODA_[A-Z_]+)""")


def test_no_module_but_envs_reads_a_pagoda_variable():
    readers = {}
    for folder in ("engine", "kernels", "operator", "router"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in READ.findall(path.read_text()):
                readers.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert readers and all(paths == {"engine/envs.py"} for paths in readers.values()), readers


def test_the_table_of_envs_names_every_variable_it_reads():
    _, doc, code = (ROOT / "engine" / "envs.py").read_text().split('"""', 2)
    read = set(re.findall(r"[\"'](PAGODA_[A-Z_]+)[\"']", code))
    listed = set(re.findall(r"^\| (PAGODA_[A-Z_]+) \|", doc, flags=re.M))
    assert read == listed and len(read) >= 8, (read - listed, listed - read)
