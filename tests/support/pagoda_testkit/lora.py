"""PEFT LoRA adapters with random weights for the default model, made with `peft` itself, and the
transformers + peft model that runs them (the reference the engine's adapters are checked against)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    targets: tuple[str, ...] = ALL_TARGETS
    alpha: float | None = None  # default: 2 x rank
    seed: int = 0
    std: float = 0.1  # big enough that the adapter changes greedy tokens of the default model
    use_rslora: bool = False


def make_peft_adapter(base_dir: Path, out_dir: Path, spec: AdapterSpec) -> Path:
    """Save a LoRA adapter of ``spec`` for the model in ``base_dir`` as PEFT does (safetensors)."""
    import peft
    import transformers

    torch.manual_seed(spec.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha if spec.alpha is not None else 2 * spec.rank,
        target_modules=list(spec.targets),
        lora_dropout=0.0,
        use_rslora=spec.use_rslora,
    )
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, spec.std)
    path = out_dir / spec.name
    peft_model.save_pretrained(path, safe_serialization=True)
    return path


def peft_reference(base_dir: Path, adapters: dict[str, Path]):
    """The transformers model of ``base_dir`` with every adapter loaded under its name (peft's
    `set_adapter(name)` picks one, `disable_adapter()` runs the base model)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    names = list(adapters)
    model = peft.PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


def greedy(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens with the model's own forward and KV cache (no generation config, no processors)."""
    ids = torch.tensor([prompt_ids])
    past, tokens = None, []
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(input_ids=ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = int(out.logits[0, -1].argmax())
            tokens.append(tok)
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return tokens


def reference_tokens(model, adapter: str | None, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens of the peft reference through ``adapter`` (None: the base model)."""
    if adapter is None:
        with model.disable_adapter():
            return greedy(model, prompt_ids, new_tokens)
    model.set_adapter(adapter)
    return greedy(model, prompt_ids, new_tokens)
