"""vLLM's side of bench_spec.py, run by the vLLM CPU venv's Python: the same prompts and greedy settings
with and without the same --speculative-config, one LLM per mode; prints one JSON line of results.

    .peers/vllm/bin/python benchmarks/peers_spec_worker.py SPEC_JSON_FILE
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    out = {}
    for mode in ("off", "on"):
        kwargs = {"speculative_config": spec["speculative_config"]} if mode == "on" else {}
        llm = LLM(model=spec["model_dir"], dtype="float32", max_model_len=512, seed=0, **kwargs)
        llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
        rounds = {}
        for key, prompts in spec["rounds"].items():
            start = time.perf_counter()
            res = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = [list(o.outputs[0].token_ids) for o in res]
            rounds[key] = {"seconds": elapsed, "tok_s": sum(map(len, tokens)) / elapsed, "tokens": tokens}
        out[mode] = rounds
        shutdown = getattr(getattr(llm, "llm_engine", None), "shutdown", None)
        if shutdown:
            shutdown()
        del llm
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
