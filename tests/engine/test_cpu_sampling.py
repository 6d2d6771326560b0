"""The one-pass greedy kernel against torch's argmax and log-softmax, and the sampler's use of it."""

from __future__ import annotations

import pytest
import torch
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.worker import cpu_sampling
from pagoda.engine.worker.sampler import SamplingRow, sample


@pytest.fixture(autouse=True)
def _every_variant(cpu_variant) -> None:
    """Every test on each kernel variant this CPU runs."""


@pytest.mark.parametrize("rows,vocab", [(1, 5), (3, 17), (64, 49152), (7, 1000), (5, 31)])
def test_argmax_and_logprob_match_torch(rows, vocab):
    torch.manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab) * 4
    want = [i % 2 == 0 for i in range(rows)]
    ids, lps = cpu_sampling.greedy(logits, want)
    assert ids == logits.argmax(dim=-1).tolist()
    ref = logits.log_softmax(dim=-1).gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)
    for i in range(rows):
        if want[i]:
            assert lps[i] == pytest.approx(ref[i].item(), abs=1e-4)
        else:
            assert lps[i] is None


def test_ties_take_the_first_index_like_torch():
    logits = torch.zeros(4, 100)
    logits[0, [3, 40, 77]] = 5.0  # ties inside one 16-lane vector and across vectors
    logits[1, [96, 99]] = 2.0  # ties in the scalar tail
    logits[2, [15, 16]] = 1.0  # across the boundary of two vectors
    ids, _ = cpu_sampling.greedy(logits, [True] * 4)
    assert ids == [3, 96, 15, 0] == logits.argmax(dim=-1).tolist()


def test_masked_logits_and_strided_rows():
    torch.manual_seed(1)
    base = torch.randn(6, 300)
    base[:, 50:] = float("-inf")  # a masked vocabulary
    view = base[::2]  # rows two apart
    ids, lps = cpu_sampling.greedy(view, [True] * 3)
    assert ids == view.argmax(dim=-1).tolist()
    ref = view.log_softmax(dim=-1).max(dim=-1).values
    assert lps == pytest.approx(ref.tolist(), abs=1e-5)


def test_kernel_declines_what_it_does_not_cover():
    assert cpu_sampling.greedy(torch.randn(2, 10, dtype=torch.float64), [True, True]) is None
    assert cpu_sampling.greedy(torch.randn(10, 2).t(), [True, True]) is None  # column-strided rows


def _rows(params: list[SamplingParams]) -> list[SamplingRow]:
    return [SamplingRow(p, [1, 2, 3], [4], None, [0]) for p in params]


def test_sampler_fast_path_gives_the_torch_path_answer(monkeypatch):
    torch.manual_seed(2)
    logits = torch.randn(8, 4096) * 3
    rows = _rows([SamplingParams(temperature=0.0, max_tokens=4) for _ in range(8)])
    fast = sample(logits, rows)
    monkeypatch.setattr(cpu_sampling, "greedy", lambda *a: None)
    slow = sample(logits, rows)
    assert fast.token_ids == slow.token_ids
    assert fast.logprobs == pytest.approx(slow.logprobs, abs=1e-4)
    assert fast.top_logprobs == slow.top_logprobs == [None] * 8


def test_sampler_keeps_the_torch_path_for_penalties_and_top_logprobs(monkeypatch):
    calls = []
    real = cpu_sampling.greedy
    monkeypatch.setattr(cpu_sampling, "greedy", lambda *a: calls.append(1) or real(*a))
    logits = torch.randn(2, 64)
    sample(logits, _rows([SamplingParams(temperature=0.0, repetition_penalty=1.3)] * 2))
    sample(logits, _rows([SamplingParams(temperature=0.0, logprobs=2)] * 2))
    assert calls == []
    sample(logits, _rows([SamplingParams(temperature=0.0)] * 2))
    assert calls == [1]
