"""From a model, a cluster and profiles to a validated plan: the glue behind `partita plan`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from partita.cluster import ClusterSpec
from partita.errors import PartitaError
from partita.model import ModelSpec
from partita.plan import Plan, SolverReport, Stage
from partita.profile import Profile
from partita.search.costs import CostModel
from partita.search.evaluate import evaluate_plan, prediction
from partita.search.uniform import Layout, SearchSpace, UniformResult, infeasible_error, uniform_search
from partita.units import to_us

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: ModelSpec
    cluster: ClusterSpec
    seq_len: int
    global_batch: int
    profiles: tuple[Profile, ...] = ()
    dtype: str | None = None
    search: str = "cpsat"  # or "uniform"
    time_limit_s: float = 10.0
    workers: int = 1
    seed: int = 0
    space: SearchSpace = field(default_factory=SearchSpace)


def check_request(req: PlanRequest) -> None:
    if req.seq_len < 1 or req.global_batch < 1:
        raise PartitaError(f"--seq-len and --global-batch must be >= 1, got {req.seq_len} and {req.global_batch}")
    if req.model.family == "gpt2" and req.seq_len > req.model.seq_len:
        raise PartitaError(f"{req.model.name} learns {req.model.seq_len} positions; --seq-len {req.seq_len} is longer")
    if req.search not in ("cpsat", "uniform"):
        raise PartitaError(f"--search {req.search!r}: choose cpsat or uniform")
    if req.time_limit_s <= 0:
        raise PartitaError(f"--time-limit must be > 0 seconds, got {req.time_limit_s}")


def layout_to_plan(cm: CostModel, layout: Layout, *, global_batch: int, solver: SolverReport | None) -> Plan:
    """Give each stage its ranks (consecutive, group by group) and attach the prediction."""
    next_rank = {g.name: cm.cluster.first_rank(g.name) for g in cm.cluster.groups}
    size = layout.dp * layout.tp
    stages = []
    for i, (group, layers) in enumerate(zip(layout.stage_groups, layout.stage_layers)):
        first = next_rank[group.name]
        next_rank[group.name] = first + size
        stages.append(Stage(index=i, group=group.name, device=group.device, ranks=tuple(range(first, first + size)),
                            layers=tuple(layers)))
    plan = Plan(model=cm.model.to_dict(), model_fingerprint=cm.model.fingerprint, cluster=cm.cluster.to_dict(),
                cluster_fingerprint=cm.cluster.fingerprint, profile_fingerprint=cm.profile_fingerprint,
                cost_sources={}, dtype=cm.dtype, seq_len=cm.seq_len, global_batch=global_batch,
                micro_batch=layout.micro_batch, num_micro_batches=layout.num_micro_batches, dp=layout.dp,
                tp=layout.tp, pp=layout.pp, stages=tuple(stages), prediction=None, solver=solver)
    return attach_prediction(plan, cm)


def attach_prediction(plan: Plan, cm: CostModel) -> Plan:
    import dataclasses

    ev = evaluate_plan(plan, cm)
    devices = [s.device for s in plan.stages for _ in s.ranks]
    pred = prediction(cm, ev, devices=devices, global_batch=plan.global_batch)
    return dataclasses.replace(plan, prediction=pred, cost_sources=cm.cost_sources())


def make_plan(req: PlanRequest, progress: Callable[[str], None] | None = None) -> tuple[Plan, UniformResult]:
    """Run the search the request asks for and return a validated plan and the uniform result."""
    from partita.validate import validate_plan

    check_request(req)
    cm = CostModel(req.model, req.cluster, seq_len=req.seq_len, dtype=req.dtype, profiles=req.profiles)
    if progress:
        progress("uniform grid")
    uni = uniform_search(cm, global_batch=req.global_batch, space=req.space)
    if uni.best is None:
        raise infeasible_error(cm, uni, req.global_batch, req.space)
    uni_us = to_us(uni.best_eval.step_time_s)
    if req.search == "uniform":
        report = SolverReport(method="uniform", status="exhaustive", objective_us=uni_us, bound_us=uni_us, gap=0.0,
                              wall_s=round(uni.wall_s, 4), uniform_objective_us=uni_us, candidates=uni.evaluated)
        plan = layout_to_plan(cm, uni.best, global_batch=req.global_batch, solver=report)
    else:
        from partita.search.cpsat import solve_plan

        if progress:
            progress("CP-SAT search")
        plan = solve_plan(cm, req, uni)
    validate_plan(plan, req.model, req.cluster)
    return plan, uni
