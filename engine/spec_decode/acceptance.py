"""Verification: which proposed tokens to keep, given the target model's logits at every proposed position.

Greedy rows keep the longest prefix of the proposal that equals the target's argmax, then the target's own
token: the same tokens as one-at-a-time greedy decoding. Sampled rows use rejection sampling: token d at a
position, drawn by the proposer from its distribution q, is kept with probability min(1, p(d) / q(d)) under
the target's (filtered) distribution p; at the first rejection the token is drawn from the residual
(p - q)+, normalised. Every emitted token then has exactly the target's distribution (Leviathan et al.
2023, Chen et al. 2023). n-gram and greedy draft proposals are point masses (q = onehot(d)): d is kept with
probability p(d) and the residual is p without d.
"""

from __future__ import annotations

import torch


def accept_greedy(target: list[int], draft: list[int]) -> list[int]:
    """``target``: the target model's argmax at each of len(draft) + 1 positions (position i predicting the
    token after draft[:i]). Returns the tokens emitted: the accepted prefix of ``draft`` and one token of
    the target's own (1 to len(draft) + 1)."""
    out = []
    for i, tok in enumerate(draft):
        if target[i] != tok:
            break
        out.append(tok)
    out.append(target[len(out)])
    return out


def accept_sampled(
    probs: torch.Tensor,
    draft: list[int],
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """``probs``: [len(draft) + 1, vocab] target probabilities (after temperature, top-k/p, min-p), on the
    host; ``draft_probs``: [len(draft), vocab] the distributions q the proposals were drawn from (None: each
    proposal is a point mass). Returns the emitted tokens, distributed as sampling one token at a time from
    the target would."""
    probs = probs.double()
    q_all = None if draft_probs is None else draft_probs.double()
    out = []
    for i, tok in enumerate(draft):
        q_tok = 1.0 if q_all is None else float(q_all[i, tok])
        u = torch.rand((), dtype=torch.float64, generator=generator)
        if float(u) * q_tok < float(probs[i, tok]):  # u < p / q without dividing by a q of 0
            out.append(tok)
            continue
        if q_all is None:
            residual = probs[i].clone()
            residual[tok] = 0.0
        else:
            residual = (probs[i] - q_all[i]).clamp_(min=0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p <= q nowhere above: p == q, and u < 1 always accepts; stay safe on rounding
            out.append(tok)
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)))
    return out
