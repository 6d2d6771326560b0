"""Continuous batching: which sequences compute how many tokens in the next step.

Every step the scheduler first serves running sequences (decodes and unfinished prefill chunks) in
policy order, then admits waiting requests while the token budget, `max_num_seqs` and the block pool
allow. A prompt longer than the remaining budget is cut into chunks (chunked prefill). When a running
sequence needs a block and none is left, the lowest-ranked running request is preempted: its blocks are
freed and it goes back to the waiting queue to be recomputed later (its cached full blocks usually make
that cheap).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagoda.engine.kv_cache.manager import KVCacheManager
from pagoda.engine.request import Request, SeqStatus, Sequence, now


@dataclass
class ScheduledSeq:
    request: Request
    seq: Sequence
    num_new_tokens: int
    # The chunk reaches the sequence's last token, so the step yields its next token. Fixed when scheduled
    # (the sequence's computed count moves on after the forward).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_preemptions: int = 0
    preempted: list[Request] = field(default_factory=list)
    # Prefix-cache lookups made while admitting requests this step (tokens).
    prefix_queries: int = 0
    prefix_hits: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """FCFS deque, or a heap ordered by (priority, arrival) for the priority policy."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, req: Request, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._counter), req))
        elif front:
            self._fifo.appendleft(req)
        else:
            self._fifo.append(req)

    def peek(self) -> Request:
        return self._heap[0][3] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, req: Request) -> bool:
        if self.policy == "priority":
            for i, item in enumerate(self._heap):
                if item[3] is req:
                    self._heap.pop(i)
                    heapq.heapify(self._heap)
                    return True
            return False
        try:
            self._fifo.remove(req)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __iter__(self) -> Iterable[Request]:
        return iter(
            [item[3] for item in sorted(self._heap)] if self.policy == "priority" else list(self._fifo)
        )


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.total_preemptions = 0
        # Offload tiers (set by the engine): lower tiers extend prefix hits; "swap" pushes a preempted
        # sequence's blocks to the host tier instead of leaving them to be recomputed.
        self.offload = None  # pagoda.engine.offload.OffloadManager | None
        self.preemption_mode = "recompute"

    # ---- queue management -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.waiting.add(req)

    def finish_request(self, req: Request) -> None:
        """Free every block of a finished or aborted request, wherever it is."""
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        for seq in req.seqs:
            self._free_seq(seq)
        req.status = SeqStatus.FINISHED

    def free_finished_seq(self, seq: Sequence) -> None:
        self._free_seq(seq)

    def _free_seq(self, seq: Sequence) -> None:
        if seq.has_blocks:
            self.kv.free(seq.seq_id)
            seq.has_blocks = False

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.active_seqs) for r in self.running)

    # ---- the step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.policy == "priority":
            self.running.sort(key=lambda r: r.sort_key)
        preempted_now = False

        for req in list(self.running):
            if req not in self.running:  # preempted earlier in this step
                continue
            for seq in req.active_seqs:
                if budget <= 0:
                    break
                num_new = self._num_new_tokens(seq, budget, out)
                if num_new == 0:
                    continue
                while not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new):
                    victim = self._pick_victim(exclude=req)
                    if victim is None:
                        break
                    budget += self._preempt(victim, out)
                    preempted_now = True
                else:
                    out.scheduled.append(ScheduledSeq(req, seq, num_new))
                    budget -= num_new
                    continue
                # Nothing left to preempt but this request itself.
                budget += self._preempt(req, out)
                preempted_now = True
                break

        # Admit waiting requests (not in a step that had to preempt: the pool is tight).
        while not preempted_now and len(self.waiting) and budget > 0:
            req = self.waiting.peek()
            seqs = req.active_seqs
            if self.num_running_seqs + len(seqs) > self.max_num_seqs:
                break
            planned: list[ScheduledSeq] = []
            fits = True
            for seq in seqs:
                num_new = self._num_new_tokens(seq, budget, out) if budget > 0 else 0
                if num_new == 0 and seq.num_computed_tokens < seq.num_tokens:
                    fits = bool(planned)  # admit if at least one sequence got going
                    break
                if not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new):
                    fits = bool(planned)
                    break
                planned.append(ScheduledSeq(req, seq, num_new))
                budget -= num_new
            if not fits:
                for sched in planned:
                    budget += sched.num_new_tokens
                for seq in seqs:
                    self._free_seq(seq)
                    seq.num_computed_tokens = 0
                out.scheduled = [s for s in out.scheduled if s.request is not req]
                break
            self.waiting.pop()
            for seq in seqs:
                queries, hits = seq.prefix_lookup
                out.prefix_queries += queries
                out.prefix_hits += hits
                seq.prefix_lookup = (0, 0)
            self.running.append(req)
            req.status = SeqStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now()
            out.scheduled.extend(s for s in planned if s.num_new_tokens > 0)

        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _num_new_tokens(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Tokens to compute for seq this step; looks the prefix cache up for a sequence without blocks."""
        if not seq.has_blocks:
            hit = self.kv.get_computed_tokens(seq.seq_id, seq.token_ids)
            seq.has_blocks = True
            seq.prefix_lookup = (seq.num_tokens if self.kv.enable_prefix_caching else 0, hit)
            if self.offload is not None:
                hit += self.offload.load_prefix(seq.seq_id, seq.token_ids, hit)
            seq.num_computed_tokens = hit
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining <= budget:
            return remaining
        return budget if self.enable_chunked_prefill else 0

    def _pick_victim(self, exclude: Request) -> Request | None:
        """The lowest-ranked running request other than `exclude`: last admitted (fcfs) or lowest priority."""
        candidates = [r for r in self.running if r is not exclude]
        if not candidates:
            return None
        if self.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> int:
        """Free the request's blocks and queue it for recompute; returns the budget it gave back."""
        refund = sum(s.num_new_tokens for s in out.scheduled if s.request is req)
        out.scheduled = [s for s in out.scheduled if s.request is not req]
        self.running.remove(req)
        for seq in req.seqs:
            if self.preemption_mode == "swap" and self.offload is not None and seq.has_blocks:
                self.offload.swap_out(self.kv.get_block_table(seq.seq_id))
            self._free_seq(seq)
            seq.num_computed_tokens = 0
        req.status = SeqStatus.WAITING
        req.num_preemptions += 1
        self.total_preemptions += 1
        out.num_preemptions += 1
        out.preempted.append(req)
        self.waiting.add(req, front=True)
        return refund

    def advance(self, out: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens now sit in the cache; register full blocks."""
        for sched in out.scheduled:
            seq = sched.seq
            seq.num_computed_tokens += sched.num_new_tokens
            self.kv.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
