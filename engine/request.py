"""Request and sequence state as the scheduler and engine see it.

A request with `n > 1` starts as one sequence; when its prompt has been computed it forks into `n`
sequences that share the prompt's KV blocks (copy-on-write).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from pagoda.engine.outputs import Logprob, RequestMetrics
from pagoda.engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    # True once the KV cache manager holds a block table for this sequence.
    has_blocks: bool = False
    # (tokens looked up, tokens hit) of the last prefix-cache lookup, counted once the request is admitted.
    prefix_lookup: tuple[int, int] = (0, 0)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Attention sinks (StreamingLLM): the first kv_sink tokens stay in the cache for good; kv_dropped tokens
    # right after them were evicted. The cache holds token_ids[:kv_sink] + token_ids[kv_sink + kv_dropped:],
    # and num_computed_tokens counts cache tokens (cache positions), not positions in token_ids.
    kv_sink: int = 0
    kv_dropped: int = 0
    num_evictions: int = 0
    # Structured outputs: this sequence's grammar matcher (engine/structured_output), None without one.
    grammar: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_cache_tokens(self) -> int:
        """Tokens the KV cache must hold for this sequence (all of them unless some were evicted)."""
        return len(self.token_ids) - self.kv_dropped

    def cache_tokens(self, start: int, n: int) -> list[int]:
        """Token ids at cache positions [start, start + n): the evicted middle is skipped."""
        if self.kv_dropped == 0 or start + n <= self.kv_sink:
            return self.token_ids[start : start + n]
        if start >= self.kv_sink:
            return self.token_ids[start + self.kv_dropped : start + n + self.kv_dropped]
        return (
            self.token_ids[start : self.kv_sink]
            + self.token_ids[self.kv_sink + self.kv_dropped : start + n + self.kv_dropped]
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # clamped to the room left in the context
    arrival_time: float
    priority: int = 0
    seqs: list[Sequence] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    forked: bool = False  # n > 1: children created once the prompt was computed
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    eos_token_ids: frozenset[int] = frozenset()  # ends the sequence unless params.ignore_eos
    # Attention sinks (StreamingLLM), resolved at the door: None, or (sink tokens, whole blocks; most tokens
    # the cache keeps). Such a request may run past max_model_len.
    kv_streaming: tuple[int, int] | None = None
    # The LoRA adapter it runs through (pagoda.engine.lora.registry.LoRAAdapter), None for the base model.
    lora: Any = None
    # Structured outputs: the compile Future until the grammar is ready, then the compiled grammar.
    grammar: Any = None
    # Prompt logprobs (params.prompt_logprobs): one entry per prompt token computed so far (None for the
    # first, which nothing predicts); handed out once, with the request's first output.
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if not self.seqs:
            self.seqs.append(self._new_seq(0, list(self.prompt_token_ids)))

    def _new_seq(self, index: int, token_ids: list[int]) -> Sequence:
        gen = None
        if self.params.seed is not None:
            gen = torch.Generator().manual_seed((self.params.seed * 1_000_003 + index) % (2**63))
        return Sequence(
            seq_id=f"{self.request_id}#{index}",
            index=index,
            token_ids=token_ids,
            num_prompt_tokens=len(self.prompt_token_ids),
            generator=gen,
            kv_sink=self.kv_streaming[0] if self.kv_streaming else 0,
        )

    def fork_children(self) -> list[Sequence]:
        """Create sequences 1..n-1 as copies of sequence 0 (before its first token is sampled)."""
        parent = self.seqs[0]
        children = []
        for i in range(1, self.params.n):
            child = self._new_seq(i, list(parent.token_ids))
            child.num_computed_tokens = parent.num_computed_tokens
            child.kv_dropped = parent.kv_dropped
            child.has_blocks = True
            children.append(child)
        self.seqs.extend(children)
        self.forked = True
        return children

    @property
    def active_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are still to compute (cached KV gives no logits)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_token_ids
        )

    @property
    def sort_key(self) -> tuple:
        return (self.priority, self.arrival_time)


def now() -> float:
    return time.monotonic()
