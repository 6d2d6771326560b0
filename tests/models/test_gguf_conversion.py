"""GGUF conversion on small synthetic files written the way llama.cpp writes them (q/k rows permuted for
Llama and Granite, q/k/v biases for Qwen2, Gemma's norms stored as 1 + w, Phi-3's fused q/k/v and gate/up and
its LongRoPE factors as tensors, Granite's multipliers as metadata, the mixtures of experts' stacked experts
(Qwen3-MoE, Mixtral as a Llama with experts, gpt-oss with its sinks, biases and interleaved gate/up)): the
converted directory must reproduce the original weights and configuration (transformers and Pagoda compute
the source model's logits from it), land atomically in the cache and be reused."""

from __future__ import annotations

import json
from dataclasses import asdict

import gguf
import numpy as np
import pytest
import torch
from pagoda.engine.attention import get_attention_backend
from pagoda.engine.loader import load_model, load_tokenizer, resolve_model
from pagoda.engine.loader.gguf_cache import converted_dir
from pagoda.engine.sizing.model_config import ModelConfig
from pagoda.engine.sizing.shapes import shape_from_path
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers import LlamaForCausalLM as HFLlama
from transformers import Qwen2ForCausalLM as HFQwen2

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: a complete byte-level vocabulary without merges."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's conversion of q/k rows (the inverse of what Pagoda undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# HF module -> llama.cpp tensor name (written here from llama.cpp's conventions, independent of the converter).
_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router
}
_GEMMA_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GPT_OSS_NAMES = {"mlp.router": "ffn_gate_inp", "post_attention_layernorm": "post_attention_norm"}


def _write_gpt_oss_tensor(writer, layer: str, module: str, kind: str, w: np.ndarray) -> None:
    """gpt-oss as llama.cpp writes it: sinks as attn_sinks, the router as ffn_gate_inp, the experts' interleaved
    gate/up columns ([E, H, 2I]) split into stacked [E, I, H] gate and up, down [E, I, H] as [E, H, I]."""
    if module == "self_attn":  # the sinks; the projections are named as everywhere
        if kind != "sinks":
            raise KeyError(kind)
        writer.add_tensor(f"blk.{layer}.attn_sinks.weight", w)
    elif module in _GPT_OSS_NAMES:
        writer.add_tensor(f"blk.{layer}.{_GPT_OSS_NAMES[module]}.{kind}", w)
    elif kind == "gate_up_proj":
        writer.add_tensor(
            f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(w[..., 0::2].transpose(0, 2, 1))
        )
        writer.add_tensor(
            f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(w[..., 1::2].transpose(0, 2, 1))
        )
    elif kind == "gate_up_proj_bias":
        writer.add_tensor(f"blk.{layer}.ffn_gate_exps.bias", np.ascontiguousarray(w[:, 0::2]))
        writer.add_tensor(f"blk.{layer}.ffn_up_exps.bias", np.ascontiguousarray(w[:, 1::2]))
    elif kind == "down_proj":
        writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", np.ascontiguousarray(w.transpose(0, 2, 1)))
    else:
        writer.add_tensor(f"blk.{layer}.ffn_down_exps.bias", w)


_PERMUTED = ("llama", "granite")  # llama.cpp's LlamaModel lineage interleaves the rotary halves of q/k rows
_GEMMA = ("gemma2", "gemma3")  # llama.cpp stores Gemma's (1 + w) norms as 1 + w


def _write_gguf(
    path, arch: str, hf, cfg, template: str | None = TEMPLATE, extra_tokens=(), split_experts: bool = False
) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch in ("qwen3", "qwen3moe", "gpt-oss", *_GEMMA):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    experts = getattr(cfg, "num_local_experts", 0)
    if experts:  # llama.cpp writes Mixtral as a Llama with these keys
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "gpt-oss":
        writer.add_expert_feed_forward_length(cfg.intermediate_size)
        writer.add_sliding_window(cfg.sliding_window)
    if arch in _GEMMA or (arch == "phi3" and cfg.sliding_window):
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "phi3":
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "phi3" and "long_factor" in rope:
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if arch == "granite":
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    tokens = _byte_tokens() + ["he", "ll", "<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_tokens]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 258 + [3] * (3 + len(extra_tokens)))
    writer.add_token_merges(["h e", "l l"])
    writer.add_bos_token_id(259)
    writer.add_eos_token_id(260)
    if getattr(cfg, "pad_token_id", None) is not None:
        writer.add_pad_token_id(cfg.pad_token_id)
    if template is not None:
        writer.add_chat_template(template)
    names = {**_GGUF_NAMES, **_GEMMA_NAMES} if arch in _GEMMA else _GGUF_NAMES
    for name, t in hf.state_dict().items():
        w = t.float().numpy().copy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out = "output.weight"
        else:
            _, _, layer, *rest = name.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            if arch == "gpt-oss" and (module in ("mlp.experts", "self_attn") or module in _GPT_OSS_NAMES):
                _write_gpt_oss_tensor(writer, layer, module, kind, w)
                continue
            if module == "mlp.experts":  # transformers 5's [E, 2I, H] / [E, H, I]: llama.cpp stacks each part
                halves = np.split(w, 2, axis=1) if kind == "gate_up_proj" else [w]
                parts = ("gate", "up") if kind == "gate_up_proj" else ("down",)
                for part, half in zip(parts, halves, strict=True):
                    if split_experts:  # older Mixtral files: one tensor per expert
                        for e in range(half.shape[0]):
                            writer.add_tensor(
                                f"blk.{layer}.ffn_{part}.{e}.weight", np.ascontiguousarray(half[e])
                            )
                    else:
                        writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", np.ascontiguousarray(half))
                continue
            out = f"blk.{layer}.{names[module]}.{kind}"
            if arch in _PERMUTED and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if module.endswith("q_proj") else cfg.num_key_value_heads
                w = _permute(w, heads)
        if arch in _GEMMA and name.endswith("norm.weight"):
            w = w + 1.0
        writer.add_tensor(out, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


COMMON = dict(
    vocab_size=261,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


@pytest.mark.parametrize(
    "arch,hf_cls,make_cfg",
    [
        ("llama", HFLlama, lambda: LlamaConfig(**COMMON, tie_word_embeddings=True)),
        ("qwen2", HFQwen2, lambda: Qwen2Config(**COMMON, tie_word_embeddings=False)),
    ],
)
def test_gguf_round_trip(arch, hf_cls, make_cfg, tmp_path, monkeypatch, paged, caches):
    torch.manual_seed(0)
    cfg = make_cfg()
    hf = hf_cls(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.2 * torch.randn(p.shape))
    src = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(src, arch, hf, cfg)
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGODA_CACHE", str(cache))

    out = resolve_model(src)
    assert out == converted_dir(src, cache) and out.parent == cache
    assert sorted(p.name for p in cache.iterdir()) == [out.name]  # atomic: no temp dir left behind
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(src)) == out and (out / "model.safetensors").stat().st_mtime_ns == mtime

    model, mc = load_model(out, torch.float32, "cpu", get_attention_backend("torch", "cpu"), progress=False)
    assert mc.architecture == arch and mc.tie_word_embeddings == cfg.tie_word_embeddings
    assert mc.attention_bias == (arch == "qwen2")
    ids = torch.randint(0, 261, (12,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    kv = caches(mc.num_hidden_layers, 8, 8, mc.num_key_value_heads, mc.head_dim)
    logits = model.compute_logits(model(ids, torch.arange(12), kv, paged(8, 8).step([(0, 0, 12)])))
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)

    tok = load_tokenizer(out)
    ids = tok("hello wörld").input_ids
    assert ids[:3] == [256, 257, ord("o")]  # the merges apply
    assert tok.decode(ids) == "hello wörld"
    assert tok.chat_template == TEMPLATE
    assert tok.eos_token == "<|im_end|>"


_GEMMA_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}
_NO_THETA = {k: v for k, v in COMMON.items() if k != "rope_theta"}
# Each family with the features its GGUF form must carry set away from their defaults where GGUF can say so
# (a key's text before "-" is the GGUF architecture; gpt-oss's is the whole key).
NEW_FAMILIES = {
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True),
    "qwen3-yarn": lambda: Qwen3Config(
        **_NO_THETA,
        head_dim=16,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "gemma3": lambda: Gemma3TextConfig(
        **{**_NO_THETA, "num_hidden_layers": 6},  # five sliding layers, then a full one
        head_dim=16,
        sliding_window=4,
        rope_parameters=_GEMMA_ROPE,
        query_pre_attn_scalar=256,  # GGUF has no key for it; readers use Gemma's 256
    ),
    "gemma3-linear": lambda: Gemma3TextConfig(  # Gemma 3 4B and larger: global layers' positions / 8
        **{**_NO_THETA, "num_hidden_layers": 6},
        head_dim=16,
        sliding_window=4,
        rope_parameters={
            **_GEMMA_ROPE,
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        },
        query_pre_attn_scalar=256,
    ),
    "gemma2": lambda: Gemma2Config(
        **_NO_THETA,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        head_dim=16,
        sliding_window=4,
        attn_logit_softcapping=2.0,  # small caps so they bite on random weights
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=256,
    ),
    "gemma2-27b": lambda: Gemma2Config(  # 46 layers: llama.cpp scales attention by hidden / heads (27B)
        **{**_NO_THETA, "num_hidden_layers": 46, "hidden_size": 48},
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=12,
    ),
    "phi3": lambda: Phi3Config(
        **{**_NO_THETA, "num_key_value_heads": 4},
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "long_factor": [1.5, 3.0],
            "short_factor": [1.1, 1.3],
            "partial_rotary_factor": 0.5,  # Phi-4-mini rotates part of each head
        },
        original_max_position_embeddings=64,
        sliding_window=6,  # Phi-3-mini's config has one (2047)
        pad_token_id=0,
        tie_word_embeddings=False,
    ),
    "qwen3moe": lambda: Qwen3MoeConfig(
        **COMMON,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        norm_topk_prob=True,  # what llama.cpp runs (Qwen3-30B-A3B's config sets it too)
        tie_word_embeddings=False,
    ),
    "llama-mixtral": lambda: MixtralConfig(
        **COMMON,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    "gpt-oss": lambda: GptOssConfig(
        **_NO_THETA,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=6,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        tie_word_embeddings=False,
    ),
    "granite": lambda: GraniteConfig(
        **COMMON,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        logits_scaling=4.0,
        tie_word_embeddings=False,
    ),
}
_ENGINE_ONLY = ("torch_dtype", "bos_token_id", "eos_token_ids")  # the file's tokenizer ids, bfloat16 on GPU


def _tiny_gguf(name: str, tmp_path, **write):
    arch = "gpt-oss" if name.startswith("gpt-oss") else name.split("-")[0]
    torch.manual_seed(0)
    cfg = NEW_FAMILIES[name]()
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.2 * torch.randn(p.shape))
    src = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(src, arch, hf, cfg, **write)
    return src, hf, cfg


@pytest.mark.parametrize("name", list(NEW_FAMILIES))
def test_gguf_new_families(name, tmp_path, monkeypatch, paged, caches):
    src, hf, cfg = _tiny_gguf(name, tmp_path)
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "cache"))
    out = resolve_model(src)

    expected = {
        k: v for k, v in hf.state_dict().items() if k != "lm_head.weight" or not cfg.tie_word_embeddings
    }
    converted = load_file(str(out / "model.safetensors"))
    assert sorted(converted) == sorted(expected)
    for key, tensor in expected.items():  # Gemma's norms come back through (w + 1) - 1 in float32
        torch.testing.assert_close(converted[key], tensor, atol=1e-6, rtol=0, msg=key)

    ours = asdict(ModelConfig.from_dir(out))
    source = asdict(ModelConfig.from_hf_config(json.loads(cfg.to_json_string())))
    for key in _ENGINE_ONLY:
        ours.pop(key), source.pop(key)
    assert ours == source
    # The planner sizes the file itself (before any conversion) as the same family with the same experts.
    shape = shape_from_path(src)
    assert shape.architecture == source["architecture"]
    assert (shape.num_experts, shape.experts_per_token, shape.moe_intermediate_size) == (
        source["num_experts"],
        source["num_experts_per_tok"],
        source["moe_intermediate_size"],
    )

    # transformers on the converted directory computes what the source model computes: nothing the
    # architecture reads from its config (caps, multipliers, rotary, windows) was lost on the way.
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, 261, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 259,
        "eos_token_id": [260],
    }

    # And Pagoda's model on the converted directory computes it too.
    model, mc = load_model(out, torch.float32, "cpu", get_attention_backend("torch", "cpu"), progress=False)
    if name == "phi3":
        # an engine within the pretraining length rotates with the short factors, as transformers does
        model.set_max_model_len(cfg.original_max_position_embeddings)
    kv = caches(mc.num_hidden_layers, 8, 8, mc.num_key_value_heads, mc.head_dim)
    with torch.no_grad():
        logits = model.compute_logits(model(ids[0], torch.arange(12), kv, paged(8, 8).step([(0, 0, 12)])))
        # float32 products summed in another order than torch's (the host's measured CPU linear kernel,
        # engine/models/cpu_linear_choice.py): Gemma 2's logits reach its cap of 30, an ulp there is 2e-6
        torch.testing.assert_close(logits, hf(ids).logits[0], atol=5e-5, rtol=1e-5)


def test_gguf_mixtral_with_one_tensor_per_expert(tmp_path, monkeypatch):
    """Older llama.cpp Mixtral files (blk.N.ffn_gate.E.weight, one tensor per expert) convert to the same
    checkpoint as the stacked form."""
    src, _, _ = _tiny_gguf("llama-mixtral", tmp_path)
    (tmp_path / "split").mkdir()
    split, _, _ = _tiny_gguf("llama-mixtral", tmp_path / "split", split_experts=True)
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "cache"))
    stacked = load_file(str(resolve_model(src) / "model.safetensors"))
    per_expert = load_file(str(resolve_model(split) / "model.safetensors"))
    assert sorted(per_expert) == sorted(stacked)
    assert "model.layers.0.mlp.experts.gate_up_proj" in stacked
    for key, tensor in stacked.items():
        torch.testing.assert_close(per_expert[key], tensor, atol=0, rtol=0, msg=key)


def test_gguf_without_chat_template_gets_the_turn_format_of_its_markers(tmp_path, monkeypatch):
    """Gemma files often carry no tokenizer.chat_template: <start_of_turn>/<end_of_turn> in the vocabulary
    give Gemma's turns, and <end_of_turn> joins the ids that end a sequence."""
    src, _, _ = _tiny_gguf(
        "gemma3", tmp_path, template=None, extra_tokens=("<start_of_turn>", "<end_of_turn>")
    )
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "cache"))
    out = resolve_model(src)
    tok = load_tokenizer(out)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [260, 262]


def test_gguf_without_chat_template_or_turn_markers_is_refused(tmp_path, monkeypatch):
    src, _, _ = _tiny_gguf("qwen3", tmp_path, template=None)
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="has no chat template"):
        resolve_model(src)
