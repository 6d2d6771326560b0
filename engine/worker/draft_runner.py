"""The draft-model proposer of speculative decoding: a second, smaller model sharing the target's tokenizer
proposes each decoding sequence's next k tokens, k steps of its own per target step, all sequences batched.

It is loaded by the same loader onto the same device in the same dtype and runs on a ModelRunner of its
own with its own small KV pool (engine/spec_decode/draft_cache.py: block tables, catch-up, eviction), so
the target's cache, prefix cache and offload tiers never see it. Greedy requests get the draft's argmax at
each position (a point mass). Sampled requests get a token drawn from the draft's own distribution q,
filtered by the request's temperature, top-k, top-p and min-p, with q kept for rejection sampling
(engine/spec_decode/acceptance.py): that keeps the target's distribution whatever q is, and accepts more
often than a point mass where the draft is close to the target. Seeded requests draw from their own
generator, so they stay reproducible.

The scheduler drives it: `prepare` once per step with every sequence that may speculate, then the
proposal of one sequence by calling the proposer, `probs` for its q, `free` when the request ends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from pagoda.engine.loader import resolve_model
from pagoda.engine.loader.gguf_quant import check_quantization
from pagoda.engine.request import Request, Sequence
from pagoda.engine.sizing.model_config import ModelConfig
from pagoda.engine.spec_decode.config import SpeculativeConfig
from pagoda.engine.spec_decode.draft_cache import DraftCache
from pagoda.engine.worker.model_runner import ModelRunner, kv_torch_dtype
from pagoda.engine.worker.rank import build_rank
from pagoda.engine.worker.sampler import SamplingRow, filtered_probs
from pagoda.engine.worker.step_input import StepInput

log = logging.getLogger("pagoda.engine")

DRAFT_BLOCK_SIZE = 16


def check_draft_vocab(draft: ModelConfig, target: ModelConfig, path: Any) -> None:
    """A draft must score the target's token ids: the same vocabulary size (the same tokenizer)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative config: the draft model {path} has a vocabulary of {draft.vocab_size} tokens and "
            f"the target {target.vocab_size}; a draft model must share the target's tokenizer"
        )


def draft_pool_blocks(
    spec: SpeculativeConfig, max_num_seqs: int, max_model_len: int, block_size: int, target_tokens: int
) -> int:
    """Blocks for every sequence that may speculate at once (the schedule's largest batch with k > 0,
    at most max_num_seqs) at full length plus its proposal, but no more tokens than the target's own cache
    holds (plus the proposals): the target cannot run more. Fewer are enough: least recently used
    sequences are evicted and recomputed."""
    widest = max((last for _, last, k in spec.per_batch_size if k > 0), default=1)
    seqs = max(1, min(max_num_seqs, widest))
    per_seq = -(-(max_model_len + spec.max_tokens + 1) // block_size)
    cap = -(-target_tokens // block_size) + seqs * (-(-(spec.max_tokens + 1) // block_size) + 1)
    return max(per_seq, min(seqs * per_seq, cap))


class DraftProposer:
    def __init__(self, runner: ModelRunner, num_blocks: int, block_size: int = DRAFT_BLOCK_SIZE) -> None:
        self.runner = runner
        self.cache = DraftCache(num_blocks, block_size)
        # this step's proposals: seq id -> (tokens, q rows [len(tokens), vocab] on the host or None)
        self._drafts: dict[str, tuple[list[int], torch.Tensor | None]] = {}
        self.num_forwards = 0  # draft forwards run (tests, benches)

    @classmethod
    def build(
        cls,
        config: Any,
        spec: SpeculativeConfig,
        target: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        target_tokens: int,
    ) -> DraftProposer:
        """Load ``spec.model`` like the target (same device and dtype; a GGUF draft's blocks kept quantized
        with ``quantization: gguf``) and size its pool; ValueError when its vocabulary is not the target's."""
        path = resolve_model(spec.model)
        mc = ModelConfig.from_dir(path)
        check_draft_vocab(mc, target, spec.model)
        if mc.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative config: the draft model {spec.model} has {mc.max_position_embeddings} positions, "
                f"fewer than max_model_len {max_model_len}: pass --max-model-len {mc.max_position_embeddings} "
                "or a draft of the target's length"
            )
        check_quantization(spec.quantization, path, mc, device)
        load = SimpleNamespace(
            attention_backend=config.attention_backend,
            quantization=spec.quantization,
            max_model_len=max_model_len,
        )
        runner = build_rank(load, path, mc, device, dtype, progress=False)
        blocks = draft_pool_blocks(spec, config.max_num_seqs, max_model_len, DRAFT_BLOCK_SIZE, target_tokens)
        runner.allocate_kv_cache(blocks, DRAFT_BLOCK_SIZE, kv_torch_dtype("auto", dtype))
        log.info(
            "speculative decoding: draft model %s (%d layers), %d KV blocks of %d tokens (%.1f MiB)",
            spec.model, mc.num_hidden_layers, blocks, DRAFT_BLOCK_SIZE, runner.kv_cache_bytes / 2**20,
        )  # fmt: skip
        return cls(runner, blocks, DRAFT_BLOCK_SIZE)

    # ---- the scheduler's side -------------------------------------------------------------------------
    def __call__(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` tokens proposed for ``seq`` this step (`prepare` computed them)."""
        return self._drafts.get(seq.seq_id, ([], None))[0][:k]

    def probs(self, seq: Sequence, n: int) -> torch.Tensor | None:
        """q of the first ``n`` proposed tokens ([n, vocab], host), None for a greedy (point-mass) draft."""
        q = self._drafts.get(seq.seq_id, ([], None))[1]
        return None if q is None else q[:n]

    def free(self, seq: Sequence) -> None:
        """``seq`` finished: its draft KV is retired for a later sequence with the same start."""
        self.cache.retire(seq.seq_id)
        self._drafts.pop(seq.seq_id, None)

    @torch.inference_mode()
    def prepare(self, batch: list[tuple[Request, Sequence, int]]) -> None:
        """Propose for every (request, sequence, k) at once: one forward catching each sequence's draft KV
        up to its last token (the first proposal comes from it), then k - 1 one-token forwards."""
        self._drafts = {}
        cache = self.cache
        protect = [seq.seq_id for _, seq, _ in batch]
        live: list[tuple[Request, Sequence, int]] = []
        for req, seq, k in batch:
            if k < 1:
                continue
            held = cache.sync(seq.seq_id, seq.token_ids) or cache.adopt(seq.seq_id, seq.token_ids)
            if held >= seq.num_tokens:  # proposed before but not scheduled: feed the last token again
                cache.truncate(seq.seq_id, seq.num_tokens - 1)
            # the proposal's last token is never fed: k - 1 proposals join the sequence's tokens
            if cache.reserve(seq.seq_id, seq.num_tokens + k - 1, protect):
                live.append((req, seq, k))
        if not live:
            return
        # Catch up: every token the draft has not seen, the sequence's last included.
        chunks = [seq.token_ids[cache.num_tokens(seq.seq_id) :] for _, seq, _ in live]
        logits = self._forward(
            [seq.seq_id for _, seq, _ in live], chunks, [cache.num_tokens(s.seq_id) for _, s, _ in live]
        )
        for (_, seq, _), chunk in zip(live, chunks, strict=True):
            cache.append(seq.seq_id, chunk, real=True)
        tokens: list[list[int]] = [[] for _ in live]
        qs: list[list[torch.Tensor]] = [[] for _ in live]
        rows = list(range(len(live)))
        self._choose(logits, [live[i] for i in rows], [tokens[i] for i in rows], [qs[i] for i in rows])
        for step in range(1, max(k for _, _, k in live)):
            rows = [i for i, (_, _, k) in enumerate(live) if k > step]
            ids = [live[i][1].seq_id for i in rows]
            feed = [[tokens[i][-1]] for i in rows]
            logits = self._forward(ids, feed, [cache.num_tokens(s) for s in ids])
            for seq_id, chunk in zip(ids, feed, strict=True):
                cache.append(seq_id, chunk, real=False)
            self._choose(logits, [live[i] for i in rows], [tokens[i] for i in rows], [qs[i] for i in rows])
        for (_, seq, _), toks, q in zip(live, tokens, qs, strict=True):
            self._drafts[seq.seq_id] = (toks, torch.stack(q) if q else None)

    # ---- the draft's own forward ---------------------------------------------------------------------
    def _forward(self, seq_ids: list[str], chunks: list[Seq[int]], starts: list[int]) -> torch.Tensor:
        """Logits [len(seq_ids), vocab] at each chunk's last token, its KV written after ``starts`` tokens."""
        qlens = np.asarray([len(c) for c in chunks], dtype=np.int64)
        tables = [self.cache.table(s) for s in seq_ids]
        table_arr = np.zeros((len(tables), max(1, max(len(t) for t in tables))), dtype=np.int32)
        for i, t in enumerate(tables):
            table_arr[i, : len(t)] = t
        step = StepInput(
            input_ids=np.asarray([t for c in chunks for t in c], dtype=np.int64),
            positions=np.concatenate(
                [np.arange(s, s + len(c), dtype=np.int64) for s, c in zip(starts, chunks, strict=True)]
            ),
            query_lens=qlens,
            context_lens=np.asarray(starts, dtype=np.int64),
            block_tables=table_arr,
            sample_idx=np.cumsum(qlens) - 1,
        )
        self.num_forwards += 1
        return self.runner.run(step)

    @staticmethod
    def _choose(
        logits: torch.Tensor,
        live: list[tuple[Request, Sequence, int]],
        tokens: list[list[int]],
        qs: list[list[torch.Tensor]],
    ) -> None:
        """Each row's next proposal: the argmax for greedy requests; for sampled ones a draw from q (the
        request's filtered draft distribution), q kept."""
        greedy = [i for i, (req, _, _) in enumerate(live) if req.params.temperature == 0.0]
        if greedy:
            picked = logits[greedy].argmax(dim=-1).tolist()
            for i, tok in zip(greedy, picked, strict=True):
                tokens[i].append(tok)
        sampled = [i for i, (req, _, _) in enumerate(live) if req.params.temperature != 0.0]
        if not sampled:
            return
        rows = [SamplingRow(live[i][0].params, [], [], None, []) for i in sampled]
        probs = filtered_probs(logits[sampled].float(), rows).cpu()
        for j, i in enumerate(sampled):
            q = probs[j]
            tokens[i].append(int(torch.multinomial(q, 1, generator=live[i][1].generator)))
            qs[i].append(q)
