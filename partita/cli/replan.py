"""``partita replan PLAN --cluster NEW``: the best plan for a changed allocation, and what moves.

A long job loses devices (a failed node, maintenance) or gains them (an elastic quota). The
model, the sequence length, the dtype and the engine stay the plan's; the global batch stays
too, or, where the new cluster cannot run it and ``--keep-batch`` is not given, becomes the
nearest batch it can (said so). What is printed against the old plan: the degrees, the stages
and devices, the step time, and the training state that moves: the checkpoint (fp32 weights and
Adam's two moments) that every device of the new plan reads its share of, and the time that
reading takes over each node's network at line rate (a lower bound: a shared filesystem may be
slower).

``partita launch --elastic`` (``partita.cli.elastic``) calls ``replan`` itself when a rank dies.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable, Sequence

from partita.cli.output import console, save_plan, writable_output
from partita.cluster import ClusterSpec, load_cluster
from partita.errors import InfeasibleError, PartitaError
from partita.plan import Plan
from partita.units import fmt_bytes

# How many other global batches a replan tries when the plan's own cannot run on the new
# cluster (each is a search of its own), nearest first.
BATCH_TRIES = 6
# Bytes of training state a parameter has in a checkpoint: its fp32 master copy and Adam's two
# fp32 moments (StageMemory's weights and optimizer categories).
STATE_BYTES_PER_PARAM = 12


@dataclasses.dataclass(frozen=True)
class Replanned:
    plan: Plan
    batch_note: str  # "" when the global batch is the old plan's


def replan(old: Plan, cluster: ClusterSpec, *, keep_batch: bool = False, time_limit_s: float | None = None,
           progress: Callable[[str], None] | None = None) -> Replanned:
    """The best plan for ``old``'s model, sequence, dtype and engine on ``cluster``; its global
    batch, or the nearest one ``cluster`` runs (unless ``keep_batch``)."""
    from partita import parallel
    from partita.search.planner import make_plan

    why = old.fp8 and parallel.fp8_devices_rule(cluster.groups)  # its engine and dtype stay the plan's
    if why:  # the plan's FP8 products cannot follow it to this cluster; a new plan can drop them
        raise PartitaError(f"the plan runs its products in FP8 (fp8: true), and on {cluster.short}: {why}; "
                           f"plan the new cluster with partita plan (without --fp8)")
    first: InfeasibleError | None = None
    for batch in [old.global_batch, *([] if keep_batch else nearest_batches(old.global_batch, cluster.world_size))]:
        if progress and batch != old.global_batch:
            progress(f"global batch {batch}")
        try:
            plan, _ = make_plan(_request(old, cluster, batch, time_limit_s), progress=progress)
        except InfeasibleError as e:
            first = first or e
            continue
        note = "" if batch == old.global_batch else (
            f"global batch {old.global_batch} cannot run on the new cluster ({_one_line(first)}); "
            f"planned at {batch}, the nearest that can (--keep-batch refuses instead)")
        return Replanned(plan, note)
    assert first is not None
    hint = "" if keep_batch else f" (nor at the {BATCH_TRIES} nearest global batches)"
    raise InfeasibleError(f"{old.model_spec.name} cannot be trained on {cluster.short} at global batch "
                          f"{old.global_batch}{hint}: {_one_line(first)}")


def _request(old: Plan, cluster: ClusterSpec, global_batch: int, time_limit_s: float | None):
    from partita.search.planner import PlanRequest

    return PlanRequest(model=old.model_spec, cluster=cluster, seq_len=old.seq_len, global_batch=global_batch,
                       dtype=old.dtype, time_limit_s=time_limit_s, engine=old.engine, fp8=old.fp8,
                       moe_imbalance=old.moe_imbalance)


def nearest_batches(batch: int, world: int, tries: int = BATCH_TRIES) -> list[int]:
    """Other global batches to try, nearest to ``batch`` first (the smaller first at a tie):
    multiples of the new world's divisors, which its data-parallel groups can split."""
    divisors = [d for d in range(2, world + 1) if world % d == 0]
    found: set[int] = set()
    for d in divisors:
        below = batch // d * d
        for b in (below, below + d):
            if b > 0 and b != batch:
                found.add(b)
    return sorted(found, key=lambda b: (abs(b - batch), b))[:tries]


def _one_line(e: BaseException | None) -> str:
    return " ".join(str(e).split()) if e is not None else ""


# ---- the state that moves ------------------------------------------------------------------
def state_per_device(plan: Plan) -> list[tuple[int, str, int]]:
    """(rank, node-group, bytes) of training state each device of ``plan`` holds: its fp32
    weights and optimizer moments, the share a resume reads from the checkpoint."""
    if plan.prediction is None:
        raise PartitaError("the plan has no prediction; re-plan it with `partita plan`")
    groups = dict(plan.rank_groups())
    out = []
    for stage, mem in zip(plan.stages, plan.prediction.memory):
        for rank in stage.ranks:
            out.append((rank, groups[rank], mem.weights_bytes + mem.optimizer_bytes))
    return out


def reload_seconds(plan: Plan) -> float:
    """Seconds for every device of ``plan`` to read its share of the checkpoint, the devices of
    a node sharing the node's network (each GPU's share of it at line rate): the slowest node."""
    cluster = plan.cluster_spec
    per_node: dict[tuple[str, int], float] = {}
    for rank, group_name, nbytes in state_per_device(plan):
        g = cluster.group(group_name)
        node = (g.name, (rank - cluster.first_rank(g.name)) // g.gpus_per_node)
        per_node[node] = per_node.get(node, 0.0) + nbytes / (g.network_gbps * 1e9 * g.gpus_per_node)
    return max(per_node.values(), default=0.0)


def checkpoint_bytes(plan: Plan) -> int:
    return STATE_BYTES_PER_PARAM * plan.model_spec.n_params


def change_lines(old: Plan, new: Plan) -> list[str]:
    """What the new plan changes, line by line: degrees, stages and devices, batch, step time,
    the state that moves."""
    lines = [f"  degrees:     {old.mesh.describe()}  ->  {new.mesh.describe()}",
             f"  devices:     {old.world_size}  ->  {new.world_size}   "
             f"stages {len(old.stages)} -> {len(new.stages)}, schedule {old.schedule} -> {new.schedule}",
             f"  batch:       {old.global_batch} x {old.seq_len} tokens, micro-batch {old.micro_batch}  ->  "
             f"{new.global_batch} x {new.seq_len} tokens, micro-batch {new.micro_batch}"]
    if old.prediction and new.prediction:
        a, b = old.prediction, new.prediction
        lines.append(f"  step time:   {a.step_time_s:.3f} s  ->  {b.step_time_s:.3f} s  "
                     f"({b.step_time_s / a.step_time_s - 1:+.1%}); tokens/s {a.tokens_per_s:,.0f} -> "
                     f"{b.tokens_per_s:,.0f} ({b.tokens_per_s / a.tokens_per_s - 1:+.1%})")
        loads = [n for _, _, n in state_per_device(new)]
        lines.append(f"  state moved: the checkpoint, {fmt_bytes(checkpoint_bytes(new))} (fp32 weights + Adam moments), "
                     f"resharded to the new plan: each device reads {fmt_bytes(min(loads))}"
                     f"{'' if min(loads) == max(loads) else ' to ' + fmt_bytes(max(loads))}; "
                     f"reloading takes at least {reload_seconds(new):.1f} s at the network's line rate")
    return lines


# ---- partita replan --------------------------------------------------------------------------
def add_replan_arguments(sub) -> None:
    p = sub.add_parser("replan", help="the best plan for a changed cluster (lost or added devices), and what moves")
    p.add_argument("plan", help="the plan the job runs now")
    p.add_argument("--cluster", required=True, help="the cluster it has now: short form or YAML")
    p.add_argument("-o", "--output", default=None, help="where to write the new plan (default: PLAN-replan.yaml beside it)")
    p.add_argument("--keep-batch", action="store_true",
                   help="keep the global batch; refuse if the new cluster cannot run it (default: the nearest it can)")
    p.add_argument("--time-limit", type=float, default=None, help="wall-clock bound on the search, s")


def replan_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    old = Plan.load(args.plan)
    default = Path(args.plan).with_name(f"{Path(args.plan).stem}-replan.yaml")
    output = writable_output(args.output or str(default), inputs=[args.plan, args.cluster])
    cluster = load_cluster(args.cluster)
    if args.time_limit is not None and args.time_limit <= 0:
        raise PartitaError(f"--time-limit must be > 0 seconds, got {args.time_limit}")
    with console.status("re-planning", spinner="dots") as status:
        result = replan(old, cluster, keep_batch=args.keep_batch, time_limit_s=args.time_limit,
                        progress=lambda what: status.update(what))
    save_plan(result.plan, output)
    from partita.cli.printing import print_plan

    print_plan(result.plan)
    console.print(f"\nwhat changes from {args.plan}:")
    for line in change_lines(old, result.plan):
        console.print(line, highlight=False)
    if result.batch_note:
        console.print(f"  note: {result.batch_note}", highlight=False)
    console.print(f"\nwrote {output}")
    return 0


def shrunk_cluster(cluster: ClusterSpec, lost: Sequence[int]) -> ClusterSpec:
    """``cluster`` without the devices of ranks ``lost`` (one node of CPU ranks, or one GPU node:
    the group keeps its node and loses those devices; the other groups are unchanged)."""
    groups, start = [], 0
    for g in cluster.groups:
        gone = sum(1 for r in lost if start <= r < start + g.size)
        start += g.size
        if not gone:
            groups.append(g)
            continue
        if g.nodes != 1:
            raise PartitaError(f"group {g.name} spans {g.nodes} nodes; an elastic run re-plans on one node's ranks")
        if g.size - gone >= 1:
            groups.append(dataclasses.replace(g, gpus_per_node=g.gpus_per_node - gone))
    if not groups:
        raise PartitaError("no device is left to re-plan on")
    return dataclasses.replace(cluster, groups=tuple(groups))
