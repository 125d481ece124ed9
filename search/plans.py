"""From a search's candidates to plans: ranks given, the prediction attached, and the way a
search that finds nothing in time ends.

The uniform grid, CP-SAT, the interleaved pass, the replica search and the top-k listing all
turn their candidates into plans here, so every plan is built and priced the same way.
"""

from __future__ import annotations

import dataclasses

from partita.errors import PartitaError
from partita.mesh import Mesh
from partita.plan import Plan, SolverReport, Stage
from partita.search.costs.model import CostModel
from partita.search.evaluate import Evaluation, evaluate_plan, prediction
from partita.search.uniform import Layout, batch_shares, micro_batch_sizes

# Without --time-limit, a wall-clock bound that only a much slower or overloaded machine
# reaches before the work limit; hitting it is reported (status "feasible"), never hidden.
SAFETY_WALL_S = 600.0


class SearchTimeout(PartitaError):
    """The time limit ran out before any plan was found, and nothing proved that none fits.
    Exit code 4: not bad input (2) and not "does not fit" (3)."""

    exit_code = 4


def timeout_error(cm: CostModel, req) -> SearchTimeout:
    """The time limit (``PlanRequest.time_limit_s``, or the safety bound) ran out with no plan."""
    limit = f"--time-limit {req.time_limit_s:g} s" if req.time_limit_s is not None else f"its {SAFETY_WALL_S:g} s safety bound"
    return SearchTimeout(
        f"no plan for {cm.model.name} on {cm.cluster.short} found within {limit}, and none was proven impossible "
        f"either: give the search more time (--time-limit)")


def layout_to_plan(cm: CostModel, layout: Layout, *, global_batch: int, solver: SolverReport | None,
                   priced: bool = True) -> Plan:
    """Give each stage its ranks (consecutive, group by group) and attach the prediction. A
    layout found on a context-parallel view (``CostModel.at_cp``), where a rank stands for a cp
    group, becomes a plan of the real cluster with dp x cp x tp ranks a stage."""
    cp = cm.cp
    cluster = cm.real_cluster if cp > 1 else cm.cluster
    next_rank = {g.name: cluster.first_rank(g.name) for g in cluster.groups}
    size = layout.dp * cp * layout.tp
    stages = []
    for i, (group, layers) in enumerate(zip(layout.stage_groups, layout.stage_layers)):
        first = next_rank[group.name]
        next_rank[group.name] = first + size
        stages.append(Stage(index=i, group=group.name, device=group.device, ranks=tuple(range(first, first + size)),
                            layers=tuple(layers)))
    plan = Plan(model=cm.model.to_dict(), model_fingerprint=cm.model.fingerprint, cluster=cluster.to_dict(),
                cluster_fingerprint=cluster.fingerprint, profile_fingerprint=cm.profile_fingerprint,
                cost_sources={}, dtype=cm.dtype, seq_len=cm.plan_seq_len, global_batch=global_batch,
                micro_batch=layout.micro_batch, num_micro_batches=layout.num_micro_batches,
                mesh=Mesh(pp=layout.pp, dp=layout.dp, cp=cp, tp=layout.tp, ep=cm.ep), cp_variant=cm.cp_variant,
                moe_imbalance=cm.moe_imbalance, engine=cm.engine.name, fp8=cm.engine.matmul == "fp8",
                stages=tuple(stages),
                prediction=None,
                solver=solver,
                batch_shares=batch_shares(global_batch, layout.dp, layout.micro_batch, layout.num_micro_batches),
                micro_batch_sizes=micro_batch_sizes(global_batch, layout.dp, layout.micro_batch,
                                                    layout.num_micro_batches))
    return attach_prediction(plan, cm) if priced else plan


def interleaved_to_plan(cm: CostModel, layout, *, global_batch: int, solver: SolverReport | None) -> Plan:
    """An ``interleaved.InterleavedLayout`` as a plan: each stage's layers virtual stage by
    virtual stage, with their counts (``Stage.chunks``), under the layout's schedule."""
    # Priced once, with its chunks and schedule (as a 1F1B plan a ZB-V layout's last stage has no head).
    plan = layout_to_plan(cm, layout, global_batch=global_batch, solver=None, priced=False)
    stages = tuple(dataclasses.replace(st, chunks=sizes) for st, sizes in zip(plan.stages, layout.chunk_sizes))
    return attach_prediction(dataclasses.replace(plan, stages=stages, schedule=layout.schedule, solver=solver), cm)


def attach_prediction(plan: Plan, cm: CostModel, ev: Evaluation | None = None) -> Plan:
    """The plan with its prediction (``ev``: the plan's evaluation, when the caller has it)."""
    ev = ev if ev is not None else evaluate_plan(plan, cm)
    devices = [cm.cluster.group(name).device for _, name in plan.rank_groups()]
    pred = prediction(cm, ev, devices=devices, global_batch=plan.global_batch)
    return dataclasses.replace(plan, prediction=pred, cost_sources=cm.cost_sources())
