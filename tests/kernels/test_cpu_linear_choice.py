"""The measured choice between the small-rows product and oneDNN (timings injected, so the choice is known), its
file in the kernel cache shared by processes, the forcing variable, and the AVX512-BF16 product on every
variant against a float64 reference."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from pagoda.engine.models import cpu_linear, cpu_linear_choice
from pagoda.engine.models.cpu_linear_choice import ONEDNN, OURS, ROW_BUCKETS, ChoiceTable, Shape
from pagoda.kernels.cpu import loader
from pagoda_testkit.native import cpu_variant  # noqa: F401 (fixture: each CPU kernel variant)

SHAPE = Shape("f32", 96, 64, 2)
IDENTITY = {"cpu": "test cpu", "flags": "f", "kernels": "avx512 lib abc", "torch": "t"}


class Timer:
    """Fake timings: ours faster up to ``cross`` rows, oneDNN above; counts the row counts asked for."""

    def __init__(self, cross: int) -> None:
        self.cross = cross
        self.asked: list[int] = []

    def __call__(self, rows: int) -> dict[str, float]:
        self.asked.append(rows)
        ours = 1.0 if rows <= self.cross else 3.0
        return {OURS: ours * 1e-6, ONEDNN: 2e-6}


@pytest.fixture(autouse=True)
def _auto(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGODA_CPU_LINEAR", raising=False)
    monkeypatch.delenv("PAGODA_ONEDNN_LINEAR", raising=False)
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "cache"))
    cpu_linear_choice.reset()
    yield
    cpu_linear_choice.reset()


def test_buckets_take_the_next_measured_row_count_up():
    assert [cpu_linear_choice.bucket(r) for r in (1, 2, 3, 5, 8, 9, 17, 33, 64)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        32,
        64,
        64,
    ]
    assert cpu_linear_choice.decide({OURS: 1.0, ONEDNN: 2.0}) == OURS
    assert cpu_linear_choice.decide({OURS: 2.0, ONEDNN: 2.0}) == ONEDNN  # a tie keeps oneDNN
    assert cpu_linear_choice.decide({ONEDNN: 2.0}) == ONEDNN


def test_measured_once_per_host_and_read_by_the_next_process(tmp_path):
    path = tmp_path / "choice.json"
    timer = Timer(cross=4)
    table = ChoiceTable(path, IDENTITY)
    got = {rows: table.choose(SHAPE, rows, timer) for rows in range(1, 65)}
    assert timer.asked == list(ROW_BUCKETS)  # every bucket once, on the first miss
    assert {r for r, c in got.items() if c == OURS} == {1, 2, 3, 4}
    # another process of the host: reads the file, measures nothing
    other = Timer(cross=64)
    again = ChoiceTable(path, IDENTITY)
    assert all(again.choose(SHAPE, rows, other) == got[rows] for rows in range(1, 65))
    assert other.asked == []
    # another shape is measured and added beside the first
    wide = Shape("bf16", 96, 64, 2)
    assert again.choose(wide, 33, other) == OURS and other.asked == list(ROW_BUCKETS)
    third = ChoiceTable(path, IDENTITY)
    assert third.choose(SHAPE, 1, Timer(0)) == OURS and third.choose(wide, 64, Timer(0)) == OURS
    # another host (or kernel library, or torch) in the same file measures again
    moved = Timer(cross=0)
    assert ChoiceTable(path, {**IDENTITY, "torch": "other"}).choose(SHAPE, 1, moved) == ONEDNN
    assert moved.asked == list(ROW_BUCKETS)


def test_concurrent_processes_agree_the_first_measures(tmp_path):
    """Two tables on one file (as two processes: separate opens, so the flock excludes) meeting a shape at
    once: one measures, the other waits on the lock and reads its result."""
    path = tmp_path / "choice.json"
    calls: list[int] = []
    results: dict[int, str] = {}

    def slow(rows: int) -> dict[str, float]:
        calls.append(rows)
        time.sleep(0.01)
        return {OURS: 1e-6, ONEDNN: 2e-6} if len(calls) <= len(ROW_BUCKETS) else {OURS: 3e-6, ONEDNN: 2e-6}

    def run(i: int) -> None:
        results[i] = ChoiceTable(path, IDENTITY).choose(SHAPE, 16, slow)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == len(ROW_BUCKETS)  # measured once
    assert results == {0: OURS, 1: OURS}


def test_an_unwritable_cache_measures_for_this_process_only(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    table = ChoiceTable(blocker / "choice.json", IDENTITY)  # a directory that cannot exist
    timer = Timer(cross=8)
    assert table.choose(SHAPE, 5, timer) == OURS and table.choose(SHAPE, 9, timer) == ONEDNN
    assert timer.asked == list(ROW_BUCKETS) and table.path is None


def test_the_variable_forces_either_side_without_measuring(monkeypatch):
    never = Timer(cross=64)
    for setting in (OURS, ONEDNN):
        monkeypatch.setenv("PAGODA_CPU_LINEAR", setting)
        assert cpu_linear_choice.choose(SHAPE, 3, never) == setting
    monkeypatch.setenv("PAGODA_CPU_LINEAR", "nonsense")
    assert cpu_linear_choice.setting() == "auto"
    assert never.asked == []


def test_linear_takes_the_measured_side_and_keeps_its_values(cpu_variant):  # noqa: F811
    """`linear` on real timings: whichever side is chosen, F.linear's values; the table is kept in the cache
    and `pagoda kernels info` reads it back."""
    torch.manual_seed(0)
    w = torch.randn(40, 37)
    packed = cpu_linear.PackedWeight()
    for rows in (1, 5, 64):
        x = torch.randn(rows, 37)
        with torch.inference_mode():  # as the engine runs: the timer's weight copies and packs work there
            got = cpu_linear.linear(x, w, None, packed)
        assert (got - x @ w.T).abs().max().item() < 1e-4
    table = cpu_linear_choice.current_table()
    key = Shape("f32", 40, 37, torch.get_num_threads()).key()
    assert set(table.shapes[key]) == {str(r) for r in ROW_BUCKETS}
    assert table.path is not None and table.path.exists()
    assert all(set(v["us"]) == {OURS, ONEDNN} for v in table.shapes[key].values())


@pytest.mark.parametrize("k", [576, 64, 37])
def test_bfloat16_dot_product_on_every_variant(k, cpu_variant):  # noqa: F811
    """bfloat16 x and weight by AVX512-BF16 dot products (AVX-512 variant on such a CPU; 2 elsewhere): streamed
    and tiled row counts, strided operands, a partial tile, an odd K (tail), float32 and bfloat16 outputs, against
    the float64 product of the bfloat16 values (float32 sums: about 1e-5 relative), and `linear` through it."""
    lib = cpu_variant.lib
    torch.manual_seed(k)
    n = 301
    w = torch.randn(n, k + 5)[:, 2 : 2 + k].to(torch.bfloat16)
    for rows in (1, 2, 5, 8, 9, 13, 64):
        x = torch.randn(rows, k + 3)[:, :k].to(torch.bfloat16)
        want = x.double() @ w.double().T
        out = torch.full((rows, n), float("nan"))
        status = lib.pagoda_small_rows_bf16dp(
            x.data_ptr(),
            rows,
            k,
            x.stride(0),
            w.data_ptr(),
            n,
            w.stride(0),
            out.data_ptr(),
            n,
            0,
            1 + rows % 2,
        )
        if not cpu_variant.bf16_dot:
            assert status == 2
            continue
        assert status == 0
        assert (out.double() - want).abs().max().item() < 2e-6 * k**0.5 * want.abs().max().item()
        outb = torch.empty(rows, n, dtype=torch.bfloat16)
        assert lib.pagoda_small_rows_bf16dp(
            x.data_ptr(), rows, k, x.stride(0), w.data_ptr(), n, w.stride(0), outb.data_ptr(), n, 1, 2
        ) == 0  # fmt: skip
        assert torch.equal(outb, out.to(torch.bfloat16))  # rounded once from the same float32 sums
        y = cpu_linear.small_rows(x, w)
        assert y is not None and y.dtype == torch.bfloat16 and torch.equal(y, outb)
    x65 = torch.randn(65, k).to(torch.bfloat16)
    out = torch.empty(65, n)
    assert lib.pagoda_small_rows_bf16dp(
        x65.data_ptr(), 65, k, k, w.data_ptr(), n, w.stride(0), out.data_ptr(), n, 0, 1
    ) in (1, 2)
    assert cpu_variant.bf16_dot == (cpu_variant.variant == "avx512" and "avx512_bf16" in loader.cpu_flags())


def test_kernels_info_prints_the_host_and_its_table(capsys):
    """`pagoda kernels info` before and after a shape was met: the CPU, the library, and the choices per row count."""
    from pagoda.engine.cli import kernels

    assert kernels.main(["info"]) == 0
    before = capsys.readouterr().out
    assert "no linear measured on this host yet" in before and "PAGODA_CPU_LINEAR: auto" in before
    w = torch.randn(24, 40)
    cpu_linear.linear(torch.randn(3, 40), w, None, cpu_linear.PackedWeight())
    assert kernels.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    key = Shape("f32", 24, 40, torch.get_num_threads()).key()
    assert set(data["linears"][key]) == {str(r) for r in ROW_BUCKETS}
    assert data["cpu"] == cpu_linear_choice.cpu_model() and data["setting"] == "auto"
    assert kernels.main(["info"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if key in ln)
    assert all(f"{r}: {data['linears'][key][str(r)]['choice']} " in line for r in ROW_BUCKETS)


def test_the_benchmark_runs_in_its_smoke_mode(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cpu_linear.py"
    spec = importlib.util.spec_from_file_location("bench_cpu_linear", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--tiny", "--threads", "1", "--out", str(tmp_path / "out.json")]) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert len(out["rows"]) == 2 * 5 * 2  # dtypes x linears x row counts
    assert all(r["onednn_min_us"] > 0 and r.get("ours_min_us", 1) > 0 for r in out["rows"])
    assert "| float32 | 1 | 16 |" in capsys.readouterr().out


def test_cold_timing_cycles_copies_past_the_last_level_cache(tmp_path):
    for index, (level, size) in enumerate([(1, "32K"), (2, "1024K"), (3, "32768K")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "level").write_text(f"{level}\n")
        (tmp_path / f"index{index}" / "size").write_text(f"{size}\n")
    assert cpu_linear_choice.last_level_cache_bytes(str(tmp_path)) == 32 << 20
    assert cpu_linear_choice.last_level_cache_bytes(str(tmp_path / "none")) == 32 << 20  # unreadable: a guess
    llc = cpu_linear_choice.last_level_cache_bytes()
    assert cpu_linear_choice.cold_copies(2 * llc) == 1  # a weight past the cache needs no copy
    assert cpu_linear_choice.cold_copies(llc // 2) == 4
    assert cpu_linear_choice.cold_copies(1) == 64  # at most 64
