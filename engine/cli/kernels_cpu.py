"""`pagoda kernels info`: the CPU path's kernels on this host, and which product each linear of 1-64 rows takes.

    pagoda kernels info [--measure] [--model M] [--dtype float32|bfloat16|both] [--json]

Prints the CPU (model, vector extensions), the kernel library the engine loads (variant, what it carries),
``PAGODA_CPU_LINEAR``, and the host's measured choices (engine/models/cpu_linear_choice.py): per weight shape,
operand kind and thread count, for each measured row count the choice and both products' microseconds per call.
The engine measures a shape when it first meets it; ``--measure`` measures a model's linear shapes now (the
default model's unless --model names one), through the engine's own `cpu_linear.linear`, into the same file.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

# the vector extensions a note about CPU kernel timings names
_EXTENSIONS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The `info` subcommand of `pagoda kernels`."""
    p = sub.add_parser(
        "info",
        help="the CPU kernels this host loads, and which product each small CPU linear takes (measured)",
        description=__doc__.split("\n\n")[2],
    )
    p.add_argument("--measure", action="store_true", help="measure a model's linear shapes now")
    p.add_argument("--model", help="with --measure: a model `pagoda plan` takes (default: the default model)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both", help="with --measure")
    p.add_argument("--json", action="store_true", help="print JSON")


def linear_shapes(model: str | None) -> list[tuple[int, int]]:
    """[n, k] of a model's linears as the engine runs them at tensor-parallel size 1: fused qkv, o, fused
    gate-up, down, lm_head. ``model``: what `pagoda plan` takes (a path, an embedded or well-known model), None
    or "default" for the default model."""
    from pagoda.engine.cli.plan import resolve_shape

    s = resolve_shape(None if model in (None, "default") else model)
    hd, hidden = s.head_dim, s.hidden_size
    inter = s.moe_intermediate_size if s.num_experts and not s.intermediate_size else s.intermediate_size
    shapes = [
        ((s.num_attention_heads + 2 * s.num_kv_heads) * hd, hidden),
        (hidden, s.num_attention_heads * hd),
        (2 * inter, hidden),
        (hidden, inter),
        (s.vocab_size, hidden),
    ]
    return list(dict.fromkeys(shapes))


def measure(shapes: list[tuple[int, int]], dtypes: list[str]) -> None:
    """Meet each shape at every measured row count through `cpu_linear.linear` (which measures on a miss)."""
    import torch
    from pagoda.engine.models import cpu_linear, cpu_linear_choice

    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for n, k in shapes:
            weight = torch.randn(n, k).to(dtype)
            packed = cpu_linear.PackedWeight()
            with torch.no_grad():
                for rows in cpu_linear_choice.ROW_BUCKETS:
                    cpu_linear.linear(torch.randn(rows, k).to(dtype), weight, None, packed)


def report() -> dict:
    """What `info` prints, as data."""
    from pagoda.engine.models import cpu_linear_choice
    from pagoda.kernels.cpu import loader

    kernels = loader.current()
    flags = loader.cpu_flags()
    table = cpu_linear_choice.current_table()
    shapes = {**table.stored(), **table.shapes}
    return {
        "cpu": cpu_linear_choice.cpu_model(),
        "extensions": [e for e in _EXTENSIONS if e in flags],
        "kernels": kernels.describe(),
        "small_rows": kernels.small_rows,
        "bf16_dot": kernels.bf16_dot,
        "setting": cpu_linear_choice.setting(),
        "file": str(table.path),
        "host": table.identity,
        "linears": shapes,
    }


def print_report(data: dict, out: TextIO = sys.stdout) -> None:
    from pagoda.engine.models.cpu_linear_choice import ROW_BUCKETS

    print(f"CPU: {data['cpu']} ({' '.join(data['extensions']) or 'no AVX2'})", file=out)
    print(f"kernels: {data['kernels']}", file=out)
    print(
        f"small-rows product: {'vector' if data['small_rows'] else 'plain C'}; "
        f"AVX512-BF16 dot products: {'yes' if data['bf16_dot'] else 'no'}",
        file=out,
    )
    print(f"PAGODA_CPU_LINEAR: {data['setting']}; choices: {data['file']}", file=out)
    if not data["linears"]:
        print("no linear measured on this host yet (the engine measures each shape when it first meets it; "
              "--measure measures a model's now)", file=out)  # fmt: skip
        return
    print("linear (kind n x k threads): choice at rows " + ", ".join(map(str, ROW_BUCKETS))
          + "; microseconds per call ours/oneDNN", file=out)  # fmt: skip
    for key in sorted(data["linears"]):
        rows = data["linears"][key]
        cells = []
        for r in ROW_BUCKETS:
            cell = rows.get(str(r))
            if cell is None:
                cells.append(f"{r}: -")
                continue
            us = cell["us"]
            ours = f"{us['ours']:.0f}" if "ours" in us else "-"
            cells.append(f"{r}: {cell['choice']} {ours}/{us.get('onednn', float('nan')):.0f}")
        print(f"  {key:<24} " + "  ".join(cells), file=out)


def info(args: argparse.Namespace) -> int:
    if args.measure:
        dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
        measure(linear_shapes(args.model), dtypes)
    data = report()
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print_report(data)
    return 0
