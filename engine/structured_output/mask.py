"""Applying a token bitmask to logits rows, in torch (any device: the CPU and the GPU sampler share it).

Row r of a bitmask is ceil(vocab / 32) int32 words; bit j of word w allows token 32 * w + j. Disallowed
tokens get -inf. xgrammar fills the rows; this is its twin of `xgrammar.apply_token_bitmask_inplace` for
a subset of rows, written with plain tensor ops so it runs wherever the logits are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BITS: dict[torch.device, torch.Tensor] = {}


@dataclass
class TokenBitmask:
    """The grammar masks of one step: ``rows`` (indices into the step's sampling rows) and their bits."""

    rows: list[int]
    bits: torch.Tensor  # [len(rows), words] int32, on the host


def _bit_values(device: torch.device) -> torch.Tensor:
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = torch.bitwise_left_shift(
            torch.ones(32, dtype=torch.int32), torch.arange(32, dtype=torch.int32)
        ).to(device)
    return bits


def allowed_tokens(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] bool: which tokens each row allows."""
    flags = torch.bitwise_and(bits.unsqueeze(-1), _bit_values(bits.device)) != 0
    return flags.view(bits.shape[0], -1)[:, :vocab]


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """Set the disallowed tokens of the masked rows of ``logits`` [N, vocab] to -inf, in place."""
    if not mask.rows:
        return
    device = logits.device
    bits = mask.bits.to(device, non_blocking=True)
    allowed = allowed_tokens(bits, logits.shape[-1])
    if len(mask.rows) == logits.shape[0] and mask.rows == list(range(logits.shape[0])):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    idx = torch.tensor(mask.rows, device=device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
