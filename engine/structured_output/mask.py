"""Applying the grammar masks of a step to its logits rows, on the logits' device.

Row r of a bitmask is ceil(vocab / 32) int32 words; bit j of word w allows token 32 * w + j; disallowed
tokens get -inf. xgrammar applies it with the kernel of the logits' device (C++ on the CPU, CUDA or Triton
on a GPU; far faster than torch ops on the CPU, docs/api.md), so the CPU and the GPU sampler run this same
call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenBitmask:
    """The grammar masks of one step: ``rows`` (indices into the step's sampling rows) and their bits."""

    rows: list[int]
    bits: torch.Tensor  # [len(rows), words] int32, on the host


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask, backend: str = "auto") -> None:
    """Set the disallowed tokens of the masked rows of ``logits`` [N, vocab] to -inf, in place."""
    import xgrammar as xgr

    if not mask.rows:
        return
    full = torch.full((logits.shape[0], mask.bits.shape[1]), -1, dtype=torch.int32)
    full[mask.rows] = mask.bits
    full = full.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(
        logits, full, vocab_size=logits.shape[-1], indices=list(mask.rows), backend=backend
    )
