"""Verification: which proposed tokens to keep, given the target model's logits at every proposed position.

Greedy rows keep the longest prefix of the proposal that equals the target's argmax, then the target's own
token: the same tokens as one-at-a-time greedy decoding. Sampled rows use rejection sampling against a
draft that is a point mass (n-gram and greedy draft models propose one token, with probability 1): token d
at a position is kept with probability p(d) under the target's (filtered) distribution p; at the first
rejection the token is drawn from the residual (p - onehot(d))+, normalised, which is p without d. Every
emitted token then has exactly the target's distribution (Leviathan et al. 2023, Chen et al. 2023).
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


def accept_sampled(probs: torch.Tensor, draft: list[int], generator: torch.Generator | None) -> list[int]:
    """``probs``: [len(draft) + 1, vocab] target probabilities (after temperature, top-k/p, min-p), on the
    host. Returns the emitted tokens, distributed as sampling one token at a time from the target would."""
    probs = probs.double()
    out = []
    for i, tok in enumerate(draft):
        u = torch.rand((), dtype=torch.float64, generator=generator)
        if float(u) < float(probs[i, tok]):
            out.append(tok)
            continue
        residual = probs[i].clone()
        residual[tok] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # p was a point mass on tok: u < 1 always accepts it, but stay safe on rounding
            out.append(tok)
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)))
    return out
