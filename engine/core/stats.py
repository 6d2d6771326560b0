"""Numbers the engine core reports after every step; the metrics exporter and the log line consume them.

They cross the process boundary with each step's outputs (engine/core/messages.py), so stat loggers run in
the front end: plain data, no engine objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class SchedulerStats:
    """A snapshot of the engine's state at the end of a step."""

    num_running: int = 0
    num_waiting: int = 0
    # blocks in use over usable blocks, 0..1 (with a window group, the fuller pool's)
    kv_cache_usage: float = 0.0
    num_blocks_total: int = 0
    num_blocks_free: int = 0  # free and not holding a cached prefix
    num_blocks_cached: int = 0  # unreferenced but holding a reusable cached prefix
    # Tier state for the offload issue: tier name -> dict of numbers.
    offload: dict[str, dict[str, float]] = field(default_factory=dict)
    # LoRA (vllm:lora_requests_info, which the Gateway API Inference Extension's picker reads): the adapters
    # of the running and of the waiting requests, by name, and how many one batch may use (0: LoRA off).
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    max_lora: int = 0
    # With a window group (sliding layers): each pool's usage, "full" and "window" ("full" left out when no
    # layer keeps every block); empty with one pool.
    kv_pool_usage: dict[str, float] = field(default_factory=dict)


@dataclass
class FinishedRequestStats:
    finish_reason: str  # stop | length | abort | error
    e2e_latency: float
    queue_time: float
    prefill_time: float
    decode_time: float
    inference_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int
    n: int
    num_preemptions: int


@dataclass
class SpecDecodingStats:
    """One step's speculative decoding (vLLM's counters): proposals verified, tokens proposed, and how
    many proposals had their token at each position accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.num_accepted_tokens_per_pos)


@dataclass
class IterationStats:
    """What happened during one step (deltas)."""

    num_prompt_tokens: int = 0  # prompt tokens computed this step
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0  # tokens found
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)  # device | host | disk
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    num_prompt_tokens_per_new_request: list[int] = field(default_factory=list)
    # Offload tiers, one step's worth: tier -> {"load_seconds": [...], "store_seconds": [...]}.
    offload: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    step_seconds: float = 0.0  # the step's own duration (schedule, forward, update), measured by the core
    spec_decoding: SpecDecodingStats | None = None  # None: no proposal was verified this step


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...
