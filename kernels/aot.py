"""Compiling the Triton kernels ahead of time for a GPU that need not be here.

Inside `compiling_for(gpu)` every launcher (the same functions the engine calls) hands its kernel and
arguments to `launch`, which compiles instead of launching: Triton builds for the target architecture with
the ptxas its wheel bundles, into the cache the engine reads (`TRITON_CACHE_DIR`). The steps are those of
Triton's own launch path (bind and specialize the arguments, then `triton.compile`), so the cache key is the
one the engine's first launch of the same variant looks up. Tensors are meta tensors: shapes, strides and
dtypes, no memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pagoda.kernels.launch_config import DeviceLimits
from pagoda.kernels.runtime import COMPILING, Compiler


@dataclass(frozen=True)
class Variant:
    """One compiled kernel variant and what it needs of the device."""

    kernel: str  # the @triton.jit function's name
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    shared_memory: int  # bytes per block, as the compiled kernel's metadata says
    shared_memory_bound: int  # what the launch configuration counted on (pagoda.kernels.launch_config)

    @property
    def label(self) -> str:
        """kernel[sizes and flags that are set, warps, stages]: what tells one variant from another."""
        sizes = [f"{k}={v}" for k, v in self.constexprs.items() if k in LABEL_SIZES]
        flags = [k for k in LABEL_FLAGS if self.constexprs.get(k)]
        parts = [*sizes, *flags, f"warps={self.num_warps}", f"stages={self.num_stages}"]
        return f"{self.kernel.strip('_')}[{', '.join(parts)}]"


LABEL_SIZES = (
    "GROUP",
    "HEAD_DIM",
    "BLOCK_SIZE",
    "BLOCK_M",
    "BLOCK_N",
    "BLOCK_K",
    "HEADS_PAD",
    "BLOCK",
    "BLOCK_H",
    "ALIGN",
)
LABEL_FLAGS = ("SPLIT", "USE_WINDOW", "SOFTCAP", "IEEE_DOT", "INT8", "QUANTIZE", "HAS_RESIDUAL", "GROUP_TILES",
               "ACT_QUANT", "BLOCKWISE", "HAS_BIAS")  # fmt: skip


@dataclass
class Compilation:
    """What one `compiling_for` block compiled, in launch order, without repeats."""

    limits: DeviceLimits
    variants: list[Variant] = field(default_factory=list)
    _seen: set = field(default_factory=set)

    def add(self, variant: Variant, key: str) -> None:
        if key not in self._seen:
            self._seen.add(key)
            self.variants.append(variant)


def target_of(limits: DeviceLimits) -> Any:
    from triton.backends.compiler import GPUTarget

    major, minor = limits.compute_capability
    return GPUTarget("cuda", major * 10 + minor, 32)


def _packed(kernel: Any, args: tuple, kwargs: dict, target: Any) -> tuple:
    """Triton's specialization of a launch for ``target``, as its JIT does it: (signature, constexprs,
    attrs, options)."""
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options


def compile_kernel(kernel: Any, args: tuple, kwargs: dict, target: Any) -> Any:
    """Triton's launch path up to the compiled kernel (triton.runtime.jit.JITFunction.run), for `target`."""
    from triton.compiler import ASTSource, compile

    signature, constexprs, attrs, options = _packed(kernel, args, kwargs, target)
    return compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def variant_key(kernel: Any, args: tuple, kwargs: dict, target: Any) -> tuple:
    """What tells a launch's compiled variant apart (Triton's specialization of its arguments, its constexprs
    and options for ``target``), without compiling."""
    signature, constexprs, attrs, options = _packed(kernel, args, kwargs, target)
    return (kernel.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items(), key=str)),
            repr(sorted(attrs.items(), key=str)), repr(sorted(options.__dict__.items())))  # fmt: skip


@contextmanager
def recording_for(limits: DeviceLimits) -> Iterator[set[tuple]]:
    """Launches inside the block record their variant_key for a device with these limits (nothing compiles):
    the set of variants a sequence of launches needs, in seconds."""
    keys: set[tuple] = set()
    target = target_of(limits)

    def record(kernel: Any, args: tuple, kwargs: dict, bound: int) -> None:
        keys.add(variant_key(kernel, args, kwargs, target))

    token = COMPILING.set(Compiler(limits, record))
    try:
        yield keys
    finally:
        COMPILING.reset(token)


@contextmanager
def compiling_for(limits: DeviceLimits) -> Iterator[Compilation]:
    """Launches inside the block compile for a device with these limits instead of running."""
    compilation = Compilation(limits)
    target = target_of(limits)

    def compile_one(kernel: Any, args: tuple, kwargs: dict, bound: int) -> None:
        compiled = compile_kernel(kernel, args, kwargs, target)
        constexprs = {p.name: kwargs[p.name] for p in kernel.params if p.is_constexpr and p.name in kwargs}
        meta = compiled.metadata
        variant = Variant(
            kernel.__name__, constexprs, meta.num_warps, meta.num_stages, int(meta.shared), bound
        )
        compilation.add(variant, compiled.hash)

    token = COMPILING.set(Compiler(limits, compile_one))
    try:
        yield compilation
    finally:
        COMPILING.reset(token)
