"""`pagoda kernels warm`: compile the Triton kernels for a GPU ahead of time, without one. (`pagoda kernels
info`, the CPU path's kernels on this host: engine/cli/kernels_cpu.py.)

    pagoda kernels warm --gpu H100 [--gpu L4 ...] [--model M ...] [--dtype D] [--kv-cache-dtype K]
                        [--tensor-parallel-size N] [--block-size B] [--max-lora-rank R] [--common]
                        [--cache-dir DIR] [--jobs J] [--json] [-- SERVE FLAGS]

For each GPU (a catalogue name, or `all`: every catalogue GPU the installed torch build can run) and
model (what `pagoda plan` takes, `default`, or `catalogue`: the default model and every well-known one;
their shapes need no weights), every kernel variant the engine launches on every tensor-parallel rank is
compiled for the GPU's architecture into the Triton cache the engine reads (`TRITON_CACHE_DIR`, or
--cache-dir), so a pod does not compile at start-up. Defaults follow the planner's choices for that GPU
(tensor-parallel size, KV dtype, block size); `--dtype auto` is the engine's rule; `--max-lora-rank R` adds
the LoRA kernels; a quantized checkpoint (FP8 or INT4, from its quantization_config) adds its linears'
W4A16 or FP8 kernels. `--common` warms what deployments most often run: the KV dtype `auto` (plain `pagoda
serve`) and the planner's, each without and (at tensor-parallel size 1) with LoRA at its default rank.
After `--`, the flags of a `pagoda serve` command (the operator passes its engine's own): the variants that
engine launches, read by serve's own parser, whatever the planner would choose. Every variant's shared
memory is checked against the GPU's limit per block. One function, `kernel_plan`, turns either into the
set of variants (pagoda.kernels.warm).

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
from typing import TYPE_CHECKING

from pagoda.engine.cli.plan import resolve_shape
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
from pagoda.engine.sizing.errors import SizingError, UnsupportedOnGPU
from pagoda.engine.sizing.gpus import TORCH_WHEEL_ARCHS, check_dtypes, torch_supports
from pagoda.engine.sizing.kv_dtypes import kv_dtype_name
from pagoda.engine.sizing.shapes import well_known_model_ids

if TYPE_CHECKING:
    from pagoda.kernels.warm import KernelPlan

DEFAULT_MODEL = (
    "default"  # --model default: the embedded SmolLM2-135M-Instruct, as `pagoda serve` without one
)
MAX_GPUS = 64  # the planner's largest tensor-parallel size: let it choose the size a model needs
COMMON_LORA_RANK = 16  # --common: `pagoda serve --enable-lora`'s default --max-lora-rank


def torch_cuda_archs() -> tuple[tuple[int, int], ...]:
    """The CUDA architectures the installed torch lists; the engine image's where it lists none (a CPU
    build, as on the test machines)."""
    import torch

    listed = [a.removeprefix("sm_") for a in torch.cuda.get_arch_list() if a.startswith("sm_")]
    archs = tuple((int(a[:-1]), int(a[-1])) for a in listed if a.isdigit())
    return archs or TORCH_WHEEL_ARCHS


@dataclass(frozen=True)
class Unit:
    """One model's kernel plan on one GPU architecture (GPUs sharing limits share it)."""

    gpus: tuple[str, ...]
    model: str
    tensor_parallel_size: int
    plan: KernelPlan

    @property
    def compute_capability(self) -> tuple[int, int]:
        return self.plan.compute_capability

    @property
    def dtype(self) -> str:
        return self.plan.dtype

    @property
    def kv_cache_dtype(self) -> str:
        return self.plan.kv_cache_dtype


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
    from pagoda.engine.cli import kernels_cpu

    p = argparse.ArgumentParser(
        prog="pagoda kernels", description="Triton kernels of the GPU engine; the CPU path's kernels (info)."
    )
    sub = p.add_subparsers(dest="action", required=True)
    kernels_cpu.add_parser(sub)
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
    w.add_argument(
        "--max-lora-rank", type=int, help="LoRA on, slots this wide: its kernels too (default: off)"
    )
    w.add_argument(
        "--common",
        action="store_true",
        help="KV dtype auto and the planner's, each without and (tensor-parallel size 1) with LoRA at rank 16",
    )
    w.add_argument("--cache-dir", help="Triton cache to fill (default: $TRITON_CACHE_DIR, else Triton's)")
    w.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes")
    w.add_argument("--json", action="store_true", help="print the variants as JSON")
    w.add_argument(
        "serve_argv",
        nargs=argparse.REMAINDER,
        metavar="-- SERVE FLAGS",
        help="a `pagoda serve` command's flags: warm exactly what that engine launches",
    )
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


def plan_unit(
    spec: GPUSpec,
    model: str,
    shape: ModelShape,
    args: argparse.Namespace,
    *,
    kv_cache_dtype: str | None = None,
    lora_rank: int | None = None,
) -> Unit:
    """What the engine would run for `shape` on `spec` by default (the planner's choices) or as flagged."""
    chosen = plan(shape, GPUInfo.from_spec(spec, MAX_GPUS), Hints())
    tp = args.tensor_parallel_size or chosen.tensor_parallel_size
    kv = kv_cache_dtype or args.kv_cache_dtype or chosen.kv_cache_dtype
    lora = lora_rank if lora_rank is not None else getattr(args, "max_lora_rank", None)
    return unit_for(spec, model, shape, dtype=args.dtype, kv_cache_dtype=kv, tensor_parallel_size=tp,
                    block_size=args.block_size or chosen.block_size, lora_rank=lora)  # fmt: skip


def unit_for(
    spec: GPUSpec,
    model: str,
    shape: ModelShape,
    *,
    dtype: str,
    kv_cache_dtype: str,
    tensor_parallel_size: int,
    block_size: int,
    lora_rank: int | None,
    attention: bool = True,
) -> Unit:
    """The kernel plan of an engine with these settings (as `pagoda serve` takes them: `auto` dtypes) on
    ``spec``, refusing what the GPU cannot run as serve does."""
    cc = spec.compute_capability
    resolved = resolve_dtype_name(dtype, "cuda", shape.dtype, cc, shape.float16)
    check_dtypes(spec.name, cc, resolved, kv_cache_dtype)
    if lora_rank and tensor_parallel_size > 1:
        raise ValueError("LoRA is not supported with tensor_parallel_size > 1 (as in pagoda serve)")
    kernel = kernel_plan(
        num_attention_heads=shape.num_attention_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        sliding_window=shape.sliding_window, compute_capability=cc,
        shared_memory_per_block=spec.shared_memory_per_block, dtype=resolved,
        kv_cache_dtype=kv_dtype_name(kv_cache_dtype, resolved), tensor_parallel_size=tensor_parallel_size,
        block_size=block_size, lora_rank=lora_rank or None, attention=attention,
        logit_softcap=shape.attn_logit_softcapping, quant_format=getattr(shape, "weight_format", ""),
    )  # fmt: skip
    kernel = _with_moe_and_sinks(kernel, shape, tensor_parallel_size)
    return Unit((spec.name,), model, tensor_parallel_size, kernel)


def _with_moe_and_sinks(kernel: KernelPlan, shape: ModelShape, tp: int) -> KernelPlan:
    """The plan with a model's experts (each rank's slice of an expert's intermediate size: the grouped-GEMM
    variants) and its family's attention sinks and biased experts (the architecture table's gpt-oss)."""
    from dataclasses import replace

    from pagoda.engine.sizing.architectures import architecture

    sinks = bool(shape.architecture) and architecture(shape.architecture).attention_sinks
    if not shape.num_experts:
        return replace(kernel, attention_sinks=sinks)
    lo, hi = shard_range(shape.moe_intermediate_size, 0, tp)
    return replace(
        kernel, attention_sinks=sinks, experts=shape.num_experts, moe_intermediate=hi - lo, expert_bias=sinks
    )


def kernel_plan(
    *,
    num_attention_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    intermediate_size: int,
    sliding_window: int | None,
    compute_capability: tuple[int, int],
    shared_memory_per_block: int,
    dtype: str,
    kv_cache_dtype: str,
    tensor_parallel_size: int,
    block_size: int,
    lora_rank: int | None,
    attention: bool = True,
    logit_softcap: float | None = None,
    quant_format: str = "",
) -> KernelPlan:
    """The kernel plan of an engine with these settings (dtypes resolved: torch names): its ranks' heads as
    the engine shards them; `logit_softcap` is the model's attention soft-cap (Gemma 2); `quant_format` the
    checkpoint's quantized linears ("int4" | "fp8": their GEMMs too; anything else, GGUF included, none on a
    GPU). Pure; `pagoda kernels warm` in every mode goes through it."""
    from pagoda.kernels.warm import KernelPlan

    tp = tensor_parallel_size
    check_tensor_parallel(num_attention_heads, tp)
    ranks = []
    for rank in range(tp):
        lo, hi = shard_range(num_attention_heads, rank, tp)
        ranks.append((hi - lo, kv_heads_per_rank(num_attention_heads, num_kv_heads, tp, rank)))
    return KernelPlan(
        tuple(compute_capability), shared_memory_per_block, tuple(dict.fromkeys(ranks)), head_dim, hidden_size,
        intermediate_size, block_size, dtype, kv_cache_dtype, sliding_window, lora_rank, attention,
        logit_softcap or None, quant_format if quant_format in ("int4", "fp8") else "",
    )  # fmt: skip


def serve_unit(spec: GPUSpec, serve_argv: list[str]) -> Unit:
    """The kernel plan of the engine `pagoda serve <serve_argv>` starts on ``spec``: its flags read by serve's
    own parser into EngineConfig's fields (the defaults serve has, not the planner's)."""
    from pagoda.engine.cli.serve_args import engine_config_kwargs, parse_args

    settings = engine_config_kwargs(parse_args(serve_argv, exit_on_error=False))
    model = settings.get("model")
    shape = model_shape(model, settings.get("revision"))
    return unit_for(
        spec, model or f"{DEFAULT_MODEL} ({shape.name})", shape, dtype=settings["dtype"],
        kv_cache_dtype=settings["kv_cache_dtype"], tensor_parallel_size=settings["tensor_parallel_size"],
        block_size=settings["block_size"],
        lora_rank=settings["max_lora_rank"] if settings["enable_lora"] else None,
        attention=settings["attention_backend"] != "torch",
    )  # fmt: skip


def model_shape(model: str | None, revision: str | None = None) -> ModelShape:
    """A model's shape as serve reads it: a local path, else its snapshot in the Hugging Face cache (HF_HOME:
    the model cache volume, read offline), else the well-known table."""
    from pathlib import Path

    from pagoda.engine.sizing.shapes import shape_from_path

    if model is None or model == DEFAULT_MODEL:
        return resolve_shape(None)
    if not Path(model).expanduser().exists() and model.count("/") == 1:
        # the engine's own reading of the cache (HF_HUB_CACHE / HF_HOME as set now, never a download); the
        # weights need not be there yet: config.json decides the shape
        from pagoda.engine.loader.resolve import hf_hub_cache

        repo_dir = hf_hub_cache() / ("models--" + model.replace("/", "--"))
        ref = repo_dir / "refs" / (revision or "main")
        snapshot = repo_dir / "snapshots" / (ref.read_text().strip() if ref.is_file() else (revision or ""))
        if (snapshot / "config.json").is_file():
            return shape_from_path(snapshot)
    return resolve_shape(model)


def units_of(args: argparse.Namespace, specs: list[GPUSpec], skipped: list[str] | None = None) -> list[Unit]:
    """Every unit the flags ask for (before GPUs sharing an architecture are merged). With `--model catalogue`,
    a catalogue model the planner cannot fit on any number of a GPU is skipped (said in ``skipped``)."""
    if args.serve_argv:
        argv = args.serve_argv[1:] if args.serve_argv[0] == "--" else args.serve_argv
        return [serve_unit(spec, argv) for spec in specs]
    models = args.model or [DEFAULT_MODEL]
    catalogue = [DEFAULT_MODEL, *well_known_model_ids()] if "catalogue" in models else []
    models = [m for m in models if m != "catalogue"] + catalogue
    units = []
    for model in dict.fromkeys(models):
        shape = resolve_shape(None if model == DEFAULT_MODEL else model)
        name = f"{model} ({shape.name})" if model == DEFAULT_MODEL else model
        for spec in specs:
            try:
                planned = plan_unit(spec, name, shape, args)
            except SizingError as exc:
                if model not in catalogue or skipped is None:
                    raise
                skipped.append(f"{spec.name} / {name}: {exc}")
                continue
            units.append(planned)
            if not args.common:
                continue
            planner_kv = plan(shape, GPUInfo.from_spec(spec, MAX_GPUS), Hints()).kv_cache_dtype
            for kv in dict.fromkeys(("auto", args.kv_cache_dtype or planner_kv)):
                units.append(plan_unit(spec, name, shape, args, kv_cache_dtype=kv))
                if planned.tensor_parallel_size == 1 and not shape.num_experts:  # LoRA refuses MoE models
                    units.append(
                        plan_unit(spec, name, shape, args, kv_cache_dtype=kv, lora_rank=COMMON_LORA_RANK)
                    )
    return units


def _merge(units: list[Unit]) -> list[Unit]:
    """GPUs with the same architecture and limit compile the same variants: one unit for all of them."""
    merged: dict[tuple, Unit] = {}
    for u in units:
        key = (u.model, u.tensor_parallel_size, u.plan)
        seen = merged.get(key)
        gpus = u.gpus if seen is None else seen.gpus + tuple(g for g in u.gpus if g not in seen.gpus)
        merged[key] = Unit(gpus, u.model, u.tensor_parallel_size, u.plan)
    return list(merged.values())


def compile_unit(unit: Unit, cache_dir: str | None) -> list[Row]:
    """Compile one unit's variants (in a worker process: Triton reads the cache directory from the
    environment) and check each against the GPU's shared memory."""
    if cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ.pop("TRITON_INTERPRET", None)
    from pagoda.kernels.warm import compile_plan

    with contextlib.redirect_stdout(sys.stderr):  # Triton prints ptxas' complaints; stdout carries --json
        compilation = compile_plan(unit.plan)
    cc = f"{unit.compute_capability[0]}.{unit.compute_capability[1]}"
    limit = unit.plan.shared_memory_per_block
    return [
        Row(list(unit.gpus), cc, unit.model, unit.dtype, unit.kv_cache_dtype, v.label, v.shared_memory,
            v.shared_memory_bound, limit, v.shared_memory <= limit)
        for v in compilation.variants
    ]  # fmt: skip


def warm(args: argparse.Namespace) -> Result:
    start = time.monotonic()
    result = Result()
    specs = _gpus(args.gpu, torch_cuda_archs(), result)
    units = _merge(units_of(args, specs, result.skipped))
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
    if args.action == "info":
        from pagoda.engine.cli import kernels_cpu

        return kernels_cpu.info(args)
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
