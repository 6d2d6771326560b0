"""Paged attention in plain torch: the reference backend and the CPU serving path.

Per step (not per layer) the backend plans once: which sequences are single-token decodes and which are
prefill chunks. The plan is reused by every layer of the step.

- bfloat16 models on the CPU: attention computes in float32 over the cache's bfloat16 values (queries
  widened), on the native and the torch paths alike, so every kernel variant computes the same thing.
- Decodes: on the CPU with float32 or bfloat16 caches, one call of the native kernel of `cpu_decode` that
  reads K/V in place (no gather, no padding to the longest sequence); otherwise (other devices or dtypes, no
  kernels library, or ``native=False``) one gathered SDPA call with a padding mask, the reference formulation.
- INT8 caches: written through `quantize_int8` (per token and KV head); decodes read them in place with the
  native kernel's INT8 variant (values widened in registers, each token's K scale on its score and V scale
  on its weight), prefill chunks and the gathered fallback multiply the gathered values by their scales.
- Prefill chunks: the native kernel of `cpu_prefill` where the loaded variant has it (AVX2, AVX-512); otherwise
  one SDPA call each, over the sequence's cached prefix plus the chunk, on 4-D views (SDPA only takes its
  fused flash kernel on the CPU for 4-D inputs; 3-D ones fall to the math kernel, which materialises the
  scores: docs/benchmarks.md).

Sliding window `w`: a query at position p sees keys at positions p - w + 1 .. p (itself included), the
Mistral / Hugging Face convention.

Logit soft-cap `c` (Gemma 2): scores become `c * tanh(scale * q.k / c)` before the mask and the softmax.
The native kernels take `c`; SDPA has no such hook, so the torch paths then compute the scores explicitly
(`_attend`).

Sinks (gpt-oss): one learned logit per query head joins each row's softmax denominator as a column with no
value (it takes probability mass from the keys; it is not a StreamingLLM sink token, nothing is kept in the
cache for it). The native kernels fold it into their last normalisation; the torch paths add the column to
explicit scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pagoda.engine.attention import cpu_decode, cpu_prefill
from pagoda.engine.attention.base import AttentionMetadata, LayerKVCache
from pagoda.kernels.reference import quantize_int8

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class _Prefill:
    start: int  # first token in the flat batch
    end: int
    context_len: int
    seq_len: int
    blocks: torch.Tensor  # [num_blocks_of_seq] physical block ids


@dataclass
class _Plan:
    num_tokens: int
    decode_rows: torch.Tensor | None  # token indices of the decodes in the flat batch; None = all tokens
    decode_seq_idx: torch.Tensor | None  # [Sd] int64 sequence index of each decode; None = all sequences
    decode_seq_lens: torch.Tensor | None  # [Sd] int64
    decode_blocks: torch.Tensor | None  # [Sd, nb] int64
    decode_max_len: int
    prefills: list[_Prefill]
    prefill_chunks: cpu_prefill.PrefillChunks | None  # the prefills as the native kernel reads them
    masks: dict  # (kind, window) -> mask tensor, filled lazily per sliding window
    block_tables: torch.Tensor  # the step's block tables and sequence lengths, int32 and contiguous
    seq_lens: torch.Tensor


def _plan(meta: AttentionMetadata, block_size: int) -> _Plan:
    qlens, slens = meta.query_lens_list, meta.seq_lens_list
    decode_idx = [i for i, q in enumerate(qlens) if q == 1]
    starts = [0]
    for q in qlens:
        starts.append(starts[-1] + q)
    device = meta.block_tables.device
    decode_rows = decode_seq_idx = decode_seq_lens = decode_blocks = None
    decode_max_len = 0
    if decode_idx:
        decode_max_len = max(slens[i] for i in decode_idx)
        nb = -(-decode_max_len // block_size)
        all_decode = len(decode_idx) == len(qlens)
        if all_decode:
            decode_blocks = meta.block_tables[:, :nb].long()
            decode_seq_lens = meta.seq_lens.long()
        else:
            sel = decode_seq_idx = torch.tensor(decode_idx, device=device, dtype=torch.long)
            decode_blocks = meta.block_tables.index_select(0, sel)[:, :nb].long()
            decode_seq_lens = meta.seq_lens.index_select(0, sel).long()
            decode_rows = torch.tensor([starts[i] for i in decode_idx], device=device, dtype=torch.long)
    prefills = []
    prefill_idx = []
    for i, q in enumerate(qlens):
        if q == 1:
            continue
        nb = -(-slens[i] // block_size)
        prefills.append(
            _Prefill(starts[i], starts[i] + q, slens[i] - q, slens[i], meta.block_tables[i, :nb].long())
        )
        prefill_idx.append(i)
    chunks = None
    if prefills:
        chunks = cpu_prefill.PrefillChunks(
            prefill_idx, [p.start for p in prefills], [p.end - p.start for p in prefills],
            [p.context_len for p in prefills],
        )  # fmt: skip
    return _Plan(
        starts[-1],
        decode_rows,
        decode_seq_idx,
        decode_seq_lens,
        decode_blocks,
        decode_max_len,
        prefills,
        chunks,
        {},
        meta.block_tables.to(torch.int32).contiguous(),
        meta.seq_lens.to(torch.int32).contiguous(),
    )


def _fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _attend(
    q: torch.Tensor,  # [B, H, n, D]
    k: torch.Tensor,  # [B, Hkv, L, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # broadcastable to [B, H, n, L], True = visible; None = causal, n == L
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor
    | None = None,  # broadcastable to [B, H, n, 1] float32: gpt-oss's per-head sink logits
) -> torch.Tensor:
    """SDPA, or without it when a soft-cap or sinks are set: explicit float32 scores, capped, masked,
    softmaxed (a sink is one more column of the softmax, dropped before the product with V)."""
    gqa = q.shape[1] != k.shape[1]
    if not softcap and sinks is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n = q.shape[2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)
    column = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.cat((scores, column), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, native: bool | None = None) -> None:
        """native: use the native CPU decode kernel where it applies (None = when it builds on this machine;
        False = always the gathered reference formulation)."""
        self.native = native
        self._plans: list[tuple[AttentionMetadata, _Plan]] = []

    # ---- cache writes --------------------------------------------------------------------------------

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        """Store new K/V at their slots (quantizing for FP8 and INT8 caches)."""
        kv = cache.kv
        dtype = kv.dtype
        if dtype is torch.float32 or dtype is torch.bfloat16 or dtype is torch.float16:
            flat = cache.flat
            if flat is None or flat[0] is not kv:
                _, nblocks, bsize, hkv, d = kv.shape
                planes = kv.view(2, nblocks * bsize, hkv, d)
                flat = cache.flat = (kv, planes[0], planes[1])
            flat[1].index_copy_(0, slot_mapping, k if k.dtype is dtype else k.to(dtype))
            flat[2].index_copy_(0, slot_mapping, v if v.dtype is dtype else v.to(dtype))
            return
        _, nblocks, bsize, hkv, d = kv.shape
        if kv.dtype == torch.int8:
            flat = kv.view(2, nblocks * bsize, hkv, d)
            scales = cache.scales.view(2, nblocks * bsize, hkv)
            for i, x in enumerate((k, v)):
                qx, sx = quantize_int8(x)
                flat[i].index_copy_(0, slot_mapping, qx)
                scales[i].index_copy_(0, slot_mapping, sx)
        elif kv.dtype in FP8_DTYPES:
            limit = _fp8_max(kv.dtype)
            k = (k.float() / cache.k_scale).clamp_(-limit, limit).to(kv.dtype)
            v = (v.float() / cache.v_scale).clamp_(-limit, limit).to(kv.dtype)
            flat = kv.view(torch.uint8).view(2, nblocks * bsize, hkv, d)
            flat[0].index_copy_(0, slot_mapping, k.view(torch.uint8))
            flat[1].index_copy_(0, slot_mapping, v.view(torch.uint8))
        else:
            flat = kv.view(2, nblocks * bsize, hkv, d)
            flat[0].index_copy_(0, slot_mapping, k.to(kv.dtype))
            flat[1].index_copy_(0, slot_mapping, v.to(kv.dtype))

    @staticmethod
    def _gather(
        cache: LayerKVCache, blocks: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks ([...] block ids) as [..., n * block_size, Hkv, D] in `dtype`."""
        kv = cache.kv
        fp8 = kv.dtype in FP8_DTYPES
        src = kv.view(torch.uint8) if fp8 else kv
        flat_blocks = blocks.reshape(-1)
        shape = (*blocks.shape[:-1], blocks.shape[-1] * kv.shape[2], kv.shape[3], kv.shape[4])
        k = src[0].index_select(0, flat_blocks).view(shape)
        v = src[1].index_select(0, flat_blocks).view(shape)
        if kv.dtype == torch.int8:
            sc = cache.scales
            k_s = sc[0].index_select(0, flat_blocks).view(shape[:-1])
            v_s = sc[1].index_select(0, flat_blocks).view(shape[:-1])
            k = (k.float() * k_s[..., None]).to(dtype)
            v = (v.float() * v_s[..., None]).to(dtype)
        elif fp8:
            k = k.view(kv.dtype).to(dtype) * cache.k_scale
            v = v.view(kv.dtype).to(dtype) * cache.v_scale
        else:
            k, v = k.to(dtype), v.to(dtype)
        return k, v

    # ---- attention ----------------------------------------------------------------------------------

    def _gathered_decode(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        plan: _Plan,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode rows by the reference formulation: gather every decode's blocks (padded to the longest),
        one masked SDPA call. Returns [Sd, H, D]."""
        block_size = cache.kv.shape[2]
        num_heads, head_dim = q.shape[1], q.shape[2]
        key = ("decode", sliding_window)
        mask = plan.masks.get(key)
        if mask is None:
            length = plan.decode_blocks.shape[1] * block_size
            pos = torch.arange(length, device=q.device)
            lens = plan.decode_seq_lens[:, None]
            mask = pos[None, :] < lens
            if sliding_window is not None:
                mask &= pos[None, :] >= lens - sliding_window
            mask = mask[:, None, None, :]  # [Sd, 1, 1, L]
            plan.masks[key] = mask
        kd, vd = self._gather(cache, plan.decode_blocks, q.dtype)  # [Sd, L, Hkv, D]
        qd = q if plan.decode_rows is None else q.index_select(0, plan.decode_rows)
        sd, kv_heads = qd.shape[0], cache.kv.shape[3]
        # GQA without copying K/V: the query heads sharing a KV head become that head's "query rows".
        return _attend(
            qd.view(sd, kv_heads, num_heads // kv_heads, head_dim),
            kd.transpose(1, 2),
            vd.transpose(1, 2),
            mask,
            scale,
            softcap,
            None if sinks is None else sinks.view(1, kv_heads, num_heads // kv_heads, 1),
        ).reshape(sd, num_heads, head_dim)

    def _get_plan(self, meta: AttentionMetadata, block_size: int) -> _Plan:
        # One plan per step: the runner builds a fresh AttentionMetadata every step; the sliding layers of a
        # cache with a window group attend with its window view (AttentionMetadata.for_layer), the second slot.
        for seen, plan in self._plans:
            if seen is meta:
                return plan
        plan = _plan(meta, block_size)
        self._plans = [(meta, plan), *self._plans[:1]]
        return plan

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        block_size = cache.kv.shape[2]
        if sinks is not None:
            sinks = sinks.float().contiguous()
        softcap = logit_softcap or None
        self.write_kv(k, v, cache, meta.slot_mapping)
        plan = self._get_plan(meta, block_size)
        dtype = q.dtype
        native = self.native is not False
        if q.dtype is torch.bfloat16 and q.is_cpu:
            # A bfloat16 model's attention computes in float32 over the cache's bfloat16 values on every path:
            # the native kernels take float32 queries, and the torch paths beside them (a prefill where the
            # loaded variant has no prefill kernel, a decode it does not cover) then compute the same thing
            # and share the step's float32 output. T x H x D values, little next to the cache rows a step
            # reads; the output is narrowed back at the end.
            q = q.float()
        native_decode = (
            plan.decode_blocks is not None and native and cpu_decode.supports(q, cache.kv, cache.scales)
        )
        native_prefill = bool(plan.prefills) and native and cpu_prefill.supports(q, cache.kv, cache.scales)
        out = torch.empty_like(q) if plan.prefills or plan.decode_rows is not None else None

        if plan.decode_blocks is not None:
            if native_decode:
                out = torch.empty_like(q) if out is None else out
                cpu_decode.paged_decode(
                    q,
                    cache.kv,
                    plan.block_tables,
                    plan.seq_lens,
                    out,
                    scale,
                    sliding_window,
                    seq_idx=plan.decode_seq_idx,
                    rows=plan.decode_rows,
                    scales=cache.scales,
                    logit_softcap=softcap,
                    sinks=sinks,
                )
                if not plan.prefills:
                    # (.to costs a microsecond even where it has nothing to do)
                    return out if out.dtype is dtype else out.to(dtype)
            else:
                od = self._gathered_decode(q, cache, plan, scale, sliding_window, softcap, sinks)
                if out is None:
                    return od.to(dtype)
                out.index_copy_(0, plan.decode_rows, od)

        if native_prefill:
            cpu_prefill.paged_prefill(
                q,
                cache.kv,
                plan.block_tables,
                plan.prefill_chunks,
                out,
                scale,
                sliding_window,
                softcap,
                sinks,
            )
            return out.to(dtype)
        for i, p in enumerate(plan.prefills):
            if p.context_len == 0 and cache.kv.dtype == k.dtype:
                # Nothing cached before this chunk and the cache holds exactly what was written: skip the gather.
                kp, vp = (x[p.start : p.end].to(q.dtype).transpose(0, 1) for x in (k, v))
            else:
                kp, vp = self._gather(cache, p.blocks, q.dtype)  # [L_pad, Hkv, D]
                kp, vp = kp[: p.seq_len].transpose(0, 1), vp[: p.seq_len].transpose(0, 1)
            qp = q[p.start : p.end].transpose(0, 1)  # [H, ql, D]
            # 4-D inputs: with 3-D ones SDPA takes its unfused math kernel on the CPU (slower, see above).
            qp, kp, vp = qp.unsqueeze(0), kp.unsqueeze(0), vp.unsqueeze(0)
            mask = None  # causal
            if p.context_len != 0 or sliding_window is not None:
                key = ("prefill", i, sliding_window)
                mask = plan.masks.get(key)
                if mask is None:
                    qpos = torch.arange(p.context_len, p.seq_len, device=q.device)[:, None]
                    kpos = torch.arange(p.seq_len, device=q.device)[None, :]
                    mask = kpos <= qpos
                    if sliding_window is not None:
                        mask &= kpos > qpos - sliding_window
                    plan.masks[key] = mask
            op = _attend(qp, kp, vp, mask, scale, softcap, None if sinks is None else sinks.view(1, -1, 1, 1))
            out[p.start : p.end] = op[0].transpose(0, 1)
        return out.to(dtype)
