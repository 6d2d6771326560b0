"""benchmarks/bench_quant_kernels.py: its smoke mode (tiny shapes under the interpreter, values against the
twins, no timing) passes, and without a GPU the timed run says it needs one and writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_quant_kernels.py"


def test_smoke_run_checks_every_column_against_its_twin(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    points = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [p["m"] for p in points] == [1, 17]
    for p in points:
        assert {"w4a16_rel_err", "fp8_weight_only_rel_err", "fp8_rel_err"} <= set(p), p
        assert not any(k.endswith("_us") for k in p)  # nothing timed under the interpreter
    out = tmp_path / "q.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          env={**env, "CUDA_VISIBLE_DEVICES": ""}, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "needs a CUDA GPU" in done.stdout and not out.exists()
