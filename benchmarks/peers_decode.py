"""One-stream decode of one engine in its own process (bench_peers.py's llama.cpp comparison runs it).

    python peers_decode.py SPEC.json OUT.json

SPEC: {"engine": "pagoda" | "llamacpp", "model": path, "prompt": [token ids], "tokens": 256, "reps": 3,
"threads": 2, "pagoda": {EngineConfig fields}}. Each rep prefills the prompt, then decodes `tokens` greedy
tokens (end-of-sequence ignored) on a fresh sequence; the clock of the decode runs from the first generated
token to the last, so the rate is (tokens - 1) / that time, the prefill excluded, measured the same way in both
engines (Pagoda: its engine stepped one decode step at a time; llama.cpp: llama-cpp-python's `Llama.generate`
iterator, which feeds one token per `eval`). Runs in the engine's own venv: llama-cpp-python lives in
.peers/llamacpp, never in the project's.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def pagoda_stream(spec: dict) -> tuple[list[list[float]], list[int], dict]:
    from pagoda.engine import SamplingParams
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.frontend.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=spec["model"], device="cpu", seed=0, **spec.get("pagoda", {})))
    runs, tokens = [], []
    for rep in range(spec["reps"] + 1):  # the first, shorter, is the warm-up
        n = spec["tokens"] if rep else min(16, spec["tokens"])
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request(f"r{rep}", None, params, prompt_token_ids=list(spec["prompt"]))
        stamps, got = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():  # each output carries the tokens new since the last step
                now = (time.perf_counter(), time.process_time())
                new = list(out.outputs[0].token_ids)
                stamps.extend([now] * len(new))
                got.extend(new)
        tokens = got
        if rep:
            runs.append(stamps)
    from importlib.metadata import version

    info = {"pagoda": version("pagoda"), "torch": version("torch"), "config": spec.get("pagoda", {})}
    engine.close()
    return runs, tokens, info


def llamacpp_stream(spec: dict) -> tuple[list[list[float]], list[int], dict]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=spec["model"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                          n_ctx=1024, n_batch=512, verbose=False, seed=0)  # fmt: skip
    runs, tokens = [], []
    for rep in range(spec["reps"] + 1):
        llm.reset()
        stamps, got = [], []
        for tok in llm.generate(list(spec["prompt"]), temp=0.0, top_k=1, reset=True):
            stamps.append((time.perf_counter(), time.process_time()))
            got.append(int(tok))
            if len(got) == (spec["tokens"] if rep else min(16, spec["tokens"])):
                break
        tokens = got
        if rep:
            runs.append(stamps)
    info = {
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(),
    }
    return runs, tokens, info


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.update(spec.get("env", {}))  # before pagoda is imported: e.g. PAGODA_GGUF_ACTIVATIONS
    if spec["engine"] == "pagoda":
        import torch

        torch.set_num_threads(spec["threads"])
        runs, tokens, info = pagoda_stream(spec)
    else:
        runs, tokens, info = llamacpp_stream(spec)
    # wall-clock tokens/s, and the process's CPU time per token: on a busy host the second is what the engine
    # costs (a descheduled thread of a team stalls the wall clock, not the CPU time)
    rates = [(len(s) - 1) / (s[-1][0] - s[0][0]) for s in runs if len(s) > 1]
    cpu_ms = [1000 * (s[-1][1] - s[0][1]) / (len(s) - 1) for s in runs if len(s) > 1]
    result = {
        "engine": spec["engine"],
        "model": spec["model"],
        "tokens": spec["tokens"],
        "decode_tokens_per_s": statistics.median(rates),
        "decode_tokens_per_s_runs": rates,
        "cpu_ms_per_token": statistics.median(cpu_ms),
        "cpu_ms_per_token_runs": cpu_ms,
        "first_tokens": tokens[:32],
        "versions": info,
        "python": platform.python_version(),
    }
    Path(sys.argv[2]).write_text(json.dumps(result, indent=2))
    print(f"{spec['engine']}: {result['decode_tokens_per_s']:.1f} decode tok/s (runs {rates})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
