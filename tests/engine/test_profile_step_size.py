"""Start-up profiles the activation peak of the largest step the scheduler may build (issue 34 item 11):
with chunked prefill off a whole prompt of up to max_model_len is one step, and the profiling forward
must be that long (it was 2,048 tokens whatever max_model_len was: a longer prompt's step could then run
out of the memory the KV cache had taken)."""

from __future__ import annotations

import pytest
from pagoda.engine import LLM
from pagoda.engine.worker.model_runner import ModelRunner


class Profiled(Exception):
    pass


@pytest.mark.parametrize(
    ("chunked", "batched", "max_model_len", "expected"),
    [
        (False, None, 3000, 3000),  # a 3,000-token prompt is one step
        (False, None, 1000, 2048),  # the plan's budget: max(2048, max_model_len)
        (True, None, 3000, 2048),  # chunks of at most the default budget
        (True, 512, 3000, 512),
        (False, 3500, 3000, 3500),
        (False, None, None, 4096),  # no length given: up to the model's own
    ],
)
def test_the_profiled_step_is_the_largest_the_scheduler_may_build(
    tiny_model, monkeypatch, chunked, batched, max_model_len, expected
):
    requests = []

    def measure(self, request):
        requests.append(request)
        raise Profiled  # the size is what is checked: no forward, no cache

    monkeypatch.setattr(ModelRunner, "measure_kv_budget", measure)
    path = str(tiny_model("llama", max_position_embeddings=4096))
    with pytest.raises(Profiled):
        LLM(path, device="cpu", dtype="float32", max_model_len=max_model_len,
            enable_chunked_prefill=chunked, max_num_batched_tokens=batched)  # fmt: skip
    (request,) = requests
    assert request.num_tokens == expected


def test_the_plan_s_budget_without_chunked_prefill_is_what_was_profiled(tiny_model, monkeypatch):
    """The same figure from both sides: the plan's max_num_batched_tokens (the scheduler's budget)."""
    seen = []
    original = ModelRunner.measure_kv_budget

    def measure(self, request):
        seen.append(request.num_tokens)
        return original(self, request)

    monkeypatch.setattr(ModelRunner, "measure_kv_budget", measure)
    monkeypatch.setattr("pagoda.engine.worker.model_runner.cpu_kv_cache_bytes", lambda ranks: 16 << 20)
    path = str(tiny_model("llama", max_position_embeddings=4096))
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=3000, enable_chunked_prefill=False)
    assert seen == [llm.engine.scheduler.max_num_batched_tokens] == [3000]


def test_the_dry_run_estimates_the_step_the_engine_profiles():
    """The operator's check (serve_check, no torch) sizes the activation peak of the same step: without
    chunked prefill a whole 8,192-token prompt, 4x the 2,048 it assumed before."""
    from pagoda.engine.cli.serve_check import check

    shape = '{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, ' \
        '"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, ' \
        '"max_position_embeddings": 131072, "torch_dtype": "bfloat16"}'  # fmt: skip
    base = [
        "--model",
        "m",
        "--model-shape",
        shape,
        "--gpu",
        "NVIDIA-H100-80GB-HBM3",
        "--max-model-len",
        "8192",
    ]
    chunked = check(base).device["activation_bytes_estimated"]
    whole = check([*base, "--no-enable-chunked-prefill"]).device["activation_bytes_estimated"]
    assert whole == pytest.approx(4 * chunked, rel=0.25)
