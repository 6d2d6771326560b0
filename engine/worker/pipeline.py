"""The pipeline-parallel forward of one step: every rank runs its stage's layers over the step's
micro-batches, handing activations on to the next stage as each micro-batch finishes.

A step's batch (the scheduler's, unchanged) is split into up to ``micro_batches`` contiguous micro-batches
of equal tokens (`split_step`). Stage 0 embeds micro-batch 0, runs its layers and sends the hidden state
and the residual stream to stage 1 without waiting for it, then goes on to micro-batch 1 while stage 1
works on micro-batch 0, and so on: with M micro-batches over N stages the stages overlap,
and each idles for about (N - 1) / (M + N - 1) of the step (the bubble). The last stage runs the final norm
and the LM head over the sampling rows and sends their logits back to rank 0, which samples.

Each stage is a tensor-parallel group: its TP rank t sends to TP rank t of the next stage (after the
stage's all-reduce every TP rank holds the same activations); only the last stage's TP rank 0 sends
logits. Point-to-point messages go over the world group (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from pagoda.engine.distributed.parallel_state import PPState
from pagoda.engine.worker.step_input import StepInput

if TYPE_CHECKING:
    from pagoda.engine.worker.model_runner import ModelRunner


def split_step(step: StepInput, parts: int) -> list[StepInput]:
    """The step's tokens in at most ``parts`` contiguous micro-batches of equal tokens (within one). In a
    decode step every cut falls between sequences; a cut inside a prompt's chunk makes it two pieces, the second with the first as context, which is sound because every
    stage runs its micro-batches in order (the first piece's KV is written before the second reads it). A
    step with prompt-logprob rows or LoRA rows stays one micro-batch (their rows are not split yet)."""
    total = len(step.input_ids)
    parts = min(parts, total)
    if parts <= 1 or len(step.logprob_idx) or step.lora_rows is not None:
        return [step]
    qsl = np.zeros(len(step.query_lens) + 1, dtype=np.int64)
    np.cumsum(step.query_lens, out=qsl[1:])
    cuts = [0, *(round(total * k / parts) for k in range(1, parts)), total]
    out = []
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        if hi <= lo:
            continue
        # the sequences with tokens in [lo, hi), and where each one's share starts and ends
        a = int(np.searchsorted(qsl, lo, side="right")) - 1
        b = int(np.searchsorted(qsl, hi, side="left"))
        starts = np.maximum(qsl[a:b], lo)
        ends = np.minimum(qsl[a + 1 : b + 1], hi)
        keep = (step.sample_idx >= lo) & (step.sample_idx < hi)
        out.append(
            StepInput(
                input_ids=step.input_ids[lo:hi],
                positions=step.positions[lo:hi],
                query_lens=ends - starts,
                context_lens=step.context_lens[a:b] + (starts - qsl[a:b]),
                block_tables=step.block_tables[a:b],
                sample_idx=step.sample_idx[keep] - lo,
                window_block_tables=(
                    None if step.window_block_tables is None else step.window_block_tables[a:b]
                ),
            )
        )
    return out


@dataclass
class StageTimes:
    """Where this rank's step time went: computing its layers, or waiting (for the previous stage's
    activations, for rank 0's logits), summed over the steps since the last reset."""

    busy_s: float = 0.0
    wall_s: float = 0.0
    steps: int = 0
    micro_batches: int = 0

    @property
    def idle_fraction(self) -> float:
        return 0.0 if self.wall_s <= 0 else max(0.0, 1.0 - self.busy_s / self.wall_s)


class Pipeline:
    """One rank's part of the pipeline forward (`run`), for its runner's model and KV caches."""

    def __init__(self, runner: ModelRunner, state: PPState, micro_batches: int | None = None) -> None:
        self.runner = runner
        self.state = state
        self.model = runner.model
        config = self.model.config
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.micro_batches = micro_batches or state.stages
        self.lo, self.hi = state.layers
        self.prev_rank = state.rank - state.tp if not state.first else None
        self.next_rank = state.rank + state.tp if not state.last else None
        # the rank that sends logits back to rank 0: TP rank 0 of the last stage
        self.logits_rank = (state.stages - 1) * state.tp
        self.times = StageTimes()

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        multiplier = self.model.config.embedding_multiplier
        return x * multiplier if multiplier != 1.0 else x

    @torch.inference_mode()
    def run(self, step: StepInput) -> torch.Tensor:
        """This stage's share of the step; on rank 0 the logits of the sampling rows (then of the
        prompt-logprob rows), in the step's order; elsewhere an empty tensor."""
        st, runner, model = self.state, self.runner, self.model
        start = time.perf_counter()
        busy = 0.0
        parts = split_step(step, self.micro_batches)
        sends: list = []
        logits_out: list[torch.Tensor] = []
        expect: list[int] = []  # rank 0: logits rows of each micro-batch, in order
        for mb in parts:
            input_ids, positions, meta = runner._metadata(mb)
            tokens = len(mb.input_ids)
            if st.first:
                t0 = time.perf_counter()
                x, residual = self._embed(input_ids), None
            else:
                buf = torch.empty((2, tokens, self.hidden_size), dtype=model.dtype, device=runner.device)
                dist.recv(buf, src=self.prev_rank)
                t0 = time.perf_counter()
                x, residual = buf[0], buf[1]
            top = meta.max_seq_len if meta.max_position is None else meta.max_position
            cos, sin = model.rotary.cos_sin(positions, top, x.dtype)
            for layer, cache in zip(model.layers[self.lo : self.hi], runner.kv_caches, strict=True):
                x, residual = layer(x, residual, cos, sin, cache, meta)
            rows = np.concatenate([mb.sample_idx, mb.logprob_idx]) if len(mb.logprob_idx) else mb.sample_idx
            if not st.last:
                out = torch.stack((x, residual)).contiguous()
                sends.append((dist.isend(out, dst=self.next_rank), out))  # kept alive until sent
                busy += time.perf_counter() - t0
            else:
                logits = None
                if len(rows):
                    hidden = model.norm.add_forward(x, residual)[0]
                    hidden = hidden[torch.as_tensor(rows, device=hidden.device)]
                    logits = model.compute_logits(hidden).contiguous()
                busy += time.perf_counter() - t0
                if logits is not None:
                    if st.rank == 0:
                        logits_out.append(logits)
                    elif st.rank == self.logits_rank:
                        sends.append((dist.isend(logits, dst=0), logits))
            if st.rank == 0 and not st.last:
                expect.append(len(rows))
        for rows in expect:  # rank 0: the last stage's logits, micro-batch by micro-batch
            if rows:
                buf = torch.empty((rows, self.vocab_size), dtype=torch.float32, device=runner.device)
                dist.recv(buf, src=self.logits_rank)
                logits_out.append(buf)
        for work, _ in sends:
            work.wait()
        wall = time.perf_counter() - start
        t = self.times
        t.busy_s += busy
        t.wall_s += wall
        t.steps += 1
        t.micro_batches += len(parts)
        if st.rank != 0:
            return torch.empty((0, 0), dtype=torch.float32)
        if not logits_out:
            return torch.empty((0, 0), dtype=torch.float32, device=runner.device)
        return torch.cat(logits_out) if len(logits_out) > 1 else logits_out[0]
