"""`pagoda kernels warm`: the kernels compiled ahead for every catalogue GPU, with no GPU here.

The command runs as users run it (a subprocess: this test session keeps Triton in interpreter mode). The
catalogue run compiles every variant the engine launches for the default model and Llama-3.1-8B / 70B
shapes on every catalogue GPU the engine's torch build supports; then Triton's own launch path (a JIT
launch that compiles without running, for the same GPU) must find each of them in the cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pagoda.engine.sizing import GPU_CATALOGUE

MODELS = ["default", "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-70B-Instruct"]
PAGODA = str(Path(sys.executable).parent / "pagoda")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, **extra}


def _warm(*args: str, cache: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PAGODA, "kernels", "warm", *args, "--cache-dir", str(cache), "--json"],
        capture_output=True, text=True, env=_env(), timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory):
    """One compilation of the whole catalogue (about 100 variants; minutes on two cores), shared."""
    cache = tmp_path_factory.mktemp("triton-cache")
    models = [arg for model in MODELS for arg in ("--model", model)]
    done = _warm("--gpu", "all", *models, "--jobs", "2", cache=cache, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return cache, json.loads(done.stdout)


def test_every_supported_catalogue_gpu_compiles_every_variant_within_its_shared_memory(catalogue):
    _, result = catalogue
    supported = {s.name for s in GPU_CATALOGUE if s.compute_capability >= (7, 5)}  # torch 2.13's CUDA wheels
    assert {g for r in result["rows"] for g in r["gpus"]} == supported
    assert sorted(s.split(":")[0] for s in result["skipped"]) == ["V100-16GB", "V100-32GB"]
    assert result["errors"] == []
    for gpu in supported:
        for model in MODELS:
            kernels = sorted(
                r["variant"].split("[")[0]
                for r in result["rows"]
                if gpu in r["gpus"] and r["model"].startswith(model)
            )
            # cache write, prefill, decode unsplit and split, the splits' merge: on every rank's shape; the
            # layer's RMSNorm (with and without the residual add), rotary and silu-and-mul
            assert set(kernels) == {"merge_splits_kernel", "paged_decode_kernel", "paged_prefill_kernel",
                                    "reshape_and_cache_kernel", "rms_norm_kernel", "rotary_kernel",
                                    "silu_mul_kernel"}, (gpu, model)  # fmt: skip
    for r in result["rows"]:
        assert r["fits"] and 0 <= r["shared_memory"] <= r["shared_memory_per_block"], r
        # the launch configuration's count is an upper bound of what Triton allocated
        assert r["shared_memory"] <= r["shared_memory_bound"], r
    t4 = [r for r in result["rows"] if "T4" in r["gpus"] and "prefill" in r["variant"]]
    assert t4 and all("BLOCK_M=64" in r["variant"] for r in t4)  # 128 x 64 would need 98,304 B of 65,536


def test_the_engines_launch_path_finds_every_warmed_variant(catalogue, tmp_path):
    """As in a pod: the warmed cache (read-only in the image) is linked into an empty writable one, then
    Triton's JIT launch (what the engine's first step runs) for an H100 and an L4 finds every kernel there:
    no compilation, so no new cache entry."""
    seed, _ = catalogue
    cache = tmp_path / "pod-cache"
    script = textwrap.dedent(
        """
        import json, sys
        import torch
        from pagoda.kernels.cache import link_seed_cache
        assert link_seed_cache() > 0
        from triton.backends.compiler import GPUTarget
        from triton.runtime.driver import driver
        from pagoda.engine.cli.kernels import plan_unit, _parser
        from pagoda.engine.cli.plan import resolve_shape
        from pagoda.engine.sizing import lookup_gpu
        from pagoda.kernels import runtime
        from pagoda.kernels.launch_config import DeviceLimits
        from pagoda.kernels.warm import AttentionShape, launch_all

        class Device:  # what Triton asks of the driver before a launch: the GPU being compiled for
            def __init__(self, cc): self.cc = cc
            def get_current_target(self): return GPUTarget("cuda", self.cc[0] * 10 + self.cc[1], 32)
            def get_current_device(self): return 0
            def get_current_stream(self, device=None): return 0

        def jit_launch(kernel, args, kwargs, bound):
            kernel.run(*args, grid=(1,), warmup=True, **kwargs)  # JITFunction.run: compile or find, no launch

        from pagoda.kernels import activation, cache_write, paged_decode, paged_prefill, rms_norm, rotary
        KERNELS = [cache_write._reshape_and_cache_kernel, paged_decode._paged_decode_kernel,
                   paged_decode._merge_splits_kernel, paged_prefill._paged_prefill_kernel,
                   rms_norm._rms_norm_kernel, rotary._rotary_kernel, activation._silu_mul_kernel]
        args = _parser().parse_args(["warm", "--gpu", "x"])
        for gpu, model in (("H100", "meta-llama/Llama-3.1-8B-Instruct"), ("L4", "meta-llama/Llama-3.1-70B-Instruct")):
            spec = lookup_gpu(gpu)
            unit = plan_unit(spec, model, resolve_shape(model), args)
            driver.set_active(Device(spec.compute_capability))
            for kernel in KERNELS:
                kernel.device_caches.clear()  # Triton keeps one target per device index
            limits = DeviceLimits(spec.compute_capability, spec.shared_memory_per_block)
            token = runtime.COMPILING.set(runtime.Compiler(limits, jit_launch))
            for shape in unit.plan.attention_shapes():
                launch_all(shape)
            runtime.COMPILING.reset(token)
        """
    )
    seeded = sorted(p.name for p in seed.iterdir())
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
        env=_env(TRITON_CACHE_DIR=str(cache), PAGODA_KERNEL_CACHE=str(seed)),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    entries = sorted(cache.iterdir())
    assert [p.name for p in entries] == seeded and all(p.is_symlink() for p in entries)
    assert sorted(p.name for p in seed.iterdir()) == seeded, "the launch path compiled what the warm had not"


def test_fp8_below_compute_capability_8_9_is_refused_with_what_to_use_instead(tmp_path):
    done = _warm("--gpu", "A100-80GB", "--kv-cache-dtype", "fp8", cache=tmp_path)
    assert done.returncode == 2
    assert "A100-80GB-SXM (compute capability 8.0)" in done.stderr and "--kv-cache-dtype int8" in done.stderr
    done = _warm("--gpu", "V100", cache=tmp_path)
    assert done.returncode == 2 and "compute capability 7.0" in done.stderr
    assert not any(tmp_path.iterdir()), "a refusal compiles nothing"


def test_a_variant_that_does_not_fit_is_named(catalogue):
    """A launch configuration that miscounted (here: every tile counted as free) shows as an error naming the
    variant, its shared memory and the GPU's limit: the T4's prefill at 128 x 64 tiles needs 98,304 B (the
    other variants are the catalogue's, already compiled)."""
    cache, _ = catalogue
    script = textwrap.dedent(
        """
        import sys
        from pagoda.kernels import launch_config
        launch_config.tile_shared_memory = lambda *args: 0
        from pagoda.engine.cli.kernels import main
        sys.exit(main(["warm", "--gpu", "T4", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--cache-dir",
                       sys.argv[1], "--jobs", "1"]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(cache)], capture_output=True, text=True, timeout=600, env=_env()
    )
    assert done.returncode == 1
    assert "T4 / meta-llama/Llama-3.1-8B-Instruct: paged_prefill_kernel[" in done.stderr
    assert (
        "BLOCK_M=128, BLOCK_N=64" in done.stderr
        and "98304 B" in done.stderr
        and "allows 65536" in done.stderr
    )


SERVE_EQUALS_WARM = textwrap.dedent(
    """
    import json, sys
    from pagoda.engine.cli.kernels import (DEFAULT_MODEL, _gpus, _merge, _parser, Result, plan_unit, serve_unit,
                                           torch_cuda_archs, units_of)
    from pagoda.engine.cli.plan import resolve_shape
    from pagoda.engine.cli.serve_args import to_argv
    from pagoda.engine.sizing import GPUInfo, Hints, plan
    from pagoda.engine.sizing.errors import SizingError
    from pagoda.engine.sizing.shapes import well_known_model_ids
    from pagoda.kernels.aot import recording_for
    from pagoda.kernels.warm import launch_plan

    def launched(unit):
        with recording_for(unit.plan.limits) as keys:
            launch_plan(unit.plan)
        return {(unit.plan.limits, key) for key in keys}

    # what the engine image warms: pagoda kernels warm --gpu all --model catalogue --common
    args = _parser().parse_args(["warm", "--gpu", "all", "--model", "catalogue", "--common"])
    result = Result()
    specs = _gpus(args.gpu, torch_cuda_archs(), result)
    warmed = set()
    for unit in _merge(units_of(args, specs, result.skipped)):
        warmed |= launched(unit)
    explicit = _parser().parse_args(["warm", "--gpu", "x"])
    report = {"plans": 0, "serve_units": 0, "missing": [], "differ": [], "warmed": len(warmed)}
    for model in [DEFAULT_MODEL, *well_known_model_ids()]:
        shape = resolve_shape(None if model == DEFAULT_MODEL else model)
        for spec in specs:
            try:
                planned = plan(shape, GPUInfo.from_spec(spec, 64), Hints())
            except SizingError:
                continue
            report["plans"] += 1
            # the engine's command as `pagoda plan` and the operator render it, then plain serve's KV dtype and LoRA
            argv = ([] if model == DEFAULT_MODEL else [model]) + to_argv(planned.engine_settings())
            auto = [a for i, a in enumerate(argv) if "--kv-cache-dtype" not in argv[max(i - 1, 0) : i + 1]]
            variants = [argv, auto]
            if planned.tensor_parallel_size == 1:
                variants += [argv + ["--enable-lora"], auto + ["--enable-lora"]]
            for serve_argv in variants:
                unit = serve_unit(spec, serve_argv)
                report["serve_units"] += 1
                # the same plan as warm's own flags give (the planner's choices, or the KV dtype and LoRA named)
                kv = "auto" if "--kv-cache-dtype" not in serve_argv else planned.kv_cache_dtype
                lora = 16 if "--enable-lora" in serve_argv else None
                mine = plan_unit(spec, unit.model, shape, explicit, kv_cache_dtype=kv, lora_rank=lora)
                if mine.plan != unit.plan:
                    report["differ"].append([spec.name, model, serve_argv, str(unit.plan), str(mine.plan)])
                missing = launched(unit) - warmed
                if missing:
                    report["missing"].append([spec.name, model, serve_argv, sorted(k[1][0] for k in missing)])
    print(json.dumps(report))
    """
)


def test_what_serve_launches_for_each_catalogue_plan_is_what_the_image_warmed():
    """For every catalogue model on every catalogue GPU the build runs, the engine command the planner makes
    (`pagoda plan`, the operator's render), the same with plain serve's KV dtype `auto`, and both with
    `--enable-lora` (tensor-parallel size 1): serve's own parser reads it, `kernel_plan` turns it into the
    plan warm's flags give too, and every variant its launches need (recorded, not compiled) is among those
    `pagoda kernels warm --gpu all --model catalogue --common` (the engine image's step) launches."""
    done = subprocess.run(
        [sys.executable, "-c", SERVE_EQUALS_WARM], capture_output=True, text=True, timeout=900, env=_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["plans"] > 150 and report["serve_units"] > 2 * report["plans"], report
    assert report["differ"] == [], report["differ"][:3]
    assert report["missing"] == [], report["missing"][:3]


def test_the_kernels_step_reads_a_hub_models_shape_from_the_model_cache(tmp_path, monkeypatch):
    """In the operator's Job the engine's `--model org/name` is a hub id found in HF_HOME (the model cache the
    download filled, read offline): its config.json decides the plan, not the well-known table."""
    from pagoda.engine.cli.kernels import model_shape, serve_unit
    from pagoda.engine.sizing import lookup_gpu

    snapshot = tmp_path / "hub" / "models--org--tiny-llama" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (tmp_path / "hub" / "models--org--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny-llama" / "refs" / "main").write_text("a" * 40)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
              "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}  # fmt: skip
    (snapshot / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shape = model_shape("org/tiny-llama")
    assert (shape.num_attention_heads, shape.num_kv_heads, shape.head_dim) == (8, 2, 32)
    unit = serve_unit(lookup_gpu("L4"), ["org/tiny-llama", "--enable-lora", "--max-lora-rank", "8"])
    assert unit.plan.ranks == ((8, 2),) and unit.plan.head_dim == 32 and unit.plan.lora_rank == 8
    assert unit.plan.dtype == "bfloat16" and unit.plan.kv_cache_dtype == "bfloat16"  # serve's auto, not fp8


SERVE_LAYERS_EQUAL_WARM = textwrap.dedent(
    """
    import ast, json
    import torch
    from pagoda.engine.attention.base import AttentionMetadata, LayerKVCache
    from pagoda.engine.attention.triton_backend import TritonAttentionBackend
    from pagoda.engine.cli.kernels import _parser, plan_unit
    from pagoda.engine.cli.plan import resolve_shape
    from pagoda.engine.sizing import lookup_gpu
    from pagoda.kernels.aot import recording_for
    from pagoda.kernels.paged_decode import _paged_decode_kernel
    from pagoda.kernels.paged_prefill import _paged_prefill_kernel
    from pagoda.kernels.warm import launch_plan

    META = torch.device("meta")
    ATTENTION = {k.__name__: k for k in (_paged_decode_kernel, _paged_prefill_kernel)}

    def flag(key, name):  # a constexpr of an attention kernel's variant key (kept by argument index there)
        names = ATTENTION[key[0]].arg_names
        return {names[i[0]]: v for i, v in ast.literal_eval(key[2])}[name]

    def step(query_lens, seq_lens):
        i32 = dict(dtype=torch.int32, device=META)
        t = sum(query_lens)
        return AttentionMetadata(
            num_seqs=len(query_lens), num_tokens=t, query_start_loc=torch.empty(len(query_lens) + 1, **i32),
            seq_lens=torch.empty(len(query_lens), **i32), context_lens=torch.empty(len(query_lens), **i32),
            block_tables=torch.empty((len(query_lens), 64), **i32),
            slot_mapping=torch.empty(t, dtype=torch.int64, device=META), max_query_len=max(query_lens),
            max_seq_len=max(seq_lens), query_lens_list=query_lens, seq_lens_list=seq_lens,
        )

    # a mixed step (prefill chunks beside decodes), one long decode (split) and a wide decode batch (unsplit)
    STEPS = [step([5, 1, 40], [5, 300, 900]), step([1], [1000]), step([1] * 64, [700] * 64)]
    args = _parser().parse_args(["warm", "--gpu", "x"])
    report = {}
    for gpu, model in (("L4", "google/gemma-2-9b-it"), ("H100", "google/gemma-3-4b-it"),
                       ("H100", "google/gemma-3-27b-it"), ("L4", "meta-llama/Llama-3.1-8B-Instruct")):
        shape = resolve_shape(model)
        plan = plan_unit(lookup_gpu(gpu), model, shape, args).plan
        with recording_for(plan.limits) as warmed:
            launch_plan(plan)
        # every layer as the model calls the backend: its own window (or none), the model's soft-cap
        windows = {shape.sliding_window, None}
        cap = shape.attn_logit_softcapping
        dtype, kv_dtype = getattr(torch, plan.dtype), getattr(torch, plan.kv_cache_dtype)
        backend = TritonAttentionBackend()
        with recording_for(plan.limits) as served:
            for heads, kv_heads in plan.ranks:
                kv = torch.empty((2, 256, plan.block_size, kv_heads, plan.head_dim), dtype=kv_dtype, device=META)
                scales = torch.empty(kv.shape[:4], device=META) if kv_dtype == torch.int8 else None
                cache = LayerKVCache(kv, scales=scales)
                for meta in STEPS:
                    t, d = meta.num_tokens, plan.head_dim
                    qkv = torch.empty((t, (heads + 2 * kv_heads) * d), dtype=dtype, device=META)
                    q = qkv[:, : heads * d].view(t, heads, d)
                    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
                    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
                    for window in windows:
                        backend.forward(q, k, v, cache, meta, d**-0.5, window, logit_softcap=cap)
        names = lambda keys: sorted({k[0] for k in keys})
        report[model] = {"missing": [k[0] for k in served - warmed], "served": names(served),
                         "softcap": sorted({flag(k, "SOFTCAP") for k in served if k[0] in ATTENTION}),
                         "window": sorted({flag(k, "USE_WINDOW") for k in served if k[0] in ATTENTION})}
    print(json.dumps(report))
    """
)


def test_what_each_layer_launches_at_serve_time_is_warmed():
    """The Triton backend called as a model's layers call it (each layer's window or none, the model's
    soft-cap) on a mixed step, a split and an unsplit decode launches only variants the warm of the same plan
    launches: Gemma 2 (soft-cap on every layer, windowed and global layers), Gemma 3 (head_dim 256 and 128,
    windowed and global layers) and a plain Llama."""
    done = subprocess.run(
        [sys.executable, "-c", SERVE_LAYERS_EQUAL_WARM],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for model, r in report.items():
        assert r["missing"] == [], (model, r["missing"])
        assert {"_paged_decode_kernel", "_paged_prefill_kernel"} <= set(r["served"]), r["served"]
    assert report["google/gemma-2-9b-it"]["softcap"] == [True]
    assert report["google/gemma-3-4b-it"]["softcap"] == [False]
    assert (
        report["google/gemma-2-9b-it"]["window"] == report["google/gemma-3-27b-it"]["window"] == [False, True]
    )
    assert report["meta-llama/Llama-3.1-8B-Instruct"]["window"] == [False]


def test_warm_lists_the_soft_cap_and_window_variants_of_gemma(tmp_path):
    """`pagoda kernels warm` for Gemma 2 compiles soft-capped prefill and decode kernels, windowed and not;
    for Gemma 3 windowed and full-attention ones without a cap, at Gemma's head_dim 256; all fit the GPU."""
    done = _warm("--gpu", "L4", "--model", "google/gemma-2-9b-it", "--model", "google/gemma-3-4b-it",
                 "--jobs", "1", cache=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)["rows"]
    assert rows and all(r["fits"] for r in rows)

    def attention(model):
        return [r["variant"] for r in rows if r["model"] == model and "paged_" in r["variant"]]

    gemma2, gemma3 = attention("google/gemma-2-9b-it"), attention("google/gemma-3-4b-it")
    assert gemma2 and all("SOFTCAP" in v and "HEAD_DIM=256" in v for v in gemma2)
    assert gemma3 and all("SOFTCAP" not in v and "HEAD_DIM=256" in v for v in gemma3)
    for variants in (gemma2, gemma3):
        for kernel in ("paged_prefill_kernel", "paged_decode_kernel"):
            windowed = {"USE_WINDOW" in v for v in variants if v.startswith(kernel)}
            assert windowed == {True, False}, (kernel, variants)


def test_warm_compiles_a_head_dim_that_is_no_power_of_two(tmp_path):
    """Phi-3.5-mini's head_dim 96 (the kernels pad a head's lanes to 128): every variant compiles for the
    T4, the smallest shared memory of the catalogue, within the launch configuration's bound."""
    done = subprocess.run(
        [PAGODA, "kernels", "warm", "--gpu", "T4", "--jobs", "1", "--cache-dir", str(tmp_path), "--json", "--",
         "microsoft/Phi-3.5-mini-instruct"], capture_output=True, text=True, env=_env(), timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)["rows"]
    kernels = {r["variant"].split("[")[0] for r in rows}
    assert {
        "paged_prefill_kernel",
        "paged_decode_kernel",
        "merge_splits_kernel",
        "reshape_and_cache_kernel",
    } <= kernels
    for r in rows:
        assert r["fits"] and r["shared_memory"] <= r["shared_memory_bound"], r
        assert "HEAD_DIM=" not in r["variant"] or "HEAD_DIM=96" in r["variant"], r
