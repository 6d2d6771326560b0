"""Pure-torch twins of the Triton kernels: they define what each kernel must compute.

Written for clarity, not speed: one sequence at a time, math in float32. The Triton kernels are tested
against these, and these are tested against `naive_dense_attention`, a per-query loop over unpaged K/V.

Conventions shared with the kernels (see `pagoda.engine.attention.base`):
- cache `[2, num_blocks, block_size, num_kv_heads, head_dim]`, 0 = K, 1 = V;
- token `i` of a sequence lives at `block_tables[s, i // block_size] * block_size + i % block_size`;
- FP8 caches store `x / scale`; reading multiplies by the scale again;
- INT8 caches store, per token and KV head, `round(x / s)` with `s = amax(|x|) / 127` over the head's
  values; `s` (float32) lies beside the blocks in a scales tensor `[2, num_blocks, block_size,
  num_kv_heads]` indexed like the cache, so each block carries its own scales; reading multiplies by `s`;
- attention reads every key from the cache, the new tokens included (they are written first), so an FP8
  cache also rounds the new tokens' keys and values;
- a sliding window of `w` lets the query at position `p` see keys at positions `p - w + 1 .. p`;
- a logit soft-cap `c` (Gemma 2) turns each score into `c * tanh(scale * q.k / c)` before the mask and
  the softmax; None (or 0) = off.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INT8_MAX = 127.0
# Adding and removing 1.5 * 2**23 rounds a float32 |x| < 2**22 to the nearest integer, ties to even, with
# plain IEEE adds: the Triton kernels use the same trick, so both round every value the same way.
_ROUND_MAGIC = 12582912.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def is_int8(dtype: torch.dtype) -> bool:
    return dtype == torch.int8


def int8_scales_shape(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """The scales tensor of an INT8 cache `[2, num_blocks, block_size, num_kv_heads, head_dim]`."""
    return tuple(kv_cache.shape[:4])


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row INT8: `x` [..., head_dim] -> (int8 values, float32 scale [...]).

    scale = amax(|x|) / 127 (times the float32 constant 1/127, not a division, so every backend gets the
    same bits); a row of zeros gets scale 0 and stores zeros.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1) * (1.0 / INT8_MAX)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = xf * inv[..., None]
    q = ((y + _ROUND_MAGIC) - _ROUND_MAGIC).clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def quantize_to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """`x / scale` saturated to the FP8 range (torch's plain cast turns overflow into NaN), or a plain cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


def reshape_and_cache_ref(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64; negative = padding token, not written
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_scales: torch.Tensor | None = None,  # INT8 caches: [2, num_blocks, block_size, num_kv_heads] float32
) -> None:
    """Write each new token's K and V into its slot (in place; INT8 caches also write the slot's scales)."""
    block_size = kv_cache.shape[2]
    slots = slot_mapping.long()
    keep = slots >= 0
    slots, k, v = slots[keep], k[keep], v[keep]
    blocks, offsets = slots // block_size, slots % block_size
    if is_int8(kv_cache.dtype):
        if kv_scales is None:
            raise ValueError("an INT8 KV cache needs its scales tensor (kv_scales)")
        for i, x in enumerate((k, v)):
            q, s = quantize_int8(x)
            kv_cache[i, blocks, offsets] = q
            kv_scales[i, blocks, offsets] = s
        return
    kv_cache[0, blocks, offsets] = quantize_to_cache_dtype(k, kv_cache.dtype, k_scale)
    kv_cache[1, blocks, offsets] = quantize_to_cache_dtype(v, kv_cache.dtype, v_scale)


def gather_sequence_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks]
    seq_len: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values `[seq_len, num_kv_heads, head_dim]` in float32, dequantized."""
    block_size = kv_cache.shape[2]
    pos = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_table.long()[pos // block_size]
    offsets = pos % block_size
    if is_int8(kv_cache.dtype):
        if kv_scales is None:
            raise ValueError("an INT8 KV cache needs its scales tensor (kv_scales)")
        k = kv_cache[0, blocks, offsets].float() * kv_scales[0, blocks, offsets][..., None]
        v = kv_cache[1, blocks, offsets].float() * kv_scales[1, blocks, offsets][..., None]
        return k, v
    k = kv_cache[0, blocks, offsets].float() * k_scale
    v = kv_cache[1, blocks, offsets].float() * v_scale
    return k, v


def _attend(
    q: torch.Tensor,  # [n, H, D] float32, queries at positions q_pos
    k: torch.Tensor,  # [L, KVH, D] float32
    v: torch.Tensor,
    q_pos: torch.Tensor,  # [n]
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H]: a learned logit per head, one more softmax column (gpt-oss)
) -> torch.Tensor:
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    if logit_softcap:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    k_pos = torch.arange(k.shape[0], device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is None:
        return torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), v)
    column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
    probs = torch.cat((scores, column), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("hnl,lhd->nhd", probs, v)


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [S + 1]
    seq_lens: torch.Tensor,  # [S], cached + new tokens
    block_tables: torch.Tensor,  # [S, max_blocks]
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    kv_scales: torch.Tensor | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every new token against its sequence's cache (prefix and new tokens)."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo:
            continue
        k, v = gather_sequence_kv(kv_cache, block_tables[s], seq_len, k_scale, v_scale, kv_scales)
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
        att = _attend(q[lo:hi].float(), k, v, q_pos, scale, sliding_window, logit_softcap, sinks)
        out[lo:hi] = att.to(q.dtype)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,  # [S, num_heads, head_dim], one new token per sequence
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    kv_scales: torch.Tensor | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode case of the prefill twin: the query is the last token of its sequence."""
    query_start_loc = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_prefill_attention_ref(
        q, kv_cache, query_start_loc, seq_lens, block_tables, scale, k_scale, v_scale, sliding_window,
        kv_scales, logit_softcap, sinks,
    )  # fmt: skip


def naive_dense_attention(
    q: torch.Tensor,  # [n, H, D], the last n tokens of a sequence
    k: torch.Tensor,  # [L, KVH, D], the whole sequence, unpaged
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Textbook attention, one query and one head at a time: the yardstick for the twins."""
    n, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(n):
        p = seq_len - n + i
        lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
        for h in range(num_heads):
            keys = k[lo : p + 1, h // group].double()
            vals = v[lo : p + 1, h // group].double()
            scores = keys @ q[i, h].double() * scale
            if logit_softcap:
                scores = torch.tanh(scores / logit_softcap) * logit_softcap
            weights = torch.softmax(scores, dim=0)
            out[i, h] = weights @ vals
    return out


# ---- LoRA ----------------------------------------------------------------------------------------------
# A step's tokens with an adapter lie in segments: rows start .. start + len of the batch use the adapter in
# slot `slot` (one segment per adapter when the runner groups them). The adapters' matrices are stacked by
# slot: A as [slots, in_features, width] (already transposed: x @ A[slot]), B as [slots, rank, out_features]
# (the PEFT scale folded in). Rows outside every segment (the base model's) are left alone.


def lora_shrink_ref(
    x: torch.Tensor,  # [T, in_features]
    a: torch.Tensor,  # [slots, in_features, width]
    seg_starts: torch.Tensor,  # [G] int32
    seg_lens: torch.Tensor,  # [G] int32
    seg_slots: torch.Tensor,  # [G] int32
) -> torch.Tensor:
    """h = x @ A[slot] per segment, in float32 [T, width]; zero in rows of no segment."""
    h = torch.zeros((x.shape[0], a.shape[2]), dtype=torch.float32, device=x.device)
    for start, n, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist(), strict=True):
        h[start : start + n] = x[start : start + n].float() @ a[slot].float()
    return h


def lora_expand_ref(
    h: torch.Tensor,  # [T, width] float32, this slice's rank columns at h_offset
    b: torch.Tensor,  # [slots, rank, out_features]
    y: torch.Tensor,  # [T, out_features], updated in place (may be a column slice of a wider output)
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    h_offset: int = 0,
) -> None:
    """y += h[:, h_offset : h_offset + rank] @ B[slot] per segment, summed in float32, rounded once."""
    rank = b.shape[1]
    for start, n, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist(), strict=True):
        rows = slice(start, start + n)
        delta = h[rows, h_offset : h_offset + rank].float() @ b[slot].float()
        y[rows] = (y[rows].float() + delta).to(y.dtype)


# ---- decoder layer element-wise ops --------------------------------------------------------------------
# Activations in float32, float16 or bfloat16, rows [T, width]; the math in float32, rounded to the
# activation dtype where the model's torch expressions round (the residual sum, the normalised row before
# the weight) and once at the end.


def add_rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H], or None for a plain RMSNorm
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(x + residual) * weight, x + residual), or (RMSNorm(x) * weight, None); nothing in place."""
    dtype = x.dtype
    new_residual = None
    if residual is not None:
        new_residual = (residual.float() + x.float()).to(dtype)
        x = new_residual
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (h.float() * weight.float()).to(dtype), new_residual


def rotary_ref(
    x: torch.Tensor,  # [T, >= nheads * head_dim], heads side by side in a row (q then k of a fused qkv)
    nheads: int,
    head_dim: int,
    cos: torch.Tensor,  # [T, head_dim], each token's row of the table
    sin: torch.Tensor,
) -> torch.Tensor:
    """A copy of x whose first ``nheads`` heads are rotated (rotate-half: each head's two halves
    (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin), with the cos/sin of each half's columns)."""
    out = x.clone()
    t = x.shape[0]
    heads = x[:, : nheads * head_dim].float().view(t, nheads, head_dim)
    half = head_dim // 2
    rotated = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
    rot = heads * cos.float()[:, None, :] + rotated * sin.float()[:, None, :]
    out[:, : nheads * head_dim] = rot.reshape(t, nheads * head_dim).to(x.dtype)
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [T, 2I] row of gate then up halves -> [T, I]."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(gate_up.dtype)
