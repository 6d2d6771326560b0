"""Pearson's chi-square goodness-of-fit p-value without scipy (the regularised upper incomplete gamma
function is in torch), for tests that check a sampler's distribution."""

from __future__ import annotations

import torch


def chi_square_p(observed: list[int], expected: list[float]) -> float:
    """P-value of observed counts against expected ones (cells expecting fewer than 5 pooled into one)."""
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for o, e in zip(observed, expected, strict=True):
        if e >= 5:
            obs.append(o)
            exp.append(e)
        else:
            rest_o, rest_e = rest_o + o, rest_e + e
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    dof = max(len(obs) - 1, 1)
    half = torch.tensor(dof / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(half, torch.tensor(stat / 2, dtype=torch.float64)))
