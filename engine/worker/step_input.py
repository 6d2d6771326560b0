"""A step's batch as plain arrays (`StepInput`), built from the scheduler's plan: what the forward needs,
small enough to send to the other tensor-parallel ranks, and what the decode graphs replay."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from pagoda.engine.step import ScheduledSeq


@dataclass
class StepInput:
    """A step's batch as plain arrays: what the forward needs, small enough to send to other ranks."""

    input_ids: np.ndarray  # [T] int64
    # [T] int64 rotary positions: cache positions, after attention-sink evictions plus the evicted tokens
    positions: np.ndarray
    query_lens: np.ndarray  # [S] int64, new tokens per sequence
    context_lens: np.ndarray  # [S] int64, tokens already cached per sequence
    block_tables: np.ndarray  # [S, max_blocks] int32, padded with 0
    # [R] int64, flat index of the last token of each sampling sequence (speculative decoding: of its last
    # token and of each proposed token after it)
    sample_idx: np.ndarray
    lora_rows: np.ndarray | None = None  # [T] int64, each token's LoRA slot (-1: base model); None: no LoRA
    # [L] int64, flat index of each token whose next-token logprobs the prompt's logprobs need
    logprob_idx: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # [S, max_blocks] int32, the sliding layers' tables (0 = the null block); None without a window group
    window_block_tables: np.ndarray | None = None


def prepare_step(
    scheduled: list[ScheduledSeq], order: list[int] | None = None, lora_slots: np.ndarray | None = None
) -> StepInput:
    """The batch of ``scheduled`` in ``order`` (default: as given); with ``lora_slots`` (each sequence's
    LoRA slot, in the order of ``scheduled``), each row's slot."""
    if order is not None:
        scheduled = [scheduled[i] for i in order]
        lora_slots = None if lora_slots is None else lora_slots[order]
    tokens, positions, qlens, ctx, sample_idx = [], [], [], [], []
    offset = 0
    for sched in scheduled:
        start, n, draft = sched.start, sched.num_new_tokens, sched.draft
        tokens.extend(sched.seq.cache_tokens(start, n - len(draft)))
        tokens.extend(draft)  # speculative decoding: scored after the sequence's last token
        # rotary positions: cache positions, plus the tokens attention sinks evicted before them
        positions.append(np.arange(start, start + n, dtype=np.int64) + sched.position_offset)
        qlens.append(n)
        ctx.append(start)
        offset += n
        if sched.samples:  # a drafted sequence: logits at its last token and at every proposed one
            sample_idx.extend(range(offset - 1 - len(draft), offset))
    max_blocks = max((len(s.block_table) for s in scheduled), default=1)
    tables = np.zeros((len(scheduled), max(max_blocks, 1)), dtype=np.int32)
    for i, sched in enumerate(scheduled):
        tables[i, : len(sched.block_table)] = sched.block_table
    window_tables = None
    if scheduled and scheduled[0].window_block_table is not None:
        window_tables = np.zeros_like(tables)
        for i, sched in enumerate(scheduled):
            window_tables[i, : len(sched.window_block_table)] = sched.window_block_table
    return StepInput(
        input_ids=np.asarray(tokens, dtype=np.int64),
        positions=np.concatenate(positions),
        query_lens=np.asarray(qlens, dtype=np.int64),
        context_lens=np.asarray(ctx, dtype=np.int64),
        block_tables=tables,
        sample_idx=np.asarray(sample_idx, dtype=np.int64),
        lora_rows=None if lora_slots is None else np.repeat(lora_slots, qlens),
        window_block_tables=window_tables,
    )


def prompt_logprob_rows(
    scheduled: list[ScheduledSeq], step: StepInput, order: list[int] | None = None
) -> list[tuple[int, list[int]]]:
    """Plan the step's prompt-logprob rows and set ``step.logprob_idx``: per chunk of a request still
    computing its prompt logprobs, in the step's ``order`` (prepare_step's), (index in ``scheduled``, the
    prompt positions whose token the chunk predicts: position t is predicted by the chunk's row of t - 1)."""
    plan, flat, offset = [], [], 0
    for i in order if order is not None else range(len(scheduled)):
        sched = scheduled[i]
        req, start, n = sched.request, sched.start, sched.num_new_tokens
        if req.needs_prompt_logprobs and sched.seq.index == 0:
            first = max(start + 1, len(req.prompt_logprobs), 1)
            last = min(start + n, len(req.prompt_token_ids) - 1)
            targets = list(range(first, last + 1))
            if targets:
                plan.append((i, targets))
                flat.extend(offset + t - 1 - start for t in targets)
        offset += n
    step.logprob_idx = np.asarray(flat, dtype=np.int64)
    return plan
