"""Where Triton kernels may run, the checks that make a wrong place a clear error, and their launch.

Every launcher goes through `launch`: normally it launches, inside `compiling_for` (pagoda.kernels.aot) it
compiles the same kernel with the same arguments for a GPU that need not be here. The kernels keep every
integer that varies from step to step or with the cache's size out of Triton's specialization and compute
the cache's strides from its constexpr shape, so the variants a launch compiles are fixed by the
constexprs, dtypes and launch configuration alone: what `pagoda kernels warm` compiles is what runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from pagoda.kernels.launch_config import INTERPRETER, DeviceLimits


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class Compiler:
    """What `launch` hands a kernel to while compiling ahead (pagoda.kernels.aot), with the target's limits."""

    limits: DeviceLimits
    compile: Callable[[Any, tuple, dict, int], None]  # (kernel, args, kwargs, shared memory bound)


COMPILING: ContextVar[Compiler | None] = ContextVar("pagoda_kernels_compiling", default=None)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, shared_memory_bound: int, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, or its compilation for the target being compiled for (which
    checks the compiled kernel against ``shared_memory_bound``, the launch configuration's estimate)."""
    compiler = COMPILING.get()
    if compiler is None:
        kernel[grid](*args, **kwargs)
    else:
        compiler.compile(kernel, args, kwargs, shared_memory_bound)


_LIMITS: dict[int, DeviceLimits] = {}


def device_limits(device: torch.device) -> DeviceLimits:
    """Compute capability and shared memory per block (opt-in maximum) of the device a launch runs on."""
    compiler = COMPILING.get()
    if compiler is not None:
        return compiler.limits
    if device.type != "cuda":
        return INTERPRETER
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _LIMITS:
        props = torch.cuda.get_device_properties(index)
        smem = getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block
        _LIMITS[index] = DeviceLimits((props.major, props.minor), int(smem))
    return _LIMITS[index]


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16', 'float8_e4m3fn', 'int8': how the launch configurations name dtypes."""
    return str(dtype).removeprefix("torch.")


def heads_layout(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``t`` [rows, heads, head_dim] as the kernels address it (heads ``head_dim`` apart, rows a whole number
    of heads apart, elements adjacent): itself when it already is, else a contiguous copy."""
    if t.stride(-1) == 1 and t.stride(-2) == head_dim and t.stride(0) % head_dim == 0:
        return t
    return t.contiguous()


def check_launchable(t: torch.Tensor, name: str) -> None:
    """Triton needs a CUDA tensor, or a CPU tensor with the interpreter switched on before Triton's import
    (or, compiling ahead, a tensor on the meta device: shapes and dtypes without memory)."""
    if t.device.type == "cuda" or (t.device.type == "meta" and COMPILING.get() is not None):
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
    if block_size & (block_size - 1):
        raise ValueError(f"block_size ({block_size}) must be a power of two")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    q = heads_layout(q, head_dim)
    if out is None:
        out = torch.empty_like(q)
    elif heads_layout(out, head_dim) is not out:
        raise ValueError(f"out {tuple(out.shape)} with strides {out.stride()} is not laid out by whole heads")
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


def vector_align(dtype: torch.dtype, *sizes: int) -> int:
    """Elements of ``dtype`` in 16 bytes when every size (a row's width, row strides) divides by it, else 1.

    The element-wise kernels take such sizes as multiples of this constexpr, which tells Triton their
    divisibility (vectorised loads) while the sizes themselves stay out of the specialization."""
    vec = 16 // dtype.itemsize
    return vec if all(s % vec == 0 for s in sizes) else 1
