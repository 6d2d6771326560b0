"""Through the official client (issue 36 item 2): the logprobs limit is the server's --max-logprobs, not a
fixed cap in the API schema. A server started with --max-logprobs 30 answers 25 top logprobs per token and
refuses 31 with a 400 in vLLM's words, for completions (logprobs, prompt_logprobs) and chat (top_logprobs)."""

from __future__ import annotations

import openai
import pytest

from .conftest import start_server

pytestmark = pytest.mark.timeout(300)


def test_limit_follows_max_logprobs(tmp_path) -> None:
    server = start_server(tmp_path, "--max-logprobs", "30")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0)
        model = client.models.list().data[0].id
        out = client.completions.create(
            model=model, prompt="The sky is", max_tokens=2, temperature=0, logprobs=25
        )
        tops = out.choices[0].logprobs.top_logprobs
        assert len(tops) == 2 and all(len(t) == 25 for t in tops)

        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            temperature=0,
            logprobs=True,
            top_logprobs=25,
        )
        entries = chat.choices[0].logprobs.content
        assert entries and all(len(e.top_logprobs) == 25 for e in entries)

        scored = client.completions.create(
            model=model, prompt="The sky is", max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 25}
        )
        prompt_lps = scored.choices[0].model_extra["prompt_logprobs"]
        # the first prompt token has none; each other one its top 25, plus the token itself when it is not
        assert prompt_lps[0] is None and all(25 <= len(e) <= 26 for e in prompt_lps[1:])

        refusals = [
            ("sample", lambda: client.completions.create(model=model, prompt="x", max_tokens=1, logprobs=31)),
            (
                "sample",
                lambda: client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1, logprobs=True,
                    top_logprobs=31,
                ),
            ),
            (
                "prompt",
                lambda: client.completions.create(
                    model=model, prompt="x", max_tokens=1, extra_body={"prompt_logprobs": 31}
                ),
            ),
        ]  # fmt: skip
        for kind, call in refusals:
            with pytest.raises(openai.BadRequestError) as err:
                call()
            assert err.value.status_code == 400
            message = err.value.body["message"]
            assert f"Requested {kind} logprobs of 31, which is greater than max allowed: 30" in message
    finally:
        server.stop()
