"""Tensor-parallel group of this process: rank, size and the two collectives the model needs.

One process per rank; with a single rank (the default) every collective is a no-op, so the model code
calls them unconditionally. NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from pagoda.engine.sizing.engine_plan import kv_heads_of_rank as _kv_heads_of_rank
from pagoda.engine.sizing.engine_plan import shard_range as _shard_range


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1


_group = TPGroup()


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device) -> None:
    """Join the group (every rank calls this with the same ``init_method``, e.g. tcp://127.0.0.1:PORT)."""
    global _group
    if size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=120),
        )
    _group = TPGroup(rank, size)


def destroy_tensor_parallel() -> None:
    global _group
    if _group.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _group = TPGroup()


def tp_rank() -> int:
    return _group.rank


def tp_size() -> int:
    return _group.size


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over the ranks, in place (row-parallel layers' partial outputs)."""
    if _group.size > 1:
        dist.all_reduce(t)
    return t


def gather_ints(value: int, device: torch.device) -> list[int]:
    """Every rank's ``value``, in rank order, on every rank (start-up figures the ranks must agree on)."""
    if _group.size == 1:
        return [int(value)]
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    parts = [torch.empty_like(t) for _ in range(_group.size)]
    dist.all_gather(parts, t)
    return [int(p.item()) for p in parts]


def all_gather_last_dim(t: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """Concatenate every rank's ``t`` along the last dimension; rank r's part is ``widths[r]`` wide
    (shards may differ by one: each is padded to the widest for the collective, then trimmed)."""
    if _group.size == 1:
        return t
    widest = max(widths)
    if t.shape[-1] < widest:
        t = torch.nn.functional.pad(t, (0, widest - t.shape[-1]))
    parts = [torch.empty_like(t) for _ in range(_group.size)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat([p[..., :w] for p, w in zip(parts, widths, strict=True)], dim=-1)


def shard_range(total: int, rank: int | None = None, size: int | None = None) -> tuple[int, int]:
    """This rank's [start, end) share of ``total`` (see pagoda.engine.sizing.engine_plan.shard_range)."""
    return _shard_range(total, _group.rank if rank is None else rank, _group.size if size is None else size)


def shard_widths(total: int, size: int | None = None) -> list[int]:
    size = _group.size if size is None else size
    return [hi - lo for lo, hi in (shard_range(total, r, size) for r in range(size))]


def kv_heads_of_rank(
    num_heads: int, num_kv_heads: int, rank: int | None = None, size: int | None = None
) -> list[int]:
    """The KV heads this rank keeps (see pagoda.engine.sizing.engine_plan.kv_heads_of_rank): the same
    function sizes the cache before any rank exists."""
    return _kv_heads_of_rank(
        num_heads, num_kv_heads, _group.rank if rank is None else rank, _group.size if size is None else size
    )
