"""A local HTTP server that speaks the part of the Hugging Face hub API `huggingface_hub` downloads with
(repo info, the recursive tree, `resolve` with HEAD and ranged GET), for the download tests (HF_ENDPOINT).

Like the hub: a gated repo's info and file list are public but its files need a token that was granted
access (403 with `X-Error-Code: GatedRepo` otherwise); an unknown token is 401 "Invalid credentials"; an
unknown repo or revision is 404 with `X-Error-Code: RepoNotFound` / `RevisionNotFound`. LFS files carry their
SHA-256 as ETag. `ranges` records each file GET (with its Range header); `corrupt_once` serves a file with one byte flipped."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

LFS_FROM = 1024  # files this large are LFS files (the hub's rule is by extension and size; this is enough)


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False
    revisions: dict[str, str] = field(default_factory=dict)  # name -> commit

    def __post_init__(self) -> None:
        commit = hashlib.sha1(repr(sorted(self.files)).encode()).hexdigest()
        self.revisions.setdefault("main", commit)


class FakeHub:
    def __init__(self, repos: dict[str, Repo], tokens: dict[str, set[str]]) -> None:
        """`tokens`: token -> the gated repos it was granted."""
        self.repos, self.tokens = repos, tokens
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        self.ranges: list[tuple[str, str | None]] = []  # (file, Range header) of every GET of a file
        self.corrupt_once: set[str] = set()  # "org/name/file": serve one flipped byte the next time
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.handle(self, head=True)

            def do_GET(self) -> None:
                hub.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- the API ------------------------------------------------------------------------------------------
    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, body: bytes = b"", headers: dict | None = None,
              head: bool = False) -> None:  # fmt: skip
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _error(
        self, h: BaseHTTPRequestHandler, status: int, code: str | None, message: str, head: bool
    ) -> None:
        headers = {"Content-Type": "application/json"}
        if code:
            headers["X-Error-Code"] = code
        headers["X-Error-Message"] = message
        self._send(h, status, json.dumps({"error": message}).encode(), headers, head)

    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        auth = h.headers.get("Authorization")
        self.requests.append(("HEAD" if head else "GET", path, auth))
        token = auth.split(" ", 1)[1] if auth and " " in auth else None
        if token is not None and token not in self.tokens:
            return self._error(h, 401, None, "Invalid credentials in Authorization header", head)
        m = re.match(r"^/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(/.*)?$", path)
        if m:
            repo_id, what, rev = m.group(1), m.group(2), m.group(3)
            repo = self.repos.get(repo_id)
            if repo is None:
                return self._error(h, 404, "RepoNotFound", "Repository not found", head)
            commit = repo.revisions.get(rev) or (rev if rev in repo.revisions.values() else None)
            if commit is None:
                return self._error(h, 404, "RevisionNotFound", "Invalid rev id", head)
            if what == "revision":
                body = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                        "gated": "manual" if repo.gated else False,
                        "siblings": [{"rfilename": p} for p in sorted(repo.files)]}  # fmt: skip
            else:
                body = [self._entry(p, data) for p, data in sorted(repo.files.items())]
            return self._send(h, 200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if not m:
            return self._error(h, 404, None, "not found", head)
        repo_id, rev, name = m.groups()
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._error(h, 404, "RepoNotFound", "Repository not found", head)
        commit = repo.revisions.get(rev) or (rev if rev in repo.revisions.values() else None)
        if commit is None:
            return self._error(h, 404, "RevisionNotFound", "Invalid rev id", head)
        if name not in repo.files:
            return self._error(h, 404, "EntryNotFound", "Entry not found", head)
        if repo.gated and repo_id not in self.tokens.get(token or "", set()):
            return self._error(h, 403, "GatedRepo", "Access to this model is restricted", head)
        data = repo.files[name]
        entry = self._entry(name, data)
        etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
        headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}  # fmt: skip
        start = 0
        ranged = re.match(r"bytes=(\d+)-", h.headers.get("Range") or "")
        if ranged and not head:
            start = int(ranged.group(1))
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if head:
            h.send_response(200)
            for k, v in headers.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            return
        body = data[start:]
        self.ranges.append((f"{repo_id}/{name}", h.headers.get("Range")))
        if f"{repo_id}/{name}" in self.corrupt_once:
            self.corrupt_once.discard(f"{repo_id}/{name}")
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        h.send_response(206 if ranged else 200)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    @staticmethod
    def _entry(name: str, data: bytes) -> dict:
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        entry = {"type": "file", "oid": blob, "size": len(data), "path": name}
        if len(data) >= LFS_FROM:
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry
