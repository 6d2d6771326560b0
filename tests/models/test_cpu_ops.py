"""The fused CPU element-wise ops against the torch expressions they replace (layers.py)."""

from __future__ import annotations

import pytest
import torch
from pagoda.engine.models import cpu_ops
from pagoda.engine.models.layers import RMSNorm, RotaryEmbedding, apply_rotary


@pytest.fixture(autouse=True)
def _every_variant(cpu_variant) -> None:
    """Every test on each kernel variant this CPU runs."""


@pytest.mark.parametrize("tokens,hidden", [(1, 576), (7, 64), (300, 576), (33, 100)])
def test_rms_norm_and_fused_residual_add(tokens, hidden):
    torch.manual_seed(tokens)
    norm = RMSNorm(hidden, 1e-5, torch.float32, torch.device("cpu"))
    norm.weight.copy_(torch.rand(hidden) + 0.5)
    x, res = torch.randn(tokens, hidden) * 3, torch.randn(tokens, hidden)
    ref_sum = res + x
    ref = norm._torch(ref_sum)
    assert (cpu_ops.add_rms_norm(x, None, norm.weight, 1e-5) - norm._torch(x)).abs().max() < 1e-5
    res_in = res.clone()
    out, new_res = norm.add_forward(x, res_in)
    assert torch.equal(new_res, ref_sum)  # the residual add is exact
    assert (out - ref).abs().max() < 1e-5


def test_rms_norm_on_a_strided_view():
    torch.manual_seed(0)
    base = torch.randn(10, 96)
    x = base[:, 16:80]  # rows not contiguous with each other
    w = torch.rand(64)
    got = cpu_ops.add_rms_norm(x, None, w, 1e-6)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 2, 16), (2, 1, 6)])
def test_rotary_in_place_is_bit_identical(heads, kv_heads, d):
    torch.manual_seed(d)
    t = 37
    rope = RotaryEmbedding(d, 10000.0, None, 4096, torch.device("cpu"))
    positions = torch.randint(0, 3000, (t,))
    cos, sin = rope.cos_sin(positions, 3000, torch.float32)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    q, k, v = qkv.clone().split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    want_q = apply_rotary(q.reshape(t, heads, d), cos, sin)
    want_k = apply_rotary(k.reshape(t, kv_heads, d), cos, sin)
    assert cpu_ops.rotary_(qkv, heads + kv_heads, d, cos.view(t, d), sin.view(t, d))
    assert torch.equal(qkv[:, : heads * d].view(t, heads, d), want_q)
    assert torch.equal(qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d), want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v)  # V untouched


@pytest.mark.parametrize("tokens,inter", [(1, 1536), (65, 1536), (5, 23)])
def test_silu_mul(tokens, inter):
    torch.manual_seed(inter)
    gate_up = torch.randn(tokens, 2 * inter) * 4
    gate, up = gate_up.split(inter, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = cpu_ops.silu_mul(gate_up)
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=2e-6, atol=1e-6)


def test_declines_what_it_does_not_handle():
    x = torch.randn(4, 32, dtype=torch.float16)
    assert cpu_ops.add_rms_norm(x, None, torch.ones(32, dtype=torch.float16), 1e-6) is None
    assert cpu_ops.silu_mul(x) is None
    mixed = torch.randn(4, 32, dtype=torch.bfloat16)
    assert cpu_ops.add_rms_norm(mixed, torch.randn(4, 32), torch.ones(32, dtype=torch.bfloat16), 1e-6) is None
    cos = torch.ones(4, 8)
    assert not cpu_ops.rotary_(torch.randn(4, 32)[:, ::2], 2, 8, cos, cos)  # elements not contiguous


def test_remembered_rotary_tables_do_not_pass_other_tables():
    """rotary_ remembers the last cos/sin pair it accepted (every layer of a step passes the same two): another
    pair, or the same pair for another row count or dtype, is checked afresh, and declined ones leave x as it
    was; a strided x is declined whatever the tables."""
    torch.manual_seed(3)
    cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    x = torch.randn(4, 32)
    assert cpu_ops.rotary_(x.clone(), 2, 8, cos, sin)
    assert cpu_ops.rotary_(x.clone(), 2, 8, cos, sin)  # remembered
    for c, s_, xx in [
        (cos[:, ::1].t().contiguous().t(), sin, x),  # a transposed copy: not contiguous rows
        (cos, sin, x[:3]),  # rows the tables do not have
        (cos.double(), sin.double(), x),  # dtype of the tables
        (cos, sin, x.to(torch.bfloat16)),  # the remembered pair against another dtype of x
        (torch.randn(4, 6), torch.randn(4, 6), x),  # head size the tables do not have
    ]:
        before = xx.clone()
        assert not cpu_ops.rotary_(xx, 2, 8, c, s_)
        assert torch.equal(xx, before)
    assert not cpu_ops.rotary_(torch.randn(4, 64)[:, ::2], 2, 8, cos, sin)
    assert cpu_ops.rotary_(x.clone(), 2, 8, cos, sin)


# ---- bfloat16: computed in float32, every stored value rounded once to the nearest bfloat16 -------------


def _bf(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("tokens,hidden", [(1, 576), (300, 576), (5, 100)])
def test_bfloat16_rms_norm_with_residual(tokens, hidden):
    torch.manual_seed(hidden)
    x, res, w = (
        _bf(torch.randn(tokens, hidden) * 3),
        _bf(torch.randn(tokens, hidden)),
        _bf(torch.rand(hidden) + 0.5),
    )
    res_in = res.clone()
    out = cpu_ops.add_rms_norm(x, res_in, w, 1e-5)
    assert out.dtype == torch.bfloat16
    summed = _bf(x.float() + res.float())  # the residual stream is bfloat16
    assert torch.equal(res_in, summed)
    r = summed.float()
    want = _bf(w.float() * (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-5)))
    # float32 summation order differs from torch's: at most one bfloat16 step apart
    assert (out.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-7
    assert (out == want).float().mean() > 0.99
    plain = cpu_ops.add_rms_norm(x, None, w, 1e-5)
    xf = x.float()
    want_plain = _bf(w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)))
    assert (plain == want_plain).float().mean() > 0.99


def test_bfloat16_rotary_and_silu_mul():
    torch.manual_seed(0)
    t, heads, kv_heads, d = 29, 9, 3, 64
    rope = RotaryEmbedding(d, 10000.0, None, 4096, torch.device("cpu"))
    cos, sin = rope.cos_sin(torch.randint(0, 3000, (t,)), 3000, torch.bfloat16)
    qkv = _bf(torch.randn(t, (heads + 2 * kv_heads) * d))
    before = qkv.clone()
    assert cpu_ops.rotary_(qkv, heads + kv_heads, d, cos.view(t, d), sin.view(t, d))
    x = before[:, : (heads + kv_heads) * d].float().view(t, heads + kv_heads, d)
    c, s_ = cos.float(), sin.float()
    rotated = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)
    want = _bf(x * c + rotated * s_)
    got = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
    assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-7
    assert (got == want).float().mean() > 0.99
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], before[:, (heads + kv_heads) * d :])  # V untouched

    gate_up = _bf(torch.randn(33, 2 * 1536) * 4)
    g, u = gate_up.float().split(1536, dim=-1)
    want = _bf(torch.nn.functional.silu(g) * u)
    got = cpu_ops.silu_mul(gate_up)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-7
    assert (got == want).float().mean() > 0.99
