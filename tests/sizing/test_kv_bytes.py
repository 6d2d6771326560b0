"""KV bytes per token against the published reference values (REFERENCE.md)."""

import pytest
from pagoda.engine.sizing import ModelShape, shape_from_config, well_known_shape
from pagoda.engine.sizing.units import GiB, MiB

LLAMA_13B_CONFIG = {  # the original LLaMA-13B, as in the vLLM paper
    "model_type": "llama",
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "torch_dtype": "float16",
}


def test_llama_13b_matches_the_vllm_paper():
    shape = shape_from_config(LLAMA_13B_CONFIG)
    assert shape.num_kv_heads == 40 and shape.head_dim == 128
    assert shape.kv_bytes_per_token() == 819_200
    # "1.6 GB for 2,048 tokens" (decimal GB in the paper)
    assert shape.kv_bytes_per_token() * 2048 == pytest.approx(1.6e9, rel=0.05)
    assert 12.5e9 < shape.num_params < 13.5e9


@pytest.mark.parametrize(
    "model_id, expected",
    [
        ("meta-llama/Llama-3.1-8B-Instruct", 131_072),
        ("meta-llama/Llama-3.1-70B", 327_680),
        ("Qwen/Qwen2.5-7B-Instruct", 57_344),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", None),  # checked below in both dtypes
    ],
)
def test_well_known_models(model_id, expected):
    shape = well_known_shape(model_id)
    assert shape is not None
    if expected is not None:
        assert shape.kv_bytes_per_token() == expected
        assert shape.kv_bytes_per_token("fp8") * 2 == expected


def test_llama_8b_4096_tokens_is_512_mib():
    shape = well_known_shape("Llama-3.1-8B")
    assert shape.kv_bytes_per_token("bfloat16") * 4096 == 512 * MiB
    assert shape.kv_bytes_per_token("fp8") * 4096 == 256 * MiB


def test_smollm2_fp16_and_fp32():
    shape = well_known_shape("SmolLM2-135M")
    assert shape.kv_bytes_per_token("float16") == 23_040
    assert shape.kv_bytes_per_token("float32") == 46_080
    assert shape.kv_bytes_per_token("fp8_e5m2") == 23_040 // 2
    assert 130e6 < shape.num_params < 140e6


@pytest.mark.parametrize(
    "model_id, billions",
    [("Llama-3.1-8B", 8.03), ("Llama-3.1-70B", 70.6), ("Llama-3.1-405B", 405.8), ("Qwen2.5-7B", 7.62),
     ("Qwen2.5-72B", 72.7), ("Mistral-7B", 7.25)],
)  # fmt: skip
def test_parameter_counts_match_the_model_cards(model_id, billions):
    shape = well_known_shape(model_id)
    assert shape.num_params / 1e9 == pytest.approx(billions, rel=0.01)
    assert shape.weight_bytes == 2 * shape.num_params  # bfloat16 checkpoints


def test_fp8_halves_every_model():
    for name in ("Llama-3.1-8B", "Llama-3.1-405B", "Mistral-7B-v0.1", "Qwen2.5-72B", "SmolLM2-135M"):
        shape = well_known_shape(name)
        assert shape.kv_bytes_per_token("fp8") * 2 == shape.kv_bytes_per_token("auto")


def test_unknown_dtype_is_a_clear_error():
    shape = ModelShape("m", 2, 2, 2, 4, 8, 16, 10, 64)
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        shape.kv_bytes_per_token("int3")
    assert GiB == 1 << 30
