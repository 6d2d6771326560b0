"""SHA-256 of weight files, paid for at most once per file version.

The model fingerprint keys disk-tier KV blocks, and that volume outlives rollouts: it must change when the
weights do, even when their shapes do not. Hashing gigabytes at every start would be slow, so:

- a file in the Hugging Face cache is a link to ``blobs/<sha256>`` (LFS files, which weights always are):
  the name is the hash, nothing is read;
- any other file is hashed once and the result kept in a small record next to it
  (``.<name>.pagoda-sha256``), or in ``$PAGODA_CACHE/content-hashes/`` when its directory cannot be written
  (a read-only volume), keyed by the file's size and mtime: a rewritten file is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from pathlib import Path

RECORD_VERSION = 1
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def hf_blob_sha256(path: Path) -> str | None:
    """The content hash a Hugging Face cache link carries in its target's name, if it is one."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    if target.parent.name == "blobs" and _SHA256.match(target.name) and target.is_file():
        return target.name
    return None


def record_paths(path: Path) -> tuple[Path, Path]:
    """Where a file's hash record may live: next to it, else in the Pagoda cache (by its real path)."""
    from pagoda.engine import envs

    real = path.resolve()
    beside = path.with_name(f".{path.name}.pagoda-sha256")
    key = hashlib.sha256(str(real).encode()).hexdigest()[:32]
    return beside, envs.cache_root() / "content-hashes" / f"{key}.json"


def _stamp(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"version": RECORD_VERSION, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _load(record: Path, stamp: dict[str, int]) -> str | None:
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or any(data.get(k) != v for k, v in stamp.items()):
        return None
    digest = data.get("sha256")
    return digest if isinstance(digest, str) and _SHA256.match(digest) else None


def _store(record: Path, data: dict[str, object]) -> bool:
    tmp = record.with_name(f"{record.name}.{secrets.token_hex(6)}.tmp")
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with open(fd, "w", closefd=True) as f:
            json.dump(data, f)
        os.replace(tmp, record)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 (hex) of a file's content, from the hub cache's blob name, a valid record, or a read."""
    path = Path(path)
    blob = hf_blob_sha256(path)
    if blob is not None:
        return blob
    stamp = _stamp(path)
    places = record_paths(path)
    for record in places:
        cached = _load(record, stamp)
        if cached is not None:
            return cached
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if _stamp(path) == stamp:  # unchanged while we read it: worth remembering
        for record in places:
            if _store(record, {**stamp, "sha256": digest}):
                break
    return digest
