"""Builds the C kernels of the CPU path ahead of run time: one shared library per variant, OpenMP and serial.

Standard library only: setup.py runs it at install (`make install`, `pip install .`, so also in the image
build) before pagoda is importable, and the loader runs it as a development fallback. From a checkout:
``python kernels/cpu/build.py [DEST]`` (default: kernels/cpu/lib).

A variant is a set of compiler flags and the CPU features it needs. x86-64 gets a portable baseline (the
plain C loops, vectorised with SSE2 only), an AVX2 + FMA build (x86-64-v3, the same loops wider) and an
AVX-512 build (x86-64-v4); the two wider builds also compile the vector paths and the prefill kernel, each
written once over the vector layer of pagoda_cpu.h, at 8 and 16 lanes. Elsewhere only the compiler's default
target. ``-ffp-contract=off``: no fused multiply-adds the source does not spell out, so element-wise kernels
round like the torch ops they replace.

OpenMP: the OpenMP library links ``libgomp.so.1``, which the dynamic loader resolves to the copy torch has
already loaded, so kernels and torch ops share one thread pool. The serial library is what the loader takes
where that fails to load.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = (
    "paged_decode.c",
    "paged_prefill.c",
    "layer_ops.c",
    "greedy.c",
    "lora.c",
    "small_rows.c",
    "quant_gguf.c",
    "quant_gguf_q8act.c",
    "info.c",
)
HEADERS = ("pagoda_cpu.h", "quant_gguf.h")
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11")
MANIFEST = "build.json"
DEFAULT_DEST = HERE / "lib"

_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]
    needs: frozenset[str]  # /proc/cpuinfo flags the CPU must list


def variants(machine: str | None = None) -> tuple[Variant, ...]:
    """This architecture's variants, best first."""
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64"):
        return (
            Variant("avx512", ("-march=x86-64-v4", "-mtune=generic"), _V4),
            Variant("avx2", ("-march=x86-64-v3", "-mtune=generic"), _V3),
            Variant("baseline", ("-march=x86-64", "-mtune=generic"), frozenset()),
        )
    return (Variant("baseline", (), frozenset()),)


def library_name(variant: str, openmp: bool) -> str:
    return f"libpagoda_cpu-{variant}-{'omp' if openmp else 'serial'}.so"


def source_digest(src: Path = HERE) -> str:
    """Hash of the sources and the common flags: a library built from other sources is stale."""
    h = hashlib.sha256(" ".join(COMMON_FLAGS).encode())
    for name in (*HEADERS, *SOURCES):
        h.update(b"\0" + name.encode() + b"\0" + (src / name).read_bytes())
    return h.hexdigest()[:20]


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compile_library(cc: str, variant: Variant, openmp: bool, dest: Path, src: Path = HERE) -> str | None:
    """Compile one library into ``dest`` (atomically: a concurrent loader never sees half a file); None on
    success, else the compiler's complaint."""
    target = dest / library_name(variant.name, openmp)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        out = Path(tmp) / target.name
        cmd = [
            cc, *COMMON_FLAGS, *variant.flags, *(["-fopenmp"] if openmp else []),
            f'-DPAGODA_VARIANT="{variant.name}"', f"-I{src}", "-o", str(out),
            *(str(src / name) for name in SOURCES), "-lm",
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{' '.join(cmd)}: {exc}"
        if proc.returncode != 0:
            return f"{' '.join(cmd)}:\n{proc.stderr[-2000:]}"
        os.chmod(out, 0o755)
        os.replace(out, target)
    return None


def build(dest: Path = DEFAULT_DEST, only: list[str] | None = None, src: Path = HERE) -> dict:
    """Build every variant (or those named in ``only``), OpenMP and serial, in parallel; write and return the
    manifest. A variant this compiler cannot build is left out (named in the manifest's ``errors``)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang, or $CC) on PATH")
    dest.mkdir(parents=True, exist_ok=True)
    jobs = [(v, omp) for v in variants() if only is None or v.name in only for omp in (True, False)]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()
    done = _up_to_date(
        dest, src, version[0] if version else cc, [library_name(v.name, omp) for v, omp in jobs]
    )
    if done is not None:
        return done
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        errors = dict(
            zip(jobs, pool.map(lambda job: compile_library(cc, *job, dest, src), jobs), strict=True)
        )
    manifest = {
        "sources": source_digest(src),
        "compiler": version[0] if version else cc,
        "libraries": {
            v.name: [library_name(v.name, omp) for omp in (True, False) if errors[(v, omp)] is None]
            for v in {v for v, _ in jobs}
        },
        "errors": {library_name(v.name, omp): e for (v, omp), e in errors.items() if e is not None},
    }
    tmp = dest / f".{MANIFEST}.{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, dest / MANIFEST)
    return manifest


def _up_to_date(dest: Path, src: Path, compiler_version: str, names: list[str]) -> dict | None:
    """The manifest in ``dest`` when it already holds these libraries, built from these sources by this
    compiler (a repeated install builds nothing)."""
    try:
        manifest = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    built = {name for libs in manifest.get("libraries", {}).values() for name in libs}
    fresh = manifest.get("sources") == source_digest(src) and manifest.get("compiler") == compiler_version
    return manifest if fresh and set(names) <= built and all((dest / n).exists() for n in names) else None


def check(dest: Path = DEFAULT_DEST) -> list[str]:
    """What is missing from a complete build of these sources in ``dest`` (empty when nothing is)."""
    try:
        manifest = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        return [f"no build manifest: {exc}"]
    problems = [f"{lib}: {err}" for lib, err in manifest.get("errors", {}).items()]
    if manifest.get("sources") != source_digest():
        problems.append("built from other sources")
    for v in variants():
        for omp in (True, False):
            name = library_name(v.name, omp)
            if name not in manifest.get("libraries", {}).get(v.name, []) or not (dest / name).exists():
                problems.append(f"{name} missing")
    return problems


def main(argv: list[str]) -> int:
    if argv[1:2] == ["--check"]:
        problems = check(Path(argv[2]) if len(argv) > 2 else DEFAULT_DEST)
        for problem in problems:
            print(f"pagoda cpu kernels: {problem}", file=sys.stderr)
        return 1 if problems else 0
    dest = Path(argv[1]) if len(argv) > 1 else DEFAULT_DEST
    manifest = build(dest)
    for name, libs in sorted(manifest["libraries"].items()):
        print(f"pagoda cpu kernels: {name}: {', '.join(libs) or 'not built'}")
    for lib, err in manifest["errors"].items():
        print(f"pagoda cpu kernels: {lib} failed: {err}", file=sys.stderr)
    return 0 if not manifest["errors"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
