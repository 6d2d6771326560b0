"""A served smoke run: `pagoda serve` of the check's model on the warmed kernel cache.

Start-up phases are timed from the server's own log lines (weights loaded, KV cache sized, CUDA graphs
captured, application started) and its first healthy /health. Then one request, then 64 at once (tok/s),
/metrics read back, SIGTERM: the server must exit 0, leave no process behind and give the GPU memory
back. The server's Triton cache starts empty with the warm step's cache as its seed
(PAGODA_KERNEL_CACHE, as in a pod): any kernel it still compiled is a miss of the warmed set.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpu_check.context import Context, check, free_port, verdict
from gpu_check.model import prompt
from gpu_check.step_warm import PLAN_FLAGS

PHASES = {
    "weights_loaded": re.compile(r"Loading weights: 100%"),
    "cuda_graphs_captured": re.compile(r"CUDA graphs: decode batches|CUDA graphs are off"),
    "engine_core_ready": re.compile(r"KV cache: \d+ blocks"),  # the engine core's last start-up line
    "app_started": re.compile(r"Application startup complete"),
}
PROFILE = re.compile(r"start-up memory profile: (\{.*\})")
GRAPHS = re.compile(r"CUDA graphs: decode batches of ([\d, ]+) sequences")
METRICS = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
)  # fmt: skip


class Server:
    """`pagoda serve` in a session of its own, its output timestamped into a log and scanned for phases."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.start = time.monotonic()
        self.phases: dict[str, float] = {}
        self.profile: dict | None = None
        self.graph_sizes: str | None = None
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            t = time.monotonic() - self.start
            self._log.write(f"{t:8.2f} {line}")
            self._log.flush()
            for name, pattern in PHASES.items():
                if name not in self.phases and pattern.search(line):
                    self.phases[name] = round(t, 2)
            m = PROFILE.search(line)
            if m:
                try:
                    self.profile = json.loads(m.group(1))
                except json.JSONDecodeError:
                    pass
            m = GRAPHS.search(line)
            if m:
                self.graph_sizes = m.group(1)

    def since_start(self) -> float:
        return round(time.monotonic() - self.start, 2)

    def kill(self) -> None:
        """SIGKILL the server's whole session (cleanup after a failure; the SIGTERM check comes first)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def http(url: str, body: dict | None = None, timeout: float = 120.0) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)


def wait_healthy(server: Server, base: str, limit_s: float) -> float | None:
    while server.since_start() < limit_s:
        if server.proc.poll() is not None:
            return None
        if http(f"{base}/health", timeout=2)[0] == 200:
            return server.since_start()
        time.sleep(0.25)
    return None


def session_members(pgid: int) -> list[int]:
    """Processes still in the server's session (its engine core process included)."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == pgid and fields[0] != "Z":
            left.append(int(stat.parent.name))
    return left


def read_metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


def load(base: str, model: str, prompts: list[str], max_tokens: int) -> dict:
    """All prompts at once (one thread each), greedy, exactly max_tokens each (ignore_eos)."""

    def one(text: str) -> tuple[int, int, float]:
        t0 = time.monotonic()
        body = {
            "model": model,
            "prompt": text,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        status, payload = http(f"{base}/v1/completions", body)
        tokens = json.loads(payload)["usage"]["completion_tokens"] if status == 200 else 0
        return status, tokens, time.monotonic() - t0

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        rows = list(pool.map(one, prompts))
    elapsed = time.monotonic() - t0
    generated = sum(r[1] for r in rows)
    return {
        "requests": len(prompts),
        "ok": sum(r[0] == 200 and r[1] == max_tokens for r in rows),
        "statuses": sorted({r[0] for r in rows}),
        "generated_tokens": generated,
        "seconds": round(elapsed, 2),
        "tok_per_s": round(generated / elapsed, 1),
        "mean_request_s": round(sum(r[2] for r in rows) / len(rows), 2),
    }


def compiled_kernels(cache: Path) -> tuple[list[str], int]:
    """(kernels Triton compiled into ``cache`` itself, entries linked from the warmed seed)."""
    compiled, linked = [], 0
    if not cache.is_dir():
        return compiled, linked
    for entry in cache.iterdir():
        if entry.is_symlink():
            linked += 1
        elif entry.is_dir():
            compiled += [p.stem for p in entry.glob("*.cubin")]
    return sorted(compiled), linked


def run(ctx: Context) -> dict:
    import torch

    on_gpu = ctx.gpu and torch.cuda.is_available()
    if ctx.gpu and not on_gpu:
        return {"status": "error", "error": "torch sees no CUDA device"}
    shape = ctx.shape
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    serve_cache = ctx.work / "serve-triton-cache"
    warmed = (ctx.result_of("warm") or {}).get("status") == "pass"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(serve_cache)
    if ctx.warm_cache.is_dir():
        env["PAGODA_KERNEL_CACHE"] = str(ctx.warm_cache)
    if on_gpu:
        flags = [*PLAN_FLAGS, "--max-model-len", "4096", "--max-num-seqs", "64"]
        concurrency, prompt_len, max_tokens, ready_limit = 64, 256, 256, 110.0
    else:
        flags = ["--max-model-len", "512", "--max-num-seqs", "16", "--device", "cpu"]
        concurrency, prompt_len, max_tokens, ready_limit = 16, 32, 16, 120.0
    cmd = [sys.executable, "-m", "pagoda.cli.main", "serve", "--model", str(ctx.model_dir), "--host",
           "127.0.0.1", "--port", str(port), *flags]  # fmt: skip
    free_before = torch.cuda.mem_get_info()[0] if on_gpu else None
    server = Server(cmd, env, ctx.work / "serve-server.log")
    checks: dict[str, dict] = {}
    data: dict = {"command": " ".join(cmd), "phases_s": server.phases}
    try:
        ready = wait_healthy(server, base, ready_limit)
        exited = server.proc.poll()
        checks["started"] = check(
            ready is not None,
            f"healthy after {ready} s" if ready else f"exited with code {exited} after {server.since_start()} s"
            if exited is not None else f"not healthy within {ready_limit:.0f} s",
        )  # fmt: skip
        if ready is None:
            data["server_log_tail"] = server.tail()
            return verdict(checks, error="the server did not start", **data)
        server.phases["healthy"] = ready
        model = json.loads(http(f"{base}/v1/models")[1])["data"][0]["id"]
        t0 = time.monotonic()
        first = load(base, model, [prompt(shape, prompt_len, 0)], 8)
        data["first_request_s"] = round(time.monotonic() - t0, 2)
        checks["first_request"] = check(first["ok"] == 1, f"{data['first_request_s']} s")
        prompts = [prompt(shape, prompt_len, seed) for seed in range(1, concurrency + 1)]
        run_ = load(base, model, prompts, max_tokens)
        data["concurrent"] = run_
        checks["concurrent_requests"] = check(
            run_["ok"] == concurrency,
            f"{run_['ok']}/{concurrency} complete, {run_['tok_per_s']} tok/s "
            f"({concurrency} x {prompt_len} prompt + {max_tokens} generated tokens)",
        )
        if on_gpu:
            data["gpu_memory_used_while_serving_gib"] = round(
                (free_before - torch.cuda.mem_get_info()[0]) / 2**30, 2
            )
        status, text = http(f"{base}/metrics")
        values = read_metrics(text) if status == 200 else {}
        missing = [m for m in METRICS if m not in values]
        checks["metrics"] = check(status == 200 and not missing, f"missing {missing}" if missing else
                                  f"{len(values)} series")  # fmt: skip
        generated = values.get("vllm:generation_tokens_total", 0)
        expected = run_["generated_tokens"] + first["generated_tokens"]
        checks["metrics_count_tokens"] = check(generated >= expected, f"{generated:.0f} >= {expected}")
        ttft_n = values.get("vllm:time_to_first_token_seconds_count") or 0
        itl_n = values.get("vllm:inter_token_latency_seconds_count") or 0
        data["metrics"] = {
            "generation_tokens_total": generated,
            "prompt_tokens_total": values.get("vllm:prompt_tokens_total"),
            "mean_ttft_s": round(values.get("vllm:time_to_first_token_seconds_sum", 0) / ttft_n, 4)
            if ttft_n
            else None,
            "mean_itl_s": round(values.get("vllm:inter_token_latency_seconds_sum", 0) / itl_n, 5)
            if itl_n
            else None,
            "preemptions": values.get("vllm:num_preemptions_total"),
        }
        compiled, linked = compiled_kernels(serve_cache)
        data["kernels_compiled_at_serve"] = compiled
        data["warmed_entries_linked"] = linked
        if on_gpu:
            checks["no_kernel_compiled_at_serve"] = check(
                warmed and not compiled,
                ("the warm step did not pass; " if not warmed else "")
                + (
                    f"compiled {', '.join(compiled)}"
                    if compiled
                    else f"none compiled, {linked} warmed entries linked"
                ),
            )
        # SIGTERM: drained and gone, the whole session, and the GPU memory back
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            code = server.proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            code = None
        data["sigterm_exit_s"] = round(time.monotonic() - t0, 2)
        checks["sigterm_exit"] = check(code == 0, f"exit code {code} after {data['sigterm_exit_s']} s")
        time.sleep(1.0)
        left = session_members(server.proc.pid)
        checks["no_process_left"] = check(not left, f"left: {left}" if left else "none")
        if on_gpu:
            deadline = time.monotonic() + 10
            while True:  # the driver frees a dead process's memory shortly after it is reaped
                free_after = torch.cuda.mem_get_info()[0]
                if free_after >= free_before - (256 << 20) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            lost = (free_before - free_after) / 2**30
            checks["gpu_memory_freed"] = check(lost < 0.25, f"{lost:.2f} GiB not back after exit")
        data["memory_profile"] = server.profile
        data["cuda_graph_batch_sizes"] = server.graph_sizes
    finally:
        server.kill()
    headline = (
        f"ready in {server.phases.get('healthy')} s, {data.get('concurrent', {}).get('tok_per_s')} tok/s "
        f"at {concurrency} concurrent"
    )
    if not all(c["ok"] is not False for c in checks.values()):
        data["server_log_tail"] = server.tail()
    return verdict(checks, headline=headline, **data)
