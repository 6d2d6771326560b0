"""The runner's side of speculative decoding: each drafted row's logits (one per scored position) in,
the tokens it emits and their logprobs out (engine/spec_decode/acceptance.py decides which)."""

from __future__ import annotations

import torch
from pagoda.engine.spec_decode.acceptance import accept_greedy, accept_sampled
from pagoda.engine.step import RunnerOutput
from pagoda.engine.worker.sampler import SamplingRow, filtered_probs


def verify(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    row_index: list[int],
    spec: list[tuple],
    result: RunnerOutput,
) -> None:
    """For each (sampling row, draft[, q]) of ``spec``: the row's logits are ``logits[row_index[row]:]
    [:len(draft) + 1]``; q, the draft's distributions at each proposal ([len(draft), vocab], host), is None
    or left out for a point-mass proposal. Fills ``result.spec_token_ids`` / ``spec_logprobs`` and sets the row's ``token_ids`` entry to
    its first emitted token."""
    greedy = any(rows[entry[0]].params.temperature == 0.0 for entry in spec)
    argmax = logits.argmax(dim=-1).tolist() if greedy else []  # one read-back for every greedy row
    emitted: list[list[int]] = []
    for row, draft, *q in spec:
        start = row_index[row]
        sampling = rows[row]
        if sampling.params.temperature == 0.0:
            tokens = accept_greedy(argmax[start : start + len(draft) + 1], draft)
        else:
            block = logits[start : start + len(draft) + 1].float()
            probs = filtered_probs(block, [sampling] * block.shape[0]).cpu()
            tokens = accept_sampled(probs, draft, sampling.generator, q[0] if q else None)
        emitted.append(tokens)
    # the emitted tokens' logprobs, in one pass: token j of a row comes from its logits row start + j
    flat_rows = [
        row_index[entry[0]] + j for entry, toks in zip(spec, emitted, strict=True) for j in range(len(toks))
    ]
    flat_toks = [t for toks in emitted for t in toks]
    picked = torch.tensor(flat_toks, device=logits.device).unsqueeze(1)
    selected = logits[torch.tensor(flat_rows, device=logits.device)].float().log_softmax(dim=-1)
    lps = selected.gather(1, picked).squeeze(1).tolist()
    at = 0
    for (row, *_), tokens in zip(spec, emitted, strict=True):
        result.spec_token_ids[row] = tokens
        result.spec_logprobs[row] = lps[at : at + len(tokens)]
        result.token_ids[row] = tokens[0]
        if result.logprobs:
            result.logprobs[row] = lps[at]
        at += len(tokens)
