"""The native CPU kernels in tests: skipped only where they cannot be built, never because a build failed."""

from __future__ import annotations

import pytest


def require_native(built: bool) -> None:
    """Skip, naming what is missing, where native kernels cannot exist here (switched off, not Linux, no C
    compiler); otherwise fail unless the kernel built: a broken build must not pass as a skip, because serving
    would then silently run the ~10x slower torch fallbacks."""
    from pagoda.engine.attention.native import _compiler, native_enabled

    if not native_enabled():
        pytest.skip("native kernels are switched off (PAGODA_NATIVE_KERNELS=0) or this is not Linux")
    if _compiler() is None:
        pytest.skip("no C compiler (cc, gcc or clang) on PATH to build the native kernels")
    assert built, "a C compiler is here but the native kernel did not build (see the engine's log)"
