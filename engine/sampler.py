"""Turns a step's logits into next tokens, batched over rows with per-row parameters.

Order: penalties -> min_tokens masking -> (greedy | temperature -> top-k -> top-p -> min-p -> sample).
Seeded rows draw from their own generator so a seeded request gives the same tokens whatever else is in
the batch; unseeded rows share one batched draw. Log-probabilities are those of the raw model
distribution, as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagoda.engine.outputs import Logprob
from pagoda.engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    # Token ids that end generation (EOS + stop_token_ids): masked while min_tokens is not reached.
    stop_ids: list[int]


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # logprob of each chosen token
    top_logprobs: list[dict[int, Logprob] | None]


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long
            )
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            out = torch.tensor(row.output_token_ids, dtype=torch.long)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _mask_stops(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens and row.stop_ids:
            logits[i, torch.tensor(row.stop_ids, dtype=torch.long)] = float("-inf")


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on the random rows; returns probabilities."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype).unsqueeze(1)
    logits = logits / temps
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab).unsqueeze(0)
        k = torch.tensor([k if k > 0 else vocab for k in top_k]).unsqueeze(1)
        drop = ranks >= k
        probs_sorted = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        before = probs_sorted.cumsum(dim=-1) - probs_sorted
        drop |= before >= torch.tensor(top_p, dtype=logits.dtype).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(m > 0 for m in min_p):
        threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, dtype=probs.dtype).unsqueeze(
            1
        )
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _draw(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], dtype=probs.dtype).exponential_()
    for i, r in enumerate(rows):
        if r.generator is not None:
            noise[i] = torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(generator=r.generator)
    return (probs / noise).argmax(dim=-1)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
    """logits: float32 [N, vocab] on any device; rows: one per logits row."""
    logits = logits.float().cpu()
    raw_logprobs = logits.log_softmax(dim=-1)
    work = logits.clone()
    _apply_penalties(work, rows)
    _mask_stops(work, rows)

    chosen = torch.empty(len(rows), dtype=torch.long)
    greedy = [i for i, r in enumerate(rows) if r.params.temperature == 0.0]
    rand = [i for i, r in enumerate(rows) if r.params.temperature != 0.0]
    if greedy:
        chosen[greedy] = work[greedy].argmax(dim=-1)
    if rand:
        sub = [rows[i] for i in rand]
        chosen[rand] = _draw(_filter(work[rand], sub), sub)

    token_ids = chosen.tolist()
    picked = raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    tops: list[dict[int, Logprob] | None] = []
    want = [r.params.logprobs for r in rows]
    kmax = max((k for k in want if k is not None), default=None)
    top_vals = top_ids = None
    if kmax is not None:
        top_vals, top_ids = raw_logprobs.topk(max(kmax, 1), dim=-1)
    for i, k in enumerate(want):
        if k is None:
            tops.append(None)
            continue
        tok = token_ids[i]
        rank = int((raw_logprobs[i] > raw_logprobs[i, tok]).sum()) + 1
        entry = {tok: Logprob(picked[i], rank)}
        for r in range(k):
            tid = int(top_ids[i, r])
            if tid not in entry:
                entry[tid] = Logprob(float(top_vals[i, r]), r + 1)
        tops.append(entry)
    return SampleResult(token_ids=token_ids, logprobs=picked, top_logprobs=tops)
