"""Steps in processes of their own, each under a time budget, so one that fails or hangs hides no other.

A step is a module of this package with `run(ctx) -> dict`; the parent starts it as
`python3 main.py --step NAME --work DIR` in a new session, waits at most its timeout, then ends the whole
session (the step's own children included). The step writes its result to WORK/NAME.json; a step that
writes none (killed, crashed) is recorded as an error with the end of its output.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MAIN = Path(__file__).resolve().parent / "main.py"


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: float  # what the step may take when every step before it used its whole budget
    what: str


def run_steps(
    steps: list[Step], work: Path, env: dict[str, str], total_s: float, args: list[str]
) -> list[dict]:
    """Run the steps in order. A step's timeout is its budget plus whatever earlier steps left unused, so
    the whole stays within ``total_s`` and no later step loses its own budget."""
    deadline = time.monotonic() + total_s
    results = []
    for i, step in enumerate(steps):
        later = sum(s.budget_s for s in steps[i + 1 :])
        remaining = deadline - time.monotonic()
        timeout = max(5.0, min(remaining, max(step.budget_s, remaining - later)))
        print(f"== {step.name} ({step.what}; up to {timeout:.0f} s)", flush=True)
        result = run_one(step, work, env, timeout, args)
        results.append(result)
        print(f"   -> {result['status']} in {result['seconds']:.1f} s"
              + (f": {result['error']}" if result.get("error") else ""), flush=True)  # fmt: skip
    return results


def run_one(step: Step, work: Path, env: dict[str, str], timeout: float, args: list[str]) -> dict:
    out_file = work / f"{step.name}.json"
    log_file = work / f"{step.name}.log"
    out_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(MAIN), "--step", step.name, "--work", str(work), *args]
    start = time.monotonic()
    with open(log_file, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            end_session(proc)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever the step left running in its session
    seconds = time.monotonic() - start
    tail = log_file.read_text(errors="replace")[-2500:]
    if out_file.is_file():
        result = json.loads(out_file.read_text())
    else:
        result = {"status": "error"}
    if timed_out:
        result["status"] = "error" if result.get("status") != "fail" else "fail"
        result["error"] = f"timed out after {timeout:.0f} s" + (
            f"; {result['error']}" if result.get("error") else ""
        )
    elif proc.returncode != 0 and "error" not in result:
        result["status"] = "error"
        result["error"] = f"exit code {proc.returncode}"
    if result["status"] != "pass":
        result["log_tail"] = tail
    return {"step": step.name, "status": result.pop("status"), "seconds": round(seconds, 1), **result}


def end_session(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the step's session (it cleans up what it started), SIGKILL what is left after ``grace``."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def write_step_result(work: Path, name: str, result: dict) -> None:
    (work / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
