"""tests/kernels compiled on the GPU (PAGODA_KERNEL_TESTS=cuda: no interpreter, see tests/kernels/conftest.py).

Every kernel test but three: the catalogue warm-up (minutes, and the warm step covers this GPU), the C
kernels of the CPU path, and the LoRA tests (they need the cluster test kit's packages). The cases cover
every KV dtype (16/32-bit, FP8 e4m3 and e5m2, INT8) against the torch twins, and CUDA graphs against
eager decoding per KV dtype. Runs in parallel processes when pytest-xdist is there (compiling is the cost).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

from gpu_check.context import Context, check, verdict
from gpu_check.shim import REPO

SKIPPED_FILES = ("test_warm.py", "test_cpu_library.py", "test_lora.py")


def run(ctx: Context) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"status": "error", "error": "torch sees no CUDA device"}
    junit = ctx.work / "kernel-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels", f"--junitxml={junit}",
           "-o", "timeout=300"]  # fmt: skip
    cmd += [f"--ignore=tests/kernels/{name}" for name in SKIPPED_FILES]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(min(8, os.cpu_count() or 1))]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PAGODA_KERNEL_TESTS="cuda", TRITON_CACHE_DIR=str(ctx.work / "tests-triton-cache"))
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    sys.stdout.write(done.stdout[-30000:] + done.stderr[-10000:])
    cases = read_junit(junit)
    passed = [c for c, outcome in cases.items() if outcome == "passed"]
    failed = {c: outcome for c, outcome in cases.items() if outcome not in ("passed", "skipped")}
    by_file: dict[str, dict[str, int]] = {}
    for case, outcome in cases.items():
        counts = by_file.setdefault(case.split("::")[0].rsplit(".", 1)[-1], {})
        key = outcome.split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    graphs = {c.rsplit("[", 1)[-1].rstrip("]"): v for c, v in cases.items() if "cuda_graphs_on_a_gpu" in c}
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else f"exit {done.returncode}"
    checks = {
        "pytest": check(done.returncode == 0 and bool(passed), summary),
        "by_file": check(None, "; ".join(f"{f} {c}" for f, c in sorted(by_file.items()))),
        "cuda_graphs_vs_eager": check(
            graphs.get("auto") == "passed" and all(v in ("passed", "skipped") for v in graphs.values()),
            ", ".join(f"{k}: {v}" for k, v in graphs.items()) or "not run",
        ),
    }
    return verdict(
        checks, headline=summary, failed=failed, passed=len(passed), by_file=by_file, command=" ".join(cmd)
    )


def read_junit(path) -> dict[str, str]:
    """test id -> passed | failed | error | skipped, from pytest's JUnit XML."""
    if not path.is_file():
        return {}
    cases = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                if outcome != "skipped":
                    name_detail = (child.get("message") or "")[:300]
                    outcome = f"{outcome}: {name_detail}"
        cases[name] = outcome
    return cases
