"""Arrival processes: when each request of a workload is sent, in seconds after the start of the run.

What this is: seeded arrival times for `workload.py`, with vLLM benchmark_serving's semantics:
  * gamma_arrivals(n, rate, burstiness): inter-arrival gaps ~ Gamma(shape=burstiness,
    scale=1/(rate*burstiness)), so the mean gap is 1/rate for every burstiness; burstiness 1 is a Poisson
    process, smaller is burstier (variance of a gap = 1/(rate^2 * burstiness)). The first request arrives
    at 0 and request i after i gaps, as vLLM sends its first request at once; rate inf sends all at 0.
  * poisson_arrivals(n, rate) = gamma_arrivals(n, rate, 1).
  * trace_arrivals(timestamps, speedup): a trace's own times, made relative to its first request and
    divided by `speedup` (2 = the same trace twice as fast); speedup_for_rate finds the speedup that gives a mean
    rate, and interarrival_cv measures how bursty a run of times is.
What this is not: a scheduler of sends (loadgen.py sleeps until each time) or a dataset reader.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def gamma_arrivals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """n non-decreasing arrival times starting at 0; see the module docstring."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """A Poisson process at `rate` requests per second (exponential gaps)."""
    return gamma_arrivals(n, rate, 1.0, seed)


def trace_arrivals(timestamps: Sequence[float], speedup: float = 1.0) -> list[float]:
    """Times relative to the first timestamp, divided by speedup; the trace must not go backwards."""
    if not (speedup > 0 and math.isfinite(speedup)):
        raise ValueError(f"trace speedup must be a finite number > 0, got {speedup}")
    if not timestamps:
        return []
    t0 = timestamps[0]
    out = [(t - t0) / speedup for t in timestamps]
    for i in range(1, len(out)):
        if out[i] < out[i - 1]:
            raise ValueError(f"trace timestamps go backwards at index {i}")
    return out


def speedup_for_rate(arrivals: Sequence[float], rate: float) -> float:
    """The factor to divide trace arrival times by so that their mean rate, (n - 1) / (last - first), is `rate`."""
    if len(arrivals) < 2 or arrivals[-1] <= arrivals[0]:
        raise ValueError("need at least two arrivals spanning a positive time")
    return rate / ((len(arrivals) - 1) / (arrivals[-1] - arrivals[0]))


def interarrival_cv(arrivals: Sequence[float]) -> float:
    """Coefficient of variation (stdev / mean) of the gaps between sorted arrivals: 1 for Poisson, 1/sqrt(b) for
    gamma arrivals of burstiness b."""
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    mean = sum(gaps) / len(gaps)
    return math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
