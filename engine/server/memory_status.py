"""GET /pagoda/memory: the memory profile the engine started with (weights, activation peak, KV allocated).

The operator plans from estimates; the engine measures. Exposing the measurement lets a supervisor compare
the two and re-plan from facts (the same profile goes to the pod's termination message when start-up runs
out of memory, see pagoda.engine.cli.exit_codes). The profile is taken once, before serving starts, so the
route never touches the engine thread.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

ROUTE = "/pagoda/memory"


def measured_profile(engine: Any) -> dict[str, Any]:
    """The start-up memory profile of an LLMEngine, as JSON; call it before the engine loop starts."""
    from pagoda.engine.sizing.engine_plan import MemoryProfile, last_profile

    cfg = engine.config
    kv_allocated = int(engine.num_blocks) * int(cfg.block_size) * int(engine.kv_bytes_per_token)
    plan = getattr(engine, "plan", None)
    profile = getattr(plan, "profile", None)
    if not isinstance(profile, MemoryProfile):
        latest = last_profile()  # set when the engine planned through pagoda.engine.sizing.engine_plan
        profile = latest if latest is not None and latest.kv_allocated_bytes == kv_allocated else None
    if profile is not None:
        out = profile.to_dict()
    else:
        device = engine.device.type
        total = free = None
        if device == "cuda":
            import torch

            free, total = torch.cuda.mem_get_info(engine.device)
        out = MemoryProfile(
            device=device,
            weights_bytes=int(engine.runner.weights_bytes()),
            activation_peak_bytes=0,
            kv_cache_bytes=kv_allocated,
            kv_allocated_bytes=kv_allocated,
            device_total_bytes=total,
            device_free_bytes=free,
            gpu_memory_utilization=cfg.gpu_memory_utilization if device == "cuda" else None,
            source=device,
        ).to_dict()
        out["activation_peak_bytes"] = None  # measured inside the engine's start-up, not kept
    out.update(
        num_blocks=int(engine.num_blocks),
        block_size=int(cfg.block_size),
        kv_bytes_per_token=int(engine.kv_bytes_per_token),
        max_model_len=int(engine.max_model_len),
        tensor_parallel_size=int(cfg.tensor_parallel_size),
    )
    return out


def install_memory_status(app: FastAPI, profile: dict[str, Any]) -> None:
    """Serve `profile` at GET /pagoda/memory, open like /metrics (the middleware's OPEN_PATHS): the operator
    reads it through the API server's pod proxy, which cannot add the engine's key."""

    @app.get(ROUTE)
    async def memory_status() -> dict[str, Any]:
        return profile
