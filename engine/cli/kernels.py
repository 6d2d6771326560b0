"""`pagoda kernels warm`: compile the Triton kernels for a GPU ahead of time, without one.

    pagoda kernels warm --gpu H100 [--gpu L4 ...] [--model M ...] [--dtype D] [--kv-cache-dtype K]
                        [--tensor-parallel-size N] [--block-size B] [--cache-dir DIR] [--jobs J] [--json]

For each GPU (a catalogue name, or `all`: every catalogue GPU the installed torch build can run) and
model (what `pagoda plan` takes; the catalogue's shapes need no weights), every kernel variant the engine
launches on every tensor-parallel rank is compiled for the GPU's architecture into the Triton cache the
engine reads (`TRITON_CACHE_DIR`, or --cache-dir), so a pod does not compile at start-up. Defaults follow
the planner's choices for that GPU (tensor-parallel size, KV dtype, block size); `--dtype auto` is the
engine's rule. Every variant's shared memory is checked against the GPU's limit per block.

Exit codes: 0 every variant compiled and fits; 1 a variant does not fit or does not compile (named);
2 bad flags, or a dtype the GPU cannot run (FP8 KV below compute capability 8.9: the same refusal as
`pagoda serve`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

from pagoda.engine.config import DTYPES, KV_CACHE_DTYPES
from pagoda.engine.sizing import (
    GPU_CATALOGUE,
    GPUInfo,
    GPUSpec,
    Hints,
    ModelShape,
    lookup_gpu,
    plan,
)
from pagoda.engine.sizing.engine_plan import (
    check_tensor_parallel,
    kv_heads_per_rank,
    resolve_dtype_name,
    shard_range,
)
from pagoda.engine.sizing.errors import UnsupportedOnGPU
from pagoda.engine.sizing.gpus import TORCH_WHEEL_ARCHS, check_dtypes, torch_supports
from pagoda.engine.sizing.kv_dtypes import kv_dtype_name

DEFAULT_MODEL = (
    "default"  # --model default: the embedded SmolLM2-135M-Instruct, as `pagoda serve` without one
)
MAX_GPUS = 64  # the planner's largest tensor-parallel size: let it choose the size a model needs


def torch_cuda_archs() -> tuple[tuple[int, int], ...]:
    """The CUDA architectures the installed torch lists; the engine image's where it lists none (a CPU
    build, as on the test machines)."""
    import torch

    listed = [a.removeprefix("sm_") for a in torch.cuda.get_arch_list() if a.startswith("sm_")]
    archs = tuple((int(a[:-1]), int(a[-1])) for a in listed if a.isdigit())
    return archs or TORCH_WHEEL_ARCHS


@dataclass(frozen=True)
class Unit:
    """One model on one GPU architecture: the attention shapes of its ranks (GPUs sharing limits share it)."""

    gpus: tuple[str, ...]
    compute_capability: tuple[int, int]
    shared_memory_per_block: int
    model: str
    dtype: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    block_size: int
    ranks: tuple[tuple[int, int], ...]  # (query heads, KV heads) per rank
    head_dim: int
    sliding_window: int | None


@dataclass
class Row:
    gpus: list[str]
    compute_capability: str
    model: str
    dtype: str
    kv_cache_dtype: str
    variant: str
    shared_memory: int
    shared_memory_bound: int
    shared_memory_per_block: int
    fits: bool


@dataclass
class Result:
    rows: list[Row] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagoda kernels", description="Triton kernels of the GPU engine.")
    sub = p.add_subparsers(dest="action", required=True)
    w = sub.add_parser(
        "warm",
        help="compile every kernel variant for a model on a GPU, ahead of time (no GPU needed)",
        description=__doc__.split("\n\n")[2],
    )
    w.add_argument(
        "--gpu",
        action="append",
        required=True,
        help="a catalogue GPU (H100, L4, A100-80GB, ...; repeatable) or 'all' (every catalogue GPU the "
        "installed torch build supports)",
    )
    w.add_argument(
        "--model",
        action="append",
        help="model directory, GGUF file, well-known id such as meta-llama/Llama-3.1-8B-Instruct, or "
        "'default' (the embedded SmolLM2-135M-Instruct, also when no --model is given); repeatable",
    )
    w.add_argument("--dtype", default="auto", choices=DTYPES, help="as `pagoda serve --dtype`")
    w.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="default: the planner's for the GPU")
    w.add_argument("--tensor-parallel-size", type=int, help="default: the planner's for the model and GPU")
    w.add_argument("--block-size", type=int, help="default: the planner's (16)")
    w.add_argument("--cache-dir", help="Triton cache to fill (default: $TRITON_CACHE_DIR, else Triton's)")
    w.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes")
    w.add_argument("--json", action="store_true", help="print the variants as JSON")
    return p


def _gpus(names: list[str], archs: tuple[tuple[int, int], ...], result: Result) -> list[GPUSpec]:
    """The GPUs asked for; with 'all' the catalogue's, those the torch build cannot run skipped (said)."""
    specs: list[GPUSpec] = []
    for name in names:
        if name.lower() == "all":
            for spec in GPU_CATALOGUE:
                if torch_supports(spec.compute_capability, archs):
                    specs.append(spec)
                else:
                    result.skipped.append(f"{spec.name}: {_unsupported(spec)}")
            continue
        spec = lookup_gpu(name)
        if not torch_supports(spec.compute_capability, archs):
            raise UnsupportedOnGPU(f"{spec.name}: {_unsupported(spec)}")
        specs.append(spec)
    return list(dict.fromkeys(specs))


def _unsupported(spec: GPUSpec) -> str:
    major, minor = spec.compute_capability
    return f"compute capability {major}.{minor} is not among the installed torch build's CUDA architectures"


def plan_unit(spec: GPUSpec, model: str, shape: ModelShape, args: argparse.Namespace) -> Unit:
    """What the engine would run for `shape` on `spec` by default (the planner's choices) or as flagged."""
    cc = spec.compute_capability
    chosen = plan(shape, GPUInfo.from_spec(spec, MAX_GPUS), Hints())
    tp = args.tensor_parallel_size or chosen.tensor_parallel_size
    check_tensor_parallel(shape.num_attention_heads, tp)
    dtype = resolve_dtype_name(args.dtype, "cuda", shape.dtype, cc)
    kv = args.kv_cache_dtype or chosen.kv_cache_dtype
    check_dtypes(spec.name, cc, dtype, kv)
    ranks = []
    for rank in range(tp):
        lo, hi = shard_range(shape.num_attention_heads, rank, tp)
        ranks.append((hi - lo, kv_heads_per_rank(shape.num_attention_heads, shape.num_kv_heads, tp, rank)))
    return Unit(
        (spec.name,), cc, spec.shared_memory_per_block, model, dtype, kv_dtype_name(kv, dtype), tp,
        args.block_size or chosen.block_size, tuple(dict.fromkeys(ranks)), shape.head_dim, shape.sliding_window,
    )  # fmt: skip


def _merge(units: list[Unit]) -> list[Unit]:
    """GPUs with the same architecture and limit compile the same variants: one unit for all of them."""
    merged: dict[tuple, Unit] = {}
    for u in units:
        key = tuple(v for k, v in asdict(u).items() if k != "gpus")
        seen = merged.get(key)
        merged[key] = u if seen is None else Unit(**{**asdict(seen), "gpus": seen.gpus + u.gpus})
    return list(merged.values())


def compile_unit(unit: Unit, cache_dir: str | None) -> list[Row]:
    """Compile one unit's variants (in a worker process: Triton reads the cache directory from the
    environment) and check each against the GPU's shared memory."""
    if cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    from pagoda.kernels.launch_config import DeviceLimits
    from pagoda.kernels.warm import AttentionShape, compile_shapes

    limits = DeviceLimits(unit.compute_capability, unit.shared_memory_per_block)
    # a model with a sliding window may also have full-attention layers (Qwen2's max_window_layers)
    windows = (unit.sliding_window, None) if unit.sliding_window else (None,)
    shapes = [
        AttentionShape(heads, kv_heads, unit.head_dim, unit.block_size, getattr(torch, unit.dtype),
                       getattr(torch, unit.kv_cache_dtype), window)
        for heads, kv_heads in unit.ranks
        for window in windows
    ]  # fmt: skip
    with contextlib.redirect_stdout(sys.stderr):  # Triton prints ptxas' complaints; stdout carries --json
        compilation = compile_shapes(limits, shapes)
    cc = f"{unit.compute_capability[0]}.{unit.compute_capability[1]}"
    return [
        Row(list(unit.gpus), cc, unit.model, unit.dtype, unit.kv_cache_dtype, v.label, v.shared_memory,
            v.shared_memory_bound, unit.shared_memory_per_block, v.shared_memory <= unit.shared_memory_per_block)
        for v in compilation.variants
    ]  # fmt: skip


def warm(args: argparse.Namespace) -> Result:
    from pagoda.engine.cli.plan import resolve_shape

    start = time.monotonic()
    result = Result()
    specs = _gpus(args.gpu, torch_cuda_archs(), result)
    units = []
    for model in args.model or [DEFAULT_MODEL]:
        shape = resolve_shape(None if model == DEFAULT_MODEL else model)
        name = f"{model} ({shape.name})" if model == DEFAULT_MODEL else model
        units += [plan_unit(spec, name, shape, args) for spec in specs]
    units = _merge(units)
    for unit, rows in _run(units, args):
        if isinstance(rows, str):
            result.errors.append(f"{', '.join(unit.gpus)} / {unit.model}: {rows}")
            continue
        result.rows += rows
        result.errors += [
            f"{', '.join(r.gpus)} / {r.model}: {r.variant} needs {r.shared_memory} B of shared memory per block, "
            f"the GPU allows {r.shared_memory_per_block}"
            for r in rows
            if not r.fits
        ]
    result.seconds = time.monotonic() - start
    return result


def _run(units: list[Unit], args: argparse.Namespace):
    """(unit, rows or the error) for every unit, compiled in up to --jobs processes, with a progress bar."""
    from tqdm.auto import tqdm

    jobs = max(1, min(args.jobs, len(units)))
    bar = tqdm(total=len(units), desc="Compiling kernels", unit="model x GPU", disable=args.json)
    if jobs == 1:
        for unit in units:
            yield unit, _safe(unit, args.cache_dir)
            bar.update()
        bar.close()
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(_safe, unit, args.cache_dir): unit for unit in units}
        for future in as_completed(futures):
            yield futures[future], future.result()
            bar.update()
    bar.close()


def _safe(unit: Unit, cache_dir: str | None) -> list[Row] | str:
    try:
        return compile_unit(unit, cache_dir)
    except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported, the rest go on
        return f"compilation failed: {type(exc).__name__}: {exc}"


def _print(result: Result, out=sys.stdout) -> None:
    width = max((len(r.variant) for r in result.rows), default=10)
    print(
        f"{'GPU':<28} {'CC':>4}  {'model':<36} {'variant':<{width}} {'shared B':>9} {'limit B':>9}", file=out
    )
    for r in result.rows:
        gpus = ",".join(r.gpus)
        mark = "" if r.fits else "  DOES NOT FIT"
        print(f"{gpus[:28]:<28} {r.compute_capability:>4}  {r.model[:36]:<36} {r.variant:<{width}} "
              f"{r.shared_memory:>9} {r.shared_memory_per_block:>9}{mark}", file=out)  # fmt: skip
    for s in result.skipped:
        print(f"skipped {s}", file=out)
    print(f"{len(result.rows)} variants in {result.seconds:.1f} s", file=out)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        result = warm(args)
    except ValueError as exc:  # SizingError and UnsupportedOnGPU included: what the flags ask cannot run
        print(f"pagoda kernels warm: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(result)}, indent=2))
    else:
        _print(result)
    for error in result.errors:
        print(f"pagoda kernels warm: {error}", file=sys.stderr)
    return 1 if result.errors else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
