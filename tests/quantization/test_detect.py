"""Which quantization a config.json declares (engine/quantization/detect.py), what is refused and in which
words, and the bits per weight the planner counts (scheme.weight_bits)."""

from __future__ import annotations

import pytest
from pagoda.engine.quantization.detect import UnsupportedQuantizationError, detect_quantization
from pagoda.engine.quantization.scheme import (
    QuantScheme,
    bits_per_weight_gguf,
    ignored,
    weight_bits,
)
from pagoda.engine.sizing.errors import UnsupportedModelError
from pagoda.engine.sizing.model_config import ModelConfig
from pagoda_testkit.quant_checkpoints import FORMATS, quantization_config

LABELS = {
    "gptq": "int4 (gptq, group 128, symmetric)",
    "gptq-asym-v2": "int4 (gptq, group 128, asymmetric)",
    "gptq-channel": "int4 (gptq, per-channel, symmetric)",
    "gptq-act-order": "int4 (gptq, group 128, asymmetric)",
    "awq": "int4 (awq, group 128, asymmetric)",
    "ct-int4-sym": "int4 (compressed-tensors, group 128, symmetric)",
    "ct-int4-asym": "int4 (compressed-tensors, group 128, asymmetric)",
    "ct-int4-channel": "int4 (compressed-tensors, per-channel, asymmetric)",
    "ct-fp8-tensor": "fp8 (compressed-tensors, per-tensor, dynamic activations)",
    "ct-fp8-channel": "fp8 (compressed-tensors, per-channel, dynamic activations)",
    "ct-fp8-block": "fp8 (compressed-tensors, block 128x128, dynamic activations)",
    "fp8-block": "fp8 (fp8, block 128x128, dynamic activations)",
    "fp8-tensor": "fp8 (fp8, per-tensor, dynamic activations)",
}
LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 320,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def detect(q: dict) -> QuantScheme | None:
    return detect_quantization({"quantization_config": q}, "config.json")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_reads_with_its_scheme(fmt) -> None:
    scheme = ModelConfig.from_hf_config(
        {**LLAMA, "quantization_config": quantization_config(fmt)}
    ).quantization
    assert scheme.label == LABELS[fmt]
    assert ignored(scheme, "lm_head") and not ignored(scheme, "model.layers.1.self_attn.qkv_proj")


def test_the_fields_of_the_schemes() -> None:
    gptq = detect(quantization_config("gptq"))
    assert (gptq.format, gptq.source, gptq.group_size, gptq.symmetric, gptq.zero_offset) == (
        "int4", "gptq", 128, True, 1
    )  # fmt: skip
    assert detect(quantization_config("gptq-asym-v2")).zero_offset == 0  # gptq_v2 stores the zero as is
    block = detect(quantization_config("ct-fp8-block"))
    assert (block.format, block.block, block.group_size, block.act_dynamic) == ("fp8", (128, 128), 128, True)
    channel = detect(quantization_config("ct-int4-channel"))
    assert (channel.group_size, channel.symmetric) == (-1, False)
    static = quantization_config("ct-fp8-tensor")
    static["config_groups"]["group_0"]["input_activations"] |= {"strategy": "tensor", "dynamic": False}
    assert detect(static).act_dynamic is False  # static activation scales: run per token (docs)
    assert detect({"quant_method": "fp8", "activation_scheme": "static"}).act_dynamic is False
    # the catalogue's hub ids carry only the method: each method's defaults
    assert detect({"quant_method": "awq"}).label == "int4 (awq, group 128, asymmetric)"
    assert detect({"quant_method": "fp8"}).label == "fp8 (fp8, per-tensor, dynamic activations)"
    assert detect({}) is None and detect_quantization({}, "x") is None


def test_ignore_lists_by_name_suffix_and_pattern() -> None:
    scheme = QuantScheme("int4", "compressed-tensors", 128, ignore=("lm_head", "re:.*layers\\.0\\.mlp\\..*"))
    assert ignored(scheme, "model.layers.0.mlp.down_proj")
    assert ignored(scheme, "model.layers.0.mlp.gate_up_proj")  # both its parts match
    assert not ignored(scheme, "model.layers.1.mlp.down_proj")
    assert ignored(None, "model.layers.1.mlp.down_proj")  # no scheme: dense
    half = QuantScheme("int4", "gptq", 128, ignore=("model.layers.0.self_attn.k_proj",))
    with pytest.raises(ValueError, match="quantizes some of q_proj, k_proj, v_proj and not the others"):
        ignored(half, "model.layers.0.self_attn.qkv_proj")
    awq = detect({"quant_method": "awq", "modules_to_not_convert": ["visual"]})
    assert ignored(awq, "model.visual.blocks.0.proj") and not ignored(awq, "model.layers.0.mlp.down_proj")


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'-quantized .* method is not"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8-bit GPTQ \\(only 4-bit is\\)"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int16"}, "pack_dtype 'int16'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "without zero points"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "FP8 format 'e5m2'"),
        ({"quant_method": "hqq"}, "'hqq'-quantized"),
        ({"quant_method": "quanto"}, "'quanto'-quantized"),
    ],
)
def test_unsupported_schemes_are_refused_naming_what_runs(config, words) -> None:
    with pytest.raises(UnsupportedModelError, match=words) as refused:
        ModelConfig.from_hf_config({**LLAMA, "quantization_config": config})
    assert "Pagoda runs compressed-tensors FP8" in str(refused.value)
    assert "GPTQ 4-bit" in str(refused.value) and "AWQ 4-bit GEMM" in str(refused.value)
    with pytest.raises(UnsupportedQuantizationError):  # detect itself raises its own error, no sizing import
        detect(config)


def ct(weights: dict, acts: dict | None = None, fmt: str = "pack-quantized") -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}}


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (
            ct({"num_bits": 8, "type": "int", "strategy": "channel"}, {"num_bits": 8, "type": "int"}, "int-quantized"),
            "8-bit int weights with quantized activations \\(W8A8\\)",
        ),
        (ct({"num_bits": 8, "type": "int", "strategy": "channel"}), "8-bit int weights"),
        (
            ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, {"num_bits": 8, "type": "int"}),
            "W4A8",
        ),
        (ct({"num_bits": 4, "type": "int", "strategy": "tensor"}), "strategy 'tensor'"),
        (ct({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16}), "4-bit float weights"),
        (
            ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}) | {"sparsity_config": {"x": 1}},
            "sparse",
        ),
    ],
)  # fmt: skip
def test_unsupported_compressed_tensors_schemes_are_refused(config, words) -> None:
    with pytest.raises(UnsupportedQuantizationError, match=words):
        detect(config)


def test_bits_per_weight_count_scales_and_zero_points() -> None:
    assert weight_bits(None) == 16.0 and weight_bits(None, dense_bits=32) == 32.0
    assert (
        weight_bits(detect(quantization_config("awq"))) == 4 + 24 / 128
    )  # 16-bit scale + 8-bit zero / group
    assert weight_bits(detect(quantization_config("ct-int4-channel")), in_features=4096) == 4 + 24 / 4096
    assert weight_bits(detect(quantization_config("ct-fp8-block"))) == 8 + 32 / (128 * 128)
    assert weight_bits(detect(quantization_config("ct-fp8-tensor")), in_features=2048) == 8 + 32 / 2048
    assert bits_per_weight_gguf("Q4_K") == 4.5 and bits_per_weight_gguf("q8_0") == 8.5
    assert bits_per_weight_gguf("Q4_1") == 5.0 and bits_per_weight_gguf("Q6_K") == 6.5625
    with pytest.raises(ValueError, match="bits_per_weight_gguf"):
        weight_bits(QuantScheme("gguf", "gguf"))
