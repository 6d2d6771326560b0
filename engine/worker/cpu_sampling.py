"""Greedy sampling on the CPU in one pass over each row of logits: the argmax and, when wanted, its logprob.

torch needs an argmax (not vectorised: docs/benchmarks.md) plus a logsumexp (four passes) for
the same answer; this kernel reads each row once, keeping a running maximum (first index on ties, as
torch.argmax) and the sum of exponentials rescaled to it, so logprob(argmax) = -log(sum). Float32 CPU logits
with contiguous rows only; `greedy` returns None otherwise and the sampler uses torch. C source:
kernels/cpu/greedy.c.
"""

from __future__ import annotations

import torch
from pagoda.kernels.cpu.loader import library


def greedy(logits: torch.Tensor, want_logprob: list[bool]) -> tuple[list[int], list[float | None]] | None:
    """(argmax of each row, its logprob where ``want_logprob``), or None where the kernel does not apply."""
    lib = library()
    if (
        lib is None
        or logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.stride(1) != 1
        or logits.shape[0] == 0
    ):
        return None
    n, vocab = logits.shape
    want = torch.tensor(want_logprob, dtype=torch.uint8)
    ids = torch.empty(n, dtype=torch.int64)
    lp = torch.empty(n, dtype=torch.float32)
    lib.pagoda_greedy(
        logits.data_ptr(),
        n,
        vocab,
        logits.stride(0),
        want.data_ptr(),
        ids.data_ptr(),
        lp.data_ptr(),
        torch.get_num_threads(),
    )
    return ids.tolist(), [v if w else None for v, w in zip(lp.tolist(), want_logprob, strict=True)]
