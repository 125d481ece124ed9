"""The cost objective: the plan of least dollars per token when idle devices can be released,
found by a walk down the time/price frontier (``make_cost_plan``), each point the time
objective's search (``planner.make_plan``) under a price bound."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

from partita.errors import InfeasibleError
from partita.plan import Plan
from partita.search.costs.model import CostModel
from partita.search.planner import PlanRequest, cost_model, make_plan, work_limit
from partita.search.plans import SAFETY_WALL_S, SearchTimeout
from partita.search.uniform import device_price


@dataclass(frozen=True)
class FrontierPoint:
    """A plan on the time/price frontier: the fastest plan whose devices cost at most what the
    previous point's cost, less one micro-dollar an hour."""

    plan: Plan
    price_uph: int  # its devices, micro-dollars per hour
    usd_per_mtok: float  # dollars per million tokens
    exact: bool  # its search proved it the fastest within its price bound
    stopped: str = ""  # the last point's: why the walk stopped ("nothing cheaper fits", OUT_OF_TIME, ...)
    # The least price of the plans its search's bound speaks for (every plan priced from here up
    # to its search's price bound is at least its bound): the next search's price bound plus one
    # micro-dollar; None: its own price (no next search, or the walk's last point).
    floor_uph: int | None = None


def usd_per_million_tokens(plan: Plan, price_uph: int) -> float:
    return _usd_per_mtok(plan, plan.prediction.step_time_s, price_uph)


def _usd_per_mtok(plan: Plan, step_s: float, price_uph: int) -> float:
    """Dollars per million tokens of a step of ``step_s`` on devices costing ``price_uph``, at the
    plan's tokens per step."""
    return step_s * price_uph / 1e6 / 3600 / (plan.global_batch * plan.seq_len) * 1e6


def plan_price(plan: Plan, cluster) -> int:
    """What the devices a plan runs on cost per hour, micro-dollars (idle devices released)."""
    return sum(device_price(cluster.group(name)) for _, name in plan.rank_groups())


OUT_OF_TIME = "out of time"


def make_cost_plan(req: PlanRequest, progress: Callable[[str], None] | None = None
                   ) -> tuple[Plan, list[FrontierPoint]]:
    """The plan of least dollars per token when idle devices can be released (the cost
    objective), and the time/price frontier it was chosen from.

    Cost per token is step time x the price of the devices used (the tokens per step are
    fixed). The first search is the time objective's (the fastest plan); each next one asks for
    the fastest plan whose devices cost strictly less than the last one's. A plan skipped in
    between costs at least as much per hour as the last point and is no faster, so the cheapest
    point is the cost optimum, proven when every search on the way proved its point and the walk
    reached its end (``cost_bound``). It stops when nothing cheaper fits, when even the cheapest
    device at the last point's proven step-time bound cannot beat the best cost, or when the time
    is up: the walk has ``--time-limit`` (or the safety bound) in all, each search what is left."""
    for g in req.cluster.groups:
        device_price(g)  # every group needs a price: one clear line otherwise
    least = min(device_price(g) for g in req.cluster.groups)
    deadline = time.perf_counter() + (req.time_limit_s if req.time_limit_s is not None else SAFETY_WALL_S)
    # One cost model for the walk: its caches (layer costs, each shape's tables and curves,
    # ``cpsat_problem.build_problem``) serve every search, whose price bounds alone differ.
    cm = cost_model(req)
    frontier: list[FrontierPoint] = []
    found: list[FrontierPoint] = []  # the plans found besides the frontier's (``_cheapest_group``)
    cap = None
    while True:
        left = deadline - time.perf_counter()
        if frontier and left <= 0:
            stopped = OUT_OF_TIME
            break
        if progress:
            progress(f"cost frontier: point {len(frontier) + 1}" + (f" (devices under ${cap / 1e6:,.2f}/h)" if cap else ""))
        try:
            plan = _fastest_under(req, cm, cap, left)
        except InfeasibleError:
            if not frontier:
                raise
            stopped = "nothing cheaper fits"
            break
        except SearchTimeout:
            if not frontier:
                raise
            stopped = OUT_OF_TIME  # what is found stands, unproven
            break
        if frontier:
            frontier[-1] = dataclasses.replace(frontier[-1], floor_uph=cap + 1)
        frontier.append(_point(plan, req.cluster,
                               exact=plan.solver is not None and plan.solver.status in ("optimal", "exhaustive")))
        price = frontier[-1].price_uph
        if len(frontier) == 1:
            found += _cheapest_group(req, cm, price, deadline)
        best = min(p.usd_per_mtok for p in frontier + found)
        if price <= least:
            stopped = "nothing cheaper fits"  # no device costs less than this plan's devices
            break
        cap = _next_price_cap(frontier, found)
        if cap < least or _least_usd_per_mtok(frontier[-1], least) >= best:
            frontier[-1] = dataclasses.replace(frontier[-1], floor_uph=cap + 1)
            stopped = "no cheaper plan can beat the best"
            break
    frontier[-1] = dataclasses.replace(frontier[-1], stopped=stopped)
    chosen = min(frontier + found, key=lambda p: p.usd_per_mtok)
    return chosen.plan, frontier


def _fastest_under(req: PlanRequest, cm: CostModel, cap: int | None, left_s: float) -> Plan:
    """The time objective's plan on devices costing at most ``cap`` an hour (None: any), in what
    is left of the walk's time (not a fresh safety bound), with the request's work limit."""
    sub = dataclasses.replace(req, time_limit_s=max(left_s, 0.01), work_limit=work_limit(req),
                              space=dataclasses.replace(req.space, price_cap=cap))
    plan, _ = make_plan(sub, cost_model=cm)
    return plan


def _point(plan: Plan, cluster, *, exact: bool) -> FrontierPoint:
    price = plan_price(plan, cluster)
    return FrontierPoint(plan=plan, price_uph=price, usd_per_mtok=usd_per_million_tokens(plan, price), exact=exact)


def _cheapest_group(req: PlanRequest, cm: CostModel, fastest_uph: int, deadline: float) -> list[FrontierPoint]:
    """The fastest plan on devices costing at most the cheapest node group's, when that is below
    the fastest plan's price: on a cluster whose dear devices cost far more per token than its
    cheap ones, a plan of the walk's far end found first lets ``_next_price_cap`` step over the
    dear prices instead of walking down them a stage at a time. Empty if none fits in time."""
    cheapest = min(g.size * device_price(g) for g in req.cluster.groups)
    left = deadline - time.perf_counter()
    if len(req.cluster.groups) < 2 or cheapest >= fastest_uph or left <= 0:
        return []
    try:
        return [_point(_fastest_under(req, cm, cheapest, left), req.cluster, exact=False)]
    except (InfeasibleError, SearchTimeout):
        return []


def _next_price_cap(frontier: list[FrontierPoint], found: list[FrontierPoint] = ()) -> int:
    """The next search's price bound: below the last point's price, and below the price at which
    a plan as fast as the last search's bound would cost as much per token as the best point (a
    plan priced above that and within the last search's bound is no faster than that bound, so it
    costs at least the best: the walk steps over those prices)."""
    last = frontier[-1]
    cap = last.price_uph - 1
    bound_s = last.plan.solver.bound_us / 1e6 if last.plan.solver else 0.0
    if bound_s > 0:
        best_price_s = min(p.price_uph * p.plan.prediction.step_time_s for p in [*frontier, *found])
        cap = min(cap, math.ceil(best_price_s / bound_s) - 1)
    return cap


def _least_usd_per_mtok(point: FrontierPoint, price_uph: int) -> float:
    """The cost per million tokens, on devices costing ``price_uph``, of a plan as fast as the
    point's search proved no plan within its price bound can beat (its bound; 0 if none)."""
    bound_s = point.plan.solver.bound_us / 1e6 if point.plan.solver else 0.0
    return _usd_per_mtok(point.plan, bound_s, price_uph)


def cost_bound(frontier: list[FrontierPoint], least_uph: int) -> float:
    """A proven lower bound on the cost per million tokens of every plan, from the walk: a plan
    priced between two points costs at least the upper point's price at its step-time bound, and
    one below the last point, where the walk stopped short of its end, at least the cheapest
    device's price at the last point's bound. The chosen plan is proven the cost optimum when this
    equals its cost (the walk reached its end and every search proved its point)."""
    bound = min(_least_usd_per_mtok(p, p.price_uph if p.floor_uph is None else p.floor_uph) for p in frontier)
    if frontier[-1].stopped == OUT_OF_TIME:
        bound = min(bound, _least_usd_per_mtok(frontier[-1], least_uph))
    return bound
