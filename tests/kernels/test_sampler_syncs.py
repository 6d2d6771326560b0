"""The sampler waits for the GPU once per step: everything it reads back comes in one copy.

Counted without mocks: torch's sync debug mode warns at every operation that makes the host wait for the
device (a blocking copy either way, `.item()`, `.tolist()`, a synchronize). Here, under tests/kernels, so
that `make gpu-check` runs them on its GPU; elsewhere they are skipped. The CPU test checks what the one
copy carries against the plain computation.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.worker.sampler import SamplingRow, sample

VOCAB = 1000
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rows(kind: str) -> list[SamplingRow]:
    def row(seed=None, out=(5, 9), **params) -> SamplingRow:
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        return SamplingRow(SamplingParams(**params), [1, 2, 3], list(out), gen, [2])

    if kind == "greedy":
        return [row(temperature=0.0) for _ in range(8)]
    if kind == "greedy_logprobs":
        return [row(temperature=0.0, logprobs=3) for _ in range(3)] + [row(temperature=0.0)] * 5
    # everything at once: penalties, bias, min_tokens, seeded and unseeded draws with filters, logprobs
    return [
        row(temperature=0.0, repetition_penalty=1.3),
        row(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.2, logit_bias={7: 4.0}),
        row(temperature=0.0, min_tokens=4, logprobs=2),
        row(temperature=0.8, top_k=20, seed=3),
        row(temperature=1.0, top_p=0.9, min_p=0.05),
        row(temperature=0.7, seed=11, logprobs=1),
    ]


def _synchronizing_calls(fn):
    """(fn's result, how many times fn made the host wait for the device)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return result, sum("synchroniz" in str(w.message) for w in caught)


@needs_cuda
@pytest.mark.parametrize("kind", ["greedy", "greedy_logprobs", "mixed"])
def test_a_step_waits_for_the_gpu_once(kind):
    logits = torch.randn(len(_rows(kind)), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    on_gpu = logits.cuda()
    sample(on_gpu, _rows(kind))  # first call: lazy CUDA initialisation, pinned memory's first blocks
    result, syncs = _synchronizing_calls(lambda: sample(on_gpu, _rows(kind)))
    assert syncs == 1, f"{syncs} host syncs in one sampling step"
    if kind != "mixed":  # (the unseeded draws differ between devices)
        on_cpu = sample(logits, _rows(kind))
        assert result.token_ids == on_cpu.token_ids
        assert result.logprobs == pytest.approx(on_cpu.logprobs, abs=1e-4)
        for got, want in zip(result.top_logprobs, on_cpu.top_logprobs, strict=True):
            assert (got is None) == (want is None)
            if got is not None:
                assert list(got) == list(want)
                assert all(got[t].rank == want[t].rank for t in got)


def test_what_the_one_copy_carries_is_the_plain_computation():
    """Ids, chosen logprobs and top-logprob entries of a mixed batch on the CPU (the same packing as on a
    GPU) against log_softmax and topk of the rows, one at a time."""
    rows = _rows("mixed")
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    result = sample(logits, rows)
    raw = logits.log_softmax(dim=-1)
    for i, r in enumerate(rows):
        token = result.token_ids[i]
        assert 0 <= token < VOCAB
        assert result.logprobs[i] == pytest.approx(float(raw[i, token]), abs=1e-5)
        if r.params.logprobs is None:
            assert result.top_logprobs[i] is None
            continue
        entry = result.top_logprobs[i]
        assert entry[token].rank == int((raw[i] > raw[i, token]).sum()) + 1
        top = raw[i].topk(r.params.logprobs)
        for rank, (value, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
            assert entry[tid].logprob == pytest.approx(value, abs=1e-6)
            assert tid == token or entry[tid].rank == rank
    # greedy rows are argmaxes of the penalised logits; with no penalty, of the logits as they are
    assert result.token_ids[2] == int(logits[2].masked_fill(torch.arange(VOCAB) == 2, float("-inf")).argmax())
