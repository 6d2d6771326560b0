"""Sigmoid routing (scoring_func "sigmoid", DeepSeek-V3-style routers) in the fused MoE layer: `route` against
its one-token-at-a-time twin (with and without renormalisation, a correction bias on the choice, a scaling
factor), and the layer on both paths (CPU grouped matmul; Triton grouped GEMM, interpreted here) against the
twin's experts."""

import pytest
import torch
from pagoda.engine.models.moe import SparseMoE, route
from pagoda.engine.sizing.model_config import ModelConfig
from pagoda.kernels.moe_reference import fused_experts_ref, route_ref


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("biased", [False, True])
def test_route_matches_the_twin(scoring, renormalize, biased):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(17, 12, generator=g) * 2
    logits[:, [4, 9]] = -1e4  # never chosen
    bias = torch.randn(12, generator=g) if biased else None
    got = route(logits, 3, renormalize, scoring, bias, scale=2.5)
    want = route_ref(logits, 3, renormalize, scoring, bias, scale=2.5)
    assert torch.equal(got[1].sort(-1).values, want[1].sort(-1).values)
    order_got, order_want = got[1].argsort(-1), want[1].argsort(-1)
    torch.testing.assert_close(
        got[0].gather(-1, order_got), want[0].gather(-1, order_want), atol=1e-6, rtol=1e-6
    )
    if scoring == "sigmoid" and not renormalize:
        assert (got[0] / 2.5 <= 1).all()  # sigmoid scores, not a distribution over the experts


def test_an_unknown_scoring_is_refused():
    with pytest.raises(ValueError, match="scoring_func 'tanh'"):
        route(torch.zeros(2, 4), 2, True, "tanh")


@pytest.mark.parametrize("triton", [False, True])
def test_the_layer_routes_by_sigmoid(triton):
    cfg = ModelConfig("qwen3_moe", 64, 48, 40, 1, 4, 2, 12, num_experts=6, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, scoring_func="sigmoid")  # fmt: skip
    layer = SparseMoE(cfg, torch.float32, torch.device("cpu"), triton=triton)
    g = torch.Generator().manual_seed(11)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(13, 48, generator=g)
    logits = x @ layer.router.T
    weights, ids = route_ref(logits, 2, True, "sigmoid")
    want = fused_experts_ref(x, layer.w13, layer.w2, weights, ids)
    torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-4)
    softmax_weights, softmax_ids = route_ref(logits, 2, True, "softmax")
    assert not torch.allclose(fused_experts_ref(x, layer.w13, layer.w2, softmax_weights, softmax_ids), want)
