"""``partita plan --top K``: the best plans of K different shapes, so a user can choose.

A shape is what CP-SAT solves one model for (``cpsat_problem.Shape``: stage width dp x tp, tp, dp,
micro-batch size and count); inside a shape the solver still chooses the pipeline depth, the
split, the placement and every layer's strategy. The first plan is the ordinary search's (so
K=1 is exactly ``partita plan``); the others are each shape's own best plan, solved in order of
the shape's proven lower bound, and a shape whose bound cannot beat the K-th plan found so far
is skipped (it cannot enter the list). Each alternative says whether it is proven optimal for its
shape ("optimal") or the best found in the work it was given ("feasible").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from partita.plan import Plan, SolverReport
from partita.search.costs.model import CostModel
from partita.search.cpsat import MIN_WORK, solve_shape
from partita.search.cpsat_fit import StageFit
from partita.search.cpsat_problem import NEVER, Shape, build_problem, memory_infeasible, shapes
from partita.search.evaluate import Evaluation, evaluate_layout
from partita.search.uniform import Layout
from partita.units import to_us


@dataclass(frozen=True)
class Alternative:
    layout: Layout
    evaluation: Evaluation
    status: str  # "optimal" (for its shape) or "feasible"
    bound_us: int


def same_shape(shape: Shape, p: Plan) -> bool:
    """Whether the plan is of this shape (compared by the fields both have, so a shape that grows
    more fields still compares)."""
    return (shape.stage_size, shape.tp, shape.dp, shape.micro_batch, shape.num_micro_batches) == (
        p.dp * p.tp, p.tp, p.dp, p.micro_batch, p.num_micro_batches)


def other_shapes(cm: CostModel, req, best: Plan, count: int, *, work_limit: float,
                 deadline: float) -> list[Alternative]:
    """Up to ``count`` plans, each the best of a shape other than ``best``'s, fastest first."""
    problems = [p for p in (build_problem(cm, s, req.space) for s in shapes(cm, req.global_batch, req.space)
                            if not same_shape(s, best)) if p is not None]
    problems.sort(key=lambda p: p.lower_bound_us)
    found: list[Alternative] = []
    work_left = work_limit
    for p in problems:
        kth = sorted(to_us(a.evaluation.step_time_s) for a in found)[count - 1] if len(found) >= count else None
        if kth is not None and p.lower_bound_us >= kth:
            break  # sorted by bound: no later shape can enter the list either
        if memory_infeasible(p):
            continue
        fit = StageFit(p)
        if fit.bound_us() >= NEVER or (kth is not None and fit.prunes(kth)):
            continue
        wall_left = deadline - time.perf_counter()
        if work_left <= 0 or wall_left <= 0:
            break
        r = solve_shape(p, upper_bound_us=kth - 1 if kth is not None else None, hint=None, time_limit_s=wall_left,
                        workers=req.workers, seed=req.seed, fit=fit,
                        work_limit=min(work_left, max(MIN_WORK, work_left / 4)))
        work_left -= r.work
        if r.layout is None:
            continue
        lay = r.layout
        ev = evaluate_layout(cm, list(zip(lay.stage_groups, lay.stage_layers)), dp=lay.dp, tp=lay.tp,
                             micro_batch=lay.micro_batch, num_micro_batches=lay.num_micro_batches)
        if ev.fits:
            found.append(Alternative(lay, ev, "optimal" if r.status == "optimal" else "feasible", r.bound_us))
    found.sort(key=lambda a: a.evaluation.step_time_s)
    return found[:count]


def alternative_plans(cm: CostModel, req, best: Plan, count: int, *, work_limit: float,
                      deadline: float) -> list[Plan]:
    """The alternatives as plans (validated like any plan), each with its own solver report."""
    from importlib.metadata import version

    from partita.search.plans import layout_to_plan
    from partita.validate import validate_plan

    start = time.perf_counter()
    plans = []
    for alt in other_shapes(cm, req, best, count, work_limit=work_limit, deadline=deadline):
        objective = to_us(alt.evaluation.step_time_s)
        bound = min(alt.bound_us, objective)
        report = SolverReport(method="cpsat", status=alt.status, objective_us=objective, bound_us=bound,
                              gap=round((objective - bound) / objective, 6) if objective else 0.0,
                              wall_s=round(time.perf_counter() - start, 4), workers=req.workers, seed=req.seed,
                              ortools_version=version("ortools"))
        plan = layout_to_plan(cm, alt.layout, global_batch=req.global_batch, solver=report)
        validate_plan(plan, req.model, req.cluster)
        plans.append(plan)
    return plans
