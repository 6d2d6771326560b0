"""The C kernels of the CPU path as built and loaded: every variant built at install, the best one this CPU
runs loaded without compiling, the signature table against the C sources, and the loader's fallbacks and
refusals (serial when OpenMP does not load, foreign or writable files refused, stale builds pruned, the torch
path said once at WARNING)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest
from pagoda.kernels.cpu import build, loader
from pagoda.kernels.cpu.signatures import SIGNATURES
from pagoda_testkit.native import require_native

C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
AVX512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
AVX2 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}


@pytest.fixture(autouse=True)
def _native() -> None:
    require_native(True)


@pytest.fixture
def no_prebuilt(tmp_path, monkeypatch) -> Path:
    """An install without prebuilt libraries, and a private kernel cache for run-time builds."""
    monkeypatch.setattr(build, "DEFAULT_DEST", tmp_path / "install-lib")
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "cpu-kernels"


def test_install_built_every_variant_ahead():
    manifest = json.loads((build.DEFAULT_DEST / build.MANIFEST).read_text())
    assert manifest["sources"] == build.source_digest() and not manifest["errors"]
    for v in build.variants():
        assert manifest["libraries"][v.name] == [build.library_name(v.name, omp) for omp in (True, False)]


def test_the_best_variant_this_cpu_runs_is_loaded_prebuilt():
    kernels = loader.load()
    best = loader.runnable()[0]
    assert (kernels.variant, kernels.origin, kernels.openmp) == (best.name, loader.PREBUILT, True), kernels
    assert kernels.lib.pagoda_cpu_variant().decode() == best.name
    assert Path(kernels.path).parent == build.DEFAULT_DEST
    assert kernels.prefill == (best.name != "baseline")


def test_variants_follow_the_cpu_flags():
    names = lambda flags: [v.name for v in loader.runnable(frozenset(flags))]  # noqa: E731
    if [v.name for v in build.variants()] != ["avx512", "avx2", "baseline"]:
        pytest.skip("x86-64 variants only on an x86-64 host")
    assert names(AVX512 | AVX2 | {"avx512_bf16"}) == ["avx512", "avx2", "baseline"]
    assert names(AVX2) == ["avx2", "baseline"]
    assert names(AVX2 - {"fma"}) == ["baseline"]
    assert names(set()) == ["baseline"]


def test_the_signature_table_matches_the_c_definitions():
    """Every exported function of the .c files is in the table with the same argument types, in order."""
    text = "\n".join((build.HERE / name).read_text() for name in build.SOURCES)
    macros = {m[0]: m[1] for m in re.findall(r"#define (\w+_DECL) (.*?)(?<!\\)\n", text, re.S)}
    found = {}
    for ret, name, args in re.findall(
        r"^(int|void|const char \*)\s*(pagoda_\w+)\(([^)]*)\)\s*\{", text, re.M | re.S
    ):
        args = macros.get(args.strip(), args).replace("\\\n", " ")
        types = []
        for arg in filter(None, (a.strip() for a in args.split(","))):
            if arg == "void":
                continue
            if "*" in arg:
                types.append(ctypes.c_void_p)
            else:
                types.append(C_TYPES[arg.rsplit(None, 1)[0].replace("const ", "")])
        restype = {"int": ctypes.c_int, "void": None, "const char *": ctypes.c_char_p}[ret]
        found[name] = (restype, types)
    assert found == SIGNATURES


def test_serial_library_where_the_openmp_one_does_not_load(tmp_path):
    variant = loader.runnable()[-1]  # the baseline
    for omp in (True, False):
        shutil.copy(build.DEFAULT_DEST / build.library_name(variant.name, omp), tmp_path)
    (tmp_path / build.library_name(variant.name, True)).write_bytes(b"\x7fELF broken")
    kernels = loader._load_from(tmp_path, variant, loader.PREBUILT, (os.getuid(), 0))
    assert kernels.lib is not None and not kernels.openmp, kernels
    assert "did not load" in kernels.reason
    assert kernels.lib.pagoda_cpu_variant().decode() == variant.name


def test_libraries_others_could_have_written_are_refused(tmp_path):
    variant = loader.runnable()[-1]
    names = [build.library_name(variant.name, omp) for omp in (True, False)]
    for name in names:
        shutil.copy(build.DEFAULT_DEST / name, tmp_path)
    tmp_path.chmod(0o755)
    (tmp_path / names[0]).chmod(0o666)  # the OpenMP library group/world-writable: refused, serial taken
    kernels = loader._load_from(tmp_path, variant, loader.PREBUILT, (os.getuid(),))
    assert not kernels.openmp and "writable by group or others" in kernels.reason
    tmp_path.chmod(0o777)  # the directory writable: nothing loads
    kernels = loader._load_from(tmp_path, variant, loader.PREBUILT, (os.getuid(),))
    assert kernels.lib is None and "writable by group or others" in kernels.reason
    tmp_path.chmod(0o755)
    if os.getuid() == 0:
        for name in names:
            os.chown(tmp_path / name, 4321, 4321)
    owners = (os.getuid(),) if os.getuid() == 0 else (os.getuid() + 1,)  # as root: a file now owned by 4321
    kernels = loader._load_from(tmp_path, variant, loader.PREBUILT, owners)
    assert kernels.lib is None and "owned by uid" in kernels.reason


def test_development_fallback_compiles_into_a_private_cache_and_prunes_stale_builds(no_prebuilt):
    if build.compiler() is None:
        pytest.skip("no C compiler (cc, gcc or clang) for the run-time build")
    stale = no_prebuilt / "0123456789abcdef0123"
    stale.mkdir(parents=True)
    (stale / build.library_name("baseline", True)).write_bytes(b"old")
    kernels = loader.load("baseline")
    assert (kernels.variant, kernels.origin) == ("baseline", loader.COMPILED), kernels
    assert "no prebuilt kernels" in kernels.reason
    assert Path(kernels.path).parent == no_prebuilt / build.source_digest()
    assert not stale.exists()
    assert (no_prebuilt / build.source_digest()).stat().st_mode & 0o777 == 0o700


def test_a_cache_others_can_write_is_refused(no_prebuilt, monkeypatch):
    no_prebuilt.mkdir(parents=True)
    no_prebuilt.chmod(0o777)
    monkeypatch.setattr(build, "compiler", lambda: "/usr/bin/cc")
    kernels = loader.load("baseline")
    assert kernels.lib is None and "refused the kernel cache" in kernels.reason, kernels


def test_torch_path_is_said_once_at_warning_with_the_reason(no_prebuilt, monkeypatch, caplog):
    monkeypatch.setattr(build, "compiler", lambda: None)
    monkeypatch.setattr(loader, "_current", None)
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        assert loader.library() is None and loader.library() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.records
    assert "no prebuilt kernels" in warnings[0].message and "no C compiler" in warnings[0].message
    assert loader.current().variant == loader.TORCH


def test_the_loaded_variant_is_logged_at_start(monkeypatch, caplog):
    monkeypatch.setattr(loader, "_current", None)
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        kernels = loader.current()
    assert [r.getMessage() for r in caplog.records] == [f"CPU kernels: {kernels.describe()}"]
    assert f"variant {kernels.variant} (prebuilt, OpenMP)" in caplog.records[0].getMessage()


def test_a_variant_by_name_and_off(monkeypatch):
    monkeypatch.setenv("PAGODA_NATIVE_KERNELS", "baseline")
    monkeypatch.setattr(loader, "_current", None)
    assert loader.current().variant == "baseline"
    monkeypatch.setenv("PAGODA_NATIVE_KERNELS", "0")
    monkeypatch.setattr(loader, "_current", None)
    assert loader.current().lib is None and "PAGODA_NATIVE_KERNELS" in loader.current().reason
    missing = sorted(AVX512 - loader.cpu_flags())
    if missing:  # a variant this CPU cannot run is refused, not loaded to crash on its first instruction
        assert "cannot run" in loader.load("avx512").reason
