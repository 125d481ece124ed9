"""Time and money: how long a plan takes to train on N tokens, the GPU-hours per device type,
and what they cost at each device's price per GPU-hour.

    partita plan --model llama-3-8b --cluster 2x8xH100+2x8xA100-80GB --tokens 2T
    partita show plan.yaml --tokens 500B

Prices are the device catalog's defaults (``partita.devices.PRICE_SOURCE`` names where they come
from) unless a node group in the cluster YAML sets ``price_per_gpu_hour``. A device type with
no price has its GPU-hours reported and its cost left out (and said so), never guessed.
GPU-hours count the devices the plan runs on; devices of the cluster the plan leaves idle are
reported separately, as what they cost if they stay reserved for the run.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from partita.cluster import ClusterSpec
from partita.errors import PartitaError
from partita.plan import Plan

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}
_TOKENS = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgtp]?)\s*$", re.IGNORECASE)


def parse_tokens(text: str) -> int:
    """``2T``, ``500B``, ``1.5e12``, ``300M``, ``4096``: a positive token count."""
    m = _TOKENS.match(text) if isinstance(text, str) else None
    if not m:
        raise PartitaError(f"--tokens {text!r}: expected a token count like 2T, 500B, 300M or 1e12")
    value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if not math.isfinite(value) or value < 1:
        raise PartitaError(f"--tokens {text!r}: must be at least one token")
    if value > 1e21:
        raise PartitaError(f"--tokens {text!r}: more than 1e21 tokens is no training run; check the suffix")
    return int(round(value))


def fmt_tokens(tokens: int) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if tokens >= scale:
            return f"{tokens / scale:.4g}{suffix}"
    return str(tokens)


@dataclass(frozen=True, kw_only=True)
class DeviceHours:
    device: str
    devices: int  # devices of this type the plan runs on
    gpu_hours: float
    price_per_gpu_hour: float | None  # None: no price known
    cost_usd: float | None


@dataclass(frozen=True, kw_only=True)
class TrainingCost:
    tokens: int
    tokens_per_s: float
    seconds: float
    by_device: tuple[DeviceHours, ...]
    idle_devices: int  # devices of the cluster the plan leaves idle
    idle_cost_usd: float | None  # what they cost over the run if they stay reserved (None: unpriced)

    @property
    def gpu_hours(self) -> float:
        return sum(d.gpu_hours for d in self.by_device)

    @property
    def cost_usd(self) -> float | None:
        """The total for the devices used, or None when a device type has no price."""
        costs = [d.cost_usd for d in self.by_device]
        return None if any(c is None for c in costs) else sum(costs)  # type: ignore[misc]

    @property
    def unpriced(self) -> list[str]:
        return [d.device for d in self.by_device if d.price_per_gpu_hour is None]

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "tokens_per_s": self.tokens_per_s, "seconds": self.seconds,
                "days": self.seconds / 86400, "gpu_hours": self.gpu_hours, "cost_usd": self.cost_usd,
                "by_device": [{"device": d.device, "devices": d.devices, "gpu_hours": d.gpu_hours,
                               "price_per_gpu_hour": d.price_per_gpu_hour, "cost_usd": d.cost_usd}
                              for d in self.by_device],
                "idle_devices": self.idle_devices, "idle_cost_usd": self.idle_cost_usd}


def training_cost(plan: Plan, cluster: ClusterSpec, tokens: int) -> TrainingCost:
    """Time to train ``tokens`` at the plan's predicted tokens/s, and what it costs."""
    if plan.prediction is None or plan.prediction.tokens_per_s <= 0:
        raise PartitaError("--tokens needs the plan's prediction (tokens/s); re-check the plan with "
                           "`partita check` or re-plan")
    seconds = tokens / plan.prediction.tokens_per_s
    hours = seconds / 3600
    used: dict[str, int] = {}
    price: dict[str, float | None] = {}
    for _, name in plan.rank_groups():
        g = cluster.group(name)
        used[g.device] = used.get(g.device, 0) + 1
        _merge_price(price, g.device, g.price)
    rows = tuple(DeviceHours(device=d, devices=n, gpu_hours=n * hours, price_per_gpu_hour=price[d],
                             cost_usd=None if price[d] is None else n * hours * price[d])
                 for d, n in sorted(used.items()))
    used_ranks = set(plan.ranks)
    idle, idle_cost, start = 0, 0.0, 0
    for g in cluster.groups:
        n = sum(1 for r in range(start, start + g.size) if r not in used_ranks)
        start += g.size
        idle += n
        if n and idle_cost is not None:
            idle_cost = None if g.price is None else idle_cost + n * hours * g.price
    return TrainingCost(tokens=tokens, tokens_per_s=plan.prediction.tokens_per_s, seconds=seconds, by_device=rows,
                        idle_devices=idle, idle_cost_usd=idle_cost if idle else 0.0)


def _merge_price(prices: dict[str, float | None], device: str, value: float | None) -> None:
    """One price per device type; groups of one type at different prices are refused (ambiguous)."""
    if device in prices and prices[device] != value:
        raise PartitaError(f"node groups of {device} have different prices ({prices[device]} and {value} per "
                           f"GPU-hour); give every {device} group the same price_per_gpu_hour")
    prices[device] = value


def fmt_duration(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:,.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:,.1f} hours"
    if seconds >= 120:
        return f"{seconds / 60:,.1f} minutes"
    return f"{seconds:,.1f} s"


def cost_lines(c: TrainingCost) -> list[str]:
    """The summary people read: time, GPU-hours and dollars per device type, and the total."""
    lines = [f"training on {fmt_tokens(c.tokens)} tokens at {c.tokens_per_s:,.0f} tokens/s: "
             f"{fmt_duration(c.seconds)}, {c.gpu_hours:,.0f} GPU-hours"
             + (f", ${c.cost_usd:,.0f}" if c.cost_usd is not None else "")]
    for d in c.by_device:
        money = (f" x ${d.price_per_gpu_hour:g}/GPU-hour = ${d.cost_usd:,.0f}" if d.cost_usd is not None
                 else " (no price: set price_per_gpu_hour for its node group in a cluster YAML)")
        lines.append(f"  {d.device}: {d.devices:,} devices, {d.gpu_hours:,.0f} GPU-hours{money}")
    if c.idle_devices:
        idle = f"${c.idle_cost_usd:,.0f}" if c.idle_cost_usd is not None else "unpriced"
        lines.append(f"  idle: {c.idle_devices:,} devices of the cluster are not used ({idle} more if they stay "
                     f"reserved for the run)")
    return lines
