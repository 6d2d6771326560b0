"""Download progress: a progress bar for people (`kubectl logs`) and JSON lines for the operator."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from pagoda.operator.download.result import PROGRESS_KEY
from tqdm import tqdm


def progress_line(done: int, total: int, files: int, total_files: int) -> str:
    body = {"bytes": done, "totalBytes": total, "files": files, "totalFiles": total_files}
    return json.dumps({PROGRESS_KEY: body}, separators=(",", ":"))


def parse_progress(log: str) -> dict[str, int] | None:
    """The last progress line in a log's tail (what the operator shows in status.model), or None."""
    for line in reversed(log.splitlines()):
        start = line.find('{"' + PROGRESS_KEY)
        if start >= 0:
            try:
                return json.loads(line[start:])[PROGRESS_KEY]
            except ValueError:
                continue
    return None


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files under `root` (partial downloads included), symlinks not followed."""
    total = 0
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
        except OSError:
            continue
    return total


class Reporter:
    """Samples the bytes on disk every `interval` seconds while a download runs (whatever client writes
    them): a tqdm bar on stderr and a JSON progress line on stdout each time."""

    def __init__(
        self, measure: Callable[[], tuple[int, int]], total: int, total_files: int, interval: float = 5.0
    ):
        self.measure = measure
        self.total, self.total_files = total, total_files
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="download-progress")
        self._bar = tqdm(total=total, unit="B", unit_scale=True, desc="model", file=sys.stderr, mininterval=1)

    def report(self) -> None:
        done, files = self.measure()
        done = min(done, self.total) if self.total else done
        self._bar.update(done - self._bar.n)
        print(progress_line(done, self.total, files, self.total_files), flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.report()

    def __enter__(self) -> Reporter:
        self.report()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.report()
        self._bar.close()
