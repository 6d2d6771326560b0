"""Gemma 2 and Gemma 3 on the GPU path (the Triton attention backend with the fused Triton norms and rotary),
run here through Triton's interpreter (or compiled on a GPU under PAGODA_KERNEL_TESTS=cuda, see conftest):
the engine's greedy tokens are transformers' on the tiny checkpoints of pagoda_testkit.tiny_gemma, cut to
their first layers for the interpreter's sake (Gemma 2: a sliding and a global layer with its soft-caps;
Gemma 3: two sliding layers on the local RoPE base, one global on the scaled one, QK-norm), through chunked
prefills and decodes; Gemma 3's decodes replayed from recordings (its two rotary tables frozen at
capture)."""

import pytest
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.worker.decode_graphs import RerunCapture
from pagoda_testkit import tiny_gemma

NEW = 6


def _llm(path) -> LLM:
    return LLM(
        model=str(path), attention_backend="triton", device="cpu", dtype="float32", block_size=16,
        kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=16, max_model_len=64, max_num_seqs=2,
        skip_tokenizer_init=True,
    )  # fmt: skip


@pytest.mark.parametrize(("name", "layers", "graphs"), [("gemma2", 2, False), ("gemma3", 3, True)])
def test_triton_path_gives_transformers_greedy_tokens(tmp_path, name, layers, graphs):
    hf, ids, _ = tiny_gemma.build(name, tmp_path, layers)
    prompts = [ids[0].tolist(), ids[1, :9].tolist()]  # 29 tokens: two chunks of 16 and 13
    expect = [tiny_gemma.hf_greedy(hf, p, NEW) for p in prompts]
    llm = _llm(tmp_path)
    engine = llm.engine
    assert engine.runner.model.layers[0].self_attn.triton
    capture = RerunCapture()
    if graphs:
        assert engine.runner.capture_decode_graphs(2, engine.max_model_len, capture=capture) is None
        capture.replays.clear()
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expect
    if graphs:
        assert sum(capture.replays.values()) >= NEW - 1
