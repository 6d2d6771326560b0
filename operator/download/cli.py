"""`pagoda-model-download --source SRC [--adapter SRC ...] --dest DIR`: what the operator's download Job (or
init container) runs: the model's weights, then each LoRA adapter's (hf:// with an inline @revision, s3://).

Writes one JSON line (result.Result) to --termination-log, which the operator reads from the finished pod,
and exits with the reason's code (result.EXIT_CODES): the first source that fails decides it."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import traceback
from pathlib import Path

from pagoda.operator.download.result import (
    EXIT_CODES,
    FAILED,
    READY,
    VOLUME_FULL,
    DownloadError,
    Result,
    redact,
    volume_full,
)

MARKERS = ".pagoda-downloads"


def marker(dest: Path, source: str, revision: str | None) -> Path:
    key = hashlib.sha256(f"{source}@{revision or ''}".encode()).hexdigest()[:16]
    return dest / MARKERS / f"{key}.json"


def fetch(source: str, revision: str | None, dest: Path, interval: float) -> Result:
    """Download `source` into the cache at `dest` (once: a complete download leaves a marker)."""
    done = marker(dest, source, revision)
    if done.is_file():
        result = Result(**json.loads(done.read_text()))
        result.message = f"already downloaded: {result.message}"
        return result
    scheme, _, rest = source.partition("://")
    if scheme == "hf":
        from pagoda.operator.download import hf

        repo, _, at = rest.partition("@")
        rev = revision or at or "main"
        path, size, files = hf.download(repo, rev, dest / "hf", interval)
        message = f"hf://{repo}@{rev}: {files} files, {size} bytes, sizes and SHA-256 checked"
    elif scheme == "s3":
        from pagoda.operator.download import s3

        bucket, _, prefix = rest.partition("/")
        path, size, files = s3.download(bucket, prefix, dest / "s3", interval)
        message = f"{source}: {files} objects, {size} bytes, sizes and MD5 checked"
    else:
        raise DownloadError(FAILED, f"{source!r} is not downloaded (only hf:// and s3:// sources are)")
    result = Result(READY, message, size, files, str(path))
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(result.to_json())
    return result


def fetch_all(
    source: str | None, revision: str | None, adapters: list[str], dest: Path, interval: float
) -> Result:
    """The model (if given), then every adapter; one Result adding up their bytes and files."""
    results = [fetch(source, revision, dest, interval)] if source else []
    results += [fetch(adapter, None, dest, interval) for adapter in adapters]
    if len(results) == 1:
        return results[0]
    return Result(
        READY,
        "; ".join(r.message for r in results),
        sum(r.bytes for r in results),
        sum(r.files for r in results),
        results[0].path,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda-model-download", description=__doc__)
    parser.add_argument("--source", help="the model: hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX")
    parser.add_argument(
        "--adapter", action="append", default=[], help="a LoRA adapter's source (as --source; repeatable)"
    )
    parser.add_argument("--revision", default=None, help="of an hf:// source (default: main)")
    parser.add_argument("--dest", required=True, type=Path, help="the model cache volume's mount")
    parser.add_argument("--termination-log", type=Path, default=Path("/dev/termination-log"))
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between progress lines")
    args = parser.parse_args(argv)
    if not args.source and not args.adapter:
        parser.error("give --source, --adapter or both")
    try:
        result = fetch_all(args.source, args.revision, args.adapter, args.dest, args.interval)
    except DownloadError as exc:
        result = Result(exc.reason, str(exc))
    except Exception as exc:  # noqa: BLE001 - every failure becomes a reason the operator can show
        if volume_full(exc):
            result = Result(VOLUME_FULL, f"the model cache volume is full ({exc.__class__.__name__}): give "
                                         "spec.model.cache.size more room")  # fmt: skip
        else:
            print(redact(traceback.format_exc()), file=sys.stderr)
            result = Result(FAILED, f"{type(exc).__name__}: {exc}")
    result.message = redact(result.message)
    print(redact(result.to_json()), flush=True)
    try:
        args.termination_log.write_text(result.to_json() + "\n")
    except OSError as exc:
        print(f"could not write {args.termination_log}: {exc}", file=sys.stderr)
    return EXIT_CODES[result.reason]


if __name__ == "__main__":
    raise SystemExit(main())
