"""What a download ends with: a reason the operator turns into a condition, written to the termination log."""

from __future__ import annotations

import errno
import json
import os
from dataclasses import asdict, dataclass

FORMAT = "pagoda.dev/model-download/v1"
PROGRESS_KEY = "pagoda.dev/progress"
# Reasons (the InferenceDeployment's condition reasons, and the exit code of the download)
READY = "ModelReady"
ACCESS_DENIED = "ModelAccessDenied"  # a missing or refused token / keys, a gated repo
NOT_FOUND = "ModelNotFound"  # no such repo, revision, bucket or prefix
VOLUME_FULL = "ModelVolumeFull"  # the cache volume ran out of space
FAILED = "ModelDownloadFailed"  # anything else (network, a file that fails its check)
EXIT_CODES = {READY: 0, FAILED: 1, ACCESS_DENIED: 4, NOT_FOUND: 5, VOLUME_FULL: 6}
SECRET_ENV = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ACCESS_KEY_ID",
)


class DownloadError(Exception):
    """A download that cannot finish; `reason` is one of the reasons above."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Result:
    reason: str
    message: str
    bytes: int = 0
    files: int = 0
    path: str = ""  # where the engine finds the model (a directory, or the HF cache's snapshot)
    format: str = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def redact(text: str) -> str:
    """`text` without the value of any credential in the environment (a library could echo one)."""
    for name in SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


def volume_full(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False
