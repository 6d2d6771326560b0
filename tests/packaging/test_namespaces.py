"""The folders engine/, kernels/, operator/ are only ever importable as pagoda.*.

A bare `operator` would shadow the standard library and a bare `kernels` collides with a Hugging Face
package that transformers probes for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STDLIB_OPERATOR = os.path.join(sysconfig.get_paths()["stdlib"], "operator.py")


def run(code: str, *, safe_path: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    if safe_path:
        env["PYTHONSAFEPATH"] = "1"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_packages_map_to_folders():
    import pagoda.engine
    import pagoda.kernels
    import pagoda.operator

    assert Path(pagoda.engine.__file__).parent == REPO / "engine"
    assert Path(pagoda.kernels.__file__).parent == REPO / "kernels"
    assert Path(pagoda.operator.__file__).parent == REPO / "operator"


def test_bare_names_from_the_test_environment():
    """As `make test` runs (PYTHONSAFEPATH=1): no bare kernels, and operator is the standard library."""
    code = (
        "import importlib.util, operator\n"
        f"assert operator.__file__ == {STDLIB_OPERATOR!r}, operator.__file__\n"
        "assert importlib.util.find_spec('kernels') is None\n"
        "import pagoda.operator, pagoda.kernels\n"
        "import operator as again; assert again.itemgetter(0)([5]) == 5\n"
        "print('ok')\n"
    )
    proc = run(code, safe_path=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_bare_names_even_with_the_repo_root_on_sys_path():
    """`python -c` in the repository root puts the root on sys.path: still no shadowing, no leak."""
    code = (
        "import sys; sys.path.insert(0, '')\n"
        "sys.modules.pop('operator', None)\n"
        "import operator\n"
        f"assert operator.__file__ == {STDLIB_OPERATOR!r}, operator.__file__\n"
        "import kernels\n"
        "assert getattr(kernels, '__file__', None) is None, 'bare kernels exposes a file'\n"
        "assert not [n for n in vars(kernels) if not n.startswith('__')], 'bare kernels exposes code'\n"
        "from transformers.utils import import_utils\n"
        "assert not import_utils.is_kernels_available()\n"
        "print('ok')\n"
    )
    proc = run(code, safe_path=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_operator_imports_without_torch():
    code = "import sys, pagoda.operator, pagoda.engine.sizing; assert 'torch' not in sys.modules; print('ok')"
    proc = run(code, safe_path=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_bare_operator_imports_nothing_else_so_it_works_mid_start_up():
    """The repository's `operator/` hands back the standard library's module without importing anything:
    it may run while the interpreter is half-way through importing threading or functools (a spawned child
    started in the repository root on Python 3.12 died there when it imported sysconfig)."""
    code = (
        "import sys; sys.path.insert(0, '')\n"
        "before = set(sys.modules)\n"
        "import operator\n"
        f"assert operator.__file__ == {STDLIB_OPERATOR!r}, operator.__file__\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['_operator', 'operator']"


def test_multiprocessing_spawn_from_the_repository_root():
    """A program run in the repository root whose children multiprocessing spawns (they start with the root
    first on sys.path and import operator early) runs."""
    code = (
        "import multiprocessing, operator\n"
        "if __name__ == '__main__':\n"
        "    with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
        "        print(pool.map(operator.neg, [1, 2]))\n"
    )
    proc = run(code, safe_path=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "[-1, -2]", proc.stderr
