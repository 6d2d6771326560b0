"""Sub-block prefix reuse: TTFT of requests whose shared prefix is not block-aligned, with and without it.

    make bench-prefix-partial     # or: python benchmarks/bench_prefix_partial.py [--requests 12]

Workloads (block sizes 16 and 64, default model, CPU unless --device says otherwise):
- system-500: a 500-token system prompt (500 = 31 blocks + 4) then a different ~20-token user turn;
- short-31: 31 shared tokens (1 block + 15) then 2 different tokens, the case where the gain is largest
  relative to the work left;
- mixed: shared prefixes of 40, 100 and 250 tokens (none a multiple of 16) then ~10 different tokens.

The shared prefix is computed once first (so it sits in the prefix cache), then every request is timed
alone (max_tokens=1: the time to the first token), engines with and without sub-block reuse alternating
request by request (which goes first alternates) so machine noise hits both alike; the gain is the median
of the per-prompt ratios. Also checks that both give the same first token.
Prints a table, writes bench-results/bench_prefix_partial.json and .png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import plot_path, print_table, write_json  # noqa: E402
from pagoda.engine.frontend.llm import LLM  # noqa: E402
from pagoda.engine.sampling_params import SamplingParams  # noqa: E402

TEXT = (
    "Section {i}. The bakery opens at five. Rye dough rests overnight in the cold room, wheat dough is "
    "shaped at four, and the wood oven is swept before the first loaves go in. Customers ask about spelt, "
    "about sourdough starters and about the honey cake that sells out before noon. "
)
GREEDY1 = SamplingParams(max_tokens=1, temperature=0)


def tokens_of(tok, n: int, salt: int = 0) -> list[int]:
    ids: list[int] = []
    i = 0
    while len(ids) < n:
        ids += tok(TEXT.format(i=i + 1000 * salt), add_special_tokens=False).input_ids
        i += 1
    return ids[:n]


def workloads(tok, requests: int) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """name -> (warm-up prompts that put the shared prefixes in the cache, timed prompts)."""
    words = ["Why", "How", "When", "Which", "Where", "Who", "What", "Could", "Should", "Would", "Is", "Are"]
    topics = ["rye", "spelt", "honey cake", "starter", "oven", "salt", "crust", "flour", "butter", "seeds"]

    def turn(i: int, n: int) -> list[int]:
        text = f"{words[i % len(words)]} is the {topics[(i * 7) % len(topics)]} special on day {i}? " * 4
        return tok(text, add_special_tokens=False).input_ids[:n]

    out: dict[str, tuple[list[list[int]], list[list[int]]]] = {}
    system = tokens_of(tok, 500)
    out["system-500"] = ([system + turn(999, 20)], [system + turn(i, 20) for i in range(requests)])
    short = tokens_of(tok, 31, salt=1)
    out["short-31"] = ([short + turn(998, 2)], [short + turn(i, 2) for i in range(requests)])
    shared = {n: tokens_of(tok, n, salt=2 + n) for n in (40, 100, 250)}
    warm = [p + turn(997, 10) for p in shared.values()]
    timed = [list(shared.values())[i % 3] + turn(i, 10) for i in range(requests)]
    out["mixed"] = (warm, timed)
    return out


def one(llm: LLM, prompt: list[int]) -> tuple[float, float, int, int]:
    """(wall seconds, CPU seconds of this process, first token, cached tokens) of one request alone."""
    start, cpu = time.perf_counter(), time.process_time()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], GREEDY1, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall, cpu, out.outputs[0].token_ids[0], out.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12, help="timed requests per workload and engine")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--block-sizes", default="16,64", help="comma-separated KV block sizes to run")
    args = ap.parse_args()
    sizes = [int(b) for b in args.block_sizes.split(",")]
    rows, results = [], {}
    bar = tqdm(total=len(sizes) * 3 * args.requests * 2, desc="requests", unit="req")
    for bs in sizes:
        run_block_size(args, bs, rows, results, bar)
    bar.close()
    report(args, rows, results)


def run_block_size(args, bs: int, rows: list, results: dict, bar) -> None:
    kw = dict(device=args.device, block_size=bs, max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    engines = {"reuse": LLM(**kw), "whole-blocks": LLM(**kw, enable_partial_prefix_reuse=False)}
    tok = engines["reuse"].get_tokenizer()
    loads = workloads(tok, args.requests)
    for name, (warm, timed) in loads.items():
        for llm in engines.values():
            llm.engine.reset_prefix_cache()
            for p in warm:
                one(llm, p)
        times: dict[str, list[float]] = {k: [] for k in engines}
        cpus: dict[str, list[float]] = {k: [] for k in engines}
        cached: dict[str, list[int]] = {k: [] for k in engines}
        first: dict[str, list[int]] = {k: [] for k in engines}
        for i, prompt in enumerate(timed):
            order = list(engines.items())
            for key, llm in order if i % 2 == 0 else order[::-1]:  # neither always goes first
                t, c, token, hit = one(llm, prompt)
                times[key].append(t)
                cpus[key].append(c)
                cached[key].append(hit)
                first[key].append(token)
                bar.update(1)
        on = statistics.median(times["reuse"]) * 1e3
        off = statistics.median(times["whole-blocks"]) * 1e3
        on_min = min(times["reuse"]) * 1e3
        off_min = min(times["whole-blocks"]) * 1e3
        # CPU time of the engine's process: what the request cost, much less bent by other processes
        # sharing the cores than wall time (the benchmark machine is shared).
        on_cpu = statistics.median(cpus["reuse"]) * 1e3
        off_cpu = statistics.median(cpus["whole-blocks"]) * 1e3
        # Paired: each prompt ran on both engines back to back, so their ratio cancels slow phases of a
        # shared machine better than either median.
        paired = statistics.median(b / a for a, b in zip(times["reuse"], times["whole-blocks"], strict=True))
        prompt_len = statistics.mean(len(p) for p in timed)
        hit_on = statistics.mean(cached["reuse"])
        hit_off = statistics.mean(cached["whole-blocks"])
        same = first["reuse"] == first["whole-blocks"]
        results[f"{name}/bs{bs}"] = {
            "block_size": bs,
            "prompt_tokens_mean": prompt_len,
            "cached_tokens_mean": {"reuse": hit_on, "whole-blocks": hit_off},
            "computed_tokens_mean": {"reuse": prompt_len - hit_on, "whole-blocks": prompt_len - hit_off},
            "ttft_ms_median": {"reuse": on, "whole-blocks": off},
            "ttft_ms_min": {"reuse": on_min, "whole-blocks": off_min},
            "cpu_ms_median": {"reuse": on_cpu, "whole-blocks": off_cpu},
            "cpu_speedup": off_cpu / on_cpu,
            "paired_speedup_median": paired,
            "ttft_ms_all": {k: [t * 1e3 for t in v] for k, v in times.items()},
            "speedup": off / on,
            "same_first_tokens": same,
        }
        rows.append(
            [name, bs, f"{prompt_len:.0f}", f"{hit_off:.0f}", f"{hit_on:.0f}", off, on, f"{paired:.2f}x",
             off_cpu, on_cpu, f"{off_cpu / on_cpu:.2f}x", same]
        )  # fmt: skip


def report(args, rows: list, results: dict) -> None:
    headers = [
        "workload", "block", "prompt tok", "cached whole", "cached reuse", "TTFT med whole", "TTFT med reuse",
        "gain (paired)", "CPU ms whole", "CPU ms reuse", "gain (CPU)", "same tokens",
    ]  # fmt: skip
    print_table("Sub-block prefix reuse: TTFT in ms (max_tokens=1), one request at a time", headers, rows)
    path = write_json("bench_prefix_partial", {"device": args.device, "requests": args.requests, **results})
    print(f"\nwrote {path}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(results)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [results[n]["ttft_ms_median"]["whole-blocks"] for n in names], 0.4,
           label="whole blocks only")  # fmt: skip
    ax.bar([i + 0.2 for i in x], [results[n]["ttft_ms_median"]["reuse"] for n in names], 0.4,
           label="sub-block reuse")  # fmt: skip
    ax.set_xticks(list(x), names, rotation=20)
    ax.set_ylabel("median TTFT (ms)")
    ax.set_title("Shared prefixes that are not block-aligned")
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot_path("bench_prefix_partial"))
    print(f"wrote {plot_path('bench_prefix_partial')}")


if __name__ == "__main__":
    main()
