"""Speculative decoding (n-gram prompt lookup, a draft model) on and off, on two workloads, at concurrency
1, 8 and 32.

- edit: "fix the typos in this paragraph" prompts (about 170 tokens of text each, different per request):
  the answer copies its input, so n-gram proposals mostly hit;
- chat: open questions: the answer copies nothing, so proposals mostly miss (or are not made).

Each configuration runs in this process on the default model (SmolLM2-135M-Instruct, float32, CPU),
greedy with ignore_eos, every request of a round submitted at once (concurrency = requests in flight =
max_num_seqs); tok/s = generated tokens / wall time of the round (prefill included, the same in both
modes), and tokens per process CPU second (steadier on a shared machine): medians of --rounds rounds per
mode, run alternately. Greedy output is identical with and without speculation (checked here too). The
n-gram config is this script's --spec: ngram, 4 tokens, n-gram sizes 2-5, turned off above 4 running
sequences (the engine's default schedule). The draft-model config (--draft-spec) proposes 4 tokens on the
same schedule with --draft: "gguf" (the default) is the default model's own GGUF file with its blocks kept
quantized (`quantization: gguf`: the float32 target is that file dequantized, so the draft agrees with it
almost always and costs a 4-bit model's weight reads), "layers:N" a draft cut from the default model's
first N layers (built into bench-results/, never committed). Writes bench-results/spec.json and spec.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import plot_path, print_table, pyplot, save_plot, write_json  # noqa: E402
from pagoda.engine import SamplingParams  # noqa: E402
from pagoda.engine.config import EngineConfig  # noqa: E402
from pagoda.engine.frontend.llm_engine import LLMEngine  # noqa: E402
from pagoda.engine.loader import resolve_model  # noqa: E402
from pagoda.engine.loader.gguf_quant import gguf_source  # noqa: E402
from pagoda.engine.spec_decode.layer_draft import write_layer_draft  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
DRAFT_SPEC = {"method": "draft_model", "num_speculative_tokens": 4}  # model: the layer draft built here
SUBJECTS = [
    "the harbour town", "a mountain railway", "the old library", "a river delta", "the night market",
    "a desert observatory", "the glass factory", "a fishing village", "the city orchestra", "a lighthouse",
]  # fmt: skip
PARAGRAPH = (
    "Every mornig the people of {s} wake up early and walk down to the square, where the baker has already "
    "opend his shop and the smell of fresh bread fills the streets. The children run to school wiht their "
    "bags, the old men sit on the benches and talk about the wether, and the shopkeepers sweep the "
    "pavement in front of there doors. In the afternon the square is quiet, but in the evening it fills "
    "again with musik and the sound of people laughing untill late at night."
)
QUESTIONS = [
    "What are three good habits for staying healthy?", "Explain why the sky is blue.",
    "Give me an idea for a birthday present for a friend who likes hiking.", "How does a bicycle work?",
    "Write a short poem about autumn.", "What should I know before adopting a cat?",
    "Describe a perfect weekend.", "Why do people learn foreign languages?",
]  # fmt: skip


def prompts(workload: str, n: int) -> list[str]:
    if workload == "edit":
        return [
            "Fix the spelling mistakes in this paragraph and write the corrected paragraph.\n\nParagraph: "
            + PARAGRAPH.format(s=SUBJECTS[i % len(SUBJECTS)])
            + "\n\nCorrected paragraph: Every morning"
            for i in range(n)
        ]
    return [QUESTIONS[i % len(QUESTIONS)] + f" (answer {i})" for i in range(n)]


def run_round(eng: LLMEngine, texts: list[str], max_tokens: int) -> tuple[float, float, int, list[list[int]]]:
    """(wall seconds, process CPU seconds, tokens generated, each request's tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out: dict[str, list[int]] = {}
    start, cpu = time.perf_counter(), time.process_time()
    for i, text in enumerate(texts):
        eng.add_request(f"r{i}", text, params)
    while eng.has_unfinished_requests():
        for delta in eng.step():
            for c in delta.outputs:
                out.setdefault(delta.request_id, []).extend(c.token_ids)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = [out[f"r{i}"] for i in range(len(texts))]
    return elapsed, cpu, sum(len(t) for t in tokens), tokens


class Accept:
    """Counts proposals and accepted tokens (a stat logger)."""

    def __init__(self) -> None:
        self.proposed = self.accepted = 0

    def record(self, scheduler_stats, it) -> None:
        if it.spec_decoding is not None:
            self.proposed += it.spec_decoding.num_draft_tokens
            self.accepted += it.spec_decoding.num_accepted_tokens


def run_vllm(args: argparse.Namespace, rows: list[list]) -> dict | None:
    """The same rounds through vLLM's CPU build (its own venv, a subprocess); adds its rows to ``rows``."""
    import subprocess
    import tempfile

    from pagoda.engine.loader import resolve_model

    rounds = {f"{w}@{c}": prompts(w, c) for w in args.workloads for c in args.concurrency}
    spec = {
        "model_dir": str(resolve_model(None)),
        "max_tokens": args.max_tokens,
        "speculative_config": json.loads(args.spec),
        "rounds": rounds,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    # a KV cache of its own size: vLLM's CPU default reserves 92% of host memory, refused where it is not free
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "2",
    }
    worker = Path(__file__).resolve().parent / "peers_spec_worker.py"
    proc = subprocess.run([str(args.vllm), str(worker), f.name], capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        print(f"vLLM failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return {"error": proc.stderr[-3000:]}
    out = json.loads(line[len("RESULT ") :])
    for key in rounds:
        w, c = key.split("@")
        off, on = out["off"][key], out["on"][key]
        same = on.pop("tokens") == off.pop("tokens")
        rows.append(
            [
                "vllm ngram",
                w,
                int(c),
                off["tok_s"],
                on["tok_s"],
                on["tok_s"] / off["tok_s"],
                "-",
                "-",
                "-",
                same,
                "-",
            ]
        )
    return out


def draft_model(kind: str) -> dict:
    """The draft's keys of the speculative config for --draft."""
    if kind == "gguf":
        source = gguf_source(resolve_model(None))
        if source is None:
            raise SystemExit("--draft gguf: the default model is not a GGUF file's conversion here")
        return {"model": str(source), "quantization": "gguf"}
    if kind.startswith("layers:"):
        n = int(kind.split(":", 1)[1])
        draft = Path("bench-results") / f"spec-draft-{n}-layers"
        write_layer_draft(resolve_model(None), draft, n)
        return {"model": str(draft.resolve())}
    raise SystemExit(f"--draft must be gguf or layers:N, got {kind!r}")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workloads", nargs="+", default=["edit", "chat"])
    ap.add_argument("--spec", default=json.dumps(SPEC), help="the --speculative-config JSON to compare")
    ap.add_argument(
        "--draft-spec", default=json.dumps(DRAFT_SPEC), help="the draft model's config (no model)"
    )
    ap.add_argument(
        "--draft",
        default="gguf",
        help='the draft model: "gguf" (the default model\'s GGUF file kept quantized) or "layers:N" (its first N '
        "layers)",
    )
    ap.add_argument("--proposers", nargs="+", default=["ngram", "draft"], choices=["ngram", "draft"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per mode (alternating); medians reported")
    ap.add_argument(
        "--vllm",
        type=Path,
        default=None,
        help="the vLLM CPU venv's python (.peers/vllm/bin/python): run the same rounds through vLLM with the "
        "same --speculative-config",
    )
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    base = dict(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=max(args.concurrency))
    specs = {
        "ngram": args.spec,
        "draft": json.dumps({**json.loads(args.draft_spec), **draft_model(args.draft)}),
    }
    specs = {name: specs[name] for name in args.proposers if name in specs}
    modes = ["off", *specs]
    engines, accepts = {}, {name: Accept() for name in specs}
    for mode in modes:
        cfg = EngineConfig(**base, speculative_config=specs.get(mode))
        engines[mode] = LLMEngine(cfg, stat_loggers=[accepts[mode]] if mode in accepts else None)
        run_round(engines[mode], ["Hello"], 4)  # warm-up
    rows, results = [], []
    for workload in args.workloads:
        for conc in args.concurrency:
            texts = prompts(workload, conc)
            load = os.getloadavg()[0]
            res, runs = {}, {mode: [] for mode in modes}
            before = {name: (a.proposed, a.accepted) for name, a in accepts.items()}
            for r in range(args.rounds):  # rotating, so a change in the machine's load hits every mode
                for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                    elapsed, cpu, n_tokens, tokens = run_round(engines[mode], texts, args.max_tokens)
                    runs[mode].append((elapsed, cpu, n_tokens))
                    res.setdefault(mode, {"outputs": tokens})
            for mode in modes:
                walls = sorted(n / e for e, _, n in runs[mode])
                cpus = sorted(n / c for _, c, n in runs[mode])
                res[mode].update(
                    tok_s=walls[len(walls) // 2],
                    tok_per_cpu_s=cpus[len(cpus) // 2],
                    runs=[{"seconds": e, "cpu_seconds": c, "tokens": n} for e, c, n in runs[mode]],
                )
            off = res["off"]
            for name in specs:
                on = res[name]
                proposed = accepts[name].proposed - before[name][0]
                accepted = accepts[name].accepted - before[name][1]
                on["acceptance"] = accepted / proposed if proposed else None
                on["proposed"] = proposed // args.rounds
                on["same_output"] = on["outputs"] == off["outputs"]
                speedup = on["tok_s"] / off["tok_s"]
                cpu_speedup = on["tok_per_cpu_s"] / off["tok_per_cpu_s"]
                acc = on["acceptance"]
                rows.append([
                    name, workload, conc, off["tok_s"], on["tok_s"], speedup, cpu_speedup,
                    "-" if acc is None else f"{acc:.0%}", on["proposed"], on["same_output"], f"{load:.1f}",
                ])  # fmt: skip
                print(rows[-1], flush=True)
            for mode in modes:
                res[mode].pop("outputs")
            # "on" stays the n-gram result (the earlier files' key); each proposer under its own name too
            results.append(
                dict(
                    workload=workload,
                    concurrency=conc,
                    load_avg=load,
                    same_output=all(res[name]["same_output"] for name in specs),
                    on=res.get("ngram"),
                    **res,
                )
            )
    if args.vllm is not None:
        results_vllm = run_vllm(args, rows)
    else:
        results_vllm = None
    headers = [
        "proposer", "workload", "conc", "off tok/s", "on tok/s", "speedup (wall)", "speedup (CPU time)", "accepted",
        "proposed", "same output", "load avg",
    ]  # fmt: skip
    print_table("speculative decoding, SmolLM2-135M float32, CPU", headers, rows)
    path = write_json(
        "spec",
        {
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "threads": args.threads or None,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "spec": json.loads(args.spec),
            "specs": {name: json.loads(v) for name, v in specs.items()},
            "results": results,
            "vllm": results_vllm,
        },
    )
    print(f"wrote {path}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for workload in args.workloads:
            pts = [r for r in results if r["workload"] == workload]
            for name in specs:
                ax.plot(
                    [r["concurrency"] for r in pts],
                    [r[name]["tok_s"] / r["off"]["tok_s"] for r in pts],
                    marker="o",
                    label=f"{name} {workload}",
                )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("tok/s with / without speculation")
        ax.legend()
        save_plot(fig, "spec")
        print(f"plot: {plot_path('spec')}")
    for eng in engines.values():
        eng.core.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
