"""Look up a layer's measured cost at any micro-batch: pure Python and numpy, never torch.

The search imports this module (``from partita.profiler.interpolate import interpolate``), so
it imports only ``partita`` (the specs) and nothing that reaches torch; ``partita.profiler``'s
``__init__`` imports nothing for the same reason.

How a cost is read from the measured points of one (layer kind, TP width, sequence length):

* the micro-batch was measured: that point, as measured;
* between two measured micro-batches m0 < m < m1: every quantity linear in the micro-batch
  between the two neighbours (activation memory is exactly linear in it; time is close to
  linear once the device is busy, and between neighbours the error is small);
* above the largest measured m_k: proportional, ``cost(m) = cost(m_k) * m / m_k`` (per-sample
  cost stays constant once the device is saturated);
* below the smallest measured m_1: linear through the two smallest points, clamped between
  proportional scaling ``cost(m_1) * m / m_1`` (no fixed overhead at all) and ``cost(m_1)``
  (all of it fixed overhead); with one point, proportional;
* parameter memory does not depend on the micro-batch: the measured value.

Anything else -- a TP width or sequence length that was not measured, a kind the profile does
not hold -- is ``None``, and the caller falls back to the analytic model.
"""

from __future__ import annotations

import dataclasses

from partita.model import LayerKind
from partita.profile import LayerCost, Profile

_SCALED = ("forward_s", "backward_s", "recompute_s", "activation_bytes")


def interpolate(profile: Profile, kind: LayerKind, tp: int, micro_batch: int, seq_len: int) -> LayerCost | None:
    """The cost of ``kind`` at shard width ``tp``, ``micro_batch`` and ``seq_len``, or None."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    points = profile.layer_points(kind, tp, seq_len)
    if not points:
        return None
    by_mb = {p.micro_batch: p for p in points}
    if micro_batch in by_mb:
        return by_mb[micro_batch]
    values = {name: _value_at(points, name, micro_batch) for name in _SCALED}
    values["activation_bytes"] = int(round(values["activation_bytes"]))
    return dataclasses.replace(points[0], micro_batch=micro_batch, **values)


def _value_at(points: list[LayerCost], name: str, m: int) -> float:
    mbs = [p.micro_batch for p in points]
    ys = [float(getattr(p, name)) for p in points]
    if m > mbs[-1]:
        return ys[-1] * m / mbs[-1]
    if m < mbs[0]:
        proportional = ys[0] * m / mbs[0]
        if len(points) == 1:
            return proportional
        linear = _line(mbs[0], ys[0], mbs[1], ys[1], m)
        return min(max(linear, proportional), ys[0])
    for i in range(len(mbs) - 1):
        if mbs[i] < m < mbs[i + 1]:
            return _line(mbs[i], ys[i], mbs[i + 1], ys[i + 1], m)
    raise AssertionError("unreachable: m is measured, above, below or between")


def _line(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
