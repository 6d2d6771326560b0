"""Building a rank: its device and dtype, its model shard and the runner that drives it. Every rank, 0
included, is built by `build_rank`; ranks 1..N-1 first join the group in their own process (`join_rank`)."""

from __future__ import annotations

import os
from typing import Any

import torch
from pagoda.engine.attention import get_attention_backend
from pagoda.engine.distributed.parallel_state import init_tensor_parallel, kv_heads_of_rank, pp_state
from pagoda.engine.loader import load_model
from pagoda.engine.sizing.engine_plan import resolve_dtype_name
from pagoda.engine.sizing.gpus import check_dtypes
from pagoda.engine.sizing.model_config import ModelConfig
from pagoda.engine.worker.model_runner import ModelRunner

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but no CUDA GPU is available")
    return torch.device(name)


def resolve_dtype(
    name: str, device: torch.device, checkpoint_dtype: str | None, float16: bool = True
) -> torch.dtype:
    """The torch dtype of ``--dtype name`` (the sizing module's rule, so dry runs size what runs);
    ``float16=False`` for families that overflow it (the architecture table's `float16`)."""
    cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return _DTYPES[resolve_dtype_name(name, device.type, checkpoint_dtype, cc, float16)]


def check_device(device: torch.device, dtype: torch.dtype, kv_cache_dtype: str) -> None:
    """Refuse at start-up what this GPU cannot run (UnsupportedOnGPU, exit code 2), before anything else."""
    if device.type == "cuda":
        name, cc = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
        check_dtypes(name, cc, str(dtype).removeprefix("torch."), kv_cache_dtype)


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


def build_rank(
    config: Any,
    path: Any,
    mc: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    *,
    eos_token_ids: list[int] | None = None,
    progress: bool = True,
) -> ModelRunner:
    """Load this rank's shard (its heads of every layer under tensor parallelism) and its runner."""
    backend = get_attention_backend(config.attention_backend, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if getattr(config, "quantization", None) == "gguf":  # the GGUF file's blocks kept quantized
        from pagoda.engine.loader.gguf_quant import load_gguf_model

        model, _ = load_gguf_model(path, dtype, device, backend, progress=progress)
    else:
        model, _ = load_model(path, dtype, device, backend, progress=progress)
    if isinstance(config.max_model_len, int) and hasattr(model, "set_max_model_len"):
        # A length the user set is known before the plan: LongRoPE picks its factor set by it (every rank
        # alike). Otherwise the model's own length decides (see layers.longrope_uses_long).
        model.set_max_model_len(config.max_model_len)
    kv_heads = len(kv_heads_of_rank(mc.num_attention_heads, mc.num_key_value_heads))
    pp = pp_state()
    first, end = pp.layers or (0, mc.num_hidden_layers)  # a pipeline stage keeps KV for its layers only
    runner = ModelRunner(
        model,
        num_layers=end - first,
        num_kv_heads=kv_heads,
        head_dim=mc.head_dim,
        device=device,
        eos_token_ids=eos_token_ids,
    )
    runner.attention_backend = backend.name
    runner.first_layer = first
    if pp.stages > 1:
        from pagoda.engine.worker.pipeline import Pipeline

        runner.pipeline = Pipeline(runner, pp)
    return runner


def join_rank(config: Any, rank: int, size: int, init_method: str) -> ModelRunner:
    """Ranks 1..N-1, each in its own process: device, threads, the group, then the build every rank runs."""
    path = config.model  # rank 0 resolved (and converted) it before starting the ranks
    mc = ModelConfig.from_dir(path)
    device = rank_device(resolve_device(config.device), rank, size)
    dtype = resolve_dtype(config.dtype, device, mc.torch_dtype, mc.family.float16)
    share_cpu_threads(device, size)
    init_tensor_parallel(rank, size, init_method, device)
    return build_rank(config, path, mc, device, dtype, progress=False)
