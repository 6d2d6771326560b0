"""Builds a step's batch tensors from the scheduler's decision, runs the model and returns logits.

Owns the per-layer KV cache tensors (layout in engine/attention/base.py).
"""

from __future__ import annotations

import numpy as np
import torch
from pagoda.engine.attention.base import AttentionMetadata, LayerKVCache
from pagoda.engine.scheduler import ScheduledSeq

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return _FP8.get(kv_cache_dtype, model_dtype)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.kv_caches = [
            LayerKVCache(
                torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=kv_dtype, device=device)
            )
            for _ in range(num_layers)
        ]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (all layers, K and V)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for cache in self.kv_caches:
            cache.kv[:, dst] = cache.kv[:, src]

    def build_metadata(
        self, scheduled: list[ScheduledSeq], block_tables: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        tokens, positions, slots = [], [], []
        query_lens, seq_lens, context_lens = [], [], []
        sample_idx = []
        offset = 0
        for sched, table in zip(scheduled, block_tables, strict=True):
            seq = sched.seq
            start, n = seq.num_computed_tokens, sched.num_new_tokens
            pos = np.arange(start, start + n, dtype=np.int64)
            table_np = np.asarray(table, dtype=np.int64)
            tokens.append(np.asarray(seq.token_ids[start : start + n], dtype=np.int64))
            positions.append(pos)
            slots.append(table_np[pos // bs] * bs + pos % bs)
            query_lens.append(n)
            context_lens.append(start)
            seq_lens.append(start + n)
            offset += n
            if sched.samples:
                sample_idx.append(offset - 1)
        max_blocks = max((len(t) for t in block_tables), default=1)
        tables = np.zeros((len(block_tables), max(max_blocks, 1)), dtype=np.int32)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = t
        dev = self.device
        qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        meta = AttentionMetadata(
            num_seqs=len(scheduled),
            num_tokens=offset,
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            is_decode_only=all(q == 1 for q in query_lens),
        )
        input_ids = torch.from_numpy(np.concatenate(tokens)).to(dev)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(dev)
        return input_ids, pos_t, meta, sample_idx

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], block_tables: list[list[int]]) -> torch.Tensor:
        """Returns float32 logits for the last token of every sequence that samples this step."""
        input_ids, positions, meta, sample_idx = self.build_metadata(scheduled, block_tables)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not sample_idx:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(sample_idx, device=hidden.device)])
