"""From a model, a cluster and profiles to a validated plan: the glue behind `partita plan`."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from partita.cluster import ClusterSpec
from partita.errors import InfeasibleError, PartitaError
from partita.model import ModelSpec
from partita.plan import Plan, SolverReport, Stage
from partita.profile import Profile
from partita.search.costs import CostModel
from partita.search.evaluate import evaluate_plan, prediction
from partita.search.uniform import (Layout, SearchSpace, UniformResult, batch_shares, device_price, infeasible_error,
                                    micro_batch_sizes,
                                    uniform_search)
from partita.units import to_us

log = logging.getLogger(__name__)

# The default stop is work, not wall time, so the same input gives the same plan on a busy
# machine and an idle one: CP-SAT's deterministic time (roughly a second of one core's work
# per unit), summed over every shape solved. The benchmark instances
# (benchmarks/search_targets.py) prove optimality within about 1 unit; the hardest shape seen
# (llama-2-70b on 1x8xH100+4x8xL4) within 7.2, and a shape's first attempt gets a quarter.
DEFAULT_WORK_LIMIT = 30.0
# Without --time-limit, a wall-clock bound that only a much slower or overloaded machine
# reaches before the work limit; hitting it is reported (status "feasible"), never hidden.
SAFETY_WALL_S = 600.0


class SearchTimeout(PartitaError):
    """The time limit ran out before any plan was found, and nothing proved that none fits.
    Exit code 4: not bad input (2) and not "does not fit" (3)."""

    exit_code = 4


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: ModelSpec
    cluster: ClusterSpec
    seq_len: int
    global_batch: int
    profiles: tuple[Profile, ...] = ()
    dtype: str | None = None
    search: str = "cpsat"  # or "uniform"
    # A wall-clock bound on the whole search (grid, model building, solving); None: the
    # deterministic work limit alone decides (with the SAFETY_WALL_S bound).
    time_limit_s: float | None = None
    # CP-SAT deterministic time over all shapes; None: DEFAULT_WORK_LIMIT, or time_limit_s if
    # that is larger (a longer limit buys more search).
    work_limit: float | None = None
    # Stop once the plan is proven within this fraction of the optimum (0: prove it optimal).
    gap: float = 0.0
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
    if req.time_limit_s is not None and req.time_limit_s <= 0:
        raise PartitaError(f"--time-limit must be > 0 seconds, got {req.time_limit_s}")
    if not 0 <= req.gap < 1:
        raise PartitaError(f"--gap must be a fraction in [0, 1) (e.g. 0.01 for 1 %), got {req.gap:g}")
    if req.work_limit is not None and req.work_limit <= 0:
        raise PartitaError(f"the work limit must be > 0, got {req.work_limit}")


def work_limit(req: PlanRequest) -> float:
    """The CP-SAT deterministic-time budget of the request."""
    if req.work_limit is not None:
        return req.work_limit
    return max(DEFAULT_WORK_LIMIT, req.time_limit_s or 0.0)


def timeout_error(cm: CostModel, req: PlanRequest) -> SearchTimeout:
    limit = f"--time-limit {req.time_limit_s:g} s" if req.time_limit_s is not None else f"its {SAFETY_WALL_S:g} s safety bound"
    return SearchTimeout(
        f"no plan for {cm.model.name} on {cm.cluster.short} found within {limit}, and none was proven impossible "
        f"either: give the search more time (--time-limit)")


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
                tp=layout.tp, pp=layout.pp, stages=tuple(stages), prediction=None, solver=solver,
                batch_shares=batch_shares(global_batch, layout.dp, layout.micro_batch, layout.num_micro_batches),
                micro_batch_sizes=micro_batch_sizes(global_batch, layout.dp, layout.micro_batch,
                                                    layout.num_micro_batches))
    return attach_prediction(plan, cm)


def interleaved_to_plan(cm: CostModel, layout, *, global_batch: int, solver: SolverReport | None) -> Plan:
    """An ``interleaved.InterleavedLayout`` as a plan: each stage's layers virtual stage by
    virtual stage, with their counts (``Stage.chunks``), under the layout's schedule."""
    plan = layout_to_plan(cm, layout, global_batch=global_batch, solver=None)
    stages = tuple(dataclasses.replace(st, chunks=sizes) for st, sizes in zip(plan.stages, layout.chunk_sizes))
    return attach_prediction(dataclasses.replace(plan, stages=stages, schedule=layout.schedule, solver=solver), cm)


def _consider_interleaved(cm: CostModel, req: PlanRequest, plan: Plan, uni: UniformResult, deadline: float) -> Plan:
    """The uniform grid's fastest pipelines under interleaved 1F1B, interleaved zero-bubble and
    ZB-V (``search/interleaved.py``): the fastest that fits replaces the 1F1B plan when it is
    faster. The 1F1B search's proof covers 1F1B plans only, so the plan then reports status
    "feasible", with the lower of the two searches' bounds (the post-pass's holds for every
    schedule it tries)."""
    from partita.search.interleaved import interleaved_search

    if req.space.pipeline and max(req.space.pipeline) < 2:
        return plan
    if not uni.pipelined:
        return plan
    found = interleaved_search(cm, global_batch=req.global_batch, space=req.space, candidates=uni.pipelined,
                               deadline=deadline)
    if found.best is None or plan.prediction is None or found.best_eval.step_time_s >= plan.prediction.step_time_s:
        return plan
    objective = to_us(found.best_eval.step_time_s)
    old = plan.solver
    if old is not None and old.method == "uniform":  # the grid's proof covers the grid only
        status, bound = "feasible", min(old.bound_us, int(found.bound_us), objective)
    else:
        status = "feasible"
        bound = min(old.bound_us if old is not None else objective, int(found.bound_us), objective)
    report = dataclasses.replace(old, status=status, objective_us=objective, bound_us=bound,
                                 gap=round((objective - bound) / objective, 6) if objective else 0.0,
                                 candidates=old.candidates + found.evaluated) if old is not None else None
    return interleaved_to_plan(cm, found.best, global_batch=req.global_batch, solver=report)


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
    start = time.perf_counter()
    deadline = start + (req.time_limit_s if req.time_limit_s is not None else SAFETY_WALL_S)
    cm = CostModel(req.model, req.cluster, seq_len=req.seq_len, dtype=req.dtype, profiles=req.profiles)
    if progress:
        progress("uniform grid")
    uni = uniform_search(cm, global_batch=req.global_batch, space=req.space, deadline=deadline)
    if req.search == "uniform":
        if uni.best is None:
            raise infeasible_error(cm, uni, req.global_batch, req.space) if uni.complete else timeout_error(cm, req)
        uni_us = to_us(uni.best_eval.step_time_s)
        # A grid cut short proves nothing about the candidates it did not see.
        status, bound = ("exhaustive", uni_us) if uni.complete else ("feasible", 0)
        report = SolverReport(method="uniform", status=status, objective_us=uni_us, bound_us=bound,
                              gap=round((uni_us - bound) / uni_us, 6) if uni_us else 0.0,
                              wall_s=round(uni.wall_s, 4), uniform_objective_us=uni_us, candidates=uni.evaluated)
        plan = layout_to_plan(cm, uni.best, global_batch=req.global_batch, solver=report)
    elif time.perf_counter() > deadline:
        plan = _out_of_time_plan(cm, req, uni)  # without even loading the solver (a second's import)
    else:
        from partita.search.cpsat import solve_plan

        if progress:
            progress("CP-SAT search")
        plan = solve_plan(cm, req, uni, deadline=deadline, work_limit=work_limit(req))
    if time.perf_counter() < deadline:
        if progress:
            progress("interleaved pipelines")
        plan = _consider_interleaved(cm, req, plan, uni, deadline)
    validate_plan(plan, req.model, req.cluster)
    return plan, uni


@dataclass(frozen=True)
class FrontierPoint:
    """A plan on the time/price frontier: the fastest plan whose devices cost at most what the
    previous point's cost, less one micro-dollar an hour."""

    plan: Plan
    price_uph: int  # its devices, micro-dollars per hour
    usd_per_mtok: float  # dollars per million tokens
    exact: bool  # its search proved it the fastest within its price bound


def usd_per_million_tokens(plan: Plan, price_uph: int) -> float:
    return plan.prediction.step_time_s * price_uph / 1e6 / 3600 / (plan.global_batch * plan.seq_len) * 1e6


def plan_price(plan: Plan, cluster) -> int:
    """What the devices a plan runs on cost per hour, micro-dollars (idle devices released)."""
    return sum(len(s.ranks) * device_price(cluster.group(s.group)) for s in plan.stages)


def make_cost_plan(req: PlanRequest, progress: Callable[[str], None] | None = None
                   ) -> tuple[Plan, list[FrontierPoint]]:
    """The plan of least dollars per token when idle devices can be released (the cost
    objective), and the time/price frontier it was chosen from.

    Cost per token is step time x the price of the devices used (the tokens per step are
    fixed). The first search is the time objective's (the fastest plan); each next one asks for
    the fastest plan whose devices cost strictly less than the last one's. A plan skipped in
    between costs at least as much per hour as the last point and is no faster, so the cheapest
    point is the cost optimum, proven when every search on the way proved its point. It stops
    when no plan is cheaper, or when even the cheapest device at the last point's step time
    cannot beat the best cost."""
    for g in req.cluster.groups:
        device_price(g)  # every group needs a price: one clear line otherwise
    least = min(device_price(g) for g in req.cluster.groups)
    deadline = time.perf_counter() + (req.time_limit_s if req.time_limit_s is not None else SAFETY_WALL_S)
    frontier: list[FrontierPoint] = []
    cap = None
    while True:
        left = deadline - time.perf_counter()
        if frontier and left <= 0:
            break
        sub = dataclasses.replace(req, time_limit_s=max(left, 0.01) if req.time_limit_s is not None else None,
                                  space=dataclasses.replace(req.space, price_cap=cap))
        if progress:
            progress(f"cost frontier: point {len(frontier) + 1}" + (f" (devices under ${cap / 1e6:,.2f}/h)" if cap else ""))
        try:
            plan, _ = make_plan(sub)
        except InfeasibleError:
            if not frontier:
                raise
            break  # nothing cheaper fits
        except SearchTimeout:
            if not frontier:
                raise
            break  # out of time: what is found stands, unproven
        price = plan_price(plan, req.cluster)
        exact = plan.solver is not None and plan.solver.status in ("optimal", "exhaustive")
        frontier.append(FrontierPoint(plan=plan, price_uph=price, usd_per_mtok=usd_per_million_tokens(plan, price),
                                      exact=exact))
        best = min(p.usd_per_mtok for p in frontier)
        if usd_per_million_tokens(plan, least) >= best or price <= least:
            break  # no cheaper device set can be fast enough to beat the best
        cap = price - 1
    chosen = min(frontier, key=lambda p: p.usd_per_mtok)
    return chosen.plan, frontier


def _out_of_time_plan(cm: CostModel, req: PlanRequest, uni: UniformResult) -> Plan:
    """The time limit ran out before CP-SAT could start: the grid's best plan, with nothing
    proven about the rest of the space (bound 0, gap 1)."""
    from importlib.metadata import version

    warm = uni.fastest()
    if warm is None:
        raise timeout_error(cm, req)
    layout, ev = warm
    objective = to_us(ev.step_time_s)
    report = SolverReport(method="cpsat", status="feasible", objective_us=objective, bound_us=0, gap=1.0,
                          wall_s=round(uni.wall_s, 4), workers=req.workers, seed=req.seed,
                          ortools_version=version("ortools"),
                          uniform_objective_us=to_us(uni.best_eval.step_time_s) if uni.best_eval else 0,
                          candidates=0)
    return layout_to_plan(cm, layout, global_batch=req.global_batch, solver=report)
