"""Our Llama-family models against Hugging Face transformers on the same random tiny weights.

Each HF model is saved with safetensors and loaded back through Pagoda's loader, then run both as one full
prefill and as prefix + chunks + single-token decodes over a paged cache, batched with a second sequence.
The families sharing the Llama implementation each bring their differences: Qwen3 (QK-norm, a head_dim not
hidden/heads, YaRN, tied embeddings), Phi-3 (fused qkv/gate_up tensors, LongRoPE), a Phi-4-mini-like Phi-3
(partial rotary, tied embeddings) and Granite (embedding, attention, residual and logits multipliers).
"""

from __future__ import annotations

import math

import pytest
import torch
from pagoda.engine.attention import get_attention_backend
from pagoda.engine.loader import load_model, model_fingerprint, weights_nbytes
from pagoda.engine.models import LlamaForCausalLM, ModelConfig
from pagoda.engine.models.layers import rope_frequencies
from transformers import (
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)
from transformers import (
    GraniteForCausalLM as HFGranite,
)
from transformers import (
    LlamaForCausalLM as HFLlama,
)
from transformers import (
    MistralForCausalLM as HFMistral,
)
from transformers import (
    Phi3ForCausalLM as HFPhi3,
)
from transformers import (
    Qwen2ForCausalLM as HFQwen2,
)
from transformers import (
    Qwen3ForCausalLM as HFQwen3,
)

PHI3_FACTORS = {"short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [1.0, 2.5, 4.0, 8.0]}
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
    # head_dim 16 over 8 heads of a 64-wide model; YaRN 4x over a 16-token pretraining length.
    "qwen3-qknorm-yarn": (
        HFQwen3,
        lambda: Qwen3Config(
            **{**COMMON, "max_position_embeddings": 64},
            head_dim=16,
            tie_word_embeddings=True,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        ),
    ),
    # LongRoPE past a 16-token pretraining length: the long factors and sqrt(1 + ln 32 / ln 16) on cos/sin.
    "phi3-longrope": (
        HFPhi3,
        lambda: Phi3Config(
            **COMMON,
            original_max_position_embeddings=16,
            pad_token_id=None,
            eos_token_id=2,
            rope_scaling={"rope_type": "longrope", **PHI3_FACTORS},
        ),
    ),
    # Phi-4-mini's shape: 3/4 of each 16-dim head rotates, tied embeddings.
    "phi4-mini-partial": (
        HFPhi3,
        lambda: Phi3Config(
            **{**COMMON, "num_attention_heads": 4},
            partial_rotary_factor=0.75,
            tie_word_embeddings=True,
            original_max_position_embeddings=16,
            pad_token_id=None,
            eos_token_id=2,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.4],
                "long_factor": [1.0, 2.0, 3.0, 5.0, 8.0, 12.0],
            },
        ),
    ),
    "granite-multipliers": (
        HFGranite,
        lambda: GraniteConfig(
            **COMMON,
            embedding_multiplier=3.0,
            attention_multiplier=0.2,
            residual_multiplier=0.4,
            logits_scaling=2.5,
        ),
    ),
}
ARCHITECTURE = {
    "llama3-rope": "llama",
    "mistral-window": "mistral",
    "qwen2-bias": "qwen2",
    "qwen3-qknorm-yarn": "qwen3",
    "phi3-longrope": "phi3",
    "phi4-mini-partial": "phi3",
    "granite-multipliers": "granite",
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
    assert cfg.architecture == ARCHITECTURE[name]
    assert cfg.num_key_value_heads == 2
    assert cfg.head_dim == {"qwen3-qknorm-yarn": 16, "phi4-mini-partial": 16}.get(name, 8)
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
    if name == "qwen3-qknorm-yarn":
        assert cfg.qk_norm and not cfg.attention_bias and cfg.tie_word_embeddings
        assert model.layers[0].self_attn.q_norm.weight.shape == (16,)
        assert model.rotary.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    if name == "phi3-longrope":
        assert cfg.rope_scaling["original_max_position_embeddings"] == 16
        assert model.rotary.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(16)))
    if name == "phi4-mini-partial":
        assert cfg.partial_rotary_factor == 0.75 and model.rotary.inv_freq.shape == (6,)
        assert model.lm_head_weight is model.embed_tokens.weight
    if name == "granite-multipliers":
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == (3.0, 0.4, 2.5)
        assert cfg.attention_scale == 0.2 and model.layers[0].self_attn.scale == 0.2
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
    fused = "model.layers.1.mlp.gate_up_proj.weight"
    state.pop(fused if fused in state else "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="layers.1.mlp.gate_up_proj"):
        model.load_weights(state.items())
    state = dict(hf.state_dict())
    state["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="model.norm.weight"):
        model.load_weights(state.items())


def _tweak_rotary_factor(model):
    model.rotary.attention_factor = 1.0
    model.rotary._cos = model.rotary._cos[:0]  # rebuilt without the factor


def _drop_qk_norm(model):
    for layer in model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = None


def _drop_residual_multiplier(model):
    for layer in model.layers:
        layer.residual_multiplier = 1.0


@pytest.mark.parametrize(
    ("name", "tweak"),
    [
        ("qwen3-qknorm-yarn", _drop_qk_norm),
        ("qwen3-qknorm-yarn", _tweak_rotary_factor),
        ("phi3-longrope", _tweak_rotary_factor),
        ("granite-multipliers", _drop_residual_multiplier),
        ("granite-multipliers", lambda m: setattr(m.config, "embedding_multiplier", 1.0)),
    ],
)
def test_each_feature_is_what_hf_uses(tmp_path_factory, paged, caches, name, tweak):
    """Guard against vacuous family tests: without the feature our model no longer matches HF."""
    _, path, _, ids, ref = _build(name, tmp_path_factory)
    model, cfg = _load(path)
    tweak(model)
    kv = caches(cfg.num_hidden_layers, 16, 8, cfg.num_key_value_heads, cfg.head_dim)
    meta = paged(num_blocks=16, block_size=8).step([(0, 0, SEQ)])
    logits = model.compute_logits(model(ids[0], torch.arange(SEQ), kv, meta))
    assert (logits - ref[0]).abs().max() > 1e-3


def test_longrope_short_factors_below_the_pretraining_length(tmp_path_factory, paged, caches):
    """An engine whose max_model_len is within original_max_position_embeddings rotates with the short
    factors (and the same attention factor), which is what transformers does for sequences that short."""
    _, path, hf, ids, _ = _build("phi3-longrope", tmp_path_factory)
    cfg = ModelConfig.from_dir(path)
    n = cfg.rope_scaling["original_max_position_embeddings"]
    with torch.no_grad():
        ref = hf(ids[:, :n]).logits.float()
    backend = get_attention_backend("torch", "cpu")
    model = LlamaForCausalLM(cfg, backend, torch.float32, max_model_len=n)
    model.load_weights(hf.state_dict().items())
    kv = caches(cfg.num_hidden_layers, 16, 8, cfg.num_key_value_heads, cfg.head_dim)
    meta = paged(num_blocks=16, block_size=8).step([(0, 0, n), (1, 0, n)])
    logits = model.compute_logits(model(ids[:, :n].reshape(-1), torch.arange(n).repeat(2), kv, meta))
    torch.testing.assert_close(logits, ref.reshape(2 * n, -1), atol=2e-5, rtol=1e-4)
    # The default (the config's 512 positions) is the long set: a different rotation of the same tokens.
    model.set_max_model_len(None)
    kv = caches(cfg.num_hidden_layers, 16, 8, cfg.num_key_value_heads, cfg.head_dim)
    meta = paged(num_blocks=16, block_size=8).step([(0, 0, n)])
    long = model.compute_logits(model(ids[0, :n], torch.arange(n), kv, meta))
    assert (long - ref[0]).abs().max() > 1e-3


def _hf_rope(config) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = config.rope_parameters["rope_type"]
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=None)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
         "mscale_all_dim": 0.5, "truncate": False},
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "attention_factor": 1.3},
    ],
)  # fmt: skip
def test_yarn_matches_transformers_rope_init(scaling):
    hf_cfg = Qwen3Config(
        **{**COMMON, "max_position_embeddings": 256}, head_dim=32, rope_scaling=dict(scaling)
    )
    want, want_factor = _hf_rope(hf_cfg)
    cfg = ModelConfig.from_hf_config(hf_cfg.to_dict())
    assert cfg.rope_scaling["rope_type"] == "yarn"
    got, factor = rope_frequencies(32, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    assert factor == pytest.approx(want_factor)
    assert not torch.allclose(got, rope_frequencies(32, cfg.rope_theta, None)[0])


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_matches_transformers_rope_init(partial):
    """Both factor sets, the attention factor from max/original positions, partial rotary, and the old
    "su" name with the pretraining length beside rope_scaling (Phi-3's first configs)."""
    dim = int(8 * partial)
    factors = {
        "short_factor": [1.0, 1.5, 2.0, 3.0][: dim // 2],
        "long_factor": [1.0, 4.0, 6.0, 9.0][: dim // 2],
    }
    hf_cfg = Phi3Config(
        **COMMON,
        partial_rotary_factor=partial,
        original_max_position_embeddings=64,
        pad_token_id=None,
        eos_token_id=2,
        rope_scaling={"rope_type": "longrope", **factors},
    )
    short, short_factor = _hf_rope(hf_cfg)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    long, long_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, "cpu", seq_len=65)
    raw = {**hf_cfg.to_dict(), "rope_scaling": {"type": "su", **factors}}
    raw.pop("rope_parameters")
    cfg = ModelConfig.from_hf_config(raw)
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.partial_rotary_factor == partial
    for max_model_len, want in [(64, short), (65, long), (None, long)]:  # None: the config's 512 positions
        got, factor = rope_frequencies(dim, cfg.rope_theta, cfg.rope_scaling, 512, max_model_len)
        torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
        assert factor == pytest.approx(short_factor) == pytest.approx(long_factor)
    assert short_factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(64)))


@pytest.mark.parametrize(
    ("family", "scaling", "message"),
    [
        ("qwen3", {"rope_type": "dynamic", "factor": 2.0}, "rope_scaling type 'dynamic' is not supported"),
        ("phi3", {"rope_type": "yarn", "factor": 2.0}, r"'yarn' is not supported \(longrope, linear\)"),
        ("granite", {"type": "longrope", "short_factor": [1.0]}, "'longrope' is not supported"),
    ],
)
def test_an_unsupported_rope_scaling_is_refused_by_name(family, scaling, message):
    raw = {**COMMON, "model_type": family, "rope_scaling": scaling}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(raw)
    assert ModelConfig.from_hf_config(raw, strict=False).rope_scaling["rope_type"]  # sizing still reads it


# ---------------------------------------------------------------- tensor parallelism

TP_FAMILIES = {
    # 9 query heads over 3 KV heads split 5 + 4 (a rank's heads straddle a KV group), head_dim 16 of a
    # 64-wide model, an intermediate size that splits 65 + 65.
    "qwen3": (
        HFQwen3,
        lambda: Qwen3Config(
            **{**COMMON, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 130},
            head_dim=16,
            tie_word_embeddings=True,
        ),
    ),
    # The fused qkv_proj and gate_up_proj tensors, split into their parts before each is sharded.
    "phi3": (
        HFPhi3,
        lambda: Phi3Config(
            **{**COMMON, "hidden_size": 72, "num_attention_heads": 9, "num_key_value_heads": 3},
            original_max_position_embeddings=64,
            pad_token_id=None,
            eos_token_id=2,
            rope_scaling={"rope_type": "longrope", **PHI3_FACTORS},
        ),
    ),
}


def _hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs, each step a full forward."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            ids.append(int(logits.argmax()))
            logprobs.append(float(torch.log_softmax(logits, -1)[ids[-1]]))
    return ids[len(prompt) :], logprobs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(TP_FAMILIES))
def test_tp2_greedy_matches_hf(tmp_path, name):
    """Two gloo ranks on the CPU give transformers' greedy tokens and logprobs. Phi-3 runs with max_model_len
    64 = its original_max_position_embeddings: the engine's LongRoPE choice (short factors) reaches every
    rank, and matches transformers on sequences that short."""
    from pagoda.engine import LLM, SamplingParams

    hf_cls, make_config = TP_FAMILIES[name]
    torch.manual_seed(0)
    cfg = make_config()
    cfg._attn_implementation = "eager"
    hf = hf_cls(cfg).eval()
    _randomize(hf, seed=7)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 20]
    n = 8
    want = [_hf_greedy(hf, p, n) for p in prompts]
    llm = LLM(
        str(tmp_path),
        device="cpu",
        dtype="float32",
        max_model_len=64,
        tensor_parallel_size=2,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=4 << 20,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.close()
    for out, (tokens, logprobs) in zip(outs, want, strict=True):
        assert list(out.token_ids) == tokens
        got = [step[t].logprob for step, t in zip(out.logprobs, tokens, strict=True)]
        assert got == pytest.approx(logprobs, abs=1e-4)


def test_a_fused_tensor_of_the_wrong_size_is_named(tmp_path_factory):
    _, path, hf, _, _ = _build("phi3-longrope", tmp_path_factory)
    cfg = ModelConfig.from_dir(path)
    model = LlamaForCausalLM(cfg, get_attention_backend("torch", "cpu"), torch.float32)
    state = dict(hf.state_dict())
    name = "model.layers.0.self_attn.qkv_proj.weight"
    state[name] = state[name][:-8]
    with pytest.raises(
        ValueError, match=r"qkv_proj.weight' has shape \(88, 64\), expected 96 rows \(64 \+ 16"
    ):
        model.load_weights(state.items())
