"""Routing policies over three real `pagoda serve` replicas behind `pagoda router`.

    make bench-router                     # or: python benchmarks/bench_router.py [--quick]

Scenario 1 (device only): small KV pools (--kv-cache-memory-bytes), a multi-tenant chat workload (12
conversations x 6 turns, one ~500-token system prompt per tenant, turns interleaved across conversations, 3
clients), the same workload with fresh prompts for each policy: roundRobin, leastLoaded, prefix, tierAware.
Every assistant reply is 64 tokens (min_tokens = max_tokens), and goes back into the conversation's history
as the next turn's context. A chat's replies are rarely shorter, and the default model would otherwise stop
after ~10 tokens of these generic questions, leaving a history that hardly grows past the system prompt:
then what a replica holds is mostly system prompts, which every policy finds sooner or later, unlike a real
chat where each conversation's own history is most of its prompt. (Up to 2026-11-23 the replies were 8
tokens and the system prompts ~400 tokens; docs/router.md compares them.)
Scenario 2 (tiers): replicas with a host tier; each tenant's system prompt is placed on one replica and
pushed down to the host tier by filler prompts, then new conversations of those tenants arrive: prefix
(device only) cannot see where the prefixes are, tierAware can.

Per policy: prefix hit rate (cached / prompt tokens, from each answer's usage), mean and p90 TTFT (streamed,
first content chunk), throughput (completion tokens/s and requests/s) and the router's routing overhead
p99. Prints tables, writes bench-results/bench_router.json and bench_router.png. Targets: prefix >= 2x
the hit rate of roundRobin and >= 1.5x lower p90 TTFT; tierAware beats prefix in scenario 2; overhead p99 < 2 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import plot_path, print_table, write_json  # noqa: E402

# Free ports and health waits are the test kit's (tests/support/pagoda_testkit), as for bench_operator.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from pagoda_testkit.processes import free_port, wait_healthy  # noqa: E402

PAGODA = str(Path(sys.executable).parent / "pagoda")
MODEL = "SmolLM2-135M-Instruct"  # the default model's served name
POLICIES = ("roundRobin", "leastLoaded", "prefix", "tierAware")
WORDS = (
    "cargo harbour invoice pallet customs freight ledger courier manifest route depot tariff vessel berth "
    "crane container schedule warehouse parcel tracking delivery shipment broker quay anchor tide ferry"
).split()


@dataclass
class Proc:
    proc: subprocess.Popen
    url: str
    log: Path

    def wait_healthy(self, timeout: float = 600) -> None:
        wait_healthy(self.proc, self.url, lambda: self.log.read_text()[-3000:], timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn(argv: list[str], log_dir: Path, name: str, port: int, nice: int = 0) -> Proc:
    """``nice`` > 0 for the replicas: on a shared 2-core machine the router would otherwise wait for CPU
    behind three engines, which a deployment (the router in its own pod) does not do."""
    log = log_dir / f"{name}.log"
    if nice:
        argv = ["nice", "-n", str(nice), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Proc(proc, f"http://127.0.0.1:{port}", log)


def start_replicas(
    n: int,
    args,
    log_dir: Path,
    extra: Callable[[int], list[str]] = lambda i: [],
    name: str = "replica",
    procs: list[Proc] | None = None,
) -> list[Proc]:
    """``n`` replicas, replica ``i`` with ``extra(i)`` more flags, appended to ``procs`` as they start (so a
    caller's cleanup stops them even if a later one fails to come up)."""
    procs = [] if procs is None else procs
    for i in range(n):
        port = free_port()
        argv = [
            PAGODA,
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--uvicorn-log-level",
            "warning",
            "--kv-cache-memory-bytes",
            args.kv_bytes,
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "8",
            "--disable-log-stats",
            *extra(i),
        ]
        procs.append(spawn(argv, log_dir, f"{name}{i}", port, nice=10))
    for p in procs:
        p.wait_healthy()
    return procs


def start_router(policy: str, replicas: list[Proc], log_dir: Path) -> Proc:
    port = free_port()
    argv = [
        PAGODA,
        "router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        policy,
        "--health-interval",
        "0.5",
        "--events-interval",
        "0.1",
        "--log-level",
        "warning",
    ]
    for r in replicas:
        argv += ["--backend", r.url]
    p = spawn(argv, log_dir, f"router-{policy}", port)
    p.wait_healthy(120)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = httpx.get(p.url + "/router/state").json()
        if all(b["healthy"] and b["synced"] for b in state["backends"]):
            break
        time.sleep(0.2)
    return p


# -- workload ----------------------------------------------------------------------------------------------
def system_prompt(tenant: int, salt: str, words: int) -> str:
    rng = random.Random(f"{salt}-{tenant}")
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are the assistant of tenant {tenant} ({salt}). Company handbook: {body}. Answer briefly."


@dataclass
class Conversation:
    system: str
    turns: int
    messages: list[dict] = field(default_factory=list)
    done: int = 0

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": self.system}]


@dataclass
class Result:
    ttft: float
    latency: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    status: int
    turn: int = 0  # 0-based turn of its conversation


def chat(
    client: httpx.Client, url: str, messages: list[dict], max_tokens: int, min_tokens: int = 0
) -> tuple[Result, str]:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "min_tokens": min(min_tokens, max_tokens),
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    text, usage = [], {}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return Result(0, 0, 0, 0, 0, r.status_code), ""
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices") or ():
                delta = (ch.get("delta") or {}).get("content")
                if delta:
                    first = first or time.perf_counter()
                    text.append(delta)
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    res = Result(
        (first or end) - start,
        end - start,
        usage.get("prompt_tokens", 0),
        details.get("cached_tokens", 0),
        usage.get("completion_tokens", 0),
        200,
    )
    return res, "".join(text)


def run_conversations(
    url: str, convs: list[Conversation], clients: int, max_tokens: int, min_tokens: int, bar
) -> tuple[list[Result], float]:
    """Turns interleaved: turn k of every conversation before turn k+1 of any, conversations in a shuffled
    order each round (a fixed order would make round robin stick each conversation to one replica whenever
    the count divides by 3); ``clients`` at a time."""
    rng = random.Random(1)
    order = []
    for k in range(max(c.turns for c in convs)):
        ids = [i for i in range(len(convs)) if k < convs[i].turns]
        rng.shuffle(ids)
        order += [(k, i) for i in ids]
    lock = threading.Condition()
    results: list[Result] = []
    nxt = [0]
    busy: set[int] = set()

    def worker() -> None:
        with httpx.Client(timeout=600) as client:
            while True:
                with lock:
                    while True:
                        if nxt[0] >= len(order):
                            return
                        k, i = order[nxt[0]]
                        if i not in busy and convs[i].done == k:
                            nxt[0] += 1
                            busy.add(i)
                            break
                        lock.wait(0.05)
                conv = convs[i]
                conv.messages.append(
                    {"role": "user", "content": f"Question {k + 1} of conversation {i}: what next?"}
                )
                res, text = chat(client, url, conv.messages, max_tokens, min_tokens)
                res.turn = k
                conv.messages.append({"role": "assistant", "content": text or "ok"})
                with lock:
                    results.append(res)
                    conv.done += 1
                    busy.discard(i)
                    lock.notify_all()
                bar.update(1)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def router_state(router: Proc) -> dict:
    """Overheads, what the router knew of each replica, and its decisions by reason."""
    state = httpx.get(router.url + "/router/state").json()
    reasons = {}
    for line in httpx.get(router.url + "/metrics").text.splitlines():
        if line.startswith("pagoda:router_decisions_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            reasons[reason] = reasons.get(reason, 0) + float(line.rsplit(" ", 1)[1])
    backends = [
        {
            "blocks": b["blocks"],
            "synced": b["synced"],
            "resyncs": b.get("resyncs"),
            "prefill_tokens_per_s": (b["info"] or {}).get("prefill_tokens_per_s"),
            "load_tokens_per_s": (b["info"] or {}).get("load_tokens_per_s"),
        }
        for b in state["backends"]
    ]
    return {
        "overheads": state["overhead_seconds"],
        "overheads_cpu": state["overhead_cpu_seconds"],
        "backends": backends,
        "reasons": reasons,
    }


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def summarize(policy: str, results: list[Result], wall: float, state: dict) -> dict:
    overheads = state["overheads"]
    ok = [r for r in results if r.status == 200]
    ttfts = sorted(r.ttft for r in ok)
    p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else float("nan")
    ov = sorted(overheads)
    p99 = ov[min(len(ov) - 1, int(0.99 * len(ov)))] if ov else float("nan")
    prompt = sum(r.prompt_tokens for r in ok)
    by_turn: dict[int, list[Result]] = {}
    for r in ok:
        by_turn.setdefault(r.turn, []).append(r)
    return {
        "policy": policy,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "prefix_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else float("nan"),
        "ttft_p90_s": p90,
        "completion_tok_per_s": sum(r.completion_tokens for r in ok) / wall,
        "req_per_s": len(ok) / wall,
        "overhead_p99_ms": p99 * 1e3,
        "overhead_mean_ms": statistics.fmean(ov) * 1e3 if ov else float("nan"),
        "overhead_cpu_p99_ms": pct(state["overheads_cpu"], 0.99) * 1e3,
        "wall_s": wall,
        "prompt_tokens_mean": prompt / len(ok) if ok else 0.0,
        "hit_rate_by_turn": [
            sum(r.cached_tokens for r in rs) / max(1, sum(r.prompt_tokens for r in rs))
            for _, rs in sorted(by_turn.items())
        ],
        "reasons": state["reasons"],
        "backends": state["backends"],
    }


def reset_caches(replicas: list[Proc]) -> None:
    for r in replicas:
        httpx.post(r.url + "/reset_prefix_cache", timeout=30)


def scenario_device(args, log_dir: Path) -> list[dict]:
    replicas = start_replicas(3, args, log_dir)
    rows = []
    try:
        total = len(args.policies) * args.conversations * args.turns
        with tqdm(total=total, desc="device scenario", unit="req") as bar:
            for policy in args.policies:
                reset_caches(replicas)
                router = start_router(policy, replicas, log_dir)
                try:
                    convs = [
                        Conversation(system_prompt(i % args.tenants, policy, args.system_words), args.turns)
                        for i in range(args.conversations)
                    ]
                    results, wall = run_conversations(
                        router.url, convs, args.clients, args.max_tokens, args.min_tokens, bar
                    )
                    rows.append(summarize(policy, results, wall, router_state(router)))
                    rows[-1]["sample_conversation"] = convs[0].messages  # what the replies look like
                finally:
                    router.stop()
    finally:
        for r in replicas:
            r.stop()
    return rows


def scenario_tiers(args, log_dir: Path) -> list[dict]:
    """Tenants' prefixes only on the host tier of one replica each; new conversations arrive."""
    disk = tempfile.mkdtemp(prefix="pagoda-bench-router-")

    def host_and_disk(i: int) -> list[str]:
        offload = {"--kv-offload-host-bytes": "512MiB", "--kv-offload-disk-dir": f"{disk}/r{i}"}
        offload["--kv-offload-disk-bytes"] = "1GiB"
        return [part for item in offload.items() for part in item]

    replicas: list[Proc] = []
    rows = []
    try:
        start_replicas(3, args, log_dir, host_and_disk, name="tier-replica", procs=replicas)
        n = args.tier_conversations
        with (
            tqdm(total=2 * (n + args.tenants + 3 * args.fillers), desc="tier scenario", unit="req") as bar,
            httpx.Client(timeout=600) as c,
        ):
            for policy in ("prefix", "tierAware"):
                reset_caches(replicas)
                systems = [system_prompt(t, f"tier-{policy}", args.system_words) for t in range(args.tenants)]
                for t, s in enumerate(systems):  # tenant t's prefix lives on replica t % 3 ...
                    chat(
                        c,
                        replicas[t % 3].url,
                        [{"role": "system", "content": s}, {"role": "user", "content": "hi"}],
                        1,
                    )
                    bar.update(1)
                for r in replicas:  # ... and is pushed down to the host tier by unrelated prompts
                    for f in range(args.fillers):
                        chat(
                            c,
                            r.url,
                            [
                                {
                                    "role": "user",
                                    "content": system_prompt(
                                        100 + f, f"filler-{r.url}-{policy}", args.system_words * 2
                                    ),
                                }
                            ],
                            1,
                        )
                        bar.update(1)
                router = start_router(policy, replicas, log_dir)
                try:
                    convs = [Conversation(systems[i % args.tenants], 1) for i in range(n)]
                    results, wall = run_conversations(
                        router.url, convs, 1, args.max_tokens, args.min_tokens, bar
                    )
                    rows.append(summarize(policy, results, wall, router_state(router)))
                finally:
                    router.stop()
    finally:
        for r in replicas:
            r.stop()
    return rows


def plot(device: list[dict], tiers: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = [r["policy"] for r in device]
    axes[0].bar(names, [r["prefix_hit_rate"] for r in device])
    axes[0].set_title("prefix hit rate (device scenario)")
    axes[1].bar(names, [r["ttft_p90_s"] for r in device], label="p90")
    axes[1].bar(names, [r["ttft_mean_s"] for r in device], label="mean")
    axes[1].set_title("TTFT, s (device scenario)")
    axes[1].legend()
    axes[2].bar([r["policy"] for r in tiers], [r["ttft_mean_s"] for r in tiers])
    axes[2].set_title("mean TTFT, s (prefixes on host/disk only)")
    fig.tight_layout()
    fig.savefig(plot_path("bench_router"))
    print(f"plot: {plot_path('bench_router')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="6 conversations x 3 turns, 2 tenants")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument(
        "--tenants", type=int, default=6, help="more system prompts than one replica's pool holds"
    )
    ap.add_argument("--system-words", type=int, default=415, help="~500 tokens with the chat template")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per assistant reply")
    ap.add_argument(
        "--min-tokens",
        type=int,
        default=None,
        help="the model may not stop before this many (default: --max-tokens, so every reply is that long; "
        "0 lets it stop where it likes, about 10 tokens for these questions)",
    )
    ap.add_argument("--kv-bytes", default="96MiB", help="per replica: small, so that routing matters")
    ap.add_argument("--tier-conversations", type=int, default=12)
    ap.add_argument("--skip-tiers", action="store_true")
    ap.add_argument(
        "--fillers", type=int, default=5, help="unrelated prompts per replica that push prefixes down"
    )
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    args = ap.parse_args()
    if args.min_tokens is None:
        args.min_tokens = args.max_tokens
    if args.quick:
        args.conversations, args.turns, args.tenants, args.tier_conversations = 6, 3, 3, 6
    log_dir = Path(tempfile.mkdtemp(prefix="pagoda-bench-router-logs-"))
    print(f"logs: {log_dir}")
    device = scenario_device(args, log_dir)
    tiers = [] if args.skip_tiers else scenario_tiers(args, log_dir)
    cols = [
        "policy",
        "requests",
        "errors",
        "prefix_hit_rate",
        "ttft_mean_s",
        "ttft_p90_s",
        "completion_tok_per_s",
        "req_per_s",
        "overhead_p99_ms",
        "overhead_cpu_p99_ms",
    ]
    print_table(
        f"Device scenario: {args.conversations} conversations x {args.turns} turns, {args.tenants} tenants, "
        f"3 replicas with {args.kv_bytes} KV each",
        cols,
        [[r[c] for c in cols] for r in device],
    )
    if tiers:
        print_table(
            "Tier scenario: each tenant's prefix only on one replica's host/disk tiers",
            cols,
            [[r[c] for c in cols] for r in tiers],
        )
    by = {r["policy"]: r for r in device}
    checks = {
        "overhead_p99_ms_max": max(r["overhead_p99_ms"] for r in device + tiers),
        "overhead_cpu_p99_ms_max": max(r["overhead_cpu_p99_ms"] for r in device + tiers),
    }
    if "prefix" in by and "roundRobin" in by:
        checks["prefix_hit_rate_vs_roundRobin"] = by["prefix"]["prefix_hit_rate"] / max(
            by["roundRobin"]["prefix_hit_rate"], 1e-9
        )
        checks["p90_ttft_roundRobin_over_prefix"] = (
            by["roundRobin"]["ttft_p90_s"] / by["prefix"]["ttft_p90_s"]
        )
    if tiers:
        t = {r["policy"]: r for r in tiers}
        checks["tier_scenario_mean_ttft_prefix_over_tierAware"] = (
            t["prefix"]["ttft_mean_s"] / t["tierAware"]["ttft_mean_s"]
        )
    print("\n" + "\n".join(f"{k}: {v:.3g}" for k, v in checks.items()))
    path = write_json(
        "bench_router", {"args": vars(args), "device": device, "tiers": tiers, "checks": checks}
    )
    print(f"results: {path}")
    plot(device, tiers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
