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
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
from pagoda.engine.attention.base import AttentionMetadata, LayerKVCache

if TYPE_CHECKING:
    from pagoda.engine.worker.step_input import StepInput

Replay = Callable[[], None]
Capture = Callable[[Callable[[], None]], Replay]
"""Turns a forward closure into its replay: on CUDA it records a graph; tests pass the closure through."""

LARGEST_CAPTURE = 256


class RerunCapture:
    """A recording emulated on any device: the replay calls the recorded forward again, with the metadata
    and buffers it was recorded with, and counts itself by batch size. What the CPU tests record with (it
    pickles, so tensor-parallel ranks get it too); shapes and host-side values are frozen as a graph
    freezes them, launches that only a GPU would refuse while recording are not checked."""

    def __init__(self) -> None:
        self.recorded: list[int] = []
        self.replays: Counter[int] = Counter()

    def __call__(self, forward: Callable[[], None]) -> Replay:
        size = forward.args[0]
        self.recorded.append(size)

        def replay() -> None:
            self.replays[size] += 1
            forward()

        return replay


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
        window: bool = False,
    ) -> None:
        """``window``: the cache has a window group, whose tables and slots the recordings read too."""
        self.model = model
        self.window = window
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        top = self.sizes[-1]
        self.staging = StagingBuffer(top, self.max_blocks, device, window)
        self.input_ids, self.positions, self.slot_mapping = (self.staging.device[k] for k in _INT64_INPUTS)
        self.seq_lens, self.context_lens = (
            self.staging.device["seq_lens"],
            self.staging.device["context_lens"],
        )
        self.block_tables = self.staging.device["block_tables"]
        self.window_block_tables = self.staging.device.get("window_block_tables")
        self.window_slot_mapping = self.staging.device.get("window_slot_mapping")
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
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
            window_block_tables=self.window_block_tables[:size] if self.window else None,
            window_slot_mapping=self.window_slot_mapping[:size] if self.window else None,
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
            and int(step.positions.max()) < self.max_model_len  # attention sinks go past what was recorded
            and (step.window_block_tables is not None) == self.window
        )

    @torch.inference_mode()
    def run(self, step: StepInput) -> torch.Tensor:
        """Write the step into the staging buffer, padded, copy it to the device in one transfer, replay;
        the hidden rows of the real sequences (a view of a buffer the next replay overwrites)."""
        tables, positions, context_lens = step.block_tables, step.positions, step.context_lens
        n = len(step.input_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        bs = self.block_size
        host = self.staging.writable()
        host["input_ids"][:n] = step.input_ids
        host["positions"][:n] = positions
        host["slot_mapping"][:n] = (
            tables[np.arange(n), context_lens // bs].astype(np.int64) * bs + context_lens % bs
        )
        host["seq_lens"][:n] = context_lens + 1
        host["context_lens"][:n] = context_lens
        host["block_tables"][:n, : tables.shape[1]] = tables
        if self.window:
            window = step.window_block_tables
            host["window_slot_mapping"][:n] = (
                window[np.arange(n), context_lens // bs].astype(np.int64) * bs + context_lens % bs
            )
            host["window_block_tables"][:n, : window.shape[1]] = window
        if size > n:  # padding rows: no KV write, one token of block 0
            for name, value in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1), ("seq_lens", 1),
                                ("context_lens", 0)):  # fmt: skip
                host[name][n:size] = value
            host["block_tables"][n:size, 0] = 0
            if self.window:
                host["window_slot_mapping"][n:size] = -1
                host["window_block_tables"][n:size, 0] = 0
        self.staging.upload(size)
        self._replays[size]()
        return self.hidden[:n]


_INT64_INPUTS = ("input_ids", "positions", "slot_mapping")
_LAYOUT = (  # name, dtype, columns (None: one value per row); the block tables last, so rows 0..size of
    # every input end the buffer's first bytes and a step copies only those
    ("input_ids", torch.int64, None),
    ("positions", torch.int64, None),
    ("slot_mapping", torch.int64, None),
    ("seq_lens", torch.int32, None),
    ("context_lens", torch.int32, None),
    ("block_tables", torch.int32, "max_blocks"),
)
# A cache with a window group: the sliding layers' slots among the small inputs, their tables after the others.
_WINDOW_LAYOUT = (
    *_LAYOUT[:-1],
    ("window_slot_mapping", torch.int64, None),
    _LAYOUT[-1],
    ("window_block_tables", torch.int32, "max_blocks"),
)
_ALIGN = 256  # each input starts where the CUDA allocator would put a tensor of its own


class StagingBuffer:
    """A decode step's inputs in one host buffer (pinned on CUDA) and one device buffer of the same layout:
    the step is written on the host with NumPy and reaches the recorded forward's static inputs in one
    asynchronous copy, instead of six pageable ones. The host side is rewritten only once the previous
    copy has finished (an event), since the engine does not wait for the device between steps on every
    rank."""

    def __init__(self, rows: int, max_blocks: int, device: torch.device, window: bool = False) -> None:
        self.cuda = device.type == "cuda"
        offsets, end = {}, 0
        for name, dtype, columns in _WINDOW_LAYOUT if window else _LAYOUT:
            shape = (rows, max_blocks) if columns else (rows,)
            offsets[name] = (end, dtype, shape)
            end += -(-(int(np.prod(shape)) * dtype.itemsize) // _ALIGN) * _ALIGN
        # the last table: a step copies its first rows and everything before it
        self.table_offset = offsets["window_block_tables" if window else "block_tables"][0]
        self.row_bytes = max_blocks * torch.int32.itemsize
        self.host_bytes = torch.zeros(end, dtype=torch.uint8, pin_memory=self.cuda)
        self.device_bytes = torch.zeros(end, dtype=torch.uint8, device=device)
        self.device = {k: _view(self.device_bytes, *spec) for k, spec in offsets.items()}
        self.host = {k: _view(self.host_bytes, *spec).numpy() for k, spec in offsets.items()}
        self.device["seq_lens"].fill_(1)  # rows never written read one token of block 0, like padding rows
        self.host["seq_lens"][:] = 1
        for slots in ("slot_mapping", "window_slot_mapping") if window else ("slot_mapping",):
            self.device[slots].fill_(-1)
            self.host[slots][:] = -1
        self._copied = torch.cuda.Event() if self.cuda else None

    def writable(self) -> dict[str, np.ndarray]:
        """The host views, once the last upload has read them."""
        if self._copied is not None:
            self._copied.synchronize()
        return self.host

    def upload(self, rows: int) -> None:
        """One copy of every input's first ``rows`` rows (the small inputs whole, then the block tables)."""
        end = self.table_offset + rows * self.row_bytes
        self.device_bytes[:end].copy_(self.host_bytes[:end], non_blocking=self.cuda)
        if self._copied is not None:
            self._copied.record()


def _view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    count = int(np.prod(shape))
    return buffer[offset : offset + count * dtype.itemsize].view(dtype).view(shape)
