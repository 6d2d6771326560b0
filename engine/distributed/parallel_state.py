"""Tensor-parallel group of this process: rank, size and the two collectives the model needs; and, with
pipeline parallelism, this rank's stage.

One process per rank; with a single rank (the default) every collective is a no-op, so the model code
calls them unconditionally. NCCL on CUDA, gloo on CPU. Under pipeline parallelism the world is
stages x tensor-parallel ranks (stage-major: global rank r is stage r // T, TP rank r % T); each stage's
TP ranks get a group of their own for the model's collectives, and the stages hand activations on with
point-to-point sends over the world group (engine/worker/pipeline.py).
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


@dataclass(frozen=True)
class PPState:
    """This rank's place in the pipeline: its global rank, the world, its stage and the stage's layers."""

    rank: int = 0
    world: int = 1
    stage: int = 0
    stages: int = 1
    tp: int = 1
    layers: tuple[int, int] | None = None  # [start, end) of the model's layers; None: all of them
    host_ranks: int = 1  # ranks on this host (they share its memory and cores)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


_pp = PPState()
_tp_pg = None  # this stage's TP process group (None: the default group, when the world is one stage)
_control_pg = None  # gloo group over every rank: rank 0's messages (pp_workers.py)
CONTROL_TIMEOUT = datetime.timedelta(days=3650)  # ranks wait for rank 0's next step for as long as it idles


def init_distributed(
    rank: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    init_method: str,
    device: torch.device,
    layers: tuple[int, int] | None = None,
    host_ranks: int = 1,
) -> None:
    """Join a world of stages x TP ranks (every rank calls this with the same arguments but ``rank`` and
    ``layers``): the world group, one TP group per stage (created by every rank, in stage order) and the
    control group rank 0 sends its messages over."""
    global _group, _pp, _tp_pg, _control_pg
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    world = tp * pp
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    stage = rank // tp
    _tp_pg = None
    for s in range(pp):
        pg = dist.new_group(list(range(s * tp, (s + 1) * tp))) if tp > 1 and pp > 1 else None
        if s == stage:
            _tp_pg = pg
    _control_pg = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _group = TPGroup(rank % tp, tp)
    _pp = PPState(rank, world, stage, pp, tp, layers, host_ranks)


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
    global _group, _pp, _tp_pg, _control_pg
    if (_group.size > 1 or _pp.world > 1) and dist.is_initialized():
        dist.destroy_process_group()
    _group, _pp, _tp_pg, _control_pg = TPGroup(), PPState(), None, None


def pp_state() -> PPState:
    return _pp


def control_group() -> dist.ProcessGroup | None:
    """The gloo group rank 0 broadcasts its messages over (None outside a pipeline world)."""
    return _control_pg


def tp_rank() -> int:
    return _group.rank


def tp_size() -> int:
    return _group.size


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over the ranks, in place (row-parallel layers' partial outputs)."""
    if _group.size > 1:
        dist.all_reduce(t, group=_tp_pg)
    return t


def gather_ints(value: int, device: torch.device) -> list[int]:
    """Every rank's ``value``, in rank order, on every rank of the world, every stage's included
    (start-up figures the ranks must agree on)."""
    world = max(_group.size, _pp.world)
    if world == 1:
        return [int(value)]
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    parts = [torch.empty_like(t) for _ in range(world)]
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
    dist.all_gather(parts, t.contiguous(), group=_tp_pg)
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
