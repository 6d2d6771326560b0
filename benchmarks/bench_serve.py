"""Serving benchmark in the style of vLLM's benchmark_serving: real `pagoda serve` processes under load.

Two servers run side by side in the same run: prefix caching on (the default) and
`--no-enable-prefix-caching` (the baseline). Each gets:

- a synthetic mixed-length workload (random prompt and output lengths) at a sweep of concurrencies;
- a shared-prefix workload: 64 requests sharing a 1,000-token system prompt plus a short unique question.

Reported per run: request and output-token throughput, TTFT and ITL mean/p50/p90/p99 (streamed, so TTFT is
what a client sees). Writes bench-results/bench_serve.json and bench_serve.png and prints a table.
Target: with prefix caching the shared-prefix mean TTFT is at least 5x lower than without.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench-results"
PAGODA = str(Path(sys.executable).parent / "pagoda")


@dataclass
class RequestSpec:
    prompt: list[int]
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, caching: bool, log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [PAGODA, "serve", "--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning"]
    if args.model:
        cmd.append(args.model)
    cmd += ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs)]
    if args.kv_cache_memory_bytes:
        cmd += ["--kv-cache-memory-bytes", args.kv_cache_memory_bytes]
    cmd += ["--enable-prefix-caching" if caching else "--no-enable-prefix-caching", *args.server_arg]
    log = open(log_dir / f"server-{'cache' if caching else 'nocache'}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server at {url} exited with {proc.returncode}; see bench-results/server-*.log")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"server at {url} did not become healthy in {timeout}s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---------------------------------------------------------------- workloads


def token_pool(url: str) -> list[int]:
    """Ordinary word tokens (no specials), so random prompts tokenize like text would."""
    words = (
        "the of and to in is was for on that with as by at from his her it an are were which be this".split()
    )
    text = " ".join(words * 4)
    ids = httpx.post(
        url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60
    ).json()["tokens"]
    return sorted(set(ids))


def mixed_workload(
    pool: list[int], n: int, rng: random.Random, max_prompt: int, max_out: int
) -> list[RequestSpec]:
    return [
        RequestSpec([rng.choice(pool) for _ in range(rng.randint(16, max_prompt))], rng.randint(4, max_out))
        for _ in range(n)
    ]


def shared_prefix_workload(
    pool: list[int], n: int, prefix_len: int, rng: random.Random, out: int
) -> list[RequestSpec]:
    prefix = [rng.choice(pool) for _ in range(prefix_len)]
    return [
        RequestSpec(prefix + [rng.choice(pool) for _ in range(rng.randint(12, 24))], out) for _ in range(n)
    ]


# ---------------------------------------------------------------- load generator


async def one_request(client: httpx.AsyncClient, spec: RequestSpec) -> RequestResult:
    body = {
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last = None
    res = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.ok = last is not None
    except httpx.HTTPError as exc:
        res.error = repr(exc)
    return res


async def run_load(
    url: str, specs: list[RequestSpec], concurrency: int, desc: str
) -> tuple[list[RequestResult], float]:
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(specs), desc=desc, leave=False)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:

        async def guarded(spec: RequestSpec) -> RequestResult:
            async with sem:
                r = await one_request(client, spec)
                bar.update(1)
                return r

        start = time.perf_counter()
        results = await asyncio.gather(*(guarded(s) for s in specs))
        duration = time.perf_counter() - start
    bar.close()
    return results, duration


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    itls = [x for r in ok for x in r.itls]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration
        if duration
        else 0.0,
    }
    for name, vals in (("ttft", ttfts), ("itl", itls), ("e2e", [r.e2e for r in ok])):
        summary[f"mean_{name}_ms"] = 1000 * statistics.fmean(vals) if vals else float("nan")
        for p in (50, 90, 99):
            summary[f"p{p}_{name}_ms"] = 1000 * pct(vals, p)
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["first_error"] = errors[0]
    return summary


# ---------------------------------------------------------------- report


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="pagoda serve benchmark")
    cols = ["workload", "prefix_caching", "concurrency", "requests", "failed", "request_throughput",
            "output_throughput", "mean_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
            "mean_itl_ms", "p50_itl_ms", "p90_itl_ms", "p99_itl_ms"]  # fmt: skip
    for c in cols:
        table.add_column(c.replace("_", " "), justify="right")
    for row in rows:
        table.add_row(*[f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in cols])
    Console(width=220).print(table)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    shared = [r for r in rows if r["workload"] == "shared-prefix"]
    labels = ["caching on" if r["prefix_caching"] else "caching off" for r in shared]
    x = range(len(shared))
    for i, key in enumerate(("mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms")):
        ax1.bar(
            [xi + i * 0.25 for xi in x], [r[key] for r in shared], width=0.25, label=key.replace("_", " ")
        )
    ax1.set_xticks([xi + 0.25 for xi in x], labels)
    ax1.set_ylabel("TTFT (ms)")
    ax1.set_yscale("log")
    ax1.set_title("shared 1,000-token prefix: time to first token")
    ax1.legend()
    for caching in (True, False):
        mixed = sorted(
            (r for r in rows if r["workload"] == "mixed" and r["prefix_caching"] == caching),
            key=lambda r: r["concurrency"],
        )
        ax2.plot([r["concurrency"] for r in mixed], [r["output_throughput"] for r in mixed], marker="o",
                 label=f"caching {'on' if caching else 'off'}")  # fmt: skip
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("output tokens/s")
    ax2.set_title("mixed-length workload: throughput")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def save_partial(out: Path, rows: list[dict]) -> None:
    """Runs finished so far, so an interrupted benchmark still leaves its numbers."""
    (out / "bench_serve.partial.json").write_text(json.dumps(rows, indent=2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="mixed-workload sweep")
    p.add_argument("--shared-concurrency", type=int, default=8)
    p.add_argument("--num-mixed", type=int, default=16)
    p.add_argument("--num-shared", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--max-prompt", type=int, default=384)
    p.add_argument("--max-output", type=int, default=32)
    p.add_argument("--shared-output", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory-bytes", default="256MiB")
    p.add_argument(
        "--server-arg", action="append", default=[], help="extra flag for both servers (repeatable)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    servers = {}
    try:
        for caching in (True, False):
            servers[caching] = start_server(args, caching, args.out)
        for proc, url in servers.values():
            wait_healthy(proc, url)
        pool = token_pool(servers[True][1])
        rows: list[dict] = []
        for caching, (_, url) in servers.items():
            rng = random.Random(args.seed)
            shared = shared_prefix_workload(
                pool, args.num_shared + 1, args.prefix_len, rng, args.shared_output
            )
            # Fresh prompts per concurrency level: a repeat would hit the prefix cache of the previous pass.
            mixed_sets = [
                mixed_workload(pool, args.num_mixed, rng, args.max_prompt, args.max_output)
                for _ in args.concurrency
            ]
            tag = "on" if caching else "off"
            # One warm-up request (both servers): fills the cache where there is one, loads lazy paths everywhere.
            asyncio.run(run_load(url, shared[:1], 1, f"warm-up caching {tag}"))
            results, duration = asyncio.run(
                run_load(url, shared[1:], args.shared_concurrency, f"shared-prefix caching {tag}")
            )
            rows.append(
                {
                    "workload": "shared-prefix",
                    "prefix_caching": caching,
                    "concurrency": args.shared_concurrency,
                    **summarize(results, duration),
                }
            )
            save_partial(args.out, rows)
            for c, mixed in zip(args.concurrency, mixed_sets, strict=True):
                results, duration = asyncio.run(run_load(url, mixed, c, f"mixed c={c} caching {tag}"))
                rows.append(
                    {
                        "workload": "mixed",
                        "prefix_caching": caching,
                        "concurrency": c,
                        **summarize(results, duration),
                    }
                )
                save_partial(args.out, rows)
    finally:
        for proc, _ in servers.values():
            stop(proc)

    on = next(r for r in rows if r["workload"] == "shared-prefix" and r["prefix_caching"])
    off = next(r for r in rows if r["workload"] == "shared-prefix" and not r["prefix_caching"])
    speedup = off["mean_ttft_ms"] / on["mean_ttft_ms"] if on["mean_ttft_ms"] else float("nan")
    verdict = {"shared_prefix_mean_ttft_speedup": speedup, "target": 5.0, "met": bool(speedup >= 5.0)}
    print_table(rows)
    print(f"shared-prefix mean TTFT: {on['mean_ttft_ms']:.1f} ms with caching vs {off['mean_ttft_ms']:.1f} ms "
          f"without -> {speedup:.1f}x lower (target >= 5x: {'met' if verdict['met'] else 'NOT met'})")  # fmt: skip
    meta = {"args": {k: str(v) for k, v in vars(args).items()}, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (args.out / "bench_serve.json").write_text(
        json.dumps({"meta": meta, "verdict": verdict, "runs": rows}, indent=2)
    )
    plot(rows, args.out / "bench_serve.png")
    print(f"wrote {args.out / 'bench_serve.json'} and {args.out / 'bench_serve.png'}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
