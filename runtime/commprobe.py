"""After the last step: time the collectives this plan runs, on the groups it runs them on, and
the host's overhead per eager op.

A step's collectives hide inside FSDP's hooks, DTensor's operators and the pipeline schedule,
where timing them would add synchronisation to every step. So a run measures them once, at
its end, on its own meshes and at its own message sizes: all-reduce, all-gather and
reduce-scatter of one activation (``micro_batch x seq x hidden`` in the compute dtype) on the
tensor-parallel group, of one block's parameters on the data-parallel group, and a ping-pong
of one activation between the first two stages of the pipeline; each also at 4 KiB, so that
``partita calibrate`` can separate latency from bandwidth. Every rank takes part; rank 0's
samples (the slowest rank's time per repeat, the fastest repeat) go into the run summary.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from partita.model import ModelSpec
from partita.plan import Plan
from partita.runtime.mesh import Meshes
from partita.runtime.phases import RunQueueDelay

SMALL_BYTES = 4096
REPEATS = 7
ITERS = 3
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def probe_collectives(plan: Plan, meshes: Meshes, device: torch.device) -> list[dict[str, Any]]:
    """Samples ``{"op", "link", "ranks", "message_bytes", "seconds"}`` (every rank calls this)."""
    spec = plan.model_spec
    elem = ELEMENT_BYTES[plan.dtype]
    activation = plan.micro_batch * plan.seq_len * spec.hidden * elem
    block_params = spec.kinds["block"].params // plan.tp * elem
    samples: list[dict[str, Any]] = []
    for dim, size in (("tp", activation), ("dp", block_params)):
        mesh = meshes.world[dim]
        if mesh.size() < 2:
            continue
        group, ranks = mesh.get_group(), mesh.mesh.flatten().tolist()
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            for nbytes in (SMALL_BYTES, max(size, 2 * SMALL_BYTES)):
                run = _collective(op, nbytes, len(ranks), group, device)
                samples.append(_sample(op, plan, ranks, nbytes, _time(run, group, device)))
    if plan.pp > 1:
        pp = meshes.pp
        group, ranks = pp.get_group(), pp.mesh.flatten().tolist()
        for nbytes in (SMALL_BYTES, max(activation, 2 * SMALL_BYTES)):
            run = _ping_pong(nbytes, ranks, group, device)
            samples.append(_sample("p2p", plan, ranks[:2], nbytes, _time(run, group, device) / 2))
    return samples


def _sample(op: str, plan: Plan, ranks: list[int], nbytes: int, seconds: float) -> dict[str, Any]:
    return {"op": op, "link": link_class(plan, ranks), "ranks": len(ranks), "message_bytes": nbytes,
            "seconds": seconds}


def link_class(plan: Plan, ranks: list[int]) -> str:
    """The node's own link when every rank is on one node of one group, else the network."""
    cluster = plan.cluster_spec
    start, nodes = 0, set()
    for g in cluster.groups:
        for r in ranks:
            if start <= r < start + g.size:
                nodes.add((g.name, (r - start) // g.gpus_per_node))
        start += g.size
    if len(nodes) == 1:
        name = next(iter(nodes))[0]
        return cluster.group(name).intra_link
    return "network"


def _collective(op: str, nbytes: int, n: int, group, device: torch.device) -> Callable[[], None]:
    numel = max(n, nbytes // 4 // n * n)
    full = torch.ones(numel, dtype=torch.float32, device=device)
    shard = torch.ones(numel // n, dtype=torch.float32, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":  # the *_single names where this torch has them (the others warn)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(full, shard, group=group)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return lambda: scatter(shard, full, group=group)


def _ping_pong(nbytes: int, ranks: list[int], group, device: torch.device) -> Callable[[], None]:
    """A round trip between the pipeline's first two stages; the other stages' ranks wait."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    me = dist.get_rank()
    if me not in ranks[:2]:
        return lambda: None
    peer = ranks[1] if me == ranks[0] else ranks[0]

    def run() -> None:
        if me == ranks[0]:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)

    return run


def _time(run: Callable[[], None], group, device: torch.device) -> float:
    run()  # warm-up (connections, buffers)
    times = []
    for _ in range(REPEATS):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(ITERS):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) / ITERS)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    # The fastest repeat: on a machine shared with other work a collective's ranks are often not
    # all on a core at once (a loaded 2-core machine made gloo's p2p look ten times slower at
    # the median).
    return min(slowest.tolist())


# ---- the host's overhead per eager op --------------------------------------------------------
class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active (``with OpCounter() as c: ...; c.ops``),
    autograd's backward ops included."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def probe_op_overhead(plan: Plan, device: torch.device, iterations: int = 20) -> float:
    """``op_overhead_of`` the plan's model."""
    return op_overhead_of(plan.model_spec, device, iterations)


def probe_spec(spec: ModelSpec) -> ModelSpec:
    """The model shrunk until its block's kernels take next to nothing, with the same modules,
    ops, grouped-query ratio and autograd graph: what host time per op is measured on."""
    group = spec.heads // spec.kv_heads
    return dataclasses.replace(spec, name=f"{spec.name}-probe", hidden=4 * 2 * group, heads=2 * group, kv_heads=2,
                               ffn=16, vocab=32, seq_len=8)


def op_overhead_of(spec: ModelSpec, device: torch.device, iterations: int = 20) -> float:
    """Seconds of host time per dispatched op of this model's block, measured on a copy of the
    block shrunk until its kernels take next to nothing (the same modules, hence the same ops,
    autograd and Python around them): the median of ``iterations`` forward + backward passes
    divided by the ops they dispatch (counted once with a dispatch mode)."""
    from partita.runtime.models import build_layer

    small = probe_spec(spec)
    block = build_layer(small, "block", device=device)
    block = block.to_empty(device=device)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    x = torch.randn(1, 8, small.hidden, device=device, requires_grad=True)

    def once() -> None:
        block(x).sum().backward()

    with OpCounter() as count:
        once()
    delay = RunQueueDelay()  # time spent waiting for a core is not the ops' (phases.py)
    times = []
    for _ in range(iterations):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0, d0 = time.perf_counter(), delay.seconds()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0 - (delay.seconds() - d0))
    return max(0.0, statistics.median(times)) / max(1, count.ops)
