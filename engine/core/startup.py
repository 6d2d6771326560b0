"""How a failed engine start-up ends `pagoda serve`: the message, the exit code, the pod's termination message.

Shared by the two places an engine starts: the server's own process (`--no-engine-process`) and the engine
core's process, which sends the verdict to the server to act on (engine/frontend/core_process.py).
"""

from __future__ import annotations

from typing import Any

from pagoda.engine.exit_codes import (
    EXIT_OUT_OF_MEMORY,
    EXIT_START_FAILED,
    EXIT_USAGE,
    REASON_CUDA_OOM,
    REASON_KV_TOO_SMALL,
    termination_message,
)

# (what to print, the exit code, the termination message to write or None)
StartupFailure = tuple[str, int, str | None]


def startup_failure(exc: BaseException) -> StartupFailure | None:
    """The verdict on an exception from building the engine; None for one that is a bug (re-raise it)."""
    from pagoda.engine.sizing.errors import UnsupportedOnGPU

    failure = out_of_memory(exc)
    if failure is not None:
        return f"out of memory at start-up: {exc}", EXIT_OUT_OF_MEMORY, failure
    if isinstance(exc, UnsupportedOnGPU):
        return f"error: {exc}", EXIT_USAGE, None
    if isinstance(exc, ValueError | FileNotFoundError | OSError):
        return f"cannot start the engine: {exc}", EXIT_START_FAILED, None
    return None


def out_of_memory(exc: BaseException) -> str | None:
    """The termination message for a start-up that ran out of memory, or None for any other failure."""
    from pagoda.engine.sizing.engine_plan import last_profile
    from pagoda.engine.sizing.errors import StartupFitError

    if isinstance(exc, StartupFitError):
        profile = exc.profile.to_dict() if hasattr(exc.profile, "to_dict") else None
        return termination_message(REASON_KV_TOO_SMALL, str(exc), profile)
    import torch

    if not (isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()):
        return None
    latest = last_profile()
    profile: dict[str, Any] = latest.to_dict() if latest is not None else {"device": "cuda", "measured": True}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        profile.update(
            device_total_bytes=total,
            device_free_bytes=free,
            peak_allocated_bytes=torch.cuda.max_memory_allocated(),
        )
    return termination_message(REASON_CUDA_OOM, str(exc), profile)
