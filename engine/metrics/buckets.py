"""Histogram buckets, exactly vLLM's, so dashboards' `histogram_quantile` queries line up."""

from __future__ import annotations

TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TTFT += [20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TOKEN_LATENCY += [20.0, 40.0, 80.0]
REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
REQUEST_LATENCY += [120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
PARAMS_N = [1, 2, 5, 10, 20]
ITERATION_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
NUM_PREEMPTIONS = [1, 2, 3, 4, 5, 10, 20]
OFFLOAD_SECONDS = [
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
]


def one_two_five(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including max_value (vLLM's build_1_2_5_buckets)."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1
