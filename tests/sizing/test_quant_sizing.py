"""Weights sized by checkpoint format (issue 37, item 3): the planner, `serve --dry-run` and the operator count
a quantized checkpoint's linears in their own bytes (scales and zero points included), so an INT4 70B fits
where the bf16 one does not, and the plan names the format it saw."""

from __future__ import annotations

import argparse
import math

import pytest
from pagoda.engine.cli.serve_check import check, shape_config
from pagoda.engine.sizing import Hints, SizingError, gpu_info, plan, shape_from_config, well_known_shape
from pagoda.engine.sizing.errors import UnsupportedModelError
from pagoda.engine.sizing.shapes import shape_from_path
from pagoda.engine.sizing.weight_format import gguf_format, held_quantized
from pagoda.operator.planning import decide
from pagoda.operator.render_cli import _pools_for
from pagoda.operator.spec import parse_spec
from pagoda_testkit import example

GiB = 1 << 30
# Llama-3.1-70B: 80 layers, hidden 8192, 64 heads / 8 KV heads of 128, MLP 28672, vocabulary 128256, untied
LAYERS, HIDDEN, Q, KV, MLP, VOCAB = 80, 8192, 64 * 128, 8 * 128, 28672, 128256
LINEARS = [(Q, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, Q), (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]
DENSE_70B = 2 * VOCAB * HIDDEN + LAYERS * 2 * HIDDEN + HIDDEN  # embeddings, LM head, norms: bfloat16


def int4_g128_bytes(rows: int, cols: int) -> int:
    """A packed 4-bit weight, one bfloat16 scale and one uint8 zero point per 128 inputs of each row."""
    return rows * cols // 2 + rows * (cols // 128) * (2 + 1)


def test_int4_70b_fits_one_h100_where_the_bf16_one_does_not() -> None:
    bf16 = well_known_shape("meta-llama/Llama-3.1-70B-Instruct")
    awq = well_known_shape("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4")
    expected = 2 * DENSE_70B + LAYERS * sum(int4_g128_bytes(n, k) for n, k in LINEARS)
    assert awq.weight_bytes == expected == 40_035_172_352  # 37.29 GiB against bf16's 131.42 GiB
    assert bf16.weight_bytes == 141_107_412_992
    assert awq.quantized_params == LAYERS * sum(n * k for n, k in LINEARS)
    assert awq.num_params == bf16.num_params

    one_h100 = gpu_info("H100-80GB", 1)
    with pytest.raises(SizingError, match=r"131.42 GiB of bfloat16 weights\) does not fit on 1 x H100"):
        plan(bf16, one_h100, Hints())
    p = plan(awq, one_h100, Hints())
    assert (p.tensor_parallel_size, p.weights_bytes_per_gpu) == (1, expected)
    assert p.max_model_len == 131072  # the model's whole context fits beside 37 GiB of weights
    assert p.weight_format.startswith("int4 (awq, group 128, asymmetric): 68.5B linear weights at 4.188 bits")
    assert "37.29 GiB of weights: int4 (awq" in p.reasons["weights_bytes_per_gpu"]
    # on an 8-GPU node the bf16 model takes two GPUs, the INT4 one a single GPU
    assert plan(bf16, gpu_info("H100-80GB", 8), Hints()).tensor_parallel_size == 2
    assert plan(awq, gpu_info("H100-80GB", 8), Hints()).tensor_parallel_size == 1


def test_fp8_block_wise_bytes_count_one_float32_scale_per_128_x_128_block() -> None:
    config = {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096,
        "intermediate_size": 12288, "vocab_size": 151936, "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
    }  # fmt: skip
    shape = shape_from_config(config, name="Qwen3-8B-FP8")
    linears = [
        (4096, 4096),
        (1024, 4096),
        (1024, 4096),
        (4096, 4096),
        (12288, 4096),
        (12288, 4096),
        (4096, 12288),
    ]
    quantized = 36 * sum(n * k + math.ceil(n / 128) * math.ceil(k / 128) * 4 for n, k in linears)
    dense = 2 * 151936 * 4096 + 36 * (2 * 4096 + 2 * 128) + 4096  # qk-norm weights are not in the estimate
    assert shape.weight_format_label == "fp8 (fp8, block 128x128, dynamic activations)"
    assert shape.quantized_bytes == quantized == 6_947_463_168
    assert shape.weight_bytes == 2 * (shape.num_params - shape.quantized_params) + quantized
    assert shape.num_params - shape.quantized_params == dense - 36 * 2 * 128
    # the float32 CPU engine dequantizes FP8 and INT4 after loading: sized as float32 there
    assert shape.weight_bytes_as("float32", held_quantized("fp8", "cpu")) == 4 * shape.num_params


def test_compressed_tensors_int4_honours_its_ignore_list_and_an_unsupported_scheme_is_refused() -> None:
    base = {
        "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 256, "intermediate_size": 512, "vocab_size": 1000, "torch_dtype": "bfloat16",
    }  # fmt: skip
    ct = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}},
        "ignore": ["lm_head", "re:.*down_proj"],
    }  # fmt: skip
    shape = shape_from_config({**base, "quantization_config": ct})
    per_layer = [(256, 256), (128, 256), (128, 256), (256, 256), (512, 256), (512, 256)]  # down_proj ignored
    assert shape.weight_format == "int4" and shape.quantized_params == 2 * sum(n * k for n, k in per_layer)
    assert shape.quantized_bytes == 2 * sum(int4_g128_bytes(n, k) for n, k in per_layer)
    with pytest.raises(UnsupportedModelError, match="bitsandbytes"):
        shape_from_config(
            {**base, "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}
        )


def test_the_default_gguf_is_sized_dequantized_and_in_its_q4_1_blocks_with_quantization_gguf(
    default_gguf,
) -> None:
    shape = shape_from_path(default_gguf)
    # SmolLM2-135M: 30 layers x 7 linears in Q4_1 (20 bytes per 32 weights); its LM head, tied to the Q8_0
    # embedding, runs from the embedding's blocks (34 bytes per 32) while lookups read the float copy
    assert shape.weight_format == "gguf"
    assert shape.weight_format_label == "gguf (Q4_1 x210; LM head Q8_0 (tied: beside the float embedding))"
    assert shape.quantized_extra_bytes == 49152 * 576 // 32 * 34 == 30_081_024
    assert shape.quantized_params == 106_168_320
    assert shape.quantized_bytes == 106_168_320 * 20 // 32 == 66_355_200
    float_plan = plan(shape, None, Hints(memory_limit_bytes=4 * GiB))
    q_plan = plan(shape, None, Hints(memory_limit_bytes=4 * GiB, quantization="gguf"))
    assert float_plan.weights_bytes_per_gpu == 4 * shape.num_params == 538_060_032
    assert (
        q_plan.weights_bytes_per_gpu
        == 4 * (shape.num_params - 106_168_320) + 66_355_200 + 30_081_024
        == 209_822_976
    )
    assert (
        float_plan.weight_format.endswith("dequantized to float32 at load")
        and float_plan.quantization is None
    )
    assert q_plan.quantization == "gguf" and q_plan.weight_format.startswith("gguf (Q4_1 x210; LM head Q8_0")
    assert q_plan.kv_cache_bytes > float_plan.kv_cache_bytes  # the bytes saved go to the KV cache
    # the GPU engine dequantizes a GGUF whatever the flag
    assert not held_quantized("gguf", "cuda", "gguf") and held_quantized("gguf", "cpu", "gguf")
    with pytest.raises(SizingError, match="not a GGUF model"):
        plan(well_known_shape("Qwen/Qwen3-8B"), None, Hints(memory_limit_bytes=64 * GiB, quantization="gguf"))


def test_gguf_counts_each_tensor_by_its_type_and_leaves_unkept_types_dense() -> None:
    tensors = {
        "blk.0.attn_q.weight": (256, 256),
        "blk.0.ffn_down.weight": (512, 256),
        "blk.0.attn_k.weight": (256, 64),
        "output.weight": (256, 1000),
        "blk.0.attn_norm.weight": (256,),
    }
    types = {"blk.0.attn_q.weight": "Q4_K", "blk.0.ffn_down.weight": "Q6_K", "blk.0.attn_k.weight": "F16",
             "output.weight": "Q6_K", "blk.0.attn_norm.weight": "F32"}  # fmt: skip
    fmt = gguf_format(tensors, types)
    # an untied LM head (output.weight) in blocks replaces the float one
    assert fmt is not None and fmt.quantized_params == 256 * 256 + 512 * 256 + 256 * 1000
    assert fmt.quantized_bytes == 256 * 256 // 256 * 144 + 512 * 256 // 256 * 210 + 256 * 1000 // 256 * 210
    assert fmt.label == "gguf (Q4_K x1, Q6_K x1; LM head Q6_K)" and fmt.extra_bytes == 0
    assert gguf_format({"blk.0.attn_q.weight": (4, 4)}, {"blk.0.attn_q.weight": "F16"}) is None


def test_serve_dry_run_and_the_operator_report_the_format(tmp_path) -> None:
    awq = well_known_shape("Qwen/Qwen3-8B-AWQ")
    assert awq.weight_format_label == "int4 (awq, group 128, asymmetric)"
    assert awq.weight_bytes < well_known_shape("Qwen/Qwen3-8B").weight_bytes * 0.4
    # the operator passes the shape as --model-shape: the format travels with it
    import json

    report = check(
        ["--model", "Qwen/Qwen3-8B-AWQ", "--model-shape", json.dumps(shape_config(awq)), "--gpu", "L4"]
    )
    assert report.device["weights_bytes_estimated"] == awq.weight_bytes
    assert report.device["weight_format"].startswith("int4 (awq, group 128, asymmetric)")

    cr = example("qwen2.5-7b-l4-fp8.yaml")
    cr["spec"]["model"] = {"source": "hf://Qwen/Qwen3-8B-AWQ"}
    cr["spec"]["gpu"] = {"product": "NVIDIA-L4", "count": 1}
    spec = parse_spec(cr["spec"])
    decision = decide(spec, _pools_for(argparse.Namespace(nodes=None, gpu=None, gpus_per_node=1), 1, "L4"))
    status = decision.status_plan()
    assert status["weights_bytes_per_gpu"] == awq.weight_bytes
    assert status["weight_format"].startswith("int4 (awq, group 128, asymmetric): ")
    assert decision.weights_label == "int4 (awq, group 128, asymmetric)"


def test_a_float_model_that_does_not_fit_is_told_what_a_4_bit_checkpoint_of_it_would_need() -> None:
    """The refusal names both ways out: more GPUs, or the INT4 checkpoint the engine runs (planned the same way,
    37.29 GiB for the 70B as above); a mixture of experts hears that its quantized checkpoints do not run yet."""
    bf16 = well_known_shape("meta-llama/Llama-3.1-70B-Instruct")
    with pytest.raises(SizingError) as one_h100:
        plan(bf16, gpu_info("H100-80GB", 1), Hints())
    assert "request 2 GPUs" in str(one_h100.value)
    assert str(one_h100.value).endswith(
        "Or a 4-bit checkpoint of it (INT4 group 128: AWQ, GPTQ or compressed-tensors; 37.29 GiB of weights) "
        "fits on the 1 GPU it has at tensor_parallel_size=1."
    )
    with pytest.raises(SizingError, match=r"request 8 GPUs .*37.29 GiB of weights\) fits on 4 GPUs at "):
        plan(bf16, gpu_info("L4", 1), Hints())
    awq = well_known_shape("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4")
    with pytest.raises(SizingError) as already_int4:
        plan(awq, gpu_info("L4", 1), Hints())
    assert "4-bit checkpoint" not in str(already_int4.value)
    with pytest.raises(SizingError, match=r"mixture of experts does not run in Pagoda yet"):
        plan(well_known_shape("mistralai/Mixtral-8x7B-Instruct-v0.1"), gpu_info("H100-80GB", 1), Hints())
