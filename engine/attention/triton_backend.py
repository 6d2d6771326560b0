"""Paged attention with the Triton kernels of `pagoda.kernels`: the GPU serving path.

Per layer: one `reshape_and_cache` launch, then at most two attention launches over the flat batch, one
for the single-token decodes (paged decode kernel, split-KV when the batch is small) and one for every
prefill chunk (paged prefill kernel). Each writes its own rows of one output tensor. Which sequences go to
which kernel is planned once per step from the host-side lists of the metadata and reused by every layer.

On the CPU the kernels run only under Triton's interpreter (`TRITON_INTERPRET=1` set before triton is
imported): slow, meant for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagoda.engine.attention.base import AttentionMetadata, LayerKVCache


@dataclass
class _Plan:
    decode_ids: torch.Tensor | None  # [n] int32 sequences with one new token; None = no decodes
    decode_max_seq_len: int
    prefill_ids: torch.Tensor | None  # [n] int32 sequences with several new tokens; None = none
    prefill_max_query_len: int


def _plan(meta: AttentionMetadata) -> _Plan:
    device = meta.block_tables.device
    decodes = [i for i, n in enumerate(meta.query_lens_list) if n == 1]
    prefills = [i for i, n in enumerate(meta.query_lens_list) if n > 1]

    def ids(rows: list[int]) -> torch.Tensor | None:
        if not rows:
            return None
        if len(rows) == meta.num_seqs:
            return torch.arange(meta.num_seqs, dtype=torch.int32, device=device)
        if device.type == "cuda":  # pinned and asynchronous: a pageable copy waits for the queued kernels
            return torch.tensor(rows, dtype=torch.int32, pin_memory=True).to(device, non_blocking=True)
        return torch.tensor(rows, dtype=torch.int32, device=device)

    return _Plan(
        decode_ids=ids(decodes),
        decode_max_seq_len=max((meta.seq_lens_list[i] for i in decodes), default=0),
        prefill_ids=ids(prefills),
        prefill_max_query_len=max((meta.query_lens_list[i] for i in prefills), default=0),
    )


class TritonAttentionBackend:
    name = "triton"

    def __init__(self) -> None:
        # Imported here, not at module import: Triton decides interpreter vs compiler when the kernels are
        # defined, so the kernel modules must load after the caller has chosen (see tests/kernels/conftest).
        from pagoda.kernels.cache import link_seed_cache
        from pagoda.kernels.cache_write import reshape_and_cache
        from pagoda.kernels.paged_decode import paged_decode_attention
        from pagoda.kernels.paged_prefill import paged_prefill_attention
        from pagoda.kernels.runtime import interpreting

        if not interpreting():
            link_seed_cache()  # the kernels the image compiled ahead (pagoda kernels warm)

        self._write = reshape_and_cache
        self._decode = paged_decode_attention
        self._prefill = paged_prefill_attention
        self._plans: list[tuple[AttentionMetadata, _Plan]] = []

    def _get_plan(self, meta: AttentionMetadata) -> _Plan:
        # The runner builds a fresh AttentionMetadata every step; every layer of the step shares it, or its
        # window view (sliding layers of a cache with a window group: AttentionMetadata.for_layer).
        for seen, plan in self._plans:
            if seen is meta:
                return plan
        plan = _plan(meta)
        self._plans = [(meta, plan), *self._plans[:1]]
        return plan

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kv = cache.kv
        self._write(k, v, kv, meta.slot_mapping, cache.k_scale, cache.v_scale, cache.scales)
        plan = self._get_plan(meta)
        out = torch.empty_like(q)
        common = dict(
            out=out,
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
            kv_scales=cache.scales,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            sinks=None if sinks is None else sinks.float().contiguous(),
        )
        if plan.decode_ids is not None:
            self._decode(
                q,
                kv,
                meta.block_tables,
                meta.seq_lens,
                scale,
                query_start_loc=meta.query_start_loc,
                seq_ids=plan.decode_ids,
                max_seq_len=plan.decode_max_seq_len,
                **common,
            )
        if plan.prefill_ids is not None:
            self._prefill(
                q,
                kv,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                scale,
                max_query_len=plan.prefill_max_query_len,
                seq_ids=plan.prefill_ids,
                **common,
            )
        return out
