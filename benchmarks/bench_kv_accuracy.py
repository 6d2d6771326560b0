"""What a quantised KV cache (or a bfloat16 model) costs in accuracy and buys in capacity: fp32 vs fp8_e4m3 vs
int8 caches, and the whole model in bfloat16 (weights, activations and cache; the CPU's fast path where it has
AVX512-BF16).

    make bench-kv-accuracy        # or: python benchmarks/bench_kv_accuracy.py [--ppl-tokens 2048]

On the default model (SmolLM2-135M-Instruct, float32 compute on CPU except the bf16 row), through the engine's
own model runner and paged cache, so every read of the past goes through the cache dtype under test:

- greedy agreement: the HF parity prompts of tests/engine/test_hf_parity.py, --new-tokens greedy tokens each;
  "identical" is the share of output positions whose token equals the fp32 cache's, and "whole" the share
  of prompts whose whole output is identical. Top-1 logit drift is teacher-forced on the fp32 cache's
  greedy tokens (so both sides see the same context): the mean |logit - logit_fp32| of the fp32 top-1
  token over every decode step, and the share of steps whose top-1 token changes.
- perplexity: the first --ppl-tokens tokens of a fixed text Debian ships (/usr/share/common-licenses/GPL-3),
  prefilled in chunks of --chunk tokens, so every chunk after the first attends to quantised keys and
  values of the chunks before it (the new chunk's own tokens are quantised too: they are written first).
- capacity: blocks and tokens of a fixed --budget-mib KV memory for each dtype, from the allocated bytes.

Prints tables, writes bench-results/bench_kv_accuracy.json and a plot.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import plot_path, print_table, write_json  # noqa: E402
from pagoda.engine.config import EngineConfig  # noqa: E402
from pagoda.engine.frontend.llm_engine import LLMEngine  # noqa: E402
from pagoda.engine.worker.step_input import StepInput  # noqa: E402

# The HF parity prompts are the test kit's (tests/support/pagoda_testkit), as for bench_router.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from pagoda_testkit.parity import parity_prompts  # noqa: E402

# label -> (model dtype, KV cache dtype); the first is the reference
VARIANTS = {
    "fp32": ("float32", "auto"),
    "fp8_e4m3": ("float32", "fp8_e4m3"),
    "int8": ("float32", "int8"),
    "bf16": ("bfloat16", "auto"),
}
TEXT = Path("/usr/share/common-licenses/GPL-3")
BLOCK = 16


class Runner:
    """One engine's model runner driven directly, sequences on disjoint runs of blocks (no scheduler)."""

    def __init__(self, dtype: str, kv_cache_dtype: str, num_blocks: int) -> None:
        probe = LLMEngine(EngineConfig(device="cpu", dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_model_len=BLOCK,
                                       kv_cache_memory_bytes=1 << 20, enable_prefix_caching=False))  # fmt: skip
        per_token = probe.kv_bytes_per_token
        probe.close()
        self.engine = LLMEngine(EngineConfig(device="cpu", dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                             max_model_len=BLOCK, kv_cache_memory_bytes=num_blocks * BLOCK * per_token,
                                             enable_prefix_caching=False))  # fmt: skip
        self.runner = self.engine.runner
        self.num_blocks = self.engine.num_blocks

    def forward(
        self, seqs: list[tuple[list[int], int]], per_seq_blocks: int, all_logits: bool
    ) -> torch.Tensor:
        """One step: sequence i feeds tokens at positions start_i.. into blocks [i * per_seq_blocks, ...);
        logits of every token (all_logits) or of each sequence's last token."""
        tables = np.arange(len(seqs) * per_seq_blocks, dtype=np.int32).reshape(len(seqs), per_seq_blocks)
        ids, pos, qlens, ctx, sample = [], [], [], [], []
        for toks, start in seqs:
            ids.extend(toks)
            pos.append(np.arange(start, start + len(toks), dtype=np.int64))
            qlens.append(len(toks))
            ctx.append(start)
            first = sum(qlens[:-1])
            sample.extend(range(first, first + len(toks)) if all_logits else [first + len(toks) - 1])
        step = StepInput(
            input_ids=np.asarray(ids, dtype=np.int64),
            positions=np.concatenate(pos),
            query_lens=np.asarray(qlens),
            context_lens=np.asarray(ctx),
            block_tables=tables,
            sample_idx=np.asarray(sample, dtype=np.int64),
        )
        return self.runner.run(step)

    def greedy(self, prompts: list[list[int]], new_tokens: int, nb: int) -> list[list[int]]:
        """All prompts as one batch: one prefill step, then one decode step per new token."""
        logits = self.forward([(p, 0) for p in prompts], nb, False)
        outs = [[int(t)] for t in logits.argmax(-1)]
        for _ in range(new_tokens - 1):
            seqs = [([o[-1]], len(p) + len(o) - 1) for p, o in zip(prompts, outs, strict=True)]
            for o, t in zip(outs, self.forward(seqs, nb, False).argmax(-1), strict=True):
                o.append(int(t))
        return outs

    def forced(self, prompts: list[list[int]], continuations: list[list[int]], nb: int) -> list[torch.Tensor]:
        """Logits before each continuation token with the given tokens as context: one prefill of prompt +
        continuation (every key and value is read back from the cache, the chunk's own included)."""
        seqs = [(p + c[:-1], 0) for p, c in zip(prompts, continuations, strict=True)]
        logits = self.forward(seqs, nb, True)
        rows, at = [], 0
        for p, c in zip(prompts, continuations, strict=True):
            n = len(p) + len(c) - 1
            rows.append(logits[at + len(p) - 1 : at + n])
            at += n
        return rows

    def perplexity(self, ids: list[int], chunk: int) -> float:
        nb = -(-len(ids) // BLOCK)
        nll, count = 0.0, 0
        for start in tqdm(range(0, len(ids) - 1, chunk), desc="perplexity chunks", leave=False):
            piece = ids[start : start + chunk]
            logits = self.forward([(piece, start)], nb, True)
            targets = torch.tensor(ids[start + 1 : start + 1 + len(piece)])
            logp = logits[: len(targets)].log_softmax(-1)
            nll -= float(logp.gather(1, targets[:, None]).sum())
            count += len(targets)
        return math.exp(nll / count)

    def close(self) -> None:
        self.engine.close()


def capacity(dtype: str, kv_cache_dtype: str, budget: int) -> dict:
    engine = LLMEngine(EngineConfig(device="cpu", dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_model_len=256,
                                    kv_cache_memory_bytes=budget, enable_prefix_caching=False))  # fmt: skip
    try:
        allocated = engine.runner.kv_cache_bytes
        return {
            "bytes_per_token": engine.kv_bytes_per_token,
            "blocks": engine.num_blocks,
            "tokens": engine.num_blocks * BLOCK,
            "allocated_bytes": allocated,
            "allocated_bytes_per_token": allocated / (engine.num_blocks * BLOCK),
        }
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per parity prompt")
    ap.add_argument("--ppl-tokens", type=int, default=2048, help="tokens of the license text to score")
    ap.add_argument("--chunk", type=int, default=128, help="prefill chunk of the perplexity run")
    ap.add_argument("--budget-mib", type=int, default=256, help="KV memory of the capacity comparison")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not TEXT.exists():
        sys.exit(f"{TEXT} is missing (Debian's base-files ships it)")

    results: dict[str, dict] = {}
    ref_tokens: list[list[int]] = []
    ref_logits: list[torch.Tensor] = []
    prompts: list[list[int]] = []
    ids: list[int] = []
    for label, (dtype, dt) in VARIANTS.items():
        is_ref = label == "fp32"
        t0 = time.perf_counter()
        if not prompts:
            from pagoda.engine.loader import load_tokenizer, resolve_model

            tok = load_tokenizer(resolve_model(None))
            prompts = parity_prompts(tok)
            ids = tok(TEXT.read_text(), add_special_tokens=False).input_ids[: args.ppl_tokens]
        nb = -(-(max(len(p) for p in prompts) + args.new_tokens) // BLOCK)
        run = Runner(dtype, dt, max(nb * len(prompts), -(-len(ids) // BLOCK)))
        with tqdm(total=3, desc=f"{label}: greedy, forced, perplexity", leave=False) as bar:
            got = run.greedy(prompts, args.new_tokens, nb)
            bar.update()
            if is_ref:
                ref_tokens = got
            logits = run.forced(prompts, ref_tokens, nb)
            bar.update()
            if is_ref:
                ref_logits = logits
            ppl = run.perplexity(ids, args.chunk)
            bar.update()
        run.close()
        same = sum(a == b for g, w in zip(got, ref_tokens, strict=True) for a, b in zip(g, w, strict=True))
        whole = sum(g == w for g, w in zip(got, ref_tokens, strict=True))
        drift: list[float] = []
        flips = steps = 0
        for mine, ref in zip(logits, ref_logits, strict=True):
            top = ref.argmax(-1)
            drift.extend(
                (mine.float().gather(1, top[:, None]) - ref.gather(1, top[:, None])).abs().squeeze(1).tolist()
            )
            flips += int((mine.argmax(-1) != top).sum())
            steps += len(top)
        results[label] = {
            "identical_tokens_pct": 100.0 * same / (len(prompts) * args.new_tokens),
            "identical_outputs_pct": 100.0 * whole / len(prompts),
            "mean_top1_logit_drift": float(np.mean(drift)),
            "max_top1_logit_drift": float(np.max(drift)),
            "top1_changed_pct": 100.0 * flips / steps,
            "perplexity": ppl,
            "seconds": time.perf_counter() - t0,
        }
        print(
            f"{label}: perplexity {ppl:.4f}, {results[label]['identical_tokens_pct']:.1f}% identical tokens"
        )
    base = results["fp32"]["perplexity"]
    for r in results.values():
        r["perplexity_vs_fp32_pct"] = 100.0 * (r["perplexity"] / base - 1.0)

    budget = args.budget_mib << 20
    caps = {label: capacity(*v, budget) for label, v in tqdm(VARIANTS.items(), desc="capacity", leave=False)}

    print_table(
        f"Accuracy vs the fp32 cache (SmolLM2-135M, {len(prompts)} parity prompts x {args.new_tokens} greedy "
        f"tokens; perplexity on {len(ids)} tokens of GPL-3 in {args.chunk}-token chunks)",
        ["model / cache", "identical tokens %", "identical outputs %", "mean top-1 logit drift", "top-1 changed %",
         "perplexity", "vs fp32 %"],
        [[k, r["identical_tokens_pct"], r["identical_outputs_pct"], r["mean_top1_logit_drift"],
          r["top1_changed_pct"], round(r["perplexity"], 4), round(r["perplexity_vs_fp32_pct"], 3)]
         for k, r in results.items()],
    )  # fmt: skip
    print_table(
        f"Capacity of a {args.budget_mib} MiB KV budget (allocated bytes, scales included)",
        ["model / cache", "bytes/token", "blocks", "tokens", "x fp32"],
        [[k, c["bytes_per_token"], c["blocks"], c["tokens"], round(c["tokens"] / caps["fp32"]["tokens"], 2)]
         for k, c in caps.items()],
    )  # fmt: skip
    target_ok = abs(results["int8"]["perplexity_vs_fp32_pct"]) <= 1.0
    print(f"\nint8 perplexity within 1% of fp32: {'yes' if target_ok else 'NO'}")
    path = write_json(
        "bench_kv_accuracy",
        {"args": vars(args), "model": "SmolLM2-135M-Instruct", "text": str(TEXT), "accuracy": results,
         "capacity": caps, "int8_within_1pct": target_ok},
    )  # fmt: skip
    print(f"wrote {path}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(results)
    colors = ["#555", "#c84", "#48c", "#4a4"]
    a.bar(names, [results[n]["perplexity"] for n in names], color=colors)
    a.set_ylim(min(r["perplexity"] for r in results.values()) * 0.98, None)
    a.set_title("perplexity (GPL-3, chunked prefill)")
    b.bar(names, [caps[n]["tokens"] for n in names], color=colors)
    b.set_title(f"tokens in {args.budget_mib} MiB of KV")
    fig.tight_layout()
    fig.savefig(plot_path("bench_kv_accuracy"))
    print(f"wrote {plot_path('bench_kv_accuracy')}")


if __name__ == "__main__":
    main()
