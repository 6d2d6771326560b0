"""Small C kernels for the CPU serving path: compiled on first use with the system C compiler, loaded with ctypes.

Why plain C and ctypes: the kernels only need raw pointers, so a C file builds in about a second, where a torch
C++ extension compiles torch's headers for a minute on a 2-core machine and `torch.compile` of the same paged
attention measured 6x slower (and a minute to compile). Built with ``-march=native``: the cache key includes the
CPU's feature flags, so a cache directory shared between hosts never hands out code this CPU cannot run.

OpenMP: the library links ``libgomp.so.1``, which the dynamic loader resolves to the copy torch has already
loaded (same soname), so kernels and torch ops share one thread pool; every call also passes
``torch.get_num_threads()`` so the kernels follow ``torch.set_num_threads``.

Nothing here is required: without a compiler, on a build error, or with ``PAGODA_NATIVE_KERNELS=0``,
`load_library` returns None and callers use their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# -ffp-contract=off: no fused multiply-adds the source does not spell out, so element-wise kernels round like
# the torch ops they replace.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11"]
_loaded: dict[str, ctypes.CDLL | None] = {}

# Shared by the kernels' sources: headers, a 16-lane exp and bfloat16 widening.
C_PRELUDE = r"""
#include <stdint.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
/* bfloat16 is the top half of a float32: widening is a 16-bit shift. */
static inline float bf16_to_f32(uint16_t x) { union { uint32_t u; float f; } c; c.u = (uint32_t)x << 16; return c.f; }
#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* exp on 16 lanes: 2^n * p(r), r = x - n ln2, Cephes' minimax polynomial (about 1 ulp on the range used). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif
"""


def native_enabled() -> bool:
    """False when PAGODA_NATIVE_KERNELS is 0/false/no/off, or off Linux (the build assumes a GNU toolchain)."""
    if os.environ.get("PAGODA_NATIVE_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return sys.platform.startswith("linux")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    from pagoda.engine.loader.resolve import pagoda_cache_dir

    return pagoda_cache_dir() / "native"


def _build(cc: str, source: str, target: Path, openmp: bool) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "kernel.c"
        src.write_text(source)
        out = Path(tmp) / target.name
        cmd = [cc, *_FLAGS, *(["-fopenmp"] if openmp else []), "-o", str(out), str(src), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            log.debug("native build failed (%s): %s", " ".join(cmd), proc.stderr[-2000:])
            return False
        os.replace(out, target)  # atomic: concurrent builders never load a half-written file
    return True


def load_library(name: str, source: str) -> ctypes.CDLL | None:
    """The compiled library for ``source`` (built once per source/compiler/CPU, then cached), or None."""
    if name in _loaded:
        return _loaded[name]
    lib = None
    cc = _compiler() if native_enabled() else None
    if cc is not None:
        try:
            version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
            key = hashlib.sha256("\0".join([source, " ".join(_FLAGS), version, cpu_flags()]).encode())
            for openmp in (True, False):
                target = _cache_dir() / f"{name}-{'omp' if openmp else 'serial'}-{key.hexdigest()[:20]}.so"
                if target.exists() or _build(cc, source, target, openmp):
                    lib = ctypes.CDLL(str(target))
                    break
        except (OSError, subprocess.SubprocessError) as e:
            log.debug("native kernels %s unavailable: %s", name, e)
            lib = None
    if lib is None and native_enabled():
        log.info("native CPU kernels %r unavailable (no working C compiler); using the torch path", name)
    _loaded[name] = lib
    return lib
