"""Keep freed host memory in the process instead of handing it back to the kernel after every step.

A CPU forward allocates and frees activations of tens of MB per layer (a 2,048-token prefill's gate/up output
is 25 MB). glibc serves blocks that large with fresh `mmap`s, or trims its heap once the free top passes a
threshold, so the next step's tensors fault in new zeroed pages from the kernel, page by page (what that
cost is measured in docs/benchmarks.md). Telling glibc to keep what it freed (no trim, no mmap below 32 MiB,
a 64 MiB pad when the heap grows) makes later steps reuse the same pages, as a caching allocator would.

The cost is that the process keeps its peak heap: memory freed after a burst is not returned to the
system (the KV cache, the largest allocation, is kept for the whole life of the engine anyway). Off with
``PAGODA_HOST_MALLOC_TUNING=0``; a no-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

from pagoda.engine import envs

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

_SETTINGS = (
    (_M_MMAP_THRESHOLD, 32 << 20),  # glibc's ceiling for this threshold on 64-bit
    (_M_TRIM_THRESHOLD, 2**31 - 1),  # an int: the largest value mallopt takes, i.e. never trim
    (_M_TOP_PAD, 64 << 20),
)
_applied: bool | None = None


def enabled() -> bool:
    return envs.host_malloc_tuning()


def keep_freed_memory() -> bool:
    """Apply the settings above once per process; True when glibc took all of them."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not enabled() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt)
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = all(mallopt(param, value) == 1 for param, value in _SETTINGS)
    if not _applied:
        log.debug("mallopt refused a setting; host allocations keep glibc's defaults")
    return _applied
