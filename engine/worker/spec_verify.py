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
    spec: list[tuple[int, list[int]]],
    result: RunnerOutput,
) -> None:
    """For each (sampling row, draft) of ``spec``: the row's logits are ``logits[row_index[row]:][:len(draft)
    + 1]``. Fills ``result.spec_token_ids`` / ``spec_logprobs`` and sets the row's ``token_ids`` entry to
    its first emitted token."""
    for row, draft in spec:
        start = row_index[row]
        block = logits[start : start + len(draft) + 1].float()
        sampling = rows[row]
        if sampling.params.temperature == 0.0:
            tokens = accept_greedy(block, draft)
        else:
            probs = filtered_probs(block, [sampling] * block.shape[0]).cpu()
            tokens = accept_sampled(probs, draft, sampling.generator)
        picked = torch.tensor(tokens, device=block.device)
        rows_lp = block[: len(tokens)].log_softmax(dim=-1)
        lps = rows_lp.gather(1, picked.unsqueeze(1)).squeeze(1).tolist()
        result.spec_token_ids[row] = tokens
        result.spec_logprobs[row] = lps
        result.token_ids[row] = tokens[0]
        if result.logprobs:
            result.logprobs[row] = lps[0]
