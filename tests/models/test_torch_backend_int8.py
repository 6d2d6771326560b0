"""The torch backend with an INT8 KV cache: the native CPU decode's INT8 variant against the gathered
formulation, both against dense attention over the dequantized history, and against float32 KV."""

from __future__ import annotations

import math

import pytest
import torch
from pagoda.engine.attention.base import LayerKVCache
from pagoda.engine.attention.torch_backend import TorchAttentionBackend
from pagoda.kernels.reference import quantize_int8


def dense(q_all, k_all, v_all, ctx, ql, window):
    """Attention of tokens [ctx, ctx+ql) over the whole history, one query at a time, in float64."""
    rep = q_all.shape[1] // k_all.shape[1]
    outs = []
    for p in range(ctx, ctx + ql):
        lo = 0 if window is None else max(0, p - window + 1)
        k = k_all[lo : p + 1].repeat_interleave(rep, 1).double()
        v = v_all[lo : p + 1].repeat_interleave(rep, 1).double()
        scores = torch.einsum("hd,khd->hk", q_all[p].double(), k) / math.sqrt(q_all.shape[2])
        outs.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
    return torch.stack(outs).float()


def dequantized(x):
    q, s = quantize_int8(x)
    return q.float() * s[..., None]


def int8_cache(num_blocks, block_size, kv_heads, d):
    shape = (2, num_blocks, block_size, kv_heads, d)
    return LayerKVCache(torch.zeros(shape, dtype=torch.int8), scales=torch.zeros(shape[:4]))


@pytest.mark.parametrize(
    "heads,kv_heads,d,block_size,window",
    [
        (9, 3, 64, 16, None),  # the default model's shapes (AVX-512 path where the CPU has it)
        (8, 2, 128, 32, None),
        (14, 2, 64, 16, 7),  # group of 7, sliding window
        (6, 3, 24, 16, None),  # head size not a multiple of 16: the portable loop
    ],
)
def test_native_int8_decode_matches_gathered_and_dense(
    heads, kv_heads, d, block_size, window, paged, cpu_variant
):
    from pagoda.engine.attention import cpu_decode

    torch.manual_seed(0)
    batches = paged(num_blocks=128, block_size=block_size, seed=1)
    caches = {n: int8_cache(128, block_size, kv_heads, d) for n in ("native", "ref")}
    fp32 = LayerKVCache(torch.zeros(2, 128, block_size, kv_heads, d))
    backends = {"native": TorchAttentionBackend(native=True), "ref": TorchAttentionBackend(native=False)}
    assert cpu_decode.supports(torch.zeros(1, heads, d), caches["native"].kv, caches["native"].scales)
    hist: dict[int, tuple] = {}
    steps = [
        [(0, 0, 37), (1, 0, 1), (2, 0, 5)],
        [(0, 37, 1), (1, 1, 1), (2, 5, 1)],
        [(0, 38, 1), (3, 0, 2 * block_size + 1), (1, 2, 1), (2, 6, 1)],
        [(3, 2 * block_size + 1, 1), (0, 39, 1), (1, 3, 1), (2, 7, 1)],
    ]
    worst_vs_fp32 = 0.0
    for step in steps:
        meta = batches.step(step)
        q = torch.randn(meta.num_tokens, heads, d)
        # keys with per-token magnitudes from 0.1 to 3: a per-tensor scale would waste most of the range
        k = torch.randn(meta.num_tokens, kv_heads, d) * torch.linspace(0.1, 3, meta.num_tokens)[:, None, None]
        v = torch.randn(meta.num_tokens, kv_heads, d)
        outs = {n: backends[n].forward(q, k, v, caches[n], meta, d**-0.5, window) for n in backends}
        out_fp32 = backends["native"].forward(q, k, v, fp32, meta, d**-0.5, window)
        assert torch.equal(caches["native"].kv, caches["ref"].kv)
        assert torch.equal(caches["native"].scales, caches["ref"].scales)
        assert (outs["native"] - outs["ref"]).abs().max() < 1e-5
        worst_vs_fp32 = max(worst_vs_fp32, (outs["native"] - out_fp32).abs().max().item())
        start = 0
        for sid, ctx, ql in step:
            empty = (torch.empty(0, heads, d), torch.empty(0, kv_heads, d), torch.empty(0, kv_heads, d))
            old = hist.get(sid, empty)
            new = (
                q[start : start + ql],
                dequantized(k[start : start + ql]),
                dequantized(v[start : start + ql]),
            )
            hist[sid] = tuple(torch.cat([o, x]) for o, x in zip(old, new, strict=True))
            ref = dense(*hist[sid], ctx, ql, window)
            assert (outs["native"][start : start + ql] - ref).abs().max() < 1e-5
            start += ql
    # INT8 is close to float32 KV, and not identical (the cache really is quantized)
    assert 1e-4 < worst_vs_fp32 < 0.1, worst_vs_fp32


def test_int8_decode_reads_only_the_sequences_own_slots(paged, cpu_variant):
    """Slots no sequence owns hold garbage that quantization never writes (-128, huge scales): the native
    decode must not read them (a read would show as a large error)."""

    torch.manual_seed(3)
    batches = paged(num_blocks=32, block_size=16, seed=2)
    cache = int8_cache(32, 16, 3, 64)
    cache.kv.fill_(-128)
    cache.scales.fill_(1e6)
    prefill = batches.step([(0, 0, 20), (1, 0, 3)])
    q, k, v = torch.randn(23, 9, 64), torch.randn(23, 3, 64), torch.randn(23, 3, 64)
    TorchAttentionBackend(native=True).forward(q, k, v, cache, prefill, 0.125)
    decode = batches.step([(0, 20, 1), (1, 3, 1)])
    q2, k2, v2 = torch.randn(2, 9, 64), torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    out = TorchAttentionBackend(native=True).forward(q2, k2, v2, cache, decode, 0.125)
    assert out.abs().max() < 10
    for i, (lo, hi) in enumerate(((0, 20), (20, 23))):
        ks = torch.cat([dequantized(k[lo:hi]), dequantized(k2[i : i + 1])])
        vs = torch.cat([dequantized(v[lo:hi]), dequantized(v2[i : i + 1])])
        qs = torch.cat([torch.zeros(hi - lo, 9, 64), q2[i : i + 1]])
        ref = dense(qs, ks, vs, hi - lo, 1, None)
        assert (out[i : i + 1] - ref).abs().max() < 1e-5


@pytest.mark.parametrize("heads,kv_heads,d,window", [(4, 1, 256, None), (8, 2, 64, 6), (6, 3, 24, None)])
def test_native_int8_decode_soft_cap(heads, kv_heads, d, window, paged, cpu_variant):
    """The INT8 decode with Gemma 2's soft-cap (applied after each key's scale) matches the gathered
    formulation with the cap, which differs from the uncapped answer."""
    torch.manual_seed(1)
    batches = paged(num_blocks=64, block_size=16, seed=2)
    caches = {n: int8_cache(64, 16, kv_heads, d) for n in ("native", "ref", "plain")}
    backends = {"native": TorchAttentionBackend(native=True), "ref": TorchAttentionBackend(native=False)}
    backends["plain"] = backends["native"]
    for step in ([(0, 0, 40), (1, 0, 3)], [(0, 40, 1), (1, 3, 1)], [(0, 41, 1), (1, 4, 1)]):
        meta = batches.step(step)
        q = torch.randn(meta.num_tokens, heads, d) * 2
        k, v = torch.randn(meta.num_tokens, kv_heads, d), torch.randn(meta.num_tokens, kv_heads, d)
        outs = {
            n: backends[n].forward(q, k, v, caches[n], meta, d**-0.5, window, None if n == "plain" else 0.8)
            for n in caches
        }
        assert (outs["native"] - outs["ref"]).abs().max() < 1e-5
        assert (outs["native"] - outs["plain"]).abs().max() > 1e-2
