"""Mixture-of-experts layer benchmark: the fused experts against a per-expert loop and a dense MLP.

    python benchmarks/bench_moe.py [--tiny] [--threads N] [--out bench-results/moe.json]

For each shape (experts E, hidden H, expert intermediate I, top-k) and token count T, the median time of:
the experts as the engine runs them (`experts_cpu`: torch._grouped_mm on the CPU; the Triton grouped GEMM,
`kernels.fused_moe.fused_experts`, on a CUDA GPU), the per-expert Python loop transformers runs
(`experts_loop`), and a dense SwiGLU MLP of the same active size (intermediate k * I, what a token computes).
Routing is random (softmax of Gaussian logits), so experts receive uneven token counts. Each time is the best
of --repeats runs (wall clock; on a GPU after a synchronisation): the CPU hosts this runs on are shared, and
their medians wander by half.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from pagoda.engine.models.moe import experts_cpu, experts_loop, route

# (name, experts, hidden, expert intermediate, top-k): scaled-down Mixtral and Qwen3-30B-A3B layers
SHAPES = [("mixtral-like", 8, 1024, 3584, 2), ("qwen3-moe-like", 128, 1024, 384, 8)]
TOKENS = [1, 16, 128]
TINY_SHAPES = [("tiny", 8, 64, 32, 2)]
TINY_TOKENS = [1, 8]


def _time(fn, args: tuple, cuda: bool, repeats: int) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*args)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def dense_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def bench(shapes, tokens, device: torch.device, dtype: torch.dtype, repeats: int) -> list[dict]:
    cuda = device.type == "cuda"
    if cuda:
        from pagoda.kernels.fused_moe import fused_experts as fused
    else:
        fused = experts_cpu
    rows = []
    for name, experts, hidden, inter, top_k in shapes:
        g = torch.Generator().manual_seed(0)
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05).to(device, dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.05).to(device, dtype)
        dense_up = (torch.randn(2 * top_k * inter, hidden, generator=g) * 0.05).to(device, dtype)
        dense_down = (torch.randn(hidden, top_k * inter, generator=g) * 0.05).to(device, dtype)
        for t in tokens:
            x = torch.randn(t, hidden, generator=g).to(device, dtype)
            weights, ids = route(torch.randn(t, experts, generator=g).to(device), top_k, True)
            moe_args = (x, w13, w2, weights, ids)
            row = {
                "shape": name, "experts": experts, "hidden": hidden, "intermediate": inter, "top_k": top_k,
                "tokens": t,
                "fused_ms": _time(fused, moe_args, cuda, repeats),
                "loop_ms": _time(experts_loop, moe_args, cuda, repeats),
                "dense_active_ms": _time(dense_mlp, (x, dense_up, dense_down), cuda, repeats),
            }  # fmt: skip
            row["loop_over_fused"] = row["loop_ms"] / row["fused_ms"]
            rows.append(row)
            print(f"| {name} | {t} | {row['fused_ms']:.3f} | {row['loop_ms']:.3f} | {row['dense_active_ms']:.3f} "
                  f"| {row['loop_over_fused']:.2f} |")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="one tiny shape (smoke run)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench-results/moe.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    print(f"{torch.cuda.get_device_name() if cuda else 'CPU'}, {dtype}, {torch.get_num_threads()} threads")
    print("| shape | tokens | fused ms | per-expert loop ms | dense (active size) ms | loop / fused |")
    print("|---|---|---|---|---|---|")
    shapes, tokens = (TINY_SHAPES, TINY_TOKENS) if args.tiny else (SHAPES, TOKENS)
    rows = bench(shapes, tokens, device, dtype, 3 if args.tiny else args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": "cuda" if cuda else "cpu", "dtype": str(dtype), "threads": torch.get_num_threads(),
              "mode": "tiny" if args.tiny else "full", "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
