"""Where Triton kernels may run, and the checks that make a wrong place a clear error."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_launchable(t: torch.Tensor, name: str) -> None:
    """Triton needs a CUDA tensor, or a CPU tensor with the interpreter switched on before Triton's import."""
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and interpreting():
        import triton.language.standard as tl_standard
        from triton.runtime.interpreter import InterpretedFunction

        if isinstance(tl_standard.max, InterpretedFunction):
            _patch_interpreter_index()
            return
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton had been imported; set it before anything imports "
            "triton (transformers' model classes do) to run the Triton kernels on the CPU"
        )
    raise RuntimeError(
        f"{name} is on {t.device}; the Triton kernels need a CUDA tensor, or a CPU tensor with the "
        "environment variable TRITON_INTERPRET=1 set before triton is imported (slow; for tests)"
    )


_INDEX_PATCHED = False


def check_int8_scales(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """An INT8 cache needs a contiguous float32 scales tensor shaped like the cache without head_dim."""
    if kv_scales is None:
        raise ValueError("an INT8 KV cache needs its scales tensor (kv_scales)")
    if tuple(kv_scales.shape) != tuple(kv_cache.shape[:4]) or kv_scales.dtype != torch.float32:
        raise ValueError(
            f"kv_scales {tuple(kv_scales.shape)} {kv_scales.dtype} does not fit kv_cache "
            f"{tuple(kv_cache.shape)}: expected {tuple(kv_cache.shape[:4])} float32"
        )
    if not kv_scales.is_contiguous():
        raise ValueError("kv_scales must be contiguous")
    if kv_scales.device != kv_cache.device:
        raise ValueError(f"kv_scales is on {kv_scales.device}, kv_cache on {kv_cache.device}")


def prepare_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int]:
    """Shared checks of the paged attention launchers; returns (q, out, num_heads, head_dim, block_size,
    num_kv_heads) with q made contiguous in its last dim and out allocated if not given."""
    check_launchable(kv_cache, "kv_cache")
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit kv_cache {tuple(kv_cache.shape)}: head_dim must match and "
            "num_heads must be a multiple of num_kv_heads"
        )
    if head_dim & (head_dim - 1) or block_size & (block_size - 1):
        raise ValueError(f"head_dim ({head_dim}) and block_size ({block_size}) must be powers of two")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    return q, out, num_heads, head_dim, block_size, num_kv_heads


def _patch_interpreter_index() -> None:
    """Let the interpreter use a loaded scalar as a `range()` bound under NumPy >= 2.4.

    The interpreter keeps scalars as 1-element arrays and converts them with `int(array)`, which NumPy 2.4
    turned into an error; compiled Triton has no such problem. Wraps Triton's per-launch patch of
    `tl.tensor` so `__index__` reads the single element instead.
    """
    global _INDEX_PATCHED
    if _INDEX_PATCHED:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor
    _INDEX_PATCHED = True


_SM_COUNT: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a fixed small number under the interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
