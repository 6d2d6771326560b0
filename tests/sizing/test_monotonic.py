"""Properties every plan keeps, over random shapes and GPU sizes (hypothesis)."""

from dataclasses import replace

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pagoda.engine.sizing import GPUInfo, Hints, ModelShape, SizingError, plan
from pagoda.engine.sizing.shapes import estimate_num_params


@st.composite
def shapes(draw):
    heads = draw(st.sampled_from([8, 16, 32, 64]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0]))
    head_dim = draw(st.sampled_from([64, 128]))
    hidden = heads * head_dim
    dims = dict(
        num_layers=draw(st.integers(2, 96)), num_attention_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        hidden_size=hidden, intermediate_size=draw(st.integers(2, 4)) * hidden,
        vocab_size=draw(st.sampled_from([32000, 128256])),
    )  # fmt: skip
    n = estimate_num_params(**dims)
    maxpos = draw(st.sampled_from([4096, 32768, 131072]))
    return ModelShape(name="random", max_position_embeddings=maxpos, dtype="bfloat16", weight_bytes=2 * n,
                      num_params=n, **dims)  # fmt: skip


def gpu(memory_mib: int, cc=(9, 0)) -> GPUInfo:
    return GPUInfo(None, "test-gpu", memory_mib, 1, cc)


def try_plan(shape, info, hints=None):
    try:
        return plan(shape, info, hints)
    except SizingError:
        return None


memories = st.integers(8_000, 200_000)
hint_sets = st.builds(
    Hints,
    target_context=st.one_of(st.none(), st.integers(256, 200_000)),
    min_concurrency=st.integers(1, 8),
    p99_prompt_tokens=st.one_of(st.none(), st.integers(1, 20_000)),
    quality_first=st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(shapes(), memories, memories, hint_sets, st.sampled_from([(8, 0), (8, 9), (9, 0)]))
def test_more_memory_never_means_less(shape, m1, m2, hints, cc):
    small, large = sorted((m1, m2))
    p_small = try_plan(shape, gpu(small, cc), hints)
    p_large = try_plan(shape, gpu(large, cc), hints)
    if p_small is not None:
        assert p_large is not None, "a larger GPU refused what a smaller one served"
    assume(p_small is not None)
    assert p_large.max_model_len >= p_small.max_model_len
    assert p_large.num_gpu_blocks >= p_small.num_gpu_blocks
    assert p_large.gpu_memory_utilization >= p_small.gpu_memory_utilization


@settings(max_examples=150, deadline=None)
@given(shapes(), st.integers(1, 40), st.integers(0, 3), memories, hint_sets)
def test_larger_model_never_gets_more_blocks(shape, extra_layers, wider, memory, hints):
    bigger = replace(shape, num_layers=shape.num_layers + extra_layers)
    bigger = replace(
        bigger,
        intermediate_size=shape.intermediate_size + wider * shape.hidden_size,
        num_params=estimate_num_params(
            num_layers=bigger.num_layers, num_attention_heads=shape.num_attention_heads,
            num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size + wider * shape.hidden_size, vocab_size=shape.vocab_size,
        ),
    )  # fmt: skip
    bigger = replace(bigger, weight_bytes=2 * bigger.num_params)
    p_big = try_plan(bigger, gpu(memory), hints)
    assume(p_big is not None)
    p_small = try_plan(shape, gpu(memory), hints)
    assert p_small is not None, "a smaller model was refused where a larger one was served"
    assert p_big.num_gpu_blocks <= p_small.num_gpu_blocks


@settings(max_examples=150, deadline=None)
@given(shapes(), memories, st.sampled_from([1, 2, 4, 8]), hint_sets)
def test_every_plan_fits_its_gpu(shape, memory, count, hints):
    info = GPUInfo(None, "test-gpu", memory, count, (9, 0))
    p = try_plan(shape, info, hints)
    assume(p is not None)
    tp = p.tensor_parallel_size
    kv_heads_per_rank = -(-shape.num_kv_heads // tp)
    elem = 1 if p.kv_cache_dtype == "fp8" else 2
    block_bytes = 2 * shape.num_layers * kv_heads_per_rank * shape.head_dim * elem * p.block_size
    used = p.num_gpu_blocks * block_bytes + p.weights_bytes_per_gpu + p.reserve_bytes
    # within the engine's budget (gpu_memory_utilization x memory), which is within the card
    assert used <= p.gpu_memory_utilization * memory * 2**20 <= memory * 2**20
    assert p.kv_cache_bytes == p.num_gpu_blocks * block_bytes
    assert tp <= count and shape.num_attention_heads % tp == 0
    assert p.max_model_len <= shape.max_position_embeddings
    assert p.max_model_len * hints.min_concurrency <= p.num_gpu_blocks * p.block_size
    assert p.max_num_seqs >= hints.min_concurrency
