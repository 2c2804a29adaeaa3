"""When each request is released: a Poisson process at `request_rate`, or all at once."""

# As in SGLang's bench_serving, the first request goes at t = 0 and the gap before each next one is
# exponential with mean 1 / rate, so arrivals form a Poisson process. A concurrency limit applies on top:
# a released request still waits for a free slot.

from __future__ import annotations

import math

import numpy as np


def arrival_times(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Seconds from the start at which request i is released (non-decreasing, first 0.0)."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if math.isnan(request_rate) or request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate!r}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / request_rate, size=max(num_requests - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:num_requests]
