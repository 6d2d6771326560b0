"""One step's contract between the scheduler and the model runner: the plan the scheduler builds
(`SchedulerOutput`: which sequences compute how many tokens, with their block tables, and the device-cache
ops to run first) and what the runner hands back (`RunnerOutput`). The scheduler writes the plan and reads
the result; the runner reads the plan and writes the result; neither reaches into the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.engine.kv_cache.hashing import BlockHash
from pagoda.engine.kv_cache.ops import KVOp
from pagoda.engine.outputs import Logprob
from pagoda.engine.request import Request, Sequence
from pagoda.engine.structured_output import TokenBitmask


@dataclass
class ScheduledSeq:
    request: Request
    seq: Sequence
    num_new_tokens: int
    # The chunk reaches the sequence's last token, so the step yields its next token. Fixed when scheduled
    # (the sequence's computed count moves on after the forward).
    samples: bool = field(init=False)
    # Filled at the end of schedule(): the block table the forward uses, and the sequences that draw a token
    # from this row's logits (the sequence itself, plus its fork children when an n > 1 prompt completes).
    block_table: list[int] = field(default_factory=list)
    # The sliding layers' table (a cache with a window group), aligned with block_table; None without one.
    window_block_table: list[int] | None = None
    sample_seqs: list[Sequence] = field(default_factory=list)
    # Attention sinks: tokens evicted from the cache since it was built; rotary positions add it.
    position_offset: int = 0
    # Tokens this chunk starts from (the sequence's computed count when scheduled).
    start: int = field(init=False)
    # Speculative decoding: tokens proposed after the sequence's last one, scored in the same forward (their
    # slots are part of num_new_tokens; the runner returns logits at every one of them).
    draft: list[int] = field(default_factory=list)
    # The distributions the draft tokens were drawn from ([len(draft), vocab] torch tensor on the host, for
    # rejection sampling); None: each proposal is a point mass (n-gram, greedy draft model).
    draft_probs: object | None = None

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_new_tokens == self.seq.num_cache_tokens

    def add_draft(self, draft: list[int]) -> None:
        """Score ``draft`` after this decode's token in the same forward."""
        self.draft = list(draft)
        self.num_new_tokens += len(draft)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # Device-cache writes to run, in order, before the forward (also when nothing is scheduled).
    kv_ops: list[KVOp] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_preemptions: int = 0
    preempted: list[Request] = field(default_factory=list)
    # Prefix-cache lookups made while admitting requests this step (tokens).
    prefix_queries: int = 0
    prefix_hits: int = 0
    # Prompt lengths of the requests admitted for the first time this step.
    new_request_prompt_lens: list[int] = field(default_factory=list)
    # Structured outputs: the token masks of the sampling rows that have a grammar (None: no such row).
    token_bitmask: TokenBitmask | None = None
    # Requests whose grammar failed to compile this step (finished with "abort"; the engine reports them).
    grammar_failed: list[Request] = field(default_factory=list)
    # Speculative decoding, filled when the step's results are taken in: proposals verified, tokens
    # proposed, tokens accepted at each proposal position (vLLM's spec_decode counters).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    """What the model runner hands back: one sampled token per entry of the scheduled sample_seqs, in order,
    and the blocks it read for SaveBlock ops (hash, host tensor)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    # Prompt logprobs: (index into the scheduled list, one entry per prompt token the chunk predicted).
    prompt_logprobs: list[tuple[int, list[dict[int, Logprob]]]] = field(default_factory=list)
    saved: list[tuple[BlockHash, object]] = field(default_factory=list)
    save_seconds: float = 0.0
    # Speculative decoding: per sampling row that verified a draft (its index among token_ids), every token
    # it emits (the accepted proposals and one of the target's own) and their logprobs.
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[int, list[float]] = field(default_factory=dict)
