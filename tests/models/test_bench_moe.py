"""benchmarks/bench_moe.py in its tiny smoke mode: every column timed, the report written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_moe_tiny_times_every_column(tmp_path):
    out = tmp_path / "moe.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_moe.py"), "--tiny", "--threads", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "tiny" and report["threads"] == 1
    assert [r["tokens"] for r in report["rows"]] == [1, 8]
    for r in report["rows"]:
        assert r["fused_ms"] > 0 and r["loop_ms"] > 0 and r["dense_active_ms"] > 0
        assert r["loop_over_fused"] == r["loop_ms"] / r["fused_ms"]
    assert "| tiny | 8 |" in done.stdout
