"""Fit ``time = latency + bus_bytes / bandwidth`` to measured collective times (numpy only).

The fit minimises the *relative* error, sum(((a + b x - t) / t)^2), not the absolute one:
message sizes span six orders of magnitude, and an ordinary least-squares fit would be set by
the largest messages alone and predict small ones (where latency dominates) badly. Latency is
kept >= 0 and bandwidth > 0 (a two-variable non-negative least squares); where the best fit has
no bandwidth term at all (every size took the same time), there is no fit: the sizes were too
small to show the link's bandwidth, and the caller says so rather than invent one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np



@dataclass(frozen=True, kw_only=True)
class LinearFit:
    latency_s: float
    seconds_per_byte: float

    @property
    def bandwidth_gbps(self) -> float:
        return 1.0 / (self.seconds_per_byte * 1e9)

    def predict_s(self, bus_bytes: float) -> float:
        return self.latency_s + bus_bytes * self.seconds_per_byte


def fit_latency_bandwidth(bus: Sequence[float], seconds: Sequence[float]) -> LinearFit | None:
    """Weighted least squares of seconds on bus bytes, weights 1/seconds (relative error),
    with latency >= 0 and bandwidth > 0; None when the times do not grow with size (the sizes
    were too small, or too noisy, to show a bandwidth)."""
    x = np.asarray(bus, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if x.shape != t.shape or x.size < 2:
        raise ValueError(f"need at least two (bytes, seconds) points of equal count, got {x.size} and {t.size}")
    if np.any(t <= 0) or np.any(x < 0):
        raise ValueError("times must be positive and sizes non-negative")
    # In relative terms: minimise |A @ (a, b) - 1|^2 with A = [1/t, x/t], a, b >= 0. With two
    # unknowns the constrained optimum is the free one or lies on an axis (a = 0 or b = 0).
    A = np.stack([1.0 / t, x / t], axis=1)
    ones = np.ones_like(t)
    candidates = []
    (a, b), *_ = np.linalg.lstsq(A, ones, rcond=None)
    if a >= 0 and b > 0:
        candidates.append((float(a), float(b)))
    for col in (0, 1):  # one unknown alone: the other pinned to zero
        v = A[:, col]
        coef = float(v @ ones / (v @ v))
        if coef > 0:
            candidates.append((coef, 0.0) if col == 0 else (0.0, coef))
    if not candidates:
        return None
    a, b = min(candidates, key=lambda ab: float(np.sum((A @ np.array(ab) - 1.0) ** 2)))
    if b <= 0:
        return None
    return LinearFit(latency_s=a, seconds_per_byte=b)


def relative_errors(fit: LinearFit, bus: Sequence[float], seconds: Sequence[float]) -> list[float]:
    """|predicted - measured| / measured for each point."""
    return [abs(fit.predict_s(x) - t) / t for x, t in zip(bus, seconds)]
