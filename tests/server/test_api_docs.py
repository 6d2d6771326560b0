"""docs/api.md lists every endpoint the server publishes and every field its completion endpoints take, and
every hint the server accepts and ignores is marked so there."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from pagoda.engine.server.protocol import HINT_FIELDS

DOCS = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
PARAM = re.compile(r"\{[^}]*\}")


def test_every_endpoint_and_field_is_listed(server) -> None:
    api = httpx.get(server.url + "/openapi.json", timeout=30).json()
    docs = PARAM.sub("{}", DOCS)
    for path, operations in api["paths"].items():
        for method in operations:
            assert f"{method.upper()} {PARAM.sub('{}', path)}" in docs, (method, path)
    schemas = api["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "StructuredOutputs", "StreamOptions"):
        for field in schemas[name]["properties"]:
            assert f"`{field}`" in DOCS or f".{field}`" in DOCS, (name, field)


def test_every_hint_is_marked_hint() -> None:
    rows = [line.split("|") for line in DOCS.splitlines() if line.startswith("| `")]
    hinted = {f for row in rows if row[2].strip().startswith("hint") for f in re.findall(r"`(\w+)`", row[1])}
    assert set(HINT_FIELDS) <= hinted, set(HINT_FIELDS) - hinted
