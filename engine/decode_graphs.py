"""CUDA graphs for decode steps: one recorded forward per batch size, replayed over static input buffers.

A decode step of a small model on a GPU is launch-bound: hundreds of small kernels whose launch cost
exceeds their run time. Recording the forward once per batch size and replaying it costs one launch.
What a replay reads must live at fixed addresses, so the step's inputs are copied into static buffers and
a batch is padded up to the next recorded size. Padding rows write no KV (slot -1) and attend to one
token of block 0 (any finite value will do: their hidden rows are dropped).

Everything the forward computes on the host is frozen at capture: the attention metadata's Python lists
and bounds are those of the padded batch at `max_model_len` (so the Triton decode kernel's split count is
chosen for the longest sequence, and each program walks only its sequence's real length), and the rotary
table is grown to `max_model_len` before capture (no later step needs a longer one, so it never moves).
The logits head runs eagerly on the real rows: recorded, every size would keep its own `[size, vocab]`
output alive.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
from pagoda.engine.attention.base import AttentionMetadata, LayerKVCache

if TYPE_CHECKING:
    from pagoda.engine.model_runner import StepInput

Replay = Callable[[], None]
Capture = Callable[[Callable[[], None]], Replay]
"""Turns a forward closure into its replay: on CUDA it records a graph; tests pass the closure through."""

LARGEST_CAPTURE = 256


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_num_seqs (at most 256): padding wastes under 8 rows."""
    top = min(max_num_seqs, LARGEST_CAPTURE)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] < top:
        sizes.append(top)
    return sizes


def cuda_capture() -> Capture:
    """Graphs recorded into one shared memory pool (captured largest first, so smaller ones fit in it)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(forward: Callable[[], None]) -> Replay:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            forward()
        return graph.replay

    return capture


class DecodeGraphs:
    """The recorded decode forwards of one model over one KV cache."""

    @torch.inference_mode()
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[LayerKVCache],
        *,
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        capture: Capture,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((top, self.max_blocks), dtype=torch.int32, device=device)
        self.hidden = torch.zeros((top, hidden_size), dtype=dtype, device=device)
        self._replays: dict[int, Replay] = {}
        from tqdm.auto import tqdm

        for size in tqdm(list(reversed(self.sizes)), desc="Recording CUDA graphs", unit="graph"):
            self._forward(size, self._metadata(size))  # warm-up: kernels compile, the rotary table grows
            # A metadata object of its own: what backends derive from it and cache (the Triton backend's
            # per-step plan) is then computed inside the recording, not borrowed from the warm-up.
            self._replays[size] = capture(partial(self._forward, size, self._metadata(size)))

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_seqs=size,
            num_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_list=[1] * size,
            seq_lens_list=[self.max_model_len] * size,
            is_decode_only=True,
        )

    def _forward(self, size: int, meta: AttentionMetadata) -> None:
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
        self.hidden[:size].copy_(hidden)

    def fits(self, step: StepInput) -> bool:
        """A pure decode step (one new token per sequence, every sequence samples) that a recording covers."""
        n = len(step.query_lens)
        return (
            0 < n <= self.sizes[-1]
            and len(step.input_ids) == n
            and len(step.sample_idx) == n
            and step.block_tables.shape[1] <= self.max_blocks
            and int(step.context_lens.max()) < self.max_model_len
        )

    @torch.inference_mode()
    def run(self, step: StepInput) -> torch.Tensor:
        """Copy the step into the buffers, pad, replay; the hidden rows of the real sequences (a view of a
        buffer the next replay overwrites)."""
        tables, positions, context_lens = step.block_tables, step.positions, step.context_lens
        n = len(step.input_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        bs = self.block_size
        slots = tables[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        self.input_ids[:n].copy_(torch.from_numpy(step.input_ids))
        self.positions[:n].copy_(torch.from_numpy(positions))
        self.slot_mapping[:n].copy_(torch.from_numpy(slots))
        self.seq_lens[:n].copy_(torch.from_numpy((context_lens + 1).astype(np.int32)))
        self.context_lens[:n].copy_(torch.from_numpy(context_lens.astype(np.int32)))
        self.block_tables[:n, : tables.shape[1]].copy_(torch.from_numpy(tables))
        if size > n:  # padding rows: no KV write, one token of block 0
            self.input_ids[n:size] = 0
            self.positions[n:size] = 0
            self.slot_mapping[n:size] = -1
            self.seq_lens[n:size] = 1
            self.context_lens[n:size] = 0
            self.block_tables[n:size, 0] = 0
        self._replays[size]()
        return self.hidden[:n]
