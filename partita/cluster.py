"""The cluster spec: node groups, each of one device type, possibly different from each other.

Ranks are numbered group by group, node by node, GPU by GPU: group 0's node 0 holds ranks
0..g-1, and so on. A short form is accepted wherever a cluster is asked for:

    8xH100                     one node of 8 H100s
    4x8xA100-80GB+2x8xH100     4 nodes of 8 A100-80GB, then 2 nodes of 8 H100
    4xcpu                      4 CPU ranks on this machine (gloo), for tests and laptops
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partita import specio
from partita.devices import LINKS, DeviceType, get_device
from partita.errors import PartitaError
from partita.units import GiB

SCHEMA_VERSION = 1
_SHORT = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(?:(\d+)\s*x\s*)?([A-Za-z][A-Za-z0-9_.-]*)\s*$")
MAX_RANKS = 1 << 20


@dataclass(frozen=True, kw_only=True)
class NodeGroup:
    name: str
    device: str  # catalog name
    nodes: int
    gpus_per_node: int
    memory_bytes: int  # usable memory per device
    intra_link: str  # nvlink, pcie, xgmi, loopback
    intra_node_gbps: float  # per GPU, per direction
    network_gbps: float  # inter-node, per GPU, per direction
    # What one device of this group costs per hour, US dollars; None: the catalog's default.
    # Not hardware: left out of the cluster's fingerprint, so a plan stays valid when it changes.
    price_per_gpu_hour: float | None = None

    @property
    def size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def device_type(self) -> DeviceType:
        return get_device(self.device)

    @property
    def price(self) -> float | None:
        """US dollars per device-hour: the group's own price, else the catalog's (None: unknown)."""
        return self.price_per_gpu_hour if self.price_per_gpu_hour is not None else self.device_type.price_per_gpu_hour

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "device": self.device, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
             "memory_gib": self.memory_bytes / GiB, "intra_link": self.intra_link,
             "intra_node_gbps": self.intra_node_gbps, "network_gbps": self.network_gbps}
        if self.price_per_gpu_hour is not None:
            d["price_per_gpu_hour"] = self.price_per_gpu_hour
        return d

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "NodeGroup":
        data = specio.require_mapping(data, where)
        valid = ["name", "device", "nodes", "gpus_per_node", "memory_gib", "intra_link", "intra_node_gbps", "network_gbps",
                 "price_per_gpu_hour"]
        for key in data:
            if key not in valid:
                raise PartitaError(f"{where}: unknown key {key!r}; valid keys: {', '.join(valid)}")
        dev = get_device(specio.get_str(data, "device", where))
        memory_gib = specio.get_float(data, "memory_gib", where, default=dev.memory_bytes / GiB)
        if memory_gib * GiB >= 2**63:  # finite, yet no integer byte count (1e308 GiB)
            raise PartitaError(f"{where}: memory_gib {memory_gib} is too large for one device")
        price = data.get("price_per_gpu_hour")
        if price is not None:
            price = specio.get_float(data, "price_per_gpu_hour", where, strict_min=False)
        group = make_group(
            name=specio.get_str(data, "name", where, default=dev.name.lower()),
            device=dev,
            nodes=specio.get_int(data, "nodes", where, default=1),
            gpus_per_node=specio.get_int(data, "gpus_per_node", where, default=dev.gpus_per_node),
            memory_bytes=dev.memory_from_gib(memory_gib),
            intra_link=specio.get_str(data, "intra_link", where, default=dev.intra_link, choices=LINKS),
            intra_node_gbps=specio.get_float(data, "intra_node_gbps", where, default=dev.intra_node_gbps),
            network_gbps=specio.get_float(data, "network_gbps", where, default=dev.network_gbps),
        )
        return dataclasses.replace(group, price_per_gpu_hour=price) if price is not None else group


def make_group(*, name: str, device: DeviceType, nodes: int, gpus_per_node: int, memory_bytes: int | None = None,
               intra_link: str | None = None, intra_node_gbps: float | None = None,
               network_gbps: float | None = None) -> NodeGroup:
    if nodes < 1 or gpus_per_node < 1:
        raise PartitaError(f"node group {name!r}: nodes and gpus_per_node must be >= 1, got {nodes} and {gpus_per_node}")
    if nodes * gpus_per_node > MAX_RANKS:
        raise PartitaError(f"node group {name!r}: {nodes * gpus_per_node} devices is more than Partita plans for ({MAX_RANKS})")
    return NodeGroup(name=name, device=device.name, nodes=nodes, gpus_per_node=gpus_per_node,
                     memory_bytes=device.memory_bytes if memory_bytes is None else memory_bytes,
                     intra_link=intra_link or device.intra_link,
                     # floats, so that a spec read back from its own YAML has the same fingerprint
                     intra_node_gbps=float(device.intra_node_gbps if intra_node_gbps is None else intra_node_gbps),
                     network_gbps=float(device.network_gbps if network_gbps is None else network_gbps))


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    schema_version: int = SCHEMA_VERSION
    name: str
    groups: tuple[NodeGroup, ...]
    # Bandwidth between node groups, per GPU per direction. None: the slower group's network.
    inter_group_gbps: float | None = None

    def __post_init__(self) -> None:
        if not self.groups:
            raise PartitaError(f"cluster {self.name!r}: no node groups")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise PartitaError(f"cluster {self.name!r}: node group names repeat: {names}")

    @property
    def world_size(self) -> int:
        return sum(g.size for g in self.groups)

    def group(self, name: str) -> NodeGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise PartitaError(f"cluster {self.name!r} has no node group {name!r}; groups: {', '.join(g.name for g in self.groups)}")

    def first_rank(self, group_name: str) -> int:
        rank = 0
        for g in self.groups:
            if g.name == group_name:
                return rank
            rank += g.size
        raise PartitaError(f"cluster {self.name!r} has no node group {group_name!r}")

    def between_groups_gbps(self, a: NodeGroup, b: NodeGroup) -> float:
        if a.name == b.name:
            return a.network_gbps
        slowest = min(a.network_gbps, b.network_gbps)
        return min(slowest, self.inter_group_gbps) if self.inter_group_gbps else slowest

    @property
    def device_types(self) -> list[str]:
        return sorted({g.device for g in self.groups})

    @property
    def is_cpu(self) -> bool:
        return all(g.device == "cpu" for g in self.groups)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"schema_version": self.schema_version, "name": self.name,
                             "groups": [g.to_dict() for g in self.groups]}
        if self.inter_group_gbps is not None:
            d["inter_group_gbps"] = self.inter_group_gbps
        return d

    @classmethod
    def from_dict(cls, data: Any, where: str = "cluster spec") -> "ClusterSpec":
        data = specio.require_mapping(data, where)
        valid = ["schema_version", "name", "groups", "inter_group_gbps"]
        for key in data:
            if key not in valid:
                raise PartitaError(f"{where}: unknown key {key!r}; valid keys: {', '.join(valid)}")
        specio.check_version(data, SCHEMA_VERSION, where)
        groups = data.get("groups")
        if not isinstance(groups, list) or not groups:
            raise PartitaError(f"{where}: 'groups' must be a non-empty list of node groups")
        inter = data.get("inter_group_gbps")
        if inter is not None:
            inter = specio.get_float(data, "inter_group_gbps", where)
        return cls(name=specio.get_str(data, "name", where, default="cluster"),
                   groups=tuple(NodeGroup.from_dict(g, f"{where}: groups[{i}]") for i, g in enumerate(groups)),
                   inter_group_gbps=inter)

    @property
    def fingerprint(self) -> str:
        d = self.to_dict()
        d.pop("name")
        for g in d["groups"]:  # a price is not hardware: re-pricing keeps plans valid
            g.pop("price_per_gpu_hour", None)
        return specio.fingerprint(d)

    @property
    def short(self) -> str:
        parts = []
        for g in self.groups:
            parts.append(f"{g.nodes}x{g.gpus_per_node}x{g.device}" if g.nodes > 1 else f"{g.gpus_per_node}x{g.device}")
        return "+".join(parts)


def _hardware(g: NodeGroup) -> tuple:
    """A group's hardware, without its name."""
    return (g.device, g.nodes, g.gpus_per_node, g.memory_bytes, g.intra_link, g.intra_node_gbps, g.network_gbps)


def _devices(c: ClusterSpec) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in c.groups:
        out[g.device] = out.get(g.device, 0) + g.size
    return out


def _layout(g: NodeGroup) -> str:
    return f"{g.nodes}x{g.gpus_per_node}x{g.device}"


def same_hardware(a: ClusterSpec, b: ClusterSpec) -> bool:
    """The same node groups, in any order and under any names: the same cluster to plan for."""
    return (sorted(map(_hardware, a.groups)) == sorted(map(_hardware, b.groups))
            and a.inter_group_gbps == b.inter_group_gbps)


def cluster_difference(a: ClusterSpec, b: ClusterSpec) -> str:
    """How two clusters' hardware differs, for messages that name both."""
    if sorted(map(_hardware, a.groups)) == sorted(map(_hardware, b.groups)):
        if a.inter_group_gbps != b.inter_group_gbps:
            return f"inter_group_gbps {a.inter_group_gbps} vs {b.inter_group_gbps}"
        return "the same hardware"
    count_a, count_b = _devices(a), _devices(b)
    if count_a != count_b:
        return ", ".join(f"{count_a.get(d, 0)} vs {count_b.get(d, 0)} {d}"
                         for d in sorted(set(count_a) | set(count_b)) if count_a.get(d, 0) != count_b.get(d, 0))
    if a.short != b.short and sorted(map(_layout, a.groups)) != sorted(map(_layout, b.groups)):
        return f"nodes {' + '.join(sorted(map(_layout, a.groups)))} vs {' + '.join(sorted(map(_layout, b.groups)))}"
    fields = ("device", "nodes", "gpus_per_node", "memory_gib", "intra_link", "intra_node_gbps", "network_gbps")
    for ga, gb in zip(sorted(a.groups, key=_hardware), sorted(b.groups, key=_hardware)):
        da, db = ga.to_dict(), gb.to_dict()
        diffs = [f"{k} {da[k]:g} vs {db[k]:g}" if isinstance(da[k], float) else f"{k} {da[k]} vs {db[k]}"
                 for k in fields if da[k] != db[k]]
        if diffs:
            return f"group {ga.name!r} vs {gb.name!r}: {', '.join(diffs)}"
    return "the groups differ"


def parse_short(text: str) -> ClusterSpec:
    """``4x8xA100-80GB+2x8xH100`` -> ClusterSpec. Bad text is one clear error."""
    if not isinstance(text, str) or not text.strip():
        raise PartitaError("cluster: empty; give a short form like 8xH100 or 4x8xA100-80GB+2x8xH100, or a YAML file")
    groups: list[NodeGroup] = []
    for part in text.split("+"):
        m = _SHORT.match(part)
        if not m:
            raise PartitaError(f"cluster {text!r}: cannot read {part!r}; write NODESxGPUSxDEVICE, e.g. 4x8xA100-80GB")
        first, second, dev_name = m.groups()
        dev = get_device(dev_name)
        if any(n is not None and len(n.lstrip("0")) > 9 for n in (first, second)):  # int() refuses > 4300 digits
            raise PartitaError(f"cluster {text!r}: {part!r} has more devices than Partita plans for ({MAX_RANKS})")
        if first is not None and second is not None:
            nodes, per_node = int(first), int(second)
        elif first is not None:
            nodes, per_node = 1, int(first)
        else:
            nodes, per_node = 1, dev.gpus_per_node
        if nodes < 1 or per_node < 1:
            raise PartitaError(f"cluster {text!r}: {part!r} has zero devices; counts must be >= 1")
        base = dev.name.lower()
        name = base
        k = 2
        while any(g.name == name for g in groups):
            name = f"{base}-{k}"
            k += 1
        groups.append(make_group(name=name, device=dev, nodes=nodes, gpus_per_node=per_node))
    return ClusterSpec(name=text.strip(), groups=tuple(groups))


def load_cluster(ref: str) -> ClusterSpec:
    """A short form or a YAML file."""
    try:
        is_file = isinstance(ref, str) and (ref.endswith((".yaml", ".yml")) or Path(ref).is_file())
    except (OSError, ValueError):  # a name no file can have (too long, a NUL byte)
        is_file = False
    if is_file:
        return ClusterSpec.from_dict(specio.load_yaml(ref), where=ref)
    return parse_short(ref)


def recorded_cluster(data: Any, where: str = "plan: cluster") -> ClusterSpec:
    """The cluster a plan records (its ``cluster`` mapping). A short-form cluster (``4xcpu``)
    is rebuilt from its name when that reproduces the mapping exactly: reading the mapping back
    turns integer bandwidths into floats, which would change the fingerprint."""
    try:
        short = parse_short(str(data.get("name", "")))
        if short.to_dict() == dict(data):
            return short
    except PartitaError:
        pass
    return ClusterSpec.from_dict(data, where=where)
