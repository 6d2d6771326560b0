"""Greedy tokens through LoRA adapters equal transformers + peft with the same adapters on the default model,
for each adapter alone and in one batch mixing every adapter and the base model."""

from __future__ import annotations

from pagoda.engine import SamplingParams
from pagoda_testkit.lora import reference_tokens

NEW_TOKENS = 6
PROMPTS = ("The capital of France is", "def fibonacci(n):")
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_adapters_match_peft_alone_and_in_a_mixed_batch(lora_llm, reference, adapters):
    tok = lora_llm.get_tokenizer()
    prompts = [tok(p).input_ids for p in PROMPTS]
    cases = [(name, p) for name in (None, *adapters) for p in range(len(prompts))]
    expected = {(n, p): reference_tokens(reference, n, prompts[p], NEW_TOKENS) for n, p in cases}
    for name in adapters:  # each adapter changes what the model says, or the comparison proves little
        assert all(expected[(name, p)] != expected[(None, p)] for p in range(len(prompts))), name

    alone = lora_llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, lora="gamma", use_tqdm=False)
    assert alone[0].outputs[0].token_ids == expected[("gamma", 0)]

    loads = lora_llm.engine.core.lora.slots.loads
    mixed = lora_llm.generate(
        [{"prompt_token_ids": prompts[p]} for _, p in cases],
        GREEDY,
        lora=[n for n, _ in cases],
        use_tqdm=False,
    )
    assert {case: out.outputs[0].token_ids for case, out in zip(cases, mixed, strict=True)} == expected
    # three adapters through two slots: the batch had to swap one in while others ran
    assert lora_llm.engine.core.lora.slots.loads - loads >= 2


def test_an_adapters_kv_is_never_reused_by_another_or_the_base_model(lora_llm):
    tok = lora_llm.get_tokenizer()
    prompt = {
        "prompt_token_ids": tok("A long prompt shared word for word by every request below. " * 3).input_ids
    }
    assert len(prompt["prompt_token_ids"]) > 32
    short = SamplingParams(temperature=0, max_tokens=1)

    def cached(lora) -> int:
        return lora_llm.generate(prompt, short, lora=lora, use_tqdm=False)[0].num_cached_tokens

    assert cached("alpha") == 0
    assert cached(None) == 0
    assert cached("beta") == 0
    assert cached("alpha") >= 32  # its own KV is reused
    assert cached(None) >= 32
