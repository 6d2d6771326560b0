"""Re-plan on an engine image upgrade from the memory the new image measured (issue 13, re-fit).

The plan's KV cache and weights figures are estimates made for one engine image. A new image can load the
same model into more (or less) memory: its KV cache is then smaller than planned and the context or the
concurrency the plan promised no longer fits, though every pod starts. So when the image changes, the first
Ready pod of the new image and the current plan is asked what it measured (`GET /pagoda/memory`, through the
API server's pod proxy), and a KV cache or weights more than TOLERANCE away from the plan's figures makes a
new plan from the measured figures, recorded in status.refit as one more attempt of the same bound
(refit.MAX_ATTEMPTS). Within the tolerance, status.planImage simply moves to the new image.
"""

from __future__ import annotations

from typing import Any

from pagoda.engine.sizing import Plan
from pagoda.engine.sizing.planner import FIT_SLACK
from pagoda.operator import refit as refitting

TOLERANCE = 0.10  # a measured figure this far (relative) from the plan's is a different memory profile
REASON = "MemoryProfileChanged"
MEMORY_PATH = "/pagoda/memory"  # the engine's route (pagoda.engine.server.memory_status.ROUTE)


def measured_kv(profile: dict[str, Any]) -> int | None:
    value = profile.get("kv_allocated_bytes") or profile.get("kv_cache_bytes")
    return int(value) if isinstance(value, int | float) and value > 0 else None


def differences(p: Plan, profile: dict[str, Any], tolerance: float = TOLERANCE) -> list[str]:
    """What the engine measured that is beyond `tolerance` of the plan's figures, in words (empty: none)."""
    out = []
    pairs = (
        ("KV cache", measured_kv(profile), p.kv_cache_bytes),
        ("weights", profile.get("weights_bytes"), p.weights_bytes_per_gpu),
    )
    for what, measured, planned in pairs:
        if not isinstance(measured, int | float) or not planned:
            continue
        if abs(measured - planned) > tolerance * planned:
            out.append(
                f"{what} {measured / 2**30:.2f} GiB measured, {planned / 2**30:.2f} GiB planned "
                f"({(measured - planned) / planned:+.0%})"
            )
    return out


def next_settings(
    spec: Any, p: Plan, profile: dict[str, Any], settings: dict[str, Any]
) -> tuple[dict[str, Any], str]:
    """Re-fit settings from the measured profile: the measured KV cache and weights replace the plan's,
    and a context the measured cache cannot hold for workload.minConcurrency sequences is shortened (within
    the spec's bounds, as refit.py does)."""
    new = refitting.settings_of(settings)
    changes = []
    kv = measured_kv(profile)
    if kv is not None:
        new[refitting.MEASURED_KV_CACHE_BYTES] = kv
        changes.append(f"KV cache {p.kv_cache_bytes} -> {kv} bytes (measured)")
    weights = profile.get("weights_bytes")
    if isinstance(weights, int) and weights > 0:
        new[refitting.MEASURED_WEIGHTS_BYTES] = weights
    if kv is not None and spec.engine.max_model_len is None:
        block_bytes = p.kv_cache_bytes // max(p.num_gpu_blocks, 1)
        tokens = int(kv // max(block_bytes, 1) * FIT_SLACK) * p.block_size
        conc = spec.workload.min_concurrency or 1
        length = refitting._round_down(tokens // conc, p.block_size)
        floor = refitting._length_floor(spec, p)
        length = max(length, floor)
        if length < p.max_model_len:
            new["max_model_len"] = length
            changes.append(
                f"{refitting.flag_word('max_model_len')} {p.max_model_len} -> {length} (what the measured cache holds)"
            )
    return new, "; ".join(changes) or "measured figures recorded"
