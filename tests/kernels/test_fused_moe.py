"""The fused MoE kernels (Triton, under the interpreter here) against their torch twins on fresh random
inputs: routings that leave experts without a token, send every token to one expert, and tiles cut inside
an expert's run."""

from __future__ import annotations

import pytest
import torch
from pagoda.kernels.fused_moe import expert_tiles, fused_experts, fused_moe_config, grouped_gemm
from pagoda.kernels.launch_config import INTERPRETER, DeviceLimits
from pagoda.kernels.moe_reference import fused_experts_ref, grouped_gemm_ref, route_ref


def _case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype, seed: int, unused=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    logits = torch.randn(tokens, experts, generator=g) * 2
    logits[:, list(unused)] = -1e4  # these experts receive no token
    weights, ids = route_ref(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


def test_tiles_cover_each_expert_s_slots_once():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 1], [3, 0]])  # expert 2 unused; expert 3 has 5 slots
    tiles = expert_tiles(ids, 4, block_m=2)
    flat = ids.reshape(-1)
    assert torch.equal(flat[tiles.order], torch.sort(flat, stable=True).values)
    real = tiles.tile_expert >= 0
    got = sorted(zip(tiles.tile_expert[real].tolist(), tiles.tile_start[real].tolist(), strict=True))
    # expert 0: slots 0-2 (two tiles), 1: 3-4, 3: 5-9 (three tiles); 2 none
    assert got == [(0, 0), (0, 2), (1, 3), (3, 5), (3, 7), (3, 9)]
    assert tiles.tile_expert.numel() == 5 + 4  # cdiv(10, 2) + experts: shape-only grid
    assert tiles.tile_end[real].tolist() == [3, 3, 5, 10, 10, 10]


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "unused"),
    [(1, 4, 2, (0, 3)), (13, 8, 2, (1, 5, 6)), (37, 4, 1, (1, 2, 3)), (20, 6, 3, ())],
)
def test_grouped_gemm_matches_twin(tokens, experts, top_k, unused):
    x, w13, _, weights, ids = _case(tokens, experts, top_k, 40, 24, torch.float32, tokens, unused)
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    assert all(counts[e] == 0 for e in unused)
    tiles = expert_tiles(ids, experts, 16)
    got = grouped_gemm(x, w13, tiles, a_rows=tiles.order // top_k, scale=weights.reshape(-1)[tiles.order])
    flat = ids.reshape(-1)[tiles.order]
    want = grouped_gemm_ref(x[tiles.order // top_k], w13, flat, weights.reshape(-1)[tiles.order])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("dtype", "tokens", "unused"),
    [(torch.float32, 19, (2, 5)), (torch.float16, 7, (0,)), (torch.bfloat16, 33, (1, 2, 3, 4))],
)
def test_fused_experts_match_twin(dtype, tokens, unused):
    x, w13, w2, weights, ids = _case(tokens, 8, 2, 48, 40, dtype, 100 + tokens, unused)
    got = fused_experts(x, w13, w2, weights, ids)
    want = fused_experts_ref(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    # the routing weights matter: equal weights give another answer
    flat = fused_experts(x, w13, w2, torch.full_like(weights, 0.5), ids)
    assert (flat.float() - want.float()).abs().max() > 1e-2


def test_no_tokens():
    x, w13, w2, weights, ids = _case(0, 4, 2, 16, 16, torch.float32, 0)
    assert fused_experts(x, w13, w2, weights, ids).shape == (0, 16)


def test_launch_config_fits_shared_memory():
    assert fused_moe_config(INTERPRETER, "float32").block_m == 16
    big = fused_moe_config(DeviceLimits((9, 0), 227 * 1024), "bfloat16")
    assert (big.block_m, big.block_n, big.block_k) == (64, 128, 64) and big.shared_memory <= 227 * 1024
    small = fused_moe_config(DeviceLimits((7, 5), 20 * 1024), "float32")
    assert small.shared_memory <= 20 * 1024 and small.block_m >= 16
    with pytest.raises(ValueError, match="no fused MoE tile fits"):
        fused_moe_config(DeviceLimits((7, 5), 1024), "float32")


def test_the_layer_s_gpu_path_matches_its_cpu_path():
    """SparseMoE with the Triton kernels (the GPU path, interpreted here) against its CPU path."""
    from pagoda.engine.models.moe import SparseMoE
    from pagoda.engine.sizing.model_config import ModelConfig

    cfg = ModelConfig("mixtral", 64, 48, 40, 1, 4, 2, 12, num_experts=6, num_experts_per_tok=2,
                      moe_intermediate_size=40)  # fmt: skip
    g = torch.Generator().manual_seed(9)
    layers = [SparseMoE(cfg, torch.float32, torch.device("cpu"), triton=t) for t in (True, False)]
    for p in layers[0].parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(11, 48, generator=g)
    torch.testing.assert_close(layers[0](x), layers[1](x), atol=1e-4, rtol=1e-4)


def test_the_gpu_tiles_match_too(monkeypatch):
    """The largest GPU tile (64 slots x 128 columns x 64), wider than every dimension here: masks only."""
    from pagoda.kernels import fused_moe

    monkeypatch.setattr(
        fused_moe, "fused_moe_config", lambda limits, dtype: fused_moe.MoEConfig(64, 128, 64, 4, 1)
    )
    x, w13, w2, weights, ids = _case(29, 8, 2, 40, 24, torch.float32, 3, unused=(4,))
    torch.testing.assert_close(
        fused_experts(x, w13, w2, weights, ids),
        fused_experts_ref(x, w13, w2, weights, ids),
        atol=1e-4,
        rtol=1e-4,
    )


def test_triton_path_of_a_tiny_qwen3_moe_gives_transformers_greedy_tokens(tmp_path):
    """The engine on the GPU path (Triton attention, norms, rotary and experts; interpreted here) over a
    two-layer Qwen3-MoE (a sparse layer, then a dense one): transformers' greedy tokens through chunked
    prefills, and decodes replayed from recordings (the experts' routing and tiles captured with them)."""
    from pagoda.engine import LLM, SamplingParams
    from pagoda.engine.worker.decode_graphs import RerunCapture
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=128,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    hf = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
            else:  # norm scales
                p.copy_(1 + 0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (21,), generator=g).tolist(), [5, 9, 77]]
    new = 5
    expect = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            expect.append(ids[len(prompt) :])
    llm = LLM(
        model=str(tmp_path), attention_backend="triton", device="cpu", dtype="float32", block_size=16,
        kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=16, max_model_len=64, max_num_seqs=2,
        skip_tokenizer_init=True,
    )  # fmt: skip
    try:
        engine = llm.engine
        assert engine.runner.model.layers[0].mlp.triton
        capture = RerunCapture()
        assert engine.runner.capture_decode_graphs(2, engine.max_model_len, capture=capture) is None
        capture.replays.clear()
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.close()
    assert got == expect
    assert sum(capture.replays.values()) >= new - 1
