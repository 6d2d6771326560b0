"""Where the engine core's step goes while `pagoda serve` streams to 32 clients (issue 40 item 3).

Starts `pagoda serve` (the default model, bfloat16, the same flags `bench_peers.py --serve` gives it),
warms it up, then drives it with the served comparison's client (peers_serve.py: the official `openai`
package, streamed, greedy, `ignore_eos`; 48 requests at concurrency 32, prompts 24-512, outputs 16-256)
while py-spy samples the engine core's process (50 Hz, Python frames, idle waits left out):

    py-spy record --pid <core> --rate 50 --format raw --nonblocking --output <file> --duration <s>

Each sample goes to the first category whose rule matches a frame, innermost first (`CATEGORIES`):
linears, attention, other layer ops, sampling, step inputs, scheduling, outputs and stats, messages to the
front end, Python elsewhere. Also reported: the engine's steps during the load (from /metrics,
vllm:iteration_tokens_total's count) and ms per step, output tok/s, and the load average (the machine may be
shared), and the CPU ms per output token of the core and of the front end (process CPU time: the shared
host's load moves it far less than wall-clock). `--one-stream` profiles one offline prompt instead
(`--quantization gguf`, `--threads`, `--tokens`; best CPU and wall ms per token of `--reps` runs), and
`--native` adds C frames: the share of samples in a kernel against the interpreter and torch's dispatch.
Writes bench-results/profile-step.json (the category counts, not the trace; `--keep-trace` keeps
py-spy's file). `--server-arg` passes flags on, e.g. `--server-arg=--async-scheduling`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, print_table, write_json  # noqa: E402
from peers_serve import free_port, load, serve_workloads, start, stop, wait_ready  # noqa: E402

# (category, regular expression on one frame "function (file:line)"), tried innermost frame first.
CATEGORIES: list[tuple[str, str]] = [
    ("linears", r"cpu_linear\.py|quant|\(linear\)|forward \(.*torch/nn/modules/linear\.py"),
    ("attention", r"engine/attention/|paged_decode|paged_prefill"),
    ("messages to the front end", r"core_process\.py|msgspec|zmq"),
    ("sampling", r"sampler\.py|cpu_sampling\.py|spec_verify\.py|greedy"),
    ("layer ops (norm, activation, rotary, embedding)", r"engine/models/|cpu_ops\.py|layers\.py"),
    ("step inputs (model runner)", r"step_input\.py|model_runner\.py"),
    ("scheduling", r"scheduler\.py|engine/kv_cache/|waiting_queue\.py|structured_output"),
    ("outputs and stats", r"engine_core\.py|stats\.py|outputs\.py|request\.py"),
]
# With --native: a sample is in a kernel when one of its frames is kernel code (our C kernels' OpenMP bodies,
# oneDNN, torch's native operators and GEMMs); the rest is the interpreter, torch's dispatch and ctypes calls.
KERNEL_FRAME = re.compile(r"_omp_fn|GOMP_parallel|libgomp|dnnl::|jit_|gemm|at::native::(?!check)")
COMPUTE = ("linears", "attention", "layer ops (norm, activation, rotary, embedding)")


def categorize(stack: str) -> str:
    """The category of one collapsed stack ("outer;...;inner")."""
    for frame in reversed(stack.split(";")):
        for name, pattern in _COMPILED:
            if pattern.search(frame):
                return name
    return "Python elsewhere"


_COMPILED = [(name, re.compile(p)) for name, p in CATEGORIES]


def breakdown(trace: Path, within: str = "") -> dict[str, int]:
    """Samples per category from py-spy's raw (collapsed) output: one "stack count" per line (``within``:
    only stacks that match this regular expression). With native frames, also "in a kernel" (`KERNEL_FRAME`), a
    count across the categories."""
    counts: dict[str, int] = {}
    for line in trace.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit() and re.search(within, stack):
            cat = categorize(stack)
            counts[cat] = counts.get(cat, 0) + int(n)
            if KERNEL_FRAME.search(stack):
                counts[IN_KERNEL] = counts.get(IN_KERNEL, 0) + int(n)
    return counts


IN_KERNEL = "in a kernel (native frames only)"


def front_end_top(trace: Path, n: int = 15) -> list[tuple[str, int]]:
    """The front end's samples by their innermost frame from the project (or the innermost at all)."""
    counts: dict[str, int] = {}
    for line in trace.read_text().splitlines():
        stack, _, k = line.rpartition(" ")
        if not (stack and k.isdigit()):
            continue
        frames = stack.split(";")
        if re.search(r"select|poll", frames[-1]):  # the event loop waiting (py-spy counts it as active)
            continue
        ours = [f for f in frames if "pagoda" in f or "/engine/" in f]
        frame = re.sub(r":\d+\)$", ")", (ours or frames)[-1])
        counts[frame] = counts.get(frame, 0) + int(k)
    return sorted(counts.items(), key=lambda kv: -kv[1])[:n]


def core_pid(server_pid: int) -> int:
    """The engine core's process: the server's child that runs run_core_process (the largest in memory)."""
    import psutil

    children = psutil.Process(server_pid).children(recursive=True)
    if not children:
        raise RuntimeError("the server has no child process: is the engine core in-process (--no-...)?")
    return max(children, key=lambda p: p.memory_info().rss).pid


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of one process so far, all its threads."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def steps_so_far(url: str) -> float:
    """Engine steps that computed tokens (vllm:iteration_tokens_total's count) from /metrics."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:iteration_tokens_total_count"):
            return float(line.split()[-1])
    return float("nan")


def report(args: argparse.Namespace, counts: dict[str, int], load0: float, what: str) -> float:
    """Print the categories' samples; returns the share outside linears, attention and layer ops."""
    order = [name for name, _ in CATEGORIES] + ["Python elsewhere"]
    total = sum(counts.get(name, 0) for name in order) or 1
    rows = [[name, counts.get(name, 0), 100.0 * counts.get(name, 0) / total] for name in order]
    outside = sum(counts.get(n, 0) for n in order if n not in COMPUTE) / total
    print_table(
        f"engine core, {what}, {args.dtype}, {os.cpu_count()} CPUs, load {load0:.1f} -> {os.getloadavg()[0]:.1f}",
        ["category", "samples", "%"],
        rows,
    )
    print(f"outside linears/attention/layer ops: {100.0 * outside:.1f}% of samples")
    if IN_KERNEL in counts:
        print(
            f"in a kernel: {100.0 * counts[IN_KERNEL] / total:.1f}% of samples, the rest is interpreter and dispatch"
        )
    return outside


def one_stream_worker(args: argparse.Namespace) -> None:
    """In the profiled process: one prompt, `--tokens` greedy tokens, `--reps` times; prints CPU and wall ms
    per output token (after the first) of the best run as JSON on the last line."""
    import torch
    from pagoda.engine import LLM, SamplingParams

    kwargs: dict = {"quantization": args.quantization} if args.quantization else {}
    if args.async_scheduling:
        kwargs["async_scheduling"] = True
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, kv_cache_memory_bytes=256 << 20, **kwargs)
    torch.set_num_threads(args.threads)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompt = [1, 504, 3458, 282, 4649, 314]
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    best: dict[str, float] = {}
    for _ in range(args.reps):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        n = len(out[0].outputs[0].token_ids)
        run = {"cpu_ms_per_token": 1000 * cpu / n, "wall_ms_per_token": 1000 * wall / n, "tokens": n}
        if not best or run["cpu_ms_per_token"] < best["cpu_ms_per_token"]:
            best = run
    print(json.dumps(best))


def one_stream(args: argparse.Namespace, pyspy: str) -> int:
    """py-spy over `one_stream_worker` in a process of its own; only samples under `LLM.generate` (or, with
    async scheduling, the step thread's) count."""
    trace = RESULTS / f"{args.name}.pyspy.txt"
    worker = [sys.executable, __file__, "--one-stream-worker", "--dtype", args.dtype, "--threads",
              str(args.threads), "--tokens", str(args.tokens), "--reps", str(args.reps)]  # fmt: skip
    worker += ["--quantization", args.quantization] if args.quantization else []
    worker += ["--model", args.model] if args.model else []
    worker += ["--async-scheduling"] if args.async_scheduling else []
    cmd = [pyspy, "record", "--rate", str(args.rate), "--format", "raw", "--output", str(trace)]
    cmd += ["--native"] if args.native else []
    load0 = os.getloadavg()[0]
    done = subprocess.run([*cmd, "--", *worker], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-4000:])
        return 1
    best = json.loads(next(ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("{")))
    counts = breakdown(trace, within=r"generate \(|StepThread\._run")  # the step thread's, with async
    report(args, counts, load0, f"one stream, {args.tokens} tokens, {args.threads} thread(s)")
    print(
        f"best of {args.reps}: {best['cpu_ms_per_token']:.2f} CPU ms / token, "
        f"{best['wall_ms_per_token']:.2f} wall ms / token"
    )
    if not args.keep_trace:
        trace.unlink(missing_ok=True)
    write_json(args.name, {"worker": worker, "args": vars(args), "samples": counts, "best": best,
                           "loadavg_1min": {"before": load0, "after": os.getloadavg()[0]}})  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=7, help="workload seed (not bench-peers' held-out one)")
    ap.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument(
        "--server-arg", action="append", default=[], help="extra `pagoda serve` flag (repeatable)"
    )
    ap.add_argument("--server-env", action="append", default=[], help="K=V for `pagoda serve` (repeatable)")
    ap.add_argument("--no-profile", action="store_true", help="only the load and the step numbers")
    ap.add_argument("--keep-trace", action="store_true", help="keep py-spy's raw output in bench-results/")
    ap.add_argument("--name", default="profile-step", help="bench-results/<name>.json")
    ap.add_argument("--one-stream", action="store_true", help="offline, one prompt (see one_stream)")
    ap.add_argument("--one-stream-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quantization", default=None, help="one stream: e.g. gguf")
    ap.add_argument("--threads", type=int, default=1, help="one stream: torch threads")
    ap.add_argument("--tokens", type=int, default=256, help="one stream: output tokens")
    ap.add_argument("--reps", type=int, default=3, help="one stream: timed runs")
    ap.add_argument("--async-scheduling", action="store_true", help="one stream: the engine's option")
    ap.add_argument("--native", action="store_true", help="py-spy --native (C frames too)")
    args = ap.parse_args(argv)
    if args.one_stream_worker:
        one_stream_worker(args)
        return 0

    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not args.no_profile and not Path(pyspy).exists():
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    if args.one_stream:
        return one_stream(args, pyspy)
    from pagoda.engine.loader.resolve import resolve_model

    model_dir = resolve_model(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    RESULTS.mkdir(exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        str(Path(sys.executable).parent / "pagoda"), "serve", str(model_dir), "--host", "127.0.0.1",
        "--port", str(port), "--served-model-name", "smollm2-bench", "--dtype", args.dtype,
        "--max-model-len", str(args.max_model_len), "--seed", "0",
        "--kv-cache-memory-bytes", f"{args.kv_cache_gib}GiB", *args.server_arg,
    ]  # fmt: skip
    log_path = RESULTS / f"{args.name}-server.log"
    trace = RESULTS / f"{args.name}.pyspy.txt"
    front_trace = RESULTS / f"{args.name}.front.pyspy.txt"
    proc = start(cmd, dict(kv.split("=", 1) for kv in args.server_env), log_path)
    try:
        wait_ready(proc, url, log_path)
        asyncio.run(load(url, [([7 + i for i in range(64)], 8), ([11 + i for i in range(300)], 8)], 2))
        work = serve_workloads([args.concurrency], args.seed, vocab, args.requests)[args.concurrency]
        pid = core_pid(proc.pid)
        steps0, load0 = steps_so_far(url), os.getloadavg()[0]
        spies = []
        if not args.no_profile:
            for who, file in ((pid, trace), (proc.pid, front_trace)):
                spies.append(
                    subprocess.Popen(
                        [pyspy, "record", "--pid", str(who), "--rate", str(args.rate), "--format", "raw",
                         "--output", str(file), "--duration", "600"]
                        # py-spy reads C frames only from a stopped process: --native samples blocking
                        + (["--native"] if args.native and who == pid else ["--nonblocking"]),
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                    )
                )  # fmt: skip
            time.sleep(1.0)  # py-spy attached before the first request
        cpu0 = {"engine core": cpu_seconds(pid), "front end": cpu_seconds(proc.pid)}
        run = asyncio.run(load(url, work, args.concurrency))
        cpu = {"engine core": cpu_seconds(pid), "front end": cpu_seconds(proc.pid)}
        cpu = {k: v - cpu0[k] for k, v in cpu.items()}
        steps = steps_so_far(url) - steps0
        for spy in spies:
            spy.send_signal(2)  # SIGINT: py-spy writes what it has and exits
            spy.wait(60)
    finally:
        stop(proc)
    counts = breakdown(trace) if not args.no_profile else {}
    front = front_end_top(front_trace) if not args.no_profile else []
    if not args.keep_trace:
        trace.unlink(missing_ok=True)
        front_trace.unlink(missing_ok=True)
    what = f"{args.requests} streamed requests at concurrency {args.concurrency}"
    outside = report(args, counts, load0, what)
    ms_per_step = 1000 * run["seconds"] / steps if steps else float("nan")
    print(
        f"{run['output_tokens_per_s']:.1f} tok/s, {steps:.0f} steps, {ms_per_step:.1f} ms per step, "
        f"TPOT {1000 * run['tpot_mean_s']:.1f} ms"
    )
    tokens = run["output_tokens"] or 1
    print(
        "CPU ms per output token: "
        + ", ".join(f"{k} {1000 * v / tokens:.2f}" for k, v in cpu.items())
        + f" (over {run['seconds']:.1f} s)"
    )
    if front:
        print("front end, innermost project frames (samples):")
        for frame, n in front:
            print(f"  {n:6d}  {frame}")
    path = write_json(
        args.name,
        {
            "command": cmd,
            "args": vars(args),
            "samples": counts,
            "outside_compute_share": outside,
            "cpu_seconds": cpu,
            "front_end_top": front,
            "steps": steps,
            "ms_per_step": ms_per_step,
            "loadavg_1min": {"before": load0, "after": os.getloadavg()[0]},
            "run": run,
        },
    )
    print(f"wrote {path}")
    return 0 if run["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
