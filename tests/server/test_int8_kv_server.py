"""An INT8 KV cache end to end on the CPU: `pagoda serve --kv-cache-dtype int8` through the official client,
and `pagoda generate --kv-cache-dtype int8`, give the greedy tokens the offline engine gives with INT8."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
PAGODA = str(Path(sys.executable).with_name("pagoda"))


@pytest.fixture(scope="module")
def offline() -> list[str]:
    from pagoda.engine import LLM, SamplingParams

    llm = LLM(device="cpu", kv_cache_dtype="int8", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    assert llm.engine.kv_bytes_per_token == 12240  # INT8 values + float32 scales, not the float32 46080
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_server_with_an_int8_cache_matches_the_offline_engine(start_pagoda, offline):
    srv = start_pagoda("--kv-cache-dtype", "int8")
    client = openai.OpenAI(base_url=srv.base_url, api_key="unused", timeout=300, max_retries=0)
    for prompt, want in zip(PROMPTS, offline, strict=True):
        got = client.completions.create(
            model=client.models.list().data[0].id, prompt=prompt, max_tokens=12, temperature=0
        )
        assert got.choices[0].text == want
    assert "Paris" in offline[0]


def test_generate_cli_takes_an_int8_cache(offline):
    proc = subprocess.run(
        [PAGODA, "generate", PROMPTS[0], "--kv-cache-dtype", "int8", "--max-tokens", "12", "--device", "cpu",
         "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert offline[0].strip() in proc.stdout
