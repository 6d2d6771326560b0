"""The periodic engine log line, like vLLM's: what an operator tailing the logs wants to know."""

from __future__ import annotations

import logging
import time

from pagoda.engine.core.stats import IterationStats, SchedulerStats

logger = logging.getLogger("pagoda.engine.metrics")


class LoggingStatLogger:
    """Logs throughput, queue depths, KV usage and prefix hit rate every `interval_s` while busy.

    Busy means the engine stepped (record() is called after each step) with something running or
    waiting, or tokens moved since the last line; an idle engine stays quiet.
    """

    def __init__(self, interval_s: float = 10.0, engine_index: int = 0, clock=time.monotonic) -> None:
        self.interval_s = interval_s
        self.engine_index = engine_index
        self._clock = clock
        self._reset(clock())

    def _reset(self, now: float) -> None:
        self._last = now
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._queries = 0
        self._hits = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        it = iteration_stats
        self._prompt_tokens += it.num_prompt_tokens
        self._generation_tokens += it.num_generation_tokens
        self._queries += it.prefix_cache_queries
        self._hits += it.prefix_cache_hits
        now = self._clock()
        if now - self._last < self.interval_s:
            return
        busy = (
            scheduler_stats.num_running
            or scheduler_stats.num_waiting
            or self._prompt_tokens
            or self._generation_tokens
        )
        if busy:
            logger.info(self.format(scheduler_stats, now - self._last))
        self._reset(now)

    def format(self, s: SchedulerStats, elapsed: float) -> str:
        elapsed = max(elapsed, 1e-9)
        hit_rate = 100.0 * self._hits / self._queries if self._queries else 0.0
        return (
            f"Engine {self.engine_index:03d}: "
            f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
            f"KV cache usage: {100.0 * s.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
        )
