"""hf:// sources: a Hugging Face repo at a revision into a Hugging Face cache (HF_HOME/hub), as the engine
reads it offline (`pagoda serve ORG/NAME --revision R` with HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from pagoda.operator.download.paths import bad_part
from pagoda.operator.download.progress import Reporter, tree_bytes
from pagoda.operator.download.result import ACCESS_DENIED, FAILED, NOT_FOUND, DownloadError, volume_full

# Never fetched: the engine never unpickles weights, and other frameworks' copies only cost space.
IGNORED = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.h5", "*.msgpack", "*.ot", "*.onnx", "*.tflite"]
CHUNK = 8 << 20


def _classify(exc: Exception, repo: str, revision: str) -> DownloadError:
    """A huggingface_hub error as a reason the operator shows (the token itself is never in a message)."""
    from huggingface_hub import errors

    token = bool(os.environ.get("HF_TOKEN"))
    secret = "the token (HF_TOKEN of spec.model.secretRef)"
    if isinstance(exc, errors.GatedRepoError):
        why = (
            f"{secret} has no access to it"
            if token
            else "no token was given (spec.model.secretRef, key HF_TOKEN)"
        )
        return DownloadError(ACCESS_DENIED, f"hf://{repo} is gated and {why}: accept its terms on the hub with the "
                                            "token's account, or use a token that has")  # fmt: skip
    if isinstance(exc, errors.RevisionNotFoundError):
        return DownloadError(NOT_FOUND, f"hf://{repo} has no revision {revision!r}")
    if isinstance(exc, errors.RepositoryNotFoundError):
        hint = "" if token else " (a private repo needs a token: spec.model.secretRef, key HF_TOKEN)"
        return DownloadError(NOT_FOUND, f"hf://{repo} does not exist{hint}")
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status in (401, 403):
        return DownloadError(ACCESS_DENIED, f"the hub refused {secret} (HTTP {status}) for hf://{repo}")
    return DownloadError(FAILED, f"hf://{repo}@{revision}: {type(exc).__name__}: {exc}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(api: Any, repo: str, commit: str) -> list[Any]:
    from fnmatch import fnmatch

    from huggingface_hub.hf_api import RepoFile

    entries = [
        f for f in api.list_repo_tree(repo, recursive=True, revision=commit) if isinstance(f, RepoFile)
    ]
    return [f for f in entries if not any(fnmatch(f.path, p) for p in IGNORED)]


def verify(snapshot: Path, files: list[Any]) -> None:
    """Every file is there with its size; LFS files (the weights) also with their SHA-256. A file that fails
    is removed (the next run fetches it again) and the download fails naming it."""
    for f in files:
        path = snapshot / f.path
        size = f.lfs.size if f.lfs is not None else f.size
        problem = None
        if not path.is_file():
            problem = "is missing"
        elif path.stat().st_size != size:
            problem = f"has {path.stat().st_size} bytes, the hub says {size}"
        elif f.lfs is not None and _sha256(path) != f.lfs.sha256:
            problem = "does not match its SHA-256"
        if problem:
            target = path.resolve()
            path.unlink(missing_ok=True)
            if target != path:
                target.unlink(missing_ok=True)
            raise DownloadError(
                FAILED, f"{f.path} {problem}; it was removed and is fetched again on the next try"
            )


def _check_names(repo: str, revision: str) -> None:
    """The repo (`org/name`) and revision become paths in the cache (models--org--name, refs/REVISION):
    refused before anything is written when they could lead out of it."""
    org, _, name = repo.partition("/")
    if not org or not name or "/" in name or bad_part(org) or bad_part(name):
        raise DownloadError(
            FAILED, f"hf://{repo}: the repo is refused: it must be org/name (nothing was written)"
        )
    if why := bad_part(revision):
        raise DownloadError(
            FAILED, f"hf://{repo}@{revision}: the revision is refused: {why} (nothing was written)"
        )


def download(repo: str, revision: str, home: Path, interval: float = 5.0) -> tuple[Path, int, int]:
    """Fetch `repo` at `revision` into the cache under `home` (HF_HOME); returns (snapshot, bytes, files)."""
    from huggingface_hub import HfApi, snapshot_download

    _check_names(repo, revision)
    hub = home / "hub"
    hub.mkdir(parents=True, exist_ok=True)
    api = HfApi()  # HF_ENDPOINT and HF_TOKEN from the environment
    try:
        commit = api.repo_info(repo, revision=revision).sha
        files = _files(api, repo, commit)
        for f in files:  # the hub's file names become paths under the snapshot: none may lead out of it
            if why := bad_part(f.path):
                raise DownloadError(FAILED, f"hf://{repo}@{revision}: the file name {f.path!r} is refused: "
                                            f"{why}, so it would not be written under the cache (nothing was "
                                            "written)")  # fmt: skip
        total = sum(f.lfs.size if f.lfs is not None else f.size for f in files)
        blobs = hub / f"models--{repo.replace('/', '--')}" / "blobs"

        def measure() -> tuple[int, int]:
            if not blobs.is_dir():
                return 0, 0
            return tree_bytes(blobs), sum(1 for p in blobs.iterdir() if not p.name.endswith(".incomplete"))

        with Reporter(measure, total, len(files), interval):
            snapshot = Path(
                snapshot_download(repo, revision=revision, cache_dir=hub, ignore_patterns=IGNORED)
            )
    except DownloadError:
        raise
    except Exception as exc:
        if volume_full(exc):
            raise  # the caller says so
        raise _classify(exc, repo, revision) from exc
    verify(snapshot, files)
    return snapshot, total, len(files)
