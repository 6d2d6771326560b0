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

On a GPU the host waits for the device once per step: the small per-row tensors the sampler needs (penalty
ids, temperatures, row indices) go up through pinned memory with asynchronous copies (a copy from pageable
memory waits for the work queued before it), and everything the host reads back (ids, chosen logprobs,
top-logprob entries) is packed on the device into one tensor and copied down once.
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


def _upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device``, without waiting for the device's queued work on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


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
            seen = [t for t in sorted(set(row.prompt_token_ids) | set(row.output_token_ids)) if t < vocab]
            seen = _upload(seen, torch.long, device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            out = _upload([t for t in row.output_token_ids if t < vocab], torch.long, device)
            # (an index_add, not bincount: on CUDA bincount reads its input's max back to the host)
            counts = torch.zeros(vocab, dtype=logits.dtype, device=device)
            counts.index_add_(0, out, torch.ones(out.shape, dtype=logits.dtype, device=device))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.logit_bias:
            ids = _upload(list(p.logit_bias), torch.long, device)
            bias = _upload(list(p.logit_bias.values()), logits.dtype, device)
            logits[i].index_add_(0, ids, bias)


def _mask_stops(logits: torch.Tensor, rows: list[SamplingRow], grammar_rows: set[int]) -> None:
    for i, row in enumerate(rows):
        if i in grammar_rows:
            continue
        if len(row.output_token_ids) < row.params.min_tokens and row.stop_ids:
            # index_fill_, not indexed assignment: on CUDA the latter waits for the device (index_put_)
            logits[i].index_fill_(0, _upload(row.stop_ids, torch.long, logits.device), float("-inf"))


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on the random rows; returns probabilities."""
    device = logits.device
    temps = _upload([r.params.temperature for r in rows], logits.dtype, device).unsqueeze(1)
    logits = logits / temps
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        k = _upload([k if k > 0 else vocab for k in top_k], torch.long, device).unsqueeze(1)
        drop = ranks >= k
        probs_sorted = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        before = probs_sorted.cumsum(dim=-1) - probs_sorted
        drop |= before >= _upload(top_p, logits.dtype, device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(m > 0 for m in min_p):
        mins = _upload(min_p, probs.dtype, device).unsqueeze(1)
        threshold = probs.max(dim=-1, keepdim=True).values * mins
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def filtered_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution a random row samples from (temperature, top-k, top-p, min-p), one row each:
    what speculative decoding's rejection sampling must keep."""
    return _filter(logits, rows)


def _draw(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i.

    Seeded rows draw their noise on the host from their own generator (the same numbers on every device)."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        draws = torch.empty(
            len(unseeded), probs.shape[1], dtype=probs.dtype, device=probs.device
        ).exponential_()
        noise.index_copy_(0, _upload(unseeded, torch.long, probs.device), draws)
    cuda = probs.device.type == "cuda"
    for i, r in enumerate(rows):
        if r.generator is not None:
            draw = torch.empty(probs.shape[1], dtype=probs.dtype, pin_memory=cuda)
            noise[i].copy_(draw.exponential_(generator=r.generator), non_blocking=cuda)
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
        idx = _upload(greedy, torch.long, logits.device)
        chosen.index_copy_(0, idx, work.index_select(0, idx).argmax(dim=-1))
    sub = [rows[i] for i in rand]
    idx = _upload(rand, torch.long, logits.device)
    chosen.index_copy_(0, idx, _draw(_filter(work.index_select(0, idx), sub), sub))
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


def _entry_tensors(log_probs: torch.Tensor, chosen: torch.Tensor, k: int) -> list[torch.Tensor]:
    """On the device: each row's chosen logprob, the chosen token's rank among all tokens, and the row's
    top ``k`` (at least 1) logprobs and token ids (as float64 rows, to travel in one tensor)."""
    chosen_lp = log_probs.gather(1, chosen.unsqueeze(1))
    ranks = (log_probs > chosen_lp).sum(dim=-1) + 1
    top_vals, top_ids = log_probs.topk(max(k, 1), dim=-1)
    return [
        chosen_lp.squeeze(1).double(),
        ranks.double(),
        top_vals.double().flatten(),
        top_ids.double().flatten(),
    ]


def _entries(host: list[float], chosen: list[int], ks: list[int]) -> list[dict[int, Logprob]]:
    """The Logprob entries of `_entry_tensors`' values, read back to the host (in that order, flattened)."""
    n, k = len(chosen), max(max(ks, default=0), 1)
    chosen_lp, ranks, top_vals, top_ids = (
        host[:n],
        host[n : 2 * n],
        host[2 * n : 2 * n + n * k],
        host[2 * n + n * k :],
    )
    out = []
    for j, tid in enumerate(chosen):
        entry = {tid: Logprob(chosen_lp[j], int(ranks[j]))}
        for r in range(ks[j]):
            top_id = int(top_ids[j * k + r])
            if top_id not in entry:
                entry[top_id] = Logprob(top_vals[j * k + r], r + 1)
        out.append(entry)
    return out


def logprob_entries(log_probs: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[dict[int, Logprob]]:
    """Per row of ``log_probs`` [N, vocab]: the chosen token's Logprob (its rank among all tokens) and the
    row's top ``ks[row]`` tokens, in rank order."""
    packed = torch.cat(_entry_tensors(log_probs, chosen, max(ks, default=0)))
    return _entries(packed.tolist(), chosen.tolist(), ks)


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

    # Everything the host reads, packed on the device as float64 (token ids are exact below 2**53, float32
    # logprobs exactly) and read back in one copy: the chosen ids, the chosen logprobs of the rows that
    # want only those, the entries of the rows that want top logprobs.
    n = len(rows)
    full = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    only_chosen = [i for i, r in enumerate(rows) if r.chosen_logprob and r.params.logprobs is None]
    parts = [chosen.double()]
    if only_chosen:  # for every row (one pass, no row selection to upload); the others are dropped
        parts.append((logits.gather(1, chosen.unsqueeze(1)).squeeze(1) - logits.logsumexp(dim=-1)).double())
    ks = [rows[i].params.logprobs for i in full]
    if full:
        idx = _upload(full, torch.long, logits.device)
        raw = logits.index_select(0, idx).log_softmax(dim=-1)
        parts += _entry_tensors(raw, chosen.index_select(0, idx), max(ks))
    host = torch.cat(parts).tolist()
    token_ids = [int(t) for t in host[:n]]

    picked: list[float | None] = [None] * n
    tops: list[dict[int, Logprob] | None] = [None] * n
    if only_chosen:
        for i in only_chosen:
            picked[i] = host[n + i]
    if full:
        start = 2 * n if only_chosen else n
        entries = _entries(host[start:], [token_ids[i] for i in full], ks)
        for i, entry in zip(full, entries, strict=True):
            picked[i] = entry[token_ids[i]].logprob
            tops[i] = entry
    return SampleResult(token_ids=token_ids, logprobs=picked, top_logprobs=tops)
