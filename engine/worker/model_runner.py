"""Executes what the scheduler planned: device-cache ops, the model forward and sampling.

Owns the per-layer KV cache tensors (layout in engine/attention/base.py) and measures the memory the model
needs, so the engine can size the cache from facts. Reads the scheduler's output, writes nothing back into
request state: what it produced goes back in a RunnerOutput.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from pagoda.engine.attention.base import AttentionMetadata, LayerKVCache
from pagoda.engine.distributed.parallel_state import gather_ints, pp_state, tp_size
from pagoda.engine.kv_cache.ops import CopyBlock, KVOp, LoadBlock, RotateBlock, SaveBlock
from pagoda.engine.kv_cache.rerotate import rotate_keys_
from pagoda.engine.sizing.engine_plan import gpu_kv_budget
from pagoda.engine.sizing.host_memory import cpu_kv_cache_bytes
from pagoda.engine.sizing.kv_dtypes import kv_cache_dtype, lookup
from pagoda.engine.step import RunnerOutput, ScheduledSeq, SchedulerOutput
from pagoda.engine.worker import host_allocator
from pagoda.engine.worker.decode_graphs import Capture, DecodeGraphs, capture_sizes, cuda_capture
from pagoda.engine.worker.rank_messages import CaptureGraphs, Profile, Step
from pagoda.engine.worker.sampler import SamplingRow, logprob_entries, sample
from pagoda.engine.worker.spec_verify import verify
from pagoda.engine.worker.step_input import StepInput, prepare_step, prompt_logprob_rows
from pagoda.engine.worker.uploads import upload

SCALE_DTYPE = torch.float32  # INT8 caches: one scale per token, KV head and K|V
SCALE_BYTES = lookup("int8").scale_bytes
GRAPH_CHECK_MIN_COSINE = 0.99  # replayed vs eager logits; a stale buffer gives unrelated rows, rounding ~1.0

log = logging.getLogger("pagoda.engine")


def kv_torch_dtype(kv_cache_dtype_flag: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a `--kv-cache-dtype` cache for a model in `model_dtype` (the KV dtype table's)."""
    return getattr(
        torch, kv_cache_dtype(kv_cache_dtype_flag, str(model_dtype).removeprefix("torch.")).torch_dtype
    )


@dataclass(frozen=True)
class PreparedStep:
    """A step's host side, built from request state before the device side runs (`ModelRunner.prepare`)."""

    step: StepInput | None  # None: nothing to compute (ops only)
    prompt_rows: list[tuple[int, list[int]]]  # prompt-logprob rows (prompt_logprob_rows)
    rows: list[SamplingRow]  # one per sampling sequence, in scheduled order
    row_index: list[int]  # each sampling row's (first) row among the step's logits
    # speculative decoding: (sampling row, proposed tokens, their draft distributions or None) of each row
    # that verifies a proposal; its logits are rows row_index[row] .. row_index[row] + len(proposed tokens)
    spec: list[tuple[int, list[int], object | None]] = ()


@dataclass(frozen=True)
class KVBudget:
    """The KV bytes every rank may allocate (the least any rank measured) and this rank's measurements."""

    kv_bytes: int
    activation_bytes: int
    rank_kv_bytes: list[int]  # each rank's own budget, in rank order
    device_memory: dict  # device_total_bytes, device_free_bytes, other_bytes (CUDA), source


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        eos_token_ids: list[int] | None = None,
    ) -> None:
        self.model = model
        self.device = device
        if device.type == "cpu":
            host_allocator.keep_freed_memory()  # steps reuse freed activation pages instead of faulting new ones
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.eos_token_ids = list(eos_token_ids or [])
        self.kv_caches: list[LayerKVCache] = []
        self.block_size = 0
        self.window_layers: frozenset[int] = frozenset()  # layers whose cache is the window group's pool
        # Tensor parallelism: the other ranks (pagoda.engine.worker.tp_workers.TPWorkers), which get every
        # step's ops and batch before this rank runs them, so all meet in the same collectives.
        self.peers = None
        # Pipeline parallelism: this rank's stage forward (engine/worker/pipeline.py) and the model layer
        # its first cache belongs to (its caches cover only its stage's layers).
        self.pipeline = None
        self.first_layer = 0
        self.decode_graphs: DecodeGraphs | None = None
        self.graphs_off: str | None = None  # why start-up profiling turned the decode graphs off, if it did
        self.lora = None  # pagoda.engine.lora.model.LoRAModel when the engine serves LoRA adapters
        self.attention_backend = ""  # the backend's name (build_rank sets it: "torch" or "triton")

    # ---- memory -------------------------------------------------------------------------------------
    def weights_bytes(self) -> int:
        """The model's parameters and, with LoRA, the adapter slots."""
        lora = self.lora.device_bytes if self.lora is not None else 0
        return lora + sum(p.numel() * p.element_size() for p in self.model.parameters())

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        num_window_blocks: int = 0,
        window_layers: tuple[int, ...] = (),
    ) -> None:
        """One cache tensor per layer of ``num_blocks`` blocks; with a window group, the ``window_layers``
        (the sliding ones) get ``num_window_blocks`` instead. Zeroed: block 0 of a window pool is the null
        block out-of-window table entries read under the mask, so it must hold finite values."""
        self.block_size = block_size
        local = (w - self.first_layer for w in window_layers)  # a pipeline stage's own layers
        self.window_layers = (
            frozenset(w for w in local if 0 <= w < self.num_layers) if num_window_blocks else frozenset()
        )
        int8 = kv_dtype == torch.int8

        def layer(blocks: int) -> LayerKVCache:
            shape = (2, blocks, block_size, self.num_kv_heads, self.head_dim)
            kv = torch.zeros(shape, dtype=kv_dtype, device=self.device)
            scales = torch.zeros(shape[:4], dtype=SCALE_DTYPE, device=self.device) if int8 else None
            return LayerKVCache(kv, scales=scales)

        self.kv_caches = [
            layer(num_window_blocks if i in self.window_layers else num_blocks)
            for i in range(self.num_layers)
        ]

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the allocated cache takes, scales included (what sizing must have counted)."""
        total = 0
        for cache in self.kv_caches:
            total += cache.kv.numel() * cache.kv.element_size()
            if cache.scales is not None:
                total += cache.scales.numel() * cache.scales.element_size()
        return total

    @property
    def _int8(self) -> bool:
        return bool(self.kv_caches) and self.kv_caches[0].scales is not None

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of every layer as the offload tiers hold it: [num_layers, 2, block_size, num_kv_heads,
        head_dim] in the cache dtype; INT8 rows carry their float32 scale in 4 more int8 elements (its bytes)
        at the end of each row: [..., head_dim + 4], so a block record is self-contained."""
        row = self.head_dim + (SCALE_BYTES if self._int8 else 0)
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, row)

    def profile_activation_peak(
        self, num_tokens: int, block_size: int, kv_dtype: torch.dtype, forward_on_cpu: bool = False
    ) -> int:
        """Run one dummy forward of ``num_tokens`` tokens against a just-big-enough cache; return the peak
        memory the forward took beyond what was allocated before it (CUDA only; 0 elsewhere, where the
        forward runs only with ``forward_on_cpu``). The scratch cache is not counted: it is freed before the
        real cache takes its place (counting it reserved 2.5 GiB too much for Llama-3.1-70B at 16,384 tokens
        per step, and refused what the operator had planned). Under tensor parallelism every rank must run
        it at once: the forward meets the other ranks in its all-reduces (see measure_kv_budget)."""
        cuda = self.device.type == "cuda"
        if not cuda and not forward_on_cpu:
            return 0
        saved = self.kv_caches, self.block_size
        num_blocks = -(-num_tokens // block_size)
        self.allocate_kv_cache(num_blocks, block_size, kv_dtype)
        before = 0
        if cuda:
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        step = StepInput(
            input_ids=np.zeros(num_tokens, dtype=np.int64),
            positions=np.arange(num_tokens, dtype=np.int64),
            query_lens=np.asarray([num_tokens]),
            context_lens=np.asarray([0]),
            block_tables=np.arange(num_blocks, dtype=np.int32)[None, :],
            sample_idx=np.asarray([num_tokens - 1]),
        )
        self.run(step)
        peak = 0
        if cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_caches, self.block_size = saved
        if cuda:
            torch.cuda.empty_cache()
        return int(peak)

    def measure_kv_budget(self, request: Profile) -> KVBudget:
        """This rank's KV budget (the GPU's share left after weights and the profiled activation peak; on
        CPU this rank's share of the host), agreed with the other ranks: every rank gets the least, since
        every rank allocates the same number of blocks. Rank 0 sends ``request`` to the others first; they
        run this same method when it arrives."""
        if self.peers is not None:
            self.peers.send(request)
        activation = self.profile_activation_peak(
            request.num_tokens, request.block_size, request.kv_dtype, request.forward_on_cpu
        )
        graphs = self.profile_graph_bytes(request)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
            own, others = gpu_kv_budget(
                total,
                free,
                reserved,
                request.gpu_memory_utilization,
                self.weights_bytes(),
                activation,
                graphs,
            )
            measured = {"device_total_bytes": total, "device_free_bytes": free, "other_bytes": others}
            source = str(self.device)
        else:
            own, measured, source = cpu_kv_cache_bytes(max(tp_size(), pp_state().host_ranks)), {}, "host"
        ranks = gather_ints(own, self.device)
        return KVBudget(
            min(ranks), activation, ranks, {**measured, "cuda_graph_bytes": graphs, "source": source}
        )

    def profile_graph_bytes(self, request: Profile) -> int:
        """Device memory the decode graphs will take (0 without graphs, or off CUDA): record the largest
        batch size and then the smallest into one pool over a two-block scratch cache, measuring the
        device's free memory around each; the pool the largest needs plus every other recording's own
        cost (the smallest's) bound what `capture_decode_graphs` takes later. Every rank records at once.

        A recording that fails here turns the graphs off (`graphs_off`, 0 bytes) with a warning: the engine
        starts and decodes eagerly, as when the later capture fails; it never stops the engine. The ranks
        agree after every recording, so none goes on to the next (whose warm-up meets the others in its
        all-reduces) while another has given up: graphs stay off on every rank if one rank's failed."""
        if not request.graph_sizes:
            return 0
        saved = self.kv_caches, self.block_size
        self.allocate_kv_cache(2, request.block_size, request.kv_dtype)
        capture = request.capture or cuda_capture()
        recordings, costs = [], []  # the recordings stay alive: the smallest records into the largest's pool
        try:
            for size in dict.fromkeys((request.graph_sizes[-1], request.graph_sizes[0])):
                free = self._free_device_bytes()
                why = None
                try:
                    recordings.append(self._record([size], request.max_model_len, capture))
                    costs.append(max(free - self._free_device_bytes(), 0))
                except Exception as exc:  # noqa: BLE001 - any recording failure means: run eagerly
                    why = f"recording failed while measuring their memory: {type(exc).__name__}: {exc}"
                failed = gather_ints(int(why is not None), self.device)
                if any(failed):
                    self.graphs_off = why or f"tensor-parallel rank {failed.index(1)} could not record them"
                    log.warning("CUDA graphs will be off, decode runs eagerly (%s)", self.graphs_off)
                    return 0
        finally:
            del recordings
            self.kv_caches, self.block_size = saved
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return costs[0] + (len(request.graph_sizes) - 1) * costs[-1]

    def _free_device_bytes(self) -> int:
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.mem_get_info(self.device)[0]

    # ---- CUDA graphs ----------------------------------------------------------------------------------
    def capture_decode_graphs(
        self, max_num_seqs: int, max_model_len: int, capture: Capture | None = None
    ) -> str | None:
        """Record the decode forward per batch size (after the KV cache is allocated), then check one
        replay against the eager forward. Returns None when graphs are on, else why they stay off: a
        recording that fails or disagrees leaves the engine eager, it never stops it. Under tensor
        parallelism every rank records (rank 0 sends the others the same request first) and the ranks
        agree: graphs stay off on every rank if one rank's failed."""
        if self.peers is not None:
            self.peers.send(CaptureGraphs(max_num_seqs, max_model_len, capture))
        self.decode_graphs = None
        why = self.graphs_off  # profiling could not record them: no second try (every rank agrees)
        try:
            if why is None:
                graphs = self._record(capture_sizes(max_num_seqs), max_model_len, capture or cuda_capture())
                why = self._check_decode_graphs(graphs)
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run eagerly
            why = f"capture failed: {type(exc).__name__}: {exc}"
        failed = gather_ints(int(why is not None), self.device)
        if why is None and any(failed):
            why = f"tensor-parallel rank {failed.index(1)} could not record them"
        if why is None:
            self.decode_graphs = graphs
            log.info("CUDA graphs: decode batches of %s sequences", ", ".join(map(str, graphs.sizes)))
        else:
            log.warning("CUDA graphs are off, decode runs eagerly (%s)", why)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return why

    def _record(self, sizes: list[int], max_model_len: int, capture: Capture) -> DecodeGraphs:
        return DecodeGraphs(
            self.model,
            self.kv_caches,
            sizes=sizes,
            max_model_len=max_model_len,
            block_size=self.block_size,
            hidden_size=self.model.config.hidden_size,
            dtype=self.model.dtype,
            device=self.device,
            capture=capture,
            window=bool(self.window_layers),
        )

    def _check_decode_graphs(self, graphs: DecodeGraphs) -> str | None:
        """One padded decode batch over random KV in free blocks (start-up: every block is free), replayed
        and run eagerly; None when every row's logits agree."""
        # the smallest pool's blocks (a window group's may be smaller)
        num_blocks = min(cache.kv.shape[1] for cache in self.kv_caches)
        n = min(3, graphs.sizes[-1], num_blocks)
        per_seq = max(1, min(num_blocks // n, graphs.max_blocks, 4))
        blocks = torch.arange(n * per_seq, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(0)
        for cache in self.kv_caches:
            shape = (2, len(blocks), *cache.kv.shape[2:])
            if cache.scales is None:
                noise = torch.randn(shape, generator=gen, device=self.device).to(cache.kv.dtype)
            else:
                noise = torch.randint(-100, 100, shape, generator=gen, device=self.device).to(torch.int8)
                cache.scales[:, blocks] = 0.01
            cache.kv[:, blocks] = noise
        seq_lens = [max(1, min(per_seq * self.block_size, graphs.max_model_len) - i) for i in range(n)]
        ctx = np.asarray(seq_lens, dtype=np.int64) - 1
        step = StepInput(
            input_ids=np.arange(1, n + 1, dtype=np.int64),
            positions=ctx.copy(),
            query_lens=np.ones(n, dtype=np.int64),
            context_lens=ctx,
            block_tables=np.arange(n * per_seq, dtype=np.int32).reshape(n, per_seq),
            sample_idx=np.arange(n, dtype=np.int64),
        )
        if graphs.window:  # the same blocks in the sliding layers' pool
            step.window_block_tables = step.block_tables.copy()
        self.decode_graphs = None
        eager = self.run(step)
        self.decode_graphs = graphs
        replayed = self.run(step)
        self.decode_graphs = None
        for layer in self.window_layers:  # the window pool's null block: zero again (finite under the mask)
            self.kv_caches[layer].kv[:, 0] = 0
            if self.kv_caches[layer].scales is not None:
                self.kv_caches[layer].scales[:, 0] = 0
        cosine = torch.nn.functional.cosine_similarity(eager.float(), replayed.float(), dim=-1)
        if not bool(torch.isfinite(replayed).all()) or float(cosine.min()) < GRAPH_CHECK_MIN_COSINE:
            return f"a replayed decode disagrees with the eager forward (cosine {float(cosine.min()):.4f})"
        return None

    # ---- device-cache ops ---------------------------------------------------------------------------
    def apply_kv_ops(self, ops: list[KVOp]) -> list[tuple[bytes, torch.Tensor]]:
        """Run copies, saves and loads in the order given (runs of one kind batched while no block repeats
        in the run); returns (hash, host data) of every saved block."""
        saved: list[tuple[bytes, torch.Tensor]] = []
        i = 0
        while i < len(ops):
            kind = type(ops[i])
            run: list[KVOp] = []
            touched: set[int] = set()
            while i < len(ops) and type(ops[i]) is kind:
                ids = _blocks_of(ops[i])  # (group, block id): the two groups' ids are distinct blocks
                if touched & ids:
                    break
                touched |= ids
                run.append(ops[i])
                i += 1
            if kind is CopyBlock:
                for window in (False, True):
                    group = [op for op in run if op.window == window]
                    if group:
                        self._copy([op.src for op in group], [op.dst for op in group], window)
            elif kind is SaveBlock:
                data = self.gather_blocks([op.block_id for op in run])
                saved.extend((op.block_hash, data[j]) for j, op in enumerate(run))
            elif kind is RotateBlock:
                self._rotate([op.src for op in run], [op.dst for op in run], [op.delta for op in run])
            else:
                self._scatter([op.block_id for op in run], [op.data for op in run])
        return saved

    def _copy(self, src: list[int], dst: list[int], window: bool = False) -> None:
        """Copy blocks in every layer of one group: the window group's layers, or the others."""
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        for layer, cache in enumerate(self.kv_caches):
            if (layer in self.window_layers) != window:
                continue
            cache.kv[:, d] = cache.kv[:, s]
            if cache.scales is not None:  # INT8: a block's scales go with it
                cache.scales[:, d] = cache.scales[:, s]

    def _packed(self, cache: LayerKVCache, ids: torch.Tensor) -> torch.Tensor:
        """[2, n, bs, H, D(+4)] of the given blocks: the cache rows, INT8 rows followed by their scale bytes."""
        kv = cache.kv.index_select(1, ids)
        if cache.scales is None:
            return kv
        scales = cache.scales.index_select(1, ids).unsqueeze(-1).view(torch.int8)  # [2, n, bs, H, 4]
        return torch.cat((kv, scales), dim=-1)

    def _rotate(self, src: list[int], dst: list[int], deltas: list[int]) -> None:
        """Attention sinks: the sinks' keys, rotated from their written blocks to follow the window."""
        per_layer = getattr(self.model, "layer_inv_freq", None)  # models with a RoPE base per layer (Gemma 3)
        for layer, cache in enumerate(self.kv_caches):
            inv_freq = (
                per_layer(self.first_layer + layer) if per_layer is not None else self.model.rotary.inv_freq
            )
            rotate_keys_(cache.kv, cache.scales, src, dst, deltas, inv_freq)

    def gather_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[n, *block_shape] on the host (pinned on CUDA)."""
        pin = self.device.type == "cuda"
        ids = torch.tensor(block_ids, device=self.device)
        dtype = self.kv_caches[0].kv.dtype
        out = torch.empty((len(block_ids), *self.block_shape), dtype=dtype, pin_memory=pin)
        for layer, cache in enumerate(self.kv_caches):
            out[:, layer].copy_(self._packed(cache, ids).transpose(0, 1), non_blocking=pin)
        if pin:
            torch.cuda.current_stream(self.device).synchronize()
        return out

    def _scatter(self, block_ids: list[int], data: list[torch.Tensor]) -> None:
        ids = torch.tensor(block_ids, device=self.device)
        stacked = torch.stack(data)  # [n, *block_shape] on the host
        if tuple(stacked.shape[1:]) != self.block_shape or stacked.dtype != self.kv_caches[0].kv.dtype:
            raise ValueError(
                f"KV block of {tuple(stacked.shape[1:])} {stacked.dtype} cannot load into a cache of "
                f"{self.block_shape} {self.kv_caches[0].kv.dtype}"
            )
        if self.device.type == "cuda":
            stacked = stacked.to(self.device, non_blocking=True)
        d = self.head_dim
        for layer, cache in enumerate(self.kv_caches):
            rows = stacked[:, layer].transpose(0, 1)  # [2, n, bs, H, D(+4)]
            if cache.scales is None:
                cache.kv.index_copy_(1, ids, rows)
            else:
                cache.kv.index_copy_(1, ids, rows[..., :d].contiguous())
                scales = rows[..., d:].contiguous().view(SCALE_DTYPE).squeeze(-1)
                cache.scales.index_copy_(1, ids, scales)

    # ---- the step -----------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Ops first (in order), then the forward and one sampled token per sampling sequence."""
        return self.run_prepared(out, self.prepare(out))

    def prepare(self, out: SchedulerOutput) -> PreparedStep:
        """The host side of a step: its batch arrays and sampling rows, copied out of request state, so the
        device side (`run_prepared`) may run on another thread while the scheduler moves on."""
        order, slots = self._batch_order(out.scheduled)
        step = None if out.empty else prepare_step(out.scheduled, order, slots)
        prompt_rows = prompt_logprob_rows(out.scheduled, step, order) if step is not None else []
        rows: list[SamplingRow] = []
        row_index: list[int] = []
        spec: list[tuple[int, list[int], object | None]] = []
        if step is not None:
            # each sampling sequence's (first) logits row: the step's rows follow `order`; a drafted
            # sequence has one row more per proposed token
            logits_row, r = {}, 0
            for i in order or range(len(out.scheduled)):
                if out.scheduled[i].samples:
                    logits_row[i] = r
                    r += 1 + len(out.scheduled[i].draft)
            for i, sched in enumerate(out.scheduled):
                if not sched.samples:
                    continue
                req = sched.request
                stop_ids = ([] if req.params.ignore_eos else self.eos_token_ids) + req.params.stop_token_ids
                for seq in sched.sample_seqs:
                    rows.append(
                        SamplingRow(
                            params=req.params,
                            prompt_token_ids=req.prompt_token_ids,
                            output_token_ids=seq.output_token_ids,
                            generator=seq.generator,
                            stop_ids=stop_ids,
                        )
                    )
                    row_index.append(logits_row[i])
                    if sched.draft:
                        spec.append((len(rows) - 1, list(sched.draft), sched.draft_probs))
        return PreparedStep(step, prompt_rows, rows, row_index, spec)

    def run_prepared(self, out: SchedulerOutput, prep: PreparedStep) -> RunnerOutput:
        """The device side of a step `prepare` planned: ops, forward, sampling. Reads no request state but
        the (unchanging) prompts of prompt-logprob rows and the sampling rows' generators."""
        result = RunnerOutput()
        step = prep.step
        if self.peers is not None and (out.kv_ops or step is not None):
            self.peers.send(Step(out.kv_ops, step))
        if out.kv_ops:
            start = time.perf_counter()
            result.saved = self.apply_kv_ops(out.kv_ops)
            result.save_seconds = time.perf_counter() - start
        if step is None:
            return result
        logits = self.run(step)
        if prep.prompt_rows:
            num_sample = len(step.sample_idx)
            result.prompt_logprobs = self._prompt_logprobs(
                logits[num_sample:], out.scheduled, prep.prompt_rows
            )
            logits = logits[:num_sample]
        rows, row_index = prep.rows, prep.row_index
        if rows:
            logits_rows = logits
            if row_index != list(range(logits.shape[0])):
                idx = upload([np.asarray(row_index, dtype=np.int64)], logits.device)[0]
                logits_rows = logits[idx]
            sampled = sample(logits_rows, rows, out.token_bitmask)
            result.token_ids = sampled.token_ids
            result.logprobs = sampled.logprobs
            result.top_logprobs = sampled.top_logprobs
        if prep.spec:
            verify(logits, prep.rows, prep.row_index, prep.spec, result)
        return result

    def _batch_order(self, scheduled: list[ScheduledSeq]) -> tuple[list[int] | None, np.ndarray | None]:
        """With LoRA: (the step's sequences grouped by adapter slot, the base model's last, so each
        adapter's tokens are one segment; each sequence's slot, -1 for the base model), loading adapters
        into slots as needed. (None, None) keeps the scheduler's order."""
        if self.lora is None or not scheduled:
            return None, None
        slots = self.lora.slots_for([s.request.lora for s in scheduled])
        return sorted(range(len(scheduled)), key=lambda i: (slots[i] < 0, slots[i])), slots

    @staticmethod
    def _prompt_logprobs(
        logits: torch.Tensor, scheduled: list[ScheduledSeq], plan: list[tuple[int, list[int]]]
    ) -> list[tuple[int, list[dict]]]:
        """Logprob entries of the prompt tokens each planned chunk predicts (rows of ``logits`` in plan order)."""
        out, start = [], 0
        for index, targets in plan:
            req = scheduled[index].request
            rows = logits[start : start + len(targets)].log_softmax(dim=-1)
            start += len(targets)
            ids = torch.tensor([req.prompt_token_ids[t] for t in targets], device=rows.device)
            out.append((index, logprob_entries(rows, ids, [req.params.prompt_logprobs] * len(targets))))
        return out

    def forward(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Float32 logits for the last token of every sequence that samples this step (in the order of
        ``scheduled``)."""
        order, slots = self._batch_order(scheduled)
        logits = self.run(prepare_step(scheduled, order, slots))
        if order is None:
            return logits
        sampling = [i for i in order if scheduled[i].samples]
        back = sorted(range(len(sampling)), key=lambda r: sampling[r])
        return logits[torch.tensor(back, device=logits.device)]

    @torch.inference_mode()
    def run(self, step: StepInput) -> torch.Tensor:
        """The forward of one step's batch (what every tensor-parallel rank runs); returns the logits of the
        sampling rows, then of the prompt-logprob rows (on the rank that gathers them; an empty tensor
        elsewhere)."""
        if self.pipeline is not None:
            return self.pipeline.run(step)
        prompt_rows = len(step.logprob_idx) > 0
        if not prompt_rows and self.decode_graphs is not None and self.decode_graphs.fits(step):
            return self.model.compute_logits(self.decode_graphs.run(step))
        input_ids, positions, meta = self._metadata(step)
        if self.lora is not None:
            self.lora.set_batch(step.lora_rows)
        try:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        finally:
            if self.lora is not None:
                self.lora.set_batch(None)
        rows = np.concatenate([step.sample_idx, step.logprob_idx]) if prompt_rows else step.sample_idx
        if len(rows) == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        if prompt_rows or len(rows) != hidden.shape[0]:
            hidden = hidden[upload([rows], hidden.device)[0]]
        return self.model.compute_logits(hidden)

    def _metadata(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        tables, pos, qlens = step.block_tables, step.positions, step.query_lens
        row = np.repeat(np.arange(len(qlens)), qlens)
        qsl = np.zeros(len(qlens) + 1, dtype=np.int32)
        np.cumsum(qlens, out=qsl[1:])
        cache_pos = step.context_lens[row] + np.arange(len(row)) - qsl[row]  # where each new token goes
        slots = tables[row, cache_pos // bs].astype(np.int64) * bs + cache_pos % bs
        window_tables = step.window_block_tables
        extra = []
        if window_tables is not None:
            window_slots = window_tables[row, cache_pos // bs].astype(np.int64) * bs + cache_pos % bs
            extra = [window_tables, window_slots]
        seq_lens = step.context_lens + qlens
        qlist, slist = qlens.tolist(), seq_lens.tolist()
        # one asynchronous copy from pinned memory on CUDA (engine/worker/uploads.py), no copy on the CPU
        input_ids, positions, qsl_d, seq_lens_d, context_lens_d, tables_d, slots_d, *window = upload(
            [
                step.input_ids,
                pos,
                qsl,
                seq_lens.astype(np.int32),
                step.context_lens.astype(np.int32),
                tables,
                slots,
                *extra,
            ],
            self.device,
        )
        meta = AttentionMetadata(
            num_seqs=len(qlist),
            num_tokens=int(qsl[-1]),
            query_start_loc=qsl_d,
            seq_lens=seq_lens_d,
            context_lens=context_lens_d,
            block_tables=tables_d,
            slot_mapping=slots_d,
            max_query_len=max(qlist),
            max_seq_len=max(slist),
            query_lens_list=qlist,
            seq_lens_list=slist,
            is_decode_only=all(q == 1 for q in qlist),
            max_position=int(pos.max()) if len(pos) else 0,
            window_block_tables=window[0] if window else None,
            window_slot_mapping=window[1] if window else None,
        )
        return input_ids, positions, meta


def _blocks_of(op: KVOp) -> set[tuple[bool, int]]:
    """The (window group?, block id) pairs an op touches."""
    if isinstance(op, CopyBlock):
        return {(op.window, op.src), (op.window, op.dst)}
    if isinstance(op, RotateBlock):
        return {(False, op.src), (False, op.dst)}
    if isinstance(op, SaveBlock | LoadBlock):
        return {(False, op.block_id)}
    raise TypeError(f"unknown KV op {op!r}")
