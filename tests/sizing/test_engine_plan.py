"""The engine's start-up arithmetic as a pure function: the same numbers and refusals as LLMEngine."""

from __future__ import annotations

import pytest
from pagoda.engine.config import EngineConfig
from pagoda.engine.sizing import SizingError, StartupFitError
from pagoda.engine.sizing.engine_plan import (
    check_tensor_parallel,
    engine_plan,
    gpu_kv_budget,
    kv_bytes_per_token,
    kv_heads_per_rank,
    last_profile,
    resolve_dtype_name,
)

KV = 46_080  # SmolLM2-135M in float32
MiB = 1 << 20


def plan(config: EngineConfig, kv_memory: int, **kw):
    return engine_plan(config, model_max_len=8192, kv_bytes_per_token=KV, kv_memory_bytes=kv_memory, **kw)


def test_blocks_length_and_token_budget() -> None:
    p = plan(EngineConfig(max_model_len=None), 512 * MiB)
    assert p.num_blocks == 512 * MiB // (KV * 16) == 728
    assert p.max_model_len == 8192 and p.max_model_len_fitted == 728 * 16
    assert p.max_num_batched_tokens == 2048
    assert p.profile.kv_allocated_bytes == 728 * 16 * KV and last_profile() == p.profile
    auto = plan(EngineConfig(max_model_len="auto"), 64 * MiB)
    assert auto.max_model_len == 64 * MiB // (KV * 16) * 16
    # chunked prefill off: the budget must hold a whole prompt
    off = plan(EngineConfig(max_model_len=4096, enable_chunked_prefill=False), 512 * MiB)
    assert off.max_num_batched_tokens == 4096
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(2048\) must be at least max_model_len"):
        plan(
            EngineConfig(max_model_len=4096, enable_chunked_prefill=False, max_num_batched_tokens=2048),
            512 * MiB,
        )


def test_a_length_that_does_not_fit_carries_the_profile() -> None:
    with pytest.raises(StartupFitError) as info:
        plan(EngineConfig(max_model_len=4096), 64 * MiB, weights_bytes=10 * MiB, device="cuda")
    assert "the largest max_model_len that fits is 1456" in str(info.value)
    assert "raise --gpu-memory-utilization" in str(info.value)
    profile = info.value.profile
    assert profile.kv_cache_bytes == 64 * MiB and profile.weights_bytes == 10 * MiB
    assert profile.kv_allocated_bytes == 0 and profile.gpu_memory_utilization == 0.92
    # longer than the model allows: a configuration error, not a memory one
    with pytest.raises(SizingError) as info:
        plan(EngineConfig(max_model_len=10_000), 512 * MiB)
    assert not isinstance(info.value, StartupFitError)


def test_gpu_budget_is_the_engines_formula() -> None:
    total, free, reserved = 80 << 30, 60 << 30, 16 << 30  # 4 GiB held by the context and others
    kv, others = gpu_kv_budget(total, free, reserved, 0.9, 15 << 30, 2 << 30)
    assert others == 4 << 30
    assert kv == int(total * 0.9) - (4 << 30) - (15 << 30) - (2 << 30)
    assert gpu_kv_budget(total, free, reserved, 0.1, 15 << 30, 2 << 30)[0] == 0


def test_dtype_and_kv_bytes(monkeypatch, tmp_path) -> None:
    import importlib

    plan_module = importlib.import_module(
        "pagoda.engine.sizing.engine_plan"
    )  # the package re-exports a function of that name
    probe = plan_module.cpu_has_native_bf16
    for flags, want in (("fpu avx2 avx512f avx512_bf16 avx512_vnni", "bfloat16"), ("fpu amx_bf16", "bfloat16"),
                        ("fpu avx2 avx512f avx512bw", "float32")):  # fmt: skip
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert probe(str(info)) == (want == "bfloat16")
        monkeypatch.setattr(plan_module, "cpu_has_native_bf16", lambda w=want: w == "bfloat16")
        assert resolve_dtype_name("auto", "cpu", "float32") == want
        assert resolve_dtype_name("float32", "cpu", "bfloat16") == "float32"
    assert probe(str(tmp_path / "missing")) is False
    assert resolve_dtype_name("auto", "cuda", "float16") == "float16"
    assert resolve_dtype_name("auto", "cuda", "float32") == "bfloat16"
    assert resolve_dtype_name("auto", "cuda", None) == "bfloat16"
    assert resolve_dtype_name("auto", "cuda", "bfloat16", (7, 5)) == "float16"  # a T4 has no bfloat16
    assert resolve_dtype_name("auto", "cuda", "bfloat16", (8, 0)) == "bfloat16"
    assert resolve_dtype_name("half", "cpu", None) == "float16"
    # Llama-3.1-70B (REFERENCE.md): 327,680 B/token in bf16; each of two ranks holds half the KV heads
    assert kv_bytes_per_token(80, 64, 8, 128, 2) == 327_680
    assert kv_bytes_per_token(80, 64, 8, 128, 2, tp=2) == 163_840
    with pytest.raises(ValueError, match="tensor_parallel_size 16 exceeds the model's 9 attention heads"):
        check_tensor_parallel(9, 16)


def test_kv_heads_per_rank_matches_the_engines_sharding() -> None:
    """The pure rule must give what the tensor-parallel engine allocates on each rank."""
    from pagoda.engine.distributed import parallel_state

    for heads in range(1, 17):
        for kv in (k for k in range(1, heads + 1) if heads % k == 0):
            for tp in range(1, heads + 1):
                for rank in range(tp):
                    want = len(parallel_state.kv_heads_of_rank(heads, kv, rank, tp)) if tp > 1 else kv
                    assert kv_heads_per_rank(heads, kv, tp, rank) == want, (heads, kv, tp, rank)
    assert kv_heads_per_rank(9, 3, 2) == 5  # uneven split: one copy per query head


def test_the_rank_with_the_most_kv_heads_sizes_every_rank() -> None:
    """Every rank allocates the same blocks, so the rank keeping the most KV heads sizes them: 28 query over
    4 KV heads on 8 ranks (Qwen2.5-7B's heads) leaves rank 0 one KV head and rank 1 four copies."""
    assert [kv_heads_per_rank(28, 4, 8, rank) for rank in range(8)] == [1, 4, 1, 2, 1, 3, 1, 1]
    assert kv_bytes_per_token(28, 28, 4, 128, 2, tp=8) == 2 * 28 * 4 * 128 * 2
    assert kv_bytes_per_token(28, 28, 4, 128, 1, tp=8, scale_bytes=4) == 2 * 28 * 4 * (128 + 4)


def test_the_engine_and_its_dry_run_agree_on_cpu() -> None:
    """The real start on the default model and `--dry-run` give the same plan, and the same refusal."""
    import torch
    from pagoda.engine.cli.dry_run import DryRunError, check
    from pagoda.engine.frontend.llm_engine import LLMEngine

    torch.set_num_threads(2)
    flags = ["--device", "cpu", "--kv-cache-memory-bytes", "512MiB", "--skip-tokenizer-init"]
    report = check(flags)
    engine = LLMEngine(EngineConfig(device="cpu", kv_cache_memory_bytes=512 * MiB, skip_tokenizer_init=True))
    assert report.plan is not None
    assert report.plan.max_model_len == engine.max_model_len == 8192
    assert report.plan.num_blocks == engine.num_blocks
    assert report.plan.kv_bytes_per_token == engine.kv_bytes_per_token
    assert report.plan.max_num_batched_tokens == engine.config.max_num_batched_tokens
    assert report.plan.profile.weights_bytes == engine.runner.weights_bytes()
    engine.close()

    small = ["--device", "cpu", "--kv-cache-memory-bytes", "64MiB", "--max-model-len", "4096"]
    with pytest.raises(DryRunError) as dry:
        check(small)
    with pytest.raises(SizingError) as real:
        LLMEngine(EngineConfig(device="cpu", kv_cache_memory_bytes=64 * MiB, max_model_len=4096))
    assert str(dry.value) == f"cannot start the engine: {real.value}"
