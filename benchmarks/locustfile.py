"""Load ramp with locust: raise concurrency level by level until the queue limit answers 503.

Each simulated user is one closed-loop client: it streams a completion, measures the time to the first
token it receives, and sends the next one at once (after a 503 it waits the Retry-After it was given, as
a well-behaved client does). Concurrency starts at --start-users and is multiplied by --users-factor every
--step-seconds; the run ends after the first level in which the server answered 503 (or at --max-users).
Per level it reports completed requests per second, p50 / p99 time to first token and the share of 503s,
and it names the level where the 503s start. A table is printed at the end and the figures are written to
bench-results/locust_ramp.json.

Locust is a load tool, not a dependency of Pagoda; run it from its own environment:

    python -m venv /tmp/locust && /tmp/locust/bin/pip install locust
    pagoda serve --max-num-seqs 8 --max-num-queued-reqs 16 &       # a limit a laptop can reach
    /tmp/locust/bin/locust -f benchmarks/locustfile.py --headless --host http://127.0.0.1:8000 \\
        --start-users 2 --users-factor 2 --step-seconds 30 --max-users 256

Run it single-process (no --processes / workers): the level bookkeeping lives in this process.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import gevent
from locust import HttpUser, LoadTestShape, constant, events, task

WORDS = "alpha beta gamma delta river mountain cloud stone seven green quiet swift north paper lamp".split()
RESULTS = Path(__file__).resolve().parent.parent / "bench-results"


@dataclass
class Level:
    users: int
    start: float
    end: float | None = None
    completed: int = 0
    rejected: int = 0  # 503
    errors: int = 0  # anything else that is not a completed stream
    ttfts: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        elapsed = max((self.end or time.monotonic()) - self.start, 1e-9)
        answered = self.completed + self.rejected + self.errors
        ttfts = sorted(self.ttfts)
        return {
            "users": self.users,
            "seconds": round(elapsed, 1),
            "completed": self.completed,
            "req_per_s": round(self.completed / elapsed, 2),
            "ttft_p50_s": _quantile(ttfts, 0.50),
            "ttft_p99_s": _quantile(ttfts, 0.99),
            "rejected_503": self.rejected,
            "share_503": round(self.rejected / answered, 3) if answered else 0.0,
            "errors": self.errors,
        }


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return round(sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)], 4)


LEVELS: list[Level] = []


def current_level() -> Level | None:
    return LEVELS[-1] if LEVELS else None


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    group = parser.add_argument_group("Pagoda ramp")
    group.add_argument("--start-users", type=int, default=2, help="concurrency of the first level")
    group.add_argument("--users-factor", type=float, default=2.0, help="concurrency multiplier per level")
    group.add_argument("--step-seconds", type=float, default=30.0, help="how long each level runs")
    group.add_argument("--max-users", type=int, default=512, help="stop here even without a 503")
    group.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    group.add_argument("--prompt-words", type=int, default=24, help="words per (unique) prompt")
    group.add_argument("--model", default=None, help="model name to send (default: the server's)")


class StepUntil503(LoadTestShape):
    """Levels of start_users x factor^i users, step_seconds each, until a level saw a 503."""

    def tick(self):
        opts = self.runner.environment.parsed_options
        index = int(self.get_run_time() // opts.step_seconds)
        if index >= len(LEVELS):
            previous = current_level()
            if previous is not None:
                previous.end = time.monotonic()
                if previous.rejected:
                    return None  # the queue limit answered: the ramp is done
            users = math.ceil(opts.start_users * opts.users_factor**index)
            if users > opts.max_users:
                return None
            LEVELS.append(Level(users, time.monotonic()))
        users = LEVELS[-1].users
        return users, users  # all of a level's users start at once


class CompletionUser(HttpUser):
    wait_time = constant(0)

    @task
    def stream_completion(self) -> None:
        opts = self.environment.parsed_options
        level = current_level()
        if level is None:
            return
        words = " ".join(random.choice(WORDS) for _ in range(opts.prompt_words))
        body = {
            "prompt": f"Request {random.randrange(10**9)}: {words}",  # unique: no prefix-cache hits
            "max_tokens": opts.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        if opts.model:
            body["model"] = opts.model
        start = time.perf_counter()
        with self.client.post(
            "/v1/completions", json=body, stream=True, catch_response=True, name="/v1/completions"
        ) as r:
            if r.status_code == 503:
                level.rejected += 1
                r.failure("503 queue full")
                gevent.sleep(float(r.headers.get("Retry-After", "1")))
                return
            if r.status_code != 200:
                level.errors += 1
                r.failure(f"HTTP {r.status_code}")
                return
            ttft = None
            done = False
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    done = True
                    break
                if b'"error"' in line:
                    break
                if ttft is None:
                    ttft = time.perf_counter() - start
            if not done or ttft is None:
                level.errors += 1
                r.failure("stream ended without [DONE]")
                return
            level.completed += 1
            level.ttfts.append(ttft)
            r.success()
        events.request.fire(
            request_type="SSE",
            name="time to first token",
            response_time=ttft * 1000,
            response_length=0,
            exception=None,
            context={},
        )


@events.quitting.add_listener
def _report(environment, **_kwargs) -> None:
    if not LEVELS:
        return
    if LEVELS[-1].end is None:
        LEVELS[-1].end = time.monotonic()
    rows = [level.summary() for level in LEVELS]
    first_503 = next((row["users"] for row in rows if row["rejected_503"]), None)
    print("\nPagoda ramp (closed-loop streaming clients)")
    print("| users | req/s | TTFT p50 (s) | TTFT p99 (s) | 503 share | errors |")
    print("|------:|------:|-------------:|-------------:|----------:|-------:|")
    for row in rows:
        print(
            f"| {row['users']} | {row['req_per_s']} | {row['ttft_p50_s']} | {row['ttft_p99_s']} | "
            f"{100 * row['share_503']:.1f}% | {row['errors']} |"
        )
    if first_503 is None:
        print(f"no 503 up to {rows[-1]['users']} concurrent users")
    else:
        print(f"503s start at {first_503} concurrent users")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "locust_ramp.json").write_text(
        json.dumps({"host": environment.host, "levels": rows, "first_503_users": first_503}, indent=2)
    )
