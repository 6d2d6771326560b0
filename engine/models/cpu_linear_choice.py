"""Which product a CPU linear of 1-64 rows takes on this host: the kernels library's small-rows product or
oneDNN's packed weight, chosen by timing both on the host, once, and kept in $PAGODA_CACHE/cpu-linear.

Neither wins everywhere: on an AVX2 host the small-rows product was faster at every decode size, on an AVX-512
one (AMD EPYC, AVX512-BF16) it wins at a few rows and oneDNN from about sixteen on (docs/benchmarks.md), and the
crossing moves with the shape, the dtype, the thread count and the CPU. So the first process of a host to meet a
shape times the candidates at a few row counts (`ROW_BUCKETS`) and writes the winners to a file in
$PAGODA_CACHE/cpu-linear named for the host (CPU model, its flags, the kernel library's variant and sources,
torch's version, which carries oneDNN's); a file lock makes the first process measure and the others wait and read, so every
process of a host (tensor-parallel ranks, restarts, replicas on one node) makes the same choice. A row count
between two measured ones takes the choice of the next measured one up.

``PAGODA_CPU_LINEAR``: ``auto`` (the measured choice), ``ours`` or ``onednn`` (forced, no measurement; ``ours``
falls back to oneDNN where no small-rows product applies). `pagoda kernels info` prints the table.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from pagoda.engine import envs
from pagoda.kernels.cpu import build, loader

log = logging.getLogger(__name__)

OURS, ONEDNN = "ours", "onednn"
SETTINGS = ("auto", OURS, ONEDNN)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# per candidate and row count: at least MIN_CALLS timed calls, more while under CALL_BUDGET_S, at most MAX_CALLS
MIN_CALLS, MAX_CALLS, CALL_BUDGET_S = 3, 40, 0.02
FORMAT = 2  # of the file and its method (2: weights cycled past the cache); another format is measured again

Timer = Callable[[int], dict[str, float]]  # rows -> seconds per call of each candidate at that row count


@dataclass(frozen=True)
class Shape:
    """What a choice is made for: the operand kinds, the weight's [n, k], and the threads the product runs on."""

    kind: (
        str  # "f32" (float32 x and weight), "f32-bf16w" (float32 x, bfloat16 weight), "bf16" (both bfloat16)
    )
    n: int
    k: int
    threads: int

    def key(self) -> str:
        return f"{self.kind} {self.n}x{self.k} t{self.threads}"


def setting() -> str:
    """``PAGODA_CPU_LINEAR`` normalised ("auto" when unset or not one of `SETTINGS`)."""
    value = envs.cpu_linear()
    return value if value in SETTINGS else "auto"


def bucket(rows: int) -> int:
    """The measured row count whose choice ``rows`` (1-64) takes: the next one up."""
    for b in ROW_BUCKETS:
        if rows <= b:
            return b
    return ROW_BUCKETS[-1]


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_identity(variant: str, library: str, flags: frozenset[str]) -> dict[str, str]:
    """What makes measurements of one host valid for another process: the CPU (model and flags), the kernel
    library (variant and its file's sources, via its path and the build digest) and torch (oneDNN ships in it)."""
    try:
        sources = build.source_digest()
    except OSError:
        sources = "unknown"
    return {
        "cpu": cpu_model(),
        "flags": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16],
        "kernels": f"{variant} {library} {sources}",
        "torch": torch.__version__,
    }


def host_key(identity: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def time_calls(candidates: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Seconds per call of each candidate: the fastest of several single calls, the candidates interleaved
    (the minimum drops calls that a loaded host preempted; interleaving spreads slow periods over all)."""
    best = {name: float("inf") for name in candidates}
    first = {}
    for name, fn in candidates.items():  # warm-up: packs, page faults, thread pool
        fn()
        t0 = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t0
        best[name] = first[name]
    slowest = max(first.values(), default=0.0)
    calls = max(MIN_CALLS, min(MAX_CALLS, int(CALL_BUDGET_S / max(slowest, 1e-9))))
    for _ in range(calls - 1):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The largest cache of CPU 0 as sysfs lists it (32 MiB where it cannot be read)."""
    sizes = []
    for index in Path(root).glob("index*"):
        with contextlib.suppress(OSError, ValueError):
            text = (index / "size").read_text().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


def cold_copies(weight_bytes: int, most: int = 64) -> int:
    """How many copies of a weight a timer cycles through so each call's weight comes from memory, as in a
    model whose weights exceed the caches (a repeated product over one small weight runs from cache, where
    oneDNN's blocked kernels win what they lose on a weight streamed from memory): twice the last-level cache,
    at most ``most``."""
    return max(1, min(most, -(-2 * last_level_cache_bytes() // max(weight_bytes, 1))))


def decide(times: dict[str, float]) -> str:
    """The fastest candidate; oneDNN on a tie or where it alone was timed."""
    ours = times.get(OURS)
    return OURS if ours is not None and ours < times.get(ONEDNN, float("inf")) else ONEDNN


def measure(timer: Timer) -> dict[str, dict]:
    """Per measured row count: the candidates' microseconds per call and the choice."""
    table = {}
    for rows in ROW_BUCKETS:
        times = timer(rows)
        table[str(rows)] = {"choice": decide(times), "us": {k: round(v * 1e6, 2) for k, v in times.items()}}
    return table


class ChoiceTable:
    """The choices of one host, read from and written to ``path`` (None: kept in this process only)."""

    def __init__(self, path: Path | None, identity: dict[str, str]) -> None:
        self.path = path
        self.identity = identity
        self.shapes: dict[str, dict[str, dict]] = {}
        self._fast: dict[tuple[str, int], str] = {}
        self._loaded = False

    def choose(self, shape: Shape, rows: int, timer: Timer) -> str:
        """OURS or ONEDNN for a product of ``rows`` (1-64) rows of ``shape``; measures the shape on a miss."""
        key = shape.key()
        b = bucket(rows)
        hit = self._fast.get((key, b))
        if hit is not None:
            return hit
        if key not in self.shapes:
            self._fill(key, timer)
        choice = self.shapes[key][str(b)]["choice"]
        self._fast[(key, b)] = choice
        return choice

    def _fill(self, key: str, timer: Timer) -> None:
        if not self._loaded:
            self.shapes.update(self._read())
            self._loaded = True
            if key in self.shapes:
                return
        if self.path is None:
            self.shapes[key] = measure(timer)
            return
        try:
            with self._locked():
                on_disk = self._read()  # another process may have measured it meanwhile
                if key not in on_disk:
                    t0 = time.perf_counter()
                    on_disk[key] = measure(timer)
                    log.info("CPU linear %s: measured in %.2f s: %s", key, time.perf_counter() - t0,
                             {r: v["choice"] for r, v in on_disk[key].items()})  # fmt: skip
                    self._write(on_disk)
                self.shapes.update(on_disk)
        except OSError as exc:
            log.warning(
                "CPU linear choices not kept in %s (%s): measured for this process only", self.path, exc
            )
            self.path = None
            self.shapes[key] = measure(timer)

    def stored(self) -> dict[str, dict]:
        """The choices in the file (other processes' included)."""
        return self._read()

    def _read(self) -> dict[str, dict]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if data.get("format") != FORMAT or data.get("host") != self.identity:
            return {}
        return dict(data.get("shapes", {}))

    def _write(self, shapes: dict[str, dict]) -> None:
        assert self.path is not None
        data = {"format": FORMAT, "host": self.identity, "shapes": shapes}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)  # readers without the lock see the old file or the new one

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.path.with_suffix(".lock"), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, or the process dies
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def choices_dir() -> Path:
    """$PAGODA_CACHE/cpu-linear, beside the compiled kernels' cpu-kernels: an image's prebuilt kernels leave
    the pod's cpu-kernels unwritten (images/check.py asserts it), while each pod measures its own host."""
    return envs.cache_root() / "cpu-linear"


_tables: dict[tuple[str, str | None], ChoiceTable] = {}


def table_for(variant: str, library: str | None) -> ChoiceTable:
    """This host's table for a loaded kernel library (one per library: tests switch variants)."""
    found = _tables.get((variant, library))
    if found is None:
        identity = host_identity(variant, str(library), loader.cpu_flags())
        found = ChoiceTable(choices_dir() / f"linear-choice-{host_key(identity)}.json", identity)
        _tables[(variant, library)] = found
    return found


def current_table() -> ChoiceTable:
    kernels = loader.current()
    return table_for(kernels.variant, kernels.path)


def choose(shape: Shape, rows: int, timer: Timer) -> str:
    """OURS or ONEDNN for this product: forced by ``PAGODA_CPU_LINEAR``, else this host's measured choice."""
    forced = setting()
    if forced != "auto":
        return forced
    return current_table().choose(shape, rows, timer)


# (kind, weight shape, threads, rows, the variable's value, the library) -> whether ours
_memo: dict[tuple, bool] = {}


def prefers_ours(
    kind: str,
    weight_shape: tuple[int, ...],
    threads: int,
    rows: int,
    make_timer: Callable[..., Timer],
    *timer_args: object,
) -> bool:
    """Whether a product of ``rows`` rows through a weight of ``weight_shape`` [n, k] takes the small-rows
    product (`choose`, remembered). ``make_timer(*timer_args)`` is called only where it measures, once: every
    linear of a step asks, so the answer is a look-up that builds nothing."""
    key = (kind, weight_shape, threads, rows, envs.cpu_linear(), loader.current().path)
    hit = _memo.get(key)
    if hit is None:
        made: list[Timer] = []

        def timer(r: int) -> dict[str, float]:
            if not made:
                made.append(make_timer(*timer_args))
            return made[0](r)

        n, k = weight_shape
        hit = _memo[key] = choose(Shape(kind, n, k, threads), rows, timer) == OURS
    return hit


# bumped by `reset`: the linears' remembered routes (cpu_linear.step_linear) name the generation they were made in
generation = 0


def reset() -> None:
    """Forget the tables read in this process (tests: another cache directory)."""
    global generation
    _tables.clear()
    _memo.clear()
    generation += 1
