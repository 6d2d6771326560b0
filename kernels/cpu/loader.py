"""Loads the C kernels of the CPU path with ctypes: the best prebuilt variant this CPU runs, once per process.

Order: the prebuilt libraries of the install (kernels/cpu/lib, built by `build.py` at install), best variant
the CPU supports first, OpenMP build then serial; only where none of them is usable (sources changed since
the install build, or an install without them) the best variant is compiled into the user's cache, a
development fallback. Where nothing loads, callers use their torch paths, and that is said once at WARNING
with the reason.

A library is loaded only from a file owned by the current user (or root, for an install) that neither group
nor others may write, in a directory of the same kind: the cache lives in a writable, possibly shared place.

``PAGODA_NATIVE_KERNELS``: unset/``1``/``auto`` picks as above, ``0``/``off`` uses torch everywhere, a
variant's name (``baseline``, ``avx2``, ``avx512``) loads that one.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pagoda.engine import envs
from pagoda.kernels.cpu import build
from pagoda.kernels.cpu.signatures import FEATURE_BF16_DOT, FEATURE_PREFILL, FEATURE_SMALL_ROWS, SIGNATURES

log = logging.getLogger(__name__)

TORCH = "torch"  # the variant name when no library is loaded
PREBUILT, COMPILED = "prebuilt", "compiled"  # where a loaded library came from
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class CpuKernels:
    """The library a process uses for its CPU kernels, or why it uses torch instead."""

    variant: str  # a build variant's name, or "torch"
    origin: str  # PREBUILT, COMPILED (at run time), or "" for torch
    openmp: bool = False
    path: str | None = None
    reason: str = ""  # why torch (or why the prebuilt libraries were passed over)
    lib: ctypes.CDLL | None = field(default=None, repr=False, compare=False)

    @property
    def prefill(self) -> bool:
        """Whether the library carries the causal prefill kernel (the AVX2 and AVX-512 variants do)."""
        return self.lib is not None and bool(self.lib.pagoda_cpu_features() & FEATURE_PREFILL)

    @functools.cached_property
    def small_rows(self) -> bool:
        """Whether the library's small-rows product is its vector one (AVX2, AVX-512); whether a linear takes
        it or oneDNN is measured on the host (engine/models/cpu_linear_choice.py)."""
        return self.lib is not None and bool(self.lib.pagoda_cpu_features() & FEATURE_SMALL_ROWS)

    @functools.cached_property
    def bf16_dot(self) -> bool:
        """Whether the library multiplies bfloat16 by AVX512-BF16 dot products here (pagoda_small_rows_bf16dp:
        the AVX-512 variant on a CPU that has them)."""
        return self.lib is not None and bool(self.lib.pagoda_cpu_features() & FEATURE_BF16_DOT)

    def describe(self) -> str:
        if self.lib is None:
            return f"torch path ({self.reason})"
        how = "OpenMP" if self.openmp else "serial"
        return f"variant {self.variant} ({self.origin}, {how}) from {self.path}"


def setting() -> str:
    """``PAGODA_NATIVE_KERNELS`` normalised: "off", "auto" or a variant name."""
    value = envs.native_kernels()
    if value in _OFF:
        return "off"
    return "auto" if value in ("", "1", "true", "yes", "on", "auto") else value


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def runnable(flags: frozenset[str] | None = None) -> list[build.Variant]:
    """The variants this CPU can run, best first."""
    flags = cpu_flags() if flags is None else flags
    return [v for v in build.variants() if v.needs <= flags]


def _safe(path: Path, owners: tuple[int, ...]) -> str | None:
    """None if ``path`` and its directory are owned by one of ``owners`` and writable by neither group nor
    others; otherwise what is wrong."""
    for p in (path.parent, path):
        st = p.stat()
        if st.st_uid not in owners:
            return f"{p} is owned by uid {st.st_uid}, not {' or '.join(map(str, owners))}"
        if st.st_mode & 0o022:
            return f"{p} is writable by group or others (mode {st.st_mode & 0o777:o})"
    return None


def _open(path: Path, owners: tuple[int, ...]) -> tuple[ctypes.CDLL | None, str]:
    problem = _safe(path, owners)
    if problem is not None:
        return None, f"refused {problem}"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"{path.name} did not load: {exc}"
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            return None, f"{path.name} lacks {name}"
        fn.restype, fn.argtypes = restype, argtypes
    return lib, ""


def _load_from(dest: Path, variant: build.Variant, origin: str, owners: tuple[int, ...]) -> CpuKernels:
    """The OpenMP library of ``variant`` in ``dest``, else its serial one."""
    reasons = []
    for openmp in (True, False):
        path = dest / build.library_name(variant.name, openmp)
        if not path.exists():
            reasons.append(f"{path.name} not built")
            continue
        lib, why = _open(path, owners)
        if lib is not None:
            return CpuKernels(variant.name, origin, openmp, str(path), "; ".join(reasons), lib)
        reasons.append(why)
    return CpuKernels(TORCH, "", reason="; ".join(reasons))


def _prebuilt(variant: build.Variant, digest: str) -> CpuKernels:
    dest = build.DEFAULT_DEST
    try:
        manifest = json.loads((dest / build.MANIFEST).read_text())
    except (OSError, ValueError):
        return CpuKernels(TORCH, "", reason=f"no prebuilt kernels in {dest}")
    if manifest.get("sources") != digest:
        return CpuKernels(TORCH, "", reason=f"the prebuilt kernels in {dest} are from other sources")
    return _load_from(dest, variant, PREBUILT, (os.getuid(), 0))


def cache_root() -> Path:
    return envs.cache_root() / "cpu-kernels"


def _private_dir(path: Path) -> str | None:
    """Create ``path`` (mode 0700) or check an existing one is ours; None when it is fit for libraries."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {st.st_mode & 0o777:o})"
    return None


def prune(root: Path, keep: str) -> list[Path]:
    """Remove the cached builds of other sources under ``root`` (only directories this user owns)."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            if entry.name != keep and entry.is_dir() and entry.stat().st_uid == os.getuid():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def _compiled(variant: build.Variant, digest: str) -> CpuKernels:
    """Development fallback: ``variant`` compiled at run time into the cache (reused while the sources stay)."""
    cc = build.compiler()
    if cc is None:
        return CpuKernels(TORCH, "", reason="no C compiler (cc, gcc or clang) to build them at run time")
    root = cache_root()
    try:
        problem = _private_dir(root) or _private_dir(root / digest)
    except OSError as exc:
        problem = f"cannot create {root}: {exc}"
    if problem is not None:
        return CpuKernels(TORCH, "", reason=f"refused the kernel cache: {problem}")
    prune(root, digest)
    dest = root / digest
    errors = []
    for openmp in (True, False):
        if not (dest / build.library_name(variant.name, openmp)).exists():
            err = build.compile_library(cc, variant, openmp, dest)
            if err is not None:
                errors.append(err)
        kernels = _load_from(dest, variant, COMPILED, (os.getuid(),))
        if kernels.lib is not None:
            return kernels
    return CpuKernels(TORCH, "", reason="the run-time build failed: " + " | ".join(errors)[-1000:])


def load(variant: str | None = None) -> CpuKernels:
    """Load the named variant, or the best one this CPU runs (None); never raises."""
    if not sys.platform.startswith("linux"):
        return CpuKernels(TORCH, "", reason="native CPU kernels are built for Linux only")
    choices = runnable()
    if variant is not None:
        known = {v.name: v for v in build.variants()}
        if variant not in known:
            return CpuKernels(TORCH, "", reason=f"no kernel variant {variant!r} (known: {', '.join(known)})")
        if known[variant] not in choices:
            return CpuKernels(TORCH, "", reason=f"this CPU cannot run the {variant} variant")
        choices = [known[variant]]
    if not choices:
        return CpuKernels(TORCH, "", reason="no kernel variant for this CPU")
    try:
        digest = build.source_digest()
    except OSError as exc:
        return CpuKernels(TORCH, "", reason=f"the kernel sources are missing: {exc}")
    passed_over = []
    for v in choices:
        kernels = _prebuilt(v, digest)
        if kernels.lib is not None:
            return kernels
        passed_over.append(kernels.reason)
    for v in choices:
        kernels = _compiled(v, digest)
        if kernels.lib is not None:
            return CpuKernels(**{**kernels.__dict__, "reason": passed_over[0]})
    return CpuKernels(TORCH, "", reason=f"{passed_over[0]}; {kernels.reason}")


_current: CpuKernels | None = None


def current() -> CpuKernels:
    """The process's kernels: loaded, and logged, on first use (the torch path at WARNING, with its reason)."""
    global _current
    if _current is None:
        wanted = setting()
        if wanted == "off":
            kernels = CpuKernels(TORCH, "", reason="switched off by PAGODA_NATIVE_KERNELS")
            log.info("CPU kernels: %s", kernels.describe())
        else:
            kernels = load(None if wanted == "auto" else wanted)
            if kernels.lib is None:
                log.warning("CPU kernels: %s; CPU steps run several times slower", kernels.describe())
            elif kernels.origin == COMPILED:
                log.warning("CPU kernels: %s at run time (%s)", kernels.describe(), kernels.reason)
            else:
                log.info("CPU kernels: %s", kernels.describe())
        _current = kernels
    return _current


def library() -> ctypes.CDLL | None:
    """The process's typed library, or None (callers take their torch path)."""
    return current().lib


@contextlib.contextmanager
def using(kernels: CpuKernels) -> Iterator[CpuKernels]:
    """Run with ``kernels`` as the process's library (tests: one variant explicitly)."""
    global _current
    before = _current
    _current = kernels
    try:
        yield kernels
    finally:
        _current = before
