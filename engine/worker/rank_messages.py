"""What rank 0 sends every other tensor-parallel rank, in order: profile, allocate, record graphs, run a
step, stop. Each rank runs it on its own runner (engine/worker/tp_workers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Profile:
    """Measure what this rank's KV cache may take: every rank runs the same profiling forward (meeting in
    its collectives) and the ranks agree on the smallest budget (ModelRunner.measure_kv_budget)."""

    num_tokens: int
    block_size: int
    kv_dtype: Any  # torch.dtype
    gpu_memory_utilization: float
    forward_on_cpu: bool = False
    graph_sizes: tuple[int, ...] = ()  # decode batch sizes CUDA graphs will be recorded for (their memory)
    max_model_len: int = 0  # the longest the recordings may have to cover
    capture: Any = None  # how graphs are recorded (None: CUDA graphs; tests pass an emulation)


@dataclass
class CaptureGraphs:
    """Record the decode graphs (every rank at once: the recordings meet in their all-reduces)."""

    max_num_seqs: int
    max_model_len: int
    capture: Any = None  # None: CUDA graphs


@dataclass
class Allocate:
    num_blocks: int
    block_size: int
    kv_dtype: Any  # torch.dtype
    num_window_blocks: int = 0  # a window group: the sliding layers' pool (ModelRunner.allocate_kv_cache)
    window_layers: tuple[int, ...] = ()


@dataclass
class Step:
    kv_ops: list
    step: Any  # pagoda.engine.worker.step_input.StepInput | None


class Stop:
    pass


def run_message(runner: Any, msg: Profile | Allocate | CaptureGraphs | Step) -> bool:
    """Run one of rank 0's messages on this rank's runner (a ModelRunner); False for a message this function
    does not know (Stop and a launcher's own are the caller's)."""
    if isinstance(msg, Profile):
        runner.measure_kv_budget(msg)
    elif isinstance(msg, Allocate):
        runner.allocate_kv_cache(
            msg.num_blocks, msg.block_size, msg.kv_dtype, msg.num_window_blocks, msg.window_layers
        )
    elif isinstance(msg, CaptureGraphs):
        runner.capture_decode_graphs(msg.max_num_seqs, msg.max_model_len, msg.capture)
    elif isinstance(msg, Step):
        if msg.kv_ops:
            runner.apply_kv_ops(msg.kv_ops)
        if msg.step is not None:
            runner.run(msg.step)
    else:
        return False
    return True
