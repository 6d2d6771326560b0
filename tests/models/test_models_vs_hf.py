"""Our Llama-family models against Hugging Face transformers on the same random tiny weights.

Each HF model is saved with safetensors and loaded back through Pagoda's loader, then run both as one full
prefill and as prefix + chunks + single-token decodes over a paged cache, batched with a second sequence.
"""

from __future__ import annotations

import pytest
import torch
from pagoda.engine.attention import get_attention_backend
from pagoda.engine.loader import load_model, model_fingerprint, weights_nbytes
from pagoda.engine.models import LlamaForCausalLM, ModelConfig
from transformers import (
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)
from transformers import (
    LlamaForCausalLM as HFLlama,
)
from transformers import (
    MistralForCausalLM as HFMistral,
)
from transformers import (
    Qwen2ForCausalLM as HFQwen2,
)

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)
FAMILIES = {
    "llama3-rope": (
        HFLlama,
        lambda: LlamaConfig(
            **COMMON,
            rope_theta=50000.0,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "mistral-window": (HFMistral, lambda: MistralConfig(**COMMON, sliding_window=6)),
    "qwen2-bias": (HFQwen2, lambda: Qwen2Config(**COMMON)),
}
SEQ = 29


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight random, biases and norm scales included, so each code path shows up in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


_BUILT: dict = {}


def _build(name: str, tmp_path_factory):
    if name not in _BUILT:
        _BUILT[name] = _make_family(name, tmp_path_factory)
    return _BUILT[name]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def _make_family(name, tmp_path_factory):
    hf_cls, make_config = FAMILIES[name]
    torch.manual_seed(0)
    cfg = make_config()
    cfg._attn_implementation = "eager"
    hf = hf_cls(cfg).eval()
    _randomize(hf, seed=len(name))
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path, safe_serialization=True)
    ids = torch.randint(0, COMMON["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits.float()  # [2, SEQ, vocab]
    return name, path, hf, ids, ref


def _load(path, dtype=torch.float32):
    return load_model(path, dtype, "cpu", get_attention_backend("torch", "cpu"), progress=False)


def test_config_is_read(family):
    name, path, hf, _, _ = family
    model, cfg = _load(path)
    assert (
        cfg.architecture == {"llama3-rope": "llama", "mistral-window": "mistral", "qwen2-bias": "qwen2"}[name]
    )
    assert cfg.head_dim == 8 and cfg.num_key_value_heads == 2
    if name == "llama3-rope":
        assert (
            cfg.rope_scaling["rope_type"] == "llama3"
            and cfg.tie_word_embeddings
            and cfg.rope_theta == 50000.0
        )
        assert model.lm_head_weight is model.embed_tokens.weight
    if name == "mistral-window":
        assert cfg.sliding_window == 6 and all(cfg.layer_sliding_window(i) == 6 for i in range(3))
    if name == "qwen2-bias":
        assert cfg.attention_bias and model.layers[0].self_attn.qkv_proj.bias is not None
        assert model.layers[0].self_attn.o_proj.bias is None
    # Sizing reads parameter bytes from the headers alone: float32 tensors as saved.
    stored = {
        k: v for k, v in hf.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")
    }
    assert weights_nbytes(path) == sum(v.numel() * 4 for v in stored.values())


def test_full_prefill_matches_hf(family, paged, caches):
    _, path, _, ids, ref = family
    model, cfg = _load(path)
    batches = paged(num_blocks=16, block_size=8)
    kv = caches(cfg.num_hidden_layers, 16, 8, cfg.num_key_value_heads, cfg.head_dim)
    meta = batches.step([(0, 0, SEQ), (1, 0, SEQ)])
    hidden = model(ids.reshape(-1), torch.arange(SEQ).repeat(2), kv, meta)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (2 * SEQ, cfg.vocab_size)
    torch.testing.assert_close(logits, ref.reshape(2 * SEQ, -1), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", [8, 16])
def test_chunked_prefill_and_decode_match_hf(family, paged, caches, block_size):
    """Seq 0: prefix of 7, chunks of 5 and 9, then decodes; seq 1 starts later and runs beside it."""
    _, path, _, ids, ref = family
    model, cfg = _load(path)
    batches = paged(num_blocks=24, block_size=block_size, seed=block_size)
    kv = caches(cfg.num_hidden_layers, 24, block_size, cfg.num_key_value_heads, cfg.head_dim)
    plan = [
        [(0, 0, 7)],
        [(0, 7, 5), (1, 0, 16)],
        [(0, 12, 9), (1, 16, 1)],
        [(0, 21, 1), (1, 17, 4)],
        *[[(0, 22 + i, 1), (1, 21 + i, 1)] for i in range(7)],
        [(1, 28, 1)],
    ]
    seen = {0: 0, 1: 0}
    for step in plan:
        meta = batches.step(step)
        tokens = torch.cat([ids[s, c : c + q] for s, c, q in step])
        positions = torch.cat([torch.arange(c, c + q) for s, c, q in step])
        logits = model.compute_logits(model(tokens, positions, kv, meta))
        expect = torch.cat([ref[s, c : c + q] for s, c, q in step])
        torch.testing.assert_close(logits, expect, atol=2e-5, rtol=1e-4)
        for s, c, q in step:
            assert seen[s] == c
            seen[s] = c + q
    assert seen == {0: SEQ, 1: SEQ}


def test_sliding_window_is_what_hf_uses(tmp_path_factory, paged, caches):
    """Guard against a vacuous Mistral test: without its window our model no longer matches HF."""
    _, path, _, ids, ref = _build("mistral-window", tmp_path_factory)
    model, cfg = _load(path)
    for layer in model.layers:
        layer.self_attn.sliding_window = None
    kv = caches(cfg.num_hidden_layers, 16, 8, cfg.num_key_value_heads, cfg.head_dim)
    meta = paged(num_blocks=16, block_size=8).step([(0, 0, SEQ)])
    logits = model.compute_logits(model(ids[0], torch.arange(SEQ), kv, meta))
    assert (logits[6:] - ref[0, 6:]).abs().max() > 1e-3
    torch.testing.assert_close(logits[:6], ref[0, :6], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_runs_close_to_fp32(family, paged, caches, dtype):
    _, path, _, ids, ref = family
    model, cfg = _load(path, dtype)
    assert model.embed_tokens.weight.dtype == dtype
    kv = caches(cfg.num_hidden_layers, 16, 8, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    meta = paged(num_blocks=16, block_size=8).step([(0, 0, SEQ)])
    logits = model.compute_logits(model(ids[0], torch.arange(SEQ), kv, meta))
    assert logits.dtype == torch.float32
    err = (logits - ref[0]).abs().max().item()
    assert err < 0.15 * ref[0].abs().max().item()
    # Same greedy choice on most positions.
    assert (logits.argmax(-1) == ref[0].argmax(-1)).float().mean() > 0.8


def test_fingerprint_tracks_weights_and_config(family, tmp_path):
    _, path, _, _, _ = family
    fp = model_fingerprint(path)
    assert fp == model_fingerprint(path) and len(fp) == 32 and int(fp, 16) >= 0
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in path.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert model_fingerprint(copy) == fp  # content, not location
    cfg = (copy / "config.json").read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06')
    (copy / "config.json").write_text(cfg)
    assert model_fingerprint(copy) != fp


def test_load_weights_rejects_missing_and_misshapen(family):
    _, path, hf, _, _ = family
    cfg = ModelConfig.from_dir(path)
    model = LlamaForCausalLM(cfg, get_attention_backend("torch", "cpu"), torch.float32)
    state = dict(hf.state_dict())
    state.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="layers.1.mlp.gate_up_proj"):
        model.load_weights(state.items())
    state = dict(hf.state_dict())
    state["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="model.norm.weight"):
        model.load_weights(state.items())
