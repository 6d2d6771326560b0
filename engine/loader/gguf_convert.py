"""GGUF -> Hugging Face directory (config.json, model.safetensors, tokenizer files), done once and cached.

Weights are dequantized with the `gguf` package and stored as float32 (lossless for every GGML type), under
the names of the family's Hugging Face checkpoints; what llama.cpp changed is undone where the architecture
table says so (the rotary permutation of q/k rows, Gemma's +1 on norm weights); a mixture of experts'
stacked expert tensors become transformers 5's 3-D ones, which transformers and the engine load as they are.
Config and tokenizer come from transformers' GGUF readers plus gguf_metadata (no model forward involved); a
file without a chat template gets the one its turn markers spell (chat_templates).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from pagoda.engine.loader.chat_templates import template_for_vocabulary
from pagoda.engine.loader.content_hash import file_sha256
from pagoda.engine.loader.gguf_cache import CONVERTER_VERSION, converted_dir
from pagoda.engine.loader.gguf_metadata import (
    ROPE_FACTOR_TENSORS,
    control_tokens,
    field,
    generation_config,
    hf_config,
    transformers_reads,
)
from pagoda.engine.sizing.architectures import Architecture, architecture, from_gguf

log = logging.getLogger(__name__)

# blk.N.<name> -> model.layers.N.<name>, for every family; the entries below it depend on the family.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# ffn_norm is the norm before the MLP: Llama calls it post_attention_layernorm; a sandwich-norm family
# (Gemma) has its own post_attention_layernorm after attention and calls this one pre_feedforward_layernorm.
_PLAIN_NORMS = {"ffn_norm": "post_attention_layernorm"}
_SANDWICH_NORMS = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# A family whose checkpoints fuse q/k/v and gate/up (Phi-3): llama.cpp keeps them fused under these names.
_FUSED = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# A mixture of experts: the router, and llama.cpp's stacked experts [E, rows, cols], which become transformers
# 5's 3-D tensors (experts.gate_up_proj [E, 2I, H] with gate rows first, experts.down_proj [E, H, I]).
_ROUTER = {"ffn_gate_inp": "mlp.gate"}
_STACKED_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# Mixtral files of llama.cpp before stacked experts: one tensor per expert, blk.N.ffn_gate.E.weight.
_PER_EXPERT = {"ffn_gate": "ffn_gate_exps", "ffn_up": "ffn_up_exps", "ffn_down": "ffn_down_exps"}
# gpt-oss's checkpoint names: a biased router, per-head sinks (a tensor without ".weight"), and the norm
# before its experts, which llama.cpp calls post_attention_norm.
_GPT_OSS = {
    "ffn_gate_inp": "mlp.router",
    "attn_sinks": "self_attn.sinks",
    "post_attention_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _layer_names(family: Architecture) -> dict[str, str]:
    names = {**_LAYER_NAMES, **(_SANDWICH_NORMS if family.post_norms else _PLAIN_NORMS)}
    if family.experts:
        names.update(_GPT_OSS if family.module == "gpt_oss" else _ROUTER)
    return {**names, **_FUSED} if family.fused_checkpoint else names


def gguf_family(reader: object, arch: str, where: str) -> Architecture:
    """The family of a GGUF file: its general.architecture's entry, except that llama.cpp writes Mixtral as a
    Llama with experts (`llama.expert_count`), with the Llama's interleaved q/k rows."""
    family = from_gguf(arch, where)
    if arch == "llama" and int(field(reader, "llama.expert_count") or 0) > 0:
        return dataclasses.replace(architecture("mixtral"), gguf_permuted_qk=True)
    return family


def _stacked_experts(
    layers: dict[int, dict[str, np.ndarray]], where: str, gpt_oss: bool
) -> dict[str, torch.Tensor]:
    """Each layer's stacked gate, up and down experts as experts.gate_up_proj and experts.down_proj: gate rows
    then up rows ([E, 2I, H], [E, H, I]), or gpt-oss's transposed layout with gate and up columns interleaved
    ([E, H, 2I], [E, I, H]) and its expert biases."""
    out: dict[str, torch.Tensor] = {}
    for layer, parts in sorted(layers.items()):
        missing = [k for k in _STACKED_EXPERTS if f"{k}.weight" not in parts]
        if missing:
            raise ValueError(f"GGUF file {where!r}: layer {layer} lacks {', '.join(missing)}")
        gate, up, down = (parts[f"{k}.weight"] for k in _STACKED_EXPERTS)
        prefix = f"model.layers.{layer}.mlp.experts"
        if gpt_oss:
            gate_up = np.empty((gate.shape[0], gate.shape[2], 2 * gate.shape[1]), dtype=gate.dtype)
            gate_up[..., 0::2], gate_up[..., 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
            down = down.transpose(0, 2, 1)
            if "ffn_gate_exps.bias" in parts:
                gb, ub = parts["ffn_gate_exps.bias"], parts["ffn_up_exps.bias"]
                bias = np.empty((gb.shape[0], 2 * gb.shape[1]), dtype=gb.dtype)
                bias[:, 0::2], bias[:, 1::2] = gb, ub
                out[f"{prefix}.gate_up_proj_bias"] = torch.from_numpy(bias)
                out[f"{prefix}.down_proj_bias"] = torch.from_numpy(parts["ffn_down_exps.bias"])
        else:
            if any(k.endswith(".bias") for k in parts):
                raise ValueError(
                    f"GGUF file {where!r}: layer {layer}'s experts have biases this family lacks"
                )
            gate_up = np.concatenate([gate, up], axis=1)
        out[f"{prefix}.gate_up_proj"] = torch.from_numpy(np.ascontiguousarray(gate_up))
        out[f"{prefix}.down_proj"] = torch.from_numpy(np.ascontiguousarray(down))
    return out


def _hf_name(gguf_name: str, layer_names: dict[str, str]) -> str | None:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    return None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Invert llama.cpp's per-head interleaving of rotary halves (rows of q_proj / k_proj)."""
    shape = w.shape
    return w.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def convert_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Return the converted directory, converting first if no complete conversion is cached."""
    target = converted_dir(gguf_path, cache_dir)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(cache_dir, target.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=cache_dir))
    try:
        _convert_into(gguf_path, tmp)
        try:
            os.rename(tmp, target)  # atomic: the directory appears complete or not at all
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
            # Another process finished the same conversion first; its result is as good as ours.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale_temp_dirs(cache_dir: Path, name: str, max_age_s: float = 3600.0) -> None:
    """Temp dirs of conversions killed midway; a live conversion is younger than an hour."""
    now = time.time()
    for stale in cache_dir.glob(f".tmp-{name}-*"):
        try:
            if now - stale.stat().st_mtime > max_age_s:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def _convert_into(gguf_path: Path, out: Path) -> None:
    import gguf
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    reader = gguf.GGUFReader(str(gguf_path))
    arch = field(reader, "general.architecture")
    family = gguf_family(reader, arch, str(gguf_path))
    heads = int(field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(field(reader, f"{arch}.attention.head_count_kv") or heads)
    layer_names = _layer_names(family)

    tensors: dict[str, torch.Tensor] = {}
    rope_factors: dict[str, list[float]] = {}
    experts: dict[int, dict[str, np.ndarray]] = {}
    per_expert: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for t in tqdm(reader.tensors, desc=f"Converting {gguf_path.name}", unit="tensor"):
        if t.name == "rope_freqs.weight":
            raise ValueError(
                f"GGUF file {str(gguf_path)!r} carries rope_freqs (Llama 3.1-style scaling baked into the file), "
                "which Pagoda does not convert; use the Hugging Face directory of this model instead"
            )
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True)
        if t.name in ROPE_FACTOR_TENSORS:  # Phi-3's LongRoPE factors: configuration, not weights
            rope_factors[ROPE_FACTOR_TENSORS[t.name]] = [float(x) for x in w.reshape(-1)]
            continue
        parts = t.name.split(".")
        if family.experts and len(parts) == 4 and parts[2] in _STACKED_EXPERTS:
            experts.setdefault(int(parts[1]), {})[f"{parts[2]}.{parts[3]}"] = w
            continue
        if family.experts and len(parts) == 5 and parts[2] in _PER_EXPERT and parts[3].isdigit():
            per_expert.setdefault((int(parts[1]), f"{_PER_EXPERT[parts[2]]}.{parts[4]}"), {})[
                int(parts[3])
            ] = w
            continue
        name = _hf_name(t.name, layer_names)
        if name is None:
            raise ValueError(f"GGUF file {str(gguf_path)!r} has an unexpected tensor {t.name!r}")
        if name.endswith(".self_attn.sinks.weight"):  # a bare tensor in gpt-oss's checkpoints
            name = name.removesuffix(".weight")
        if family.gguf_permuted_qk and (".q_proj." in name or ".k_proj." in name):
            w = _unpermute(w, heads if ".q_proj." in name else kv_heads)
        if family.gguf_norm_shift and name.endswith("norm.weight"):
            w -= family.gguf_norm_shift
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    for (layer, kind), by_expert in per_expert.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"GGUF file {str(gguf_path)!r}: layer {layer}'s {kind} misses experts")
        experts.setdefault(layer, {})[kind] = np.stack([by_expert[e] for e in range(len(by_expert))])
    del per_expert
    tensors.update(_stacked_experts(experts, str(gguf_path), family.module == "gpt_oss"))
    del experts
    tied = "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors

    config = hf_config(reader, gguf_path, family, tied, rope_factors)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    controls = control_tokens(reader)
    template = _write_tokenizer(gguf_path, out, arch, controls)
    generation = generation_config(reader, template, controls)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    (out / "pagoda_source.json").write_text(
        json.dumps(
            {
                "gguf": str(gguf_path),
                "gguf_sha256": file_sha256(gguf_path),
                "converter_version": CONVERTER_VERSION,
            },
            indent=2,
        )
        + "\n"
    )


def _write_tokenizer(gguf_path: Path, out: Path, arch: str, controls: dict[str, int]) -> str:
    """The tokenizer files; returns the chat template (the file's, else the one its turn markers spell)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # AutoTokenizer reads the file's config first to pick a class, which fails where transformers lacks the
    # architecture; the generic fast tokenizer reads only the tokenizer keys.
    reader_class = AutoTokenizer if transformers_reads(arch) else PreTrainedTokenizerFast
    tok = reader_class.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    template = tok.chat_template
    if template is None:
        known = template_for_vocabulary(controls)
        if known is None:
            raise ValueError(f"GGUF file {str(gguf_path)!r} has no chat template (tokenizer.chat_template)")
        template = known[0]
        tok.chat_template = template
    tok.save_pretrained(str(out))
    # Keep the chat template inside tokenizer_config.json too, where older readers look for it, and name
    # a tokenizer class every transformers version knows.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("local_files_only", None)
    cfg.pop("is_local", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return template
