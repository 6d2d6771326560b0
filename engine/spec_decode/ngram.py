"""N-gram prompt lookup: guess the next tokens by finding the sequence's last n tokens earlier in its own
prompt and output, and proposing what followed there. No weights, a few microseconds per sequence; it
hits when the output copies its input (editing, summarising, code) and proposes nothing otherwise."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the earliest earlier occurrence of the longest suffix of ``tokens``
    of ``min_n`` to ``max_n`` tokens; [] when no such suffix occurs earlier. The earliest occurrence: in
    an editing prompt that is the original text, which runs on the longest."""
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # window i is arr[i : i + n], for every i whose window is followed by at least one token
        windows = sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == arr[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return arr[start : start + k].tolist()
    return []
