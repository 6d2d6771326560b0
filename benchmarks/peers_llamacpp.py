"""`bench_peers.py --llamacpp`: Pagoda against llama.cpp on the default model's own GGUF file (issue 37, item 5).

llama.cpp is PyPI's llama-cpp-python (built from source into its own venv, .peers/llamacpp, on first use:
minutes of C++), run with 2 threads on the very file Pagoda loads (SmolLM2-135M-Instruct.Q4_1.gguf). Two
measurements, each engine alone, in its own process:

- one-stream decode (peers_decode.py): a 32-token prompt, then --decode-tokens (256) greedy tokens, end of
  sequence ignored; tokens/s from the first generated token to the last, median of --decode-reps (3) runs after a 16-token warm-up.
  Pagoda float32 (the engine's default on the CPU: the file dequantized at load), Pagoda bfloat16, Pagoda with
  `--quantization gguf` (the file's own Q4_1 blocks, where the engine has the flag) and llama.cpp.
- served at concurrency 1/8/32: `pagoda serve` (float32, `--quantization gguf` exact and with int8 activations)
  against llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`, which runs one request at
  a time; `--interrupt_requests False` queues the others, which by default cut the streaming one short), the
  official `openai` client streaming completions (peers_serve.load). That server takes text prompts only, so
  every server gets the same text (the serve workload's token ids decoded by the model's tokenizer) and
  re-tokenizes it; the end of sequence is suppressed (Pagoda: ignore_eos; llama.cpp: a -100 logit bias on the
  EOS id, which the GGUF names), so every request should produce its max_tokens (the table notes tokens short
  of them). llama.cpp's stream has no usage block: its output tokens are its streamed chunks, one token each.
- vLLM's CPU build on an INT4 checkpoint: `--vllm-int4 DIR` (a W4A16 checkpoint, e.g. the one
  bench_weight_accuracy.py builds) served like the others, where vLLM runs it.

Goals (issue 37): one-stream decode of the Q4 default model >= 2x Pagoda float32 and >= llama.cpp on the same
file. Every number is printed with the CPU model and the 1-minute load average; writes
bench-results/peers-llamacpp.json, peers-llamacpp-serve.json and their plots.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_peers import OFFLINE_ENV, PEERS, RESULTS, ROOT, run_logged, say
from common import plot_path, print_table, write_json
from peers_serve import SERVED_NAME, free_port, load, serve_workloads, start, stop, wait_ready

LLAMA_CPP_VERSION = "0.3.36"
DECODER = Path(__file__).resolve().with_name("peers_decode.py")
# the 32-token prompt of the one-stream decode: a fixed English sentence, tokenized by each engine's tokenizer
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle on a stormy night."


def ensure_llamacpp(install: bool) -> tuple[Path | None, str]:
    """The llama-cpp-python venv's interpreter (built on first use), or None with the reason."""
    venv = PEERS / "llamacpp"
    python = venv / "bin" / "python"
    stamp = venv / f".installed-llama-cpp-python-{LLAMA_CPP_VERSION}"
    if not stamp.exists():
        if not install:
            return None, f"llama-cpp-python is not installed in {venv} and --no-install was given"
        log_path = RESULTS / "peers-llamacpp-install.log"
        say(f"building llama-cpp-python=={LLAMA_CPP_VERSION} into {venv.relative_to(ROOT)} (C++: many minutes; "
            f"log: {log_path})")  # fmt: skip
        steps = [[sys.executable, "-m", "venv", str(venv)],
                 [str(python), "-m", "pip", "install", f"llama-cpp-python[server]=={LLAMA_CPP_VERSION}"]]  # fmt: skip
        for cmd in steps:
            if run_logged(cmd, log_path, timeout=7200) != 0:
                return None, f"installing llama-cpp-python failed; see {log_path}"
        stamp.write_text("ok\n")
    out = subprocess.run([str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                         capture_output=True, text=True, cwd="/", check=False)  # fmt: skip
    if out.returncode:
        return None, f"`import llama_cpp` fails in {venv}: {(out.stderr.strip().splitlines() or ['?'])[-1]}"
    return python, f"llama-cpp-python {out.stdout.strip()}"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def has_gguf_flag() -> bool:
    from pagoda.engine.config import EngineConfig

    return "quantization" in EngineConfig.__dataclass_fields__


def _decode(python: Path, spec: dict, label: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        before = os.getloadavg()[0]
        say(f"--- {label} (1-min load average now {before:.1f} on {os.cpu_count()} CPUs)")
        log_path = RESULTS / f"peers-llamacpp-{label.split()[0].lower()}.log"
        rc = run_logged([str(python), str(DECODER), str(spec_path), str(out_path)], log_path, timeout)
        if rc != 0 or not out_path.exists():
            return {"label": label, "error": f"exited with {rc}; see {log_path}"}
        result = json.loads(out_path.read_text())
        result.update(label=label, loadavg_1min={"before": before, "after": os.getloadavg()[0]})
        say(f"{label}: {result['decode_tokens_per_s']:.1f} decode tok/s")
        return result


def decode_comparison(
    args, gguf: Path, model_dir: Path, llama_python: Path | None, prompt: list[int]
) -> list[dict]:
    base = {
        "prompt": prompt,
        "tokens": args.decode_tokens,
        "reps": args.decode_reps,
        "threads": args.llamacpp_threads,
    }
    pagoda = {"max_model_len": args.max_model_len, "kv_cache_memory_bytes": args.kv_cache_gib << 30}
    runs = [("Pagoda float32 (dequantized at load)", Path(sys.executable),
             {**base, "engine": "pagoda", "model": str(model_dir), "pagoda": {**pagoda, "dtype": "float32"}}),
            ("Pagoda bfloat16 (dequantized at load)", Path(sys.executable),
             {**base, "engine": "pagoda", "model": str(model_dir), "pagoda": {**pagoda, "dtype": "bfloat16"}})]  # fmt: skip
    if has_gguf_flag():
        runs.append(("Pagoda --quantization gguf (Q4_1 blocks)", Path(sys.executable),
                     {**base, "engine": "pagoda", "model": str(gguf),
                      "pagoda": {**pagoda, "dtype": "float32", "quantization": "gguf"}}))  # fmt: skip
        # llama.cpp's own way: activations quantized to 8 bits per block, integer dot products
        runs.append(("Pagoda --quantization gguf, int8 activations", Path(sys.executable),
                     {**runs[-1][2], "env": {"PAGODA_GGUF_ACTIVATIONS": "int8"}}))  # fmt: skip
    if llama_python is not None:
        runs.append((f"llama.cpp ({args.llamacpp_threads} threads, Q4_1)", llama_python,
                     {**base, "engine": "llamacpp", "model": str(gguf)}))  # fmt: skip
    return [_decode(py, spec, label, args.timeout) for label, py, spec in runs]


def _decode_report(results: list[dict], meta: dict) -> dict:
    def rate(prefix: str) -> float | None:
        r = next((r for r in results if r["label"].startswith(prefix) and "decode_tokens_per_s" in r), None)
        return r["decode_tokens_per_s"] if r else None

    f32, q4, llama = rate("Pagoda float32"), rate("Pagoda --quantization gguf (Q4_1"), rate("llama.cpp")
    q4_int8 = rate("Pagoda --quantization gguf, int8")
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["label"], "failed", "", "", r["error"]])
            continue
        load = r["loadavg_1min"]
        v = r["decode_tokens_per_s"]
        rows.append([r["label"], f"{v:.1f}", f"{v / f32:.2f}x" if f32 else "", f"{v / llama:.2f}x" if llama else "",
                     f"{r['cpu_ms_per_token']:.1f}", f"{load['before']:.1f} -> {load['after']:.1f}"])  # fmt: skip
    print_table(
        f"One-stream decode, {meta['decode_tokens']} tokens after a 32-token prompt, greedy (median of {meta['decode_reps']}), "
        f"{meta['cpu']}, {os.cpu_count()} CPUs",
        [
            "engine",
            "decode tok/s",
            "vs Pagoda float32",
            "vs llama.cpp",
            "CPU ms / token",
            "load before -> after",
        ],
        rows,
    )
    goals = {
        "q4_vs_pagoda_float32": q4 / f32 if q4 and f32 else None,
        "q4_vs_llamacpp": q4 / llama if q4 and llama else None,
        "float32_vs_llamacpp": f32 / llama if f32 and llama else None,
        "q4_int8_activations_vs_llamacpp": q4_int8 / llama if q4_int8 and llama else None,
    }
    if goals["q4_vs_pagoda_float32"] is not None:
        print(f"Pagoda Q4 / Pagoda float32: {goals['q4_vs_pagoda_float32']:.2f}x (goal >= 2x)")
    if goals["q4_vs_llamacpp"] is not None:
        print(f"Pagoda Q4 / llama.cpp: {goals['q4_vs_llamacpp']:.2f}x (goal >= 1x)")
    if goals["q4_int8_activations_vs_llamacpp"] is not None:
        print(
            f"Pagoda Q4, int8 activations / llama.cpp: {goals['q4_int8_activations_vs_llamacpp']:.2f}x (goal >= 1x)"
        )
    if q4 is None:
        print("Pagoda --quantization gguf: not measured (this engine has no --quantization flag)")
    return goals


def _text_workloads(levels: list[int], seed: int, tokenizer, count: int) -> dict[int, list[tuple[str, int]]]:
    work = serve_workloads(levels, seed, tokenizer.vocab_size, count)
    return {c: [(tokenizer.decode(p), n) for p, n in reqs] for c, reqs in work.items()}


def serve_comparison(args, gguf: Path, model_dir: Path, llama_python: Path | None, meta: dict) -> dict:
    from pagoda.engine.loader import load_tokenizer
    from pagoda.engine.sizing.gguf_meta import read_gguf_meta

    levels = [int(c) for c in args.concurrency.split(",")]
    tok = load_tokenizer(model_dir)
    work = _text_workloads(levels, args.seed, tok, args.serve_requests)
    eos = int(read_gguf_meta(gguf).get("tokenizer.ggml.eos_token_id", 2))
    pagoda_bin = Path(sys.executable).parent / "pagoda"
    common_flags = ["--host", "127.0.0.1", "--served-model-name", SERVED_NAME, "--max-model-len",
                    str(args.max_model_len), "--seed", "0", "--kv-cache-memory-bytes", f"{args.kv_cache_gib}GiB"]  # fmt: skip
    servers = [("pagoda serve float32", [str(pagoda_bin), "serve", str(model_dir), "--dtype", "float32", *common_flags],
                {}, "/health", {"ignore_eos": True})]  # fmt: skip
    if has_gguf_flag():
        servers.append(("pagoda serve --quantization gguf", [str(pagoda_bin), "serve", str(gguf), "--dtype", "float32",
                        "--quantization", "gguf", *common_flags], {}, "/health", {"ignore_eos": True}))  # fmt: skip
        servers.append(("pagoda serve --quantization gguf, int8 activations", servers[-1][1],
                        {"PAGODA_GGUF_ACTIVATIONS": "int8"}, "/health", {"ignore_eos": True}))  # fmt: skip
    if llama_python is not None:
        servers.append(("llama.cpp server", [str(llama_python), "-m", "llama_cpp.server", "--model", str(gguf),
                        "--model_alias", SERVED_NAME, "--n_threads", str(args.llamacpp_threads), "--n_threads_batch",
                        str(args.llamacpp_threads), "--n_ctx", str(args.max_model_len), "--host", "127.0.0.1",
                        # queue concurrent requests: by default a new request cuts the one streaming short
                        "--interrupt_requests", "False"],
                        {}, "/v1/models", {"logit_bias": {str(eos): -100.0}}))  # fmt: skip
    if args.vllm_int4:
        from bench_peers import BOTH_CORES, ensure_vllm

        vllm_python, note = ensure_vllm(install=not args.no_install)
        if vllm_python is not None:
            servers.append((f"vllm serve {Path(args.vllm_int4).name}", [str(vllm_python), "-m",
                            "vllm.entrypoints.openai.api_server", "--model", str(Path(args.vllm_int4).resolve()), "--dtype", "bfloat16",
                            "--host", "127.0.0.1", "--served-model-name", SERVED_NAME, "--max-model-len",
                            str(args.max_model_len)], {**BOTH_CORES, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)},
                            "/health", {"ignore_eos": True}))  # fmt: skip
        else:
            say(f"vLLM on the INT4 checkpoint SKIPPED: {note}")
    runs, skipped = [], []
    for name, cmd, env, health, extra in servers:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log_path = RESULTS / f"peers-llamacpp-serve-{name.split()[0].replace('.', '')}-{len(runs)}.log"
        say(f"--- {name} on {url} (log: {log_path})")
        proc = start([*cmd, "--port", str(port)], {**OFFLINE_ENV, **env}, log_path)
        try:
            t0 = time.monotonic()
            wait_ready(proc, url, log_path, health=health)
            say(f"{name} ready after {time.monotonic() - t0:.0f}s; warming up")
            asyncio.run(load(url, [("Hello there, how are you today?", 8)] * 2, 2, extra=extra))
            for c in levels:
                before = os.getloadavg()[0]
                run = asyncio.run(load(url, work[c], c, extra=extra))
                run.update(server=name, loadavg_1min={"before": before, "after": os.getloadavg()[0]},
                           expected_tokens=sum(n for _, n in work[c]))  # fmt: skip
                runs.append(run)
        except RuntimeError as e:
            say(f"{name} FAILED: {e}")
            skipped.append(f"{name}: {e}")
        finally:
            stop(proc)
    rows = []
    for r in runs:
        peer = next(
            (p for p in runs if p["server"] == "llama.cpp server" and p["concurrency"] == r["concurrency"]),
            None,
        )
        load_ = r["loadavg_1min"]
        short = r["expected_tokens"] - r["output_tokens"] if not r["failed"] else 0
        rows.append([r["server"], r["concurrency"], f"{r['requests']}" + (f" ({r['failed']} failed)" if r["failed"] else "")
                     + (f" ({short} tokens short)" if short > 0 else ""),
                     f"{r['output_tokens_per_s']:.1f}", f"{r['tpot_mean_s'] * 1000:.1f}", f"{r['ttft_mean_s'] * 1000:.0f}",
                     f"{r['output_tokens_per_s'] / peer['output_tokens_per_s']:.2f}x" if peer else "",
                     f"{load_['before']:.1f} -> {load_['after']:.1f}"])  # fmt: skip
    print_table(
        f"Served, {meta['model_name']} (text prompts, streamed, {args.serve_requests or 'max(8, 2 x c)'} requests per "
        f"level), {meta['cpu']}, {os.cpu_count()} CPUs",
        ["server", "concurrency", "requests", "output tok/s", "TPOT mean ms", "TTFT mean ms", "vs llama.cpp",
         "load before -> after"],
        rows,
    )  # fmt: skip
    for why in skipped:
        print(f"skipped: {why}")
    name = f"{meta['results']}-llamacpp-serve"
    path = write_json(name, {"gguf": str(gguf), "model_dir": str(model_dir), "cpu": meta["cpu"], "runs": runs,
                             "skipped": skipped})  # fmt: skip
    png = _plot_serve(runs, levels, name)
    say(f"wrote {path}" + (f" and {png}" if png else ""))
    return {"runs": runs, "skipped": skipped}


def llamacpp_comparison(args, model_dir: Path, meta: dict) -> None:
    from pagoda.engine.loader import load_tokenizer
    from pagoda.engine.loader.resolve import default_model_gguf

    gguf = Path(args.gguf) if args.gguf else default_model_gguf()
    meta = {**meta, "cpu": cpu_model(), "decode_tokens": args.decode_tokens, "decode_reps": args.decode_reps}
    llama_python, note = ensure_llamacpp(install=not args.no_install)
    say(f"llama.cpp: {note}" if llama_python else f"llama.cpp SKIPPED: {note}")
    prompt = load_tokenizer(model_dir)(PROMPT, add_special_tokens=False).input_ids[:32]
    payload: dict = {"gguf": str(gguf), "model_dir": str(model_dir), "cpu": meta["cpu"], "cpus": os.cpu_count(),
                     "llamacpp": note, "prompt_tokens": len(prompt)}  # fmt: skip
    if not args.llamacpp_serve_only:
        results = decode_comparison(args, gguf, model_dir, llama_python, prompt)
        payload.update(decode=results, goals=_decode_report(results, meta))
        path = write_json(f"{meta['results']}-llamacpp", payload)
        png = _plot_decode(results, f"{meta['results']}-llamacpp", meta)
        say(f"wrote {path}" + (f" and {png}" if png else ""))
    if args.serve or args.llamacpp_serve_only:
        serve_comparison(args, gguf, model_dir, llama_python, meta)


def _plot_decode(results: list[dict], name: str, meta: dict) -> Path | None:
    ok = [r for r in results if "decode_tokens_per_s" in r]
    if not ok:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.6 * len(ok) + 1.4))
    labels = [r["label"] for r in ok][::-1]
    bars = ax.barh(labels, [r["decode_tokens_per_s"] for r in ok][::-1],
                   color=["#c0392b" if r["label"].startswith("Pagoda") else "#7f8c8d" for r in ok][::-1])  # fmt: skip
    ax.bar_label(bars, fmt="%.1f", padding=3)
    ax.set_xlabel("one-stream decode tokens / s")
    ax.set_title(f"SmolLM2-135M, {meta['decode_tokens']} tokens, {meta['cpu']}", fontsize=9)
    ax.margins(x=0.15)
    fig.tight_layout()
    path = plot_path(name)
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot_serve(runs: list[dict], levels: list[int], name: str) -> Path | None:
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for server in dict.fromkeys(r["server"] for r in runs):
        mine = sorted((r for r in runs if r["server"] == server), key=lambda r: r["concurrency"])
        ax.plot(
            [r["concurrency"] for r in mine],
            [r["output_tokens_per_s"] for r in mine],
            marker="o",
            label=server,
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens / s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = plot_path(name)
    fig.savefig(path)
    plt.close(fig)
    return path
