"""Turns a step's logits into next tokens, batched over rows with per-row parameters.

Order: penalties -> logit_bias -> min_tokens masking -> grammar mask -> (greedy | temperature -> top-k ->
top-p -> min-p -> sample). A row with a grammar skips min_tokens masking: where the grammar has ended, its
stop token is the only token it allows.
Seeded rows draw from their own generator so a seeded request gives the same tokens whatever else is in
the batch; unseeded rows share one batched draw. Log-probabilities are those of the raw model
distribution, as vLLM reports them.

Work stays on the logits' device and is only done where asked for: a greedy row without penalties is one
argmax over the logits as they are (no copy); the logits are copied only when some row's penalties or
min_tokens masking must change them; the full log-softmax is computed only for rows that asked for top
logprobs, the chosen token's logprob (one logsumexp) only for rows whose caller wants it
(`SamplingRow.chosen_logprob`). Only the chosen ids and the logprobs come back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagoda.engine.outputs import Logprob
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.structured_output import TokenBitmask, apply_token_bitmask
from pagoda.engine.worker import cpu_sampling


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    # Token ids that end generation (EOS + stop_token_ids): masked while min_tokens is not reached.
    stop_ids: list[int]
    # Whether the caller needs the chosen token's logprob (it feeds cumulative_logprob). False: the row's
    # `SampleResult.logprobs` entry is None unless params.logprobs asks for logprobs anyway.
    chosen_logprob: bool = True


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # logprob of each chosen token (None where nobody asked for it)
    top_logprobs: list[dict[int, Logprob] | None]


def _changes_logits(row: SamplingRow) -> bool:
    p = row.params
    return (
        p.repetition_penalty != 1.0
        or bool(p.logit_bias)
        or bool((p.presence_penalty or p.frequency_penalty) and row.output_token_ids)
        or bool(len(row.output_token_ids) < p.min_tokens and row.stop_ids)
    )


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab, device = logits.shape[-1], logits.device
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long
            )
            seen = seen[seen < vocab].to(device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            out = torch.tensor(row.output_token_ids, dtype=torch.long, device=device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=device)
            logits[i].index_add_(0, ids, bias)


def _mask_stops(logits: torch.Tensor, rows: list[SamplingRow], grammar_rows: set[int]) -> None:
    for i, row in enumerate(rows):
        if i in grammar_rows:
            continue
        if len(row.output_token_ids) < row.params.min_tokens and row.stop_ids:
            logits[i, torch.tensor(row.stop_ids, dtype=torch.long, device=logits.device)] = float("-inf")


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on the random rows; returns probabilities."""
    device = logits.device
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=device).unsqueeze(1)
    logits = logits / temps
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=device).unsqueeze(1)
        drop = ranks >= k
        probs_sorted = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        before = probs_sorted.cumsum(dim=-1) - probs_sorted
        drop |= before >= torch.tensor(top_p, dtype=logits.dtype, device=device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(m > 0 for m in min_p):
        mins = torch.tensor(min_p, dtype=probs.dtype, device=device).unsqueeze(1)
        threshold = probs.max(dim=-1, keepdim=True).values * mins
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _draw(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i.

    Seeded rows draw their noise on the host from their own generator (the same numbers on every device)."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        noise[unseeded] = torch.empty(
            len(unseeded), probs.shape[1], dtype=probs.dtype, device=probs.device
        ).exponential_()
    for i, r in enumerate(rows):
        if r.generator is not None:
            draw = torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(generator=r.generator)
            noise[i] = draw.to(probs.device)
    return (probs / noise).argmax(dim=-1)


def _choose(logits: torch.Tensor, rows: list[SamplingRow], mask: TokenBitmask | None) -> torch.Tensor:
    """Token id per row (on the logits' device)."""
    changed = [_changes_logits(r) for r in rows]
    work = logits
    if any(changed) or mask is not None:
        work = logits.clone()
        _apply_penalties(work, rows)
        _mask_stops(work, rows, set(mask.rows) if mask is not None else set())
        if mask is not None:
            apply_token_bitmask(work, mask)
    greedy = [i for i, r in enumerate(rows) if r.params.temperature == 0.0]
    if len(greedy) == len(rows):
        return work.argmax(dim=-1)
    rand = [i for i, r in enumerate(rows) if r.params.temperature != 0.0]
    chosen = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if greedy:
        chosen[greedy] = work[greedy].argmax(dim=-1)
    sub = [rows[i] for i in rand]
    chosen[rand] = _draw(_filter(work[rand], sub), sub)
    return chosen


def _plain_greedy(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult | None:
    """Every row greedy on the raw logits with no top logprobs (the common batch): one native pass per row
    gives the argmax and its logprob together; None where that kernel does not apply."""
    if any(r.params.temperature != 0.0 or r.params.logprobs is not None or _changes_logits(r) for r in rows):
        return None
    out = cpu_sampling.greedy(logits, [r.chosen_logprob for r in rows])
    if out is None:
        return None
    token_ids, picked = out
    return SampleResult(token_ids=token_ids, logprobs=picked, top_logprobs=[None] * len(rows))


def logprob_entries(log_probs: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[dict[int, Logprob]]:
    """Per row of ``log_probs`` [N, vocab]: the chosen token's Logprob (its rank among all tokens) and the
    row's top ``ks[row]`` tokens, in rank order."""
    sel = chosen.unsqueeze(1)
    chosen_lp = log_probs.gather(1, sel)
    ranks = ((log_probs > chosen_lp).sum(dim=-1) + 1).tolist()
    top_vals, top_ids = (t.tolist() for t in log_probs.topk(max(max(ks, default=0), 1), dim=-1))
    out = []
    for j, (tid, lp) in enumerate(zip(chosen.tolist(), chosen_lp.squeeze(1).tolist(), strict=True)):
        entry = {tid: Logprob(lp, ranks[j])}
        for r in range(ks[j]):
            if top_ids[j][r] not in entry:
                entry[top_ids[j][r]] = Logprob(top_vals[j][r], r + 1)
        out.append(entry)
    return out


def sample(logits: torch.Tensor, rows: list[SamplingRow], mask: TokenBitmask | None = None) -> SampleResult:
    """logits: [N, vocab] on any device (computed in float32); rows: one per logits row; ``mask``: the
    grammar masks of the rows that have one."""
    logits = logits.float()
    if mask is not None and not mask.rows:
        mask = None
    fast = _plain_greedy(logits, rows) if mask is None else None
    if fast is not None:
        return fast
    chosen = _choose(logits, rows, mask)
    token_ids = chosen.tolist()

    picked: list[float | None] = [None] * len(rows)
    tops: list[dict[int, Logprob] | None] = [None] * len(rows)
    full = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    only_chosen = [i for i, r in enumerate(rows) if r.chosen_logprob and r.params.logprobs is None]
    if only_chosen:
        idx = torch.tensor(only_chosen, device=logits.device)
        sub = logits.index_select(0, idx)
        vals = sub.gather(1, chosen.index_select(0, idx).unsqueeze(1)).squeeze(1) - sub.logsumexp(dim=-1)
        for i, v in zip(only_chosen, vals.tolist(), strict=True):
            picked[i] = v
    if full:
        idx = torch.tensor(full, device=logits.device)
        raw = logits.index_select(0, idx).log_softmax(dim=-1)
        entries = logprob_entries(raw, chosen.index_select(0, idx), [rows[i].params.logprobs for i in full])
        for i, entry in zip(full, entries, strict=True):
            picked[i] = entry[token_ids[i]].logprob
            tops[i] = entry
    return SampleResult(token_ids=token_ids, logprobs=picked, top_logprobs=tops)
