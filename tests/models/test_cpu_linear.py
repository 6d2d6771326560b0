"""oneDNN linears with packed weights against F.linear, and the pack following its weight."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from pagoda.engine.models import cpu_linear
from pagoda.engine.models.layers import Linear
from pagoda.kernels.cpu import loader


@pytest.fixture(autouse=True)
def _onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pinned CPU torch is built with oneDNN: its absence is a failure here, not a skip."""
    monkeypatch.delenv("PAGODA_ONEDNN_LINEAR", raising=False)
    assert cpu_linear.enabled()


@pytest.mark.parametrize("rows,k,n,bias", [(1, 576, 1728, False), (64, 64, 96, True), (300, 37, 5, True)])
@pytest.mark.parametrize("choice", ["onednn", "ours", "auto"])
def test_packed_linear_matches_f_linear(rows, k, n, bias, choice, monkeypatch):
    """Each side of the small-rows choice (forced by PAGODA_CPU_LINEAR, or measured) gives F.linear's values."""
    monkeypatch.setenv("PAGODA_CPU_LINEAR", choice)
    cpu_linear.refresh()  # a module's linear reads the switches as the step last read them
    torch.manual_seed(rows + k + n)
    layer = Linear(k, n, bias, torch.float32, torch.device("cpu"))
    layer.weight.copy_(torch.randn(n, k) / k**0.5)
    if bias:
        layer.bias.copy_(torch.randn(n))
    x = torch.randn(rows, k)
    got = layer(x)
    if choice != "auto":  # the oneDNN path ran, or the small-rows product (forced: nothing measured)
        small = choice == "ours" and rows <= cpu_linear.SMALL_ROWS_MAX and loader.current().lib is not None
        assert (layer.packed._packed is None) == small
    want = F.linear(x, layer.weight, layer.bias)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4


def test_three_dimensional_and_strided_inputs():
    torch.manual_seed(0)
    w, packed = torch.randn(24, 40), cpu_linear.PackedWeight()
    x3 = torch.randn(2, 5, 40)
    assert torch.allclose(cpu_linear.linear(x3, w, None, packed), F.linear(x3, w), atol=1e-4)
    wide = torch.randn(6, 100)[:, 10:50]
    assert torch.allclose(cpu_linear.linear(wide, w, None, packed), F.linear(wide, w), atol=1e-4)


def test_the_pack_follows_an_in_place_weight_change():
    torch.manual_seed(1)
    w, packed = torch.randn(16, 32), cpu_linear.PackedWeight()
    x = torch.randn(4, 32)
    first = cpu_linear.linear(x, w, None, packed)
    w.mul_(-2.0)  # a reload writes into the same storage
    second = cpu_linear.linear(x, w, None, packed)
    assert torch.allclose(second, -2.0 * first, atol=1e-4)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("PAGODA_ONEDNN_LINEAR", "0")
    w, packed = torch.randn(8, 8), cpu_linear.PackedWeight()
    x = torch.randn(3, 8)
    assert torch.equal(cpu_linear.linear(x, w, None, packed), F.linear(x, w))
    assert packed._packed is None


def test_other_dtypes_and_grad_take_f_linear():
    packed = cpu_linear.PackedWeight()
    w64 = torch.randn(4, 4, dtype=torch.float64)
    assert packed.get(w64) is None
    wg = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4)
    y = cpu_linear.linear(x, wg, None, packed)
    y.sum().backward()  # autograd still works: F.linear ran
    assert wg.grad is not None


@pytest.mark.parametrize("k", [576, 1536, 23])
def test_small_rows_product_on_every_variant(k, cpu_variant, monkeypatch):
    """Streamed (1-8) and tiled (9-64) row counts, strided x, a weight that is a column slice of a wider one
    with a row count that ends in a partial tile, one to three threads, against a float64 product; 65 rows,
    another dtype and the environment switch decline it; `linear` gives the same values whichever side the
    host's measured choice takes."""
    torch.manual_seed(k)
    lib = cpu_variant.lib
    n = 299  # 24 chunks of twelve rows, then three tiles and a two-row one
    w = torch.randn(n, k + 7)[:, 3 : 3 + k]
    for rows in (*range(1, 10), 11, 12, 13, 31, cpu_linear.SMALL_ROWS_MAX):
        x = torch.randn(rows, k + 5)[:, :k]
        want = (x.double() @ w.double().T).float()
        out = torch.full((rows, n), float("nan"))
        threads = 1 + rows % 3
        assert lib.pagoda_small_rows_f32(x.data_ptr(), rows, k, x.stride(0), w.data_ptr(), n, w.stride(0),
                                         out.data_ptr(), n, threads) == 0  # fmt: skip
        assert (out - want).abs().max().item() < 1e-4 * k**0.5, rows
        wb = w.to(torch.bfloat16)  # a strided bfloat16 weight, widened exactly in the kernel
        want_b = (x.double() @ wb.double().T).float()
        out.fill_(float("nan"))
        assert lib.pagoda_small_rows_bf16w(x.data_ptr(), rows, k, x.stride(0), wb.data_ptr(), n, wb.stride(0),
                                           out.data_ptr(), n, threads) == 0  # fmt: skip
        assert (out - want_b).abs().max().item() < 1e-4 * k**0.5, rows
        assert cpu_linear.small_rows(x, wb) is not None
        bias = torch.randn(n)
        got = cpu_linear.linear(x, w, bias, cpu_linear.PackedWeight())
        assert (got - (want + bias)).abs().max().item() < 1e-4 * k**0.5, rows
    assert cpu_variant.small_rows == (cpu_variant.variant != "baseline")  # the vector product
    x = torch.randn(cpu_linear.SMALL_ROWS_MAX + 1, k)
    assert lib.pagoda_small_rows_f32(x.data_ptr(), len(x), k, k, w.data_ptr(), n, w.stride(0), 0, n, 2) == 1
    assert cpu_linear.small_rows(x, w) is None
    assert cpu_linear.small_rows(x[:2].double(), w.double()) is None
    assert cpu_linear.small_rows(x[:2], w) is not None
    monkeypatch.setenv("PAGODA_ONEDNN_LINEAR", "0")
    assert cpu_linear.small_rows(x[:2], w) is None


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_bfloat16_linears_compute_in_float32_without_bfloat16_multiplies(rows, monkeypatch):
    """On an x86 CPU without bfloat16 multiply instructions a bfloat16 linear is the float32 product of the
    bfloat16 values rounded once to bfloat16 (at most one bfloat16 step from it: summation order), through a
    float32 pack or the small-rows product; with bfloat16 multiplies it is oneDNN's bfloat16 product or the
    AVX512-BF16 small-rows product (float32 sums of exact products), both rounded once."""
    torch.manual_seed(rows)
    bf = torch.bfloat16
    w, bias = torch.randn(96, 200).to(bf), torch.randn(96).to(bf)
    x = torch.randn(rows, 200).to(bf)
    want = (x.double() @ w.double().T + bias.double()).to(bf)
    flags = loader.cpu_flags()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    widens = x86 and not flags & {"avx512_bf16", "amx_bf16"}
    assert cpu_linear.bfloat16_widens() == widens
    for choice in ("onednn", "ours", "auto"):
        monkeypatch.setenv("PAGODA_CPU_LINEAR", choice)
        packed = cpu_linear.PackedWeight()
        got = cpu_linear.linear(x, w, bias, packed)
        assert got.dtype == bf
        assert ((got.double() - want.double()).abs() <= want.double().abs() * 2**-7 + 1e-6).all(), choice
        if choice == "onednn" or rows > cpu_linear.SMALL_ROWS_MAX:  # on a float32 pack where bfloat16 widens
            assert packed._packed is not None and packed._packed.dtype == (torch.float32 if widens else bf)
    monkeypatch.setenv("PAGODA_ONEDNN_LINEAR", "0")
    assert not cpu_linear.bfloat16_widens()
    assert torch.equal(cpu_linear.linear(x, w, bias, cpu_linear.PackedWeight()), F.linear(x, w, bias))


@pytest.mark.parametrize("choice", ["onednn", "ours"])
@pytest.mark.parametrize(
    "dtypes", [(torch.float32,) * 2, (torch.float32, torch.bfloat16), (torch.bfloat16,) * 2]
)
def test_remembered_routes_give_the_values_of_deciding_each_call(choice, dtypes, monkeypatch):
    """`step_linear` decides a product's route once per layout and remembers it on the PackedWeight: its first
    and later calls give exactly what deciding on every call (`_linear`) gives, for decode and prefill rows, with
    and without a bias, strided x; a switch read by `refresh` takes a new route."""
    monkeypatch.setenv("PAGODA_CPU_LINEAR", choice)
    settings = cpu_linear.refresh()
    x_dtype, w_dtype = dtypes
    torch.manual_seed(7)
    w, bias = torch.randn(40, 72).to(w_dtype), torch.randn(40).to(x_dtype)
    packed = cpu_linear.PackedWeight()
    for rows in (1, 3, 17, 64, 65, 100):
        for b in (None, bias):
            for x in (torch.randn(rows, 72).to(x_dtype), torch.randn(rows, 80).to(x_dtype)[:, 4:76]):
                want = cpu_linear._linear(x, w, b, cpu_linear.PackedWeight(), settings)
                got = cpu_linear.step_linear(x, w, b, packed)
                assert torch.equal(got, want), (
                    rows,
                    b is None,
                    x.stride(),
                    (got - want).abs().max(),
                    got.dtype,
                    want.dtype,
                )
                assert torch.equal(cpu_linear.step_linear(x, w, b, packed), want), (rows, b is None)
    # one per row count, whatever the bias and row stride (above 64 rows one); and the float32 product's where
    # bfloat16 widens to it
    widened = settings.widens and x_dtype == w_dtype == torch.bfloat16
    assert len(packed.routes) == 5 * (2 if widened else 1)
    assert cpu_linear.refresh() is settings  # the switches unchanged: the routes stay valid
    monkeypatch.setenv("PAGODA_ONEDNN_LINEAR", "0")
    assert cpu_linear.refresh() is not settings
    x, packed = torch.randn(2, 72).to(x_dtype), cpu_linear.PackedWeight()
    want = F.linear(x.float(), w.float(), bias.float()) if x_dtype != w_dtype else F.linear(x, w, bias)
    assert torch.equal(cpu_linear.step_linear(x, w, bias, packed), want)
    assert packed._packed is None
