"""Quantized linear kernels on a GPU: W4A16 and FP8 (both paths) against a bf16 matmul in the same run.

    python benchmarks/bench_quant_kernels.py [--quick] [--out bench-results/quant_kernels.json]
    python benchmarks/bench_quant_kernels.py --smoke     # tiny shapes under Triton's interpreter, no timing

Needs a CUDA GPU: the kernels' speed under the CPU interpreter means nothing, so without one the script says
so and exits 0 without writing (--smoke checks the script's code path and the kernels' values only).

Shapes: Llama-3.1-8B's linears as the engine fuses them (qkv 4096 -> 6144, o 4096 -> 4096, gate_up
4096 -> 28672, down 14336 -> 4096) at M = 1, 16, 128, 1024, 4096 rows (decode to prefill). Columns, each the
median of CUDA-event-timed calls after warm-up, rotating through enough weight copies that they exceed 3x L2:
`torch.nn.functional.linear` in bfloat16 (the dense baseline), `w4a16_linear` (group 128, asymmetric),
`fp8_linear` weight-only and, from compute capability 8.9, FP8 x FP8 with per-token activation scales (its
time includes the activation quantizer) and `torch._scaled_mm` with row-wise scales where torch has it (the
same product in cuBLAS). Per point: time, TFLOP/s, the weight bytes read per second (the format's bytes, scales
and zero points included), the speed-up over bf16, and the largest difference from the torch twin relative to
the output's largest value.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
ROWS = [1, 16, 128, 1024, 4096]
QUICK_ROWS = [1, 128, 4096]
SMOKE_SHAPES = [("tiny", 96, 80)]
SMOKE_ROWS = [1, 17]
GROUP = 128


def _time_ms(fn, inputs: list, warmup: int = 5, iters: int = 30) -> float:
    import torch

    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*inputs[i % len(inputs)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _copies(bytes_per_copy: int, device) -> int:
    import torch

    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(8, -(-3 * l2 // max(1, bytes_per_copy))))


def _weights(n: int, k: int, device, dtype):
    """Random weights in every format: bf16, canonical INT4 (group 128), FP8 per row."""
    import torch

    w = torch.randn(n, k, device=device) * 0.02
    groups = -(-k // GROUP)
    q = torch.randint(0, 16, (n, k), device=device, dtype=torch.uint8)
    qweight = q[:, 0::2] | (q[:, 1::2] << 4)
    scales = (torch.rand(n, groups, device=device) * 0.004 + 1e-4).to(dtype)
    zeros = torch.randint(0, 16, (n, groups), device=device, dtype=torch.uint8)
    w_scale = w.abs().amax(dim=1).clamp(min=1e-12) / 448.0
    w8 = (w / w_scale[:, None]).to(torch.float8_e4m3fn)
    return {"dense": w.to(dtype), "int4": (qweight, scales, zeros), "fp8": (w8, w_scale)}


def _rel(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6))


def _runs(x, dtype, fp8_dot: bool, scaled_mm: bool) -> dict:
    """label -> (the product on a weight set, its twin or None) for activations ``x``."""
    import torch
    from pagoda.kernels.quant_fp8 import fp8_linear
    from pagoda.kernels.quant_reference import fp8_reference, quantize_fp8_per_token, w4a16_reference
    from pagoda.kernels.quant_w4a16 import w4a16_linear

    runs = {
        "bf16": (lambda w: torch.nn.functional.linear(x, w["dense"]), None),
        "w4a16": (lambda w: w4a16_linear(x, *w["int4"], GROUP), lambda w: w4a16_reference(x, *w["int4"], GROUP)),
        "fp8_weight_only": (lambda w: fp8_linear(x, *w["fp8"], act_quant=False),
                            lambda w: fp8_reference(x, *w["fp8"], act_quant=False)),
    }  # fmt: skip
    if fp8_dot:
        runs["fp8"] = (lambda w: fp8_linear(x, *w["fp8"], act_quant=True),
                       lambda w: fp8_reference(x, *w["fp8"], act_quant=True))  # fmt: skip
    if scaled_mm:

        def cublas(w):
            xq, xs = quantize_fp8_per_token(x)
            w8, ws = w["fp8"]
            return torch._scaled_mm(xq, w8.T, scale_a=xs, scale_b=ws[None, :], out_dtype=dtype)

        runs["scaled_mm"] = (cublas, None)
    return runs


def run(shapes, rows, timed: bool) -> list[dict]:
    import torch
    from pagoda.kernels.quant_fp8 import fp8_act_quant

    device = torch.device("cuda" if timed else "cpu")
    dtype = torch.bfloat16 if timed else torch.float32
    fp8_dot = fp8_act_quant(device) if timed else True  # the interpreter runs both paths
    torch.manual_seed(0)
    scaled_mm = timed and fp8_dot and hasattr(torch, "_scaled_mm")
    points = []
    for name, k, n in shapes:
        weights = _weights(n, k, device, dtype)
        int4_bytes = n * ((k + 1) // 2) + n * (-(-k // GROUP)) * 3  # nibbles, 16-bit scales, uint8 zeros
        formats = {
            "bf16": 2 * n * k,
            "w4a16": int4_bytes,
            "fp8_weight_only": n * k + 4 * n,
            "fp8": n * k + 4 * n,
        }
        copies = (
            [weights] + [_weights(n, k, device, dtype) for _ in range(_copies(int4_bytes, device) - 1)]
            if timed
            else [weights]
        )
        for m in rows:
            x = torch.randn(m, k, device=device).to(dtype)
            runs = _runs(x, dtype, fp8_dot, scaled_mm)
            if scaled_mm:
                formats["scaled_mm"] = formats["fp8"]
            point = {"linear": name, "m": m, "n": n, "k": k}
            for label, (fn, twin) in runs.items():
                if twin is not None:
                    point[f"{label}_rel_err"] = _rel(fn(weights), twin(weights))
                if not timed:
                    continue
                try:
                    ms = _time_ms(lambda w, fn=fn: fn(w), [(c,) for c in copies])
                except RuntimeError as exc:  # e.g. _scaled_mm's row-wise scales on an older torch or GPU
                    point[f"{label}_error"] = str(exc)[:200]
                    continue
                point[f"{label}_us"] = ms * 1e3
                point[f"{label}_tflops"] = 2 * m * n * k / ms / 1e9
                point[f"{label}_weight_gbs"] = formats[label] / ms / 1e6
            if timed:
                for label in runs:
                    if label != "bf16" and f"{label}_us" in point:
                        point[f"{label}_speedup"] = point["bf16_us"] / point[f"{label}_us"]
            points.append(point)
            print(json.dumps(point), flush=True)
    return points


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"rows {QUICK_ROWS} only")
    p.add_argument("--smoke", action="store_true", help="tiny shapes under the interpreter, values only")
    p.add_argument("--out", default="bench-results/quant_kernels.json")
    args = p.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
        points = run(SMOKE_SHAPES, SMOKE_ROWS, timed=False)
        worst = max(v for pt in points for key, v in pt.items() if key.endswith("_rel_err"))
        print(f"smoke: {len(points)} points, largest relative difference from the twins {worst:.2e}")
        return 0 if worst < 1e-4 else 1
    import torch

    if not torch.cuda.is_available():
        print(
            "bench_quant_kernels: needs a CUDA GPU (the interpreter's timings mean nothing); nothing written"
        )
        return 0
    device = torch.cuda.get_device_name()
    cc = torch.cuda.get_device_capability()
    print(f"{device} (compute capability {cc[0]}.{cc[1]})")
    points = run(SHAPES, QUICK_ROWS if args.quick else ROWS, timed=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device, "compute_capability": list(cc), "points": points}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
