"""The LoRA product on a fused linear of the model, for a batch that mixes adapters and the base model.

Each fused linear (qkv, o, gate_up, down) holds, per slot, the stacked A of its slices [in, slices x R] and
each slice's B [R, out_slice] (R = --max-lora-rank; a smaller adapter is zero-padded, an untargeted slice is
zero). The model runner orders a step's sequences by slot, base model last, so every adapter's tokens are one
contiguous segment from row 0 on: the shrink h = x @ A[slot] and the expand y[:, slice] += h[:, slice] @
B[slot] run per segment, on the GPU as the Triton kernels of `pagoda.kernels.lora`, on the CPU as one call of
the C kernel (kernels/cpu/lora.c) per fused linear for every segment and slice, each adapter's weights read
once per tile of its rows. Where the C kernels are not loaded, a loop of torch products per segment (one
product per slice: a dozen small products per adapter and layer, whose call overhead is what the C kernel
saves).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from pagoda.kernels.cpu.loader import library


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
        # what the C kernel takes: B's addresses and the slices' columns (fixed: slots are written in place)
        self._b_ptrs = np.asarray([b.data_ptr() for b in self.b], dtype=np.int64)
        self._offsets = np.asarray([s.offset for s in slices], dtype=np.int64)
        self._sizes = np.asarray([s.size for s in slices], dtype=np.int64)

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
        if x.is_cuda:
            self._apply_triton(x, y, batch)
        elif not self._apply_native(x, y, batch):
            self._apply_loop(x, y, batch)

    def _apply_triton(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        from pagoda.kernels.lora import lora_expand, lora_shrink

        seg = (batch.seg_starts, batch.seg_lens, batch.seg_slots, batch.max_seg_len)
        h = lora_shrink(x, self.a, *seg)
        for i, s in enumerate(self.slices):
            lora_expand(h, self.b[i], y[:, s.offset : s.offset + s.size], *seg, h_offset=i * self.max_rank)

    def _apply_native(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> bool:
        """The C kernel; False (nothing done) where it does not apply."""
        lib = library()
        if (
            lib is None
            or x.dtype not in (torch.float32, torch.bfloat16)
            or y.dtype != x.dtype
            or self.a.dtype != x.dtype
            or x.stride(1) != 1
            or y.stride(1) != 1
        ):
            return False
        fn = lib.pagoda_lora_bf16 if x.dtype == torch.bfloat16 else lib.pagoda_lora_f32
        fn(
            x.data_ptr(),
            x.stride(0),
            y.data_ptr(),
            y.stride(0),
            self.a.data_ptr(),
            self.in_features,
            self.a.shape[2],
            self._b_ptrs.ctypes.data,
            self._offsets.ctypes.data,
            self._sizes.ctypes.data,
            len(self.slices),
            self.max_rank,
            batch.seg_starts.data_ptr(),
            batch.seg_lens.data_ptr(),
            batch.seg_slots.data_ptr(),
            batch.seg_starts.numel(),
            torch.get_num_threads(),
        )
        return True

    def _apply_loop(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        r = self.max_rank
        for start, n, slot in batch.segments:
            rows = slice(start, start + n)
            h = x[rows] @ self.a[slot]
            for i, s in enumerate(self.slices):
                y[rows, s.offset : s.offset + s.size] += h[:, i * r : (i + 1) * r] @ self.b[i][slot]
