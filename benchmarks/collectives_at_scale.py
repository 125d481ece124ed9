"""Public nccl-tests measurements of ring collectives across many H100 nodes against the cost
model's ring (``search/costs/links.py``: every step at the network hop's latency once the ring
leaves a node, plus the bus bytes over the group's NICs), and beside it the same ring with only
the steps that cross between nodes at the network's latency and the others at NVLink's, as
NCCL's own tuning model composes it (``src/graph/tuning.cc``; computed here, not in the cost
model). Prints each measurement, both predictions and their errors, and the median |error| of
each: the evidence behind the ring latency in docs/calibration.md, "Collectives at scale".

    python benchmarks/collectives_at_scale.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

from partita.cluster import parse_short
from partita.search.costs import links

MiB, GiB = 2**20, 2**30


@dataclass(frozen=True)
class Measurement:
    source: str
    op: str
    nbytes: int  # nccl-tests' "size": the whole gathered or reduced buffer
    ranks: int
    measured_us: float  # out-of-place time
    conditions: str


# 8 H100 a node, 8 x 400 Gb/s NICs (the catalog's H100 node) in each source.
MEASUREMENTS = [
    Measurement("NVIDIA/nccl#1218 (2024)", "all_gather", 2 * GiB, 256, 2 * GiB * 255 / 256 / 200e9 * 1e6,
                "RoCE, 16 channels, one QP a connection, one timed iteration (-n 1); only the "
                "bus bandwidth (~200 GB/s) is given"),
    *(Measurement("NVIDIA/nccl-tests#322 (2025)", "all_reduce", size, 1024, us,
                  "RoCE, NCCL_ALGO=Ring, NCCL_PROTO=LL128, 32 channels, 2 QPs a connection")
      for size, us in ((1 * GiB, 19355), (2 * GiB, 20218), (4 * GiB, 25377), (8 * GiB, 47078), (16 * GiB, 93457))),
    *(Measurement("NVIDIA/nccl-tests#309 (2025)", "all_reduce", size, 16, us,
                  "InfiniBand NDR, NCCL 2.26.2, NCCL_ALGO=Ring, NCCL_MIN_CTAS=24, 2 QPs a connection")
      for size, us in ((1 * MiB, 156.9), (4 * MiB, 178.1), (16 * MiB, 199.3), (64 * MiB, 433.8),
                       (128 * MiB, 795.8), (512 * MiB, 2649.9), (1 * GiB, 5236.2), (8 * GiB, 41015.0))),
]


def _link(m: Measurement) -> tuple[int, links.Link]:
    """(GPUs a node, the ring's link) of the measurement's cluster: the catalog's H100 node."""
    group = parse_short(f"{m.ranks // 8}x8xH100").groups[0]
    return group.gpus_per_node, links.dp_link(group, m.ranks, 1)


def model_us(m: Measurement) -> float:
    return links.collective_s({}, m.op, m.nbytes, m.ranks, _link(m)[1]) * 1e6


def hop_by_hop_us(m: Measurement) -> float:
    """The cost model's ring with NCCL's composition of its latency in place of its own: nodes - 1
    steps (twice for all-reduce) at the network's latency, the rest at NVLink's."""
    per_node, link = _link(m)
    steps = links.ring_steps(m.op, m.ranks)
    inter = (2 if m.op == "all_reduce" else 1) * (m.ranks // per_node - 1)
    latency = inter * links.LINK_LATENCY_S["network"] + (steps - inter) * links.LINK_LATENCY_S["nvlink"]
    return model_us(m) + (latency - steps * link.latency_s) * 1e6


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    print("| source | op | size | ranks | measured (µs) | model (µs) | error | hop by hop (µs) | error |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    model_err, hop_err = [], []
    for m in MEASUREMENTS:
        a, b = model_us(m), hop_by_hop_us(m)
        model_err.append(100 * (a / m.measured_us - 1))
        hop_err.append(100 * (b / m.measured_us - 1))
        size = f"{m.nbytes / GiB:g} GiB" if m.nbytes >= GiB else f"{m.nbytes / MiB:g} MiB"
        print(f"| {m.source} | {m.op} | {size} | {m.ranks} | {m.measured_us:,.0f} | {a:,.0f} | {model_err[-1]:+.1f} % "
              f"| {b:,.0f} | {hop_err[-1]:+.1f} % |")
    for name, errors in (("model (every step at the network's latency)", model_err),
                         ("hop by hop (NCCL's composition)", hop_err)):
        print(f"{name}: {len(errors)} measurements, median |error| {statistics.median(abs(e) for e in errors):.1f} %, "
              f"max |error| {max(abs(e) for e in errors):.1f} %")
    print("conditions: " + "; ".join(sorted({f"{m.source}: {m.conditions}" for m in MEASUREMENTS})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
