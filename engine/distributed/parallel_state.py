"""Tensor-parallel group of this process: rank, size and the two collectives the model needs.

One process per rank; with a single rank (the default) every collective is a no-op, so the model code
calls them unconditionally. NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
    """[start, end) of this rank's share of ``total``: equal shares, the first ``total % size`` ranks one
    more (9 heads over 2 ranks: 5 and 4)."""
    rank = _group.rank if rank is None else rank
    size = _group.size if size is None else size
    if total < size:
        raise ValueError(f"{total} cannot be split over {size} tensor-parallel ranks")
    per, extra = divmod(total, size)
    start = rank * per + min(rank, extra)
    return start, start + per + (1 if rank < extra else 0)


def shard_widths(total: int, size: int | None = None) -> list[int]:
    size = _group.size if size is None else size
    return [hi - lo for lo, hi in (shard_range(total, r, size) for r in range(size))]


def kv_heads_of_rank(
    num_heads: int, num_kv_heads: int, rank: int | None = None, size: int | None = None
) -> list[int]:
    """The KV heads this rank keeps, one entry per local KV head, in order.

    A rank's query heads are a contiguous share; it keeps the KV heads they read. When its query heads
    cover whole groups (or sit inside one group), that is each needed KV head once and the grouping stays
    uniform. Otherwise (9 query heads over 3 KV heads on 2 ranks) each query head gets its own copy of its
    KV head, so attention sees plain multi-head attention on that rank.
    """
    lo, hi = shard_range(num_heads, rank, size)
    group = num_heads // num_kv_heads
    needed = [h // group for h in range(lo, hi)]
    distinct = sorted(set(needed))
    local = hi - lo
    if local % len(distinct) == 0 and all(
        needed[i] == distinct[i // (local // len(distinct))] for i in range(local)
    ):
        return distinct
    return needed
