"""Mixture-of-experts families (Qwen3-MoE, Mixtral) against transformers on the same random tiny weights.

The checkpoints are saved by transformers (per-expert tensors, the hub's layout) and loaded through
Pagoda's loader; the harness (random weights, transformers' greedy decoding) is test_models_vs_hf.py's.
Qwen3-MoE: 8 experts, top-2 renormalised, QK-norm, layer 1 dense through mlp_only_layers. Mixtral: 4
experts, top-2 (always renormalised), a 6-token sliding window.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from pagoda.engine.attention import get_attention_backend
from pagoda.engine.loader import load_model
from pagoda.engine.models import LlamaForCausalLM, ModelConfig
from pagoda.engine.models import moe as moe_module
from pagoda.engine.models.layers import SiluMLP
from pagoda.engine.models.moe import SparseMoE, experts_cpu, experts_loop
from pagoda.kernels.moe_reference import fused_experts_ref, route_ref
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM


def _harness():
    """test_models_vs_hf.py as a module (tests are imported by path under --import-mode=importlib)."""
    path = Path(__file__).with_name("test_models_vs_hf.py")
    spec = importlib.util.spec_from_file_location("pagoda_models_vs_hf_harness", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


H = _harness()
SEQ = H.SEQ
COMMON = {**H.COMMON, "num_hidden_layers": 3}
FAMILIES = {
    "qwen3-moe": (
        Qwen3MoeForCausalLM,
        lambda: Qwen3MoeConfig(
            **COMMON,
            head_dim=16,
            moe_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "mixtral-window": (
        MixtralForCausalLM,
        lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=6),
    ),
}
_BUILT: dict = {}


def _build(name: str, tmp_path_factory):
    if name not in _BUILT:
        hf_cls, make_config = FAMILIES[name]
        torch.manual_seed(0)
        cfg = make_config()
        cfg._attn_implementation = "eager"
        cfg._experts_implementation = "eager"  # transformers' definition: a loop over the experts
        hf = hf_cls(cfg).eval()
        H._randomize(hf, seed=len(name))
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path, safe_serialization=True)
        ids = torch.randint(0, COMMON["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref = hf(ids).logits.float()
        _BUILT[name] = (name, path, hf, ids, ref)
    return _BUILT[name]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def _load(path, dtype=torch.float32):
    return load_model(path, dtype, "cpu", get_attention_backend("torch", "cpu"), progress=False)


def _prefill(model, cfg, tokens, paged, caches) -> torch.Tensor:
    kv = caches(cfg.num_hidden_layers, 16, 8, cfg.num_key_value_heads, cfg.head_dim, dtype=model.dtype)
    meta = paged(num_blocks=16, block_size=8).step([(0, 0, len(tokens))])
    return model.compute_logits(model(tokens, torch.arange(len(tokens)), kv, meta))


def test_config_is_read(family):
    name, path, _, _, _ = family
    model, cfg = _load(path)
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in model.layers]
    if name == "qwen3-moe":
        assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 8, 2)
        assert cfg.norm_topk_prob and cfg.qk_norm and cfg.moe_intermediate_size == 40
        assert sparse == [True, False, True] and isinstance(model.layers[1].mlp, SiluMLP)
        assert model.layers[0].mlp.w13.shape == (8, 80, 64) and model.layers[1].mlp.intermediate == 112
    else:
        assert (cfg.architecture, cfg.num_experts, cfg.sliding_window) == ("mixtral", 4, 6)
        assert cfg.norm_topk_prob and cfg.moe_intermediate_size == 112 and sparse == [True] * 3
        assert model.layers[0].mlp.w2.shape == (4, 64, 112)


def test_full_prefill_matches_hf(family, paged, caches):
    _, path, _, ids, ref = family
    model, cfg = _load(path)
    kv = caches(cfg.num_hidden_layers, 16, 8, cfg.num_key_value_heads, cfg.head_dim)
    meta = paged(num_blocks=16, block_size=8).step([(0, 0, SEQ), (1, 0, SEQ)])
    logits = model.compute_logits(model(ids.reshape(-1), torch.arange(SEQ).repeat(2), kv, meta))
    torch.testing.assert_close(logits, ref.reshape(2 * SEQ, -1), atol=2e-5, rtol=1e-4)


def test_chunked_prefill_and_decode_match_hf(family, paged, caches):
    """Seq 0: a prefix, two chunks, then decodes; seq 1 starts later and runs beside it."""
    _, path, _, ids, ref = family
    model, cfg = _load(path)
    batches = paged(num_blocks=24, block_size=8, seed=3)
    kv = caches(cfg.num_hidden_layers, 24, 8, cfg.num_key_value_heads, cfg.head_dim)
    plan = [
        [(0, 0, 7)],
        [(0, 7, 5), (1, 0, 16)],
        [(0, 12, 9), (1, 16, 1)],
        [(0, 21, 1), (1, 17, 4)],
        *[[(0, 22 + i, 1), (1, 21 + i, 1)] for i in range(7)],
        [(1, 28, 1)],
    ]
    for step in plan:
        meta = batches.step(step)
        tokens = torch.cat([ids[s, c : c + q] for s, c, q in step])
        positions = torch.cat([torch.arange(c, c + q) for s, c, q in step])
        logits = model.compute_logits(model(tokens, positions, kv, meta))
        expect = torch.cat([ref[s, c : c + q] for s, c, q in step])
        torch.testing.assert_close(logits, expect, atol=2e-5, rtol=1e-4)


def test_greedy_tokens_and_logprobs_match_hf(family):
    """The engine end to end (scheduler, paged cache, sampler) gives transformers' greedy decoding."""
    from pagoda.engine import LLM, SamplingParams

    _, path, hf, _, _ = family
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300, 17, 250, 251, 4, 9]]
    n = 8
    want = [H._hf_greedy(hf, p, n) for p in prompts]
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, skip_tokenizer_init=True,
              kv_cache_memory_bytes=4 << 20)  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.close()
    for out, (tokens, logprobs) in zip(outs, want, strict=True):
        assert list(out.token_ids) == tokens
        got = [step[t].logprob for step, t in zip(out.logprobs, tokens, strict=True)]
        assert got == pytest.approx(logprobs, abs=1e-4)


def test_transformers_in_memory_expert_layout_loads_too(family, paged, caches):
    """transformers 5 keeps experts as 3-D tensors in memory (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]; Mixtral under mlp.): a state dict in that layout gives the same model."""
    _, path, hf, ids, ref = family
    state = hf.state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    model = LlamaForCausalLM(ModelConfig.from_dir(path), get_attention_backend("torch", "cpu"), torch.float32)
    model.load_weights(state.items())
    torch.testing.assert_close(
        _prefill(model, model.config, ids[0], paged, caches), ref[0], atol=2e-5, rtol=1e-4
    )


def test_bfloat16_runs_close_to_fp32(family, paged, caches):
    _, path, _, ids, ref = family
    model, cfg = _load(path, torch.bfloat16)
    logits = _prefill(model, cfg, ids[0], paged, caches)
    # bfloat16 router logits can flip a token's choice of expert, which moves that whole position (as it
    # does for transformers run in bfloat16, at the same position here): most positions stay close.
    close = (logits - ref[0]).abs().amax(-1) < 0.1 * ref[0].abs().max()
    assert close.float().mean() > 0.9
    assert (logits.argmax(-1) == ref[0].argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize(
    ("name", "tweak"),
    [
        ("qwen3-moe", lambda m: [setattr(layer.mlp, "renormalize", False) for layer in m.layers[::2]]),
        ("qwen3-moe", lambda m: [setattr(layer.mlp, "top_k", 1) for layer in m.layers[::2]]),
        (
            "mixtral-window",
            lambda m: [setattr(layer.self_attn, "sliding_window", None) for layer in m.layers],
        ),
    ],
)
def test_each_feature_is_what_hf_uses(tmp_path_factory, paged, caches, name, tweak):
    """Guard against vacuous tests: without renormalisation, with another k, or without the window our
    model no longer matches transformers."""
    _, path, _, ids, ref = _build(name, tmp_path_factory)
    model, cfg = _load(path)
    tweak(model)
    assert (_prefill(model, cfg, ids[0], paged, caches) - ref[0]).abs().max() > 1e-3


def test_a_missing_or_misshapen_expert_tensor_is_named(tmp_path_factory):
    _, path, hf, _, _ = _build("qwen3-moe", tmp_path_factory)
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    model = LlamaForCausalLM(ModelConfig.from_dir(path), get_attention_backend("torch", "cpu"), torch.float32)
    missing = {k: v for k, v in state.items() if k != "model.layers.2.mlp.experts.5.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing weights for: .*layers.2.mlp.w13"):
        model.load_weights(missing.items())
    bad = {**state, "model.layers.0.mlp.experts.3.down_proj.weight": torch.zeros(64, 39)}
    with pytest.raises(
        ValueError, match=r"experts.3.down_proj.weight' has shape \(64, 39\), expected \(64, 40\)"
    ):
        model.load_weights(bad.items())
    extra = {**state, "model.layers.0.mlp.experts.8.w1.weight": torch.zeros(40, 64)}
    with pytest.raises(ValueError, match="experts.8.w1.weight' has no place in a qwen3_moe model"):
        model.load_weights(extra.items())


@pytest.mark.parametrize("grouped_mm", [True, False])
def test_cpu_experts_match_the_twin_and_the_loop(monkeypatch, grouped_mm):
    """The CPU path (torch._grouped_mm, or the padded bmm without it) against the twin and the
    per-expert loop, with experts no token chose."""
    monkeypatch.setattr(moe_module, "HAS_GROUPED_MM", grouped_mm and moe_module.HAS_GROUPED_MM)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(23, 48, generator=g)
    w13 = torch.randn(8, 64, 48, generator=g) * 0.2
    w2 = torch.randn(8, 48, 32, generator=g) * 0.2
    logits = torch.randn(23, 8, generator=g)
    logits[:, [2, 6]] = -1e4
    weights, ids = route_ref(logits, 3, renormalize=False)
    want = fused_experts_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(experts_cpu(x, w13, w2, weights, ids), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(experts_loop(x, w13, w2, weights, ids), want, atol=1e-5, rtol=1e-5)
    assert experts_cpu(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 48)


# ---------------------------------------------------------------- tensor parallelism


@pytest.mark.timeout(300)
def test_tp2_greedy_matches_hf(tmp_path):
    """Two gloo ranks: every expert on each rank with half of its intermediate size (43 + 42 of 85), the
    dense layer's 130 split 65 + 65, 9 query heads over 3 KV heads split 5 + 4."""
    from pagoda.engine import LLM, SamplingParams

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        **{**COMMON, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 130},
        head_dim=16,
        moe_intermediate_size=85,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the per-expert loop (its grouped_mm needs 16-byte strides)
    hf = Qwen3MoeForCausalLM(cfg).eval()
    H._randomize(hf, seed=7)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 20]
    n = 8
    want = [H._hf_greedy(hf, p, n) for p in prompts]
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=64, tensor_parallel_size=2,
              skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.close()
    for out, (tokens, logprobs) in zip(outs, want, strict=True):
        assert list(out.token_ids) == tokens
        got = [step[t].logprob for step, t in zip(out.logprobs, tokens, strict=True)]
        assert got == pytest.approx(logprobs, abs=1e-4)


def test_lora_is_refused_by_name(tmp_path_factory):
    from pagoda.engine.lora.model import LoRAModel

    _, path, _, _, _ = _build("mixtral-window", tmp_path_factory)
    model, _ = _load(path)
    with pytest.raises(ValueError, match=r"not supported on mixture-of-experts models \(mixtral\)"):
        LoRAModel(model, max_loras=2, max_rank=8)


QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32000,
}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "experts", "top_k", "billions"),
    [(QWEN3_30B_A3B, 128, 8, 30.53), (MIXTRAL_8X7B, 8, 2, 46.70)],
    ids=["Qwen3-30B-A3B", "Mixtral-8x7B"],
)
def test_published_configs_build_the_published_parameter_count(config, experts, top_k, billions):
    """The hub's config.json (the fields as published) read and built on the meta device: the model cards'
    parameter counts (30.5B, 46.7B), so every expert has its place."""
    cfg = ModelConfig.from_hf_config(config)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (experts, top_k, True)
    model = LlamaForCausalLM(cfg, get_attention_backend("torch", "cpu"), torch.bfloat16, device="meta")
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.layers)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.005)
