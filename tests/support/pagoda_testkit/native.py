"""The native CPU kernels in tests: skipped only where they cannot exist, never because a build failed."""

from __future__ import annotations

import contextlib

import pytest


def require_native(built: bool) -> None:
    """Skip, naming what is missing, where native kernels cannot exist here (switched off, not Linux);
    otherwise fail unless the kernel loaded: a broken build must not pass as a skip, because serving would
    then silently run the ~10x slower torch fallbacks."""
    import sys

    from pagoda.kernels.cpu import loader

    if loader.setting() == "off" or not sys.platform.startswith("linux"):
        pytest.skip("native kernels are switched off (PAGODA_NATIVE_KERNELS=0) or this is not Linux")
    assert built, f"the native CPU kernels did not load: {loader.current().describe()}"


def _variant_names() -> list[str]:
    from pagoda.kernels.cpu import build

    return [v.name for v in build.variants()]


def _prefill_variant_names() -> list[str]:
    """The variants that compile the causal prefill kernel: every vector build (the baseline has none)."""
    return [n for n in _variant_names() if n != "baseline"] or ["none"]


@contextlib.contextmanager
def _using_variant(name: str):
    """The named variant as the process's library, skipped (naming the missing CPU features) where this CPU
    cannot run it."""
    from pagoda.kernels.cpu import build, loader

    require_native(True)
    variant = next(v for v in build.variants() if v.name == name)
    missing = sorted(variant.needs - loader.cpu_flags())
    if missing:
        pytest.skip(f"the {variant.name} kernels need a CPU with {', '.join(missing)}")
    kernels = loader.load(variant.name)
    assert kernels.lib is not None, kernels.reason
    with loader.using(kernels):
        yield kernels


@pytest.fixture(params=_variant_names())
def cpu_variant(request):
    """Each build variant of the CPU kernels in turn as the process's library (every variant this CPU runs:
    the portable baseline everywhere, so CI on an AVX-512 host tests it too)."""
    with _using_variant(request.param) as kernels:
        yield kernels


@pytest.fixture(params=_prefill_variant_names())
def prefill_variant(request):
    """Each variant that carries the causal prefill kernel (AVX2, AVX-512) in turn, as `cpu_variant`."""
    if request.param == "none":
        pytest.skip("the native prefill kernel needs an x86-64 CPU with AVX2 + FMA")
    with _using_variant(request.param) as kernels:
        assert kernels.prefill, kernels.describe()
        yield kernels


def gguf_product(lib, x, blocks, ggml_type: int, threads: int = 2, symbol: str = "pagoda_gguf_linear"):
    """``x @ W.T`` by the kernels library's GGUF product ``symbol`` (the exact one, or ``pagoda_gguf_linear_q8``)
    into a NaN-filled float32 output, asserting its status is 0."""
    import torch

    m, k = x.shape
    y = torch.full((m, blocks.shape[0]), float("nan"))
    status = getattr(lib, symbol)(
        x.data_ptr(), m, k, x.stride(0), blocks.data_ptr(), blocks.shape[0], blocks.stride(0), ggml_type,
        y.data_ptr(), y.stride(0), threads,
    )  # fmt: skip
    assert status == 0
    return y
