"""Measure collectives (all-reduce, all-gather, reduce-scatter, p2p, all-to-all) and fit their costs.

Two ways to run, the same measurement:

* under ``torchrun`` (one node or several): every rank runs ``partita profile --comm``; the
  process group comes from the environment, and groups spanning nodes are measured too;
* on one machine without a launcher: ``spawn_and_measure`` starts ``nproc`` local ranks itself
  (gloo on CPU, NCCL on GPUs).

Groups: inside node 0, the first g ranks for g in 2, 4, 8 ... and the node's size (link class:
the device's intra-node link, ``loopback`` on CPU); across nodes, the first rank of the first
g nodes, for the same g up to the node count (link class ``network``). p2p is a ping-pong
between the first two ranks of each link class; its time is half the round trip. all-to-all is
``dist.all_to_all_single`` on equal splits, the op context parallelism's all-to-all variant runs
(``runtime.context``); its message is one rank's whole buffer, of which it sends (g-1)/g.

Each (op, group, size) point is timed ``repeats`` times after ``warmup`` untimed runs; a timed
repeat is a barrier, then ``iters`` back-to-back runs (so that the ranks' skew leaving the
barrier averages out), divided by ``iters``. A repeat's time is the slowest rank's, and the
point's time the median over repeats. ``fit_comm`` turns the points into one ``CommCost`` per (op, link, group size).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from partita import fileio
from partita.errors import PartitaError
from partita.profile import CommCost, bus_bytes
from partita.profiler.fit import fit_latency_bandwidth
from partita.units import KiB, MiB

log = logging.getLogger(__name__)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all")


@dataclass(frozen=True, kw_only=True)
class CommOptions:
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL)
    intra_link: str = "loopback"  # link class of groups inside a node
    min_bytes: int = 4 * KiB
    max_bytes: int = 4 * MiB
    size_factor: int = 4  # message sizes: min_bytes, min_bytes * factor, ... up to max_bytes
    warmup: int = 2
    repeats: int = 5
    iters: int = 4  # back-to-back runs per timed repeat, so rank skew after the barrier averages out
    ops: tuple[str, ...] = OPS

    def sizes(self) -> list[int]:
        sizes, n = [], self.min_bytes
        while n <= self.max_bytes:
            sizes.append(n)
            n *= self.size_factor
        return sizes


@dataclass(frozen=True, kw_only=True)
class CommSample:
    """One measured point: the median time of ``op`` on a ``message_bytes`` buffer."""

    op: str
    link: str
    ranks: int
    message_bytes: int
    seconds: float

    @property
    def bus_bytes(self) -> float:
        return bus_bytes(self.op, self.message_bytes, self.ranks)


# ---- groups ------------------------------------------------------------------------------
def group_sizes(n: int) -> list[int]:
    """2, 4, 8, ... up to n, and n itself."""
    sizes, g = [], 2
    while g <= n:
        sizes.append(g)
        g *= 2
    if n >= 2 and n not in sizes:
        sizes.append(n)
    return sizes


def plan_groups(world: int, local_world: int, intra_link: str) -> list[tuple[str, list[int]]]:
    """(link class, ranks) of every group to measure, in the order all ranks create them."""
    groups = [(intra_link, list(range(g))) for g in group_sizes(min(local_world, world))]
    n_nodes = world // local_world
    groups += [("network", [node * local_world for node in range(g)]) for g in group_sizes(n_nodes)]
    return groups


# ---- one rank's measurement ----------------------------------------------------------------
def measure_collectives(opts: CommOptions, *, rank: int, world: int, local_world: int) -> list[CommSample]:
    """Run on every rank of an initialised process group; rank 0 returns the samples, others []."""
    device = torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda" else torch.device("cpu")
    groups = plan_groups(world, local_world, opts.intra_link)
    points = [(link, ranks, op) for link, ranks in groups for op in opts.ops if op != "p2p" or len(ranks) == 2]
    samples: list[CommSample] = []
    with _progress(rank == 0, total=len(points) * len(opts.sizes())) as advance:
        for link, ranks in groups:
            # new_group is collective over the whole world: every rank creates every group.
            group = dist.new_group(ranks)
            if rank not in ranks:
                continue
            for op in opts.ops:
                if op == "p2p" and len(ranks) != 2:
                    continue
                for size in opts.sizes():
                    advance(f"{op} on {len(ranks)} ranks ({link}), {size} B")
                    run, messages = _make_op(op, size, ranks, rank, group, device)
                    seconds = _time_slowest_rank(run, opts, group, device) / messages
                    if rank == 0:
                        samples.append(CommSample(op=op, link=link, ranks=len(ranks), message_bytes=size,
                                                  seconds=seconds))
                        log.debug("%s %s x%d %d B: %.1f us", op, link, len(ranks), size, seconds * 1e6)
    dist.barrier()
    return samples


@contextlib.contextmanager
def _progress(show: bool, total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar on rank 0 (stderr); a no-op elsewhere."""
    if not show:
        yield lambda what: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[bold]collectives: {task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("", total=total)
        started = [False]

        def advance(what: str) -> None:
            if started[0]:
                progress.advance(task)
            started[0] = True
            progress.update(task, description=what)

        yield advance


def _make_op(op: str, size: int, ranks: list[int], rank: int, group,
             device: torch.device) -> tuple[Callable[[], None], int]:
    """One run of ``op`` on a ``size``-byte buffer, and how many messages one run is."""
    g = len(ranks)
    numel = max(g, size // 4 // g * g)  # float32 elements, divisible by the group size
    full = torch.ones(numel, dtype=torch.float32, device=device)
    shard = torch.ones(numel // g, dtype=torch.float32, device=device)
    if op == "all_reduce":
        return (lambda: dist.all_reduce(full, group=group)), 1
    if op == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: gather(full, shard, group=group)), 1
    if op == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return (lambda: scatter(shard, full, group=group)), 1
    if op == "all_to_all":  # equal splits: rank i's j-th slice goes to rank j
        received = torch.empty_like(full)
        return (lambda: dist.all_to_all_single(received, full, group=group)), 1
    if op == "p2p":
        peer = ranks[1] if rank == ranks[0] else ranks[0]
        first = rank == ranks[0]

        def ping_pong() -> None:
            if first:
                dist.send(full, peer, group=group)
                dist.recv(full, peer, group=group)
            else:
                dist.recv(full, peer, group=group)
                dist.send(full, peer, group=group)

        return ping_pong, 2  # a round trip: two one-way messages
    raise PartitaError(f"unknown collective {op!r}; valid: {', '.join(OPS)}")


def _time_slowest_rank(run: Callable[[], None], opts: CommOptions, group, device: torch.device) -> float:
    for _ in range(opts.warmup):
        run()
    times = []
    for _ in range(opts.repeats):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(opts.iters):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) / opts.iters)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(slowest.tolist())


# ---- fitting -------------------------------------------------------------------------------
def fit_comm(samples: Iterable[CommSample]) -> tuple[CommCost, ...]:
    """One latency + bandwidth fit per (op, link, group size), in a stable order."""
    by_key: dict[tuple[str, str, int], list[CommSample]] = {}
    for s in samples:
        by_key.setdefault((s.op, s.link, s.ranks), []).append(s)
    costs = []
    for (op, link, ranks), points in sorted(by_key.items(), key=lambda kv: (OPS.index(kv[0][0]), kv[0][1], kv[0][2])):
        fit = fit_latency_bandwidth([p.bus_bytes for p in points], [p.seconds for p in points])
        if fit is None:
            log.warning("%s on %d %s ranks: times do not grow with size (%s..%s B); no fit written, "
                        "widen --comm-sizes", op, ranks, link, points[0].message_bytes, points[-1].message_bytes)
            continue
        costs.append(CommCost(op=op, link=link, ranks=ranks, latency_s=fit.latency_s,
                              bandwidth_gbps=fit.bandwidth_gbps))
    return tuple(costs)


# ---- launching -----------------------------------------------------------------------------
def under_launcher() -> bool:
    """True when torchrun (or another launcher) set this process's rank and world size."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def measure_under_launcher(opts: CommOptions) -> list[CommSample]:
    """Every rank of a torchrun job calls this; rank 0 gets the samples."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local_world:
        raise PartitaError(f"world size {world} is not a whole number of nodes of {local_world} ranks")
    if opts.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if opts.device == "cuda" else "gloo")
    try:
        return measure_collectives(opts, rank=rank, world=world, local_world=local_world)
    finally:
        dist.destroy_process_group()


def spawn_and_measure(opts: CommOptions, nproc: int, *, threads_per_rank: int = 1) -> list[CommSample]:
    """Start ``nproc`` local ranks, measure, and return rank 0's samples."""
    import torch.multiprocessing as mp

    if nproc < 2:
        raise PartitaError(f"collectives need at least 2 ranks, got --nproc {nproc}"
                           + (" (one GPU visible: measure collectives on a multi-GPU node)" if opts.device == "cuda" else ""))
    if opts.device == "cuda" and nproc > torch.cuda.device_count():
        raise PartitaError(f"--nproc {nproc} is more than the {torch.cuda.device_count()} visible GPUs")
    with tempfile.TemporaryDirectory(prefix="partita-comm-") as tmp:
        out = Path(tmp) / "samples.json"
        # A forkserver that has imported torch forks ranks in milliseconds; spawn imports torch
        # in every rank. Threads per rank are set in the environment before any rank starts.
        os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank))
        ctx = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        if ctx == "forkserver":
            mp.set_forkserver_preload(["torch", "torch.distributed"])
        mp.start_processes(_rank_main, args=(nproc, opts, f"file://{tmp}/store", str(out), threads_per_rank),
                           nprocs=nproc, start_method=ctx, join=True)
        data = fileio.load_json(out)
    return [CommSample(**d) for d in data]


def _rank_main(rank: int, world: int, opts: CommOptions, init_method: str, out: str, threads: int) -> None:
    torch.set_num_threads(threads)
    if opts.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if opts.device == "cuda" else "gloo", init_method=init_method,
                            rank=rank, world_size=world)
    try:
        samples = measure_collectives(opts, rank=rank, world=world, local_world=world)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps([asdict(s) for s in samples]))
