"""The statistics the benchmarks print, written once: medians and percentiles of samples, and ratios."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable


def median(values: Iterable[float]) -> float:
    """The median, or NaN for no samples (a side that measured nothing prints as such, not as 0)."""
    values = list(values)
    return statistics.median(values) if values else math.nan


def pct(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100), interpolated between samples; NaN for none, the sample itself for one."""
    values = sorted(values)
    if len(values) < 2:
        return values[0] if values else math.nan
    rank = (len(values) - 1) * q / 100
    low = math.floor(rank)
    return values[low] + (values[min(low + 1, len(values) - 1)] - values[low]) * (rank - low)


def ratio(a: float | None, b: float | None) -> float:
    """``a / b``, NaN where either is missing or ``b`` is 0."""
    return a / b if a is not None and b else math.nan
