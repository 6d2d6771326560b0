"""The sampler's fast paths against a plain reference: greedy rows are an argmax of the logits as they are,
the logits are never changed in place, logprobs are computed only for the rows that want them, and the
result does not depend on which other rows share the batch."""

from __future__ import annotations

import random

import pytest
import torch
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.worker.sampler import SamplingRow, sample

VOCAB = 257


def row(params: SamplingParams, out=(), prompt=(1, 2, 3), seed=None, stop=(), chosen=True) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params, list(prompt), list(out), gen, list(stop), chosen)


def reference_greedy(logits: torch.Tensor, r: SamplingRow) -> int:
    """Penalties and min_tokens masking as documented, then argmax: one row, written out plainly."""
    x = logits.clone()
    p = r.params
    if p.repetition_penalty != 1.0:
        for t in set(r.prompt_token_ids) | set(r.output_token_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(r.output_token_ids):
        x[t] -= p.frequency_penalty * r.output_token_ids.count(t) + p.presence_penalty
    if len(r.output_token_ids) < p.min_tokens:
        x[r.stop_ids] = float("-inf")
    return int(x.argmax())


def test_greedy_rows_match_the_reference_and_leave_logits_untouched():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB) * 3
    before = logits.clone()
    rows = [
        row(SamplingParams(temperature=0)),
        row(SamplingParams(temperature=0, repetition_penalty=1.7), out=[5, 9]),
        row(SamplingParams(temperature=0, frequency_penalty=0.8, presence_penalty=0.3), out=[7, 7, 11]),
        row(SamplingParams(temperature=0, min_tokens=4), out=[1], stop=[int(logits[3].argmax())]),
        row(SamplingParams(temperature=0, logprobs=3)),
        row(SamplingParams(temperature=0), chosen=False),
    ]
    res = sample(logits, rows)
    assert torch.equal(logits, before)
    assert res.token_ids == [reference_greedy(logits[i], r) for i, r in enumerate(rows)]
    assert res.token_ids[3] != int(logits[3].argmax())  # the stop id really was masked
    raw = logits.log_softmax(-1)
    for i in (0, 1, 2, 3, 4):
        assert res.logprobs[i] == pytest.approx(float(raw[i, res.token_ids[i]]), abs=1e-5)
    assert res.logprobs[5] is None and res.top_logprobs[5] is None
    assert [t is None for t in res.top_logprobs] == [True, True, True, True, False, True]


def test_top_logprobs_entries():
    torch.manual_seed(1)
    logits = torch.randn(2, VOCAB)
    rows = [row(SamplingParams(temperature=0, logprobs=5)), row(SamplingParams(temperature=0, logprobs=0))]
    res = sample(logits, rows)
    raw = logits.log_softmax(-1)
    top = raw[0].topk(5)
    entry = res.top_logprobs[0]
    assert list(entry) == top.indices.tolist()  # the chosen (greedy) token is the top-1
    assert [e.rank for e in entry.values()] == [1, 2, 3, 4, 5]
    assert [e.logprob for e in entry.values()] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert list(res.top_logprobs[1]) == [res.token_ids[1]] and res.top_logprobs[1][res.token_ids[1]].rank == 1


def test_rank_of_a_sampled_token_that_is_not_the_best():
    logits = torch.full((1, VOCAB), -30.0)
    logits[0, :3] = torch.tensor([5.0, 4.0, 3.0])
    # min_tokens masks tokens 0 and 1, so the greedy choice is token 2: third in the raw distribution.
    res = sample(logits, [row(SamplingParams(temperature=0, logprobs=2, min_tokens=1), stop=[0, 1])])
    assert res.token_ids == [2]
    entry = res.top_logprobs[0]
    assert entry[2].rank == 3 and entry[0].rank == 1 and entry[1].rank == 2


@pytest.mark.parametrize("trial", range(5))
def test_seeded_rows_do_not_depend_on_their_batch(trial):
    """A seeded random row gives the same token alone and in a batch whose other rows take the copying path
    (penalties) or the plain greedy path."""
    rng = random.Random(trial)
    torch.manual_seed(trial)
    logits = torch.randn(4, VOCAB) * 2
    params = SamplingParams(temperature=0.8, top_k=rng.choice([0, 20]), top_p=rng.choice([1.0, 0.9]), seed=3)
    alone = sample(logits[1:2], [row(params, seed=trial)]).token_ids[0]
    batch = [
        row(SamplingParams(temperature=0, repetition_penalty=1.3), out=[4]),
        row(params, seed=trial),
        row(SamplingParams(temperature=0)),
        row(SamplingParams(temperature=1.0, min_p=0.1)),
    ]
    assert sample(logits, batch).token_ids[1] == alone


def test_lower_precision_logits():
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB).to(torch.bfloat16)
    res = sample(logits, [row(SamplingParams(temperature=0)) for _ in range(3)])
    assert res.token_ids == logits.float().argmax(-1).tolist()
    assert all(isinstance(v, float) for v in res.logprobs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_sampling_stays_on_the_gpu():
    torch.manual_seed(3)
    logits = torch.randn(4, VOCAB, device="cuda")
    rows = [
        row(SamplingParams(temperature=0)),
        row(SamplingParams(temperature=0, repetition_penalty=1.5), out=[2]),
        row(SamplingParams(temperature=0.7, seed=1), seed=1),
        row(SamplingParams(temperature=0, logprobs=2)),
    ]
    res = sample(logits, rows)
    cpu = sample(
        logits.cpu(), [row(r.params, r.output_token_ids, seed=1 if r.generator else None) for r in rows]
    )
    assert res.token_ids == cpu.token_ids
