"""What serving LoRA adapters costs: a batch of 32 requests spread over 1, 4 and 8 adapters, against the base
model alone.

    make bench-lora      # or: python benchmarks/bench_lora.py [--rank 8] [--rounds 3] [--device cpu]

Every case runs the same 32 requests (distinct prompts of --prompt-tokens tokens, --output-tokens greedy
tokens each, EOS ignored) as one batch on the default model (float32 on the CPU, the exact path):
- base: an engine without --enable-lora (the strongest peer: nothing of LoRA runs);
- lora engine, base requests: --enable-lora --max-loras 8, no request names an adapter;
- 1 / 4 / 8 adapters: the requests go round-robin to that many adapters (rank --rank on all seven target
  modules, random weights) on the same engine, all of them in slots (--max-loras 8).
Cases alternate within each round (the order turns every round) and the prefix cache is reset before each
run, so every run computes the same tokens; the table shows the median of the rounds. Throughput counts
prompt and output tokens over wall time; CPU seconds are the process's. Prints a table, writes
bench-results/bench_lora.json and .png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import plot_path, print_table, pyplot, write_json  # noqa: E402
from pagoda.engine.frontend.llm import LLM  # noqa: E402
from pagoda.engine.lora.adapter import TARGET_MODULES  # noqa: E402
from pagoda.engine.lora.model import module_shapes  # noqa: E402
from pagoda.engine.sampling_params import SamplingParams  # noqa: E402

REQUESTS = 32
MAX_LORAS = 8
TEXT = (
    "Report {i}: the river rose {i} centimetres overnight, the ferry kept to its timetable and the market "
    "sold out of apples before noon, while the council argued about the new bridge for the {i}th time. "
)


def write_adapter(path: Path, model, rank: int, seed: int) -> None:
    """A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) with random weights."""
    import json

    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(model)
    tensors = {}
    for layer in range(model.config.num_hidden_layers):
        for module, parent in TARGET_MODULES.items():
            shape = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn((rank, shape.in_features), generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn((shape.out_features, rank), generator=gen) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES)}
    (path / "adapter_config.json").write_text(json.dumps(config))


def prompts_of(tok, n: int, length: int) -> list[list[int]]:
    out = []
    for i in range(n):
        ids: list[int] = []
        k = 0
        while len(ids) < length:
            ids += tok(TEXT.format(i=1000 * i + k), add_special_tokens=False).input_ids
            k += 1
        out.append(ids[:length])
    return out


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, adapters: list[str | None]) -> dict:
    llm.engine.reset_prefix_cache()
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora=adapters, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(p) for p in prompts) + sum(len(o.outputs[0].token_ids) for o in outs)
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tok_s": tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank of every adapter (all 7 target modules)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default torch's: every core); 1 keeps the "
        "ratios meaningful on a machine that other jobs keep busy, where OpenMP teams stall",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    common = dict(
        device=args.device,
        dtype=args.dtype,
        max_model_len=1024,
        max_num_seqs=REQUESTS,
        kv_cache_memory_bytes=256 << 20,
    )
    base = LLM(**common)
    lora = LLM(**common, enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=max(args.rank, 16))
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(MAX_LORAS):
            path = Path(tmp) / f"adapter-{i}"
            write_adapter(path, lora.engine.core.model, args.rank, seed=i)
            lora.engine.load_lora_adapter(f"adapter-{i}", str(path))
    prompts = prompts_of(base.get_tokenizer(), REQUESTS, args.prompt_tokens)
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    cases = {
        "base": (base, [None] * REQUESTS),
        "lora engine, base requests": (lora, [None] * REQUESTS),
        **{
            f"{n} adapter{'s' if n > 1 else ''}": (lora, [f"adapter-{i % n}" for i in range(REQUESTS)])
            for n in (1, 4, 8)
        },
    }
    for llm, adapters in cases.values():  # warm-up: first-use costs (packing, allocator, slot loads)
        run(llm, prompts[:4], SamplingParams(temperature=0, max_tokens=2), adapters[:4])
    results: dict[str, list[dict]] = {name: [] for name in cases}
    bar = tqdm(total=args.rounds * len(cases), desc="runs", unit="run")
    names = list(cases)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            llm, adapters = cases[name]
            results[name].append(run(llm, prompts, params, adapters))
            bar.update(1)
    bar.close()
    report(args, results, load_before, os.getloadavg())


def report(args, results: dict[str, list[dict]], load_before, load_after) -> None:
    med = {name: statistics.median(r["tok_s"] for r in runs) for name, runs in results.items()}
    cpu = {name: statistics.median(r["tokens"] / r["cpu_s"] for r in runs) for name, runs in results.items()}
    base, base_cpu = med["base"], cpu["base"]
    rows = [
        [name, f"{med[name]:.0f}", f"{med[name] / base:.3f}", f"{(1 - med[name] / base) * 100:+.1f}%",
         f"{cpu[name] / base_cpu:.3f}"]
        for name in results
    ]  # fmt: skip
    headers = ["case", "tok/s (median)", "vs base", "slower by", "vs base (CPU time)"]
    title = (
        f"LoRA cost: {REQUESTS} requests x ({args.prompt_tokens} prompt + {args.output_tokens} output) tokens, "
        f"rank {args.rank}, {args.device} {args.dtype}, median of {args.rounds} rounds"
    )
    print_table(title, headers, rows)
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")
    payload = {
        "device": args.device,
        "dtype": args.dtype,
        "rank": args.rank,
        "requests": REQUESTS,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "tok_s_median": med,
        "relative_to_base": {name: med[name] / base for name in med},
        "relative_to_base_cpu_time": {name: cpu[name] / base_cpu for name in cpu},
        "runs": results,
    }
    path = write_json("bench_lora", payload)
    print(f"wrote {path}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(med)
    ax.bar(
        range(len(names)), [med[n] / base for n in names], color=["grey"] + ["tab:blue"] * (len(names) - 1)
    )
    ax.axhline(0.8, color="tab:red", linestyle="--", label="goal: at most 20% slower")
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_ylabel("throughput relative to the base model")
    ax.set_title(f"{REQUESTS} requests over LoRA adapters (rank {args.rank}, {args.device})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot_path("bench_lora"))
    print(f"wrote {plot_path('bench_lora')}")


if __name__ == "__main__":
    main()
