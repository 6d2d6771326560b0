"""The contract between the model runner, the models and the attention kernels.

A step's batch is flat: T new tokens from S sequences, prefill chunks and decodes mixed, sequences in
order, each sequence's new tokens contiguous. The KV cache of one layer is a tensor
`[2, num_blocks, block_size, num_kv_heads, head_dim]` (0 = K, 1 = V). Every backend first writes the new
K and V into their slots, then attends each new token to its sequence's cached prefix and to the new
tokens up to and including itself.

An INT8 cache (`--kv-cache-dtype int8`) also has a float32 scales tensor `[2, num_blocks, block_size,
num_kv_heads]` beside it, one scale per token and KV head, indexed by the same slots: a block's scales
move with the block (copies, offload saves and loads), so a cached or offloaded block is self-contained.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    num_seqs: int
    num_tokens: int
    query_start_loc: torch.Tensor  # [S + 1] int32, cumulative new-token counts (cu_seqlens)
    seq_lens: torch.Tensor  # [S] int32, context length after this step (cached + new)
    context_lens: torch.Tensor  # [S] int32, tokens already in the cache before this step
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset for every new token
    max_query_len: int
    max_seq_len: int
    # Python-side copies, so backends can plan without a device sync.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    # True when every sequence contributes exactly one new token (a pure decode step).
    is_decode_only: bool = False
    # The largest rotary position of the step (host side); None: below max_seq_len. Above it only after
    # attention-sink evictions, whose positions go on counting past the evicted tokens.
    max_position: int | None = None
    # A cache with a window group (engine/kv_cache/manager.py): the sliding layers' tables and slots, whose
    # blocks index those layers' smaller caches; entries out of the window are the null block 0 (never
    # written, read only under the window mask). None: every layer uses block_tables / slot_mapping.
    window_block_tables: torch.Tensor | None = None
    window_slot_mapping: torch.Tensor | None = None
    _window_view: AttentionMetadata | None = field(default=None, repr=False)

    def for_layer(self, sliding_window: int | None) -> AttentionMetadata:
        """The metadata a layer attends with: a sliding layer of a cache with a window group gets the same
        batch over the window tables (one view per step, so backends plan it once)."""
        if sliding_window is None or self.window_block_tables is None:
            return self
        if self._window_view is None:
            self._window_view = replace(
                self,
                block_tables=self.window_block_tables,
                slot_mapping=self.window_slot_mapping,
                window_block_tables=None,
                window_slot_mapping=None,
            )
        return self._window_view


@dataclass
class LayerKVCache:
    """One layer's cache tensor and, for FP8 caches, its float32 scales (1.0 otherwise); for INT8 caches the
    per-token, per-head scales tensor."""

    kv: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    k_scale: float = 1.0
    v_scale: float = 1.0
    scales: torch.Tensor | None = None  # INT8 only: [2, num_blocks, block_size, num_kv_heads] float32
    # (kv, its K plane, its V plane) as [num_blocks * block_size, num_kv_heads, head_dim] views, made on the first
    # write (TorchAttentionBackend.write_kv) rather than on every layer's every step; remade if kv is replaced
    flat: tuple | None = field(default=None, repr=False, compare=False)


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads] float32 (gpt-oss)
    ) -> torch.Tensor:  # [T, num_heads, head_dim], dtype of q
        """Write the new K/V, then attend. With `logit_softcap` c (Gemma 2) every score becomes
        `c * tanh(scale * q.k / c)` before the causal / window mask and the softmax; None or 0 = off. With
        `sinks` each query head's row of the softmax has one more logit, its sink, whose weight goes to no
        value (gpt-oss's learned attention sinks)."""
        ...
