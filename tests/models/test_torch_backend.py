"""The torch paged-attention backend against a dense, per-token reference on random inputs."""

from __future__ import annotations

import math

import pytest
import torch
from pagoda.engine.attention import get_attention_backend
from pagoda.engine.attention.base import LayerKVCache
from pagoda.engine.attention.torch_backend import TorchAttentionBackend


def dense_reference(q_all, k_all, v_all, ctx, ql, window, softcap=None, sinks=None):
    """Attention of the new tokens [ctx, ctx+ql) of one sequence over its whole K/V history, one by one
    (scores soft-capped to softcap * tanh(score / softcap) when softcap is given; with sinks [H], each head's
    sink logit one more softmax column whose weight is dropped)."""
    heads, kv_heads, d = q_all.shape[1], k_all.shape[1], q_all.shape[2]
    rep = heads // kv_heads
    outs = []
    for p in range(ctx, ctx + ql):
        lo = 0 if window is None else max(0, p - window + 1)
        k = k_all[lo : p + 1].repeat_interleave(rep, 1).double()
        v = v_all[lo : p + 1].repeat_interleave(rep, 1).double()
        scores = torch.einsum("hd,khd->hk", q_all[p].double(), k) / math.sqrt(d)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is not None:
            probs = torch.cat((scores, sinks.double()[:, None]), dim=-1).softmax(-1)[:, :-1]
        else:
            probs = scores.softmax(-1)
        outs.append(torch.einsum("hk,khd->hd", probs, v))
    return torch.stack(outs).float()


def fp8_roundtrip(x, dtype, scale):
    limit = torch.finfo(dtype).max
    return ((x / scale).clamp(-limit, limit).to(dtype).float()) * scale


# Steps of (seq_id, context_len, query_len): prefills of ragged lengths (1, exact block multiples, odd),
# then pure decodes, then chunked prefills mixed with decodes.
def schedule(bs):
    first = [(0, 0, 1), (1, 0, bs), (2, 0, 2 * bs + 3), (3, 0, bs - 1)]
    lens = {s: q for s, _, q in first}
    steps = [first]
    decode = [(s, lens[s], 1) for s in sorted(lens)]
    steps.append(decode)
    for s, _, q in decode:
        lens[s] += q
    mixed = [(0, lens[0], 1), (1, lens[1], bs + 2), (2, lens[2], 1), (3, lens[3], 3), (4, 0, 5)]
    steps.append(mixed)
    return steps


def run_schedule(
    backend, block_size, heads, kv_heads, window, cache_dtype, paged, scale=1.0, seed=0, softcap=None, d=16,
    sinks=None,
):  # fmt: skip
    torch.manual_seed(seed)
    batches = paged(num_blocks=64, block_size=block_size, seed=seed)
    cache = LayerKVCache(torch.zeros(2, 64, block_size, kv_heads, d, dtype=cache_dtype), scale, scale)
    hist = {}
    worst = 0.0
    for step in schedule(block_size):
        meta = batches.step(step)
        qs, ks, vs = [], [], []
        for sid, _, ql in step:
            q, k, v = torch.randn(ql, heads, d), torch.randn(ql, kv_heads, d), torch.randn(ql, kv_heads, d)
            if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                ks_ref, vs_ref = fp8_roundtrip(k, cache_dtype, scale), fp8_roundtrip(v, cache_dtype, scale)
            else:
                ks_ref, vs_ref = k, v
            old = hist.get(
                sid, (torch.empty(0, heads, d), torch.empty(0, kv_heads, d), torch.empty(0, kv_heads, d))
            )
            hist[sid] = (torch.cat([old[0], q]), torch.cat([old[1], ks_ref]), torch.cat([old[2], vs_ref]))
            qs.append(q)
            ks.append(k)
            vs.append(v)
        out = backend.forward(
            torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, d**-0.5, window, logit_softcap=softcap,
            sinks=sinks,
        )  # fmt: skip
        ref = torch.cat(
            [dense_reference(*hist[sid], ctx, ql, window, softcap, sinks) for sid, ctx, ql in step]
        )
        assert out.shape == ref.shape
        worst = max(worst, (out - ref).abs().max().item())
    return worst


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_matches_dense_reference(block_size, heads, kv_heads, paged):
    assert (
        run_schedule(TorchAttentionBackend(), block_size, heads, kv_heads, None, torch.float32, paged) < 1e-5
    )


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(window, paged):
    assert run_schedule(TorchAttentionBackend(), 8, 8, 2, window, torch.float32, paged) < 1e-5


def test_sliding_window_changes_the_result(paged):
    """The window really masks: a run with a small window differs from the dense reference without one."""
    backend = TorchAttentionBackend()
    torch.manual_seed(0)
    batches = paged(num_blocks=8, block_size=8)
    q, k, v = torch.randn(20, 2, 16), torch.randn(20, 2, 16), torch.randn(20, 2, 16)
    cache = LayerKVCache(torch.zeros(2, 8, 8, 2, 16))
    out = backend.forward(q, k, v, cache, batches.step([(0, 0, 20)]), 0.25, 4)
    full = dense_reference(q, k, v, 0, 20, None)
    windowed = dense_reference(q, k, v, 0, 20, 4)
    assert torch.allclose(out, windowed, atol=1e-5)
    assert (out[4:] - full[4:]).abs().max() > 1e-2


@pytest.mark.parametrize(
    "heads,kv_heads,d,window,native",
    [(4, 4, 16, None, None), (8, 2, 64, 5, None), (4, 1, 256, None, False), (4, 1, 256, 7, None)],
)
def test_logit_softcap(heads, kv_heads, d, window, native, paged):
    """Gemma 2's soft-capped scores, with and without a window, GQA, head size 256 (Gemma's), on the native
    and the reference formulation: every new token matches the dense reference with the cap."""
    backend = TorchAttentionBackend(native=native)
    worst = run_schedule(backend, 8, heads, kv_heads, window, torch.float32, paged, softcap=0.5, d=d)
    assert worst < 1e-5


def test_logit_softcap_changes_the_result(paged):
    """The cap really applies: a tight cap differs from plain attention, a huge one does not."""
    torch.manual_seed(0)
    q, k, v = torch.randn(20, 2, 16) * 3, torch.randn(20, 2, 16), torch.randn(20, 2, 16)
    outs = {}
    for cap in (None, 0.5, 1e6):
        batches = paged(num_blocks=8, block_size=8)
        cache = LayerKVCache(torch.zeros(2, 8, 8, 2, 16))
        outs[cap] = TorchAttentionBackend().forward(
            q, k, v, cache, batches.step([(0, 0, 20)]), 0.25, logit_softcap=cap
        )
    assert (outs[0.5] - outs[None]).abs().max() > 1e-2
    assert (outs[1e6] - outs[None]).abs().max() < 1e-5
    assert torch.allclose(outs[0.5], dense_reference(q, k, v, 0, 20, None, 0.5), atol=1e-5)


@pytest.mark.parametrize(
    "heads,kv_heads,d,window,native,cache_dtype",
    [
        (4, 4, 16, None, False, torch.float32),
        (8, 2, 64, 5, None, torch.float32),
        (8, 2, 64, None, None, torch.bfloat16),
        (8, 1, 64, 3, None, torch.float32),
        (4, 2, 32, 6, False, torch.float32),
    ],
)
def test_attention_sinks(heads, kv_heads, d, window, native, cache_dtype, paged):
    """gpt-oss's learned sinks (one logit per query head in the softmax's denominator), with and without a
    window, GQA, on the native kernels (decode and prefill) and the torch formulation: every new token
    matches the dense reference with the sinks, and differs from it without them."""
    sinks = torch.tensor([2.0, -1.0, 0.5, 30.0, -30.0, 1.5, 0.0, 3.0][:heads])
    backend = TorchAttentionBackend(native=native)
    worst = run_schedule(backend, 8, heads, kv_heads, window, cache_dtype, paged, d=d, sinks=sinks)
    assert worst < (2e-2 if cache_dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("native", [None, False])
def test_attention_sinks_change_the_result(native, paged):
    """The sinks really apply: large sinks take most of the weight (the output shrinks), tiny ones none."""
    torch.manual_seed(0)
    q, k, v = torch.randn(20, 4, 16), torch.randn(20, 2, 16), torch.randn(20, 2, 16)
    outs = {}
    for name, sinks in (("none", None), ("big", torch.full((4,), 5.0)), ("tiny", torch.full((4,), -80.0))):
        batches = paged(num_blocks=8, block_size=8)
        cache = LayerKVCache(torch.zeros(2, 8, 8, 2, 16))
        backend = TorchAttentionBackend(native=native)
        outs[name] = backend.forward(q, k, v, cache, batches.step([(0, 0, 20)]), 0.25, sinks=sinks)
    assert outs["big"].abs().mean() < 0.5 * outs["none"].abs().mean()
    assert (outs["tiny"] - outs["none"]).abs().max() < 1e-5


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scale", [1.0, 0.05])
def test_fp8_cache(cache_dtype, scale, paged):
    """FP8 caches quantize on write (value / scale) and dequantize on read; the result equals attention
    over the rounded K/V, and stays near full precision."""
    assert run_schedule(TorchAttentionBackend(), 16, 8, 2, None, cache_dtype, paged, scale=scale) < 1e-4


def test_fp8_cache_stores_scaled_values(paged):
    batches = paged(num_blocks=4, block_size=8)
    cache = LayerKVCache(torch.zeros(2, 4, 8, 1, 4, dtype=torch.float8_e4m3fn), k_scale=0.5, v_scale=2.0)
    k = torch.full((3, 1, 4), 1.5)
    v = torch.full((3, 1, 4), 8.0)
    meta = batches.step([(0, 0, 3)])
    TorchAttentionBackend().forward(torch.randn(3, 1, 4), k, v, cache, meta, 0.5)
    slot = int(meta.slot_mapping[0])
    flat = cache.kv.view(2, -1, 1, 4).float()
    assert flat[0, slot].eq(3.0).all() and flat[1, slot].eq(4.0).all()


def test_writes_every_new_token_to_its_slot(paged):
    batches = paged(num_blocks=16, block_size=8)
    cache = LayerKVCache(torch.zeros(2, 16, 8, 2, 4))
    meta = batches.step([(0, 0, 11), (1, 0, 1)])
    k, v = torch.randn(12, 2, 4), torch.randn(12, 2, 4)
    TorchAttentionBackend().forward(torch.randn(12, 4, 4), k, v, cache, meta, 0.5)
    flat = cache.kv.view(2, 16 * 8, 2, 4)
    assert torch.equal(flat[0, meta.slot_mapping], k) and torch.equal(flat[1, meta.slot_mapping], v)
    untouched = torch.ones(16 * 8, dtype=torch.bool)
    untouched[meta.slot_mapping] = False
    assert flat[:, untouched].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_writes_follow_a_replaced_cache_tensor(dtype):
    """write_kv keeps the cache's K and V planes between steps: a cache whose tensor is replaced gets its
    writes in the new tensor, none in the old; float32 K/V into a bfloat16 cache are rounded as .to rounds."""
    cache = LayerKVCache(torch.zeros(2, 4, 8, 2, 4, dtype=dtype))
    slots = torch.tensor([3, 17])
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    TorchAttentionBackend.write_kv(k, v, cache, slots)
    old = cache.kv
    assert torch.equal(old.view(2, 32, 2, 4)[0, slots], k.to(dtype))
    cache.kv = torch.zeros_like(old)
    TorchAttentionBackend.write_kv(v, k, cache, slots)
    assert torch.equal(cache.kv.view(2, 32, 2, 4)[0, slots], v.to(dtype))
    assert torch.equal(cache.kv.view(2, 32, 2, 4)[1, slots], k.to(dtype))
    assert torch.equal(old.view(2, 32, 2, 4)[1, slots], v.to(dtype))  # the old tensor kept its first write


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype, paged, cpu_variant):
    """A prefill next to a decode in one step (a bfloat16 cache: the decode kernel widens the queries while
    the prefill runs elsewhere), on every kernel variant."""
    torch.manual_seed(0)
    batches = paged(num_blocks=16, block_size=16)
    q, k, v = torch.randn(21, 4, 16), torch.randn(21, 2, 16), torch.randn(21, 2, 16)
    cache = LayerKVCache(torch.zeros(2, 16, 16, 2, 16, dtype=dtype))
    backend = TorchAttentionBackend()
    out = backend.forward(
        q.to(dtype), k.to(dtype), v.to(dtype), cache, batches.step([(0, 0, 20), (1, 0, 1)]), 0.25
    )
    assert out.dtype == dtype
    ref = torch.cat(
        [
            dense_reference(q[:20], k[:20], v[:20], 0, 20, None),
            dense_reference(q[20:], k[20:], v[20:], 0, 1, None),
        ]
    )
    assert (out.float() - ref).abs().max() < 5e-2


def test_get_attention_backend():
    assert get_attention_backend("torch", torch.device("cpu")).name == "torch"
    assert get_attention_backend("auto", "cpu").name == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("flash", "cpu")


def run_native_and_reference(
    batches, steps, caches, backends, heads, kv_heads, d, window, softcap=None
) -> None:
    """Each step through the native and the reference backend (random q, k, v): the two agree, and every
    new token's output matches the dense per-token reference over its sequence's history."""
    hist: dict[int, tuple] = {}
    for step in steps:
        meta = batches.step(step)
        q = torch.randn(meta.num_tokens, heads, d)
        k, v = torch.randn(meta.num_tokens, kv_heads, d), torch.randn(meta.num_tokens, kv_heads, d)
        outs = {
            n: backends[n].forward(q, k, v, caches[n], meta, d**-0.5, window, logit_softcap=softcap)
            for n in backends
        }
        assert (outs["native"] - outs["ref"]).abs().max() < 1e-5
        start = 0
        for sid, ctx, ql in step:
            empty = (torch.empty(0, heads, d), torch.empty(0, kv_heads, d), torch.empty(0, kv_heads, d))
            old = hist.get(sid, empty)
            hist[sid] = tuple(
                torch.cat([o, x[start : start + ql]]) for o, x in zip(old, (q, k, v), strict=True)
            )
            ref = dense_reference(*hist[sid], ctx, ql, window, softcap)
            assert (outs["native"][start : start + ql] - ref).abs().max() < 1e-5
            start += ql


@pytest.mark.parametrize(
    "heads,kv_heads,d,block_size,window",
    [
        (4, 1, 256, 16, None),  # Gemma 3 270M's attention (head_dim 256, 4 query heads on 1 KV head)
        (4, 1, 256, 16, 9),
        (16, 8, 256, 16, 20),  # Gemma 2 9B's group of 2, windowed
        (8, 2, 64, 32, None),
        (6, 3, 24, 16, 5),  # head size not a multiple of 16: portable decode, torch prefill
    ],
)
def test_native_kernels_soft_cap(heads, kv_heads, d, block_size, window, paged, cpu_variant):
    """Gemma 2's soft-capped scores through each variant's native decode and prefill kernels (where the
    variant has them) and the reference formulation: all agree with the dense reference with the cap (0.8,
    near the scores' spread, so it matters), and the native kernels are the ones that ran, given the cap."""
    from pagoda.engine.attention import cpu_decode, cpu_prefill

    torch.manual_seed(d + heads)
    batches = paged(num_blocks=96, block_size=block_size, seed=5)
    caches = {n: LayerKVCache(torch.zeros(2, 96, block_size, kv_heads, d)) for n in ("native", "ref")}
    backends = {"native": TorchAttentionBackend(native=True), "ref": TorchAttentionBackend(native=False)}
    assert cpu_decode.supports(torch.zeros(1, heads, d), caches["native"].kv)
    calls = {"decode": 0, "prefill": 0}
    real = cpu_decode.paged_decode, cpu_prefill.paged_prefill

    def count(kind, fn):
        def spy(*a, **k):
            assert k.get("logit_softcap", a[7] if len(a) > 7 else None) == 0.8
            calls[kind] += 1
            return fn(*a, **k)

        return spy

    steps = [
        [(0, 0, 29), (1, 0, 1), (2, 0, 5)],
        [(0, 29, 1), (1, 1, 17), (2, 5, 1)],
        [(0, 30, 1), (1, 18, 1), (2, 6, 2 * block_size + 3)],
    ]
    cpu_decode.paged_decode, cpu_prefill.paged_prefill = count("decode", real[0]), count("prefill", real[1])
    try:
        run_native_and_reference(batches, steps, caches, backends, heads, kv_heads, d, window, softcap=0.8)
    finally:
        cpu_decode.paged_decode, cpu_prefill.paged_prefill = real
    assert calls["decode"] == 3
    assert calls["prefill"] == (
        3 if cpu_prefill.supports(torch.zeros(1, heads, d), caches["native"].kv) else 0
    )


# ---- the native CPU decode kernel ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "heads,kv_heads,d,block_size,window",
    [
        (9, 3, 64, 16, None),  # the default model's shapes
        (4, 4, 16, 8, None),
        (8, 2, 128, 32, None),
        (14, 2, 64, 16, 7),  # group of 7, sliding window
        (6, 3, 24, 16, None),  # head size not a multiple of 16: the portable loop
        (2, 1, 40, 8, 3),
    ],
)
def test_native_decode_matches_the_gathered_reference(
    heads, kv_heads, d, block_size, window, paged, cpu_variant
):
    """Mixed steps (decodes between prefill chunks) through the native kernel and through the gathered
    reference formulation give the same outputs, and both match the dense per-token reference."""
    torch.manual_seed(0)
    batches = paged(num_blocks=128, block_size=block_size, seed=1)
    caches = {n: LayerKVCache(torch.zeros(2, 128, block_size, kv_heads, d)) for n in ("native", "ref")}
    backends = {"native": TorchAttentionBackend(native=True), "ref": TorchAttentionBackend(native=False)}
    steps = [
        [(0, 0, 37), (1, 0, 1), (2, 0, 5)],
        [(0, 37, 1), (1, 1, 1), (2, 5, 1)],
        [(0, 38, 1), (3, 0, 2 * block_size + 1), (1, 2, 1), (2, 6, 1)],
        [(3, 2 * block_size + 1, 1), (0, 39, 1), (1, 3, 1), (2, 7, 1)],
    ]
    run_native_and_reference(batches, steps, caches, backends, heads, kv_heads, d, window)


@pytest.mark.parametrize(
    "heads,kv_heads,d,block_size,window",
    [(9, 3, 64, 16, None), (8, 2, 128, 32, 21), (6, 3, 24, 16, None), (4, 1, 40, 8, 5)],
)
def test_native_decode_reads_bfloat16_caches_in_every_variant(
    heads, kv_heads, d, block_size, window, cpu_variant
):
    """Each variant's decode over a bfloat16 cache in scattered blocks (lengths that end mid-block and past
    a multiple of the vector width) equals the dense reference over the same bfloat16-rounded values."""
    from pagoda.engine.attention import cpu_decode

    torch.manual_seed(d + block_size)
    num_blocks, lens = 48, [1, 7, block_size + 3, 3 * block_size + 9]
    kv = torch.randn(2, num_blocks, block_size, kv_heads, d).to(torch.bfloat16)
    order = torch.randperm(num_blocks).tolist()
    per_seq = max(-(-n // block_size) for n in lens)
    tables = torch.tensor(
        [order[i * per_seq : (i + 1) * per_seq] for i in range(len(lens))], dtype=torch.int32
    )
    q = torch.randn(len(lens), heads, d)
    out = torch.full_like(q, float("nan"))
    assert cpu_decode.supports(q, kv)
    cpu_decode.paged_decode(q, kv, tables, torch.tensor(lens, dtype=torch.int32), out, d**-0.5, window)
    for i, n in enumerate(lens):
        rows = [tables[i, t // block_size].item() for t in range(n)]
        k = kv[0, rows, [t % block_size for t in range(n)]].float()
        v = kv[1, rows, [t % block_size for t in range(n)]].float()
        ref = dense_reference(q[i : i + 1].expand(n, -1, -1), k, v, n - 1, 1, window)
        assert (out[i] - ref[0]).abs().max() < 1e-5, (i, n)


# ---- the native CPU prefill kernel -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "heads,kv_heads,d,block_size,window",
    [
        (9, 3, 64, 16, None),  # the default model's shapes
        (4, 4, 16, 8, None),  # no GQA, blocks smaller than a 16-key chunk
        (8, 2, 128, 32, None),
        (14, 2, 64, 16, 7),  # group of 7 (tiles not a multiple of the group), sliding window
        (12, 1, 32, 64, 20),  # a group of 12 fills a tile with one position
        (6, 3, 16, 16, 1),  # a window of one token
    ],
)
def test_native_prefill_matches_the_dense_reference(
    heads, kv_heads, d, block_size, window, paged, prefill_variant
):
    """Prefill chunks with and without a cached prefix, next to decodes, through the native kernel: every
    row matches the dense per-token reference, and the kernel really ran (its output differs from a run
    with the kernel switched off only by rounding, and rows it does not own are left as written)."""
    from pagoda.engine.attention import cpu_prefill

    torch.manual_seed(0)
    batches = paged(num_blocks=160, block_size=block_size, seed=2)
    caches = {n: LayerKVCache(torch.zeros(2, 160, block_size, kv_heads, d)) for n in ("native", "ref")}
    backends = {"native": TorchAttentionBackend(native=True), "ref": TorchAttentionBackend(native=False)}
    q0 = torch.randn(1, heads, d)
    assert cpu_prefill.supports(q0, caches["native"].kv)
    steps = [
        [(0, 0, 37), (1, 0, 1), (2, 0, 5), (4, 0, 2)],
        [(0, 37, 1), (1, 1, 19), (2, 5, 1), (3, 0, 70), (4, 2, 33)],  # chunks continuing cached prefixes
        [(3, 70, 2 * block_size + 1), (0, 38, 1), (1, 20, 1), (2, 6, 40)],
    ]
    calls = []
    real = cpu_prefill.paged_prefill

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    cpu_prefill.paged_prefill = spy
    try:
        run_native_and_reference(batches, steps, caches, backends, heads, kv_heads, d, window)
    finally:
        cpu_prefill.paged_prefill = real
    assert len(calls) == len(steps)


def test_native_prefill_leaves_rows_it_does_not_own(paged, prefill_variant):
    """Only the prefill rows are written: decode rows of the output keep what was there."""
    from pagoda.engine.attention import cpu_prefill
    from pagoda.engine.attention.torch_backend import _plan

    heads, kv_heads, d, bs = 9, 3, 64, 16
    batches = paged(num_blocks=32, block_size=bs, seed=3)
    cache = LayerKVCache(torch.randn(2, 32, bs, kv_heads, d))
    meta = batches.step([(0, 0, 20), (1, 0, 1), (2, 0, 3)])
    plan = _plan(meta, bs)
    q = torch.randn(meta.num_tokens, heads, d)
    out = torch.full_like(q, float("nan"))
    cpu_prefill.paged_prefill(q, cache.kv, plan.block_tables, plan.prefill_chunks, out, d**-0.5)
    assert torch.isnan(out[20]).all()  # the decode row
    assert not torch.isnan(out[:20]).any() and not torch.isnan(out[21:]).any()


def test_native_prefill_refuses_what_it_cannot_run():
    from pagoda.engine.attention import cpu_prefill

    kv = torch.zeros(2, 4, 16, 2, 64)
    assert not cpu_prefill.supports(torch.zeros(3, 4, 64, dtype=torch.float64), kv)  # dtype
    assert not cpu_prefill.supports(
        torch.zeros(3, 4, 64), kv.to(torch.int8), torch.zeros(2, 4, 16, 2)
    )  # int8
    assert not cpu_prefill.supports(torch.zeros(3, 4, 24), torch.zeros(2, 4, 16, 2, 24))  # head size
    assert not cpu_prefill.supports(torch.zeros(3, 26, 64), kv)  # 13 query heads per KV head


@pytest.mark.parametrize("heads,kv_heads,d,block_size,window", [(9, 3, 64, 16, None), (8, 2, 32, 8, 9)])
def test_native_kernels_read_bfloat16_caches(heads, kv_heads, d, block_size, window, paged, prefill_variant):
    """A bfloat16 model's cache is read in place by both native kernels (its queries widened to float32):
    the result equals the dense reference over the same bfloat16-rounded values to float32 rounding (far
    tighter than a bfloat16 computation would be), and it is the kernels that ran."""
    from pagoda.engine.attention import cpu_decode, cpu_prefill

    torch.manual_seed(1)
    bf = torch.bfloat16
    batches = paged(num_blocks=64, block_size=block_size, seed=4)
    cache = LayerKVCache(torch.zeros(2, 64, block_size, kv_heads, d, dtype=bf))
    assert cpu_decode.supports(torch.zeros(1, heads, d), cache.kv)
    assert cpu_prefill.supports(torch.zeros(1, heads, d), cache.kv)
    backend = TorchAttentionBackend(native=True)
    calls = {"decode": 0, "prefill": 0}
    real = cpu_decode.paged_decode, cpu_prefill.paged_prefill

    def count(kind, fn):
        def spy(*a, **k):
            calls[kind] += 1
            return fn(*a, **k)

        return spy

    cpu_decode.paged_decode, cpu_prefill.paged_prefill = count("decode", real[0]), count("prefill", real[1])
    hist: dict[int, tuple] = {}
    try:
        for step in ([(0, 0, 40), (1, 0, 3)], [(0, 40, 1), (1, 3, 21), (2, 0, 1)], [(0, 41, 1), (1, 24, 1)]):
            meta = batches.step(step)
            q, k, v = (torch.randn(meta.num_tokens, n, d).to(bf) for n in (heads, kv_heads, kv_heads))
            out = backend.forward(q, k, v, cache, meta, d**-0.5, window)
            assert out.dtype == bf
            start = 0
            for sid, ctx, ql in step:
                empty = (torch.empty(0, heads, d), torch.empty(0, kv_heads, d), torch.empty(0, kv_heads, d))
                old = hist.get(sid, empty)
                hist[sid] = tuple(
                    torch.cat([o, x[start : start + ql].float()]) for o, x in zip(old, (q, k, v), strict=True)
                )
                ref = dense_reference(*hist[sid], ctx, ql, window)
                # only the final narrowing to bfloat16 rounds: within half a bfloat16 ulp of the result
                err = (out[start : start + ql].float() - ref).abs()
                assert (err <= ref.abs() * 2**-8 + 1e-6).all()
                start += ql
    finally:
        cpu_decode.paged_decode, cpu_prefill.paged_prefill = real
    assert calls == {"decode": 2, "prefill": 2}
