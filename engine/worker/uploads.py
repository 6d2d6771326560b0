"""A step's host arrays on the device: on CUDA in one asynchronous copy from pinned memory.

`torch.from_numpy(a).to("cuda")` copies from pageable memory, which makes the host wait for every kernel
queued before it, once per array (an eager step has seven). `upload` writes the arrays into one pinned
staging buffer (torch's caching host allocator: a block is handed out again only once the copies that
read it have finished, so nothing here waits) and copies it to one device buffer with `non_blocking`;
the device tensors are views of that buffer, each starting 256 bytes apart (as the CUDA allocator places
tensors of their own, so kernels see the same pointer alignment). On the CPU the arrays stay where they
are (`torch.from_numpy`, no copy), exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ALIGN = 256


def upload(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays as tensors on ``device``, same dtypes and shapes, in order."""
    if device.type != "cuda":
        return [torch.from_numpy(a).to(device) for a in arrays]
    arrays = [np.ascontiguousarray(a) for a in arrays]
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end += -(-a.nbytes // ALIGN) * ALIGN
    host = torch.empty(max(end, ALIGN), dtype=torch.uint8, pin_memory=True)
    staging = host.numpy()
    for a, offset in zip(arrays, offsets, strict=True):
        staging[offset : offset + a.nbytes] = a.reshape(-1).view(np.uint8)
    on_device = torch.empty(host.shape, dtype=torch.uint8, device=device)
    on_device.copy_(host, non_blocking=True)
    out = []
    for a, offset in zip(arrays, offsets, strict=True):
        dtype = torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype
        out.append(on_device[offset : offset + a.nbytes].view(dtype).view(a.shape))
    return out
