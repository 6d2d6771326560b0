"""INT8 KV sizing: bytes per token count the scales, the planner offers INT8 where FP8 is missing only when
capacity is preferred, and the engine allocates exactly the bytes per token the plan counted."""

from __future__ import annotations

import pytest
from pagoda.engine.cli.serve_args import to_argv
from pagoda.engine.sizing import Hints, SizingError, gpu_info, plan, well_known_shape
from pagoda.engine.sizing.engine_plan import kv_bytes_per_token
from pagoda.engine.sizing.kv_dtypes import kv_cache_dtype

SMOL = well_known_shape("smollm2-135m")
LLAMA_8B = well_known_shape("llama-3.1-8b")


def test_int8_bytes_per_token_count_one_byte_per_element_plus_float32_scales():
    # 30 layers x K|V x 3 kv heads x (64 int8 + 4 scale bytes)
    assert SMOL.kv_bytes_per_token("int8") == 2 * 30 * 3 * (64 + 4) == 12240
    assert LLAMA_8B.kv_bytes_per_token("int8") == 2 * 32 * 8 * (128 + 4) == 67584
    assert LLAMA_8B.kv_bytes_per_token("fp8") == 65536 and LLAMA_8B.kv_bytes_per_token("auto") == 131072
    # the engine's start-up arithmetic (and the dry run) agree with the shape
    int8 = kv_cache_dtype("int8", "bfloat16")
    assert kv_bytes_per_token(32, 32, 8, 128, int8.element_bytes, 1, int8.scale_bytes) == 67584
    assert (
        kv_cache_dtype("fp8", "bfloat16").scale_bytes == 0
        and kv_cache_dtype("auto", "bfloat16").scale_bytes == 0
    )


@pytest.mark.parametrize("gpu", ["A100-80GB", "A100", "A10G", "T4"])
def test_int8_is_offered_without_fp8_only_when_capacity_is_preferred(gpu):
    info = gpu_info(gpu, 1)
    assert not info.fp8
    default = plan(SMOL, info, Hints())
    assert default.kv_cache_dtype == "auto"  # today's behaviour without the preference
    assert "prefer capacity" in default.reasons["kv_cache_dtype"]
    dense = plan(SMOL, info, Hints(prefer_capacity=True))
    assert dense.kv_cache_dtype == "int8" and "--kv-cache-dtype int8" in " ".join(
        to_argv(dense.engine_settings())
    )
    assert dense.kv_bytes_per_token == SMOL.kv_bytes_per_token("int8")
    why = dense.reasons["kv_cache_dtype"]
    assert "no FP8" in why and "12240 B/token instead of 23040" in why and "1.88x the tokens" in why
    # the same memory holds about 1.88x the tokens (block bytes 16 x 12240 vs 16 x 23040)
    ratio = dense.num_gpu_blocks / default.num_gpu_blocks
    assert 1.85 < ratio < 1.9, ratio


@pytest.mark.parametrize("gpu", ["H100", "L4", "L40S"])
def test_fp8_gpus_keep_fp8_with_or_without_the_preference(gpu):
    info = gpu_info(gpu, 1)
    assert plan(LLAMA_8B, info, Hints()).kv_cache_dtype == "fp8"
    assert plan(LLAMA_8B, info, Hints(prefer_capacity=True)).kv_cache_dtype == "fp8"
    assert plan(LLAMA_8B, info, Hints(quality_first=True)).kv_cache_dtype == "auto"
    # INT8 asked for explicitly is sized as INT8 (its scales counted), not relabelled
    explicit = plan(LLAMA_8B, info, Hints(kv_cache_dtype="int8"))
    assert explicit.kv_cache_dtype == "int8" and explicit.kv_bytes_per_token == 67584


def test_quality_first_and_prefer_capacity_contradict():
    with pytest.raises(SizingError, match="contradict"):
        plan(SMOL, gpu_info("A100", 1), Hints(quality_first=True, prefer_capacity=True))


def test_cpu_plan_with_capacity_preferred_is_int8():
    base = plan(SMOL, None, Hints(memory_limit_bytes=4 << 30))
    dense = plan(SMOL, None, Hints(memory_limit_bytes=4 << 30, prefer_capacity=True))
    assert base.kv_cache_dtype == "auto" and base.kv_bytes_per_token == 46080  # float32 on CPU
    assert dense.kv_cache_dtype == "int8" and dense.kv_bytes_per_token == 12240
    assert dense.num_gpu_blocks > 3.7 * base.num_gpu_blocks
    assert "INT8" in dense.reasons["kv_cache_dtype"]


def test_engine_allocates_the_bytes_per_token_the_plan_counted():
    from pagoda.engine.cli.plan import resolve_shape
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.frontend.llm_engine import LLMEngine

    shape = resolve_shape(None)  # the default model, as `pagoda plan` reads it
    p = plan(shape, None, Hints(memory_limit_bytes=4 << 30, prefer_capacity=True))
    engine = LLMEngine(EngineConfig(device="cpu", kv_cache_dtype=p.kv_cache_dtype, max_model_len=256,
                                    kv_cache_memory_bytes=64 * 16 * p.kv_bytes_per_token))  # fmt: skip
    try:
        allocated = engine.runner.kv_cache_bytes
        assert engine.num_blocks == 64
        assert allocated == engine.num_blocks * 16 * p.kv_bytes_per_token
        assert engine.kv_bytes_per_token == p.kv_bytes_per_token == 12240
    finally:
        engine.close()


def test_operator_plans_int8_on_an_a100_when_the_spec_prefers_capacity():
    from pagoda.operator.discovery import node_gpus, pools
    from pagoda.operator.planning import decide
    from pagoda.operator.spec import SpecError, parse_spec
    from pagoda_testkit import node

    a100 = pools(g for g in [node_gpus(node("n-a100", "a100"))] if g)
    h100 = pools(g for g in [node_gpus(node("n-h100", "h100"))] if g)
    base = {"model": {"source": "default"}, "gpu": {"count": 1}}
    assert decide(parse_spec(base), a100).plan.kv_cache_dtype == "auto"
    prefer = base | {"workload": {"preferCapacity": True}}
    d = decide(parse_spec(prefer), a100)
    assert d.plan.kv_cache_dtype == "int8" and "no FP8" in d.plan.reasons["kv_cache_dtype"]
    assert decide(parse_spec(prefer), h100).plan.kv_cache_dtype == "fp8"
    explicit = base | {"engine": {"kvCacheDtype": "int8"}}
    assert decide(parse_spec(explicit), h100).plan.kv_cache_dtype == "int8"
    cpu = {"model": {"source": "default"}, "gpu": {"count": 0}, "engine": {"kvCacheDtype": "int8"}}
    assert decide(parse_spec(cpu), {}).plan.kv_cache_dtype == "int8"
    with pytest.raises(SpecError, match="qualityFirst"):
        parse_spec(base | {"workload": {"preferCapacity": True, "qualityFirst": True}})
