"""Collectives across nodes against public NCCL measurements (docs/calibration.md, "Collectives
at scale"): a data-parallel group's share of its nodes' NICs, the ring's latency growing with
the group, and spanning rings capped like rings inside one node group."""

from __future__ import annotations

import dataclasses

import pytest

from partita.cluster import parse_short
from partita.profile import bus_bytes
from partita.search.costs import links

GiB = 2**30


def bus_gbps(op: str, nbytes: float, n: int, link: links.Link) -> float:
    """The bus bandwidth nccl-tests reports: the bytes a rank moves over the time."""
    return bus_bytes(op, nbytes, n) / links.collective_s({}, op, nbytes, n, link) / 1e9


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_a_group_gets_the_nics_its_ranks_sit_by_and_the_node_s_groups_add_up_to_its_network(tp):
    group = parse_short("4x8xH100").groups[0]
    link = links.dp_link(group, 32 // tp, tp)
    cap = links.nic_share_gbps(group, 8)
    assert link.kind == "network"
    assert link.gbps == pytest.approx(min(8 // tp * group.network_gbps, cap))
    # The node's tp groups together never get more than its 8 NICs.
    assert tp * link.gbps <= 8 * group.network_gbps + 1e-9


def test_eight_a100_with_four_hdr_nics_a_node_all_reduce_at_the_measured_bus_bandwidth():
    # NVIDIA/nccl-tests#119: 8 A100 a node, 4 x 200 Gb/s HDR NICs (12.5 GB/s a GPU),
    # all_reduce_perf across nodes: 96 GB/s bus bandwidth at large messages.
    group = dataclasses.replace(parse_short("2x8xA100-80GB").groups[0], network_gbps=12.5)
    link = links.dp_link(group, 16, 1)
    assert bus_gbps("all_reduce", 8 * GiB, 16, link) == pytest.approx(96, rel=0.05)


def test_an_all_gather_over_256_h100_runs_near_the_measured_200_gb_s():
    # NVIDIA/nccl#1218 (2024): all_gather_perf, 2 GiB, 32 nodes x 8 H100 with 8 x 400 Gb/s a
    # node: ~200 GB/s bus bandwidth. The model's ring pays the network hop's latency on each of
    # its 255 steps and says 223.
    group = parse_short("32x8xH100").groups[0]
    link = links.dp_link(group, 256, 1)
    assert bus_gbps("all_gather", 2 * GiB, 256, link) == pytest.approx(200, rel=0.15)


def test_gathering_one_layer_s_parameters_slows_as_the_group_grows():
    # ZeRO-3 gathers a layer's whole parameters whatever dp is: each of the n - 1 steps moves
    # 1/n of them and pays the hop's latency, so the achieved bus bandwidth falls with n.
    group = parse_short("256x8xH100").groups[0]
    layer = 1.7 * GiB  # a llama-3-405b block in bf16
    rates = [bus_gbps("all_gather", layer, n, links.dp_link(group, n, 1)) for n in (16, 128, 1024, 2048)]
    assert rates == sorted(rates, reverse=True)
    assert rates[-1] < 0.8 * rates[0]


def test_a_ring_spanning_two_node_groups_is_capped_as_each_group_s_own_ring():
    cluster = parse_short("2x8xH100+2x8xH200")
    spanning = links.spanning_dp_link(cluster, [g.name for g in cluster.groups], 1)
    alone = [links.dp_link(g, 16, 1) for g in cluster.groups]
    assert spanning.gbps == pytest.approx(min(link.gbps for link in alone))


def test_the_collectives_check_prints_every_measurement_with_both_latency_models(capsys):
    """benchmarks/collectives_at_scale.py: each public ring measurement beside the cost model's
    time and NCCL's hop-by-hop composition of the latency, and each one's median |error|."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "collectives_at_scale.py"
    spec = importlib.util.spec_from_file_location("collectives_at_scale", path)
    check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = check  # its dataclass looks its module up there
    spec.loader.exec_module(check)
    assert check.main([]) == 0
    out = capsys.readouterr().out
    assert sum(1 for line in out.splitlines() if line.startswith("| NVIDIA/")) == len(check.MEASUREMENTS) == 14
    for m in check.MEASUREMENTS:  # the model column is the cost model's own ring
        group = parse_short(f"{m.ranks // 8}x8xH100").groups[0]
        t = links.collective_s({}, m.op, m.nbytes, m.ranks, links.dp_link(group, m.ranks, 1)) * 1e6
        assert check.model_us(m) == pytest.approx(t)
        assert check.hop_by_hop_us(m) <= t  # the hops inside a node at NVLink's latency
    assert "model (every step at the network's latency): 14 measurements" in out
    assert "hop by hop (NCCL's composition): 14 measurements" in out
