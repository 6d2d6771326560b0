"""Continuous batching: which sequences compute how many tokens in the next step.

Every step the scheduler first serves running sequences (decodes and unfinished prefill chunks) in
policy order, then admits waiting requests while the token budget, `max_num_seqs` and the block pool
allow. A prompt longer than the remaining budget is cut into chunks (chunked prefill). When a running
sequence needs a block and none is left, the lowest-ranked running request is preempted: its blocks are
freed and it goes back to the waiting queue to be recomputed later (its cached full blocks usually make
that cheap), or, in swap mode, its blocks are saved to the host tier first.

The scheduler is the only owner of request state and of the KV cache manager (and, through it, of the
offload tiers' bookkeeping). A step is three calls:

    out = scheduler.schedule()                 # what to compute, block tables, ordered device-cache ops
    result = runner.execute(out)               # ops, forward, sampling
    updates = scheduler.update_from_output(out, result)   # append, stops, forks, frees

Stop strings are not its business: they need text, which output processing builds; it ends such a
sequence through `finish_seq`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagoda.engine.core.waiting_queue import waiting_queue
from pagoda.engine.kv_cache.manager import KVCacheManager
from pagoda.engine.outputs import Logprob
from pagoda.engine.request import Request, SeqStatus, Sequence, now
from pagoda.engine.spec_decode.config import SpeculativeConfig
from pagoda.engine.spec_decode.eligibility import opt_out_reason
from pagoda.engine.spec_decode.ngram import propose_ngram
from pagoda.engine.step import RunnerOutput, ScheduledSeq, SchedulerOutput

log = logging.getLogger("pagoda.engine.core.scheduler")

# A prompt whose logprobs are asked for is computed at most this many tokens a step: its logits rows
# ([tokens, vocab] float32) are what the step holds for it (49,152 x 256 x 4 B = 48 MiB for the default model).
PROMPT_LOGPROBS_CHUNK = 256

# Async scheduling: the token a sequence in a running step stands on for the step planned after it; never a
# real id (no vocabulary has it), replaced by the sampled token before the planned step runs.
PLACEHOLDER = -1


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # fcfs | priority
    preemption_mode: str = "recompute"  # recompute | swap
    max_loras: int = 0  # distinct LoRA adapters the running requests may use (0: LoRA off)


@dataclass
class CacheConfig:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    enable_partial_prefix_reuse: bool = True
    extra_keys: tuple[str, ...] = ()
    # A window group for the sliding layers (KVCacheManager): their window and pool; None: one pool.
    window: int | None = None
    num_window_blocks: int = 0


@dataclass
class SeqUpdate:
    """One sequence's progress in a step: the token it got."""

    request: Request
    seq: Sequence
    token_id: int
    top_logprobs: dict[int, Logprob] | None = None
    gap: float | None = None  # seconds since the sequence's previous token; None for its first
    # Speculative decoding: the tokens the sequence got after token_id in the same step.
    more_token_ids: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        offload=None,
        structured=None,
        speculative: SpeculativeConfig | None = None,
        proposer=None,
    ) -> None:
        """``offload``: a pagoda.engine.offload.OffloadManager or None. Lower tiers extend prefix hits;
        swap preemption saves a preempted sequence's blocks to them instead of leaving them to recompute.
        ``structured``: a StructuredOutputManager (None: requests with a grammar are refused).
        ``speculative``: decoding sequences get proposed tokens scored with their next one; ``proposer``
        (seq, k) -> up to k tokens makes them (default: n-gram prompt lookup with the config's sizes)."""
        self.speculative = speculative
        self.proposer = proposer
        # Per decoding sequence, the most tokens its next proposal may have: down to one past the accepted
        # ones after a rejection, up by one after a proposal accepted whole (a sequence whose proposals
        # miss costs one scored position a step, not k).
        self._spec_room: dict[str, int] = {}
        if speculative is not None and proposer is None:
            lo, hi = speculative.prompt_lookup_min, speculative.prompt_lookup_max
            self.proposer = lambda seq, k: propose_ngram(seq.token_ids, k, lo, hi)
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.preemption_mode = config.preemption_mode
        self.offload = offload
        # Blocks received from a prefill engine (engine/kv_transfer/blocks.py: StagedBlocks), looked up
        # after the offload tiers; None unless this engine is a KV consumer.
        self.remote_blocks = None
        self.kv = KVCacheManager(
            cache.num_blocks,
            cache.block_size,
            enable_prefix_caching=cache.enable_prefix_caching,
            enable_partial_prefix_reuse=cache.enable_partial_prefix_reuse,
            extra_keys=cache.extra_keys,
            should_save=offload.should_save if offload is not None else None,
            window=cache.window,
            num_window_blocks=cache.num_window_blocks,
        )
        self.waiting = waiting_queue(config.policy)
        self.structured = structured
        # Requests whose grammar is still compiling: not in the waiting queue, so admission never waits on
        # them; each schedule() moves the ready ones over.
        self.compiling: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.total_preemptions = 0

    # ---- queue management -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        spec = req.params.structured_outputs
        if spec is not None:
            if self.structured is None:
                raise ValueError("structured outputs need the tokenizer; this engine has none")
            req.grammar = self.structured.submit(spec)
            self.requests[req.request_id] = req
            self.compiling.append(req)
            return
        self.requests[req.request_id] = req
        self.waiting.add(req)

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: queued, or waiting for their grammar."""
        return len(self.waiting) + len(self.compiling)

    def _take_compiled(self, out: SchedulerOutput) -> None:
        """Queue the requests whose grammar is ready (each sequence gets its matcher); finish those whose
        compile failed."""
        for req in [r for r in self.compiling if r.grammar.done()]:
            self.compiling.remove(req)
            try:
                req.grammar = req.grammar.result()
            except Exception:  # noqa: BLE001 - the door checked the spec: a compiler bug ends this request only
                log.exception("the grammar of request %s failed to compile", req.request_id)
                for seq in req.seqs:
                    seq.finish_reason = "abort"
                self._finish_request(req)
                out.grammar_failed.append(req)
                continue
            for seq in req.seqs:
                seq.grammar = self.structured.matcher(req.grammar)
            self.waiting.add(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish the given requests (unknown ids are ignored); returns the ones that were live."""
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            for seq in req.seqs:
                if not seq.finished:
                    seq.finish_reason = "abort"
            self._finish_request(req)
            aborted.append(req)
        return aborted

    def finish_seq(
        self, request_id: str, index: int, reason: str, stop_reason: int | str | None
    ) -> Request | None:
        """Finish one running sequence from outside the step (a stop string); returns its request when
        that ended the request (unknown or already finished: nothing happens, None)."""
        req = self.requests.get(request_id)
        if req is None or index >= len(req.seqs) or req.seqs[index].finished:
            return None
        seq = req.seqs[index]
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self._free_seq(seq)
        if not req.finished:
            return None
        self._finish_request(req)
        return req

    def _finish_request(self, req: Request) -> None:
        """Free every block of a finished or aborted request, wherever it is."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.compiling:
            self.compiling.remove(req)
        else:
            self.waiting.remove(req)
        for seq in req.seqs:
            self._free_seq(seq)
            if hasattr(self.proposer, "free"):  # a draft model's own cache
                self.proposer.free(seq)
        req.status = SeqStatus.FINISHED
        self.requests.pop(req.request_id, None)

    def _free_seq(self, seq: Sequence) -> None:
        self._spec_room.pop(seq.seq_id, None)
        if seq.has_blocks:
            self.kv.free(seq.seq_id)
            seq.has_blocks = False

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.active_seqs) for r in self.running)

    # ---- the step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.compiling:
            self._take_compiled(out)
        budget = self.max_num_batched_tokens
        self.waiting.order_running(self.running)
        preempted_now = False
        spec_k = self.speculative.tokens_for_batch(self.num_running_seqs) if self.speculative else 0
        if spec_k and hasattr(self.proposer, "prepare"):  # a draft model proposes for the batch at once
            self.proposer.prepare(self._draft_batch(spec_k))

        for req in list(self.running):
            if req not in self.running:  # preempted earlier in this step
                continue
            for seq in req.active_seqs:
                if budget <= 0:
                    break
                num_new = self._num_new_tokens(req, seq, budget, out)
                if num_new == 0:
                    continue
                if req.kv_streaming is not None:
                    self._evict_middle(req, seq, num_new)
                draft = self._propose(req, seq, num_new, budget, spec_k) if spec_k else []
                if draft and self.kv.allocate_slots(
                    seq.seq_id, seq.num_computed_tokens + num_new + len(draft)
                ):
                    sched = ScheduledSeq(req, seq, num_new)
                    sched.add_draft(draft)
                    if hasattr(self.proposer, "probs"):
                        sched.draft_probs = self.proposer.probs(seq, len(draft))
                    out.scheduled.append(sched)
                    budget -= sched.num_new_tokens
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

        # Admit waiting requests (not in a step that had to preempt: the pool is tight). One whose LoRA
        # adapter would take the running requests past max_loras adapters waits; those behind it may go.
        lora_skipped: list[Request] = []
        while not preempted_now and len(self.waiting) and budget > 0:
            req = self.waiting.peek()
            if not self._lora_fits(req):
                lora_skipped.append(self.waiting.pop())
                continue
            seqs = req.active_seqs
            if self.num_running_seqs + len(seqs) > self.max_num_seqs:
                break
            planned: list[ScheduledSeq] = []
            fits = True
            for seq in seqs:
                num_new = self._num_new_tokens(req, seq, budget, out) if budget > 0 else 0
                if num_new == 0 and seq.num_computed_tokens < seq.num_cache_tokens:
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
            if req.first_scheduled_time is None:
                out.new_request_prompt_lens.append(len(req.prompt_token_ids))
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
        for skipped in reversed(lora_skipped):
            self.waiting.add(skipped, front=True)

        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        for sched in out.scheduled:
            sched.block_table = self.kv.get_block_table(sched.seq.seq_id)
            sched.window_block_table = self.kv.get_window_block_table(sched.seq.seq_id)
            sched.position_offset = self.kv.get_position_offset(sched.seq.seq_id)
            if sched.samples:
                sched.sample_seqs = [sched.seq]
                req = sched.request
                if req.params.n > 1 and not req.forked:
                    # Children share the prompt's blocks (the forward about to run fills them); each
                    # draws its own first token from the same logits row.
                    for child in req.fork_children():
                        self.kv.fork(sched.seq.seq_id, child.seq_id)
                        if sched.seq.grammar is not None:
                            child.grammar = self.structured.fork(sched.seq.grammar)
                        sched.sample_seqs.append(child)
        out.kv_ops = self.kv.take_ops()
        self._bitmask(out)
        return out

    def _propose(self, req: Request, seq: Sequence, num_new: int, budget: int, k: int) -> list[int]:
        """Tokens to score after a decoding sequence's next one ([] for a prefill chunk, an opted-out
        request, or no room: the proposal stays within max_tokens, max_model_len and the step's budget)."""
        if num_new != 1:
            return []
        room = min(self._spec_tokens(req, seq, k), budget - 1)
        return self.proposer(seq, room)[:room] if room > 0 else []

    def _spec_tokens(self, req: Request, seq: Sequence, k: int) -> int:
        """How many tokens a decoding sequence may have proposed (0: none), before the step's budget."""
        if seq.num_computed_tokens + 1 != seq.num_cache_tokens or seq.kv_dropped:
            return 0
        n_out = seq.num_output_tokens
        if n_out < req.params.min_tokens or opt_out_reason(req) is not None:
            return 0
        k = min(k, self._spec_room.get(seq.seq_id, k))
        return min(k, req.max_tokens - n_out - 1, self.config.max_model_len - seq.num_tokens - 1)

    def _draft_batch(self, k: int) -> list[tuple[Request, Sequence, int]]:
        """The running sequences that may speculate this step, with their room (a draft model's batch)."""
        batch = []
        for req in self.running:
            for seq in req.active_seqs:
                room = self._spec_tokens(req, seq, k) if seq.has_blocks else 0
                if room > 0:
                    batch.append((req, seq, room))
        return batch

    def _bitmask(self, out: SchedulerOutput) -> None:
        """The token masks of the sampling rows that have a grammar, by row (None: no such row)."""
        if self.structured is not None:
            rows = [s for sched in out.scheduled for s in sched.sample_seqs]
            out.token_bitmask = self.structured.bitmask(
                [(i, s.grammar) for i, s in enumerate(rows) if s.grammar is not None]
            )

    def _lora_fits(self, req: Request) -> bool:
        """Whether admitting ``req`` keeps the running requests within max_loras distinct adapters."""
        if req.lora is None or self.config.max_loras < 1:
            return True
        running = {r.lora.id for r in self.running if r.lora is not None}
        return req.lora.id in running or len(running) < self.config.max_loras

    def _num_new_tokens(self, req: Request, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Tokens to compute for seq this step; looks the prefix cache up for a sequence without blocks
        (not while the request's prompt logprobs are still to compute: cached KV gives no logits)."""
        if req.needs_prompt_logprobs:
            budget = min(budget, PROMPT_LOGPROBS_CHUNK)
            if not seq.has_blocks:
                self.kv.get_computed_tokens(seq.seq_id, [])
                seq.has_blocks = True
                seq.num_computed_tokens = 0
            remaining = seq.num_cache_tokens - seq.num_computed_tokens
            return min(remaining, budget)
        if not seq.has_blocks:
            # After an attention-sink eviction the cache holds (and a restart recomputes) only the kept
            # tokens, at their cache positions: that is what the prefix cache is asked about. A LoRA
            # request's chain starts at its adapter's root: no other adapter's KV can match it.
            tokens = seq.token_ids if seq.kv_dropped == 0 else seq.cache_tokens(0, seq.num_cache_tokens)
            root = req.lora.cache_root if req.lora is not None else None
            hit = self.kv.get_computed_tokens(seq.seq_id, tokens, root)
            seq.has_blocks = True
            seq.prefix_lookup = (len(tokens) if self.kv.enable_prefix_caching else 0, hit)
            if self.offload is not None:
                hit += self.offload.load_prefix(self.kv, seq.seq_id, tokens, hit)
            if self.remote_blocks is not None:
                hit += self.remote_blocks.load_prefix(self.kv, seq.seq_id, tokens, hit)
            gained = self.kv.reuse_partial_block(seq.seq_id, tokens)
            if gained:
                hit += gained
                seq.prefix_lookup = (seq.prefix_lookup[0], seq.prefix_lookup[1] + gained)
            seq.num_computed_tokens = hit
        remaining = seq.num_cache_tokens - seq.num_computed_tokens
        if remaining <= budget:
            return remaining
        return budget if self.enable_chunked_prefill else 0

    def _evict_middle(self, req: Request, seq: Sequence, num_new: int) -> None:
        """Attention sinks: when the step would take the sequence's cache past its budget, free whole
        blocks of computed tokens right after the sinks (the manager rotates the sinks to follow)."""
        sink, cap = req.kv_streaming
        over = seq.num_computed_tokens + num_new - cap
        if over <= 0:
            return
        bs = self.kv.block_size
        first = sink // bs
        count = min(-(-over // bs), seq.num_computed_tokens // bs - first)
        if count >= 1 and self.kv.drop_blocks(seq.seq_id, first, count):
            seq.kv_dropped += count * bs
            seq.num_computed_tokens -= count * bs
            seq.num_evictions += 1

    def _pick_victim(self, exclude: Request) -> Request | None:
        """The lowest-ranked running request other than `exclude`: last admitted (fcfs) or lowest priority."""
        candidates = [r for r in self.running if r is not exclude]
        return self.waiting.pick_victim(candidates) if candidates else None

    def _preempt(self, req: Request, out: SchedulerOutput) -> int:
        """Free the request's blocks and queue it for recompute; returns the budget it gave back."""
        refund = sum(s.num_new_tokens for s in out.scheduled if s.request is req)
        out.scheduled = [s for s in out.scheduled if s.request is not req]
        self.running.remove(req)
        for seq in req.seqs:
            if self.preemption_mode == "swap" and self.offload is not None and seq.has_blocks:
                self.offload.swap_out(self.kv, seq.seq_id)
            self._free_seq(seq)
            seq.num_computed_tokens = 0
        req.status = SeqStatus.WAITING
        req.num_preemptions += 1
        self.total_preemptions += 1
        out.num_preemptions += 1
        out.preempted.append(req)
        self.waiting.add(req, front=True)
        return refund

    # ---- after the forward ------------------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, result: RunnerOutput, advanced: bool = False
    ) -> list[SeqUpdate]:
        """The scheduled tokens now sit in the cache: register full blocks, append the sampled tokens, apply
        stops, free what finished. Returns one update per sampled sequence, in batch order. A sequence that
        ended while the step ran (an abort, a stop string) gets nothing. ``advanced``: `advance_in_flight`
        already moved the step's counts on and left placeholders, which the sampled tokens replace."""
        if result.saved and self.offload is not None:
            self.offload.store(result.saved, result.save_seconds)
        for sched in out.scheduled:
            seq, req = sched.seq, sched.request
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = req.first_scheduled_time
                if req.num_cached_tokens == 0:
                    req.num_cached_tokens = sched.start
            if not advanced and not seq.finished and not sched.draft:
                self._computed(sched)
        for sched in out.scheduled:
            req = sched.request
            if req.params.prompt_logprobs is not None and not req.prompt_logprobs:
                # Nothing predicts the first prompt token: its entry is None once it is computed (a one-token
                # prompt then has all its prompt logprobs, [None], and no longer keeps off the prefix cache).
                req.prompt_logprobs.append(None)
        for index, entries in result.prompt_logprobs:
            out.scheduled[index].request.prompt_logprobs.extend(entries)
        updates: list[SeqUpdate] = []
        i = 0
        t_now = now()
        for sched in out.scheduled:
            for seq in sched.sample_seqs:
                tok = result.token_ids[i]
                top = result.top_logprobs[i] if result.top_logprobs else None
                lp = result.logprobs[i] if result.logprobs else 0.0
                spec = result.spec_token_ids.get(i) if sched.draft else None
                spec_lps = result.spec_logprobs.get(i)
                i += 1
                if advanced and seq.token_ids[-1] == PLACEHOLDER:
                    seq.token_ids.pop()
                if seq.finished:
                    continue
                if spec is not None:
                    updates.append(self._verified(out, sched, spec, spec_lps, t_now))
                    continue
                updates.append(self._append(sched.request, seq, tok, lp, top, t_now))
        finished = {id(u.request): u.request for u in updates if u.request.finished}
        for req in finished.values():
            if req.request_id in self.requests:
                self._finish_request(req)
        return updates

    def _verified(
        self,
        out: SchedulerOutput,
        sched: ScheduledSeq,
        tokens: list[int],
        logprobs: list[float] | None,
        t_now: float,
    ) -> SeqUpdate:
        """Take in a verified proposal: ``tokens`` are the accepted proposals and the target's own next
        token. Only the accepted tokens' KV counts as computed (and reaches the prefix cache); the slots of
        the rejected ones are given back. Stops apply token by token: what follows a stop is dropped."""
        seq, req = sched.seq, sched.request
        accepted = len(tokens) - 1
        out.spec_num_drafts += 1
        out.spec_num_draft_tokens += len(sched.draft)
        per_pos = out.spec_accepted_per_pos
        per_pos.extend([0] * (len(sched.draft) - len(per_pos)))
        for pos in range(accepted):
            per_pos[pos] += 1
        self._spec_room[seq.seq_id] = len(sched.draft) + 1 if accepted == len(sched.draft) else accepted + 1
        seq.num_computed_tokens = sched.start + 1 + accepted
        update = None
        for j, tok in enumerate(tokens):
            lp = logprobs[j] if logprobs else 0.0
            if update is None:
                update = self._append(req, seq, tok, lp, None, t_now)
            else:
                self._append(req, seq, tok, lp, None, t_now)
                update.more_token_ids.append(tok)
            if seq.finished:
                break
        if not seq.finished:
            self.kv.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            self.kv.truncate(seq.seq_id, seq.num_computed_tokens)
        return update

    def _computed(self, sched: ScheduledSeq) -> None:
        """The chunk's tokens are (or, in flight, will be) in the cache: count them, register full blocks."""
        seq = sched.seq
        seq.num_computed_tokens = sched.start + sched.num_new_tokens
        tokens = seq.token_ids if seq.kv_dropped == 0 else seq.cache_tokens(0, seq.num_cache_tokens)
        self.kv.cache_blocks(seq.seq_id, tokens, seq.num_computed_tokens)
        for child in sched.sample_seqs[1:]:
            child.num_computed_tokens = seq.num_computed_tokens

    # ---- async scheduling: the next step planned while this one runs ----------------------------------
    def can_advance(self, out: SchedulerOutput) -> bool:
        """Whether the step after ``out`` can be planned before ``out``'s tokens are known: only what the
        tokens themselves decide stops it. A grammar (its next mask needs the token), a fork of n > 1
        sequences, prompt logprobs still being computed, or attention-sink eviction in ``out`` means no."""
        for sched in out.scheduled:
            req, seq = sched.request, sched.seq
            if seq.finished:
                continue
            if req.kv_streaming is not None or req.needs_prompt_logprobs:
                return False
            if sched.samples and (len(sched.sample_seqs) != 1 or seq.grammar is not None):
                return False
            if sched.draft:  # how many tokens it gets is what verification decides
                return False
        return True

    def advance_in_flight(self, out: SchedulerOutput) -> None:
        """Move ``out``'s sequences on as if it had finished: computed counts and full blocks (what its
        tokens do not decide), and one placeholder token per sampling sequence, so `schedule` plans each a
        one-token decode next. `update_from_output(out, result, advanced=True)` swaps in the real tokens."""
        for sched in out.scheduled:
            seq = sched.seq
            if seq.finished:
                continue
            self._computed(sched)
            if sched.samples:
                seq.token_ids.append(PLACEHOLDER)

    def drop_finished(self, out: SchedulerOutput) -> None:
        """Take the sequences that ended since ``out`` was planned (their blocks are freed) out of it."""
        kept = [s for s in out.scheduled if not s.seq.finished]
        if len(kept) != len(out.scheduled):
            out.scheduled = kept
            out.num_batched_tokens = sum(s.num_new_tokens for s in kept)
            if out.token_bitmask is not None:  # the masks go by row: the rows moved
                self._bitmask(out)

    def _append(
        self,
        req: Request,
        seq: Sequence,
        tok: int,
        lp: float,
        top: dict[int, Logprob] | None,
        t_now: float,
    ) -> SeqUpdate:
        params = req.params
        seq.token_ids.append(tok)
        seq.cumulative_logprob += lp
        gap = None
        if seq.first_token_time is None:
            seq.first_token_time = t_now
            if seq.index == 0 and req.metrics.first_token_time is None:
                req.metrics.first_token_time = t_now
        else:
            gap = t_now - seq.last_token_time
        seq.last_token_time = t_now
        req.metrics.last_token_time = t_now
        n_out = seq.num_output_tokens
        if n_out >= params.min_tokens:
            if tok in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", tok
            elif not params.ignore_eos and tok in req.eos_token_ids:
                seq.finish_reason = "stop"
        if seq.grammar is not None and not seq.finished:
            self._advance_grammar(req, seq, tok)
        # Attention sinks keep the cache within max_model_len however long the sequence grows.
        at_len = req.kv_streaming is None and seq.num_tokens >= self.config.max_model_len
        if not seq.finished and (n_out >= req.max_tokens or at_len):
            seq.finish_reason = "length"
        if seq.finished:
            self._free_seq(seq)
        return SeqUpdate(req, seq, tok, top, gap)

    def _advance_grammar(self, req: Request, seq: Sequence, tok: int) -> None:
        """Feed the token to the sequence's matcher; the grammar's end (its stop token accepted) ends the
        sequence, whatever ignore_eos says (nothing else could follow)."""
        if not self.structured.accept(seq.grammar, tok):
            log.error("request %s: the grammar refused token %d that its mask allowed", req.request_id, tok)
            seq.finish_reason = "abort"
        elif self.structured.finished(seq.grammar):
            seq.finish_reason = "stop"

    # ---- views --------------------------------------------------------------------------------------
    def kv_waste(self) -> float:
        """Allocated-but-unfilled KV slots over allocated slots, across running sequences."""
        allocated = filled = 0
        for req in self.running:
            for seq in req.active_seqs:
                if seq.has_blocks:
                    allocated += len(self.kv.get_block_table(seq.seq_id)) * self.kv.block_size
                    filled += seq.num_computed_tokens
        return 0.0 if allocated == 0 else 1.0 - filled / allocated

    def check_invariants(self) -> None:
        """Raise AssertionError when request state and the KV cache manager disagree."""
        self.kv.check_invariants()
        live = {s.seq_id for r in self.requests.values() for s in r.seqs if s.has_blocks}
        for req in self.requests.values():
            assert req.status != SeqStatus.FINISHED, f"{req.request_id} is finished but still tracked"
        assert all(self.kv.has_seq(s) for s in live), (
            "a sequence that has blocks is unknown to the KV manager"
        )
        if not self.requests:
            assert self.kv.num_seqs == 0, "no request is live but the KV manager still holds sequences"
            assert self.kv.num_used_blocks == 0, "no request is live but blocks are in use"
