"""`make bench-kernels` without a GPU (or with --cpu): the CPU kernels' rows, run here in the tiny smoke mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pagoda.kernels.cpu import loader
from pagoda_testkit.native import require_native

REPO = Path(__file__).resolve().parents[2]
KERNELS = {
    "paged decode",
    "paged prefill",
    "greedy + logprob",
    "add + RMSNorm",
    "silu * mul",
    "rotary",
    "small-rows product",
}


def test_cpu_rows_time_every_kernel_on_every_variant_against_a_second_build(tmp_path):
    variants = [loader.load(v.name) for v in loader.runnable()]
    require_native(all(k.lib is not None for k in variants))
    lib_dirs = {Path(k.path).parent for k in variants}
    assert len(lib_dirs) == 1, lib_dirs
    out = tmp_path / "kernels-cpu.json"
    # the same libraries as the "old" build: what --compare does, minus a second compile
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_kernels.py"), "--cpu", "--tiny",
         "--compare", str(lib_dirs.pop()), "--threads", "1,2", "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "tiny" and report["threads"] == [1, 2]
    rows = report["rows"]
    seen = {(r["kernel"], r["shape"], r["variant"], r["threads"]) for r in rows}
    assert len(seen) == len(rows), "a point timed twice"
    assert {r["kernel"] for r in rows} == KERNELS
    shapes = {(r["kernel"], r["shape"]) for r in rows}
    for k in variants:
        for kernel, shape in shapes:
            if kernel == "paged prefill" and not k.prefill:
                assert any(s.startswith(f"{kernel} {shape} on {k.variant}") for s in report["skipped"])
                continue
            for threads in (1, 2):
                assert (kernel, shape, k.variant, threads) in seen, (kernel, shape, k.variant, threads)
    for r in rows:
        assert r["ms"] > 0 and r["old_ms"] > 0 and r["new_over_old"] > 0, r
        assert r.get("GBps", 0) > 0 or r.get("GFLOPs", 0) > 0, r
    assert "| kernel" in done.stdout and "new/old" in done.stdout
    # then the fused MoE layer's rows (bench_moe.py --tiny), beside --out
    moe = json.loads((tmp_path / "moe.json").read_text())
    assert moe["mode"] == "tiny" and moe["threads"] == 1 and [r["tokens"] for r in moe["rows"]] == [1, 8]
    assert all(r["fused_ms"] > 0 and r["loop_ms"] > 0 and r["dense_active_ms"] > 0 for r in moe["rows"])
