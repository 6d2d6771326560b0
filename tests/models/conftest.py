"""Shared helpers: hand-built paged batches (block tables, slot mappings, caches) for the model tests."""

from __future__ import annotations

import random

import pytest
import torch
from pagoda.engine.attention.base import AttentionMetadata, LayerKVCache
from pagoda_testkit.native import (  # noqa: F401 (fixtures: each CPU kernel variant, each with prefill)
    cpu_variant,
    prefill_variant,
)

torch.set_num_threads(2)


class PagedBatches:
    """Hands out physical blocks to sequences and builds the step metadata a model runner would."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0):
        self.block_size = block_size
        self.free = list(range(1, num_blocks))  # block 0 stays unused, like the runner's padding block
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}

    def step(self, seqs: list[tuple[int, int, int]], device="cpu") -> AttentionMetadata:
        """seqs: (seq_id, context_len, query_len) in batch order."""
        bs = self.block_size
        slots, qlens, slens, ctxs = [], [], [], []
        for sid, ctx, ql in seqs:
            table = self.tables.setdefault(sid, [])
            need = -(-(ctx + ql) // bs)
            while len(table) < need:
                table.append(self.free.pop())
            for pos in range(ctx, ctx + ql):
                slots.append(table[pos // bs] * bs + pos % bs)
            qlens.append(ql)
            slens.append(ctx + ql)
            ctxs.append(ctx)
        max_blocks = max(len(self.tables[s[0]]) for s in seqs)
        bt = torch.zeros(len(seqs), max_blocks + 2, dtype=torch.int32)  # extra padding columns on purpose
        for i, (sid, _, _) in enumerate(seqs):
            bt[i, : len(self.tables[sid])] = torch.tensor(self.tables[sid], dtype=torch.int32)
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        return AttentionMetadata(
            num_seqs=len(seqs),
            num_tokens=qsl[-1],
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(slens, dtype=torch.int32, device=device),
            context_lens=torch.tensor(ctxs, dtype=torch.int32, device=device),
            block_tables=bt.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(qlens),
            max_seq_len=max(slens),
            query_lens_list=qlens,
            seq_lens_list=slens,
            is_decode_only=all(q == 1 for q in qlens),
        )


@pytest.fixture
def paged():
    return PagedBatches


def make_caches(num_layers, num_blocks, block_size, kv_heads, head_dim, dtype=torch.float32, scale=1.0):
    return [
        LayerKVCache(torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype), scale, scale)
        for _ in range(num_layers)
    ]


@pytest.fixture
def caches():
    return make_caches
