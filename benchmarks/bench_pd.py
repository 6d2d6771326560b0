"""Prefill/decode disaggregation against aggregated serving: two `pagoda serve` processes, one mixed workload.

    make bench-pd                  # or: python benchmarks/bench_pd.py [--quick] [--model DIR]

Two engines (the default model, float32, CPU, one thread each), both started with
``--kv-transfer-config '{"kv_role": "kv_both"}'`` so the same two processes serve both modes:

- aggregated: the requests alternate between the two engines, each prefills and decodes its own;
- disaggregated: every request goes to engine B with ``x-prefiller-host-port`` naming engine A (as
  `pagoda router --prefill-backend` sends them): A prefills, B fetches the blocks over TCP and decodes.

Workload, the same in both modes (fresh prompts per mode, prefix caches reset): ``--chat-clients`` clients
each send ``--chat-requests`` chat-sized requests (``--chat-prompt`` prompt tokens, ``--chat-output`` output
tokens, streamed), while one client sends ``--long-requests`` long-prompt requests (``--long-prompt`` tokens,
``--long-output`` output tokens) ``--long-gap`` seconds apart. Reported: the chat requests' time per output
token (TPOT, from their streams: (last token - first token) / (tokens - 1)) p50/p90, the long requests'
TTFT p50/p90, wall time, and for the disaggregated run the transfer's bytes, fetch seconds and bytes/s (from
the decode engine's pagoda:kv_transfer_* metrics). Then one isolated transfer of a ``--long-prompt`` prompt's
blocks, fetched from the bench process, for the raw rate. Table, bench-results/bench_pd.json and
bench_pd.png.

On a small shared CPU host the numbers are indicative only: both processes share the same cores, so
disaggregation cannot add compute here; what it changes is who waits for the long prefills.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, pyplot, save_plot, write_json  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from pagoda_testkit.processes import free_port, wait_healthy  # noqa: E402

PAGODA = str(Path(sys.executable).parent / "pagoda")


class Engine:
    def __init__(self, args: argparse.Namespace, log_dir: Path, name: str, kv_port: int) -> None:
        self.name = name
        self.port = free_port()
        self.kv_port = kv_port
        self.log_path = log_dir / f"{name}.log"
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
        env.pop("PAGODA_API_KEY", None)
        kv = {"kv_role": "kv_both", "kv_port": kv_port, "kv_ip": "127.0.0.1"}
        argv = [PAGODA, "serve", *([args.model] if args.model else []), "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--kv-cache-memory-bytes", args.kv_cache_memory, "--max-model-len"]
        argv += [str(args.long_prompt + 64), "--uvicorn-log-level", "warning", "--disable-log-stats"]
        argv += ["--kv-transfer-config", json.dumps(kv)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=30).text):
            for s in fam.samples:
                if s.name.startswith("pagoda:kv_transfer"):
                    key = s.name + ("" if "reason" not in s.labels else f"{{{s.labels['reason']}}}")
                    out[key] = out.get(key, 0.0) + s.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def stream(
    client: httpx.AsyncClient, url: str, headers: dict, prompt: list[int], max_tokens: int
) -> tuple[float, list[float]]:
    """(seconds from send to the first token, the arrival time of every token) of one streamed completion."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError("no tokens streamed")
    return arrivals[0] - start, arrivals


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def workload(args: argparse.Namespace, a: Engine, b: Engine, disaggregated: bool, seed: int) -> dict:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(200, 40000) for _ in range(n)]

    chat_tpot: list[float] = []
    chat_ttft: list[float] = []
    long_ttft: list[float] = []
    header = {"x-prefiller-host-port": f"127.0.0.1:{a.port}"}

    def target(i: int) -> tuple[str, dict]:
        if disaggregated:
            return b.url, header
        return (a.url if i % 2 == 0 else b.url), {}

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:

        async def chat(k: int) -> None:
            for j in range(args.chat_requests):
                url, h = target(k + j)
                ttft, arrivals = await stream(client, url, h, ids(args.chat_prompt), args.chat_output)
                chat_ttft.append(ttft)
                if len(arrivals) > 1:
                    chat_tpot.append((arrivals[-1] - arrivals[0]) / (len(arrivals) - 1))

        async def long() -> None:
            for j in range(args.long_requests):
                await asyncio.sleep(args.long_gap)
                url, h = target(j)
                ttft, _ = await stream(client, url, h, ids(args.long_prompt), args.long_output)
                long_ttft.append(ttft)

        start = time.perf_counter()
        await asyncio.gather(*(chat(k) for k in range(args.chat_clients)), long())
        wall = time.perf_counter() - start
    return {
        "mode": "disaggregated" if disaggregated else "aggregated",
        "chat_tpot_p50_s": percentile(chat_tpot, 0.5),
        "chat_tpot_p90_s": percentile(chat_tpot, 0.9),
        "chat_ttft_p50_s": percentile(chat_ttft, 0.5),
        "long_ttft_p50_s": percentile(long_ttft, 0.5),
        "long_ttft_p90_s": percentile(long_ttft, 0.9),
        "wall_s": wall,
        "chat_requests": len(chat_tpot),
        "long_requests": len(long_ttft),
    }


def isolated_transfer(a: Engine, prompt_len: int, repeats: int) -> dict:
    """Prefill one long prompt on A with do_remote_decode, fetch its blocks here: bytes and seconds."""
    from pagoda.engine.kv_transfer.wire import fetch_blocks

    rates, sizes, seconds = [], [], []
    rng = random.Random(99)
    for _ in range(repeats):
        prompt = [rng.randrange(200, 40000) for _ in range(prompt_len)]
        body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        answer = httpx.post(a.url + "/v1/completions", json=body, timeout=600).json()
        params = answer["kv_transfer_params"]
        t0 = time.perf_counter()
        records = fetch_blocks("127.0.0.1", params["remote_port"], params["remote_request_id"], timeout=120)
        dt = time.perf_counter() - t0
        size = sum(len(r) for r in records)
        sizes.append(size)
        seconds.append(dt)
        rates.append(size / dt)
    return {
        "prompt_tokens": prompt_len,
        "blocks": len(records),
        "bytes": statistics.median(sizes),
        "fetch_seconds_median": statistics.median(seconds),
        "bytes_per_s_median": statistics.median(rates),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per engine process")
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--chat-clients", type=int, default=3)
    ap.add_argument("--chat-requests", type=int, default=4)
    ap.add_argument("--chat-prompt", type=int, default=48)
    ap.add_argument("--chat-output", type=int, default=32)
    ap.add_argument("--long-requests", type=int, default=4)
    ap.add_argument("--long-prompt", type=int, default=1024)
    ap.add_argument("--long-output", type=int, default=4)
    ap.add_argument("--long-gap", type=float, default=2.0)
    ap.add_argument(
        "--quick", action="store_true", help="a smaller run (2 clients x 2 chats, 2 long prompts of 512)"
    )
    args = ap.parse_args()
    if args.quick:
        args.chat_clients, args.chat_requests, args.long_requests, args.long_prompt = 2, 2, 2, 512
    log_dir = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    a = Engine(args, log_dir, "engine-a", free_port())
    b = Engine(args, log_dir, "engine-b", free_port())
    try:
        for e in (a, b):
            wait_healthy(e.proc, e.url, e.log, 900, poll_s=0.5)
        # warm-up: both paths once
        asyncio.run(workload(argparse.Namespace(**{**vars(args), "chat_clients": 1, "chat_requests": 1,
                                                    "long_requests": 1, "long_gap": 0}), a, b, True, 1))  # fmt: skip
        results = []
        for disaggregated, seed in ((False, 10), (True, 20)):
            for e in (a, b):
                httpx.post(e.url + "/reset_prefix_cache", timeout=60)
            before = b.metrics()
            row = asyncio.run(workload(args, a, b, disaggregated, seed))
            after = b.metrics()
            delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            fetch_s = delta.get("pagoda:kv_transfer_fetch_seconds_sum", 0.0)
            row["transfer_bytes"] = delta.get("pagoda:kv_transfer_received_bytes_total", 0.0)
            row["transfer_fetch_s"] = fetch_s
            row["transfer_bytes_per_s"] = row["transfer_bytes"] / fetch_s if fetch_s else 0.0
            row["transfer_failures"] = sum(
                v for k, v in delta.items() if k.startswith("pagoda:kv_transfer_failures")
            )
            results.append(row)
        raw = isolated_transfer(a, args.long_prompt, 3)
    finally:
        a.stop()
        b.stop()

    headers = [
        "mode",
        "chat TPOT p50 ms",
        "p90 ms",
        "long TTFT p50 s",
        "p90 s",
        "wall s",
        "transfer MB",
        "MB/s",
    ]
    rows = [
        [
            r["mode"], r["chat_tpot_p50_s"] * 1e3, r["chat_tpot_p90_s"] * 1e3, r["long_ttft_p50_s"],
            r["long_ttft_p90_s"], r["wall_s"], r["transfer_bytes"] / 1e6, r["transfer_bytes_per_s"] / 1e6,
        ]
        for r in results
    ]  # fmt: skip
    print_table("Prefill/decode disaggregation, 2 CPU processes (indicative on a shared host)", headers, rows)
    print(
        f"\nisolated transfer: {raw['prompt_tokens']} tokens = {raw['blocks']} blocks, {raw['bytes'] / 1e6:.1f} MB "
        f"in {raw['fetch_seconds_median'] * 1e3:.1f} ms = {raw['bytes_per_s_median'] / 1e9:.2f} GB/s (median of 3)"
    )
    path = write_json(
        "bench_pd",
        {"args": vars(args), "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(), "results": results,
         "isolated_transfer": raw},
    )  # fmt: skip
    print(f"wrote {path}")
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
        modes = [r["mode"] for r in results]
        x = range(len(modes))
        axes[0].bar([i - 0.2 for i in x], [r["chat_tpot_p50_s"] * 1e3 for r in results], 0.4, label="p50")
        axes[0].bar([i + 0.2 for i in x], [r["chat_tpot_p90_s"] * 1e3 for r in results], 0.4, label="p90")
        axes[0].set_xticks(list(x), modes)
        axes[0].set_ylabel("chat TPOT (ms)")
        axes[0].legend()
        axes[1].bar([i - 0.2 for i in x], [r["long_ttft_p50_s"] for r in results], 0.4, label="p50")
        axes[1].bar([i + 0.2 for i in x], [r["long_ttft_p90_s"] for r in results], 0.4, label="p90")
        axes[1].set_xticks(list(x), modes)
        axes[1].set_ylabel("long-prompt TTFT (s)")
        axes[1].legend()
        fig.suptitle("P/D disaggregation vs aggregated, 2 CPU processes")
        save_plot(fig, "bench_pd")
    return 0


if __name__ == "__main__":
    sys.exit(main())
