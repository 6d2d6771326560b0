"""Building one tensor-parallel rank: its device, its model shard and the runner that drives it."""

from __future__ import annotations

import os
from typing import Any

import torch
from pagoda.engine.distributed.parallel_state import init_tensor_parallel, kv_heads_of_rank


def rank_device(device: torch.device, rank: int, size: int) -> torch.device:
    """One GPU per rank (cuda:RANK); on CPU every rank shares the host."""
    if device.type == "cuda" and size > 1:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    return device


def share_cpu_threads(device: torch.device, size: int) -> None:
    """On CPU the ranks share the cores: each takes its part, so they don't oversubscribe them."""
    if device.type == "cpu" and size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or size) // size))


def build_rank(config: Any, rank: int, size: int, init_method: str):
    """Join the group and load this rank's shard (ranks 1..N-1; rank 0 is built by the engine)."""
    from pagoda.engine.attention import get_attention_backend
    from pagoda.engine.engine_core import resolve_device, resolve_dtype
    from pagoda.engine.loader import load_model
    from pagoda.engine.model_runner import ModelRunner
    from pagoda.engine.models.config import ModelConfig

    path = config.model  # rank 0 resolved (and converted) it before starting the ranks
    mc = ModelConfig.from_dir(path)
    device = rank_device(resolve_device(config.device), rank, size)
    dtype = resolve_dtype(config.dtype, device, mc.torch_dtype)
    share_cpu_threads(device, size)
    init_tensor_parallel(rank, size, init_method, device)
    backend = get_attention_backend(config.attention_backend, device)
    model, _ = load_model(path, dtype, device, backend, progress=False)
    kv_heads = len(kv_heads_of_rank(mc.num_attention_heads, mc.num_key_value_heads))
    return ModelRunner(
        model, num_layers=mc.num_hidden_layers, num_kv_heads=kv_heads, head_dim=mc.head_dim, device=device
    )
