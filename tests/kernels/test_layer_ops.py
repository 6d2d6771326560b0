"""The decoder layer's fused element-wise kernels (RMSNorm with the residual add, rotary, silu-and-mul) against
their torch twins, on fresh random inputs: odd sizes, strided rows, every activation dtype.

The tests run wherever the kernel tests run: on the CPU through Triton's interpreter, on a CUDA device when
the kernel tests compile for it (`make gpu-check`). Launch configurations differ between the two (the
interpreter walks rows in small steps), so the sizes below cover rows of one and of several steps on both.
"""

from __future__ import annotations

import os

import pytest
import torch
from pagoda.kernels.activation import silu_mul
from pagoda.kernels.reference import add_rms_norm_ref, rotary_ref, silu_mul_ref
from pagoda.kernels.rms_norm import add_rms_norm
from pagoda.kernels.rotary import rotary_

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def device() -> torch.device:
    """CUDA when the kernels compile for a GPU here, else the CPU (Triton's interpreter)."""
    compiled = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    return torch.device("cuda" if compiled else "cpu")


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # the kernels and twins compute in float32 and round once; a last-bit difference (FMA contraction,
    # reduction order, rsqrt) may flip one rounding of the activation dtype
    return {
        torch.float32: {"atol": 1e-5, "rtol": 1e-5},
        torch.float16: {"atol": 2e-3, "rtol": 2e-3},
        torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
    }[dtype]


def _exact(dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    """Tolerance of a value rounded once from float32, as the twin rounds it: none, except that Triton's
    interpreter rounds float32 to bfloat16 by its own approximation (off by an ulp at times)."""
    if dtype == torch.bfloat16 and device.type == "cpu":
        return {"atol": 0.0, "rtol": 2.0**-7}
    return {"atol": 0.0, "rtol": 0.0}


def _randn(shape, gen, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (5, 200), (3, 333), (7, 4100)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_its_twin(device, dtype, rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    x = _randn((rows, hidden), gen, dtype, device, 2.0)
    residual = _randn((rows, hidden), gen, dtype, device) if with_residual else None
    weight = _randn((hidden,), gen, dtype, device, 0.5) + 1
    want, want_residual = add_rms_norm_ref(x, residual, weight, 1e-6)
    res = None if residual is None else residual.clone()
    got = add_rms_norm(x, res, weight, 1e-6)
    torch.testing.assert_close(got, want, **_tol(dtype))
    if with_residual:
        # the residual sum is rounded exactly as the twin rounds it (one add, one rounding)
        torch.testing.assert_close(res, want_residual, **_exact(dtype, device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_reads_strided_rows_and_writes_only_its_own(device, dtype):
    """Rows of x and the residual a wider tensor's column slices (odd strides: no vectorised path), the
    output into a NaN-filled buffer: every element written once, nothing outside the rows touched."""
    gen = torch.Generator().manual_seed(7)
    rows, hidden = 6, 97
    wide_x = _randn((rows, hidden + 3), gen, dtype, device)
    wide_res = _randn((rows, hidden + 5), gen, dtype, device)
    x, residual = wide_x[:, 1 : 1 + hidden], wide_res[:, 2 : 2 + hidden]
    weight = _randn((hidden,), gen, dtype, device)
    want, want_residual = add_rms_norm_ref(x, residual, weight, 1e-5)
    before = wide_res.clone()
    out = torch.full((rows, hidden), float("nan"), dtype=dtype, device=device)
    got = add_rms_norm(x, residual, weight, 1e-5, out=out)
    assert got is out
    torch.testing.assert_close(got, want, **_tol(dtype))
    torch.testing.assert_close(residual, want_residual, **_exact(dtype, device))
    outside = torch.ones_like(wide_res, dtype=torch.bool)
    outside[:, 2 : 2 + hidden] = False
    assert torch.equal(wide_res[outside], before[outside])


def test_add_rms_norm_of_no_rows_and_bad_inputs(device):
    x = torch.empty((0, 32), device=device)
    assert add_rms_norm(x, None, torch.ones(32, device=device), 1e-6).shape == (0, 32)
    x = torch.ones((2, 32), device=device)
    with pytest.raises(ValueError, match="share a dtype"):
        add_rms_norm(x, None, torch.ones(32, dtype=torch.float16, device=device), 1e-6)
    with pytest.raises(ValueError, match="laid out like x"):
        add_rms_norm(x, torch.ones((2, 16), device=device), torch.ones(32, device=device), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim"), [(1, 4, 1, 64), (5, 3, 3, 32), (9, 7, 2, 128), (4, 2, 1, 80)]
)
def test_rotary_matches_its_twin_in_place_on_q_and_k_only(device, dtype, tokens, heads, kv_heads, head_dim):
    """q and k heads of a fused qkv row rotated in place (head counts that are no multiple of a program's
    heads, a head dim whose half is no power of two), v left bit for bit as it was."""
    from pagoda.engine.models.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(tokens * 100 + head_dim)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = _randn((tokens, width), gen, dtype, device)
    rope = RotaryEmbedding(head_dim, 10000.0, None, 4096, torch.device(device))
    positions = torch.randint(0, 3000, (tokens,), generator=gen).to(device)
    cos, sin = rope.cos_sin(positions, int(positions.max()), dtype)
    cos, sin = cos.view(tokens, head_dim), sin.view(tokens, head_dim)
    want = rotary_ref(qkv, heads + kv_heads, head_dim, cos, sin)
    got = qkv.clone()
    rotary_(got, heads + kv_heads, head_dim, cos, sin)
    torch.testing.assert_close(got, want, **_tol(dtype))
    v = slice((heads + kv_heads) * head_dim, None)
    assert torch.equal(got[:, v], qkv[:, v])


def test_rotary_twin_is_the_models_rotate_half():
    """The twin is the model's own convention (`layers.apply_rotary`) on float32 inputs."""
    from pagoda.engine.models.layers import RotaryEmbedding, apply_rotary

    gen = torch.Generator().manual_seed(1)
    t, heads, d = 3, 5, 64
    x = torch.randn((t, heads * d), generator=gen)
    rope = RotaryEmbedding(d, 500000.0, None, 256, torch.device("cpu"))
    cos, sin = rope.cos_sin(torch.tensor([0, 17, 200]), 200, torch.float32)
    want = apply_rotary(x.view(t, heads, d), cos, sin).reshape(t, heads * d)
    torch.testing.assert_close(rotary_ref(x, heads, d, cos.view(t, d), sin.view(t, d)), want)


def test_rotary_rejects_rows_that_are_not_whole_heads(device):
    x = torch.zeros((2, 100), device=device)
    cos = torch.zeros((2, 64), device=device)
    with pytest.raises(ValueError, match="heads of 64"):
        rotary_(x, 1, 64, cos, cos)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(1, 16), (3, 100), (6, 333), (2, 1100)])
def test_silu_mul_matches_its_twin(device, dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = _randn((rows, 2 * inter), gen, dtype, device, 3.0)
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_ref(gate_up), **_tol(dtype))


# the interpreter's exp(100) overflows to inf, as a GPU's does, with NumPy's warning
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_silu_mul_of_strided_rows_into_a_given_buffer(device):
    gen = torch.Generator().manual_seed(5)
    wide = _randn((4, 2 * 50 + 6), gen, torch.float16, device)
    gate_up = wide[:, 3 : 3 + 100]
    out = torch.full((4, 50), float("nan"), dtype=torch.float16, device=device)
    assert silu_mul(gate_up, out=out) is out
    torch.testing.assert_close(out, silu_mul_ref(gate_up), **_tol(torch.float16))
    # extremes: large negative gates give (-)0, large positive ones pass the gate through
    edge = torch.tensor([[-100.0, 0.0, 100.0, 2.0, 3.0, 4.0]], device=device)
    torch.testing.assert_close(silu_mul(edge), torch.tensor([[-0.0, 0.0, 400.0]], device=device))
