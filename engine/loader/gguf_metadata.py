"""A GGUF file's metadata as Hugging Face's config.json and generation_config.json.

transformers' GGUF reader gives the base config where it knows the architecture; the keys it leaves out
(llama.cpp's standard names, so read here by key, never by family) are added: head_dim, partial rotary,
soft-capping, the sliding layers' RoPE base, RoPE scaling (linear, YaRN, and Phi-3's LongRoPE factors, which
llama.cpp stores as tensors) and Granite's multipliers. A family transformers cannot read from GGUF (Granite)
gets its config from the same standard keys. generation_config.json lists every id that ends a turn, as the
Hugging Face repos of chat models do (Gemma's <end_of_turn> besides <eos>), so the engine stops there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from pagoda.engine.sizing.architectures import Architecture

# Tokens that end a chat turn in the templates of the supported families (llama.cpp's end-of-generation
# list); one counts only where it is a control token the file's chat template writes.
TURN_ENDS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>")
_CONTROL = 3  # llama.cpp's token type of control tokens

# llama.cpp's standard key (after "{arch}.") -> config.json name, for an architecture transformers lacks.
_STANDARD_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# Plain numbers llama.cpp writes under "{arch}." that map one-to-one onto config.json fields.
_EXTRA_KEYS = {
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",  # Phi-3's (transformers reads only Gemma's)
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "attention.scale": "attention_multiplier",
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "logit_scale": "logits_scaling",
}
# A mixture of experts' counts and sizes (transformers reads the first two for Qwen3-MoE, none for Mixtral,
# which llama.cpp writes as a Llama). num_local_experts is the name every MoE config class answers to.
_EXPERT_KEYS = {
    "expert_count": "num_local_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}
# general.architecture -> the name transformers' GGUF tables use, where the two differ.
# (transformers 5.x's gpt-oss reader fails on a file with YaRN scaling, which every gpt-oss file has, so gpt-oss
# is read from the standard keys here.)
_TRANSFORMERS_ARCH = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
# YaRN settings GGUF has no key for, as the family's published config.json sets them (llama.cpp's defaults
# otherwise): gpt-oss's ramp is not truncated to whole dimensions.
_YARN_DEFAULTS = {"gpt_oss": {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}}
# Tensors that are configuration, not weights.
ROPE_FACTOR_TENSORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


def _decimal(x: float) -> float:
    """A float32 of the file as the shortest decimal that is that float32 (1e-06, not 9.99999997e-07): the
    value the source config.json said."""
    return float(str(np.float32(x)))


def field(reader: Any, key: str) -> Any:
    """A metadata value (None where the file lacks it)."""
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def hf_config(
    reader: Any, gguf_path: Path, family: Architecture, tied: bool, rope_factors: dict[str, list[float]]
) -> dict[str, Any]:
    """config.json for the converted directory."""
    from transformers import CONFIG_MAPPING

    arch = field(reader, "general.architecture")
    d = _base_config(reader, gguf_path, family, arch)
    _add_extras(d, reader, arch, rope_factors)
    if family.experts:
        _add_experts(d, reader, arch, family)
    if d["num_hidden_layers"] in family.gguf_width_scaled_layers:  # Gemma 2/3 27B, as llama.cpp runs them
        d["query_pre_attn_scalar"] = d["hidden_size"] // d["num_attention_heads"]
    model_type = d.pop("model_type")
    d = CONFIG_MAPPING[model_type].from_dict(d).to_dict()  # normalized as transformers itself reads it
    for key in ("_name_or_path", "_model_name_or_path", "dtype", "transformers_version"):
        d.pop(key, None)
    d["tie_word_embeddings"] = tied
    d["architectures"] = [family.hf_architectures[0]]
    # Weights are stored as float32 (lossless dequantization); bfloat16 is what these models run in on GPU.
    d["torch_dtype"] = "bfloat16"
    return d


def transformers_reads(arch: str) -> bool:
    """Whether transformers' GGUF readers know this general.architecture (Granite: not yet)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return _TRANSFORMERS_ARCH.get(arch, arch) in GGUF_CONFIG_MAPPING


def _add_experts(d: dict[str, Any], reader: Any, arch: str, family: Architecture) -> None:
    """The expert counts and sizes, under the family's model_type (Mixtral's file says llama). llama.cpp routes
    Qwen3-MoE with renormalised top-k weights whatever the source config said, so the file means that."""
    if d.get("model_type") not in family.model_types:
        d["model_type"] = family.model_types[0]
    d.pop("num_experts", None)
    for key, name in _EXPERT_KEYS.items():
        value = field(reader, f"{arch}.{key}")
        if value is not None:
            d[name] = int(value)
    if "moe_intermediate_size" in d and "mixtral" in family.model_types:
        d["intermediate_size"] = d.pop(
            "moe_intermediate_size"
        )  # Mixtral's experts are intermediate_size wide
    if not family.norm_topk_prob:
        d["norm_topk_prob"] = True


def _base_config(reader: Any, gguf_path: Path, family: Architecture, arch: str) -> dict[str, Any]:
    if transformers_reads(arch):
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
        return cfg.to_dict()
    d: dict[str, Any] = {"model_type": family.model_types[0]}
    for key, name in _STANDARD_KEYS.items():
        value = field(reader, f"{arch}.{key}")
        if value is not None:
            d[name] = value
    if "vocab_size" not in d:
        d["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    theta = field(reader, f"{arch}.rope.freq_base")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta or 10000.0)}
    for name, key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = field(reader, f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            d[name] = int(value)
    return d


def _add_extras(d: dict[str, Any], reader: Any, arch: str, rope_factors: dict[str, list[float]]) -> None:
    for key, name in _EXTRA_KEYS.items():
        value = field(reader, f"{arch}.{key}")
        if value is not None:
            d[name] = value if isinstance(value, int) else _decimal(value)
    if isinstance(d.get("rms_norm_eps"), float):
        d["rms_norm_eps"] = _decimal(d["rms_norm_eps"])
    rope = dict(d.get("rope_parameters") or {"rope_type": "default", "rope_theta": d.get("rope_theta", 1e4)})
    per_layer_type = (
        "full_attention" in rope
    )  # Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}
    full = rope["full_attention"] if per_layer_type else rope
    local_theta = field(reader, f"{arch}.rope.freq_base_swa")
    if local_theta is not None:
        if per_layer_type and "sliding_attention" in rope:
            rope["sliding_attention"]["rope_theta"] = float(local_theta)
        else:
            d["rope_local_base_freq"] = float(local_theta)
    scaling = field(reader, f"{arch}.rope.scaling.type")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if scaling in ("linear", "yarn") and factor:
        full.update(rope_type=scaling, factor=_decimal(factor))
        if scaling == "yarn" and original:
            full["original_max_position_embeddings"] = int(original)
        if scaling == "yarn":
            full.update(_YARN_DEFAULTS.get(d.get("model_type", ""), {}))
    if rope_factors:
        full.update(rope_type="longrope", **{k: [_decimal(x) for x in v] for k, v in rope_factors.items()})
        if original:
            full["original_max_position_embeddings"] = int(original)
            d["original_max_position_embeddings"] = int(original)
    rotary_dim = field(reader, f"{arch}.rope.dimension_count")
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    if rotary_dim and int(rotary_dim) < head_dim:
        full["partial_rotary_factor"] = int(rotary_dim) / head_dim
        d["partial_rotary_factor"] = int(rotary_dim) / head_dim
    d["rope_parameters"] = rope


def control_tokens(reader: Any) -> dict[str, int]:
    """The file's control tokens (text -> id): special tokens such as turn markers."""
    types = reader.fields.get("tokenizer.ggml.token_type")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if types is None or tokens is None:
        return {}
    kinds = np.array([types.parts[i][0] for i in types.data])
    return {
        bytes(tokens.parts[tokens.data[i]]).decode("utf-8"): int(i) for i in np.flatnonzero(kinds == _CONTROL)
    }


def generation_config(reader: Any, template: str, controls: dict[str, int]) -> dict[str, Any]:
    """generation_config.json: bos and every id that ends a turn (eos, end-of-turn and end-of-message ids,
    and the turn-end control tokens the chat template writes)."""
    ends: list[int] = []
    for key in ("eos", "eot", "eom"):
        value = field(reader, f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            ends.append(int(value))
    ends += [controls[t] for t in TURN_ENDS if t in controls and t in template]
    body: dict[str, Any] = {"eos_token_id": sorted(set(ends), key=ends.index)}
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        body["bos_token_id"] = int(bos)
    return body
