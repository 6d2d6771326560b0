"""The engine's window group, as arithmetic: which layers keep only their sliding window's blocks, and how a
KV budget splits between their pool and the full-attention layers' (engine/kv_cache/manager.py holds the two
pools). The engine's start-up plan, `serve --dry-run` and the planner all split with `split_kv_blocks`.

No torch and no other sizing import here: engine_plan imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SlidingLayout:
    """The layers of a model whose KV cache gets a window group (engine/kv_cache/manager.py): ``sliding`` of
    ``num_layers`` layers keep only the last ``window`` tokens' blocks (the largest window, when they differ:
    the kernels mask each layer's own)."""

    window: int
    sliding: tuple[int, ...]  # the sliding layers' indices
    num_layers: int


def sliding_layout(windows: Sequence[int | None]) -> SlidingLayout | None:
    """The window group of a model with these per-layer windows (None = full attention): None when no layer
    slides. When every layer slides (Mistral v0.1) the full group keeps its table but no layer: its blocks
    are bookkeeping only (hashes, the prefix index, events) and take no memory (``split_kv_blocks``)."""
    sliding = tuple(i for i, w in enumerate(windows) if w)
    if not sliding:
        return None
    return SlidingLayout(max(w for w in windows if w), sliding, len(windows))


def all_sliding(layout: SlidingLayout | None) -> bool:
    """Whether every layer of the model slides: the full group then holds no KV at all."""
    return layout is not None and len(layout.sliding) == layout.num_layers


WINDOW_CACHE_MODES = ("auto", "off")  # --sliding-window-cache


def engine_sliding_layout(config: Any, windows: Sequence[int | None]) -> tuple[SlidingLayout | None, str]:
    """(the window group the engine builds for ``config`` (an EngineConfig, read only) and a model with these
    per-layer windows, or None; why, in words). The engine and `serve --dry-run` both decide here. Offload
    tiers asked for explicitly and attention sinks keep every block of every layer (their blocks hold every
    layer); the default host tier of a GPU pod is left out in favour of the window group."""
    layout = sliding_layout(windows)
    if layout is None:
        return None, "no window group: the model has no sliding layers beside full-attention ones"
    if getattr(config, "sliding_window_cache", "auto") == "off":
        return None, "no window group: --sliding-window-cache off"
    if getattr(config, "pipeline_parallel_size", 1) > 1:  # its pools are sized over the whole model's layers
        return None, "no window group: pipeline parallelism (each stage holds its own layers' KV)"
    explicit_tier = (
        (config.kv_offload_host_bytes or 0) > 0
        or (config.swap_space or 0) > 0
        or bool(config.kv_offload_disk_dir)
        or config.preemption_mode == "swap"
    )
    if explicit_tier:
        return None, "no window group: KV offload tiers (and swap preemption) keep every layer's blocks"
    if config.kv_eviction != "none":
        return None, "no window group: --kv-eviction streaming (attention sinks) keeps every layer's blocks"
    return layout, (
        f"window group: {len(layout.sliding)} of {layout.num_layers} layers keep the last {layout.window} "
        "tokens' blocks"
    )


def window_blocks_per_sequence(window: int, block_size: int) -> int:
    """Most window-group blocks a decoding sequence holds: the blocks of keys ``p - window + 1 .. p`` of its
    next query p, plus the block its next token goes into."""
    return _ceil_div(window - 1, block_size) + 2


def bookkeeping_blocks(
    num_window: int, window: int, block_size: int, max_model_len: int, max_num_seqs: int
) -> int:
    """The full group's pool when every layer slides: its blocks hold no KV (hashes, the prefix index and
    events only), so it is sized never to bind. A sequence holds at most a table of ``max_model_len``
    tokens there; one that has passed the window holds at least ``(window - 1) // block_size + 1`` window
    blocks and a shorter one as many window blocks as full ones, so the window pool's blocks bound the
    full blocks in use as well as ``max_num_seqs`` does. The smaller bound, plus one sequence's table."""
    per_seq = _ceil_div(max_model_len, block_size)
    least_window = (window - 1) // block_size + 1
    by_seqs = min(max_num_seqs, num_window - 1) * (per_seq + 1)
    by_window = (num_window - 1) * _ceil_div(per_seq + 1, least_window)
    return min(by_seqs, by_window) + per_seq + 1


@dataclass(frozen=True)
class KVSplit:
    """The KV blocks of each pool: ``num_blocks`` for the full-attention layers (every layer without a window
    group), ``num_window_blocks`` for the sliding layers (0: one pool); ``sequences`` of ``max_model_len``
    tokens fit in both at once."""

    num_blocks: int
    num_window_blocks: int
    sequences: int
    block_bytes: int  # one block of the full pool, all its layers
    window_block_bytes: int  # one block of the window pool, all its layers

    @property
    def allocated_bytes(self) -> int:
        return self.num_blocks * self.block_bytes + self.num_window_blocks * self.window_block_bytes


def split_kv_blocks(
    kv_memory_bytes: int,
    kv_bytes_per_token: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    layout: SlidingLayout | None,
) -> KVSplit:
    """Split a KV budget between the pools: the window pool gets, for c sequences, their window blocks (plus
    the null block and one step's chunk), the full pool the rest, c being the most sequences of
    ``max_model_len`` tokens the budget holds that way, at most ``max_num_seqs``. Without a layout (or with
    ``max_model_len`` within the window, where freeing gains nothing) one pool of every layer. When every
    layer slides, the full group's blocks cost nothing: the window pool takes the whole budget and the full
    one is bookkeeping, sized never to bind (``bookkeeping_blocks``)."""
    block_bytes = kv_bytes_per_token * block_size
    per_seq = _ceil_div(max_model_len, block_size)
    if layout is None or max_model_len <= layout.window:
        blocks = int(max(kv_memory_bytes // block_bytes, 1))
        return KVSplit(blocks, 0, blocks // per_seq, block_bytes, 0)
    layer_block = block_bytes // layout.num_layers
    win_bytes = len(layout.sliding) * layer_block
    full_bytes = block_bytes - win_bytes
    per_seq_win = min(window_blocks_per_sequence(layout.window, block_size), per_seq + 1)
    # the null block and one step's chunk (no longer than a sequence)
    fixed = 1 + _ceil_div(min(max_num_batched_tokens, max_model_len), block_size)
    seqs = (kv_memory_bytes - fixed * win_bytes) // (per_seq * full_bytes + per_seq_win * win_bytes)
    seqs = min(int(seqs), max_num_seqs)
    if seqs < 1:
        blocks = int(max(kv_memory_bytes // block_bytes, 1))
        return KVSplit(blocks, 0, blocks // per_seq, block_bytes, 0)
    if full_bytes == 0:  # every layer slides: the window pool is the cache
        num_window = int(kv_memory_bytes // win_bytes)
        return KVSplit(
            bookkeeping_blocks(num_window, layout.window, block_size, max_model_len, max_num_seqs),
            num_window,
            seqs,
            0,
            win_bytes,
        )
    num_window = fixed + seqs * per_seq_win
    num_full = int((kv_memory_bytes - num_window * win_bytes) // full_bytes)
    return KVSplit(num_full, num_window, seqs, full_bytes, win_bytes)
