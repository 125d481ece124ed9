"""The CP-SAT planner: stage split, stage placement and every layer's strategy in one exact model.

The outer loop enumerates the few *shapes* a plan can take — stage size ``S = dp * tp``,
tensor degree ``tp``, micro-batch size ``b`` (hence the micro-batch count ``m``) — and orders
them by a proven lower bound. For each shape worth solving, one CP-SAT model decides jointly:

* the pipeline degree and which node group each stage sits on (a stage's ``S`` ranks belong
  to one group; a group hosts at most ``size // S`` stages);
* the stage boundaries, uneven: how many blocks each stage takes;
* every layer's choices: tensor-parallel or replicated, sequence parallelism, ZeRO level,
  recomputation.

Identical blocks are one kind, so the model counts blocks per (stage, group, strategy)
instead of assigning each block: its size grows with stages x groups x strategies, not with
layers (``c[r, g, k]`` integer counts, one per slot, group and strategy). Blocks of a stage
are then laid out in the canonical order (``costs.canonical_order``); the cost model is
additive over a stage's blocks, so the order inside a stage changes nothing to it but at its
ends: under tensor parallelism a stage boundary carries sequence shards, and an end block
that is not sequence-parallel all-gathers them (``costs.boundary_gathers``), which the model
reads from the first and last strategy a slot uses in that order (``PlanModel._end_gathers``).
(The runtime's layout conversions between sequence-parallel and replicated layers inside a
stage, one activation-sized all-gather each, are not priced; docs/search.md lists this
approximation.)

Slots are indexed from the *end* of the pipeline (r = 0 is the last stage, holding the head),
so the micro-batches a 1F1B stage keeps in flight, ``min(r + 1, m)``, are constants and the
pipeline degree stays a decision: used slots are a prefix, and the first stage (holding the
embedding) is the highest used slot.

Objective (the cost model's step time, integer microseconds; ``partita.units`` rounding):
``(m - 1) * max_r T_r + sum_r T_r + m * Z + max_r exposed_dp_r + max_r optimizer_r`` plus the
fixed per-step overhead, with Z the largest stage's exposed ZeRO edge. The solver's objective
equals the evaluator's prediction of the returned plan up to that rounding: each per-layer term
is rounded to the nearest microsecond, so they differ by at most
``(m - 1 + pp) * (layers per stage + 5) / 2 + m / 2 + 1`` microseconds (a stage's layers, its
two boundaries' transfers and its two end gathers). Memory is in whole allocation
grains (``partita.units``: the cost model's byte counts are whole grains), summed as the
evaluator sums them, so the solver accepts exactly the plans that fit.

The uniform planner's best plan is the warm start (a hint, and an upper bound every shape
must beat), the fallback, and the yardstick reported in the plan; before CP-SAT runs, the
primal heuristic (``primal``) builds a plan for each open shape from its tables, and the best
that fits replaces the warm start when it is faster.

The parts, each its own file: the problem's integer tables, its shapes and their split by ZeRO
edge (``cpsat_problem``); the stage-fit bounds that prune shapes and cut the model
(``cpsat_fit``); the model's variables and constraint families (``cpsat_model``); the primal
heuristic (``primal``); and here the solve of one shape (``solve_shape``), the search over shapes
(``ShapeSearch``, one method per step) and the report.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

import ortools
from partita import parallel
from partita.plan import Plan, SolverReport
from partita.search.costs.model import CostModel
from partita.search.cpsat_fit import StageFit
from partita.search.cpsat_model import PlanModel
from partita.search.cpsat_problem import (NEVER, Problem, Shape, build_problem, edge_levels, memory_infeasible,
                                          shape_bound_us, shapes, with_extras)
from partita.search.evaluate import Evaluation, evaluate_layout
from partita.search.primal import shape_plans
from partita.search.infeasible import infeasible_error
from partita.search.uniform import Layout, UniformResult, batch_shares
from partita.units import to_us

log = logging.getLogger(__name__)


# ---- solve ------------------------------------------------------------------------------------
MIN_WORK = 0.2  # the least deterministic time a shape's first attempt gets
# A whole shape's one attempt at refutation before its split by ZeRO edge (``_refute_whole``): the
# three-type 1,024-GPU instance of benchmarks/search_targets.py refutes every such shape within
# 0.5 units (within 0.2: 10 of 11), where its levels took 53 solves.
WHOLE_WORK = 0.5


@dataclass
class ShapeResult:
    shape: Shape
    status: str  # optimal, feasible, infeasible (nothing better than the bound given), unknown, pruned
    bound_us: int
    layout: Layout | None = None
    objective_us: int | None = None
    wall_s: float = 0.0
    work: float = 0.0  # CP-SAT deterministic time spent


FULL_LP_SLOTS = 8  # shapes with at most this many stage slots solve with the full LP relaxation


def solve_shape(p: Problem, *, upper_bound_us: int | None, hint: Layout | None, time_limit_s: float, workers: int,
                seed: int, fit: "StageFit | None" = None, work_limit: float | None = None,
                gap: float = 0.0) -> ShapeResult:
    """The only place that runs CpSolver. ``work_limit`` is CP-SAT's deterministic time (the
    same on a busy machine and an idle one); ``time_limit_s`` a wall-clock bound."""
    start = time.perf_counter()
    pm = PlanModel(p, upper_bound_us, fit)
    pm.build()
    if hint is not None:
        pm.add_hint(hint)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    if work_limit is not None:
        solver.parameters.max_deterministic_time = max(0.01, work_limit)
    solver.parameters.num_workers = workers
    if gap:
        solver.parameters.relative_gap_limit = gap
    solver.parameters.random_seed = seed
    solver.parameters.log_search_progress = False
    # One presolve pass: these models come out of it as small after one pass as after CP-SAT's
    # default many, and the later passes cost more than the search they save (the ten subproblems
    # the mixed-cluster instance of benchmarks/search_targets.py solves, re-solved both ways by a
    # one-off script not kept: 2.4 -> 1.6 s of solver CPU, the same statuses and bounds).
    solver.parameters.max_presolve_iterations = 1
    if p.slots <= FULL_LP_SLOTS:
        # The LP relaxation with every constraint's linearization from the start: on the
        # benchmark (benchmarks/search_targets.py) 15-20 % less CPU on the mixed-cluster and 8x8
        # instances. Deeper pipelines' models are larger, and there it slows the search for a
        # first feasible plan (twice the work on llama-2-70b at pp 24, tests/test_search.py).
        solver.parameters.linearization_level = 2
        solver.parameters.add_lp_constraints_lazily = False
    status = _solve_interruptibly(solver, pm.m)
    wall, work = time.perf_counter() - start, solver.deterministic_time
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"CP-SAT model invalid for {p.shape}: {pm.m.validate()}")
    if status == cp_model.OPTIMAL:
        return ShapeResult(p.shape, "optimal", int(solver.objective_value), pm.read_layout(solver),
                           int(solver.objective_value), wall, work)
    if status == cp_model.FEASIBLE:
        return ShapeResult(p.shape, "feasible", int(math.floor(solver.best_objective_bound)), pm.read_layout(solver),
                           int(solver.objective_value), wall, work)
    if status == cp_model.INFEASIBLE:
        # Nothing in this shape is at or below the upper bound we imposed (without one: it
        # does not fit at all).
        bound = (upper_bound_us + 1) if upper_bound_us is not None else NEVER
        return ShapeResult(p.shape, "infeasible", bound, wall_s=wall, work=work)
    return ShapeResult(p.shape, "unknown", p.lower_bound_us, wall_s=wall, work=work)


def _solve_interruptibly(solver: cp_model.CpSolver, model: cp_model.CpModel) -> int:
    """``solver.solve(model)`` on a helper thread, so that the main thread takes Ctrl-C and
    SIGTERM as the uniform grid does: the search stops at once and the exception goes up.
    CP-SAT's own SIGINT handler would end only this solve, as if its time were up, and the
    search would go on to the next shape and exit 0."""
    solver.parameters.catch_sigint_signal = False
    result: list[int] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(solver.solve(model))
        except BaseException as e:  # handed to the main thread
            failure.append(e)

    thread = threading.Thread(target=run, name="cp-sat", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.05)  # a signal's handler runs here, on the main thread
    except BaseException:
        solver.stop_search()
        thread.join()
        raise
    if failure:
        raise failure[0]
    return result[0]


@dataclass
class Incumbent:
    """The best plan so far: its layout, evaluation and objective (integer microseconds)."""

    layout: Layout
    evaluation: Evaluation
    us: int


def solve_plan(cm: CostModel, req, uniform: UniformResult, *, deadline: float, work_limit: float,
               beat_us: int | None = None) -> Plan:
    """Search every shape, best bound first; return the best plan (never worse than uniform).
    ``beat_us``: a plan outside the 1F1B space already this fast (the interleaved schedules'
    best): a shape that cannot beat it is pruned, its bound that time, so the plan returned is
    the best 1F1B plan below it, or the warm start with that bound.

    Stops at ``work_limit`` (CP-SAT deterministic time summed over shapes: the same plan on a
    busy machine as on an idle one) or at the wall-clock ``deadline``, whichever comes first;
    the deadline is checked between model builds and solves too. With no plan found, it raises
    "does not fit" only when every shape is proven infeasible, and SearchTimeout otherwise."""
    start = time.perf_counter()
    warm = uniform.fastest()
    search = ShapeSearch(cm, req, deadline=deadline, work_limit=work_limit,
                         best=Incumbent(warm[0], warm[1], to_us(warm[1].step_time_s)) if warm else None,
                         beat_us=beat_us)
    search.open(search.problems())
    search.primal()
    while search.queue:
        search.step(search.queue.pop(0))
    return search.plan(uniform, start)


@dataclass
class ShapeSearch:
    """The search over shapes (``solve_plan``), one method per step: the shapes' problems with
    their cheap bounds (``problems``), the queue of those still open (``open``, ``still_open``),
    the primal incumbent (``primal``), one queued problem at a time (``step``: split it by ZeRO
    edge, tighten its stage fit, solve it, record the result, take a better plan), and the plan
    (``plan``). Every record lands in ``results``, which ``plan`` reads back."""

    cm: CostModel
    req: object  # planner.PlanRequest (not imported: the planner imports this module)
    deadline: float  # wall clock (time.perf_counter)
    work_limit: float  # CP-SAT deterministic time, summed over shapes
    best: Incumbent | None  # the incumbent: the warm start, then the best plan found
    results: list[ShapeResult] = field(default_factory=list)  # one per shape or subproblem settled
    candidates: int = 0  # shapes some group hosts
    fits: dict[tuple, StageFit] = field(default_factory=dict)  # each problem's stage-fit bounds
    bounds: dict[tuple, int] = field(default_factory=dict)  # each queued problem's best lower bound, us
    levels: dict[tuple, list[Problem]] = field(default_factory=dict)  # each shape's split by ZeRO edge
    queue: list[Problem] = field(default_factory=list)  # problems still to solve, most promising first
    earlier: dict[tuple, ShapeResult] = field(default_factory=dict)  # first attempts out of work, to retry once
    work_used: float = 0.0
    beat_us: int | None = None  # a faster plan of another schedule (``solve_plan``)

    def target(self) -> int:
        """What a shape must beat to be worth solving: the incumbent, less the gap the request
        accepts (``PlanRequest.gap``: a shape pruned or proven unable to beat this bounds the
        optimum within that gap)."""
        target = _target_us(self.best, self.req.gap)
        return target if self.beat_us is None else min(target, self.beat_us)

    def time_left(self) -> bool:
        return self.deadline - time.perf_counter() > 0

    # ---- the problems and their bounds, before any solve
    def problems(self) -> list[Problem]:
        """Every shape's problem, built only when its cheap bound (``shape_bound_us``) can beat
        the incumbent, in order of the problems' own lower bounds."""
        problems = []
        for shape in shapes(self.cm, self.req.global_batch, self.req.space):
            if time.perf_counter() > self.deadline:  # not built: nothing known about the shape
                self.results.append(ShapeResult(shape, "unknown", 0))
                continue
            bound = shape_bound_us(self.cm, shape, self.req.space)
            if bound is None:
                continue  # no group hosts it
            self.candidates += 1
            if self.best is not None and bound >= self.target():  # its tables are not worth building
                self.results.append(ShapeResult(shape, "pruned", bound))
                continue
            p = build_problem(self.cm, shape, self.req.space, extras=False)  # (``open`` adds them)
            if p is not None:
                problems.append(p)
        # Shapes first, whole; a shape is split by ZeRO edge (``edge_levels``) when it comes up to
        # be solved, so only shapes that survive the cheap bounds pay for their subproblems.
        problems.sort(key=lambda p: p.lower_bound_us)
        return problems

    def still_open(self, p: Problem) -> bool:
        """Record shapes proven unable to fit or to beat the incumbent; keep the rest."""
        if self.best is not None and p.lower_bound_us >= self.target():
            self.results.append(ShapeResult(p.shape, "pruned", p.lower_bound_us))
            return False
        if memory_infeasible(p):
            self.results.append(ShapeResult(p.shape, "infeasible", NEVER))
            return False
        if p.key not in self.fits and time.perf_counter() > self.deadline:
            self.results.append(ShapeResult(p.shape, "unknown", p.lower_bound_us))
            return False
        fit = self.fits.get(p.key) or self.fits.setdefault(p.key, StageFit(p, self._curves(p.shape)))
        if fit.bound_us() >= NEVER or not fit.holds_within_price():  # no pipeline holds the blocks: a proof
            self.results.append(ShapeResult(p.shape, "infeasible", NEVER))
            return False
        if self.best is not None and fit.prunes(self.target()):
            self.results.append(ShapeResult(p.shape, "pruned", self.target()))
            return False
        return True

    def _curves(self, shape: Shape) -> dict:
        """The shape's whole-block curves, shared by its subproblems and, on the cost model (its
        ``stage_cache``), by the cost objective's searches, whose price bounds leave them alike."""
        key = ("curves", shape, dataclasses.replace(self.req.space, price_cap=None))
        return self.cm.stage_cache.setdefault(key, {})

    def open(self, problems: list[Problem]) -> None:
        """Queue the problems still open, most promising first: a better incumbent early lets
        the stage-fit test prune the rest."""
        self.queue = [self._with_extras(p) for p in problems if self.still_open(p)]
        self.bounds = {p.key: max(p.lower_bound_us, self.fits[p.key].bound_us()) for p in self.queue}
        self.queue.sort(key=lambda p: self.bounds[p.key])
        self.levels = {p.key: edge_levels(p) for p in self.queue}

    def _with_extras(self, p: Problem) -> Problem:
        """An open problem with its schedule memory (``cpsat_problem.with_extras``), its stage
        fit reading it from now on (the envelope, built before, does not)."""
        q = with_extras(self.cm, p, self.req.space)
        self.fits[q.key].p = q
        return q

    def primal(self) -> None:
        """A plan near the optimum before CP-SAT (``primal``): shapes that cannot beat it are then
        refuted in a few hundredths of a work unit instead of being solved to their own optimum."""
        self.best = _primal_incumbent(self.cm, self.queue, self.levels, self.fits, self.bounds, self.best,
                                      self.req.gap, self.deadline)
        self.queue = [p for p in self.queue if self.still_open(p)]

    # ---- one queued problem
    def step(self, p: Problem) -> None:
        """Split a whole shape into its ZeRO-edge levels, or tighten its bound, solve it, record
        the result and take its plan if it is better."""
        if self._split(p) or not self._tighten(p):
            return
        r = self._solve(p)
        if r is not None:
            self._record(p, r)
            self._take(r)

    def _split(self, p: Problem) -> bool:
        """Queue a whole shape's ZeRO-edge levels (those still open) in its place, if it has
        several and time is left, unless the whole shape is refuted first (``_refute_whole``);
        True if the shape is settled or split."""
        if p.edge_ceiling_us is None and self.time_left() and len(self.levels[p.key]) > 1:
            if self._refute_whole(p):
                return True
            for q in self.levels[p.key]:
                if self.still_open(q):
                    self.bounds[q.key] = max(q.lower_bound_us, self.fits[q.key].bound_us())
                    self.queue.append(q)
            self.queue.sort(key=lambda q: self.bounds[q.key])
            return True
        return False

    def _refute_whole(self, p: Problem) -> bool:
        """With an incumbent, one short solve of the whole shape against the target
        (``WHOLE_WORK``) before it is split by ZeRO edge: a shape that cannot beat a near-optimal
        incumbent is refuted once instead of level by level (each level's solve has its own
        model build and presolve). True if that settled it; a plan it finds is taken either way."""
        if self.best is None or self.work_used >= self.work_limit:
            return False
        r = self._solve(p, work_cap=WHOLE_WORK)
        if r is None:  # out of time: recorded as it stands
            return True
        settled = r.status in ("infeasible", "optimal")  # nothing under the target, or the shape's optimum
        if settled:
            self._record(p, r)
        self._take(r)
        return settled

    def _tighten(self, p: Problem) -> bool:
        """The cheap envelope did not prune it: the whole-block curves may (while time and work
        are left, and unless the envelope meets the incumbent with more to spare than the curves
        close: ``StageFit.may_prune_tight``). False if the problem is now settled (and recorded)."""
        fit = self.fits[p.key]
        if (self.time_left() and self.work_used < self.work_limit and not fit.tight
                and (self.best is None or fit.may_prune_tight(self.target()))):
            fit.tighten()
            if not self.still_open(p):
                return False
            self.bounds[p.key] = max(self.bounds[p.key], self.fits[p.key].bound_us())
        return True

    def _solve(self, p: Problem, work_cap: float | None = None) -> ShapeResult | None:
        """CP-SAT on the problem with its share of the work left (or, with ``work_cap``, that
        much of it at most) and the incumbent as its upper bound and hint; None (and its first
        attempt or "unknown" recorded) once time or work is spent."""
        wall_left, work_left = self.deadline - time.perf_counter(), self.work_limit - self.work_used
        if wall_left <= 0 or work_left <= 0:
            self.results.append(self.earlier.get(p.key) or ShapeResult(p.shape, "unknown", self.bounds[p.key]))
            return None
        best, req = self.best, self.req
        hint = best.layout if best is not None and _shape_of(best.layout, req.global_batch) == p.shape else None
        if hint is None and p.key in self.earlier:
            hint = self.earlier[p.key].layout
        # Share the work left among the shapes still open, giving the most promising more;
        # a shape that runs out is retried once at the end with whatever work is left.
        if work_cap is not None:
            work = min(work_cap, work_left)
        elif p.key in self.earlier:  # the retry
            work = work_left
        else:
            work = min(work_left, max(MIN_WORK, work_left / min(len(self.queue) + 1, 4)))
        # The model is the same with or without a gap (CP-SAT's path through it is sensitive to
        # its upper bound: one less than the incumbent either way); with a gap CP-SAT stops once
        # its own bound is within it.
        # Below the target, not the incumbent: with a gap, a plan between the two would not
        # change what the search proves (the optimum is within the gap of the incumbent either
        # way), and refuting the target is less work than refuting the incumbent.
        ceiling = self.target() if best is not None else self.beat_us
        r = solve_shape(p, upper_bound_us=ceiling - 1 if ceiling is not None else None, hint=hint, gap=req.gap,
                        time_limit_s=wall_left, workers=req.workers, seed=req.seed, fit=self.fits[p.key],
                        work_limit=work)
        self.work_used += r.work
        return r

    def _record(self, p: Problem, r: ShapeResult) -> None:
        """Keep the result, or, for a first attempt that ran out of work short of the gap asked
        for, queue the problem once more (its result kept for the retry)."""
        gap = self.req.gap
        settled = (r.status == "feasible" and gap > 0 and r.objective_us is not None
                   and r.objective_us - r.bound_us <= gap * r.objective_us)  # within the gap asked for
        if r.status in ("feasible", "unknown") and not settled:
            r.bound_us = max(r.bound_us, self.bounds[p.key])
            if p.key not in self.earlier:
                self.earlier[p.key] = r
                self.queue.append(p)
            else:
                self.results.append(r)
        else:
            self.results.append(r)
        log.info("shape %s, edge <= %s us: %s, bound %d us, %.2f s, work %.2f", p.shape, p.edge_ceiling_us, r.status,
                 r.bound_us, r.wall_s, r.work)

    def _take(self, r: ShapeResult) -> None:
        """The solver's plan becomes the incumbent if the evaluator finds it fits and faster;
        then the queue drops what it refutes."""
        if r.layout is None:
            return
        lay, best = r.layout, self.best
        ev = evaluate_layout(self.cm, list(zip(lay.stage_groups, lay.stage_layers)), dp=lay.dp, tp=lay.tp,
                             micro_batch=lay.micro_batch, num_micro_batches=lay.num_micro_batches)
        if ev.fits and (best is None or ev.step_time_s < best.evaluation.step_time_s):
            self.best = Incumbent(lay, ev, min(best.us, r.objective_us) if best is not None else r.objective_us)
            self.queue = [q for q in self.queue if self.still_open(q)]

    # ---- read back
    def plan(self, uniform: UniformResult, start: float) -> Plan:
        """The incumbent as a plan with the search's report; with none, "does not fit" when every
        shape is proven infeasible, else SearchTimeout. ``start``: when ``solve_plan`` began."""
        from partita.search.plans import layout_to_plan, timeout_error

        cm, req, best = self.cm, self.req, self.best
        if best is None:
            if all(r.status == "infeasible" for r in self.results):
                raise infeasible_error(cm, uniform, req.global_batch, req.space)
            raise timeout_error(cm, req)
        uniform_us = to_us(uniform.best_eval.step_time_s) if uniform.best_eval is not None else 0
        report = _report(req, best, self.results, uniform_us, self.candidates,
                         time.perf_counter() - start + uniform.wall_s, beat_us=self.beat_us)
        return layout_to_plan(cm, best.layout, global_batch=req.global_batch, solver=report)


def _target_us(best: Incumbent, gap: float) -> int:
    """The incumbent less the gap the request accepts (``solve_plan``'s target)."""
    if not gap:
        return best.us
    # From the plan's own (evaluated) step time, which the reported gap is relative to.
    return min(best.us, math.ceil(to_us(best.evaluation.step_time_s) * (1 - gap)))


def _primal_incumbent(cm: CostModel, queue: list[Problem], levels: dict[tuple, list[Problem]],
                      fits: dict[tuple, StageFit], bounds: dict[tuple, int], best: Incumbent | None, gap: float,
                      deadline: float) -> Incumbent | None:
    """The best plan the primal heuristic (``primal.shape_plans``) finds in the open shapes, in
    the order given, or ``best`` if none beats it. A shape the incumbent already refutes is
    skipped. First each shape's subproblem of every choice (its top ZeRO-edge level), then the
    lower levels of the shapes whose plan a smaller edge could bring under the target: a lower
    level only forbids choices, and saves at most m x the edge above its floor."""
    start, tried = time.perf_counter(), 0
    tables: dict[Shape, dict] = {}  # each shape's slot tables, shared by its subproblems
    found: dict[Shape, tuple[int, int]] = {}  # each shape's best plan at its top level: (step, ZeRO edge), us
    for top in (True, False):
        for p in queue:
            if deadline - time.perf_counter() <= 0:
                break
            if best is not None and (bounds[p.key] >= _target_us(best, gap)
                                     or fits[p.key].prunes(_target_us(best, gap))):
                continue
            for q in (levels[p.key][-1:] if top else levels[p.key][:-1]):
                if best is not None and q.lower_bound_us >= _target_us(best, gap):
                    continue
                if not top and p.shape in found:
                    step_us, edge_us = found[p.shape]
                    if step_us - p.shape.num_micro_batches * max(0, edge_us - q.edge_floor_us) >= _target_us(best, gap):
                        continue
                tried += 1
                for lay in shape_plans(q, tables.setdefault(p.shape, {})):
                    if parallel.pipeline_zero_rule(cm.engine.name, lay.pp,
                                                   ((s.name, s.zero) for stage in lay.stage_layers for s in stage),
                                                   cm.cp):
                        continue  # the heuristic does not know the rule; the CP-SAT model does
                    ev = evaluate_layout(cm, list(zip(lay.stage_groups, lay.stage_layers)), dp=lay.dp, tp=lay.tp,
                                         micro_batch=lay.micro_batch, num_micro_batches=lay.num_micro_batches)
                    if not ev.fits:  # the evaluator has the last word on memory
                        continue
                    us = to_us(ev.step_time_s)
                    if top and (p.shape not in found or us < found[p.shape][0]):
                        found[p.shape] = (us, to_us(max(s.zero_edge_s for s in ev.stages)))
                    if best is None or ev.step_time_s < best.evaluation.step_time_s:
                        best = Incumbent(lay, ev, us)
    log.info("primal heuristic: %s us after %d subproblems, %.2f s", best.us if best else None, tried,
             time.perf_counter() - start)
    return best


def _report(req, best: Incumbent, results: list[ShapeResult], uniform_us: int, candidates: int,
            wall_s: float, beat_us: int | None = None) -> SolverReport:
    """Status, bound and gap of the search: optimal only when the bound meets the plan within
    the integer rounding of its terms (every shape settled, or the bounds close enough)."""
    bound = min([best.us] + [r.bound_us for r in results])
    objective = to_us(best.evaluation.step_time_s)
    exact = all(r.status in ("optimal", "infeasible", "pruned") for r in results)  # every shape settled
    lay = best.layout
    # Each layer's time is rounded to a microsecond (half of one off at most), and so are a
    # stage's boundary terms (up to two transfers and two end gathers), counted once per
    # micro-batch the schedule's formula takes them, and its per-step terms (data-parallel sync,
    # the window that hides it, optimizer step) are rounded apart: three more.
    slack = (lay.num_micro_batches - 1 + lay.pp + 3) * (max(len(l) for l in lay.stage_layers) + 3) / 2
    if exact and objective - bound > slack + req.gap * objective and (beat_us is None or bound < beat_us - slack):
        # A shape proven better than the plan returned means the solver and the evaluator
        # disagree on a cost; never call that optimal.
        log.warning("a shape's proven optimum (%d us) beats the plan returned (%d us): the CP-SAT model and the "
                    "evaluator disagree; reporting the plan as feasible", bound, objective)
    status = "optimal" if objective - bound <= slack else "feasible"
    bound = min(bound, objective)
    gap = (objective - bound) / objective if objective else 0.0
    return SolverReport(method="cpsat", status=status, objective_us=objective, bound_us=bound,
                        gap=round(max(gap, 0.0), 6), wall_s=round(wall_s, 4), workers=req.workers, seed=req.seed,
                        ortools_version=ortools.__version__, uniform_objective_us=uniform_us, candidates=candidates)


def _shape_of(layout: Layout, global_batch: int) -> Shape:
    return Shape(layout.dp * layout.tp, layout.tp, layout.dp, layout.micro_batch, layout.num_micro_batches,
                 uneven=bool(batch_shares(global_batch, layout.dp, layout.micro_batch, layout.num_micro_batches)))
