"""What a grammar's token mask costs per decode step, at batch 1 and 32 (goal: under 5% of the step).

    make bench-structured       # or: python benchmarks/bench_structured.py [--steps 20] [--batches 1 32]

Default model on the CPU (float32), every sequence decoding under a JSON schema that cannot end within the
timed steps (an array of at least 1,000 short strings; the run checks every timed step masked every row). Per decode step it times the three parts of the mask's work: filling
the bitmask rows (xgrammar's matcher, in the scheduler), applying them to the logits (the sampler's call,
xgrammar's kernel behind Pagoda's row selection), and advancing the matchers by the sampled tokens; and the
step itself, with the grammar and without (the same prompts, unconstrained). The peer: xgrammar's kernel
called directly on a full-batch bitmask (what Pagoda's row selection adds on top of it).
Prints a table, writes bench-results/bench_structured.json and .png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, pyplot, save_plot, write_json  # noqa: E402
from pagoda.engine.frontend.llm import LLM  # noqa: E402
from pagoda.engine.sampling_params import SamplingParams  # noqa: E402
from pagoda.engine.structured_output import GrammarSpec  # noqa: E402
from pagoda.engine.structured_output.mask import TokenBitmask, apply_token_bitmask  # noqa: E402
from pagoda.engine.worker import sampler as sampler_module  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1000}


class Timer:
    """Wraps a callable; sums the seconds spent in it since the last take()."""

    def __init__(self, fn) -> None:
        self.fn, self.total, self.calls = fn, 0.0, []

    def __call__(self, *args, **kwargs):
        self.calls.append(args)
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - start

    def take(self) -> float:
        total, self.total = self.total, 0.0
        self.calls.clear()
        return total


def run_batch(llm: LLM, batch: int, steps: int, grammar: bool) -> dict:
    engine = llm.engine
    spec = GrammarSpec.json_schema(SCHEMA) if grammar else None
    tok = llm.get_tokenizer()
    for i in range(batch):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": f"List {i} short words as JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        params = SamplingParams(
            max_tokens=4 * steps + 64, temperature=0.8, seed=i, ignore_eos=True, structured_outputs=spec
        )
        engine.add_request(f"{grammar}-{batch}-{i}", prompt, params)
    sched = engine.scheduler
    fill, accept = Timer(sched.structured.bitmask), Timer(sched.structured.accept)
    apply = Timer(apply_token_bitmask)
    sched.structured.bitmask, sched.structured.accept = fill, accept
    sampler_module.apply_token_bitmask = apply
    try:
        while sched.num_waiting or any(
            s.num_computed_tokens < s.num_cache_tokens - 1 for r in sched.running for s in r.active_seqs
        ):
            engine.step()  # prefill and grammar compiles first: only decode steps are timed
        rows = {"step": [], "fill": [], "apply": [], "accept": []}
        for _ in range(steps):
            for t in (fill, apply, accept):
                t.take()
            start = time.perf_counter()
            engine.step()
            rows["step"].append(time.perf_counter() - start)
            masked = sum(len(args[0]) for args in fill.calls)
            rows["fill"].append(fill.take())
            rows["apply"].append(apply.take())
            rows["accept"].append(accept.take())
            if grammar and masked != batch:
                raise RuntimeError(f"a timed step masked {masked} rows, not {batch}: a grammar ended early")
    finally:
        sched.structured.bitmask, sched.structured.accept = fill.fn, accept.fn
        sampler_module.apply_token_bitmask = apply.fn
        engine.abort_request([r.request_id for r in list(sched.requests.values())])
        engine.step()
    return {k: statistics.median(v) * 1e3 for k, v in rows.items()}


def peer_apply_ms(batch: int, vocab: int, repeat: int = 50) -> tuple[float, float]:
    """(ours, xgrammar's CPU kernel): ms to apply a full-batch bitmask to [batch, vocab] float32 logits."""
    import xgrammar as xgr

    bits = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.randn(batch, vocab)
    mask = TokenBitmask(list(range(batch)), bits)

    def med(fn) -> float:
        times = []
        for _ in range(repeat):
            work = logits.clone()
            start = time.perf_counter()
            fn(work)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    return med(lambda w: apply_token_bitmask(w, mask)), med(
        lambda w: xgr.apply_token_bitmask_inplace(w, bits)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    args = ap.parse_args()
    llm = LLM(
        device="cpu", dtype="float32", max_model_len=1024, kv_cache_memory_bytes=256 << 20, max_num_seqs=64
    )
    vocab = llm.engine.model_config.vocab_size
    results, rows = {}, []
    for batch in tqdm(args.batches, desc="batches"):
        plain = run_batch(llm, batch, args.steps, grammar=False)
        masked = run_batch(llm, batch, args.steps, grammar=True)
        ours, peer = peer_apply_ms(batch, vocab)
        cost = masked["fill"] + masked["apply"] + masked["accept"]
        results[f"batch{batch}"] = {
            "step_ms_plain": plain["step"],
            "step_ms_grammar": masked["step"],
            "fill_ms": masked["fill"],
            "apply_ms": masked["apply"],
            "accept_ms": masked["accept"],
            "mask_cost_ms": cost,
            "mask_cost_share_of_step": cost / masked["step"],
            "apply_ms_ours_isolated": ours,
            "apply_ms_xgrammar_kernel": peer,
            "ratio_ours_to_xgrammar_kernel": ours / peer,
        }
        rows.append([batch, plain["step"], masked["step"], masked["fill"], masked["apply"], masked["accept"],
                     f"{100 * cost / masked['step']:.1f}%", ours, peer, f"{ours / peer:.2f}x"])  # fmt: skip
    headers = ["batch", "step ms plain", "step ms grammar", "fill ms", "apply ms", "accept ms", "mask share",
               "apply ms (ours, alone)", "apply ms (xgrammar kernel)", "ours / xgrammar"]  # fmt: skip
    print_table("Token-mask cost per decode step (median), default model, CPU float32", headers, rows)
    path = write_json("bench_structured", {"device": "cpu", "steps": args.steps, "schema": SCHEMA, **results})
    print(f"\nwrote {path}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(results)
    x = range(len(names))
    ax.bar(
        [i - 0.2 for i in x],
        [results[n]["step_ms_grammar"] - results[n]["mask_cost_ms"] for n in names],
        0.4,
        label="rest of the step",
    )
    ax.bar([i - 0.2 for i in x], [results[n]["mask_cost_ms"] for n in names], 0.4,
           bottom=[results[n]["step_ms_grammar"] - results[n]["mask_cost_ms"] for n in names], label="grammar mask")  # fmt: skip
    ax.bar(
        [i + 0.2 for i in x], [results[n]["step_ms_plain"] for n in names], 0.4, label="step without grammar"
    )
    ax.set_xticks(list(x), names)
    ax.set_ylabel("ms per decode step (median)")
    ax.set_title("What the grammar's token mask costs")
    ax.legend()
    save_plot(fig, "bench_structured")


if __name__ == "__main__":
    main()
