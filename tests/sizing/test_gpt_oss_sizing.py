"""gpt-oss in the catalogue: its published config.json read by the engine's reader (MXFP4 experts, which the
engine dequantizes at load, so sized as bfloat16), parameter counts against the model cards, and a plan (or
the number of GPUs that would fit it) on every catalogue GPU the engine runs on."""

from __future__ import annotations

import pytest
from pagoda.engine.sizing import ENGINE_MIN_COMPUTE, GPU_CATALOGUE, GPUInfo, Hints, plan, shape_from_config
from pagoda.engine.sizing.errors import SizingError
from pagoda.engine.sizing.model_config import ModelConfig
from pagoda.engine.sizing.shapes import check_published_config, well_known_shape

# openai/gpt-oss-20b's config.json (the 120b's differs in num_hidden_layers 36 and num_local_experts 128)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088,
}  # fmt: skip
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18}  # fmt: skip
# the model card's totals (all experts): 20.91B and 116.83B
PUBLISHED = {"gpt-oss-20b": 20.91, "gpt-oss-120b": 116.83}


@pytest.mark.parametrize(("name", "config"), [("gpt-oss-20b", GPT_OSS_20B), ("gpt-oss-120b", GPT_OSS_120B)])
def test_the_published_config_reads_as_the_catalogue_row(name, config):
    cfg = ModelConfig.from_hf_config(config)  # the engine's strict reading: MXFP4 is undone at load
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == (
        "gpt_oss",
        config["num_local_experts"],
        4,
    )
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert [cfg.layer_sliding_window(i) for i in range(2)] == [128, None]
    check_published_config(f"openai/{name}")
    known = well_known_shape(f"openai/{name}")
    assert abs(known.num_params / 1e9 / PUBLISHED[name] - 1) < 0.01, known.num_params
    assert known.dtype == "bfloat16" and known.weight_bytes == 2 * known.num_params  # held dequantized
    read, want = shape_from_config(config, name=known.name).to_dict(), known.to_dict()
    assert read.pop("num_params") == want.pop("num_params")
    assert read == want


def test_another_quantization_of_gpt_oss_is_still_refused():
    from pagoda.engine.sizing.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError):
        ModelConfig.from_hf_config({**GPT_OSS_20B, "quantization_config": {"quant_method": "bitsandbytes"}})


# tensor_parallel_size the planner picks with GPUs to spare (bfloat16 experts: 38.9 and 217.5 GiB of weights)
WANT_TP = {
    "gpt-oss-20b": {"H100-SXM": 1, "H200": 1, "B200": 1, "A100-80GB-SXM": 1, "A100-40GB-SXM": 2, "L40S": 2,
                    "L4": 4},
    "gpt-oss-120b": {"H100-SXM": 4, "H200": 2, "B200": 2, "A100-80GB-SXM": 4, "A100-40GB-SXM": 8, "L40S": 8,
                     "L4": 16},
}  # fmt: skip


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_a_plan_on_every_gpu_the_engine_runs_on(name):
    """With GPUs to spare, a plan on every catalogue GPU; on one GPU where it does not fit, the refusal names the
    GPU count that would (tensor parallelism over the heads and each expert's intermediate size)."""
    shape = well_known_shape(name)
    for spec in GPU_CATALOGUE:
        if spec.compute_capability < ENGINE_MIN_COMPUTE:
            continue
        p = plan(shape, GPUInfo.from_spec(spec, 64), Hints())
        assert p.num_gpu_blocks > 0 and shape.num_attention_heads % p.tensor_parallel_size == 0, spec.name
        if spec.name in WANT_TP[name]:
            assert p.tensor_parallel_size == WANT_TP[name][spec.name], spec.name
        if p.tensor_parallel_size > 1:
            with pytest.raises(SizingError, match=rf"request {p.tensor_parallel_size} GPUs"):
                plan(shape, GPUInfo.from_spec(spec, 1), Hints())
