"""Means with their 95% Student-t intervals over seeds, and ratios paired per seed: what `fastserve compare` and
the experiment harness (scripts/experiments/steady_state.py) report. Standard library only, so that a simulation
worker can import it without the server's modules."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

# Student's t, 97.5% quantile, by degrees of freedom (the 95% two-sided interval); 1.96 beyond 30
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042}


def t_975(df: int) -> float:
    """Student's t 97.5% quantile for df degrees of freedom (the table's entry at or below df; 1.96 past 30)."""
    if df > 30:
        return 1.96
    return T_975[max(k for k in T_975 if k <= df)]


def interval(values: Sequence[float]) -> dict:
    """{"mean", "half", "low", "high", "values"}: the mean and the 95% Student-t interval of the values (half-width
    nan for fewer than two)."""
    values = list(values)
    mean = statistics.fmean(values) if values else math.nan
    half = t_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return {"mean": mean, "half": half, "low": mean - half, "high": mean + half, "values": values}


def paired_ratios(num: Sequence[float], den: Sequence[float]) -> dict:
    """interval() of num[i] / den[i], pairs of the same seed (a pair with a non-positive or nan den is left out)."""
    return interval([a / b for a, b in zip(num, den) if b > 0])
