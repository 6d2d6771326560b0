"""CPU rows of `make bench-kernels`: the C kernels of the CPU path, timed on every variant this CPU runs.

    python benchmarks/bench_kernels.py --cpu [--quick] [--compare OLD_LIB_DIR | --compare-rev REV]
    python benchmarks/bench_kernels_cpu.py ...      # the same; bench_kernels.py comes here without a GPU

Each kernel runs through the engine's own wrapper (cpu_decode.paged_decode, cpu_prefill.paged_prefill,
cpu_sampling.greedy, cpu_ops.add_rms_norm / silu_mul / rotary_, cpu_linear.small_rows) with the variant
installed as the process's library (`loader.using`), on the default model's shapes (SmolLM2-135M: 9 query
and 3 KV heads of 64, hidden 576, intermediate 1536, vocabulary 49,152):

- paged decode: 16 sequences x 1,000 tokens, block 16, blocks in random order; float32, bfloat16 and INT8
  caches. GB/s = the cache bytes read (K and V, plus INT8's scales) + q + out, over the time.
- paged prefill: one causal chunk of 512 and 1,024 tokens over a float32 cache (AVX2 and AVX-512 variants:
  the baseline has no prefill kernel). GFLOP/s = 4 * n^2 / 2 * heads * head dim (causal half).
- greedy with logprob: 32 rows of 49,152 float32 logits (GB/s of the logits).
- add + RMSNorm (64 x 576, with the residual), silu * mul (64 x 2 * 1,536), rotary (64 rows of the fused
  qkv, 12 rotated heads of 64): GB/s of what each reads and writes.
- small-rows product: 1, 4, 16 and 32 float32 rows through a [576, 1,536] float32 weight (GB/s of the weight;
  GFLOP/s in the JSON). Where the variant leaves such products to oneDNN (`CpuKernels.small_rows` false: the
  engine would not call it there) the library's function is called directly, and the row says so.

Timing: per kernel, variant and thread count (one thread, and all of torch's threads), warm-up calls, then
the best of N repeats, each repeat timing enough back-to-back calls to last a few milliseconds (the
wrapper's Python and ctypes cost is part of it, as in the engine). Inputs stay the same between calls, so
the caches are warm: on a small working set GB/s can exceed the memory's bandwidth.

``--compare OLD_LIB_DIR``: a second build of the libraries (``python kernels/cpu/build.py DIR`` run on another
commit's sources) timed in the same run, repeats interleaved with the current build's (alternating which goes
first), with new/old time ratios (< 1: the current build is faster). ``--compare-rev REV`` builds REV's
kernels/cpu sources with REV's build.py into a temporary folder first (about a minute on two cores).

Writes bench-results/kernels-cpu.json (``--out`` elsewhere). ``--quick``: fewer repeats, well under a minute.
``--tiny``: toy shapes, one repeat (the test's smoke mode).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench-results"
# SmolLM2-135M (the default model)
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB, BLOCK = 9, 3, 64, 576, 1536, 49152, 16
KERNEL_SOURCES = ("build.py", "pagoda_cpu.h", "paged_decode.c", "paged_prefill.c", "layer_ops.c", "greedy.c",
                  "lora.c", "small_rows.c", "info.c")  # fmt: skip


@dataclass
class Case:
    kernel: str
    shape: str
    make: Callable[[], Callable[[], object]]  # builds the inputs once, returns the call to time
    nbytes: float = 0.0  # bytes moved per call (GB/s), or
    flops: float = 0.0  # floating-point operations per call (GFLOP/s)
    needs_prefill: bool = False
    small_rows: bool = False


@dataclass(frozen=True)
class Sizes:
    decode: tuple[int, int]  # sequences, tokens each
    prefill: tuple[int, ...]
    greedy: tuple[int, int]  # rows, vocabulary
    rows: int  # rows of the element-wise ops
    small_rows: tuple[int, ...]
    weight: tuple[int, int]  # out, in features
    hidden: int
    inter: int


FULL = Sizes((16, 1000), (512, 1024), (32, VOCAB), 64, (1, 4, 16, 32), (HIDDEN, INTER), HIDDEN, INTER)
TINY = Sizes((2, 40), (32,), (2, 1000), 4, (1, 4), (64, 96), 64, 96)


def decode_case(sizes: Sizes, kv_dtype: str) -> Case:
    from pagoda.engine.attention import cpu_decode

    seqs, tokens = sizes.decode
    per_seq = -(-tokens // BLOCK)
    elt = {"float32": 4, "bfloat16": 2, "int8": 1}[kv_dtype]
    nbytes = 2 * seqs * tokens * KV_HEADS * HEAD_DIM * elt + 2 * seqs * HEADS * HEAD_DIM * 4
    if kv_dtype == "int8":
        nbytes += 2 * seqs * tokens * KV_HEADS * 4

    def make():
        gen = torch.Generator().manual_seed(0)
        shape = (2, seqs * per_seq, BLOCK, KV_HEADS, HEAD_DIM)
        scales = None
        if kv_dtype == "int8":
            kv = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
            scales = torch.rand(shape[:4], generator=gen) * 0.02 + 0.001
        else:
            kv = torch.randn(shape, generator=gen).to(getattr(torch, kv_dtype))
        tables = (
            torch.randperm(seqs * per_seq, generator=gen).to(torch.int32).view(seqs, per_seq).contiguous()
        )
        lens = torch.full((seqs,), tokens, dtype=torch.int32)
        q = torch.randn((seqs, HEADS, HEAD_DIM), generator=gen)
        out = torch.empty_like(q)
        assert cpu_decode.supports(q, kv, scales)
        scale = HEAD_DIM**-0.5
        return lambda: cpu_decode.paged_decode(q, kv, tables, lens, out, scale, scales=scales)

    return Case("paged decode", f"{kv_dtype} {seqs}x{tokens}", make, nbytes=nbytes)


def prefill_case(tokens: int) -> Case:
    from pagoda.engine.attention import cpu_prefill

    def make():
        gen = torch.Generator().manual_seed(tokens)
        nb = -(-tokens // BLOCK)
        kv = torch.randn((2, nb, BLOCK, KV_HEADS, HEAD_DIM), generator=gen)
        tables = torch.randperm(nb, generator=gen).to(torch.int32)[None].contiguous()
        q = torch.randn((tokens, HEADS, HEAD_DIM), generator=gen)
        out = torch.empty_like(q)
        chunks = cpu_prefill.PrefillChunks([0], [0], [tokens], [0])
        scale = HEAD_DIM**-0.5
        return lambda: cpu_prefill.paged_prefill(q, kv, tables, chunks, out, scale)

    flops = 4 * tokens * tokens / 2 * HEADS * HEAD_DIM
    return Case("paged prefill", f"float32 {tokens} tokens", make, flops=flops, needs_prefill=True)


def greedy_case(sizes: Sizes) -> Case:
    from pagoda.engine.worker import cpu_sampling

    rows, vocab = sizes.greedy

    def make():
        logits = torch.randn((rows, vocab), generator=torch.Generator().manual_seed(1))
        want = [True] * rows
        return lambda: cpu_sampling.greedy(logits, want)

    return Case("greedy + logprob", f"{rows}x{vocab}", make, nbytes=rows * vocab * 4)


def layer_cases(sizes: Sizes) -> list[Case]:
    from pagoda.engine.models import cpu_ops

    t, hidden, inter = sizes.rows, sizes.hidden, sizes.inter
    rope_heads, qkv_width = HEADS + KV_HEADS, (HEADS + 2 * KV_HEADS) * HEAD_DIM

    def norm():
        gen = torch.Generator().manual_seed(2)
        x, res, w = (
            torch.randn((t, hidden), generator=gen),
            torch.randn((t, hidden), generator=gen),
            torch.rand(hidden),
        )
        return lambda: cpu_ops.add_rms_norm(x, res, w, 1e-5)

    def silu():
        gate_up = torch.randn((t, 2 * inter), generator=torch.Generator().manual_seed(3))
        return lambda: cpu_ops.silu_mul(gate_up)

    def rotary():
        gen = torch.Generator().manual_seed(4)
        qkv = torch.randn((t, qkv_width), generator=gen)
        angle = torch.rand((t, HEAD_DIM), generator=gen) * 6.28
        cos, sin = angle.cos(), angle.sin()

        def call():
            assert cpu_ops.rotary_(qkv, rope_heads, HEAD_DIM, cos, sin)

        return call

    return [
        Case("add + RMSNorm", f"{t}x{hidden}", norm, nbytes=4 * t * hidden * 4),  # x, residual in; both out
        Case("silu * mul", f"{t}x2*{inter}", silu, nbytes=3 * t * inter * 4),
        Case("rotary", f"{t}x{rope_heads}x{HEAD_DIM}", rotary, nbytes=(2 * t * rope_heads + 2 * t) * HEAD_DIM * 4),
    ]  # fmt: skip


def small_rows_case(rows: int, weight_shape: tuple[int, int]) -> Case:
    from pagoda.engine.models import cpu_linear
    from pagoda.kernels.cpu import loader

    n, k = weight_shape

    def make():
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn((rows, k), generator=gen)
        w = torch.randn((n, k), generator=gen) * 0.05

        def call():
            if cpu_linear.small_rows(x, w) is not None:
                return
            # the variant leaves such products to oneDNN: the library's function itself, as the wrapper calls it
            y = torch.empty(rows, n)
            status = loader.current().lib.pagoda_small_rows_f32(
                x.data_ptr(), rows, k, x.stride(0), w.data_ptr(), n, w.stride(0), y.data_ptr(), y.stride(0),
                torch.get_num_threads(),
            )  # fmt: skip
            assert status == 0, status

        return call

    return Case("small-rows product", f"{rows} rows x [{n}, {k}] float32", make, nbytes=n * k * 4,
                flops=2 * rows * n * k, small_rows=True)  # fmt: skip


def cases(sizes: Sizes) -> list[Case]:
    return [
        *(decode_case(sizes, d) for d in ("float32", "bfloat16", "int8")),
        *(prefill_case(n) for n in sizes.prefill),
        greedy_case(sizes),
        *layer_cases(sizes),
        *(small_rows_case(r, sizes.weight) for r in sizes.small_rows),
    ]


def _per_call(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def time_interleaved(fn, libs: list, warmup: int, repeats: int, min_repeat_s: float) -> list[float]:
    """Best seconds per call of ``fn`` under each library in ``libs``, repeats interleaved (the order of the
    libraries alternating from one repeat to the next)."""
    from pagoda.kernels.cpu import loader

    once = math.inf
    for lib in libs:
        with loader.using(lib):
            for _ in range(warmup):
                fn()
            once = min(once, _per_call(fn, 1))
    calls = max(1, math.ceil(min_repeat_s / max(once, 1e-7)))
    best = [math.inf] * len(libs)
    for r in range(repeats):
        order = list(range(len(libs)))
        if r % 2:
            order.reverse()
        for i in order:
            with loader.using(libs[i]):
                best[i] = min(best[i], _per_call(fn, calls))
    return best


def build_rev(rev: str) -> Path:
    """REV's kernels/cpu sources built by REV's build.py into a temporary folder; returns the library folder."""
    src = Path(tempfile.mkdtemp(prefix=f"pagoda-kernels-{rev}-"))
    for name in KERNEL_SOURCES:
        text = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:kernels/cpu/{name}"], check=True,
                              capture_output=True).stdout  # fmt: skip
        (src / name).write_bytes(text)
    print(f"building {rev}'s CPU kernels in {src / 'lib'} ...", flush=True)
    subprocess.run([sys.executable, str(src / "build.py"), str(src / "lib")], check=True, cwd=src)
    return src / "lib"


def load_variants(names: list[str] | None, compare: Path | None) -> tuple[list[tuple], list[str]]:
    """(variant name, current kernels, old kernels or None) for each variant asked for that this CPU runs, and
    notes on those left out."""
    from pagoda.kernels.cpu import loader

    notes, out = [], []
    for v in loader.runnable():
        if names and v.name not in names:
            continue
        new = loader.load(v.name)
        if new.lib is None:
            notes.append(f"{v.name}: not loaded ({new.reason})")
            continue
        old = None
        if compare is not None:
            old = loader._load_from(compare, v, "compare", (os.getuid(), 0))
            if old.lib is None:
                notes.append(f"{v.name}: no old library in {compare} ({old.reason})")
                old = None
        out.append((v.name, new, old))
    skipped = sorted(set(names or []) - {v.name for v in loader.runnable()})
    notes += [f"{n}: this CPU cannot run it" for n in skipped]
    return out, notes


def _sources(lib_dir: Path | None) -> str | None:
    try:
        return json.loads((lib_dir / "build.json").read_text()).get("sources") if lib_dir else None
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 repeats of >= 10 ms (under a minute)")
    parser.add_argument("--tiny", action="store_true", help="toy shapes, one repeat (smoke test)")
    parser.add_argument("--compare", type=Path, metavar="OLD_LIB_DIR", help="a second build to time against")
    parser.add_argument("--compare-rev", metavar="REV", help="build REV's kernels/cpu sources and compare")
    parser.add_argument("--variants", help="comma-separated variant names (default: every one this CPU runs)")
    parser.add_argument("--threads", help="comma-separated thread counts (default: 1 and torch's threads)")
    parser.add_argument("--repeats", type=int, help="timed repeats per point (best is kept)")
    parser.add_argument("--out", type=Path, default=RESULTS / "kernels-cpu.json")
    parser.add_argument("--skip-e2e", action="store_true", help=argparse.SUPPRESS)  # bench_kernels' flag
    args = parser.parse_args(argv)

    from pagoda.kernels.cpu import build

    compare = args.compare
    if args.compare_rev:
        compare = build_rev(args.compare_rev)
    if compare is not None and not compare.is_dir():
        parser.error(f"--compare: {compare} is not a folder")
    sizes = TINY if args.tiny else FULL
    warmup, repeats, min_s = (1, 1, 0.0) if args.tiny else (1, 5, 0.01) if args.quick else (3, 10, 0.03)
    repeats = args.repeats or repeats
    all_threads = torch.get_num_threads()
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, all_threads})
    variants, notes = load_variants(args.variants.split(",") if args.variants else None, compare)
    if not variants:
        print("no CPU kernel variant loaded: " + "; ".join(notes))
        return 1
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())  # fmt: skip
    print(f"CPU kernels on {cpu}: variants {', '.join(v for v, _, _ in variants)}; threads {threads}; "
          f"torch {torch.__version__}" + (f"; against {compare}" if compare else ""))  # fmt: skip
    if compare is not None and _sources(compare) == build.source_digest():
        notes.append(f"{compare} was built from the current sources: the ratios show only noise")
    for note in notes:
        print(f"  note: {note}")

    rows, skipped = [], []
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    before = torch.get_num_threads()
    try:
        for case in cases(sizes):
            call = case.make()
            for name, new, old in variants:
                if case.needs_prefill and not new.prefill:
                    skipped.append(f"{case.kernel} {case.shape} on {name}: not in this variant")
                    continue
                with_old = old is not None and (old.prefill or not case.needs_prefill)
                for n in threads:
                    torch.set_num_threads(n)
                    libs = [new, old] if with_old else [new]
                    best = time_interleaved(call, libs, warmup, repeats, min_s)
                    row = dict(
                        kernel=case.kernel, shape=case.shape, variant=name, threads=n, ms=best[0] * 1e3
                    )
                    if case.nbytes:
                        row["GBps"] = case.nbytes / best[0] / 1e9
                    if case.flops:
                        row["GFLOPs"] = case.flops / best[0] / 1e9
                    if with_old:
                        row["old_ms"] = best[1] * 1e3
                        row["new_over_old"] = best[0] / best[1]
                    if case.small_rows and not new.small_rows:
                        row["note"] = "engine uses oneDNN here"
                    rows.append(row)
                    print("  " + _line(row), flush=True)
    finally:
        torch.set_num_threads(before)
    elapsed = time.perf_counter() - started
    load = [load_before, os.getloadavg()[0]]
    _table(rows)
    print(f"1-minute load average {load[0]:.1f} before, {load[1]:.1f} after ({os.cpu_count()} CPUs): other work "
          "on the machine skews every number, and a multi-thread row most (its OpenMP team waits on any thread "
          "that is descheduled)")  # fmt: skip
    for s in skipped:
        print(f"  skipped: {s}")
    report = dict(
        benchmark="kernels-cpu", date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), host=platform.node(),
        cpu=cpu, torch=torch.__version__, mode="tiny" if args.tiny else "quick" if args.quick else "full",
        threads=threads, repeats=repeats, seconds=elapsed, load_average=load, sources=build.source_digest(),
        libraries={name: new.path for name, new, _ in variants},
        compare=None if compare is None else dict(dir=str(compare), rev=args.compare_rev, sources=_sources(compare),
                                                  libraries={n: o.path for n, _, o in variants if o}),
        notes=notes, skipped=skipped, rows=rows,
    )  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out} ({elapsed:.0f} s of timing)")
    return 0


def _rate(row: dict) -> str:
    if "GFLOPs" in row and "GBps" not in row:
        return f"{row['GFLOPs']:.1f} GFLOP/s"
    return f"{row['GBps']:.1f} GB/s" if "GBps" in row else ""


def _line(row: dict) -> str:
    text = f"{row['kernel']:<18} {row['shape']:<30} {row['variant']:<8} {row['threads']}t {row['ms']:9.3f} ms"
    text += f"  {_rate(row):>16}"
    if "old_ms" in row:
        text += f"  old {row['old_ms']:9.3f} ms  new/old {row['new_over_old']:.2f}"
    return text + (f"  ({row['note']})" if "note" in row else "")


def _table(rows: list[dict]) -> None:
    compare = any("old_ms" in r for r in rows)
    notes = any("note" in r for r in rows)
    head = ["kernel", "shape", "variant", "threads", "ms", "rate"]
    head += (["old ms", "new/old"] if compare else []) + (["note"] if notes else [])
    cells = [head]
    for r in rows:
        line = [r["kernel"], r["shape"], r["variant"], str(r["threads"]), f"{r['ms']:.3f}", _rate(r)]
        if compare:
            line += [f"{r['old_ms']:.3f}", f"{r['new_over_old']:.2f}"] if "old_ms" in r else ["", ""]
        cells.append(line + ([r.get("note", "")] if notes else []))
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    print()
    for i, c in enumerate(cells):
        print("| " + " | ".join(x.ljust(w) for x, w in zip(c, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


if __name__ == "__main__":
    sys.exit(main())
