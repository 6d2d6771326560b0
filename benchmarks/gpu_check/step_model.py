"""The random-weight model the warm and serve steps use (8-layer Llama-3.1-8B shape on a GPU, tiny otherwise)."""

from __future__ import annotations

from gpu_check.context import Context, check, verdict
from gpu_check.model import write_model


def run(ctx: Context) -> dict:
    import torch

    if ctx.gpu and not torch.cuda.is_available():
        return {
            "status": "error",
            "error": "torch sees no CUDA device (the 8B-shaped model is drawn on the GPU)",
        }
    device = "cuda" if ctx.gpu else "cpu"
    written = write_model(ctx.model_dir, ctx.shape, device=device)
    from pagoda.engine.loader import load_tokenizer

    tokenizer = load_tokenizer(ctx.model_dir)
    ids = tokenizer("w5 w6 w7")["input_ids"]
    checks = {
        "files": check(written["safetensors_bytes"] > 0, f"{written['safetensors_bytes'] / 1e9:.2f} GB"),
        "tokenizer_loads": check(len(tokenizer) == ctx.shape.vocab_size and ids == [5, 6, 7], f"{ids}"),
    }
    headline = (
        f"{ctx.shape.name}: {written['parameters'] / 1e6:,.1f} M parameters, "
        f"{written['safetensors_bytes'] / 1e6:,.1f} MB in {written['seconds']} s"
    )
    return verdict(checks, headline=headline, model=written)
