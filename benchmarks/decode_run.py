"""One greedy decode workload through the offline engine, timed: the parallelism benches' common run.

Every request gets its first token before decode timing starts (prefill is timed apart); the first request's
first tokens come back so that runs of different sizes can be checked to agree.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from pagoda.engine import LLM, SamplingParams


def timed_decode(
    args: argparse.Namespace, label: str, on_decode_start: Callable[[Any], None] | None = None, **engine: Any
) -> tuple[Any, dict]:
    """(the open engine, its numbers) for ``args.batch`` prompts of ``args.prompt_len`` tokens decoded to
    ``args.output_len`` each; ``on_decode_start(engine)`` runs once every request has its first token. The
    caller closes the engine (after reading what else it wants from it)."""
    llm = LLM(
        args.model,
        device=args.device,
        max_model_len=args.prompt_len + args.output_len + 16,
        **({"kv_cache_memory_bytes": args.kv_cache_memory_bytes} if args.kv_cache_memory_bytes else {}),
        **engine,
    )
    prompts = [[(7 * i + 13 * j) % 20000 + 100 for j in range(args.prompt_len)] for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"{label}-{i}", None, params, prompt_token_ids=p)
    first: dict[str, float] = {}
    tokens: list[int] = []
    start = time.perf_counter()
    decode_start = None
    decoded = 0
    while eng.has_unfinished_requests():
        for delta in eng.step():
            n = sum(len(c.token_ids) for c in delta.outputs)
            if delta.request_id not in first:
                first[delta.request_id] = time.perf_counter()
            elif decode_start is not None:
                decoded += n
            if delta.request_id == f"{label}-0":
                tokens.extend(delta.outputs[0].token_ids)
        if decode_start is None and len(first) == args.batch:
            decode_start = time.perf_counter()
            if on_decode_start is not None:
                on_decode_start(eng)
    end = time.perf_counter()
    return (
        eng,
        {
            "decode_tokens_per_s": decoded / max(end - (decode_start or end), 1e-9),
            "seconds": end - start,
            "prefill_seconds": (decode_start or end) - start,  # until every request has its first token
            "first_tokens": tokens[:16],
        },
    )
