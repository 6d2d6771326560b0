"""Where a download may write: every name that comes from a source (an S3 object key, a bucket, a prefix, a
hub repo, revision or file path) is checked here before anything is written, so that no name can place a
file outside the model cache directory it belongs to (an absolute path, `..`, an empty or `.` part).
A name that fails is refused: the download fails with the name and the reason, and writes nothing."""

from __future__ import annotations

import os
from pathlib import Path

from pagoda.operator.download.result import FAILED, DownloadError


def bad_part(relative: str) -> str | None:
    """Why `relative` (a '/'-separated path) cannot be placed under a directory, or None when it can."""
    if not relative:
        return "it is empty"
    if "\0" in relative:
        return "it holds a NUL byte"
    if relative.startswith("/"):
        return "it is an absolute path"
    for part in relative.split("/"):
        if part == "":
            return "it has an empty path part (//)"
        if part in (".", ".."):
            return f"it has a {part!r} path part"
    return None


def under(root: Path, relative: str, what: str) -> Path:
    """`root / relative`, refused (DownloadError naming `what`) unless it stays under `root`."""
    why = bad_part(relative)
    target = root / relative if why is None else root
    if why is None:
        # Lexically under root too (belt and braces: bad_part already rules out every way out).
        base, full = os.path.normpath(root), os.path.normpath(target)
        if os.path.commonpath([base, full]) != base or full == base:
            why = "it does not name a file under the download's directory"
    if why is not None:
        raise DownloadError(
            FAILED, f"{what} is refused: {why}, so it would not be written under {root} (nothing was written)"
        )
    return target
