"""`pagoda generate "prompt"`: load a model, generate one completion, print it."""

from __future__ import annotations

import argparse
import sys

from pagoda.engine.config import KV_CACHE_DTYPES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagoda generate", description="Generate a completion and print it.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument(
        "--model",
        default=None,
        help="HF directory, GGUF file or hub id with a local copy (default: embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--chat", action="store_true", help="apply the model's chat template to the prompt (a user message)"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache element type (int8: per-token scales, any device; fp8 needs compute capability 8.9+)",
    )
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from pagoda.engine.frontend.llm import LLM
    from pagoda.engine.sampling_params import SamplingParams
    from pagoda.engine.sizing.errors import SizingError

    try:
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop, max_tokens=args.max_tokens,
        )  # fmt: skip
        llm = LLM(
            args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes, attention_backend=args.attention_backend,
            kv_cache_dtype=args.kv_cache_dtype,
        )  # fmt: skip
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
        else:
            out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    except (ValueError, SizingError, FileNotFoundError) as exc:
        print(f"pagoda generate: {exc}", file=sys.stderr)
        return 2
    for comp in out.outputs:
        if len(out.outputs) > 1:
            print(f"--- sample {comp.index} ({comp.finish_reason})")
        print(comp.text)
    return 0
