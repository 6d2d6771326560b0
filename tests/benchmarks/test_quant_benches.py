"""Smoke tests of issue 37's benches without their peers' venvs: the pieces that decide what is measured (the
calibration text, the checkpoints listed, the served workload each server gets, the decode rate)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))


def test_calibration_is_a_few_apache_paragraphs_never_the_scored_gpl_text() -> None:
    import quantize_llmcompressor as q

    paragraphs = q.calibration_sentences(4)
    assert len(paragraphs) == 4 and all(len(p) > 200 for p in paragraphs)
    assert q.CALIBRATION.name == "Apache-2.0"
    gpl = Path("/usr/share/common-licenses/GPL-3").read_text()
    assert not any(p[:80] in " ".join(gpl.split()) for p in paragraphs)
    assert q.int4_group(False, 64)["group_0"]["weights"] == {
        "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64, "dynamic": False,
    }  # fmt: skip


def test_the_accuracy_bench_lists_each_format_with_its_floor(tmp_path) -> None:
    import bench_weight_accuracy as b

    args = argparse.Namespace(dry_run=False, skip_gguf=False, skip_llmcompressor=False, no_build=True)
    rows = b.variants(args, Path("/ref"), Path("/q4_1.gguf"), tmp_path)  # nothing built yet
    assert [(r["label"], r["floor"]) for r in rows] == [
        ("float32 (dequantized Q4_1)", None),  # the reference comes first
        ("gguf Q4_1 (its own blocks)", "int4"),
    ]
    assert rows[1]["quantization"] == "gguf"  # the engine's flag (QC) keeps the file's blocks
    (tmp_path / "fp8-block").mkdir()
    (tmp_path / "fp8-block" / "config.json").write_text("{}")
    assert [r["label"] for r in b.variants(args, Path("/ref"), Path("/q"), tmp_path)][2:] == ["fp8-block"]
    floors = {name: floor for name, (floor, _) in b.LLMC.items()} | {
        n: f for n, (f, _) in b.GGUF_TYPES.items()
    }
    assert floors == {"fp8-dynamic": "fp8", "fp8-block": "fp8", "w4a16-rtn": "int4", "w4a16-awq": "int4",
                      "w4a16-gptq": "int4", "Q8_0": "int8", "Q6_K": "int8", "Q4_K_M": "int4", "Q4_0": "int4"}  # fmt: skip
    assert b.FLOORS == {"fp8": 97.0, "int8": 97.0, "int4": 90.0}
    dry = b.variants(argparse.Namespace(dry_run=True), Path("/ref"), Path("/q"))
    assert [r["path"] for r in dry] == [Path("/ref"), Path("/ref")]


def test_the_tiny_model_rows_are_its_llmcompressor_checkpoints_at_group_128(tmp_path) -> None:
    import bench_weight_accuracy as b

    args = argparse.Namespace(dry_run=False, skip_llmcompressor=False, no_build=True)
    assert [r["label"] for r in b.tiny_variants(args, Path("/ref"), tmp_path)] == ["float32 (trained here)"]
    for name in ("bf16-rounded", "w4a16-gptq"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    rows = b.tiny_variants(args, Path("/ref"), tmp_path)
    assert [(r["label"], r["floor"]) for r in rows] == [
        ("float32 (trained here)", None), (b.YARDSTICK, None), ("w4a16-gptq", "int4"),
    ]  # fmt: skip
    assert rows[2]["made"] == "llm-compressor GPTQ W4A16, symmetric, group 128"
    assert b.GROUPS == {"default": 64, "tiny": 128}


def test_fp8_rows_are_scored_again_with_the_gpu_kernels_activation_quantization(tmp_path) -> None:
    """The FP8 rows' second pass runs each FP8 linear through the kernel's torch twin with activations
    quantized (the CPU engine otherwise dequantizes FP8 weights); the engine's own class is restored."""
    import bench_weight_accuracy as b
    import torch
    from pagoda.engine.quantization.linear import Fp8Linear
    from pagoda.kernels.quant_reference import fp8_reference, quantize_fp8_per_token

    rows = [
        {"label": "fp8-block", "floor": "fp8", "made": "m"},
        {"label": "w4a16-rtn", "floor": "int4", "made": "m"},
    ]
    extra = b.fp8_act_rows(rows)
    assert [r["label"] for r in extra] == ["fp8-block, FP8 activations (GPU path, torch twin)"]
    assert b.fp8_act_rows(rows + extra) == extra  # never twice
    lin = Fp8Linear(256, 64, False, torch.float32, torch.device("cpu"), -1, None)
    lin.weight.data = (torch.randn(64, 256) * 0.1).to(torch.float8_e4m3fn)
    lin.weight_scale.data = torch.rand(64) + 0.5
    x = torch.randn(3, 256)
    plain = lin._matmul(x)  # weights only, dequantized
    with b.fp8_activations(True):
        assert not Fp8Linear.dense_on_cpu
        quantized = lin._matmul(x)
    assert Fp8Linear.dense_on_cpu and torch.equal(lin._matmul(x), plain)
    xq, xs = quantize_fp8_per_token(x)
    want = fp8_reference(xq.float() * xs, lin.weight, lin.weight_scale)
    torch.testing.assert_close(quantized, want, rtol=1e-4, atol=1e-4)
    assert not torch.equal(quantized, plain)


def test_agreement_counts_flips_and_how_near_a_tie_each_was() -> None:
    import bench_weight_accuracy as b
    import torch

    ref = torch.log_softmax(
        torch.tensor([[3.0, 2.9, 0.0], [0.0, 5.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 4.0]]), -1
    )
    same = b.agreement(ref, ref.clone())
    assert same == (100.0, None)
    other = torch.log_softmax(
        torch.tensor([[2.9, 3.0, 0.0], [0.0, 5.0, 1.0], [0.0, 0.0, 1.0], [0, 0, 4.0]]), -1
    )
    agree, gap = b.agreement(ref, other)  # two flips: margins 0.1 and 1.0 nats in the reference
    assert agree == 50.0 and gap == pytest.approx(0.1, abs=1e-5)  # torch's median: the lower of two


def test_the_tiny_model_never_trains_on_the_scored_gpl_text() -> None:
    import tiny_trained_model as t

    files = t.corpus_files()
    gpl = Path("/usr/share/common-licenses/GPL-3").resolve()
    assert files and gpl not in files and len(files) == len(set(files))
    assert not any("free, copyleft license for" in f.read_text(errors="replace") for f in files)
    assert t.SHAPE["hidden_size"] % 128 == 0 and t.SHAPE["intermediate_size"] % 128 == 0


def test_every_served_peer_gets_the_same_text_prompts() -> None:
    import peers_llamacpp as p
    from peers_serve import serve_workloads

    class Tok:
        vocab_size = 1000

        def decode(self, ids: list[int]) -> str:
            return " ".join(map(str, ids))

    work = p._text_workloads([1, 8], 7, Tok(), 3)
    ids = serve_workloads([1, 8], 7, 1000, 3)
    assert {c: [(t.split(), n) for t, n in reqs] for c, reqs in work.items()} == {
        c: [([str(i) for i in ids_], n) for ids_, n in reqs] for c, reqs in ids.items()
    }
    assert p._text_workloads([1, 8], 7, Tok(), 3) == work  # seeded: every server, every run


def test_decode_rate_counts_the_tokens_after_the_first(tmp_path, monkeypatch) -> None:
    """peers_decode's rate: (tokens - 1) / (last - first stamp), median over runs, the prefill excluded; the
    same for the process's CPU time per token."""
    import peers_decode

    monkeypatch.setattr(
        peers_decode,
        "pagoda_stream",
        lambda spec: (
            [[(0.0, 0.0), (1.0, 0.1), (2.0, 0.2)], [(5.0, 1.0), (5.5, 1.3), (6.0, 1.6)]],
            [9, 9],
            {},
        ),
    )
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"engine": "pagoda", "model": "m", "tokens": 3, "threads": 1}))
    monkeypatch.setattr(sys, "argv", ["peers_decode.py", str(spec), str(tmp_path / "out.json")])
    assert peers_decode.main() == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["decode_tokens_per_s_runs"] == [1.0, 2.0] and out["decode_tokens_per_s"] == 1.5
    assert out["cpu_ms_per_token_runs"] == pytest.approx(
        [100.0, 300.0]
    )  # CPU seconds per token after the first
    assert out["cpu_ms_per_token"] == pytest.approx(200.0)


@pytest.mark.parametrize("flag", ["--llamacpp-only", "--no-llamacpp"])
def test_bench_peers_takes_the_llamacpp_flags(flag) -> None:
    out = subprocess.run([sys.executable, str(BENCH / "bench_peers.py"), "--help"], capture_output=True, text=True,
                         check=True, cwd=BENCH)  # fmt: skip
    assert flag in out.stdout and "--decode-tokens" in out.stdout


def test_decode_comparison_runs_the_int8_activation_mode_with_its_env(tmp_path, monkeypatch) -> None:
    """The int8-activation row is the gguf row with PAGODA_GGUF_ACTIVATIONS=int8, which peers_decode sets
    before the engine is imported; the report's Q4 goal stays the exact row's."""
    import os

    import peers_decode
    import peers_llamacpp as p

    seen: list[tuple[str, dict]] = []
    monkeypatch.setattr(p, "has_gguf_flag", lambda: True)
    monkeypatch.setattr(p, "_decode", lambda py, spec, label, timeout: seen.append((label, spec)) or {})
    args = argparse.Namespace(decode_tokens=8, decode_reps=1, llamacpp_threads=2, max_model_len=256,
                              kv_cache_gib=1, timeout=1)  # fmt: skip
    p.decode_comparison(args, Path("/m.gguf"), Path("/m"), None, [1, 2])
    exact, int8 = seen[2][1], seen[3][1]
    assert seen[3][0].startswith("Pagoda --quantization gguf, int8") and "env" not in exact
    assert int8 == {**exact, "env": {"PAGODA_GGUF_ACTIVATIONS": "int8"}}
    rows = [{"label": label, "decode_tokens_per_s": v, "cpu_ms_per_token": 1.0,
             "loadavg_1min": {"before": 0.0, "after": 0.0}}
            for label, v in [("Pagoda float32 (x)", 10.0), (seen[2][0], 40.0), (seen[3][0], 60.0), ("llama.cpp (2)", 50.0)]]  # fmt: skip
    goals = p._decode_report(rows, {"decode_tokens": 8, "decode_reps": 1, "cpu": "cpu"})
    assert goals["q4_vs_llamacpp"] == pytest.approx(0.8)
    assert goals["q4_int8_activations_vs_llamacpp"] == pytest.approx(1.2)

    monkeypatch.setenv("PAGODA_GGUF_ACTIVATIONS", "float32")
    monkeypatch.setattr(peers_decode, "pagoda_stream", lambda spec: ([[(0.0, 0.0), (1.0, 0.1)]], [9], {}))
    spec = tmp_path / "spec.json"
    import torch

    spec.write_text(
        json.dumps({**int8, "engine": "pagoda", "model": "m", "threads": torch.get_num_threads()})
    )
    monkeypatch.setattr(sys, "argv", ["peers_decode.py", str(spec), str(tmp_path / "out.json")])
    assert peers_decode.main() == 0 and os.environ["PAGODA_GGUF_ACTIVATIONS"] == "int8"
