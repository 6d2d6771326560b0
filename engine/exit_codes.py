"""`pagoda serve`'s exit codes and the termination message it leaves when start-up runs out of memory.

A supervisor acts on these without parsing logs: the operator re-plans an InferenceDeployment whose engine
exits with EXIT_OUT_OF_MEMORY (or is OOMKilled), reading the measured memory from the termination message
that Kubernetes copies into the pod's status (`terminationMessagePath`, 4096 bytes at most). Every code
means one thing; EXIT_CODES below is the table (docs/serving.md's is generated from it, `exit_codes_table`).

Torch-free: the operator imports it.
"""

from __future__ import annotations

import json
from typing import Any

from pagoda.engine import envs

EXIT_OK = 0
EXIT_START_FAILED = 1
EXIT_USAGE = 2
EXIT_OUT_OF_MEMORY = 3
EXIT_ENGINE_DIED = 4
EXIT_PORT_IN_USE = 5

# (code, name, meaning): the one table of what `pagoda serve` exits with.
EXIT_CODES: tuple[tuple[int, str, str], ...] = (
    (EXIT_OK, "EXIT_OK", "served and drained (SIGTERM), or --help, or a passing --dry-run"),
    (
        EXIT_START_FAILED,
        "EXIT_START_FAILED",
        "could not start for another reason (model not found, bad weights, ...)",
    ),
    (EXIT_USAGE, "EXIT_USAGE", "bad flags or configuration (the dry run's refusals too)"),
    (
        EXIT_OUT_OF_MEMORY,
        "EXIT_OUT_OF_MEMORY",
        "out of memory at start-up: CUDA ran out while loading, profiling or allocating the KV cache, or the "
        "configured max_model_len does not fit the memory measured (the termination message says what fits); "
        "the operator re-fits the plan",
    ),
    (
        EXIT_ENGINE_DIED,
        "EXIT_ENGINE_DIED",
        "the engine core stopped while serving (its process died, a tensor-parallel rank died, or its steps "
        "kept failing): in-flight requests got an error, and a restart is the remedy",
    ),
    (
        EXIT_PORT_IN_USE,
        "EXIT_PORT_IN_USE",
        "the HTTP address (--host/--port) could not be bound; checked before the model loads, so nothing "
        "was loaded; the operator leaves the plan alone",
    ),
)


def exit_codes_table() -> str:
    """EXIT_CODES as the Markdown table docs/serving.md carries (a test checks they match)."""
    rows = ["| code | name | meaning |", "|---:|---|---|"]
    rows += [f"| {code} | `{name}` | {meaning} |" for code, name, meaning in EXIT_CODES]
    return "\n".join(rows) + "\n"


MESSAGE_LIMIT = 4096  # what the kubelet keeps of a termination message
FORMAT = "pagoda.dev/startup-failure/v1"

REASON_CUDA_OOM = "CUDAOutOfMemory"
REASON_KV_TOO_SMALL = "KVCacheTooSmall"


def termination_message(reason: str, message: str, profile: dict[str, Any] | None) -> str:
    """One JSON line under the kubelet's size limit: the reason, the error and the memory figures."""
    body: dict[str, Any] = {
        "format": FORMAT,
        "exitCode": EXIT_OUT_OF_MEMORY,
        "reason": reason,
        "profile": profile,
        "message": message,
    }
    text = json.dumps(body, separators=(",", ":"))
    if len(text.encode()) > MESSAGE_LIMIT:
        over = len(text.encode()) - MESSAGE_LIMIT + 3
        body["message"] = message[: max(len(message) - over, 0)] + "..."
        text = json.dumps(body, separators=(",", ":"))
    return text


def write_termination_message(text: str) -> str | None:
    """Write `text` where the pod's termination message is read from; the path, or None where there is
    none to write (outside Kubernetes /dev/termination-log does not exist)."""
    path = envs.termination_log()
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError:
        return None
    return path


def parse_termination_message(text: str | None) -> dict[str, Any] | None:
    """The start-up failure a termination message describes, or None if it is not one of ours."""
    if not text:
        return None
    try:
        body = json.loads(text)
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        return None
    return body
