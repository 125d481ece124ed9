"""Why no plan fits: the one-line messages a search ends with when the space holds no plan.

Exit 3 (``InfeasibleError``) in every case: the least memory any candidate needs, what holds it
and a remedy the search did not already try; or, when no layout meets the space's limits at
all, the limit that, lifted alone, would admit one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from partita import parallel
from partita.errors import InfeasibleError, PartitaError
from partita.mesh import Mesh
from partita.search.costs.model import CostModel
from partita.search.uniform import SearchSpace, UniformResult, grid, shape_zeros, zero_levels
from partita.units import fmt_bytes


def infeasible_error(cm: CostModel, result: UniformResult, global_batch: int,
                     space: SearchSpace = SearchSpace()) -> PartitaError:
    """Exit 3 with the least memory any candidate needs, what holds it, and a remedy the search
    did not already try; or, when no layout meets the limits given, naming the limit."""
    if result.closest is None or result.closest_eval is None:  # no shape meets the space's limits: none fits
        return InfeasibleError(no_layout_message(cm, global_batch, space))
    ev, lay = result.closest_eval, result.closest
    worst = max(ev.stages, key=lambda s: s.peak_bytes / s.capacity)
    need = worst.peak_bytes
    if worst.capacity <= worst.reserve:
        return InfeasibleError(f"a device of {fmt_bytes(worst.capacity)} is smaller than the {fmt_bytes(worst.reserve)} "
                               f"the runtime itself keeps on it; use devices with more memory")
    # What holds the memory: the model's state (weights, gradients, optimizer) does not shrink
    # with a shorter sequence; activations and the transient working set do.
    state = worst.weights + worst.gathered_weights + worst.gradients + worst.optimizer + worst.reserve
    state_binds = state > worst.capacity
    hints = []  # only what the search did not already try
    if "full" not in space.recompute:
        hints.append("recompute (drop --no-recompute)" if space.recompute == ("none",)
                     else "full recompute (--recompute none,selective,full)")
    if 3 not in space.zero_levels:
        hints.append("ZeRO-3 (--zero 0,1,2,3)")
    if space.micro_batches and min(space.micro_batches) > 1:
        hints.append("micro-batch 1 (--micro-batch 1)")
    if space.tensor_parallel or space.pipeline:
        hints.append("no --tp/--pp limits")
    hints.append(_more_devices(cm, need / worst.capacity))
    if not state_binds:
        hints.append("a shorter --seq-len")
    what = (f"weights, gradients and optimizer state alone need {fmt_bytes(state)}" if state_binds else
            f"weights, gradients and optimizer state {fmt_bytes(state)}, activations and working memory "
            f"{fmt_bytes(need - state)}")
    return InfeasibleError(
        f"{cm.model.name} does not fit on {cm.cluster.short}: the least memory per device any plan in the space "
        f"needs is {fmt_bytes(need)} ({Mesh(pp=lay.pp, dp=lay.dp, cp=cm.cp, tp=lay.tp, ep=cm.ep).factors()}, "
        f"micro-batch {lay.micro_batch}; {what}), "
        f"against {fmt_bytes(worst.capacity)}; try {', or '.join(hints)}")


def _more_devices(cm: CostModel, ratio: float) -> str:
    """'about 2 more nodes of 8x A100-80GB': the memory shortfall as whole nodes of the cluster's kind
    (state sharded over more devices shrinks about in proportion)."""
    groups = cm.real_cluster.groups  # the devices (under cp the search's cluster is a view of them)
    g = max(groups, key=lambda g: g.memory_bytes)
    nodes = sum(x.nodes for x in groups)
    more = max(1, math.ceil(nodes * (ratio - 1)))
    if g.device_type.is_cpu:
        return f"about {more * g.gpus_per_node} more CPU ranks, or ranks with more memory"
    return (f"about {more} more node{'s' if more > 1 else ''} of {g.gpus_per_node}x {g.device} "
            f"(or devices with more memory)")


def no_layout_message(cm: CostModel, global_batch: int, space: SearchSpace) -> str:
    """Why no stage shape meets the limits: the limit that, lifted alone, would admit one."""
    model, cluster = cm.model, cm.cluster
    where = f"no parallel layout of {model.name} on {cluster.short} with global batch {global_batch}"
    node_sizes = sorted({g.gpus_per_node for g in cluster.groups})
    if space.price_cap is not None and next(grid(cm, global_batch, dataclasses.replace(space, price_cap=None)), None):
        return f"{where} costs under ${space.price_cap / 1e6:,.2f} an hour; allow dearer devices"
    found = list(grid(cm, global_batch, space))
    if found and not any(zero_levels(space, global_batch, dp, mb, m) for _, _, dp, mb, m in found):
        return (f"{where} meets --zero {_csv(space.zero_levels)}: the global batch splits unevenly over every "
                f"data-parallel degree the space allows, and replicas that run different numbers of micro-batches "
                f"take ZeRO 0 or 1 only; allow --zero 0,1, or a global batch the replicas divide")
    if found and not any(shape_zeros(cm, space, global_batch, len(groups), dp, mb, m) for groups, _, dp, mb, m in found):
        advice = parallel.zero_advice(cm.engine.name, sorted({len(groups) for groups, *_ in found}), space.zero_levels, cm.cp)
        return f"{where} meets --zero {_csv(space.zero_levels)}: {advice}, or plan without --engine {cm.engine.name}"
    if space.tensor_parallel and not any(n % t == 0 for t in space.tensor_parallel for n in node_sizes):
        return (f"{where}: --tp {_csv(space.tensor_parallel)}: a tensor-parallel group stays inside one node, and "
                f"the nodes here have {' or '.join(map(str, node_sizes))} devices; choose a degree that divides it")
    for flag, relaxed in (("--tp", dataclasses.replace(space, tensor_parallel=None)),
                          ("--pp", dataclasses.replace(space, pipeline=None)),
                          ("--micro-batch", dataclasses.replace(space, micro_batches=None))):
        given = getattr(space, {"--tp": "tensor_parallel", "--pp": "pipeline", "--micro-batch": "micro_batches"}[flag])
        if given and next(grid(cm, global_batch, relaxed), None) is not None:
            return (f"{where} meets {flag} {_csv(given)}: every stage has dp x cp x tp ranks inside one node group, "
                    f"the pipeline needs a micro-batch per stage, and dp x micro-batch must divide the global batch; "
                    f"widen {flag} or drop it")
    if space.tensor_parallel or space.pipeline or space.micro_batches:
        return f"{where} meets the --tp/--pp/--micro-batch limits together; widen them"
    return (f"{where}: every data-parallel degree the node groups allow leaves the global batch unevenly split; "
            f"choose a global batch divisible by the group sizes (e.g. {cluster.world_size}), or a cluster whose "
            f"group sizes share a divisor")


def _csv(values: Sequence[int]) -> str:
    return ",".join(map(str, values))
