"""The links ranks communicate over, and what a ring collective costs on one.

Collectives are ring algorithms priced on the links the ranks use, at the bus bandwidth NCCL
achieves there (``timing.LINK_EFFICIENCY``), or a profile's measured fit; a data-parallel group
across nodes uses the NICs of all its ranks in a node (``dp_link``). Stages are aligned to nodes
(a stage's size divides the node size or is a multiple of it), so a group of ranks inside one
stage sits in one node exactly when it is no wider than a node; sends between stages are
intra-node only on a single-node group, else priced on the network; between node groups the
slower side (or the cluster's inter-group bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from partita.cluster import ClusterSpec, NodeGroup
from partita.profile import Profile, bus_bytes
from partita.search.timing import LINK_EFFICIENCY

# Per-message latency of one ring step, by link class (seconds). NVLink/NCCL ~ a few us,
# inter-node RDMA ~ 10 us; gloo between CPU ranks ~ 0.5 ms (`partita profile --comm` on the
# 2-core development machine: a 2-rank all-reduce of 4 KiB took ~1 ms for its 2 steps). A ring
# that leaves a node pays the network's on every one of its steps (``ring_steps``: n - 1, or
# 2 (n - 1) for all-reduce), so at a fixed shard it slows with the group: 2 GiB all-gathered over
# 256 H100 (32 nodes, 8 x 400 Gb/s) at ~200 GB/s bus bandwidth (NVIDIA/nccl#1218, 2024), 223 here.
# The ring-time tables at 16 and 1,024 ranks (nccl-tests#309, #322) read 7-190 % slower here and
# are matched by NCCL's hop-by-hop composition (intra-node hops at NVLink latency), as is the
# slope of DeepSpeed's published ZeRO-3 runs over the ranks; their level is not, and 15 us a
# step stays until the term it stands in for is found (docs/calibration.md, "Collectives at
# scale"; benchmarks/collectives_at_scale.py; tests/test_collectives_at_scale.py).
LINK_LATENCY_S = {"nvlink": 5e-6, "xgmi": 5e-6, "pcie": 10e-6, "network": 15e-6, "loopback": 500e-6}


@dataclass(frozen=True)
class Link:
    kind: str  # "nvlink", "pcie", "xgmi", "loopback" or "network"
    gbps: float  # per rank, per direction
    latency_s: float


def ring_steps(op: str, n: int) -> int:
    if n <= 1:
        return 0
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "p2p": 1, "all_to_all": n - 1}[op]


def link_within(group: NodeGroup, span: int) -> Link:
    """The link a group of ``span`` consecutive ranks of ``group`` communicates over."""
    if span <= group.gpus_per_node:
        kind = group.intra_link
        return Link(kind, group.intra_node_gbps, LINK_LATENCY_S[kind])
    return Link("network", group.network_gbps, LINK_LATENCY_S["network"])


def dp_link(group: NodeGroup, dp: int, tp: int) -> Link:
    """dp peers are tp ranks apart; the group spans dp * tp consecutive ranks. Across nodes
    NCCL runs a ring (channel) through each NIC its ranks sit by, so a group with k = gpus per
    node / tp ranks in every node moves data between nodes over k NICs at once (the other tp
    ranks' groups use the other NICs): its bus bandwidth is k x the per-GPU network rate, up
    to what NVLink carries inside the node (NVIDIA/nccl-tests#119: 8 A100 a node with 4 HDR
    NICs reach 96 GB/s all-reduce bus bandwidth, "24GB/s ... per 200G NIC"; nccl-tests#319:
    8 x 400G NICs "aggregated to achieve up to ~396GB/s with the RING protocol"). This is the
    group's own share, not the node's whole network: at tp > 1 the node's tp groups split its
    NICs. In training: FSDP of Llama 2 70B on 128 A100 with 400 Gb/s a node (fms-fsdp) measured
    within 10 % of this pricing; at one NIC's share per GPU it would be 76 % slow."""
    link = link_within(group, dp * tp)
    if link.kind != "network":
        return link
    return Link("network", nic_share_gbps(group, max(1, group.gpus_per_node // tp)), link.latency_s)


def nic_share_gbps(group: NodeGroup, per_node: int) -> float:
    """The network rate of a ring with ``per_node`` ranks in each node of ``group``: that many
    NICs at once, up to what NVLink carries inside the node (in the network's efficiency)."""
    intra = group.intra_node_gbps * LINK_EFFICIENCY.get(group.intra_link, 1.0) / LINK_EFFICIENCY["network"]
    return min(per_node * group.network_gbps, max(intra, group.network_gbps))


def spanning_dp_link(cluster: ClusterSpec, span: Sequence[str], tp: int) -> Link:
    """dp peers on the node groups ``span``: the ring crosses between the groups, so every group
    runs its part over its network (each node's NICs at once, as in ``dp_link``) and the
    slowest group's rate, or the slowest link between two groups, sets the pace. Each group's
    rate is capped by its NVLink as in ``dp_link`` (before, a spanning ring of H100s ran at
    8 x 50 GB/s where the same ring inside one group ran at NVLink's 385)."""
    groups = [cluster.group(n) for n in span]
    per_node = max(1, min(g.gpus_per_node for g in groups) // tp)
    rates = [nic_share_gbps(g, per_node) for g in groups]
    rates += [per_node * cluster.between_groups_gbps(a, b) for i, a in enumerate(groups) for b in groups[i + 1:]]
    return Link("network", min(rates), LINK_LATENCY_S["network"])


def pp_link(cluster: ClusterSpec, a: NodeGroup, b: NodeGroup, stage_size: int) -> Link:
    """Between consecutive stages: inside a node only when the group is that one node
    (a stage boundary in a multi-node group may fall between nodes: priced on the network)."""
    if a.name == b.name and a.nodes == 1 and 2 * stage_size <= a.gpus_per_node:
        return Link(a.intra_link, a.intra_node_gbps, LINK_LATENCY_S[a.intra_link])
    return Link("network", cluster.between_groups_gbps(a, b), LINK_LATENCY_S["network"])


def collective_s(profiles: Mapping[str, Profile], op: str, nbytes: float, n: int, link: Link,
                 device: str | None = None) -> float:
    """Ring collective time: latency per step plus bus bytes over the bus bandwidth NCCL
    achieves on the link (``LINK_EFFICIENCY`` of its line rate; the latency term makes the
    achieved bandwidth grow with the message size). A measured comm fit of the device's
    profile replaces these datasheet figures."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bus = bus_bytes(op, nbytes, n)
    profile = profiles.get(device) if device else None
    if profile is not None:
        fit = profile.comm_fit(op, link.kind, n)
        if fit is not None:
            return fit.time_s(bus)
    return ring_steps(op, n) * link.latency_s + bus / (LINK_EFFICIENCY.get(link.kind, 1.0) * link.gbps * 1e9)
