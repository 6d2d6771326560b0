"""Start-up fit: given the KV memory the engine measured, settle max_model_len or refuse with one message."""

from __future__ import annotations

from pagoda.engine.sizing.errors import SizingError, StartupFitError
from pagoda.engine.sizing.units import human_bytes


def num_blocks_for(kv_memory_bytes: int, kv_bytes_per_token: int, block_size: int) -> int:
    """Whole KV blocks that fit in kv_memory_bytes (never negative)."""
    if kv_bytes_per_token <= 0 or block_size <= 0:
        raise SizingError(
            f"kv_bytes_per_token and block_size must be positive, got {kv_bytes_per_token}, {block_size}"
        )
    return max(int(kv_memory_bytes), 0) // (kv_bytes_per_token * block_size)


def _memory_flag(device: str) -> str:
    if str(device).startswith("cuda") or device == "gpu":
        return "raise --gpu-memory-utilization"
    return "raise --kv-cache-memory-bytes"


def fit_max_model_len(
    requested: int | str | None,
    model_max_len: int,
    kv_bytes_per_token: int,
    kv_memory_bytes: int,
    block_size: int,
    *,
    weights_bytes: int = 0,
    activation_bytes: int = 0,
    device: str = "cpu",
) -> int:
    """The max_model_len the engine will run with.

    kv_memory_bytes is what is left for the KV cache after weights and activations (weights_bytes and
    activation_bytes are only quoted in the message). requested: None = the model's limit, which must fit;
    "auto" = the largest length, a multiple of block_size up to the model's limit, that fits one sequence;
    an int = that length, which must fit. A length that cannot fit raises SizingError saying what fits.
    """
    if model_max_len < 1:
        raise SizingError(f"model_max_len must be at least 1, got {model_max_len}")
    blocks = num_blocks_for(kv_memory_bytes, kv_bytes_per_token, block_size)
    capacity = blocks * block_size  # tokens one sequence could hold if it had every block
    largest = model_max_len if capacity >= model_max_len else capacity

    if isinstance(requested, str):
        if requested.strip().lower() == "auto":
            requested_len = None
        else:
            try:
                requested_len = int(requested)
            except ValueError:
                raise SizingError(f"max_model_len must be an integer or 'auto', got {requested!r}") from None
            requested = requested_len
    if requested is not None and not isinstance(requested, str):
        requested = int(requested)
        if requested < 1:
            raise SizingError(f"max_model_len must be at least 1, got {requested}")
        if requested > model_max_len:
            raise SizingError(
                f"max_model_len={requested} is longer than the model's limit of {model_max_len} tokens "
                f"(max_position_embeddings); set --max-model-len {model_max_len} or less, or 'auto'"
            )

    if isinstance(requested, str):  # auto
        if largest >= 1:
            return largest
        want = block_size
    else:
        want = model_max_len if requested is None else requested
        if -(-want // block_size) <= blocks:
            return want

    needed = -(-want // block_size) * block_size * kv_bytes_per_token
    after = []
    if weights_bytes:
        after.append(f"{human_bytes(weights_bytes)} of weights")
    if activation_bytes:
        after.append(f"{human_bytes(activation_bytes)} of activations")
    after_text = f" after {' and '.join(after)}" if after else ""
    subject = (
        f"max_model_len={want}"
        if requested is not None and not isinstance(requested, str)
        else f"the model's limit of {want} tokens (no --max-model-len given)"
        if requested is None
        else "--max-model-len auto"
    )
    fits = (
        f"the largest max_model_len that fits is {largest}"
        if largest >= 1
        else f"not even one block of {block_size} tokens fits"
    )
    raise StartupFitError(
        f"{subject} does not fit in the KV cache: one sequence of {want} tokens needs {human_bytes(needed)} "
        f"of KV cache ({kv_bytes_per_token} B/token, block size {block_size}), but only "
        f"{human_bytes(max(kv_memory_bytes, 0))} is available for the KV cache{after_text}; {fits}. "
        f"Lower --max-model-len (or pass --max-model-len auto) or {_memory_flag(device)}."
    )
