"""What the steps share: the work folder (model, caches, step results), the mode, and small helpers."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path

from gpu_check.model import LLAMA_8B_8L, TINY, Shape


@dataclass(frozen=True)
class Context:
    work: Path
    mode: str  # gpu | cpu (a rehearsal on the CPU) | dry

    @property
    def gpu(self) -> bool:
        return self.mode == "gpu"

    @property
    def shape(self) -> Shape:
        return LLAMA_8B_8L if self.gpu else TINY

    @property
    def model_dir(self) -> Path:
        return self.work / "model"

    @property
    def warm_cache(self) -> Path:
        return self.work / "warm-cache"

    def result_of(self, step: str) -> dict | None:
        path = self.work / f"{step}.json"
        return json.loads(path.read_text()) if path.is_file() else None


def check(ok: bool | None, detail: object = "") -> dict:
    """One named check of a step: ok True/False, or None for a figure that is reported, not judged."""
    return {"ok": ok, "detail": detail}


def verdict(checks: dict[str, dict], **data: object) -> dict:
    """A step's result: pass when no check failed."""
    failed = [name for name, c in checks.items() if c["ok"] is False]
    status = "fail" if failed else "pass"
    out = {"status": status, "checks": checks, **data}
    if failed and "error" not in out:
        out["error"] = "failed: " + ", ".join(failed)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
