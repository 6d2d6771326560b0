"""The ranks of a pipeline-parallel replica (or of any replica spanning hosts): the world of
stages x tensor-parallel ranks, rank 0's handle on it, and what every other rank runs.

Rank 0 is the engine's own process (stage 0, TP rank 0): it schedules and samples, and broadcasts every
message (profile, allocate, step, stop) to the other ranks over a gloo control group; unlike the queues
of tensor parallelism alone (tp_workers.py) this reaches ranks on other hosts. With ``--nnodes H`` each
host runs world / H consecutive ranks: the leader (node rank 0) starts its ranks 1.. as child processes
of the engine, a ``--headless`` host starts its own (`run_headless`) and waits for them. Every rank meets
at tcp://MASTER_ADDR:MASTER_PORT (on one host: a free loopback port).

Lifetime: local ranks die with the engine's process (lifetime.py) and a local rank that dies makes the
engine report itself dead (watchdog, as tensor parallelism does). A rank whose leader is gone fails in
its next receive (the connection closes) and exits; a headless host exits once its ranks have.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist
from pagoda.engine.sizing.stages import host_ranks, stage_layers
from pagoda.engine.worker.lifetime import die_with_parent, started_on_main_thread
from pagoda.engine.worker.rank_messages import Stop, run_message
from pagoda.engine.worker.tp_workers import EXIT_TIMEOUT_S, free_tcp_port

log = logging.getLogger("pagoda.engine.distributed")

EXIT_LEADER_GONE = 3  # a rank whose leader went away (its control receive failed)


@dataclasses.dataclass
class StageTimesRequest:
    """Every rank reports its pipeline stage's busy and wall seconds (for the bubble); reset afterwards."""

    reset: bool = True


def uses_pipeline(config: Any) -> bool:
    """Whether this engine's ranks form a pipeline world (several stages, or several hosts)."""
    return config.pipeline_parallel_size > 1 or config.nnodes > 1


def check_pipeline(config: Any, mc: Any, model_class: type | None = None) -> None:
    """Refuse what the pipeline does not support, before any rank starts (ValueError)."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if mc.num_attention_heads < tp:
        raise ValueError(
            f"tensor_parallel_size {tp} exceeds the model's {mc.num_attention_heads} attention heads"
        )
    stage_layers(mc.num_hidden_layers, pp)  # enough layers for the stages
    if pp > 1 and model_class is not None:
        from pagoda.engine.models.llama import LlamaForCausalLM

        if (
            not issubclass(model_class, LlamaForCausalLM)
            or model_class.forward is not LlamaForCausalLM.forward
        ):
            raise ValueError(
                f"pipeline_parallel_size > 1 is not supported for {mc.architecture} yet (its forward is its "
                "own); Llama-family models are supported"
            )


def _init_method(config: Any) -> str:
    if config.nnodes == 1:
        return f"tcp://127.0.0.1:{free_tcp_port()}"
    return f"tcp://{config.master_addr}:{config.master_port}"


def _local_device(device: torch.device, local_index: int) -> torch.device:
    """One GPU per rank on its host (cuda:LOCAL_INDEX); on CPU every rank shares the host."""
    if device.type == "cuda":
        device = torch.device("cuda", local_index)
        torch.cuda.set_device(device)
    return device


def join_world(
    config: Any, rank: int, init_method: str, device: torch.device, num_layers: int
) -> torch.device:
    """This rank's device and threads, then the world (engine/distributed/parallel_state.py)."""
    from pagoda.engine.distributed.parallel_state import init_distributed
    from pagoda.engine.worker.rank import share_cpu_threads

    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    per_host = tp * pp // config.nnodes
    device = _local_device(device, rank % per_host)
    share_cpu_threads(device, per_host)
    layers = stage_layers(num_layers, pp)[rank // tp]
    init_distributed(rank, tp, pp, init_method, device, layers, per_host)
    return device


class PPWorkers:
    """Rank 0's handle on the other ranks: starts this host's ranks 1..per_host-1 and sends every rank the
    same messages, in order (``send``)."""

    def __init__(self, config: Any, init_method: str) -> None:
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        self.size = world
        ctx = mp.get_context("spawn")
        pdeathsig = started_on_main_thread()
        self.procs = [
            ctx.Process(
                target=rank_main,
                args=(rank, config, init_method, os.getpid(), pdeathsig),
                name=f"pagoda-pp-rank{rank}",
                daemon=True,
            )
            for rank in host_ranks(world, config.nnodes, 0)
            if rank != 0
        ]
        for p in self.procs:
            p.start()
        self.dead_reason: str | None = None
        self._closing = False
        self._watchdog = threading.Thread(target=self._watch, name="pagoda-pp-watchdog", daemon=True)
        self._watchdog.start()
        atexit.register(self.shutdown, EXIT_TIMEOUT_S)

    def _watch(self) -> None:
        while not self._closing:
            for p in self.procs:
                if not p.is_alive() and not self._closing:
                    rank = int(p.name.removeprefix("pagoda-pp-rank"))
                    self.dead_reason = f"pipeline rank {rank} exited (code {p.exitcode})"
                    log.error("%s", self.dead_reason)
                    return
            threading.Event().wait(0.5)

    def send(self, msg: Any) -> None:
        if self.dead_reason is not None:
            raise RuntimeError(self.dead_reason)
        from pagoda.engine.distributed.parallel_state import control_group

        try:
            dist.broadcast_object_list([msg], src=0, group=control_group())
        except RuntimeError as exc:  # a rank went away (another host's, which no watchdog sees)
            self.dead_reason = f"a pipeline rank is gone: {exc}"
            raise

    def stage_times(self, runner: Any) -> list[tuple[float, float, int]]:
        """(busy s, wall s, steps) of every rank's stage since the last call, in rank order; resets them."""
        from pagoda.engine.distributed.parallel_state import pp_state

        self.send(StageTimesRequest())
        return _gather_times(runner, pp_state().world)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        if self.dead_reason is None:
            # Stop every rank (remote ones too); in a thread, so a rank stuck elsewhere cannot hold us here.
            stopper = threading.Thread(target=self._send_stop, daemon=True)
            stopper.start()
            stopper.join(timeout)
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)

    def _send_stop(self) -> None:
        from pagoda.engine.distributed.parallel_state import control_group

        try:
            dist.broadcast_object_list([Stop()], src=0, group=control_group())
        except Exception:  # noqa: BLE001 - a rank already gone: nothing left to stop there
            pass


def _gather_times(runner: Any, world: int) -> list[tuple[float, float, int]]:
    from pagoda.engine.distributed.parallel_state import control_group

    t = runner.pipeline.times
    mine = torch.tensor([t.busy_s, t.wall_s, float(t.steps)], dtype=torch.float64)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=control_group())
    runner.pipeline.times = type(t)()
    return [(float(p[0]), float(p[1]), int(p[2])) for p in parts]


def start_pipeline(
    config: Any, path: Any, device: torch.device, num_layers: int
) -> tuple[PPWorkers, torch.device]:
    """Rank 0: start this host's other ranks and join the world with them (and the other hosts' ranks)."""
    init_method = _init_method(config)
    workers = PPWorkers(dataclasses.replace(config, model=str(path)), init_method)
    try:
        device = join_world(config, 0, init_method, device, num_layers)
    except Exception:
        workers.shutdown()
        raise
    log.info(
        "pipeline parallelism: %d stages x %d tensor-parallel ranks over %d host(s) (%s), stages %s",
        config.pipeline_parallel_size, config.tensor_parallel_size, config.nnodes,
        "nccl" if device.type == "cuda" else "gloo",
        stage_layers(num_layers, config.pipeline_parallel_size),
    )  # fmt: skip
    return workers, device


def rank_main(rank: int, config: Any, init_method: str, parent_pid: int, pdeathsig: bool = True) -> None:
    """One rank other than 0: build its stage's shard, then run every message rank 0 broadcasts."""
    die_with_parent(parent_pid, pdeathsig=pdeathsig, grace_s=0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine (or the headless host) stops its ranks
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from pagoda.engine.distributed.parallel_state import control_group, destroy_tensor_parallel
    from pagoda.engine.sizing.model_config import ModelConfig
    from pagoda.engine.worker.rank import build_rank, resolve_device, resolve_dtype

    path = config.model
    mc = ModelConfig.from_dir(path)
    device = join_world(config, rank, init_method, resolve_device(config.device), mc.num_hidden_layers)
    dtype = resolve_dtype(config.dtype, device, mc.torch_dtype, mc.family.float16)
    runner = build_rank(config, path, mc, device, dtype, progress=False)
    try:
        while True:
            box: list[Any] = [None]
            try:
                dist.broadcast_object_list(box, src=0, group=control_group())
            except RuntimeError as exc:
                log.error("pipeline rank %d: the leader is gone (%s); exiting", rank, exc)
                os._exit(EXIT_LEADER_GONE)
            msg = box[0]
            if isinstance(msg, Stop):
                return
            if isinstance(msg, StageTimesRequest):
                _gather_times(runner, config.tensor_parallel_size * config.pipeline_parallel_size)
            else:
                run_message(runner, msg)
    finally:
        destroy_tensor_parallel()


LEADER_WAIT_S = 1800.0  # a headless host may start long before its leader (image pulls, model downloads)


def wait_for_leader(addr: str, port: int, timeout_s: float = LEADER_WAIT_S) -> bool:
    """Wait until the leader's rendezvous port accepts a connection (its name may not even resolve before
    its pod runs), so the ranks' own rendezvous, whose timeout is short, starts once the leader is there."""
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=5):
                return True
        except OSError:
            time.sleep(1.0)
    return False


def run_headless(config: Any) -> int:
    """`pagoda serve --headless --node-rank K`: run this host's ranks of the replica until they end (the
    leader stopped them, or went away). No API server. Returns the exit code."""
    from pagoda.engine.loader import resolve_model

    path = resolve_model(config.model, config.revision)
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    ranks = host_ranks(world, config.nnodes, config.node_rank)
    init_method = _init_method(config)
    log.info("headless host %d of %d: ranks %d..%d, joining %s", config.node_rank, config.nnodes,
             ranks[0], ranks[-1], init_method)  # fmt: skip
    if not wait_for_leader(config.master_addr, config.master_port):
        log.error(
            "the leader %s:%d did not come up in %.0f s",
            config.master_addr,
            config.master_port,
            LEADER_WAIT_S,
        )
        return 1
    ctx = mp.get_context("spawn")
    cfg = dataclasses.replace(config, model=str(path))
    procs = [
        ctx.Process(
            target=rank_main, args=(r, cfg, init_method, os.getpid(), True), name=f"pagoda-pp-rank{r}"
        )
        for r in ranks
    ]
    for p in procs:
        p.start()

    def stop(signum: int, frame: Any) -> None:
        for p in procs:
            if p.is_alive():
                p.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    for p in procs:
        p.join()
        if p.exitcode:
            code = code or 1
            # one rank gone: the replica cannot run; end the others rather than leave them waiting
            stop(signal.SIGTERM, None)
    return code
