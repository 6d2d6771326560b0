"""Through HTTP (issue 36 item 2): generation_config.json's sampling values are the defaults of requests that
leave them out, and --max-logprobs refuses more with vLLM's words (a 400)."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import start_server

pytestmark = pytest.mark.timeout(300)


def test_generation_config_defaults_and_max_logprobs(tmp_path) -> None:
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 1}))
    server = start_server(tmp_path, "--generation-config", str(folder), "--max-logprobs", "2")
    try:
        body = {"model": "m", "prompt": "The capital of France is", "max_tokens": 8, "seed": 1}
        names = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        body["model"] = names
        texts = set()
        for seed in (1, 2, 3):  # no temperature given: the file's 0 applies, so every seed answers alike
            r = httpx.post(server.url + "/v1/completions", json={**body, "seed": seed}, timeout=120)
            assert r.status_code == 200, r.text
            texts.add(r.json()["choices"][0]["text"])
        greedy = httpx.post(server.url + "/v1/completions", json={**body, "temperature": 0}, timeout=120)
        assert texts == {greedy.json()["choices"][0]["text"]}
        r = httpx.post(server.url + "/v1/completions", json={**body, "logprobs": 3}, timeout=120)
        assert r.status_code == 400
        assert (
            "Requested sample logprobs of 3, which is greater than max allowed: 2"
            in r.json()["error"]["message"]
        )
        ok = httpx.post(server.url + "/v1/completions", json={**body, "logprobs": 2}, timeout=120)
        assert ok.status_code == 200
    finally:
        server.stop()
