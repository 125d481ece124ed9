"""Fit ``time = latency + bus_bytes / bandwidth`` to measured collective times (numpy only).

The fit minimises the *relative* error, sum(((a + b x - t) / t)^2), not the absolute one:
message sizes span six orders of magnitude, and an ordinary least-squares fit would be set by
the largest messages alone and predict small ones (where latency dominates) badly. Latency is
kept >= 0 and bandwidth > 0; when the free fit wants a negative latency, latency is pinned to 0
and the bandwidth refitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from partita.errors import PartitaError


@dataclass(frozen=True, kw_only=True)
class LinearFit:
    latency_s: float
    seconds_per_byte: float

    @property
    def bandwidth_gbps(self) -> float:
        return 1.0 / (self.seconds_per_byte * 1e9)

    def predict_s(self, bus_bytes: float) -> float:
        return self.latency_s + bus_bytes * self.seconds_per_byte


def bus_bytes(op: str, message_bytes: int, ranks: int) -> float:
    """The bytes one rank moves for a collective on a ``message_bytes`` buffer (ring algorithms).

    ``message_bytes`` is the full buffer: the all-reduce input, the all-gather output, the
    reduce-scatter input, the p2p message. This is the convention of ``partita.profile``.
    """
    if op == "all_reduce":
        return 2.0 * (ranks - 1) / ranks * message_bytes
    if op in ("all_gather", "reduce_scatter"):
        return (ranks - 1) / ranks * message_bytes
    if op == "p2p":
        return float(message_bytes)
    raise PartitaError(f"unknown collective {op!r}; valid: all_reduce, all_gather, reduce_scatter, p2p")


def fit_latency_bandwidth(bus: Sequence[float], seconds: Sequence[float]) -> LinearFit:
    """Weighted least squares of seconds on bus bytes, weights 1/seconds (relative error)."""
    x = np.asarray(bus, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if x.shape != t.shape or x.size < 2:
        raise ValueError(f"need at least two (bytes, seconds) points of equal count, got {x.size} and {t.size}")
    if np.any(t <= 0) or np.any(x < 0):
        raise ValueError("times must be positive and sizes non-negative")
    w = 1.0 / t
    design = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if a < 0 or b <= 0:
        # Pin latency to zero and fit the slope alone: minimise sum((b x / t - 1)^2).
        a = 0.0
        r = x / t
        b = float(r.sum() / (r @ r)) if (r @ r) > 0 else 0.0
    if b <= 0:
        # Every message took the same time (sizes too small to see bandwidth): a pure latency.
        a = float(np.median(t))
        b = 1e-15
    return LinearFit(latency_s=float(a), seconds_per_byte=float(b))


def relative_errors(fit: LinearFit, bus: Sequence[float], seconds: Sequence[float]) -> list[float]:
    """|predicted - measured| / measured for each point."""
    return [abs(fit.predict_s(x) - t) / t for x, t in zip(bus, seconds)]
