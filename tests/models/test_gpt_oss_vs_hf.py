"""gpt-oss against transformers (eager attention, its per-expert loop) on the same random tiny weights.

The checkpoint is saved by transformers and loaded through Pagoda's loader. Tiny shape: 4 layers alternating a
6-token sliding window and full attention, 8 query heads over 2 KV heads, 4 experts top-2 with biases, YaRN, a
SwiGLU limit low enough (0.6) that its clamps bite, sinks large enough to move the attention. The harness
(random weights, greedy decoding) is test_models_vs_hf.py's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from pagoda.engine.attention import get_attention_backend
from pagoda.engine.loader import load_model
from pagoda.engine.models import ModelConfig, get_model_class
from pagoda.engine.models.gpt_oss import GptOssMoE, biased_experts, biased_experts_ref
from pagoda.engine.models.mxfp4 import dequantize_mxfp4
from transformers import GptOssConfig, GptOssForCausalLM


def _harness():
    path = Path(__file__).with_name("test_models_vs_hf.py")
    spec = importlib.util.spec_from_file_location("pagoda_models_vs_hf_harness", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


H = _harness()
SEQ = H.SEQ
WINDOW = 6


def _config() -> GptOssConfig:
    cfg = GptOssConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=64,  # MXFP4 packs rows of 32
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        swiglu_limit=0.6,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def _make_hf(seed: int = 5) -> GptOssForCausalLM:
    torch.manual_seed(0)
    hf = GptOssForCausalLM(_config()).eval()
    H._randomize(hf, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.copy_(1.5 * torch.randn(layer.self_attn.sinks.shape, generator=g))
    return hf


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    hf = _make_hf()
    path = tmp_path_factory.mktemp("gpt-oss")
    hf.save_pretrained(path, safe_serialization=True)
    ids = torch.randint(0, 320, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    return path, hf, ids, ref


def _load(path, dtype=torch.float32, backend="torch"):
    return load_model(path, dtype, "cpu", get_attention_backend(backend, "cpu"), progress=False)


def test_config_is_read(built):
    path, _, _, _ = built
    model, cfg = _load(path)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        "gpt_oss", 4, 2, 64,
    )  # fmt: skip
    assert cfg.attention_bias and cfg.swiglu_limit == 0.6 and cfg.rope_scaling["rope_type"] == "yarn"
    assert [cfg.layer_sliding_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert all(isinstance(layer.mlp, GptOssMoE) for layer in model.layers)
    assert model.layers[0].self_attn.o_proj.bias is not None
    assert model.layers[0].self_attn.sinks.dtype == torch.float32


@pytest.mark.parametrize("native", [None, False])
def test_chunked_prefill_and_decode_match_hf(built, paged, caches, native):
    """Seq 0: chunks then decodes past the window; seq 1 beside it. Native C kernels and the torch path."""
    path, _, ids, ref = built
    cfg = ModelConfig.from_dir(path)
    model = get_model_class(cfg.architecture)(cfg, _backend(native), torch.float32)
    from pagoda.engine.loader.weights import iter_weights

    model.load_weights(iter_weights(path, progress=False))
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


def _backend(native):
    from pagoda.engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(native=native)


def test_each_feature_is_what_hf_uses(built, paged, caches):
    """Guard against vacuous tests: without the sinks, the window, the clamp or the biases our model no longer
    matches transformers."""
    path, _, ids, ref = built

    def prefill(model):
        cfg = model.config
        kv = caches(cfg.num_hidden_layers, 16, 8, cfg.num_key_value_heads, cfg.head_dim)
        meta = paged(num_blocks=16, block_size=8).step([(0, 0, SEQ)])
        return model.compute_logits(model(ids[0], torch.arange(SEQ), kv, meta))

    tweaks = [
        lambda m: [layer.self_attn.sinks.fill_(-1e4) for layer in m.layers],
        lambda m: [setattr(layer.self_attn, "sliding_window", None) for layer in m.layers],
        lambda m: [setattr(layer.mlp, "limit", 1e4) for layer in m.layers],
        lambda m: [layer.mlp.b13.zero_() for layer in m.layers],
        lambda m: [layer.mlp.router_bias.zero_() for layer in m.layers],
    ]
    for tweak in tweaks:
        model, _ = _load(path)
        torch.testing.assert_close(prefill(model), ref[0], atol=2e-5, rtol=1e-4)
        tweak(model)
        assert (prefill(model) - ref[0]).abs().max() > 1e-3


def test_greedy_tokens_and_logprobs_match_hf(built):
    """The engine end to end (scheduler, paged cache, sampler) gives transformers' greedy decoding, also with
    the sliding layers' window pool (--sliding-window-cache auto, the default) and without it (off)."""
    from pagoda.engine import LLM, SamplingParams

    path, hf, _, _ = built
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300, 17, 250, 251, 4, 9, 11, 12]]
    n = 10
    want = [H._hf_greedy(hf, p, n) for p in prompts]
    for extra in ({}, {"sliding_window_cache": "off"}):
        llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, skip_tokenizer_init=True,
                  kv_cache_memory_bytes=4 << 20, **extra)  # fmt: skip
        try:
            reason = llm.engine.core.window_cache_reason
            assert reason.startswith("window group") == (not extra), reason
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
            outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.engine.close()
        for out, (tokens, logprobs) in zip(outs, want, strict=True):
            assert list(out.token_ids) == tokens
            got = [step[t].logprob for step, t in zip(out.logprobs, tokens, strict=True)]
            assert got == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.timeout(300)
def test_tp2_greedy_matches_hf(tmp_path):
    """Two gloo ranks: each holds half of every expert's intermediate size and half the query heads (with their
    sinks); down's bias on rank 0 only."""
    from pagoda.engine import LLM, SamplingParams

    hf = _make_hf(seed=7)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompts = [[5, 6, 7, 8, 9], [42] * 12]
    n = 6
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


def test_bfloat16_runs_close_to_fp32(built, paged, caches):
    path, _, ids, ref = built
    model, cfg = _load(path, torch.bfloat16)
    kv = caches(cfg.num_hidden_layers, 16, 8, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16)
    meta = paged(num_blocks=16, block_size=8).step([(0, 0, SEQ)])
    logits = model.compute_logits(model(ids[0], torch.arange(SEQ), kv, meta))
    close = (logits - ref[0]).abs().amax(-1) < 0.1 * ref[0].abs().max()
    assert close.float().mean() > 0.9


# ---- MXFP4 -----------------------------------------------------------------------------------------------


def _packed(shape_rows: tuple[int, ...], cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape_rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 134, (*shape_rows, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_decode_matches_transformers():
    """Our E2M1 x E8M0 decode equals transformers' own dequantization of the same packed bytes (which also
    transposes to its [E, in, out] layout)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _packed((3, 24), 64, seed=0)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [3, 24, 64]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 64, 24]
    torch.testing.assert_close(ours, theirs.transpose(1, 2), rtol=0, atol=0)
    assert ours.abs().max() > 0
    # spot check the format itself: code 0x21 -> low nibble 1 (0.5), high nibble 2 (1.0), times 2^(128-127)
    one = dequantize_mxfp4(torch.full((1, 16), 0x21, dtype=torch.uint8), torch.tensor([128], dtype=torch.uint8),
                           torch.float32)  # fmt: skip
    assert one[:4].tolist() == [1.0, 2.0, 1.0, 2.0]


def test_mxfp4_experts_load_as_their_dequantized_floats(built, paged, caches):
    """A checkpoint whose experts are MXFP4 pairs (gate_up_proj_blocks/_scales [E, 2I, H/32, 16], as the
    hub's gpt-oss) loads to the same model as the float checkpoint holding transformers' dequantization."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, hf, ids, _ = built
    cfg = ModelConfig.from_dir(path)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    state = dict(hf.state_dict())
    packed_state, float_state = {}, {}
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            rows, cols = (2 * i, h) if name.endswith("gate_up_proj") else (h, i)
            blocks, scales = _packed((e, rows), cols, seed=len(name))
            packed_state[name + "_scales"] = scales  # the scales first: the loader pairs either order
            packed_state[name + "_blocks"] = blocks
            float_state[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            packed_state[name] = float_state[name] = tensor
    outs = []
    for weights in (packed_state, float_state):
        model = get_model_class("gpt_oss")(cfg, get_attention_backend("torch", "cpu"), torch.float32)
        model.load_weights(weights.items())
        kv = caches(cfg.num_hidden_layers, 16, 8, cfg.num_key_value_heads, cfg.head_dim)
        meta = paged(num_blocks=16, block_size=8).step([(0, 0, SEQ)])
        outs.append(model.compute_logits(model(ids[0], torch.arange(SEQ), kv, meta)))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    # and a blocks tensor without its scales is refused by name
    model = get_model_class("gpt_oss")(cfg, get_attention_backend("torch", "cpu"), torch.float32)
    lonely = {k: v for k, v in packed_state.items() if k != "model.layers.1.mlp.experts.down_proj_scales"}
    with pytest.raises(ValueError, match="down_proj_blocks"):
        model.load_weights(lonely.items())


def test_mxfp4_quantization_config_is_read_as_float_weights():
    d = {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_size": 64,
        "vocab_size": 100,
        "num_local_experts": 4,
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn"],
        },
    }
    cfg = ModelConfig.from_hf_config(d)
    assert cfg.architecture == "gpt_oss" and cfg.num_experts == 4


# ---- the experts against their twin ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [40, 7])  # 7: rows torch._grouped_mm refuses, the padded-bmm path
def test_biased_experts_match_the_twin(dtype, inter):
    g = torch.Generator().manual_seed(0)
    e, h, t, k = 6, 32, 9, 2
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (0.3 * torch.randn(e, 2 * inter, h, generator=g)).to(dtype)
    b13 = torch.randn(e, 2 * inter, generator=g).to(dtype)
    w2 = (0.3 * torch.randn(e, h, inter, generator=g)).to(dtype)
    b2 = torch.randn(e, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e - 2, generator=g)[:k] for _ in range(t)])  # experts 4, 5: no token
    weights = torch.rand(t, k, generator=g)
    got = biased_experts(x, w13, b13, w2, b2, weights, ids, 1.702, 0.8)
    want = biased_experts_ref(x, w13, b13, w2, b2, weights, ids, 1.702, 0.8)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
