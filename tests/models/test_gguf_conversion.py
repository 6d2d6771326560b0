"""GGUF conversion on small synthetic files written the way llama.cpp writes them (q/k rows permuted for
Llama, q/k/v biases for Qwen2): the converted directory must reproduce the original weights exactly, land
atomically in the cache and be reused."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from pagoda.engine.attention import get_attention_backend
from pagoda.engine.loader import load_model, load_tokenizer, resolve_model
from pagoda.engine.loader.gguf_convert import converted_dir
from transformers import LlamaConfig, Qwen2Config
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


def _write_gguf(path, arch: str, hf, cfg) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    tokens = _byte_tokens() + ["he", "ll", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 258 + [3, 3, 3])
    writer.add_token_merges(["h e", "l l"])
    writer.add_bos_token_id(259)
    writer.add_eos_token_id(260)
    writer.add_chat_template(TEMPLATE)
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
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
            out = f"blk.{layer}.{names[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if module.endswith("q_proj") else cfg.num_key_value_heads
                w = _permute(w, heads)
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
