"""Tensor parallelism: decode throughput with TP=1 vs TP=2 on a model that fits both.

On GPUs (the point of it) each rank gets its own GPU and NCCL all-reduces; on CPU the two gloo ranks share
the cores, so TP=2 shows the collectives' overhead rather than a speed-up. Same greedy workload for both
sizes, one engine at a time; the first request's tokens must agree.

    make bench-tp                                     # default model, the device torch finds
    python benchmarks/bench_tp.py --model /models/llama-3.1-8b --device cuda --batch 32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import plot_path, print_table, write_json  # noqa: E402
from decode_run import timed_decode  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402


def run(args: argparse.Namespace, tp: int) -> dict:
    engine, numbers = timed_decode(args, f"tp{tp}", tensor_parallel_size=tp)
    engine.close()
    return {"tp": tp, **numbers}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    ap.add_argument("--sizes", default="1,2")
    args = ap.parse_args()
    if args.kv_cache_memory_bytes is None and args.device in ("auto", "cpu"):
        try:
            import torch

            if not torch.cuda.is_available():
                args.kv_cache_memory_bytes = 256 << 20
        except ImportError:
            pass
    runs = [run(args, int(tp)) for tp in tqdm(args.sizes.split(","), desc="tensor-parallel sizes")]
    base = runs[0]["decode_tokens_per_s"]
    agree = all(r["first_tokens"] == runs[0]["first_tokens"] for r in runs)
    rows = [
        [f"TP={r['tp']}", f"{r['decode_tokens_per_s']:.1f}", f"{r['decode_tokens_per_s'] / base:.2f}x"]
        for r in runs
    ]
    print_table(
        f"Decode throughput, batch {args.batch}, prompts {args.prompt_len}, outputs {args.output_len}",
        ["size", "decode tok/s", "vs TP=1"],
        rows,
    )
    print(f"greedy tokens agree across sizes: {agree}")
    path = write_json("tp", {"runs": runs, "tokens_agree": agree, "args": vars(args)})

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([f"TP={r['tp']}" for r in runs], [r["decode_tokens_per_s"] for r in runs], color="#c0392b")
    ax.set_ylabel("decode tokens / s")
    ax.set_title("Tensor parallelism")
    fig.tight_layout()
    fig.savefig(plot_path("tp"))
    print(f"wrote {path} and {plot_path('tp')}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
