"""The offline Python API, shaped like vLLM's: `LLM(...).generate(prompts, params)` and `.chat(messages)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from pagoda.engine.config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from pagoda.engine.frontend.llm_engine import LLMEngine
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.sampling_params import SamplingParams
from tqdm.auto import tqdm

PromptType = str | dict[str, Any] | list[int]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        block_size: int = 16,
        max_model_len: int | str | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        device: str = "auto",
        attention_backend: str = "auto",
        **kwargs: Any,
    ) -> None:
        config = EngineConfig(
            model=model,
            dtype=dtype,
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            device=device,
            attention_backend=attention_backend,
            **kwargs,
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (--generation-config), as
        vLLM's LLM gives them; what generate() uses when it is given none."""
        return self.engine.input_processor.default_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts. ``lora``: the
        name of a loaded LoRA adapter for every prompt, or one name (None: the base model) per prompt."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts; give one or one per prompt"
                )
        adapters = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(adapters) != len(prompts):
            raise ValueError(
                f"lora has {len(adapters)} entries for {len(prompts)} prompts; give one or one per prompt"
            )
        ids = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
            rid = str(next(self._ids))
            text, token_ids = _split_prompt(prompt)
            self.engine.add_request(
                rid,
                text,
                params,
                prompt_token_ids=token_ids,
                priority=priority[i] if priority else 0,
                lora=adapters[i],
            )
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        inputs = self.engine.input_processor
        prompts = [
            {"prompt_token_ids": inputs.chat_token_ids(conv, add_generation_prompt)[0]}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        partial: dict[str, RequestOutput] = {}  # deltas folded so far, per unfinished request
        pending = set(ids)
        bar = tqdm(
            total=len(ids), desc="Processed prompts", unit="req", disable=not use_tqdm, dynamic_ncols=True
        )
        generated = 0
        try:
            while pending:
                for delta in self.engine.step():
                    rid = delta.request_id
                    if rid not in pending:
                        continue
                    whole = partial.get(rid)
                    if whole is None:
                        partial[rid] = whole = delta
                    else:
                        whole.add(delta)
                    if whole.finished:
                        pending.discard(rid)
                        results[rid] = partial.pop(rid)
                        generated += sum(len(c.token_ids) for c in whole.outputs)
                        bar.update(1)
                        elapsed = bar.format_dict.get("elapsed") or 0.0
                        if elapsed > 0:
                            bar.set_postfix_str(f"output {generated / elapsed:.1f} tok/s")
        except BaseException:
            self.engine.abort_request(pending)
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]


def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], None
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, list):
        return None, list(prompt)
    raise ValueError(f"prompt must be a string, a token-id list or a dict, got {type(prompt).__name__}")
