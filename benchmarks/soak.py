"""Soak test of the served path: many requests with cancels, then proof that nothing leaked.

The real server (FastAPI app, AsyncEngine, the default embedded model) runs in this process on a uvicorn
thread, so the check can ask the engine core (`AsyncEngine.call`, between two steps) for the KV manager's
invariants. A
mixed workload goes through real HTTP: completions and chats, streamed and not, n = 2, several prompts per
request, prompts sharing prefixes (prefix-cache hits), clients that disconnect at random points (before the
first chunk, mid-stream, while a non-streamed answer is being computed) and a few invalid requests (400s).

Faults are mixed in (issue 34): chats with tools whose output is bad tool text (forced by a regex: a bare
name, a bad escape, a cut-off call; the hermes parser must answer it as content), bursts of requests at
once beyond the client's concurrency and the server's queue limit (those past the limit must get a 503
with Retry-After before admission and nothing else), and a LoRA adapter loaded, used and unloaded over and
over through the runtime routes while requests run through it. With ``--engine-process`` the core runs in
its own process behind the ZMQ transport, as `pagoda serve` runs it.

Afterwards it requires: 0 running, 0 waiting, every KV block free or cached and the KV manager's
invariants hold, resident memory within 10% of its level after the warm-up, no failed engine step, and
every valid request either completed, was cancelled by its client or (a burst past the queue limit) shed
with a 503 + Retry-After (nothing else: no other 5xx, no error event in a stream, no request still
unanswered after its timeout). Exit status 0 when all hold.

    python benchmarks/soak.py                       # 10,000 requests (make soak)
    python benchmarks/soak.py --requests 500        # a quick one
    python benchmarks/soak.py --requests 500 --engine-process
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import random
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

WORDS = "alpha beta gamma delta river mountain cloud stone seven green quiet swift north paper lamp".split()
PREFIXES = [
    "You are a terse assistant for a Kubernetes platform team. Answer in one short sentence.",
    "Translate the user's words into French, keeping names as they are.",
    "You summarise log lines for an on-call engineer; never speculate.",
    "Count with the user, one number a line.",
]
RSS_TOLERANCE = 0.10
# Tool text a small model may well write, none of it a well-formed call: each must come back as content.
BAD_TOOL_TEXT = [
    '<tool_call>{"name": get_weather, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa\\qris"}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
    "<tool_call>[[[[{{{{</tool_call>",
    '<tool_call>{"name": "get_weather", "name": "x", "arguments": 3}</tool_call>',
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ADAPTER = "soak-adapter"
SHED_RETRIES = 60


@dataclass
class SoakConfig:
    requests: int = 10_000
    warmup: int = 300
    concurrency: int = 32
    seed: int = 0
    max_model_len: int = 512
    kv_cache_bytes: int = 64 << 20
    max_tokens: int = 6
    disconnect_rate: float = 0.15
    invalid_rate: float = 0.02
    bad_tool_rate: float = 0.03  # chats with tools whose output is forced to be bad tool text
    burst_every: int = 400  # after this many requests of the mix, a burst (0: none)
    burst_size: int = 80  # requests at once, beyond the concurrency and the queue limit
    queue_limit: int = 64  # the server's --max-num-queued-reqs
    adapter_cycle_s: float = 2.0  # load, use and unload the LoRA adapter every this often (0: never)
    request_timeout_s: float = 300.0  # a request unanswered after this long is hung
    engine_process: bool = False  # the core in its own process (pagoda serve's default)
    progress: bool = True


@dataclass
class SoakReport:
    requests: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)  # completed | cancelled | rejected | shed | error
    errors: list[str] = field(default_factory=list)  # anything a valid request should never see
    server_errors: int = 0  # 5xx answers the client did not cause (a shed 503 + Retry-After is not one)
    hung: int = 0  # requests unanswered after request_timeout_s
    bad_tool_requests: int = 0
    bursts: int = 0
    adapter_cycles: int = 0  # loads + unloads that succeeded
    adapter_requests: int = 0
    burst_outcomes: dict[str, int] = field(default_factory=dict)  # completed | shed | anything else
    shed_retries: int = 0  # mix requests sent again after a 503 + Retry-After (a burst filled the queue)
    duration_s: float = 0.0
    requests_per_s: float = 0.0
    rss_after_warmup_mib: float = 0.0
    rss_end_mib: float = 0.0
    rss_growth: float = 0.0
    failed_steps: int = 0
    running: int = -1
    waiting: int = -1
    unfinished: bool = True
    open_streams: int = -1
    blocks_total: int = 0
    blocks_free: int = 0
    blocks_cached: int = 0
    invariants: str = "not checked"

    def problems(self) -> list[str]:
        """Everything that is not as it must be after the soak; empty means it passed."""
        out = [f"{len(self.errors)} request errors, e.g. {self.errors[:3]}"] if self.errors else []
        if self.server_errors or self.hung:
            out.append(f"{self.server_errors} 5xx the client did not cause, {self.hung} hung requests")
        if sum(self.outcomes.values()) != self.requests:
            out.append(f"outcomes {self.outcomes} do not add up to {self.requests} requests")
        if self.failed_steps:
            out.append(f"{self.failed_steps} failed engine steps")
        if self.running or self.waiting or self.unfinished or self.open_streams:
            out.append(
                f"left behind: running={self.running} waiting={self.waiting} "
                f"unfinished={self.unfinished} open streams={self.open_streams}"
            )
        if self.blocks_free + self.blocks_cached != self.blocks_total or not self.blocks_total:
            out.append(
                f"KV blocks: {self.blocks_free} free + {self.blocks_cached} cached != {self.blocks_total}"
            )
        if self.invariants != "ok":
            out.append(f"KV invariants: {self.invariants}")
        if self.rss_growth > RSS_TOLERANCE:
            out.append(
                f"resident memory grew {100 * self.rss_growth:.1f}% after the warm-up "
                f"({self.rss_after_warmup_mib:.0f} -> {self.rss_end_mib:.0f} MiB)"
            )
        return out


# ---------------------------------------------------------------- the server, in this process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessServer:
    """`pagoda serve` as the CLI builds it (the core on a thread of this process, or with
    ``engine_process`` in a process of its own), on a uvicorn thread, with LoRA and its runtime routes on
    and the hermes tool parser; `call` runs one of the core's utility calls between two steps."""

    def __init__(self, cfg: SoakConfig) -> None:
        import uvicorn
        from pagoda.engine.cli.serve import build_exporter
        from pagoda.engine.config import EngineConfig
        from pagoda.engine.core.engine_core import EngineCore
        from pagoda.engine.frontend.async_engine import AsyncEngine, CoreThread
        from pagoda.engine.frontend.core_process import CoreProcess
        from pagoda.engine.loader import load_tokenizer, resolve_model
        from pagoda.engine.server.app import build_app
        from pagoda.engine.server.settings import ServerSettings

        self.settings = ServerSettings(
            host="127.0.0.1",
            port=_free_port(),
            uvicorn_log_level="warning",
            max_num_queued_reqs=cfg.queue_limit,
            tool_call_parser="hermes",
            allow_runtime_lora_updating=True,
        )
        config = EngineConfig(
            max_model_len=cfg.max_model_len,
            kv_cache_memory_bytes=cfg.kv_cache_bytes,
            enable_lora=True,
            max_loras=1,
            max_lora_rank=8,
        )
        tokenizer = load_tokenizer(resolve_model(config.model))
        self.core_pid: int | None = None
        if cfg.engine_process:
            core: Any = CoreProcess(config)
            self.core_pid = core.pid
        else:
            core = CoreThread(EngineCore(config, tokenizer=tokenizer))
        self.aengine = AsyncEngine(core, tokenizer)
        self.exporter = build_exporter(self.aengine.info, self.settings)
        self.aengine.add_stat_logger(self.exporter)
        app = build_app(self.aengine, self.settings, self.exporter)
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.settings.port, log_level="warning", timeout_keep_alive=5
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="soak-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    def call(self, method: str, timeout: float = 60) -> Any:
        loop = self.aengine._loop
        assert loop is not None
        return asyncio.run_coroutine_threadsafe(self.aengine.call(method), loop).result(timeout)

    def open_streams(self) -> int:
        loop = self.aengine._loop
        assert loop is not None

        async def count() -> int:
            return len(self.aengine._streams)

        return asyncio.run_coroutine_threadsafe(count(), loop).result(30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.aengine.shutdown()


def make_adapter(out_dir: Path) -> Path:
    """A rank-8 PEFT adapter with random weights for the default model (made with peft, as a user's)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from pagoda.engine.loader import resolve_model
    from pagoda_testkit.lora import AdapterSpec, make_peft_adapter

    spec = AdapterSpec(ADAPTER, rank=8, targets=("q_proj", "v_proj"), seed=3)
    return make_peft_adapter(Path(resolve_model(None)), out_dir, spec)


# ---------------------------------------------------------------- the workload


def _rss_mib(core_pid: int | None = None) -> float:
    """Resident memory of this process (and of the core's, when it has its own), after handing freed heap
    back to the OS (glibc keeps freed arenas otherwise, which would read as growth that no live object
    holds)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    total = 0.0
    for pid in ("self", core_pid) if core_pid else ("self",):
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
    return total


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}" else c for c in text)


def _question(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))


def _invalid(rng: random.Random, max_model_len: int) -> tuple[str, dict]:
    return rng.choice(
        [
            ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [10**6], "min_tokens": 1}),
            ("/v1/completions", {"prompt": [1, 2, 10**7]}),
            ("/v1/completions", {"prompt": "Hi", "temperature": -1}),
            ("/v1/completions", {"prompt": "Hi", "bad_words": ["x"]}),  # honoured by vLLM, refused here (unknown fields are ignored)
            ("/v1/chat/completions", {"messages": []}),
            ("/v1/completions", {"prompt": "word " * (max_model_len * 2)}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "min_tokens": 9,
                                      "max_tokens": 2}),
        ]
    )  # fmt: skip


def make_request(rng: random.Random, cfg: SoakConfig) -> dict:
    """One request of the mix: path, body, whether it is valid, and when (if) its client walks away."""
    if rng.random() < cfg.invalid_rate:
        path, body = _invalid(rng, cfg.max_model_len)
        return {"path": path, "body": body, "valid": False, "leave_after": None}
    if rng.random() < cfg.bad_tool_rate:  # the model "writes" bad tool text: it must come back as content
        text = rng.choice(BAD_TOOL_TEXT)
        body = {
            "messages": [{"role": "user", "content": f"What is the weather in {rng.choice(WORDS)}?"}],
            "tools": TOOLS,
            "structured_outputs": {"regex": _regex_literal(text)},
            "max_tokens": 64,
            "temperature": 0.0,
            "stream": rng.random() < 0.5,
        }
        return {
            "path": "/v1/chat/completions",
            "body": body,
            "valid": True,
            "leave_after": None,
            "tool": text,
        }
    prefix = rng.choice(PREFIXES)
    sampling: dict[str, Any] = {
        "max_tokens": rng.randint(1, cfg.max_tokens),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "n": 2 if rng.random() < 0.15 else 1,
    }
    if rng.random() < 0.3:
        sampling["seed"] = rng.randrange(2**31)
    if rng.random() < 0.1:
        sampling["logprobs"] = 2
    stream = rng.random() < 0.5
    kind = rng.random()
    if kind < 0.45:
        path = "/v1/completions"
        body = {"prompt": f"{prefix}\nQuestion: {_question(rng)}\nAnswer:", **sampling}
    elif kind < 0.55:
        path = "/v1/completions"
        prompts = [f"{prefix}\nQuestion: {_question(rng)}\nAnswer:" for _ in range(rng.randint(2, 3))]
        body = {"prompt": prompts, **sampling}
    else:
        path = "/v1/chat/completions"
        if sampling.pop("logprobs", None):
            sampling.update(logprobs=True, top_logprobs=2)
        messages = [{"role": "system", "content": prefix}, {"role": "user", "content": _question(rng)}]
        body = {"messages": messages, **sampling}
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    leave_after = None
    if rng.random() < cfg.disconnect_rate:
        # streams: after this many events (0 = right after the headers); others: after this many seconds
        leave_after = rng.randint(0, 3) if stream else rng.uniform(0.0, 0.3)
    return {"path": path, "body": body, "valid": True, "leave_after": leave_after}


def _check_json(req: dict, data: dict) -> str | None:
    body = req["body"]
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    choices = data.get("choices", [])
    if len(choices) != prompts * body.get("n", 1):
        return f"{len(choices)} choices for {prompts} prompts x n={body.get('n', 1)}"
    if any(c.get("finish_reason") not in ("stop", "length", "tool_calls") for c in choices):
        return f"finish reasons {[c.get('finish_reason') for c in choices]}"
    if not 1 <= data["usage"]["completion_tokens"] <= len(choices) * body["max_tokens"]:
        return f"usage {data['usage']}"
    return None


async def _run_stream(client: httpx.AsyncClient, req: dict) -> tuple[str, str | None]:
    body, leave = req["body"], req["leave_after"]
    events: list[dict] = []
    async with client.stream("POST", req["path"], json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            return _refused(r.status_code, r.headers, text), f"HTTP {r.status_code}: {text[:200]}"
        if leave == 0:
            return "cancelled", None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            events.append(json.loads(line[6:]))
            if "error" in events[-1]:
                return "server_error", f"error event {events[-1]['error']}"
            if leave is not None and len(events) >= leave:
                return "cancelled", None
        else:
            return "error", "stream ended without [DONE]"
    finishes = Counter(
        c["index"] for e in events for c in e.get("choices", []) if c.get("finish_reason") is not None
    )
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    want = prompts * body.get("n", 1)
    if len(finishes) != want or any(v != 1 for v in finishes.values()):
        return "error", f"finish events {dict(finishes)} for {want} choices"
    return "completed", None


async def _run_one(client: httpx.AsyncClient, req: dict) -> tuple[str, str | None]:
    if not req["valid"]:
        r = await client.post(req["path"], json=req["body"])
        if r.status_code == 400 and r.json().get("error", {}).get("param") is not None:
            return "rejected", None
        return "error", f"invalid request answered {r.status_code}: {r.text[:200]}"
    if req["body"].get("stream"):
        return await _run_stream(client, req)
    task = asyncio.ensure_future(client.post(req["path"], json=req["body"]))
    if req["leave_after"] is not None:
        done, _ = await asyncio.wait({task}, timeout=req["leave_after"])
        if not done:
            task.cancel()  # closes the connection: the server must abort the request
            try:
                await task
            except (asyncio.CancelledError, httpx.HTTPError):
                pass
            return "cancelled", None
    r = await task
    if r.status_code != 200:
        return _refused(r.status_code, r.headers, r.text), f"HTTP {r.status_code}: {r.text[:200]}"
    data = r.json()
    problem = _check_json(req, data)
    if problem is None and "tool" in req and data["choices"][0]["message"].get("tool_calls"):
        problem = f"bad tool text {req['tool']!r} was answered as a call"
    return ("error", problem) if problem else ("completed", None)


def _failed(status: int) -> str:
    return "server_error" if status >= 500 else "error"


def _refused(status: int, headers: Any, text: str) -> str:
    """ "shed": a 503 + Retry-After before admission (the queue is full: a burst of this same client);
    a client retries it after the time it names. Any other 5xx is the server's fault."""
    if status == 503 and headers.get("retry-after") and '"queue_full"' in text:
        return "shed"
    return _failed(status)


async def _timed(coro: Any, timeout: float) -> tuple[str, str | None]:
    try:
        return await asyncio.wait_for(coro, timeout)
    except TimeoutError:
        return "hung", f"no answer after {timeout:.0f} s"


async def _burst(url: str, cfg: SoakConfig, rng: random.Random, report: SoakReport) -> None:
    """``burst_size`` requests at once (beyond the client's concurrency, past the queue limit): each is
    answered in full, or shed with a 503 + Retry-After before it was admitted."""
    limits = httpx.Limits(max_connections=cfg.burst_size + 4)

    async def one(client: httpx.AsyncClient) -> tuple[str, str | None]:
        body = {"prompt": f"{rng.choice(PREFIXES)} {_question(rng)}", "max_tokens": rng.randint(1, 3)}
        r = await client.post("/v1/completions", json=body)
        if r.status_code == 200:
            return "completed", None
        code = (
            r.json().get("error", {}).get("code")
            if r.headers.get("content-type") == "application/json"
            else None
        )
        if r.status_code == 503 and r.headers.get("retry-after") and code == "queue_full":
            return "shed", None
        return _failed(r.status_code), f"burst request answered {r.status_code}: {r.text[:200]}"

    async with httpx.AsyncClient(base_url=url, timeout=cfg.request_timeout_s + 30, limits=limits) as client:
        results = await asyncio.gather(
            *(_timed(one(client), cfg.request_timeout_s) for _ in range(cfg.burst_size))
        )
    report.bursts += 1
    for kind, problem in results:
        report.burst_outcomes[kind] = report.burst_outcomes.get(kind, 0) + 1
        _note(report, kind, problem and f"burst: {problem}")


async def _adapter_cycles(
    url: str, cfg: SoakConfig, path: Path, report: SoakReport, stop: asyncio.Event
) -> None:
    """Load the adapter, run requests through it, unload it while they may still run; again and again.
    Its requests are answered in full, or 404 when the unload came before they were admitted."""
    rng = random.Random(cfg.seed + 7)
    async with httpx.AsyncClient(base_url=url, timeout=cfg.request_timeout_s + 30) as client:

        async def use() -> tuple[str, str | None]:
            body = {"model": ADAPTER, "prompt": _question(rng), "max_tokens": rng.randint(1, 4)}
            r = await client.post("/v1/completions", json=body)
            if r.status_code == 200:
                report.adapter_requests += 1
                return "completed", None
            if r.status_code in (400, 404) and r.json()["error"]["code"] == "model_not_found":
                return "completed", None  # the unload came first: the client named an adapter not loaded
            if _refused(r.status_code, r.headers, r.text) == "shed":
                return "completed", None  # a burst filled the queue: refused before admission
            return _failed(r.status_code), f"adapter request answered {r.status_code}: {r.text[:200]}"

        while not stop.is_set():
            load = await client.post(
                "/v1/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(path)}
            )
            if load.status_code != 200:
                _note(
                    report, _failed(load.status_code), f"load answered {load.status_code}: {load.text[:200]}"
                )
            users = [asyncio.ensure_future(_timed(use(), cfg.request_timeout_s)) for _ in range(3)]
            await asyncio.sleep(rng.uniform(0.0, 0.3))
            unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": ADAPTER})
            if unload.status_code != 200:
                _note(
                    report,
                    _failed(unload.status_code),
                    f"unload answered {unload.status_code}: {unload.text[:200]}",
                )
            elif load.status_code == 200:
                report.adapter_cycles += 1
            for kind, problem in await asyncio.gather(*users):
                _note(report, kind, problem)
            try:
                await asyncio.wait_for(stop.wait(), cfg.adapter_cycle_s)
            except TimeoutError:
                pass


def _note(report: SoakReport, kind: str, problem: str | None) -> None:
    if kind == "server_error":
        report.server_errors += 1
    elif kind == "hung":
        report.hung += 1
    if problem:
        report.errors.append(problem)


async def _drive(
    url: str, cfg: SoakConfig, count: int, seed: int, report: SoakReport | None, adapter: Path | None = None
) -> None:
    """``count`` requests of the mix; with a report, the faults too: bursts and adapter cycles."""
    rng = random.Random(seed)
    requests = iter([make_request(rng, cfg) for _ in range(count)])
    outcomes: Counter = Counter()
    done = 0
    faults: list[asyncio.Task] = []
    stop = asyncio.Event()
    if report is not None and adapter is not None and cfg.adapter_cycle_s > 0:
        faults.append(asyncio.ensure_future(_adapter_cycles(url, cfg, adapter, report, stop)))
    limits = httpx.Limits(max_connections=cfg.concurrency + 4, max_keepalive_connections=cfg.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=cfg.request_timeout_s + 30, limits=limits) as client:

        async def worker() -> None:
            nonlocal done
            for req in requests:
                for _ in range(SHED_RETRIES):  # a shed request is sent again after its Retry-After
                    try:
                        kind, problem = await _timed(_run_one(client, req), cfg.request_timeout_s)
                    except httpx.HTTPError as exc:
                        kind, problem = "error", f"{type(exc).__name__}: {exc}"
                    if kind != "shed":
                        break
                    if report is not None:
                        report.shed_retries += 1
                    await asyncio.sleep(1.0)
                else:
                    kind = "server_error"  # overloaded for a minute: not a burst's passing overload
                outcomes[kind] += 1
                if report is not None:
                    report.bad_tool_requests += "tool" in req
                    _note(
                        report, kind, problem and f"{req['path']} {json.dumps(req['body'])[:160]}: {problem}"
                    )
                done += 1
                if (
                    report is not None
                    and cfg.burst_every
                    and (done % cfg.burst_every == 0 or done == count // 2)
                ):
                    faults.append(asyncio.ensure_future(_burst(url, cfg, rng, report)))
                if cfg.progress and report is not None and done % 1000 == 0:
                    print(f"  {done}/{count} requests, {dict(outcomes)}", flush=True)

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
    stop.set()
    await asyncio.gather(*faults)
    if report is not None:
        kinds = ("completed", "cancelled", "rejected", "error", "server_error", "hung")
        report.outcomes = {k: outcomes.get(k, 0) for k in kinds}


def run_soak(cfg: SoakConfig) -> SoakReport:
    report = SoakReport(requests=cfg.requests)
    server = InProcessServer(cfg)
    adapters = tempfile.TemporaryDirectory(prefix="pagoda-soak-")
    try:
        adapter = make_adapter(Path(adapters.name)) if cfg.adapter_cycle_s > 0 else None
        # The warm-up has the faults too: grammars, adapter loads and bursts fill their caches before the
        # resident memory is taken as the baseline.
        warmup = SoakReport(requests=cfg.warmup)
        asyncio.run(_drive(server.url, cfg, cfg.warmup, cfg.seed + 1, warmup, adapter))
        if warmup.server_errors or warmup.hung:
            report.errors.extend(f"warm-up: {e}" for e in warmup.errors)
            report.server_errors, report.hung = warmup.server_errors, warmup.hung
        _wait_idle(server)
        report.rss_after_warmup_mib = _rss_mib(server.core_pid)
        start = time.monotonic()
        asyncio.run(_drive(server.url, cfg, cfg.requests, cfg.seed, report, adapter))
        report.duration_s = time.monotonic() - start
        report.requests_per_s = cfg.requests / report.duration_s
        _wait_idle(server)
        stats = server.call("get_scheduler_stats")
        if not hasattr(stats, "num_running"):  # from a core process: the struct's fields, as msgpack has them
            import msgspec
            from pagoda.engine.core.stats import SchedulerStats

            stats = msgspec.convert(stats, SchedulerStats)
        report.running, report.waiting = stats.num_running, stats.num_waiting
        report.blocks_total, report.blocks_free = stats.num_blocks_total, stats.num_blocks_free
        report.blocks_cached = stats.num_blocks_cached
        report.unfinished = server.call("has_unfinished_requests")
        report.open_streams = server.open_streams()
        report.invariants = server.call("check_invariants")
        report.failed_steps = server.aengine.failed_steps
        report.rss_end_mib = _rss_mib(server.core_pid)
        report.rss_growth = report.rss_end_mib / report.rss_after_warmup_mib - 1
    finally:
        server.stop()
        adapters.cleanup()
    return report


def _wait_idle(server: InProcessServer, timeout: float = 120) -> None:
    """Until the engine holds no request (aborts of disconnected clients land a step later)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.call("num_requests") == 0 and server.open_streams() == 0:
            return
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = SoakConfig()
    ints = ("requests", "warmup", "concurrency", "seed", "max_model_len", "max_tokens", "burst_every",
            "burst_size", "queue_limit")  # fmt: skip
    for name in ints:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("disconnect_rate", "invalid_rate", "bad_tool_rate", "adapter_cycle_s", "request_timeout_s"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    p.add_argument("--engine-process", action="store_true", help="the core in its own process")
    p.add_argument("--json", help="also write the report to this file")
    args = p.parse_args(argv)
    cfg = SoakConfig(**{k: v for k, v in vars(args).items() if k != "json"})
    print(
        f"soak: {cfg.requests} requests after a {cfg.warmup}-request warm-up, concurrency {cfg.concurrency}"
    )
    report = run_soak(cfg)
    summary = {k: v for k, v in asdict(report).items() if k != "errors"}
    summary["errors"] = report.errors[:20]
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=2)
    problems = report.problems()
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    if not problems:
        print(
            f"soak passed: {report.requests} requests in {report.duration_s:.0f} s, RSS "
            f"{report.rss_after_warmup_mib:.0f} -> {report.rss_end_mib:.0f} MiB, 0 failed steps, 0 leaks"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
