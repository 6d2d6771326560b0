"""One engine of `bench_peers.py`, run in its own process (and, for vLLM, its own venv).

    python benchmarks/peers_worker.py SPEC.json RESULT.json

The spec names the engine (`pagoda`, `vllm` or `hf`), the model directory, the workload (token ids and
output lengths) and the measurements to take. Only the standard library is imported at module level, so
this file runs under `.venv` and under `.peers/vllm` alike; each engine's packages are imported inside its
runner. The `__main__` guard matters: vLLM starts its engine core with multiprocessing spawn, which
re-imports this module in the child.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fresh_prompts(seed: int, count: int, length: int, vocab: int) -> list[list[int]]:
    """Prompts no timed run has seen, so a prefix cache cannot shorten a TTFT measurement."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


# ---------------------------------------------------------------- engines behind one small interface


class PagodaRunner:
    name = "pagoda"

    def __init__(self, spec: dict) -> None:
        from pagoda.engine import LLM, SamplingParams

        self._params = SamplingParams
        self.llm = LLM(
            spec["model_dir"],
            dtype=spec["dtype"],
            device="cpu",
            max_model_len=spec["max_model_len"],
            kv_cache_memory_bytes=int(spec["kv_cache_gib"] * (1 << 30)),
            kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
            seed=spec["seed"],
        )

    def generate(self, prompts: list[list[int]], out_lens: list[int], progress: bool) -> list[list[int]]:
        params = [self._params(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=progress)
        return [list(o.outputs[0].token_ids) for o in outs]

    def versions(self) -> dict:
        from importlib.metadata import version

        import torch

        return {
            "pagoda": version("pagoda"),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        }

    def close(self) -> None:
        close = getattr(self.llm.engine, "close", None)
        if close:
            close()


class VllmRunner:
    name = "vllm"

    def __init__(self, spec: dict) -> None:
        from vllm import LLM, SamplingParams

        self._params = SamplingParams
        self.llm = LLM(
            model=spec["model_dir"],
            dtype=spec["dtype"],
            max_model_len=spec["max_model_len"],
            seed=spec["seed"],
            trust_remote_code=False,
        )

    def generate(self, prompts: list[list[int]], out_lens: list[int], progress: bool) -> list[list[int]]:
        params = [self._params(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=progress)
        return [list(o.outputs[0].token_ids) for o in outs]

    def versions(self) -> dict:
        import torch
        import vllm

        return {"vllm": vllm.__version__, "torch": torch.__version__}

    def close(self) -> None:
        shutdown = getattr(getattr(self.llm, "llm_engine", None), "shutdown", None)
        if shutdown:
            shutdown()


class HfRunner:
    """transformers `generate` with static batches: each batch is left-padded and runs to its longest
    output; only the tokens each request asked for count as output."""

    name = "hf"

    def __init__(self, spec: dict) -> None:
        import torch
        import transformers

        self.torch = torch
        self.batch_size = spec["hf_batch_size"]
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            spec["model_dir"], dtype=getattr(torch, spec["dtype"]), local_files_only=True
        ).eval()
        # ignore_eos: never stop on EOS, and never mask it either (min_new_tokens would).
        self.model.generation_config.eos_token_id = None
        self.pad = self.model.config.pad_token_id or 0

    def generate(self, prompts: list[list[int]], out_lens: list[int], progress: bool) -> list[list[int]]:
        torch = self.torch
        from tqdm.auto import tqdm

        results: list[list[int]] = []
        starts = range(0, len(prompts), self.batch_size)
        for b in tqdm(starts, desc=f"hf batch {self.batch_size}", unit="batch", disable=not progress):
            batch, lens = prompts[b : b + self.batch_size], out_lens[b : b + self.batch_size]
            longest = max(len(p) for p in batch)
            ids = torch.full((len(batch), longest), self.pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(batch):
                ids[i, longest - len(p) :] = torch.tensor(p)
                mask[i, longest - len(p) :] = 1
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max(lens),
                    do_sample=False,
                    pad_token_id=self.pad,
                )
            results += [out[i, longest : longest + n].tolist() for i, n in enumerate(lens)]
        return results

    def versions(self) -> dict:
        import transformers

        torch = self.torch
        return {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        }

    def close(self) -> None:
        pass


RUNNERS = {"pagoda": PagodaRunner, "vllm": VllmRunner, "hf": HfRunner}


# ---------------------------------------------------------------- measurements


def measure(spec: dict) -> dict:
    if spec.get("torch_threads"):
        import torch

        torch.set_num_threads(spec["torch_threads"])
    prompts = [p for p, _ in spec["workload"]]
    out_lens = [n for _, n in spec["workload"]]
    vocab = spec["vocab_size"]

    log(f"{spec['label']}: loading {spec['model_dir']}")
    t0 = time.perf_counter()
    runner = RUNNERS[spec["engine"]](spec)
    load_s = time.perf_counter() - t0
    log(f"{spec['label']}: loaded in {load_s:.1f}s; warming up")

    # Warm-up on prompts outside the workload: every code path the timed run takes (prefill of a long
    # prompt, batched decode) runs once before the clock starts.
    warm = [fresh_prompts(spec["seed"] + 1 + i, 1, n, vocab)[0] for i, n in enumerate((24, 96, 256, 512))]
    t0 = time.perf_counter()
    runner.generate(warm, [8, 8, 8, 8], progress=False)
    warmup_s = time.perf_counter() - t0

    log(f"{spec['label']}: timed run, {len(prompts)} requests submitted at once")
    t0 = time.perf_counter()
    outputs = runner.generate(prompts, out_lens, progress=True)
    seconds = time.perf_counter() - t0
    produced = [len(o) for o in outputs]
    if produced != out_lens:
        short = sum(1 for a, b in zip(produced, out_lens, strict=True) if a != b)
        log(f"{spec['label']}: WARNING {short} requests returned a different number of tokens than asked")
    result: dict = {
        "label": spec["label"],
        "engine": spec["engine"],
        "env": spec.get("env", {}),
        "load_s": load_s,
        "warmup_s": warmup_s,
        "seconds": seconds,
        "requests": len(prompts),
        "output_tokens": sum(produced),
        "tokens_per_s": sum(produced) / seconds,
        "first_tokens": outputs[0][: spec["check_tokens"]],
    }

    if spec.get("single_stream"):
        ss = spec["single_stream"]
        length, decode_tokens = ss["prompt_len"], ss["decode_tokens"]
        fresh = iter(fresh_prompts(spec["seed"] + 100, ss["ttft_reps"] + ss["decode_reps"], length, vocab))
        log(f"{spec['label']}: single stream, TTFT of a {length}-token prompt x{ss['ttft_reps']}")
        ttfts = []
        for _ in range(ss["ttft_reps"]):
            t0 = time.perf_counter()
            runner.generate([next(fresh)], [1], progress=False)
            ttfts.append(time.perf_counter() - t0)
        ttft = statistics.median(ttfts)
        log(f"{spec['label']}: single stream, {decode_tokens} decode tokens x{ss['decode_reps']}")
        totals = []
        for _ in range(ss["decode_reps"]):
            t0 = time.perf_counter()
            runner.generate([next(fresh)], [1 + decode_tokens], progress=False)
            totals.append(time.perf_counter() - t0)
        total = statistics.median(totals)
        result["single_stream"] = {
            "prompt_len": length,
            "ttft_s": ttft,
            "ttft_samples_s": ttfts,
            "decode_tokens": decode_tokens,
            "request_s": total,
            # the first token costs one TTFT; the rest are pure decode steps
            "decode_tokens_per_s": decode_tokens / max(total - ttft, 1e-9),
        }

    result["versions"] = runner.versions()
    result["python"] = platform.python_version()
    runner.close()
    return result


def main() -> int:
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = measure(spec)
    out_path.write_text(json.dumps(result, indent=2))
    log(f"{spec['label']}: {result['tokens_per_s']:.1f} output tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
