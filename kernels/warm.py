"""Every kernel variant the engine launches for one attention shape, compiled ahead (`pagoda kernels warm`).

The launchers are called as the Triton attention backend calls them, with meta tensors: one cache write,
one prefill, one unsplit and one split decode (whose merge kernel follows). Their variants depend on the
constexprs, dtypes and launch configuration only (see pagoda.kernels.runtime), so these four launches cover
every step of a deployment with this shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagoda.kernels.aot import Compilation, compiling_for
from pagoda.kernels.launch_config import DeviceLimits

META = torch.device("meta")


@dataclass(frozen=True)
class AttentionShape:
    """What one rank's attention layers look like to the kernels."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads this rank keeps
    head_dim: int
    block_size: int
    dtype: torch.dtype  # activations
    kv_dtype: torch.dtype  # the cache
    sliding_window: int | None = None


def launch_all(shape: AttentionShape) -> None:
    """One launch of each kernel with this shape (inside `compiling_for`, one compilation of each)."""
    from pagoda.kernels.cache_write import reshape_and_cache
    from pagoda.kernels.paged_decode import paged_decode_attention
    from pagoda.kernels.paged_prefill import paged_prefill_attention

    h, kvh, d, bs = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.block_size
    tokens, num_blocks = 4, 8
    # q and k as the model leaves them (rotated copies), v a view into the fused qkv projection
    qkv = torch.empty((tokens, (h + 2 * kvh) * d), dtype=shape.dtype, device=META)
    q = torch.empty((tokens, h, d), dtype=shape.dtype, device=META)
    k = torch.empty((tokens, kvh, d), dtype=shape.dtype, device=META)
    v = qkv[:, (h + kvh) * d :].view(tokens, kvh, d)
    kv_cache = torch.empty((2, num_blocks, bs, kvh, d), dtype=shape.kv_dtype, device=META)
    int8 = shape.kv_dtype == torch.int8
    scales = torch.empty(kv_cache.shape[:4], dtype=torch.float32, device=META) if int8 else None
    slots = torch.empty(tokens, dtype=torch.int64, device=META)
    tables = torch.empty((tokens, 2), dtype=torch.int32, device=META)
    seq_lens = torch.empty(tokens, dtype=torch.int32, device=META)
    qsl = torch.empty(tokens + 1, dtype=torch.int32, device=META)
    ids = torch.empty(tokens, dtype=torch.int32, device=META)
    common = dict(kv_scales=scales, sliding_window=shape.sliding_window, seq_ids=ids)
    reshape_and_cache(k, v, kv_cache, slots, kv_scales=scales)
    paged_prefill_attention(q, kv_cache, qsl, seq_lens, tables, 0.1, max_query_len=tokens, **common)
    for splits in (1, 2):
        paged_decode_attention(
            q,
            kv_cache,
            tables,
            seq_lens,
            0.1,
            query_start_loc=qsl,
            max_seq_len=64,
            num_splits=splits,
            **common,
        )


def compile_shapes(limits: DeviceLimits, shapes: list[AttentionShape]) -> Compilation:
    """Compile every variant the shapes launch for a device with these limits (repeats compile once)."""
    with compiling_for(limits) as compilation:
        for shape in dict.fromkeys(shapes):
            launch_all(shape)
    return compilation
