"""Offline throughput: Pagoda's continuous batching vs Hugging Face `generate()` with static batching.

64 requests, prompts of 20-600 tokens, outputs of 16-256 tokens, greedy, default model, same run.
Hugging Face runs the same requests in arrival order in fixed batches (left-padded, each batch runs to
its longest output); it is timed at several batch sizes and its best is the baseline. Pagoda's KV waste
(allocated but unfilled slots over allocated slots) is sampled after every step.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import plot_path, print_table, write_json  # noqa: E402
from pagoda.engine import LLM, SamplingParams  # noqa: E402


def make_workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, 40000) for _ in range(rng.randint(20, 600))], rng.randint(16, 256))
        for _ in range(n)
    ]


def run_pagoda(llm: LLM, work) -> dict:
    engine = llm.engine
    for i, (prompt, out_len) in enumerate(work):
        engine.add_request(
            f"r{i}",
            None,
            SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True),
            prompt_token_ids=prompt,
        )
    from tqdm.auto import tqdm

    waste, tokens, steps = [], 0, 0
    preempt_before = engine.scheduler.total_preemptions
    bar = tqdm(total=len(work), desc="pagoda", unit="req")
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += sum(len(c.token_ids) for c in delta.outputs)
            if delta.finished:
                bar.update(1)
        steps += 1
        if engine.scheduler.running:
            waste.append(engine.kv_waste())
    elapsed = time.perf_counter() - start
    bar.close()
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "mean_kv_waste": sum(waste) / max(len(waste), 1),
        "preemptions": engine.scheduler.total_preemptions - preempt_before,
        "steps": steps,
    }


def run_hf(model, work, batch_size: int) -> dict:
    from tqdm.auto import tqdm

    useful = 0
    start = time.perf_counter()
    for b in tqdm(range(0, len(work), batch_size), desc=f"hf batch {batch_size}", unit="batch"):
        batch = work[b : b + batch_size]
        longest = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(batch):
            ids[i, longest - len(p) :] = torch.tensor(p)
            mask[i, longest - len(p) :] = 1
        new = max(o for _, o in batch)
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        useful += sum(o for _, o in batch)
    elapsed = time.perf_counter() - start
    return {
        "batch_size": batch_size,
        "seconds": elapsed,
        "output_tokens": useful,
        "tokens_per_s": useful / elapsed,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--hf-batch-sizes", default="8,16,32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = make_workload(args.requests, args.seed)

    llm = LLM(device="cpu", dtype="float32", max_model_len=1024, kv_cache_memory_bytes=2 << 30)
    pagoda = run_pagoda(llm, work)

    import transformers

    model_dir = llm.engine.model_path
    del llm
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_runs = [run_hf(hf_model, work, int(b)) for b in args.hf_batch_sizes.split(",")]
    best = max(hf_runs, key=lambda r: r["tokens_per_s"])
    ratio = pagoda["tokens_per_s"] / best["tokens_per_s"]

    rows = [
        [
            "pagoda (continuous batching)",
            f"{pagoda['tokens_per_s']:.1f}",
            f"{pagoda['seconds']:.1f}",
            f"{ratio:.2f}x",
        ]
    ]
    rows += [[f"HF generate, batch {r['batch_size']}", f"{r['tokens_per_s']:.1f}", f"{r['seconds']:.1f}",
              f"{pagoda['tokens_per_s'] / r['tokens_per_s']:.2f}x"] for r in hf_runs]  # fmt: skip
    print_table(
        f"Offline throughput, {args.requests} requests, default model, {args.threads} CPU threads",
        ["system", "output tok/s", "seconds", "pagoda speed-up"],
        rows,
    )
    print(
        f"\nPagoda mean KV waste: {pagoda['mean_kv_waste'] * 100:.2f}%   preemptions: {pagoda['preemptions']}"
    )
    print(f"Pagoda / best HF throughput: {ratio:.2f}x (target >= 3x); KV waste target < 4%")
    result = {
        "pagoda": pagoda,
        "hf": hf_runs,
        "hf_best": best,
        "ratio_vs_best_hf": ratio,
        "requests": args.requests,
    }
    path = write_json("offline", result)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["pagoda"] + [f"HF b={r['batch_size']}" for r in hf_runs]
    values = [pagoda["tokens_per_s"]] + [r["tokens_per_s"] for r in hf_runs]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, values, color=["#c0392b"] + ["#7f8c8d"] * len(hf_runs))
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Offline throughput ({args.requests} requests, CPU)")
    fig.tight_layout()
    fig.savefig(plot_path("offline"))
    print(f"wrote {path} and {plot_path('offline')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
