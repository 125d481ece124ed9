"""Measured against analytic for ``partita profile``: the same layer points priced by ``partita.search.analytic``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

from partita.devices import get_device
from partita.profile import LayerCost

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Comparison:
    measured: LayerCost
    analytic: LayerCost
    analytic_activation_bytes: int

    def ratio(self, field: str) -> float:
        """measured / analytic of one LayerCost field (activation_bytes: the analytic count)."""
        a = self.analytic_activation_bytes if field == "activation_bytes" else getattr(self.analytic, field)
        return getattr(self.measured, field) / a if a else float("inf")


def compare(points: Iterable[LayerCost], device: str, dtype: str) -> list[Comparison] | None:
    """One comparison per measured point; None where the analytic model is not importable."""
    try:
        from partita.search.analytic import activation_bytes, layer_cost
    except ImportError as e:
        log.info("no analytic model to compare with (%s)", e)
        return None
    dev = get_device(device)
    out = []
    for p in points:
        a = layer_cost(p.kind, dev, tp=p.tp, micro_batch=p.micro_batch, seq_len=p.seq_len, dtype=dtype)
        kw = dict(tp=p.tp, micro_batch=p.micro_batch, seq_len=p.seq_len, dtype=dtype,
                  sequence_parallel=False, recompute="none")
        try:  # the CPU runs composite norms that keep more (see search.analytic)
            act = activation_bytes(p.kind, on_cpu=dev.is_cpu, **kw)
        except TypeError:
            act = activation_bytes(p.kind, **kw)
        out.append(Comparison(measured=p, analytic=a, analytic_activation_bytes=int(act)))
    return out
