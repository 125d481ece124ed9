"""The profile: per-layer-kind compute and memory costs, and collective costs, of one device type.

A profile is a typed table with provenance. Measured profiles come from ``partita profile``
on the real device; with none, the search derives the same quantities analytically from the
device catalog (``partita.search.roofline``) and says so in the plan.

Layer entries are keyed by the layer kind's shapes (a ``LayerKind``), the tensor-parallel
width it was sharded to, the micro-batch size and the sequence length. Comm entries fit
``time = latency + bytes / bandwidth`` per collective, link class and group size, where
``bytes`` is the collective's *bus* traffic per rank (ring algorithms: all-reduce moves
2(n-1)/n of the buffer, all-gather and reduce-scatter (n-1)/n of the full buffer).

An optional ``calibration`` block (``partita calibrate``, fitted on measured runs) holds the
time constants the cost model prices analytic layers with on this device type: a scale on the
analytic device time, the host's overhead per eager op, the compute slowdown while
communication overlaps it, the fixed per-step overhead and, on CPU ranks, the bandwidth at
which passes over the weights stream; its ``runs`` and ``error`` say what
it was fitted on and how well. Profiles without it load as before (and keep their fingerprint).

An optional ``attention`` table (``partita profile --attention-seq-lens``) holds the causal
attention core alone (the runtime's SDPA call) at long sequences, where context parallelism
prices it on shapes no layer point covers: all s positions for H/cp heads (all-to-all), one
L-token block (ring). ``attention_time_at`` reads it at any shape; absent, as before.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partita import specio
from partita.errors import PartitaError
from partita.model import LayerKind

SCHEMA_VERSION = 1
COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all")
LINK_CLASSES = ("nvlink", "pcie", "xgmi", "loopback", "network")


def bus_bytes(op: str, message_bytes: float, ranks: int) -> float:
    """The bytes one rank moves for a ring collective over ``ranks`` ranks on a buffer of
    ``message_bytes`` (the all-reduce input, the all-gather output, the reduce-scatter input,
    the p2p message): the traffic a comm fit's bandwidth is measured against."""
    if op == "p2p":
        return float(message_bytes)
    if ranks <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (ranks - 1) / ranks * message_bytes
    if op in ("all_gather", "reduce_scatter"):
        return (ranks - 1) / ranks * message_bytes
    if op == "all_to_all":  # every rank keeps 1/ranks of its buffer and sends the rest (context parallelism)
        return (ranks - 1) / ranks * message_bytes
    raise PartitaError(f"unknown collective {op!r}; valid: {', '.join(COMM_OPS)}")


@dataclass(frozen=True, kw_only=True)
class Provenance:
    source: str  # "measured" or "analytic"
    device_name: str  # what the driver calls the device (torch.cuda.get_device_name, or the CPU model)
    torch: str = ""
    cuda: str = ""
    driver: str = ""
    dtype: str = "bf16"
    date: str = ""
    command: str = ""
    host: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "Provenance":
        data = specio.require_mapping(data, where)
        specio.check_keys(data, cls, where, required=("source", "device_name"))
        specio.get_str(data, "source", where, choices=("measured", "analytic", "calibrated"))
        return cls(**{k: str(v) for k, v in data.items()})


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    kind: LayerKind
    tp: int
    micro_batch: int
    seq_len: int
    forward_s: float
    backward_s: float  # gradient of inputs and weights, without recomputation
    recompute_s: float  # the extra forward a checkpointed layer runs in backward
    activation_bytes: int  # kept from forward for backward, one micro-batch, one rank
    param_bytes: int  # this rank's shard of the layer's parameters, in the profile's dtype
    # What a block's selective recomputation adds to its backward (the runtime's policy,
    # ``runtime.parallelize.selective_context``); None: not measured (profiles from before it,
    # other roles, or lost in timing noise), the cost model then takes the analytic share of
    # ``recompute_s``. Absent from the file when None, so older profiles keep their fingerprint.
    selective_recompute_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["kind"] = self.kind.to_dict()
        if self.selective_recompute_s is None:
            del d["selective_recompute_s"]
        return d

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "LayerCost":
        data = specio.require_mapping(data, where)
        names = [f.name for f in dataclasses.fields(cls) if f.name != "selective_recompute_s"]
        specio.check_keys(data, cls, where, required=names)
        selective = data.get("selective_recompute_s")
        kind = LayerKind.from_dict(specio.require_mapping(data["kind"], f"{where}: kind"), f"{where}: kind")
        return cls(kind=kind, tp=specio.get_int(data, "tp", where), micro_batch=specio.get_int(data, "micro_batch", where),
                   seq_len=specio.get_int(data, "seq_len", where),
                   forward_s=specio.get_float(data, "forward_s", where),
                   backward_s=specio.get_float(data, "backward_s", where),
                   recompute_s=specio.get_float(data, "recompute_s", where, strict_min=False),
                   activation_bytes=specio.get_int(data, "activation_bytes", where, minimum=0),
                   param_bytes=specio.get_int(data, "param_bytes", where, minimum=0),
                   selective_recompute_s=None if selective is None else
                   specio.get_float(data, "selective_recompute_s", where))


@dataclass(frozen=True, kw_only=True)
class CommCost:
    op: str  # one of COMM_OPS
    link: str  # one of LINK_CLASSES
    ranks: int  # group size it was measured on
    latency_s: float
    bandwidth_gbps: float  # bus bandwidth, GB/s per rank per direction

    def time_s(self, bus_bytes: float) -> float:
        return self.latency_s + bus_bytes / (self.bandwidth_gbps * 1e9)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "CommCost":
        data = specio.require_mapping(data, where)
        specio.check_keys(data, cls, where, required=[f.name for f in dataclasses.fields(cls)])
        return cls(op=specio.get_str(data, "op", where, choices=COMM_OPS),
                   link=specio.get_str(data, "link", where, choices=LINK_CLASSES),
                   ranks=specio.get_int(data, "ranks", where, minimum=2),
                   latency_s=specio.get_float(data, "latency_s", where, strict_min=False),
                   bandwidth_gbps=specio.get_float(data, "bandwidth_gbps", where))


@dataclass(frozen=True, kw_only=True)
class AttentionCost:
    """The causal attention core on one device: ``scaled_dot_product_attention(q, k, v,
    is_causal=True)`` on [micro_batch, heads, seq_len, head_dim] tensors (kv heads already
    repeated to the query heads, as the runtime calls it), forward and backward (q, k, v
    gradients)."""

    heads: int
    head_dim: int
    micro_batch: int
    seq_len: int
    forward_s: float
    backward_s: float

    @property
    def forward_flops(self) -> float:
        return causal_attention_flops(self.micro_batch, self.heads, self.seq_len, self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "AttentionCost":
        data = specio.require_mapping(data, where)
        specio.check_keys(data, cls, where, required=[f.name for f in dataclasses.fields(cls)])
        return cls(heads=specio.get_int(data, "heads", where), head_dim=specio.get_int(data, "head_dim", where),
                   micro_batch=specio.get_int(data, "micro_batch", where),
                   seq_len=specio.get_int(data, "seq_len", where),
                   forward_s=specio.get_float(data, "forward_s", where),
                   backward_s=specio.get_float(data, "backward_s", where))


def causal_attention_flops(batch: int, heads: int, seq_len: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention over ``seq_len`` positions: 2 b H s^2 d (q k^T and p v
    over the s^2/2 pairs the mask keeps), as ``roofline.attention_flops_bytes`` counts them."""
    return 2.0 * batch * heads * seq_len * seq_len * head_dim


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Time constants fitted on measured runs of this device type (``partita calibrate``)."""

    compute_scale: float  # measured / analytic device time of the layers' own work
    op_overhead_s: float  # host time per dispatched eager op
    overlap_slowdown: float  # compute slowdown while a collective overlaps it (0: none, 1: no overlap)
    step_overhead_s: float  # fixed per step: loss reduction, data, Python between micro-batches
    # CPU ranks: the bandwidth at which passes over the weights and the optimizer's state stream
    # (``roofline.cpu_weight_stream_s``). None: a calibration from before the term (its other
    # constants were fitted without it, so it prices as it did), or of a GPU (not used there).
    # Absent from the file when None, so such profiles keep their fingerprint.
    weight_stream_gbps: float | None = None
    fitted: tuple[str, ...] = ()  # which constants were fitted to the runs (the others kept their default)
    runs: tuple[str, ...] = ()  # run ids fitted on
    error: float = 0.0  # median |predicted / measured - 1| over the fitted observations

    CONSTANTS = ("compute_scale", "op_overhead_s", "overlap_slowdown", "step_overhead_s")
    OPTIONAL = ("weight_stream_gbps",)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["fitted"], d["runs"] = list(self.fitted), list(self.runs)
        if self.weight_stream_gbps is None:
            del d["weight_stream_gbps"]
        return d

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "Calibration":
        data = specio.require_mapping(data, where)
        specio.check_keys(data, cls, where, required=cls.CONSTANTS)
        values = {name: specio.get_float(data, name, where, strict_min=False) for name in cls.CONSTANTS}
        if values["compute_scale"] <= 0:
            raise PartitaError(f"{where}: compute_scale must be > 0, got {values['compute_scale']}")
        if data.get("weight_stream_gbps") is not None:
            values["weight_stream_gbps"] = specio.get_float(data, "weight_stream_gbps", where)
        fitted = data.get("fitted") or []
        runs = data.get("runs") or []
        names = cls.CONSTANTS + cls.OPTIONAL
        if not isinstance(fitted, list) or any(f not in names for f in fitted):
            raise PartitaError(f"{where}: fitted must list some of {', '.join(names)}")
        if not isinstance(runs, list):
            raise PartitaError(f"{where}: runs must be a list of run ids")
        return cls(**values, fitted=tuple(fitted), runs=tuple(str(r) for r in runs),
                   error=specio.get_float(data, "error", where, strict_min=False) if "error" in data else 0.0)


@dataclass(frozen=True, kw_only=True)
class Profile:
    schema_version: int = SCHEMA_VERSION
    device: str  # catalog name the costs apply to
    dtype: str
    provenance: Provenance
    layers: tuple[LayerCost, ...] = ()
    comm: tuple[CommCost, ...] = ()
    calibration: Calibration | None = None
    attention: tuple[AttentionCost, ...] = ()  # long-sequence attention cores; absent from the file when empty
    # Host time per dispatched eager op, as `partita profile` measured it on the device
    # (``runtime.commprobe.op_overhead_of``); the per-op floor of analytic layers when the
    # profile has no calibration. Absent from the file when None.
    op_overhead_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"schema_version": self.schema_version, "device": self.device, "dtype": self.dtype,
             "provenance": self.provenance.to_dict(), "layers": [l.to_dict() for l in self.layers],
             "comm": [c.to_dict() for c in self.comm]}
        if self.calibration is not None:  # absent, a profile keeps the fingerprint it always had
            d["calibration"] = self.calibration.to_dict()
        if self.attention:  # likewise
            d["attention"] = [a.to_dict() for a in self.attention]
        if self.op_overhead_s is not None:  # likewise
            d["op_overhead_s"] = self.op_overhead_s
        return d

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> "Profile":
        from partita.devices import get_device

        data = specio.require_mapping(data, where)
        specio.check_keys(data, cls, where, required=("device", "dtype", "provenance"))
        specio.check_version(data, SCHEMA_VERSION, where)
        layers = data.get("layers") or []
        comm = data.get("comm") or []
        attention = data.get("attention") or []
        if not isinstance(layers, list) or not isinstance(comm, list) or not isinstance(attention, list):
            raise PartitaError(f"{where}: layers, comm and attention must be lists")
        device = get_device(specio.get_str(data, "device", where)).name
        return cls(device=device, dtype=specio.get_str(data, "dtype", where, choices=("bf16", "fp16", "fp32")),
                   provenance=Provenance.from_dict(data["provenance"], f"{where}: provenance"),
                   layers=tuple(LayerCost.from_dict(l, f"{where}: layers[{i}]") for i, l in enumerate(layers)),
                   comm=tuple(CommCost.from_dict(c, f"{where}: comm[{i}]") for i, c in enumerate(comm)),
                   calibration=Calibration.from_dict(data["calibration"], f"{where}: calibration")
                   if data.get("calibration") is not None else None,
                   attention=tuple(AttentionCost.from_dict(a, f"{where}: attention[{i}]")
                                   for i, a in enumerate(attention)),
                   op_overhead_s=specio.get_float(data, "op_overhead_s", where)
                   if data.get("op_overhead_s") is not None else None)

    def save(self, path: str | Path) -> None:
        specio.save_yaml(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        return cls.from_dict(specio.load_yaml(path), where=str(path))

    @property
    def fingerprint(self) -> str:
        return specio.fingerprint(self.to_dict())

    def layer_points(self, kind: LayerKind, tp: int, seq_len: int) -> list[LayerCost]:
        """Measured points for this kind, width and sequence length, by micro-batch."""
        return sorted((l for l in self.layers if l.kind == kind and l.tp == tp and l.seq_len == seq_len),
                      key=lambda l: l.micro_batch)

    def comm_fit(self, op: str, link: str, ranks: int) -> CommCost | None:
        """The fit for this op and link measured on the nearest group size (exact first)."""
        fits = [c for c in self.comm if c.op == op and c.link == link]
        if not fits:
            return None
        return min(fits, key=lambda c: (abs(c.ranks - ranks), -c.ranks))


_SCALED = ("forward_s", "backward_s", "recompute_s", "activation_bytes")


def layer_cost_at(profile: Profile, kind: LayerKind, tp: int, micro_batch: int, seq_len: int) -> LayerCost | None:
    """A measured layer cost at any micro-batch, or None if the profile has no point for this
    kind, shard width and sequence length (the caller then uses the analytic model).

    * a measured micro-batch: that point;
    * between two measured micro-batches: every quantity linear between the neighbours
      (activation memory is exactly linear in it; time nearly so once the device is busy);
    * above the largest measured one: proportional (per-sample cost constant at saturation);
    * below the smallest: linear through the two smallest points, clamped between proportional
      scaling (no fixed overhead) and the smallest point's cost (all overhead); with one
      point, proportional;
    * parameter memory does not depend on the micro-batch.
    """
    if micro_batch < 1:
        raise PartitaError(f"micro_batch must be >= 1, got {micro_batch}")
    points = profile.layer_points(kind, tp, seq_len)
    if not points:
        return None
    for p in points:
        if p.micro_batch == micro_batch:
            return p
    values = {name: _value_at(points, name, micro_batch) for name in _SCALED}
    values["activation_bytes"] = int(round(values["activation_bytes"]))
    # measured at every point or not at all (a profile's points come from one profiler run)
    values["selective_recompute_s"] = (_value_at(points, "selective_recompute_s", micro_batch)
                                       if all(p.selective_recompute_s is not None for p in points) else None)
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
        return min(max(_line(mbs[0], ys[0], mbs[1], ys[1], m), proportional), ys[0])
    i = max(j for j in range(len(mbs)) if mbs[j] < m)
    return _line(mbs[i], ys[i], mbs[i + 1], ys[i + 1], m)


def _line(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def attention_time_at(profile: Profile, *, batch: int, heads: int, seq_len: int,
                      head_dim: int) -> tuple[float, float] | None:
    """(forward, backward) seconds of the causal attention core at this shape from the
    profile's ``attention`` table, or None where it has no point to read it from (the caller
    then uses the roofline).

    Read as an achieved rate, forward FLOPs (``causal_attention_flops``) per second:

    * the points of this head_dim whose b x H (the kernel's independent rows of work) is nearest
      the asked one, an exact match first, then the larger (log distance);
    * among those, the rate linear in log2(s) between the two measured lengths around s, and the
      longest's rate above it (a fused kernel's rate is flat once the sequence fills the device);
    * below the shortest measured length: None; short sequences are what the layer points
      measure, and a kernel's rate falls there;
    * time = FLOPs at the asked shape / rate, so b x H scales time proportionally (the device is
      full at these lengths)."""
    points = [a for a in profile.attention if a.head_dim == head_dim]
    if not points or min(batch, heads, seq_len) < 1:
        return None
    width = batch * heads
    nearest = min({a.micro_batch * a.heads for a in points},
                  key=lambda w: (abs(math.log(w / width)), -w))
    by_len: dict[int, list[AttentionCost]] = {}
    for a in points:
        if a.micro_batch * a.heads == nearest:
            by_len.setdefault(a.seq_len, []).append(a)
    lengths = sorted(by_len)
    if seq_len < lengths[0]:
        return None
    rates = {n: (sum(a.forward_flops / a.forward_s for a in by_len[n]) / len(by_len[n]),
                 sum(a.forward_flops / a.backward_s for a in by_len[n]) / len(by_len[n])) for n in lengths}
    if seq_len >= lengths[-1]:
        fwd_rate, bwd_rate = rates[lengths[-1]]
    else:
        hi = next(n for n in lengths if n >= seq_len)
        lo = max(n for n in lengths if n <= seq_len)
        share = 0.0 if hi == lo else (math.log2(seq_len) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        fwd_rate, bwd_rate = ((1 - share) * rates[lo][i] + share * rates[hi][i] for i in (0, 1))
    flops = causal_attention_flops(batch, heads, seq_len, head_dim)
    return flops / fwd_rate, flops / bwd_rate
