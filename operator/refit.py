"""Re-fit instead of crash loops: an engine that runs out of memory gets a plan with a safety margin.

A failure is an engine container that was OOMKilled (the pod's memory limit) or exited with the engine's
out-of-memory code (3, pagoda.engine.exit_codes: CUDA ran out at start-up, or the KV cache for the
planned context did not fit the memory the engine measured, whose termination message says what fits); any
other exit (a busy port, EXIT_PORT_IN_USE; a bad flag; a missing model) leaves the plan alone. Each
failure of a pod running the current plan lowers one setting, the first that still has room within the
spec's bounds, in this order:

1. gpu-memory-utilization by UTILIZATION_STEP, down to UTILIZATION_FLOOR (on CPU pods the KV cache size,
   by KV_CACHE_FACTOR), capping max-model-len to what the smaller cache holds; skipped when the spec sets
   gpuMemoryUtilization. An OOMKilled GPU pod first halves its host KV tier (that is host RAM, the limit the
   kernel enforced). A measured KVCacheTooSmall skips this step: less memory cannot fit more.
2. max-model-len by LENGTH_FACTOR (or to what the engine measured fits), not below the workload's
   targetContext (or p99 prompt + output, else MIN_MODEL_LEN); skipped when the spec sets maxModelLen.
3. max-num-seqs halved, not below workload.minConcurrency; skipped when the spec sets maxNumSeqs.

The settings live in status.refit under EngineConfig's field names (with the failure that caused each change) for as long as the spec does
not change, replicas aside (an autoscaler writes them; spec_key); any other spec change starts over from a
fresh plan. An engine image upgrade whose pods measure a different memory profile re-plans through the same
record and bound (profile.py). After MAX_ATTEMPTS starts in a row
end in a memory failure (or no setting has room left), Ready=False with reason RefitExhausted and the operator
writes nothing more for that generation.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from pagoda.engine.cli.serve_args import flag
from pagoda.engine.exit_codes import (
    EXIT_OUT_OF_MEMORY,
    REASON_CUDA_OOM,
    REASON_KV_TOO_SMALL,
    parse_termination_message,
)
from pagoda.engine.sizing import Plan
from pagoda.engine.sizing.planner import FIT_SLACK

MAX_ATTEMPTS = 3  # engine starts per spec generation that may end in a memory failure: the plan + 2 re-fits
UTILIZATION_STEP = 0.05
UTILIZATION_FLOOR = 0.5
KV_CACHE_FACTOR = 0.8
LENGTH_FACTOR = 0.75
MIN_MODEL_LEN = 2048
HISTORY = 5  # re-fits kept in status.refit.history
OOM_KILLED = "OOMKilled"
EXHAUSTED = "RefitExhausted"
ENGINE_CONTAINER = "engine"
_FITS = re.compile(r"the largest max_model_len that fits is (\d+)")
# Settings are stored under EngineConfig's field names; measured figures (profile.py) under these.
MEASURED_KV_CACHE_BYTES = "measured_kv_cache_bytes"
MEASURED_WEIGHTS_BYTES = "measured_weights_bytes"
_CAMEL = re.compile(r"(?<!^)([A-Z])")


def settings_of(raw: dict[str, Any] | None) -> dict[str, Any]:
    """status.refit.settings by EngineConfig field name; a status written in camelCase by an older operator
    (maxModelLen) reads the same."""
    return {_CAMEL.sub(r"_\1", key).lower(): value for key, value in (raw or {}).items()}


def flag_word(field: str) -> str:
    """A setting as the engine's flag names it, for the words of a change (max-model-len)."""
    return flag(field).removeprefix("--")


@dataclass(frozen=True)
class Failure:
    """One memory failure of one engine container (one termination: acted on once)."""

    key: str
    pod: str
    reason: str  # OOMKilled, CUDAOutOfMemory or KVCacheTooSmall
    exit_code: int | None
    plan: str | None  # the plan hash of the pod's template
    message: str = ""
    profile: dict[str, Any] | None = None


def failure_of(pod: dict[str, Any], plan_annotation: str) -> Failure | None:
    """The engine container's memory failure in a Pod's status (its current or last termination), or None."""
    meta = pod.get("metadata") or {}
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") != ENGINE_CONTAINER:
            continue
        for state in ("state", "lastState"):
            term = (status.get(state) or {}).get("terminated")
            if not term:
                continue
            code = term.get("exitCode")
            failure = parse_termination_message(term.get("message"))
            if term.get("reason") == OOM_KILLED:
                reason = OOM_KILLED
            elif code == EXIT_OUT_OF_MEMORY:
                reason = (failure or {}).get("reason") or REASON_CUDA_OOM
            else:
                continue
            ended = term.get("containerID") or term.get("finishedAt") or ""
            return Failure(
                key=f"{meta.get('uid') or meta.get('name')}/{status.get('restartCount', 0)}/{ended}",
                pod=str(meta.get("name")),
                reason=reason,
                exit_code=code,
                plan=(meta.get("annotations") or {}).get(plan_annotation),
                message=str((failure or {}).get("message") or term.get("message") or "")[:500],
                profile=(failure or {}).get("profile"),
            )
    return None


def spec_key(spec: Any) -> str:
    """A digest of the spec without `replicas`: an autoscaler writes replicas (the scale subresource), and a
    re-fit holds for every replica count, so only another change to the spec starts over."""
    body = {k: v for k, v in (spec or {}).items() if k != "replicas"} if isinstance(spec, dict) else spec
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def current(status: dict[str, Any] | None, generation: int | None, spec: Any = None) -> dict[str, Any]:
    """status.refit if it belongs to this spec (all but replicas; this generation where no spec is given or
    recorded); {} once the spec has changed."""
    refit = (status or {}).get("refit") or {}
    if spec is not None and refit.get("specKey"):
        return refit if refit["specKey"] == spec_key(spec) else {}
    return refit if refit.get("generation") == generation else {}


def _round_down(tokens: int, block: int) -> int:
    return tokens // block * block


def _length_floor(spec: Any, p: Plan) -> int:
    w = spec.workload
    if w.target_context:
        floor = w.target_context
    elif w.p99_prompt_tokens or w.p99_output_tokens:
        floor = (w.p99_prompt_tokens or 0) + (w.p99_output_tokens or 0)
    else:
        floor = MIN_MODEL_LEN
    return min(floor, p.max_model_len)


def _capacity_after(p: Plan, freed: int) -> int:
    """Tokens the KV cache holds (with the planner's slack) once `freed` bytes of it are given back."""
    block_bytes = p.kv_cache_bytes // max(p.num_gpu_blocks, 1)
    blocks = max(p.kv_cache_bytes - freed, 0) // max(block_bytes, 1)
    return int(blocks * FIT_SLACK) * p.block_size


def _budget_step(spec: Any, p: Plan, gpu_memory_bytes: int | None, floor: int) -> tuple[dict, str] | None:
    """Step 1: a smaller memory budget (GPU utilization, or the KV cache on CPU), and the context it holds."""
    e, conc = spec.engine, spec.workload.min_concurrency or 1
    if p.device == "cuda" and e.gpu_memory_utilization is None and gpu_memory_bytes:
        util = round(p.gpu_memory_utilization - UTILIZATION_STEP, 2)
        if util < UTILIZATION_FLOOR:
            return None
        freed = int(UTILIZATION_STEP * gpu_memory_bytes)
        settings: dict[str, Any] = {"gpu_memory_utilization": util}
        change = f"{flag_word('gpu_memory_utilization')} {p.gpu_memory_utilization:.2f} -> {util:.2f}"
    elif p.device == "cpu" and p.kv_cache_memory_bytes:
        kv = int(p.kv_cache_memory_bytes * KV_CACHE_FACTOR) >> 20 << 20
        freed = p.kv_cache_memory_bytes - kv
        settings = {"kv_cache_memory_bytes": kv}
        change = f"{flag_word('kv_cache_memory_bytes')} {p.kv_cache_memory_bytes} -> {kv}"
    else:
        return None
    length = min(p.max_model_len, _round_down(_capacity_after(p, freed) // conc, p.block_size))
    if length < p.max_model_len:
        if e.max_model_len is not None or length < floor:
            return None  # the smaller budget would not hold the context the spec asks for
        settings["max_model_len"] = length
        change += (
            f", {flag_word('max_model_len')} {p.max_model_len} -> {length} (what the smaller cache holds)"
        )
    return settings, change


def next_settings(
    spec: Any, p: Plan, gpu_memory_bytes: int | None, failure: Failure, settings: dict[str, Any]
) -> tuple[dict[str, Any], str] | None:
    """The re-fit settings after `failure` of a pod running plan `p`, and the change in words; None when no
    setting has room left within the spec's bounds."""
    e, conc = spec.engine, spec.workload.min_concurrency or 1
    new = settings_of(settings)
    floor = _length_floor(spec, p)
    changes: list[str] = []
    if failure.reason == OOM_KILLED and p.device == "cuda" and p.kv_offload_host_bytes >= 2 << 30:
        host = p.kv_offload_host_bytes // 2 >> 30 << 30
        new["kv_offload_host_bytes"] = host
        changes.append(
            f"host KV tier {p.kv_offload_host_bytes >> 30}Gi -> {host >> 30}Gi (the pod's RAM ran out)"
        )
    step = _budget_step(spec, p, gpu_memory_bytes, floor) if failure.reason != REASON_KV_TOO_SMALL else None
    if step is None and e.max_model_len is None and p.max_model_len > floor:
        length = _round_down(int(p.max_model_len * LENGTH_FACTOR), p.block_size)
        measured = _FITS.search(failure.message) if failure.reason == REASON_KV_TOO_SMALL else None
        if measured:  # the engine said what fits in what it measured: take it, with the planner's slack
            length = min(length, _round_down(int(int(measured.group(1)) * FIT_SLACK), p.block_size))
        length = max(length, floor)
        if length < p.max_model_len:
            step = {"max_model_len": length}, f"{flag_word('max_model_len')} {p.max_model_len} -> {length}"
    if step is None and e.max_num_seqs is None and p.max_num_seqs > conc:
        seqs = max(conc, p.max_num_seqs // 2)
        step = {"max_num_seqs": seqs}, f"{flag_word('max_num_seqs')} {p.max_num_seqs} -> {seqs}"
    if step is not None:
        new.update(step[0])
        changes.insert(0, step[1])
    return (new, "; ".join(changes)) if changes else None


def apply(p: Plan, settings: dict[str, Any], gpu_memory_bytes: int | None, why: str) -> Plan:
    """`p` with the re-fit settings applied (and the KV figures they imply), each reason saying so."""
    settings = settings_of(settings)
    if not settings:
        return p
    reasons = dict(p.reasons)
    changes: dict[str, Any] = {}
    block_bytes = p.kv_cache_bytes // max(p.num_gpu_blocks, 1)
    util = settings.get("gpu_memory_utilization")
    if util is not None and p.gpu_memory_utilization is not None and gpu_memory_bytes:
        freed = max(int((p.gpu_memory_utilization - util) * gpu_memory_bytes), 0)
        blocks = max(p.kv_cache_bytes - freed, 0) // max(block_bytes, 1)
        changes.update(
            gpu_memory_utilization=util, num_gpu_blocks=blocks, kv_cache_bytes=blocks * block_bytes
        )
        reasons["gpu_memory_utilization"] = f"{why}: lowered from {p.gpu_memory_utilization:.2f}"
    kv = settings.get("kv_cache_memory_bytes")
    if kv is not None and p.kv_cache_memory_bytes is not None:
        blocks = kv // max(block_bytes, 1)
        changes.update(kv_cache_memory_bytes=kv, num_gpu_blocks=blocks, kv_cache_bytes=blocks * block_bytes)
        reasons["kv_cache_memory_bytes"] = f"{why}: lowered from {p.kv_cache_memory_bytes}"
    measured = settings.get(MEASURED_KV_CACHE_BYTES)  # an image upgrade's measured profile (profile.py)
    if measured is not None:
        blocks = measured // max(block_bytes, 1)
        changes.update(num_gpu_blocks=blocks, kv_cache_bytes=blocks * block_bytes)
        reasons["kv_cache_bytes"] = f"{why}: measured by the engine, planned {p.kv_cache_bytes}"
    if settings.get(MEASURED_WEIGHTS_BYTES) is not None:
        changes["weights_bytes_per_gpu"] = settings[MEASURED_WEIGHTS_BYTES]
    for name in ("max_model_len", "max_num_seqs", "kv_offload_host_bytes"):
        if settings.get(name) is not None and settings[name] < getattr(p, name):
            changes[name] = settings[name]
            reasons[name] = f"{why}: lowered from {getattr(p, name)}"
    return dataclasses.replace(p, **changes, reasons=reasons)


def now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def record(
    refit: dict[str, Any],
    generation: int | None,
    failure: Failure,
    change: tuple[dict[str, Any], str] | None,
    spec: Any = None,
) -> dict[str, Any]:
    """The new status.refit after `failure`: the next settings, or exhausted."""
    attempts = int(refit.get("attempts") or 0) + 1
    entry = {
        "attempt": attempts,
        "at": now(),
        "pod": failure.pod,
        "reason": failure.reason,
        "exitCode": failure.exit_code,
        "key": failure.key,
    }
    out: dict[str, Any] = {
        "generation": generation,
        "attempts": attempts,
        "settings": settings_of(refit.get("settings")),
        "lastFailure": {**entry, "message": failure.message, "profile": failure.profile},
        "history": list(refit.get("history") or []),
        "exhausted": change is None,
    }
    if spec is not None:
        out["specKey"] = spec_key(spec)
    if change is not None:
        out["settings"], entry["change"] = change
    out["history"] = (out["history"] + [entry])[-HISTORY:]
    return out


def handled(refit: dict[str, Any], failure: Failure) -> bool:
    return any(h.get("key") == failure.key for h in refit.get("history") or [])


def exhausted_message(refit: dict[str, Any], why: str) -> str:
    changes = "; ".join(h["change"] for h in refit.get("history") or [] if h.get("change")) or "none"
    return (
        f"the engine ran out of memory {refit['attempts']} time(s) in a row ({why}); re-fits tried: {changes}. "
        "Nothing more is changed until the spec does: give the pods more memory (resources.limits.memory, a "
        "larger GPU) or set lower engine.maxModelLen / engine.maxNumSeqs / engine.gpuMemoryUtilization"
    )


def too_many(refit: dict[str, Any]) -> bool:
    """Whether the next failure is the last one allowed (MAX_ATTEMPTS starts in a row failed)."""
    return int(refit.get("attempts") or 0) + 1 >= MAX_ATTEMPTS
