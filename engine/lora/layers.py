"""The LoRA product on a fused linear of the model, for a batch that mixes adapters and the base model.

Each fused linear (qkv, o, gate_up, down) holds, per slot, the stacked A of its slices [in, slices x R] and
each slice's B [R, out_slice] (R = --max-lora-rank; a smaller adapter is zero-padded, an untargeted slice is
zero). The model runner orders a step's sequences by slot, base model last, so every adapter's tokens are one
contiguous segment from row 0 on: the shrink h = x @ A[slot] and the expand y[:, slice] += h[:, slice] @
B[slot] run per segment, on the GPU as the Triton kernels of `pagoda.kernels.lora`, on the CPU as grouped
matrix products over the slots (`torch._grouped_mm`: one call per product for every adapter of the step,
each reading its weights once; a loop of products where torch lacks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Slice:
    """One PEFT module inside a fused linear: its output columns."""

    module: str
    offset: int
    size: int


@dataclass
class LoRABatch:
    """Where a step's adapter tokens are: rows [0, num_tokens) of the batch, slot by slot."""

    num_tokens: int
    offsets: torch.Tensor  # [slots] int32, cumulative token count through each slot (grouped products)
    seg_starts: torch.Tensor  # [G] int32 on the device, the non-empty segments (kernels)
    seg_lens: torch.Tensor
    seg_slots: torch.Tensor
    max_seg_len: int
    segments: list[tuple[int, int, int]]  # (start, length, slot), for the loop fallback

    @classmethod
    def from_rows(cls, row_slots: np.ndarray, num_slots: int, device: torch.device) -> LoRABatch | None:
        """``row_slots`` [T]: each row's slot, -1 for the base model, grouped by slot in ascending order with
        the base model's rows last (the runner's order). None when no row uses an adapter."""
        used = row_slots[row_slots >= 0]
        if used.size == 0:
            return None
        if np.any(np.diff(used) < 0) or np.any(row_slots[used.size :] >= 0):
            raise ValueError("rows must be grouped by slot, ascending, with the base model's rows last")
        counts = np.bincount(used, minlength=num_slots)[:num_slots]
        ends = np.cumsum(counts)
        nonempty = np.flatnonzero(counts)
        starts = (ends - counts)[nonempty]
        lens = counts[nonempty]
        segments = list(zip(starts.tolist(), lens.tolist(), nonempty.tolist(), strict=True))

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a.astype(np.int32)).to(device)

        return cls(
            num_tokens=int(used.size),
            offsets=torch.from_numpy(ends.astype(np.int32)),
            seg_starts=dev(starts),
            seg_lens=dev(lens),
            seg_slots=dev(nonempty),
            max_seg_len=int(lens.max()),
            segments=segments,
        )


class LoRAContext:
    """The step's batch, shared by every LoRA linear of the model (set by the runner around a forward)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


def _grouped_mm_available() -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x, w = torch.ones(2, 16), torch.ones(2, 16, 16)
        out = torch._grouped_mm(x, w, offs=torch.tensor([1, 2], dtype=torch.int32))
        return bool(torch.equal(out, torch.full((2, 16), 16.0)))
    except (RuntimeError, NotImplementedError):
        return False


_GROUPED_MM: bool | None = None


def grouped_mm_available() -> bool:
    global _GROUPED_MM
    if _GROUPED_MM is None:
        _GROUPED_MM = _grouped_mm_available()
    return _GROUPED_MM


class LoRALinear:
    """The LoRA weights of one fused linear across all slots, and their product for a step's batch."""

    def __init__(
        self,
        in_features: int,
        slices: list[Slice],
        num_slots: int,
        max_rank: int,
        context: LoRAContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.in_features = in_features
        self.slices = slices
        self.max_rank = max_rank
        self.context = context
        width = len(slices) * max_rank
        self.a = torch.zeros((num_slots, in_features, width), dtype=dtype, device=device)
        self.b = [torch.zeros((num_slots, max_rank, s.size), dtype=dtype, device=device) for s in slices]

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter's matrices (module -> A [r, in], B [out, r] scaled) into ``slot``; modules it
        does not target, and ranks beyond its own, become zero."""
        self.a[slot].zero_()
        r_max = self.max_rank
        for i, s in enumerate(self.slices):
            self.b[i][slot].zero_()
            pair = weights.get(s.module)
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            self.a[slot, :, i * r_max : i * r_max + r].copy_(a.t(), non_blocking=True)
            self.b[i][slot, :r].copy_(b.t(), non_blocking=True)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the LoRA product of every row of x that belongs to an adapter (in place)."""
        batch = self.context.batch
        if batch is None:
            return
        n = batch.num_tokens
        if x.is_cuda:
            self._apply_triton(x, y, batch)
        elif grouped_mm_available() and x.dtype in (torch.float32, torch.bfloat16):
            self._apply_grouped(x[:n], y[:n], batch)
        else:
            self._apply_loop(x, y, batch)

    def _apply_triton(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        from pagoda.kernels.lora import lora_expand, lora_shrink

        seg = (batch.seg_starts, batch.seg_lens, batch.seg_slots, batch.max_seg_len)
        h = lora_shrink(x, self.a, *seg)
        for i, s in enumerate(self.slices):
            lora_expand(h, self.b[i], y[:, s.offset : s.offset + s.size], *seg, h_offset=i * self.max_rank)

    def _apply_grouped(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        # in the model's dtype, as PEFT computes it
        h = torch._grouped_mm(x, self.a, offs=batch.offsets)
        r = self.max_rank
        for i, s in enumerate(self.slices):
            delta = torch._grouped_mm(h[:, i * r : (i + 1) * r], self.b[i], offs=batch.offsets)
            y[:, s.offset : s.offset + s.size] += delta

    def _apply_loop(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        r = self.max_rank
        for start, n, slot in batch.segments:
            rows = slice(start, start + n)
            h = x[rows] @ self.a[slot]
            for i, s in enumerate(self.slices):
                y[rows, s.offset : s.offset + s.size] += h[:, i * r : (i + 1) * r] @ self.b[i][slot]
