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


def test_bench_moe_serve_quick_serves_the_tiny_moe_at_each_concurrency(tmp_path):
    """`make bench-moe`'s script, two concurrency levels: the random Qwen3-MoE is built, served and answers
    every request with exactly its output length (the growth of tok/s is the full run's finding, not asserted
    on a shared host)."""
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_moe_serve.py"), "--quick", "--concurrency", "1", "4",
         "--model-dir", str(tmp_path / "moe-tiny"), "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    config = json.loads((tmp_path / "moe-tiny" / "config.json").read_text())
    assert (
        config["model_type"] == "qwen3_moe"
        and config.get("num_experts", config.get("num_local_experts"))
        == 16  # transformers 5 writes the latter
        and config["num_experts_per_tok"] == 2
    )
    report = json.loads((out / "bench_moe_serve.json").read_text())
    assert [r["concurrency"] for r in report["runs"]] == [1, 4]
    for r in report["runs"]:
        assert r["requests"] == 8 and r["failed"] == 0 and r["server_cpu_s"] > 0
        assert r["server_cpu_ms_per_token"] == 1e3 * r["server_cpu_s"] / (
            r["output_throughput"] * r["duration_s"]
        )
        # 8 requests x 8 tokens (--quick, ignore_eos) over the run's duration
        assert abs(r["output_throughput"] * r["duration_s"] - 64) < 1e-6
    assert len(report["load_average"]) == 2 and (out / "bench_moe_serve.png").is_file()
    assert "| 4 | 8 |" in done.stdout
