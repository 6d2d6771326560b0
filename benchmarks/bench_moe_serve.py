"""Served mixture-of-experts model: output tokens/s of `pagoda serve` at concurrency 1, 8 and 32.

    make bench-moe            # or: python benchmarks/bench_moe_serve.py [--concurrency 1 8 32] [--quick]

Shows that batching works through the expert layer: with more requests in flight, each decode step routes
more tokens through the same grouped expert GEMMs, so output tokens/s should grow with concurrency.

The model is a tiny random-weight Qwen3-MoE built here with transformers (no hub access): hidden 512,
4 layers, 16 experts of intermediate 256 with top-2 renormalised routing on every layer, 8 query / 4 KV
heads of 64, QK-norm, tied embeddings, and the default model's tokenizer (so its 49,152-token vocabulary).
It is saved once to bench-results/moe-tiny/ (rebuilt when the shape changes). One server (prefix caching
off, so no pass reuses another's prompts) gets, per concurrency c, max(2c, 8) requests of random word-token
prompts of 32-128 tokens and exactly --output tokens each (ignore_eos), streamed; one warm-up request first.

Writes bench-results/bench_moe_serve.json (with the host's 1-minute load average before and after: on a
shared CPU host other work lowers every number) and bench_moe_serve.png, and prints a table. Next to the
wall-clock tok/s, the server's CPU time (its process tree's, from /proc) per output token: the load moves it
far less than tok/s, and batching shows as its fall with concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import (  # noqa: E402
    RESULTS,
    RequestSpec,
    run_load,
    start_server,
    stop,
    summarize,
    token_pool,
    wait_healthy,
)

SHAPE = dict(
    hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
    intermediate_size=1024, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=2,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=2048,
    tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0,
)  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_model(out: Path, seed: int = 0) -> Path:
    """The tiny random Qwen3-MoE checkpoint with the default model's tokenizer (cached by shape)."""
    import torch
    from pagoda.engine.loader import resolve_model
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    stamp = out / "bench-shape.json"
    want = json.dumps({**SHAPE, "seed": seed}, sort_keys=True)
    if stamp.is_file() and stamp.read_text() == want and (out / "config.json").is_file():
        return out
    tokenizer_src = Path(resolve_model(None))
    base = json.loads((tokenizer_src / "config.json").read_text())
    cfg = Qwen3MoeConfig(
        **SHAPE, vocab_size=base["vocab_size"], bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"),
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random, not flat: routing spreads tokens over the experts
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    if out.exists():
        shutil.rmtree(out)
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_src / name).exists():
            shutil.copy(tokenizer_src / name, out / name)
    stamp.write_text(want)
    return out


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants (the engine core may run in a child)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        pid_i = int(stat.parent.name)
        parents[pid_i] = int(fields[1])
        times[pid_i] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(times.get(p, 0.0) for p in tree)


def workload(pool: list[int], n: int, rng: random.Random, output: int) -> list[RequestSpec]:
    return [RequestSpec([rng.choice(pool) for _ in range(rng.randint(32, 128))], output) for _ in range(n)]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.plot([r["concurrency"] for r in rows], [r["output_throughput"] for r in rows], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title("tiny Qwen3-MoE (16 experts, top-2) served")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--output", type=int, default=64, help="output tokens per request")
    p.add_argument("--quick", action="store_true", help="8 output tokens per request (smoke run)")
    p.add_argument("--model-dir", type=Path, default=RESULTS / "moe-tiny")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for the server (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    output = 8 if args.quick else args.output
    model = build_model(args.model_dir, args.seed)
    server_args = argparse.Namespace(
        model=str(model), max_model_len=1024, max_num_seqs=max(args.concurrency), kv_cache_memory_bytes="256MiB",
        server_arg=args.server_arg,
    )  # fmt: skip
    load = [os.getloadavg()[0]]
    (args.out / "moe-serve-logs").mkdir(exist_ok=True)
    proc, url = start_server(server_args, False, args.out / "moe-serve-logs")
    rows: list[dict] = []
    try:
        wait_healthy(proc, url)
        pool = token_pool(url)
        rng = random.Random(args.seed)
        asyncio.run(run_load(url, workload(pool, 1, rng, output), 1, "warm-up"))
        for c in args.concurrency:
            specs = workload(pool, max(2 * c, 8), rng, output)
            cpu_before = tree_cpu_seconds(proc.pid)
            results, duration = asyncio.run(run_load(url, specs, c, f"moe c={c}"))
            row = {"concurrency": c, **summarize(results, duration)}
            row["server_cpu_s"] = tree_cpu_seconds(proc.pid) - cpu_before
            tokens = row["output_throughput"] * duration
            row["server_cpu_ms_per_token"] = 1e3 * row["server_cpu_s"] / tokens if tokens else float("nan")
            rows.append(row)
            print(f"  c={c}: {row['output_throughput']:.1f} output tok/s, {row['server_cpu_ms_per_token']:.1f} server "
                  "CPU ms per output token", flush=True)  # fmt: skip
    finally:
        stop(proc)
    load.append(os.getloadavg()[0])
    rates = [r["output_throughput"] for r in rows]
    grows = all(b > a for a, b in zip(rates, rates[1:], strict=False))
    print(
        "\n| concurrency | requests | output tok/s | server CPU ms / token | mean TTFT ms | mean ITL ms | p99 ITL ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['requests']} | {r['output_throughput']:.1f} | "
              f"{r['server_cpu_ms_per_token']:.1f} | {r['mean_ttft_ms']:.0f} | {r['mean_itl_ms']:.1f} | "
              f"{r['p99_itl_ms']:.1f} |")  # fmt: skip
    print(f"output tok/s grows with concurrency: {'yes' if grows else 'NO'}; 1-minute load average {load[0]:.1f} "
          f"before, {load[1]:.1f} after ({os.cpu_count()} CPUs)")  # fmt: skip
    report = {
        "benchmark": "moe-serve", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": {**SHAPE, "dir": str(model)},
        "output_tokens_per_request": output, "load_average": load, "cpus": os.cpu_count(),
        "grows_with_concurrency": grows, "runs": rows,
    }  # fmt: skip
    (args.out / "bench_moe_serve.json").write_text(json.dumps(report, indent=2))
    plot(rows, args.out / "bench_moe_serve.png")
    print(f"wrote {args.out / 'bench_moe_serve.json'} and {args.out / 'bench_moe_serve.png'}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
