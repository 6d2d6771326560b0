"""Pipeline parallelism: decode throughput with PP=1 vs PP=2, and the pipeline's bubble.

Each stage is a rank of its own (gloo on CPU, NCCL on GPUs) holding half the layers; a step's batch runs as
PP micro-batches, so stage 0 works on micro-batch 1 while stage 1 works on micro-batch 0. The bubble is the
fraction of a stage's forward time spent waiting (for the previous stage's activations, or, on rank 0, for
the last stage's logits), measured on every rank over the decode steps; with M micro-batches over N stages
an ideal pipeline idles (N - 1) / (M + N - 1) of it. On CPU both ranks share the host's cores, so PP=2
shows the hand-offs' cost rather than a speed-up: pipeline parallelism is for models that do not fit one
node's GPUs, not for speed on one host. Same greedy workload for both; the first request's tokens must agree.

    make bench-pp
    python benchmarks/bench_pp.py --model /models/llama-3.1-8b --device cuda --batch 32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, pyplot, save_plot, write_json  # noqa: E402
from decode_run import timed_decode  # noqa: E402


def run(args: argparse.Namespace, pp: int) -> dict:
    def from_here(engine) -> None:  # from decode start on: the stage times of the decode steps only
        engine.core.workers.stage_times(engine.core.runner)

    engine, numbers = timed_decode(args, f"pp{pp}", from_here if pp > 1 else None, pipeline_parallel_size=pp)
    stages = None
    if pp > 1:
        core = engine.core
        stages = [
            {
                "rank": r,
                "busy_s": busy,
                "wall_s": wall,
                "steps": steps,
                "idle_fraction": 1 - busy / wall if wall else 0.0,
            }
            for r, (busy, wall, steps) in enumerate(core.workers.stage_times(core.runner))
        ]
    engine.close()
    return {
        "pp": pp,
        **numbers,
        "stages": stages,
        "ideal_bubble": (pp - 1) / (2 * pp - 1) if pp > 1 else 0.0,  # M = PP micro-batches per step
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads of the engine's own process (rank 0); on CPU each of PP ranks otherwise takes 1/PP of the "
        "cores, so --threads 1 gives PP=1 one core as each PP=2 rank has",
    )
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.kv_cache_memory_bytes is None and args.device == "cpu":
        args.kv_cache_memory_bytes = 128 << 20
    runs = [run(args, int(pp)) for pp in args.sizes.split(",")]
    base = runs[0]["decode_tokens_per_s"]
    agree = all(r["first_tokens"] == runs[0]["first_tokens"] for r in runs)
    rows = []
    for r in runs:
        bubble = "-" if not r["stages"] else " / ".join(f"{s['idle_fraction']:.0%}" for s in r["stages"])
        ideal = "-" if r["pp"] == 1 else f"{r['ideal_bubble']:.0%}"
        rows.append(
            [
                f"PP={r['pp']}",
                f"{r['prefill_seconds']:.2f}",
                f"{r['decode_tokens_per_s']:.1f}",
                f"{r['decode_tokens_per_s'] / base:.2f}x",
                bubble,
                ideal,
            ]
        )
    print_table(
        f"Decode throughput, batch {args.batch}, prompts {args.prompt_len}, outputs {args.output_len} "
        f"({args.device}; on a shared CPU host the numbers are indicative only)",
        [
            "size",
            "prefill s",
            "decode tok/s",
            "vs PP=1",
            "bubble per rank (idle share of forward)",
            "ideal bubble",
        ],
        rows,
    )
    print(f"greedy tokens agree across sizes: {agree}")
    path = write_json("pp", {"runs": runs, "tokens_agree": agree, "args": vars(args)})
    plt = pyplot()
    if plt is not None:
        fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
        a.bar([f"PP={r['pp']}" for r in runs], [r["decode_tokens_per_s"] for r in runs], color="#2c7fb8")
        a.set_ylabel("decode tokens / s")
        a.set_title("Pipeline parallelism")
        staged = [r for r in runs if r["stages"]]
        for r in staged:
            b.bar([f"PP={r['pp']} rank {s['rank']}" for s in r["stages"]], [s["idle_fraction"] for s in r["stages"]],
                  color="#f03b20")  # fmt: skip
            b.axhline(r["ideal_bubble"], color="k", linestyle="--", linewidth=1)
        b.set_ylabel("idle share of forward (bubble)")
        b.set_ylim(0, 1)
        b.set_title("Bubble (dashed: ideal)")
        save_plot(fig, "pp")
    print(f"wrote {path}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
