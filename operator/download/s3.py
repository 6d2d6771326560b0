"""s3:// sources: every object under a prefix into a directory, with boto3 (AWS or any S3-compatible store:
AWS_ENDPOINT_URL). Each object is fetched into `NAME.partial` and resumed from its length with a ranged GET,
then checked (size; MD5 for single-part objects, whose ETag is their MD5) and renamed into place."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from pagoda.operator.download.paths import bad_part, under
from pagoda.operator.download.progress import Reporter, tree_bytes
from pagoda.operator.download.result import ACCESS_DENIED, FAILED, NOT_FOUND, DownloadError, volume_full

PARTIAL = ".partial"
CHUNK = 8 << 20
DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "403",
    "401",
}
MISSING = {"NoSuchBucket", "NoSuchKey", "404"}
BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3's bucket names (as the CRD's s3:// pattern)


def _classify(exc: Exception, where: str) -> DownloadError:
    code = (
        str(getattr(exc, "response", {}).get("Error", {}).get("Code", "")) if hasattr(exc, "response") else ""
    )
    name = type(exc).__name__
    if code in DENIED or name in ("NoCredentialsError", "PartialCredentialsError"):
        return DownloadError(ACCESS_DENIED, f"{where}: the store refused the keys of spec.model.secretRef "
                                            f"(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY): {code or name}")  # fmt: skip
    if code in MISSING:
        return DownloadError(NOT_FOUND, f"{where} does not exist ({code})")
    return DownloadError(FAILED, f"{where}: {name}: {exc}")


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fetch(client: Any, bucket: str, obj: dict[str, Any], target: Path) -> None:
    """One object into `target`, resuming a partial file; raises DownloadError if it fails its check."""
    size, etag = int(obj["Size"]), obj.get("ETag", "").strip('"')
    if target.is_file() and target.stat().st_size == size:
        return  # fetched and checked by an earlier run
    partial = target.with_name(target.name + PARTIAL)
    target.parent.mkdir(parents=True, exist_ok=True)
    have = partial.stat().st_size if partial.is_file() else 0
    if have > size:
        partial.unlink()
        have = 0
    if have < size:
        extra = {"Range": f"bytes={have}-"} if have else {}
        body = client.get_object(Bucket=bucket, Key=obj["Key"], **extra)["Body"]
        with open(partial, "ab") as out:
            for chunk in body.iter_chunks(CHUNK):
                out.write(chunk)
    got = partial.stat().st_size if partial.is_file() else 0
    problem = None
    if got != size:
        problem = f"has {got} bytes, the store says {size}"
    elif etag and "-" not in etag and len(etag) == 32 and _md5(partial) != etag:
        problem = "does not match its MD5 (ETag)"
    if problem:
        partial.unlink(missing_ok=True)
        raise DownloadError(
            FAILED, f"s3://{bucket}/{obj['Key']} {problem}; it is fetched again on the next try"
        )
    partial.rename(target)


def download(bucket: str, prefix: str, dest: Path, interval: float = 5.0) -> tuple[Path, int, int]:
    """Every object under s3://bucket/prefix into dest/bucket/prefix; returns (directory, bytes, files)."""
    import boto3

    where = f"s3://{bucket}/{prefix}"
    if not BUCKET.fullmatch(bucket):
        raise DownloadError(FAILED, f"{where}: {bucket!r} is not an S3 bucket name")
    if prefix.strip("/") and (why := bad_part(prefix.strip("/"))):
        raise DownloadError(FAILED, f"{where}: the prefix is refused: {why} (nothing was written)")
    root = dest / bucket / prefix.strip("/")
    base = prefix.strip("/") + "/" if prefix.strip("/") else ""
    try:
        client = boto3.client("s3")  # keys, region and AWS_ENDPOINT_URL from the environment
        objects = [
            o
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base)
            for o in page.get("Contents", [])
            if not o["Key"].endswith("/")
        ]
        if not objects:
            raise DownloadError(NOT_FOUND, f"{where} holds no objects")
        # Every key is placed under root before anything is fetched: one that would land outside (an
        # absolute or `..` path, an empty part) fails the whole download and nothing is written.
        targets = [
            under(root, o["Key"][len(base) :], f"object key s3://{bucket}/{o['Key']}") for o in objects
        ]
        total = sum(int(o["Size"]) for o in objects)

        def measure() -> tuple[int, int]:
            if not root.is_dir():
                return 0, 0
            done = sum(1 for p in root.rglob("*") if p.is_file() and not p.name.endswith(PARTIAL))
            return tree_bytes(root), done

        with Reporter(measure, total, len(objects), interval):
            for obj, target in zip(objects, targets, strict=True):
                _fetch(client, bucket, obj, target)
    except DownloadError:
        raise
    except Exception as exc:
        if volume_full(exc):
            raise
        raise _classify(exc, where) from exc
    return root, total, len(objects)
