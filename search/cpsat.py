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
are then laid out in strategy order; the cost model is additive over a stage's blocks, so the
order inside a stage changes nothing to it (the runtime's layout conversions between
sequence-parallel and replicated layers, one activation-sized all-gather each, are not priced;
docs/search.md lists this approximation).

Slots are indexed from the *end* of the pipeline (r = 0 is the last stage, holding the head),
so the micro-batches a 1F1B stage keeps in flight, ``min(r + 1, m)``, are constants and the
pipeline degree stays a decision: used slots are a prefix, and the first stage (holding the
embedding) is the highest used slot.

Objective (the cost model's step time, integer microseconds; ``partita.units`` rounding):
``(m - 1) * max_r T_r + sum_r T_r + m * Z + max_r exposed_dp_r + max_r optimizer_r`` plus the
fixed per-step overhead, with Z the largest stage's exposed ZeRO edge. The solver's objective
equals the evaluator's prediction of the returned plan up to that rounding: each per-layer term
is rounded to the nearest microsecond, so they differ by at most
``(m - 1 + pp) * (layers per stage + 3) / 2 + m / 2 + 1`` microseconds. Memory is in whole allocation
grains (``partita.units``: the cost model's byte counts are whole grains), summed as the
evaluator sums them, so the solver accepts exactly the plans that fit.

The uniform planner's best plan is the warm start (a hint, and an upper bound every shape
must beat), the fallback, and the yardstick reported in the plan.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from ortools.sat.python import cp_model

import ortools
from partita.cluster import NodeGroup
from partita.plan import LayerStrategy, Plan, SolverReport
from partita.search.costs import (CostModel, activation_message_bytes, boundary_s, canonical_order, choice_of,
                                  stage_cost_counts)
from partita.search.evaluate import Evaluation, evaluate_layout
from partita.search.uniform import (Layout, SearchSpace, UniformResult, batch_splits, divisors, hosts,
                                    device_price, infeasible_error, layer_tp, max_stages, sp_choices, stage_sizes,
                                    tp_allowed)
from partita.units import capacity_grains, to_grains, to_us

log = logging.getLogger(__name__)

NEVER = 1 << 61  # the bound of a shape proven to hold no plan at all


# ---- the problem: integer cost tables for one shape ----------------------------------------
@dataclass(frozen=True)
class Shape:
    stage_size: int
    tp: int
    dp: int
    micro_batch: int
    num_micro_batches: int  # the largest replica's share when they differ
    uneven: bool = False  # replicas take batch shares that differ by one (``uniform.batch_shares``)


@dataclass(frozen=True)
class LayerTable:
    """Integer costs of one layer kind per (group, strategy): times in microseconds, memory
    (the ``*_bytes`` fields) in allocation grains (``partita.units.MEMORY_GRAIN``)."""

    strategies: tuple[LayerStrategy, ...]  # name is a placeholder
    time_us: tuple[tuple[int, ...], ...]  # [g][k] forward + backward per micro-batch
    backward_us: tuple[tuple[int, ...], ...]
    sync_us: tuple[tuple[int, ...], ...]  # per-step data-parallel sync
    optimizer_us: tuple[tuple[int, ...], ...]
    static_bytes: tuple[tuple[int, ...], ...]  # weights + gradients + optimizer state
    act_bytes: tuple[tuple[int, ...], ...]  # kept activations, one micro-batch
    transient_bytes: tuple[tuple[int, ...], ...]  # extra at its own peak moment (gathers, recompute, working set)
    # A tied head on another stage than the embedding (its own copy of the shared weight):
    copy_transient_bytes: tuple[tuple[int, ...], ...] = ()
    tied_us: tuple[tuple[int, ...], ...] = ()  # per step: the copies' gradient sum and the copy's update
    # Time terms a stage takes as the largest over its layers, or sums (costs.StageCost):
    edge_us: tuple[tuple[int, ...], ...] = ()  # exposed ZeRO traffic if it is the stage's edge layer
    window_us: tuple[tuple[int, ...], ...] = ()  # backward the data-parallel sync can hide behind
    order: tuple[tuple[int, ...], ...] = ()  # [g]: the strategies in a stage's canonical order
    # [g][k]: the choices a subproblem allows (``edge_levels``); empty: every one.
    allowed: tuple[tuple[bool, ...], ...] = ()

    def allows(self, g: int, k: int) -> bool:
        return not self.allowed or self.allowed[g][k]

    def on(self, g: int) -> list[int]:
        """The choices allowed on group g."""
        return [k for k in range(len(self.strategies)) if self.allows(g, k)]

    def least(self, field: str) -> int:
        """The least of a field over every allowed (group, choice); a huge number if none is."""
        table = getattr(self, field)
        return min((table[g][k] for g in range(len(table)) for k in self.on(g)), default=NEVER)


@dataclass(frozen=True)
class Problem:
    shape: Shape
    groups: tuple[NodeGroup, ...]
    slots: int  # most stages the shape allows (K)
    stages_per_group: tuple[int, ...]
    n_blocks: int
    block: LayerTable
    embed: LayerTable
    head: LayerTable
    p2p_us: tuple[tuple[int, ...], ...]  # [g][h] send + receive between a stage on g and the next on h
    capacity_bytes: tuple[int, ...]  # per group, minus the reserve
    lower_bound_us: int
    tied: bool = False  # embedding and head share one weight
    pipeline: tuple[int, ...] | None = None  # allowed pipeline degrees, None: any
    # What the evaluator counts for a stage beyond its layers' own terms (the schedule's
    # buffers, a last stage's retained output), per group, by the stage's place in the
    # pipeline: [g] for a first or a middle stage, [g][head choice] for a last or a lone one.
    extra_first: tuple[int, ...] = ()
    extra_middle: tuple[int, ...] = ()
    extra_last: tuple[tuple[int, ...], ...] = ()
    extra_alone: tuple[tuple[int, ...], ...] = ()
    output_bytes: int = 0  # a stage's output (micro_batch x seq x hidden), kept per micro-batch in flight
    step_overhead_us: int = 0  # the fixed per-step overhead (CostModel.step_overhead_s)
    # A subproblem of the shape (``edge_levels``): only the choices whose exposed ZeRO edge is
    # at most the ceiling, and the edge term Z at least the floor; None: the whole shape.
    edge_ceiling_us: int | None = None
    edge_floor_us: int = 0
    # The cost objective's bound on the devices used (``SearchSpace.price_cap``), micro-dollars
    # per hour, and what a stage on each group costs; None: no bound.
    price_cap: int | None = None
    stage_price: tuple[int, ...] = ()

    @property
    def key(self) -> tuple[Shape, int | None]:
        return self.shape, self.edge_ceiling_us


def strategies_for(cm: CostModel, role: str, shape: Shape, space: SearchSpace) -> list[LayerStrategy]:
    """Every choice the runtime executes for this layer kind in this shape."""
    out = []
    tps = sorted({1, layer_tp(cm.model, role, shape.tp)})
    zeros = (0,) if shape.dp == 1 else tuple(z for z in space.zero_levels if z <= 1 or not shape.uneven)
    recomputes = space.recompute if role == "block" else (False,)
    for t in tps:
        for sp in sp_choices(cm, t, space):
            for z in zeros:
                for rc in recomputes:
                    out.append(LayerStrategy(name=role, tensor_parallel=t, sequence_parallel=sp, zero=z, recompute=rc))
    return out


def layer_table(cm: CostModel, role: str, shape: Shape, groups: Sequence[NodeGroup], space: SearchSpace) -> LayerTable:
    """The integer cost table of one kind. Dominated choices are dropped, except for a tied
    embedding and head, whose choices must be matched pairwise."""
    strategies = strategies_for(cm, role, shape, space)
    rows: dict[str, list[list[int]]] = {k: [] for k in ("time", "bwd", "sync", "opt", "static", "act", "gath", "edge", "win",
                                                         "copy_gath", "tied")}
    copy = role == "head" and cm.model.tie_embeddings
    for g in groups:
        cols: dict[str, list[int]] = {k: [] for k in rows}
        for s in strategies:
            t = cm.layer_time(role, g, s, dp=shape.dp, micro_batch=shape.micro_batch)
            m = cm.layer_memory(role, g.device, s, dp=shape.dp, micro_batch=shape.micro_batch,
                                num_micro_batches=shape.num_micro_batches)
            cols["time"].append(to_us(t.total_s))
            cols["bwd"].append(to_us(t.backward_s))
            cols["sync"].append(to_us(t.dp_sync_s))
            cols["opt"].append(to_us(t.optimizer_s))
            cols["edge"].append(to_us(t.zero_edge_s))
            cols["win"].append(to_us(t.overlap_window_s))
            cols["static"].append(to_grains(m.static_bytes))
            cols["act"].append(to_grains(m.activations))
            cols["gath"].append(to_grains(m.transient))
            if copy:
                mc = cm.layer_memory(role, g.device, s, dp=shape.dp, micro_batch=shape.micro_batch,
                                     num_micro_batches=shape.num_micro_batches, tied_copy=True)
                cols["copy_gath"].append(to_grains(mc.transient))
                cols["tied"].append(to_us(cm.tied_sync_s(g, dp=shape.dp, tp=s.tensor_parallel, zero=s.zero)))
        for k in rows:
            rows[k].append(cols[k])
    keep = list(range(len(strategies))) if cm.model.tie_embeddings and role != "block" else undominated([[rows[k][g][j] for k in ("time", "opt", "static", "act", "gath", "edge", "sync") for g in range(len(groups))]
                        + [-rows["win"][g][j] for g in range(len(groups))]
                        for j in range(len(strategies))])
    strategies = [strategies[j] for j in keep]
    tup = lambda k: tuple(tuple(r[j] for j in keep) for r in rows[k])  # noqa: E731
    # The order the evaluator prices a stage's layers in and the plan writes them in
    # (``costs.canonical_order``), per group, as indices into ``strategies``.
    choices = [choice_of(cm.model, dataclasses.replace(s, name="layers.0" if role == "block" else role))
               for s in strategies]
    order = tuple(tuple(choices.index(c) for c in canonical_order(
        cm, g.device, choices, dp=shape.dp, micro_batch=shape.micro_batch,
        num_micro_batches=shape.num_micro_batches)) for g in groups)
    return LayerTable(strategies=tuple(strategies), time_us=tup("time"), backward_us=tup("bwd"), sync_us=tup("sync"),
                      optimizer_us=tup("opt"), static_bytes=tup("static"), act_bytes=tup("act"),
                      transient_bytes=tup("gath"), copy_transient_bytes=tup("copy_gath") if copy else (),
                      tied_us=tup("tied") if copy else (), edge_us=tup("edge"), window_us=tup("win"), order=order)


def undominated(vectors: list[list[int]]) -> list[int]:
    """Indices of the choices no other choice beats or ties on every cost (time, exposed sync,
    optimizer, each memory term, on every group). Dropping the others cannot make the optimum
    worse, and shrinks the model; of exact ties the first is kept."""
    keep = []
    for j, v in enumerate(vectors):
        dominated = False
        for i, w in enumerate(vectors):
            if i != j and all(a <= b for a, b in zip(w, v)) and (w != v or i < j):
                dominated = True
                break
        if not dominated:
            keep.append(j)
    return keep


def shapes(cm: CostModel, global_batch: int, space: SearchSpace) -> list[Shape]:
    """Every (stage size, tp, micro-batch) some node group can host."""
    model = cm.model
    sizes = sorted({s for g in cm.cluster.groups for s in stage_sizes(g)})
    out = []
    for stage_size in sizes:
        for tp in divisors(stage_size):
            if not tp_allowed(model, tp, space):
                continue
            if not any(hosts(g, stage_size, tp) for g in cm.cluster.groups):
                continue
            dp = stage_size // tp
            out += [Shape(stage_size, tp, dp, mb, m, uneven=dp * mb * m != global_batch)
                    for mb, m in batch_splits(global_batch, dp, space)]
    return out


def build_problem(cm: CostModel, shape: Shape, space: SearchSpace) -> Problem | None:
    """Integer tables for one shape, or None if no group can host a stage of it."""
    groups = tuple(g for g in cm.cluster.groups if hosts(g, shape.stage_size, shape.tp))
    if not groups:
        return None
    per_group = tuple(g.size // shape.stage_size for g in groups)
    slots = min(sum(per_group), max_stages(cm, shape.num_micro_batches))
    if space.pipeline:
        slots = min(slots, max(space.pipeline))
    block = layer_table(cm, "block", shape, groups, space)
    embed = layer_table(cm, "embed", shape, groups, space)
    head = layer_table(cm, "head", shape, groups, space)
    p2p = tuple(tuple(_p2p_us(cm, a, b, shape) for b in groups) for a in groups)
    capacity = tuple(capacity_grains(g.memory_bytes - cm.reserve_bytes(g)) for g in groups)
    lb = _lower_bound_us(cm, shape, block, embed, head, slots)
    extra = lambda g, first, last, k=0: _stage_extra_bytes(cm, shape, groups, g, block, embed, head,  # noqa: E731
                                                            first=first, last=last, head_k=k)
    heads = range(len(head.strategies))
    return Problem(shape=shape, groups=groups, slots=slots, stages_per_group=per_group, n_blocks=cm.model.n_layers,
                   block=block, embed=embed, head=head, p2p_us=p2p, capacity_bytes=capacity, lower_bound_us=lb,
                   tied=cm.model.tie_embeddings, pipeline=space.pipeline,
                   extra_first=tuple(extra(g, True, False) for g in range(len(groups))),
                   extra_middle=tuple(extra(g, False, False) for g in range(len(groups))),
                   extra_last=tuple(tuple(extra(g, False, True, k) for k in heads) for g in range(len(groups))),
                   extra_alone=tuple(tuple(extra(g, True, True, k) for k in heads) for g in range(len(groups))),
                   output_bytes=to_grains(activation_message_bytes(cm, shape.micro_batch)),
                   step_overhead_us=to_us(cm.step_overhead_s), price_cap=space.price_cap,
                   stage_price=tuple(shape.stage_size * device_price(g) for g in groups)
                   if space.price_cap is not None else ())


EDGE_LEVEL_RATIO = 1.25  # edge values within this ratio of the level's least share a subproblem


def edge_levels(p: Problem) -> list[Problem]:
    """The shape split by its largest exposed ZeRO edge (Z, paid m times a step). The distinct
    edge values, grouped into levels [lo, hi] (values within ``EDGE_LEVEL_RATIO`` of each other:
    on a mixed cluster one choice's edge differs a little from group to group), give one
    subproblem each, allowing only the choices whose edge is at most hi and holding Z >= lo.
    Every plan of the shape is in the subproblem of its own largest edge, priced exactly, and in
    those above it priced at least as high, so the least over the subproblems is the shape's
    optimum. What the split buys is bounds: a relaxation free to pick any choice must still pay
    the edge of the lean (ZeRO-3) ones m times, so they stop making every shape look cheap."""
    tables = (p.block, p.embed, p.head)
    values = sorted({v for t in tables for row in t.edge_us for v in row})
    levels: list[list[int]] = []
    for v in values:
        if levels and v <= EDGE_LEVEL_RATIO * levels[-1][0]:
            levels[-1][1] = v
        else:
            levels.append([v, v])
    if len(levels) <= 1:
        return [p]
    out = []
    m = p.shape.num_micro_batches
    for lo, hi in levels:
        block, embed, head = (dataclasses.replace(t, allowed=tuple(tuple(v <= hi for v in row) for row in t.edge_us))
                              for t in tables)
        if min(t.least("time_us") for t in (block, embed, head)) >= NEVER:
            continue  # some layer has no choice this low
        work = p.n_blocks * block.least("time_us") + embed.least("time_us") + head.least("time_us")
        lb = int(math.floor(work * (m - 1 + p.slots) / p.slots)) + m * lo
        out.append(dataclasses.replace(p, block=block, embed=embed, head=head, edge_floor_us=lo, edge_ceiling_us=hi,
                                       lower_bound_us=lb))
    return out


def _stage_extra_bytes(cm: CostModel, shape: Shape, groups: Sequence[NodeGroup], g: int, block: LayerTable,
                       embed: LayerTable, head: LayerTable, *, first: bool, last: bool, head_k: int) -> int:
    """A stage's peak under the evaluator, less the reserve and its layers' own terms (static
    state, in-flight activations and outputs, the running micro-batch's activations up to its
    peak layer and that layer's transient): what the schedule adds for a stage at this place in
    the pipeline. Measured on a stage of one block, so the CP-SAT memory sums stay those of the
    evaluator whatever stage-level terms the cost model holds."""
    parts = ([(embed, 0, "embed")] if first else []) + [(block, 0, "layers.0")] + ([(head, head_k, "head")] if last else [])
    counts = {choice_of(cm.model, dataclasses.replace(t.strategies[k], name=name)): 1 for t, k, name in parts}
    pp, stage = {(True, True): (1, 0), (True, False): (2, 0), (False, True): (2, 1), (False, False): (3, 1)}[first, last]
    group = groups[g]
    sc = stage_cost_counts(cm, group, counts, stage=stage, pp=pp, dp=shape.dp, tp=shape.tp,
                           micro_batch=shape.micro_batch, num_micro_batches=shape.num_micro_batches,
                           next_group=None if last else group)
    acts = sum(t.act_bytes[g][k] for t, k, _ in parts)
    running, prefix = 0, 0
    for t, k, name in parts:  # the canonical order: embed, blocks, head
        prefix += t.act_bytes[g][k]
        copy = name == "head" and not first and t.copy_transient_bytes
        running = max(running, prefix + (t.copy_transient_bytes if copy else t.transient_bytes)[g][k])
    own = (sum(t.static_bytes[g][k] for t, k, _ in parts) + (sc.in_flight - 1) * acts
           + sc.in_flight * to_grains(sc.output_per_mb) + running)
    return to_grains(sc.peak_bytes - sc.reserve) - own


def _p2p_us(cm: CostModel, a: NodeGroup, b: NodeGroup, shape: Shape) -> int:
    """One side of the boundary between a stage on ``a`` and the next on ``b`` (each side pays it)."""
    return to_us(boundary_s(cm, a, b, dp=shape.dp, tp=shape.tp, micro_batch=shape.micro_batch))


def _lower_bound_us(cm: CostModel, shape: Shape, block: LayerTable, embed: LayerTable, head: LayerTable,
                    slots: int) -> int:
    """A proven bound for the shape: the least total work W (each layer at its cheapest group and
    strategy), and (m - 1) * max T + sum T >= W * (m - 1 + pp) / pp >= W * (m - 1 + K) / K."""
    work = cm.model.n_layers * block.least("time_us") + embed.least("time_us") + head.least("time_us")
    m = shape.num_micro_batches
    return int(math.floor(work * (m - 1 + slots) / slots))


def _hull(mem: np.ndarray, time_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lower convex envelope of (memory, time) points, memory increasing, time non-increasing:
    the least average time per block for any average memory per block (fractional mixes)."""
    order = np.lexsort((time_, mem))
    pts: list[tuple[float, float]] = []
    for x, y in zip(mem[order], time_[order]):
        if pts and y >= pts[-1][1]:
            continue  # more memory and no faster: never on the envelope
        while len(pts) >= 2 and (pts[-1][1] - pts[-2][1]) * (x - pts[-2][0]) >= (y - pts[-2][1]) * (pts[-1][0] - pts[-2][0]):
            pts.pop()
        pts.append((float(x), float(y)))
    xs, ys = zip(*pts)
    return np.array(xs), np.array(ys)


def _hull_cuts(f: np.ndarray) -> list[tuple[float, float]]:
    """Lines (slope, intercept) of the lower convex hull of points (n, f[n]), n = 0..len-1.
    Each lies below every point, and the intercept is <= f[0] = 0."""
    hull: list[tuple[int, float]] = []
    for n, v in enumerate(f):
        while len(hull) >= 2 and (hull[-1][1] - hull[-2][1]) * (n - hull[-2][0]) >= (v - hull[-2][1]) * (hull[-1][0] - hull[-2][0]):
            hull.pop()
        hull.append((n, float(v)))
    cuts = []
    for (n0, v0), (n1, v1) in zip(hull, hull[1:]):
        slope = (v1 - v0) / (n1 - n0)
        cuts.append((slope, v0 - slope * n0))
    return cuts


def _slot_floor(p: Problem, r: int, k: int) -> int:
    """Memory any stage in slot r holds besides its layers' own terms, whatever the pipeline's
    depth: a used slot r >= 1 is not the last stage, so the schedule keeps a gradient receive
    buffer per micro-batch and its output per micro-batch in flight (``pipeline_memory``)."""
    return (p.shape.num_micro_batches + k) * p.output_bytes if r >= 1 else 0


class StageFit:
    """Whether a shape's stages can hold all blocks with no stage slower than tau.

    With pp stages, stage r (from the end) keeps k = min(r + 1, m) micro-batches in flight, so
    on group g its n blocks may use at most room_g / n memory each on average; the least time
    for them is at first n x the (memory, time) envelope of the block's choices at that average
    (the LP relaxation of the stage), and after ``tighten`` the whole-block curves
    (``integer_curve``). Stages are counted per group up to the group's share.
    This yields proofs (``prunes``) and bounds (``bound_us``) that account for memory, which
    the plain work bound does not.
    """

    def __init__(self, p: Problem, shared: dict | None = None) -> None:
        self.p = p
        self.m = p.shape.num_micro_batches
        # Whole-block curves by slot, group and the choices allowed there: one shape's
        # subproblems (``edge_levels``) share them where their choices agree.
        self._int = {} if shared is None else shared
        N, G = p.n_blocks, len(p.groups)
        self.least_embed = p.embed.least("time_us")
        self.least_head = p.head.least("time_us")
        self.least_p2p = min(min(r) for r in p.p2p_us)
        self.work = N * p.block.least("time_us") + self.least_embed + self.least_head
        # The objective's terms no slowest stage or work bound holds: a subproblem's edge m x Z,
        # the step overhead, and the least exposed sync and optimizer step any block brings (the
        # exposed sync is at least every layer's own reduction, the optimizer step at least one
        # block's).
        self.fixed = (self.m * p.edge_floor_us + p.step_overhead_us + p.block.least("sync_us")
                      + p.block.least("optimizer_us"))
        # [group, slot, blocks]: least stage time of its blocks, for a slot holding the first
        # stage (slot 0: the only one), for one that does not, and for either. First the cheap
        # fractional envelope (``_envelope``), then, for shapes it does not prune, the whole-block
        # curves (``tighten``).
        self.curves = self._envelope(first=True)
        self.curves_not_first = self._envelope(first=False)
        self.curves_any = np.minimum(self.curves, self.curves_not_first)
        self.tight = False

    def tighten(self) -> None:
        """Replace the envelope by the whole-block curves (``integer_curve``); bounds are recomputed."""
        if self.tight:
            return
        p, G = self.p, len(self.p.groups)
        self.curves = np.array([[self.integer_curve(r, g, first=True) for r in range(p.slots)] for g in range(G)])
        self.curves_not_first = np.array([[self.integer_curve(r, g, first=False) for r in range(p.slots)]
                                          for g in range(G)])
        self.curves_any = np.minimum(self.curves, self.curves_not_first)
        self.tight = True
        self.__dict__.pop("_tau", None)
        self.__dict__.pop("_tau_at", None)

    def _envelope(self, *, first: bool) -> np.ndarray:
        """Least time of n blocks in each (group, slot) when blocks may mix choices fractionally:
        n x the (memory, time) envelope of the allowed choices at the slot's room / n (the LP
        relaxation of the stage; transients left out). ``first``: a slot that may hold the first
        stage; otherwise (tighter) one that keeps an activation receive buffer per micro-batch."""
        p, N = self.p, self.p.n_blocks
        n = np.arange(1, N + 1, dtype=float)
        head_room = p.head.least("static_bytes")
        recv = 0 if first else self.m * p.output_bytes
        rows = []
        for g in range(len(p.groups)):
            row = []
            allowed = p.block.on(g)
            for r in range(p.slots):
                k = min(r + 1, self.m)
                if not allowed:
                    row.append(np.concatenate([[0.0], np.full(N, np.inf)]))
                    continue
                mem = np.array([p.block.static_bytes[g][j] + k * p.block.act_bytes[g][j] for j in allowed], float)
                xs, ys = _hull(mem, np.array([p.block.time_us[g][j] for j in allowed], float))
                room = p.capacity_bytes[g] - (head_room if r == 0 else 0) - _slot_floor(p, r, k) - recv
                per_block = room / n
                avg = np.interp(per_block, xs, ys)  # beyond the last point: the fastest choice
                avg[per_block < xs[0]] = np.inf  # not even the leanest choice fits
                row.append(np.concatenate([[0.0], n * avg]))
            rows.append(np.stack(row))
        return np.stack(rows)

    def integer_curve(self, r: int, g: int, grain_steps: int = 4096, *, first: bool | None = None) -> np.ndarray:
        """Least time of n = 0..N whole blocks in slot r on group g within its memory (blocks
        may mix choices), by dynamic programming over a memory grid; inf where n blocks cannot
        fit. A lower bound on the slot's block time, as tight as two of the memory rows (M) allow:

        - at the last layer in the canonical order (the used choice of least transient, j):
          static + k x activations of every block + j's transient;
        - at the first (the used choice of largest transient, h): static + (k - 1) x every
          block's activations + h's own activations (at least one block's) + h's transient;

        each beside the least the slot holds whatever its layers (its place's schedule extra,
        outputs in flight, a last stage's head). ``first`` says whether the slot holds the
        first stage (for slot 0: the only one), None either. Each row is a knapsack over the choices a
        prefix of the canonical order allows, solved for every prefix in one pass; the curve is
        the larger of the two rows' least times. Memory and room are rounded down to whole grid
        cells (the sum of rounded-down weights is at most the rounded-down sum), so the curve
        stays a lower bound."""
        p, N = self.p, self.p.n_blocks
        b = p.block
        order = [j for j in (b.order[g] if b.order else range(len(b.strategies))) if b.allows(g, j)]
        cache, at = self._int, (r, g, tuple(order), tuple(p.head.on(g)))
        if (*at, first) in cache:
            return cache[(*at, first)]
        k = min(r + 1, self.m)
        places = (True, False)
        rooms = [p.capacity_bytes[g] - self._slot_least_bytes(r, g, k, place) for place in places]
        if not order:
            curves = [np.concatenate([[0.0], np.full(N, np.inf)]) for _ in places]
        else:
            times = [float(t) for t in b.time_us[g]]
            tr = b.transient_bytes[g]
            full = [b.static_bytes[g][j] + k * b.act_bytes[g][j] for j in range(len(times))]
            lean = [b.static_bytes[g][j] + (k - 1) * b.act_bytes[g][j] for j in range(len(times))]
            head = 0
            if r == 0 and p.head.transient_bytes:  # the head's own moment, after every block
                head = min((p.head.act_bytes[g][h] + p.head.transient_bytes[g][h] for h in p.head.on(g)), default=NEVER)
            # Per place: the last layer's row (and the head's: the prefix of every choice), then the first's.
            last = self._knapsack(order, full, times, [[room - max(tr[j], head) for j in order] for room in rooms],
                                  grain_steps)
            lead = self._knapsack(order[::-1], lean, times,
                                  [[room - b.act_bytes[g][j] - tr[j] for j in order[::-1]] for room in rooms], grain_steps)
            curves = [np.maximum(a, c) for a, c in zip(last, lead)]
        for place, curve in zip(places, curves):
            curve[0] = 0.0
            cache[(*at, place)] = curve
        cache[(*at, None)] = np.minimum(*curves)
        return cache[(*at, first)]

    def _slot_least_bytes(self, r: int, g: int, k: int, first: bool | None = None) -> int:
        """Memory slot r on group g holds besides its blocks' static state and activations at
        any moment, at its place in the pipeline (``first``: the first stage, or for slot 0 the
        only one; None: either) whatever its head's choice: the schedule's extra, the outputs in
        flight, the head's state and activations (slot 0)."""
        p = self.p
        pick = lambda a, b: {True: a, False: b, None: min(a, b)}[first]  # noqa: E731
        if r == 0:
            h = p.head
            least = min((h.static_bytes[g][j] + (k - 1) * h.act_bytes[g][j]
                         + (pick(p.extra_alone[g][j], p.extra_last[g][j]) if p.extra_last else 0)
                         for j in h.on(g)), default=NEVER)
        else:
            least = k * p.output_bytes + (pick(p.extra_first[g], p.extra_middle[g]) if p.extra_first else 0)
        return max(least, _slot_floor(p, r, k) + (p.head.least("static_bytes") if r == 0 else 0))

    def _knapsack(self, order: list[int], weight: list[int], times: list[float], rooms: list[list[int]],
                  grain_steps: int) -> list[np.ndarray]:
        """Least time of n = 0..N blocks whose choices come from a prefix of ``order``, within
        that prefix's room (``rooms[i]`` once ``order[i]`` is allowed), the least over prefixes:
        an unbounded knapsack with a count dimension, one pass over the choices, read for each
        list of rooms given."""
        N = self.p.n_blocks
        outs = [np.full(N + 1, np.inf) for _ in rooms]
        top = max(max(rs) for rs in rooms)
        if top <= 0:
            return outs
        grain = max(1.0, top / grain_steps)
        cells = int(top // grain)
        ws = {j: int(weight[j] // grain) for j in order}  # rounded down: never heavier than the block
        most = min(N, cells // max(1, min(ws.values())))  # no more blocks than the lightest choice fits
        best = np.full((most + 1, cells + 1), np.inf)  # least time of n blocks within c cells
        best[0, :] = 0.0
        for i, j in enumerate(order):
            w = ws[j]
            if w <= cells:
                for n in range(1, most + 1):  # n ascending: the same choice may repeat
                    np.minimum(best[n, w:], best[n - 1, :cells + 1 - w] + times[j], out=best[n, w:])
            for out, rs in zip(outs, rooms):
                if rs[i] >= 0:
                    np.minimum(out[:most + 1], best[:, min(cells, int(rs[i] // grain))], out=out[:most + 1])
        return outs

    def holds(self, pp: int, tau: float, *, empty_slots: bool = False) -> bool:
        """Can pp stages hold every block with none slower than tau? With ``empty_slots``,
        slots may stay unused (and the embedding's stage is not known): a relaxation of every
        depth up to pp at once."""
        p = self.p
        stage = (self.curves_any if empty_slots else self.curves)[:, :pp].copy()
        if not empty_slots:  # the first stage is slot pp - 1; every other one receives activations
            stage[:, :pp - 1] = self.curves_not_first[:, :pp - 1]
        stage[:, 1:] += self.least_p2p  # a used slot r >= 1 sends to slot r - 1 ...
        if not empty_slots:  # ... and every stage but the first pays its side of the boundary before it
            stage[:, :pp - 1] += self.least_p2p
        stage[:, 0] += self.least_head
        if not empty_slots:
            stage[:, pp - 1] += self.least_embed
        fit = np.count_nonzero(stage <= tau, axis=2) - 1  # blocks each (group, slot) takes within tau
        if empty_slots:
            fit = np.maximum(fit, 0)
        any_group = int(fit.max(axis=0).sum())
        per_group = sum(int(np.sort(fit[g])[::-1][:p.stages_per_group[g]].sum()) for g in range(len(p.groups)))
        return min(any_group, per_group) >= p.n_blocks

    def _floor(self, pp: int) -> float:
        return self.work + self.fixed + 2 * (pp - 1) * self.least_p2p  # each boundary is paid on both sides

    def prunes(self, incumbent_us: int) -> bool:
        """True if no plan of this shape can beat the incumbent."""
        if self.m == 1:
            return self.work + self.fixed >= incumbent_us
        return not any(self.holds(pp, (incumbent_us - self._floor(pp)) / (self.m - 1))
                       for pp in range(1, self.p.slots + 1) if incumbent_us >= self._floor(pp))

    def least_slowest_stage_us(self) -> float:
        """tau*(K) with unused slots allowed, a relaxation of every depth up to K at once: no
        plan of the shape has a slowest stage faster than this. inf if nothing holds the model."""
        if not hasattr(self, "_tau"):
            K = self.p.slots
            hi = float(np.max(self.curves[np.isfinite(self.curves)], initial=0.0)) + self.least_head + self.least_embed + self.least_p2p
            lo = 0.0
            if self.holds(K, hi, empty_slots=True):
                for _ in range(24):  # to within hi / 2**24; lo always fails, so it stays a valid bound
                    mid = (lo + hi) / 2
                    lo, hi = (lo, mid) if self.holds(K, mid, empty_slots=True) else (mid, hi)
            else:
                lo = math.inf
            self._tau = lo
        return self._tau

    def least_slowest_stage_at_us(self, pp: int) -> float:
        """tau*(pp): the least slowest-stage time of a pipeline exactly pp deep (its first
        stage holding the embedding); inf if pp stages cannot hold the model."""
        cache = self.__dict__.setdefault("_tau_at", {})
        if pp not in cache:
            hi = float(np.max(self.curves[np.isfinite(self.curves)], initial=0.0)) + self.least_head + self.least_embed + self.least_p2p
            lo = 0.0
            if self.holds(pp, hi):
                for _ in range(24):  # lo always fails: a valid bound
                    mid = (lo + hi) / 2
                    lo, hi = (lo, mid) if self.holds(pp, mid) else (mid, hi)
            else:
                lo = math.inf
            cache[pp] = lo
        return cache[pp]

    def bound_us(self) -> int:
        """(m - 1) * tau*(K) + the least total work, a bound on any plan of the shape."""
        tau = self.least_slowest_stage_us()
        if not math.isfinite(tau):
            return NEVER  # no depth holds the model
        return int(math.floor((self.m - 1) * tau + self.work + self.fixed))


# ---- the model ----------------------------------------------------------------------------
class PlanModel:
    """Variables and one method per constraint family (labels as in the module docstring)."""

    def __init__(self, p: Problem, upper_bound_us: int | None, fit: "StageFit | None" = None) -> None:
        self.p = p
        self.tied = p.tied
        self.pipeline = p.pipeline
        self.fit = fit
        self.m = cp_model.CpModel()
        K, G = p.slots, len(p.groups)
        nb, ne, nh = len(p.block.strategies), len(p.embed.strategies), len(p.head.strategies)
        m = self.m
        self.y = [[m.new_bool_var(f"y[{r},{g}]") for g in range(G)] for r in range(K)]  # slot r on group g
        self.used = [m.new_bool_var(f"used[{r}]") for r in range(K)]
        # A subproblem's choices that are not allowed are fixed to zero.
        self.c = [[[m.new_int_var(0, p.n_blocks if p.block.allows(g, k) else 0, f"c[{r},{g},{k}]") for k in range(nb)]
                   for g in range(G)] for r in range(K)]
        self.e = [[[m.new_bool_var(f"e[{r},{g},{k}]") for k in range(ne)] for g in range(G)] for r in range(K)]
        self.h = [[m.new_bool_var(f"h[{g},{k}]") for k in range(nh)] for g in range(G)]
        for g in range(G):
            m.add_bool_and([self.e[r][g][k].Not() for r in range(K) for k in range(ne) if not p.embed.allows(g, k)])
            m.add_bool_and([self.h[g][k].Not() for k in range(nh) if not p.head.allows(g, k)])
        self.u = [[m.new_bool_var(f"u[{r},{k}]") for k in range(nb)] for r in range(K)]  # strategy k used in slot r
        # The longest a stage can take: every layer at its slowest choice, plus a send.
        most = lambda t: max(max(row) for row in t.time_us)  # noqa: E731
        horizon = p.n_blocks * most(p.block) + most(p.embed) + most(p.head) + 2 * max(max(r) for r in p.p2p_us)
        self.T = [m.new_int_var(0, horizon, f"T[{r}]") for r in range(K)]
        self.T_max = m.new_int_var(0, horizon, "T_max")
        self.E = m.new_int_var(0, horizon, "exposed_dp")
        # The largest stage edge, per micro-batch, within a subproblem's level (``edge_levels``).
        top = horizon if p.edge_ceiling_us is None else p.edge_ceiling_us
        self.Z = m.new_int_var(p.edge_floor_us, top, "zero_edge") if top > p.edge_floor_us else top
        self.O = m.new_int_var(0, horizon, "optimizer")
        self.upper_bound_us = upper_bound_us

    def build(self) -> None:
        self.add_stage_fit_cuts()
        self.add_slot_placement()
        self.add_group_capacity()
        self.add_block_cover()
        self.add_embed_and_head()
        self.add_stage_time()
        self.add_memory()
        self.add_data_parallel_and_optimizer()
        self.add_objective()

    def _block_sum(self, r: int, table: tuple[tuple[int, ...], ...]) -> cp_model.LinearExpr:
        p = self.p
        return sum(table[g][k] * self.c[r][g][k] for g in range(len(p.groups)) for k in range(len(p.block.strategies)))

    def _embed_sum(self, r: int, table: tuple[tuple[int, ...], ...]) -> cp_model.LinearExpr:
        return sum(table[g][k] * self.e[r][g][k] for g in range(len(self.p.groups)) for k in range(len(self.p.embed.strategies)))

    def _head_sum(self, r: int, table: tuple[tuple[int, ...], ...]) -> cp_model.LinearExpr:
        if r != 0:
            return 0
        return sum(table[g][k] * self.h[g][k] for g in range(len(self.p.groups)) for k in range(len(self.p.head.strategies)))

    # (F) redundant cuts from the stage-fit relaxation (see StageFit): a slot's time is at
    # least the convex least-time curve of its block count on its group, and no slot takes
    # more blocks than fit its memory. They are proven valid and give the LP a tight bound.
    def add_stage_fit_cuts(self) -> None:
        if self.fit is None:
            return
        p = self.p
        nb = len(p.block.strategies)
        self.fit.tighten()
        # The element constraints pay on one group; on several the hull cuts alone are cheaper.
        whole = len(p.groups) == 1
        for r in range(p.slots):
            for g in range(len(p.groups)):
                f = self.fit.curves_any[g, r]  # whatever the slot's place: valid for every one
                finite = np.nonzero(np.isfinite(f))[0]
                most = int(finite[-1])  # the most blocks that fit
                n_on_g = self.m.new_int_var(0, most, f"n[{r},{g}]")
                self.m.add(n_on_g == sum(self.c[r][g][k] for k in range(nb)))
                self.m.add(n_on_g <= most * self.y[r][g])
                if whole:
                    # CP propagation: the slot's time is at least the curve at its block count,
                    # the curve of its place: the first stage (slot 0: the only one) or another.
                    nxt = self.used[r + 1] if r + 1 < p.slots else None
                    for first in (True, False):
                        if nxt is None and not first:
                            continue
                        curve = self.fit.integer_curve(r, g, first=first)[:most + 1]
                        top = max(int(v) for v in curve if np.isfinite(v))
                        least = self.m.new_int_var(0, top, f"least[{r},{g},{first}]")
                        self.m.add_element(n_on_g, [int(math.floor(v)) if np.isfinite(v) else top for v in curve], least)
                        cond = self.y[r][g] if nxt is None else ([self.y[r][g], nxt.Not()] if first else [self.y[r][g], nxt])
                        self.m.add(self.T[r] >= least).only_enforce_if(cond)
                        if not all(np.isfinite(curve)):  # counts this place cannot hold
                            bad = [n for n, v in enumerate(curve) if not np.isfinite(v)]
                            self.m.add_linear_expression_in_domain(
                                n_on_g, cp_model.Domain.from_values([n for n in range(most + 1) if n not in bad])
                            ).only_enforce_if(cond)
                # LP: the lower convex hull of the curve, as linear cuts through (0, 0).
                for slope, intercept in _hull_cuts(f[:most + 1]):
                    self.m.add(self.T[r] >= int(math.floor(slope)) * n_on_g + int(math.floor(intercept)) * self.y[r][g])

    # (P) each used slot sits on exactly one group; used slots are a prefix from the end of
    # the pipeline (r = 0 is the last stage), which also breaks the symmetry of empty slots.
    def add_slot_placement(self) -> None:
        for r in range(self.p.slots):
            self.m.add(sum(self.y[r]) == self.used[r])
            if r > 0:
                self.m.add_implication(self.used[r], self.used[r - 1])
        self.m.add(self.used[0] == 1)
        if self.pipeline:  # the user pinned the pipeline degrees allowed
            self.m.add_linear_expression_in_domain(sum(self.used), cp_model.Domain.from_values(list(self.pipeline)))

    # (C) a group hosts at most size // S stages.
    def add_group_capacity(self) -> None:
        for g, cap in enumerate(self.p.stages_per_group):
            self.m.add(sum(self.y[r][g] for r in range(self.p.slots)) <= cap)
        if self.p.price_cap is not None:  # the cost objective's bound on the devices used
            self.m.add(sum(price * self.y[r][g] for r in range(self.p.slots)
                           for g, price in enumerate(self.p.stage_price)) <= self.p.price_cap)

    # (B) every block is in exactly one stage; counts only on the slot's group; each used stage
    # holds at least one block; u marks strategies present in a slot.
    def add_block_cover(self) -> None:
        p = self.p
        G, nb = len(p.groups), len(p.block.strategies)
        self.m.add(sum(self.c[r][g][k] for r in range(p.slots) for g in range(G) for k in range(nb)) == p.n_blocks)
        for r in range(p.slots):
            for g in range(G):
                self.m.add(sum(self.c[r][g]) <= p.n_blocks * self.y[r][g])
            self.m.add(sum(self.c[r][g][k] for g in range(G) for k in range(nb)) >= self.used[r])
            for k in range(nb):
                self.m.add(sum(self.c[r][g][k] for g in range(G)) <= p.n_blocks * self.u[r][k])

    # (E) the embedding sits on the first stage (the highest used slot), the head on the last.
    def add_embed_and_head(self) -> None:
        p = self.p
        G = len(p.groups)
        for r in range(p.slots):
            first = self.used[r] - (self.used[r + 1] if r + 1 < p.slots else 0)
            self.m.add(sum(self.e[r][g][k] for g in range(G) for k in range(len(p.embed.strategies))) == first)
            for g in range(G):
                for k in range(len(p.embed.strategies)):
                    self.m.add_implication(self.e[r][g][k], self.y[r][g])
        for g in range(G):
            self.m.add(sum(self.h[g]) == self.y[0][g])
        self.alone = None
        if p.head.copy_transient_bytes:  # a tied head keeps a copy when the pipeline has several stages
            self.alone = self.m.new_bool_var("alone")  # one stage: the last is also the first
            self.m.add(self.alone == self.used[0] - (self.used[1] if p.slots > 1 else 0))
        if self.tied:  # one weight: the runtime needs the same tensor split and ZeRO level for both
            key = lambda s: (s.tensor_parallel, s.zero)  # noqa: E731
            for choice in {key(s) for s in p.embed.strategies} | {key(s) for s in p.head.strategies}:
                embed = [self.e[r][g][k] for r in range(p.slots) for g in range(G)
                         for k, s in enumerate(p.embed.strategies) if key(s) == choice]
                head = [self.h[g][k] for g in range(G) for k, s in enumerate(p.head.strategies) if key(s) == choice]
                self.m.add(sum(embed) == sum(head))

    # (T) stage time: its layers and its side of each boundary: the send to the next stage (slot
    # r - 1) and the gradient back, the receive from the stage before (slot r + 1) and its gradient.
    def add_stage_time(self) -> None:
        p = self.p
        boundary = [self._p2p(r) if r > 0 else 0 for r in range(p.slots)]
        for r in range(p.slots):
            expr = self._block_sum(r, p.block.time_us) + self._embed_sum(r, p.embed.time_us) + self._head_sum(r, p.head.time_us)
            if r > 0:  # its side of the boundary to the next stage ...
                expr += boundary[r]
            if r + 1 < p.slots:  # ... and of the one from the stage before (nothing when that slot is unused)
                expr += boundary[r + 1]
            self.m.add(self.T[r] == expr)
            self.m.add(self.T_max >= self.T[r])

    def _at_least_each_layer(self, var: cp_model.IntVar, r: int, field: str) -> None:
        """var >= ``field`` of every layer slot r holds, on the group it sits on (the objective
        grows with var, so the solver sets it to the largest)."""
        p = self.p
        G = len(p.groups)
        tables = [getattr(t, field) for t in (p.block, p.embed, p.head)]
        for g in range(G):
            for k, v in enumerate(tables[0][g]):
                if v:
                    self.m.add(var >= v).only_enforce_if([self.u[r][k], self.y[r][g]])
            for k, v in enumerate(tables[1][g]):
                if v:
                    self.m.add(var >= v * self.e[r][g][k])
            if r == 0:
                for k, v in enumerate(tables[2][g]):
                    if v:
                        self.m.add(var >= v * self.h[g][k])

    def _p2p(self, r: int) -> cp_model.LinearExpr:
        """Send cost between slot r and slot r - 1, through pair booleans w[g][h] = y[r][g] and y[r-1][h]."""
        p = self.p
        G = len(p.groups)
        if G == 1:  # one group: the send costs the same wherever the stage is
            return p.p2p_us[0][0] * self.used[r]
        terms = []
        for g in range(G):
            for h in range(G):
                w = self.m.new_bool_var(f"w[{r},{g},{h}]")
                self.m.add_bool_and([self.y[r][g], self.y[r - 1][h]]).only_enforce_if(w)
                self.m.add_bool_or([self.y[r][g].Not(), self.y[r - 1][h].Not(), w])
                terms.append(p.p2p_us[g][h] * w)
        return sum(terms)

    # (M) per device memory, in grains as the evaluator counts it (``costs._stage_cost``): static
    # state + k - 1 micro-batches' activations + the stage outputs kept + the schedule's extra +
    # the running micro-batch at each of its layers (the activations of the layers up to it, in
    # the canonical order, plus its transient), within the group's capacity less the reserve.
    def add_memory(self) -> None:
        p = self.p
        G, nb = len(p.groups), len(p.block.strategies)
        ne, nh = len(p.embed.strategies), len(p.head.strategies)
        m_count = p.shape.num_micro_batches
        for r in range(p.slots):
            k_in_flight = min(r + 1, m_count)
            extra = self._stage_extra(r)
            for g in range(G):
                static = sum(p.block.static_bytes[g][k] * self.c[r][g][k] for k in range(nb))
                embed_acts = sum(p.embed.act_bytes[g][k] * self.e[r][g][k] for k in range(ne))
                acts = sum(p.block.act_bytes[g][k] * self.c[r][g][k] for k in range(nb)) + embed_acts
                static += sum(p.embed.static_bytes[g][k] * self.e[r][g][k] for k in range(ne))
                if r == 0:
                    static += sum(p.head.static_bytes[g][k] * self.h[g][k] for k in range(nh))
                    acts += sum(p.head.act_bytes[g][k] * self.h[g][k] for k in range(nh))
                # Every stage but the last keeps its output per micro-batch in flight.
                out = p.output_bytes if r > 0 else 0
                base = static + (k_in_flight - 1) * acts + k_in_flight * out + extra
                cap = p.capacity_bytes[g]
                self.m.add(base + acts <= cap).only_enforce_if(self.y[r][g])
                for k in range(ne):
                    if p.embed.transient_bytes[g][k]:
                        self.m.add(base + p.embed.act_bytes[g][k] + p.embed.transient_bytes[g][k] <= cap
                                   ).only_enforce_if(self.e[r][g][k])
                prefix = embed_acts
                for k in p.block.order[g]:
                    prefix = prefix + p.block.act_bytes[g][k] * self.c[r][g][k]
                    if p.block.transient_bytes[g][k]:
                        self.m.add(base + prefix + p.block.transient_bytes[g][k] <= cap
                                   ).only_enforce_if([self.u[r][k], self.y[r][g]])
                if r == 0:
                    copy = p.head.copy_transient_bytes  # a tied head's copy when the embedding is elsewhere
                    for k in range(nh):
                        if copy:
                            self.m.add(base + acts + p.head.transient_bytes[g][k] <= cap
                                       ).only_enforce_if([self.h[g][k], self.alone])
                            self.m.add(base + acts + copy[g][k] <= cap).only_enforce_if([self.h[g][k], self.alone.Not()])
                        elif p.head.transient_bytes[g][k]:
                            self.m.add(base + acts + p.head.transient_bytes[g][k] <= cap).only_enforce_if(self.h[g][k])

    def _stage_extra(self, r: int) -> cp_model.LinearExprT:
        """The bytes the schedule adds to slot r (see Problem.extra_*), by its group, whether it
        is the first stage, and for the last one (r = 0) its head's choice."""
        p = self.p
        G = len(p.groups)
        if not p.extra_first:
            return 0
        values = [v for row in (p.extra_first, p.extra_middle) for v in row]
        values += [v for t in (p.extra_last, p.extra_alone) for row in t for v in row]
        if not any(values):
            return 0
        var = self.m.new_int_var(min(0, min(values)), max(0, max(values)), f"stage_extra[{r}]")
        first = self.m.new_bool_var(f"first[{r}]")  # slot r holds the first stage
        self.m.add(first == self.used[r] - (self.used[r + 1] if r + 1 < p.slots else 0))
        for g in range(G):
            if r > 0:
                self.m.add(var >= p.extra_first[g]).only_enforce_if([self.y[r][g], first])
                self.m.add(var >= p.extra_middle[g]).only_enforce_if([self.y[r][g], first.Not()])
            else:
                for k in range(len(p.head.strategies)):
                    self.m.add(var >= p.extra_alone[g][k]).only_enforce_if([self.h[g][k], first])
                    self.m.add(var >= p.extra_last[g][k]).only_enforce_if([self.h[g][k], first.Not()])
        return var

    # (D) exposed data-parallel sync (what sticks out of the overlap window of a stage's last
    # backward, and at least its largest layer's reduction), the exposed ZeRO edge (a stage's
    # largest layer's per-micro-batch ZeRO traffic, charged m times in the objective) and the
    # optimizer step, each the maximum over stages.
    def add_data_parallel_and_optimizer(self) -> None:
        p = self.p
        for r in range(p.slots):
            sync = self._block_sum(r, p.block.sync_us) + self._embed_sum(r, p.embed.sync_us) + self._head_sum(r, p.head.sync_us)
            window = (self._block_sum(r, p.block.window_us) + self._embed_sum(r, p.embed.window_us)
                      + self._head_sum(r, p.head.window_us))
            self.m.add(self.E >= sync - window)
            self._at_least_each_layer(self.E, r, "sync_us")  # the last reduction hides behind nothing
            if not isinstance(self.Z, int):
                self._at_least_each_layer(self.Z, r, "edge_us")
            opt = (self._block_sum(r, p.block.optimizer_us) + self._embed_sum(r, p.embed.optimizer_us)
                   + self._head_sum(r, p.head.optimizer_us))
            self.m.add(self.O >= opt)
        # A tied head on its own stage: the copies' gradient sum and the copy's update, per step.
        self.tied_sync = 0
        if p.head.tied_us and any(v for row in p.head.tied_us for v in row):
            top = max(v for row in p.head.tied_us for v in row)
            self.tied_sync = self.m.new_int_var(0, top, "tied_sync")
            for g in range(len(p.groups)):
                for k, v in enumerate(p.head.tied_us[g]):
                    if v:
                        self.m.add(self.tied_sync >= v).only_enforce_if([self.h[g][k], self.alone.Not()])

    # (O) the 1F1B step time; bounded by the incumbent so only better plans are searched.
    def add_objective(self) -> None:
        m_count = self.p.shape.num_micro_batches
        self.objective = ((m_count - 1) * self.T_max + sum(self.T) + m_count * self.Z + self.E + self.O + self.tied_sync
                          + self.p.step_overhead_us)
        if self.upper_bound_us is not None:
            self.m.add(self.objective <= self.upper_bound_us)
        self.m.add(self.objective >= self.p.lower_bound_us)
        if self.fit is not None:
            # Redundant, proven by the stage-fit relaxation; they give the LP its bound at once:
            # the slowest stage of a pipeline pp deep is at least tau*(pp) (slot pp - 1 is the
            # first stage exactly when it is used and the next is not).
            p = self.p
            for r in range(p.slots):
                first = self.used[r] - (self.used[r + 1] if r + 1 < p.slots else 0)
                tau = self.fit.least_slowest_stage_at_us(r + 1)
                if math.isfinite(tau):
                    self.m.add(self.T_max >= int(math.floor(tau)) * first)
                else:
                    self.m.add(first == 0)  # this depth cannot hold the model
            self.m.add(self.objective >= self.fit.bound_us())
        self.m.minimize(self.objective)

    # ---- hint and read-back -----------------------------------------------------------------
    def add_hint(self, layout: Layout) -> None:
        """Feed a plan of this shape (the uniform best) as the solver's starting point."""
        p = self.p
        pp = layout.pp
        if pp > p.slots:
            return
        gi = {g.name: i for i, g in enumerate(p.groups)}
        for r in range(p.slots):
            s = pp - 1 - r  # forward stage index of slot r
            self.m.add_hint(self.used[r], s >= 0)
            for g in range(len(p.groups)):
                on = s >= 0 and gi.get(layout.stage_groups[s].name) == g
                self.m.add_hint(self.y[r][g], on)
                for k, strat in enumerate(p.block.strategies):
                    n = 0
                    if on:
                        n = sum(1 for l in layout.stage_layers[s] if l.name.startswith("layers.") and _same(l, strat))
                    self.m.add_hint(self.c[r][g][k], n)
                for k, strat in enumerate(p.embed.strategies):
                    self.m.add_hint(self.e[r][g][k], on and s == 0 and _same(layout.stage_layers[0][0], strat))
        for g in range(len(p.groups)):
            last = layout.stage_layers[-1][-1]
            for k, strat in enumerate(p.head.strategies):
                self.m.add_hint(self.h[g][k], gi.get(layout.stage_groups[-1].name) == g and _same(last, strat))

    def read_layout(self, solver: cp_model.CpSolver) -> Layout:
        p = self.p
        G = len(p.groups)
        used = [r for r in range(p.slots) if solver.value(self.used[r])]
        pp = len(used)
        stage_groups, stage_layers = [], []
        next_block = 0
        for s in range(pp):
            r = pp - 1 - s
            g = next(g for g in range(G) if solver.value(self.y[r][g]))
            layers: list[LayerStrategy] = []
            if s == 0:
                k = next(k for g2 in range(G) for k in range(len(p.embed.strategies)) if solver.value(self.e[r][g2][k]))
                layers.append(dataclasses.replace(p.embed.strategies[k], name="embed"))
            for k in p.block.order[g]:
                strat = p.block.strategies[k]
                for _ in range(solver.value(self.c[r][g][k])):
                    layers.append(dataclasses.replace(strat, name=f"layers.{next_block}"))
                    next_block += 1
            if r == 0:
                k = next(k for k in range(len(p.head.strategies)) if solver.value(self.h[g][k]))
                layers.append(dataclasses.replace(p.head.strategies[k], name="head"))
            stage_groups.append(p.groups[g])
            stage_layers.append(tuple(layers))
        sh = p.shape
        return Layout(stage_groups=tuple(stage_groups), stage_layers=tuple(stage_layers), dp=sh.dp, tp=sh.tp,
                      micro_batch=sh.micro_batch, num_micro_batches=sh.num_micro_batches)


def _same(a: LayerStrategy, b: LayerStrategy) -> bool:
    return (a.tensor_parallel, a.sequence_parallel, a.zero, a.recompute) == (
        b.tensor_parallel, b.sequence_parallel, b.zero, b.recompute)


# ---- solve ------------------------------------------------------------------------------------
MIN_WORK = 0.2  # the least deterministic time a shape's first attempt gets


@dataclass
class ShapeResult:
    shape: Shape
    status: str  # optimal, feasible, infeasible (nothing better than the bound given), unknown, pruned
    bound_us: int
    layout: Layout | None = None
    objective_us: int | None = None
    wall_s: float = 0.0
    work: float = 0.0  # CP-SAT deterministic time spent


def solve_shape(p: Problem, *, upper_bound_us: int | None, hint: Layout | None, time_limit_s: float, workers: int,
                seed: int, fit: "StageFit | None" = None, work_limit: float | None = None) -> ShapeResult:
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
    solver.parameters.random_seed = seed
    solver.parameters.log_search_progress = False
    status = solver.solve(pm.m)
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


def memory_infeasible(p: Problem) -> bool:
    """Quick proof that a shape cannot fit: even the least static memory of every layer,
    spread over every slot of the largest group, exceeds what those slots hold."""
    need = p.n_blocks * p.block.least("static_bytes") + p.embed.least("static_bytes") + p.head.least("static_bytes")
    room = sum(n * cap for n, cap in zip(p.stages_per_group, p.capacity_bytes))
    return need > room


@dataclass
class Incumbent:
    """The best plan so far: its layout, evaluation and objective (integer microseconds)."""

    layout: Layout
    evaluation: Evaluation
    us: int


def solve_plan(cm: CostModel, req, uniform: UniformResult, *, deadline: float, work_limit: float) -> Plan:
    """Search every shape, best bound first; return the best plan (never worse than uniform).

    Stops at ``work_limit`` (CP-SAT deterministic time summed over shapes: the same plan on a
    busy machine as on an idle one) or at the wall-clock ``deadline``, whichever comes first;
    the deadline is checked between model builds and solves too. With no plan found, it raises
    "does not fit" only when every shape is proven infeasible, and SearchTimeout otherwise."""
    from partita.search.planner import layout_to_plan, timeout_error

    start = time.perf_counter()
    warm = uniform.fastest()
    best = Incumbent(warm[0], warm[1], to_us(warm[1].step_time_s)) if warm else None
    uniform_us = to_us(uniform.best_eval.step_time_s) if uniform.best_eval is not None else 0
    results: list[ShapeResult] = []
    problems = []
    for shape in shapes(cm, req.global_batch, req.space):
        if time.perf_counter() > deadline:  # not built: nothing known about the shape
            results.append(ShapeResult(shape, "unknown", 0))
            continue
        p = build_problem(cm, shape, req.space)
        if p is not None:
            problems.append(p)
    candidates = len(problems)
    # Shapes first, whole; a shape is split by ZeRO edge (``edge_levels``) when it comes up to
    # be solved, so only shapes that survive the cheap bounds pay for their subproblems.
    problems.sort(key=lambda p: p.lower_bound_us)
    fits: dict[tuple, StageFit] = {}
    curves: dict[Shape, dict] = {}  # whole-block curves, shared by a shape's subproblems

    def still_open(p: Problem) -> bool:
        """Record shapes proven unable to fit or to beat the incumbent; keep the rest."""
        if best is not None and p.lower_bound_us >= best.us:
            results.append(ShapeResult(p.shape, "pruned", p.lower_bound_us))
            return False
        if memory_infeasible(p):
            results.append(ShapeResult(p.shape, "infeasible", NEVER))
            return False
        if p.key not in fits and time.perf_counter() > deadline:
            results.append(ShapeResult(p.shape, "unknown", p.lower_bound_us))
            return False
        fit = fits.get(p.key) or fits.setdefault(p.key, StageFit(p, curves.setdefault(p.shape, {})))
        if fit.bound_us() >= NEVER:  # no pipeline depth holds the blocks: a proof
            results.append(ShapeResult(p.shape, "infeasible", NEVER))
            return False
        if best is not None and fit.prunes(best.us):
            results.append(ShapeResult(p.shape, "pruned", best.us))
            return False
        return True

    queue = [p for p in problems if still_open(p)]
    # Most promising first: a better incumbent early lets the stage-fit test prune the rest.
    bounds = {p.key: max(p.lower_bound_us, fits[p.key].bound_us()) for p in queue}
    queue.sort(key=lambda p: bounds[p.key])
    earlier: dict[tuple, ShapeResult] = {}  # first attempts that ran out of work, to retry once
    work_used = 0.0
    while queue:
        p = queue.pop(0)
        if p.edge_ceiling_us is None and deadline - time.perf_counter() > 0:
            levels = edge_levels(p)
            if len(levels) > 1:
                for q in levels:
                    if still_open(q):
                        bounds[q.key] = max(q.lower_bound_us, fits[q.key].bound_us())
                        queue.append(q)
                queue.sort(key=lambda q: bounds[q.key])
                continue
        if deadline - time.perf_counter() > 0 and work_used < work_limit and not fits[p.key].tight:
            # The cheap envelope did not prune it: the whole-block curves may.
            fits[p.key].tighten()
            if not still_open(p):
                continue
            bounds[p.key] = max(bounds[p.key], fits[p.key].bound_us())
        wall_left, work_left = deadline - time.perf_counter(), work_limit - work_used
        if wall_left <= 0 or work_left <= 0:
            results.append(earlier.get(p.key) or ShapeResult(p.shape, "unknown", bounds[p.key]))
            continue
        hint = best.layout if best is not None and _shape_of(best.layout, req.global_batch) == p.shape else None
        if hint is None and p.key in earlier:
            hint = earlier[p.key].layout
        # Share the work left among the shapes still open, giving the most promising more;
        # a shape that runs out is retried once at the end with whatever work is left.
        work = work_left if p.key in earlier else min(work_left, max(MIN_WORK, work_left / min(len(queue) + 1, 4)))
        r = solve_shape(p, upper_bound_us=best.us - 1 if best is not None else None, hint=hint,
                        time_limit_s=wall_left, workers=req.workers, seed=req.seed, fit=fits[p.key],
                        work_limit=work)
        work_used += r.work
        if r.status in ("feasible", "unknown"):
            r.bound_us = max(r.bound_us, bounds[p.key])
            if p.key not in earlier:
                earlier[p.key] = r
                queue.append(p)
            else:
                results.append(r)
        else:
            results.append(r)
        log.info("shape %s, edge <= %s us: %s, bound %d us, %.2f s, work %.2f", p.shape, p.edge_ceiling_us, r.status,
                 r.bound_us, r.wall_s, r.work)
        if r.layout is not None:
            ev = evaluate_layout(cm, list(zip(r.layout.stage_groups, r.layout.stage_layers)), dp=r.layout.dp,
                                 tp=r.layout.tp, micro_batch=r.layout.micro_batch,
                                 num_micro_batches=r.layout.num_micro_batches)
            if ev.fits and (best is None or ev.step_time_s < best.evaluation.step_time_s):
                best = Incumbent(r.layout, ev, min(best.us, r.objective_us) if best is not None else r.objective_us)
                queue = [q for q in queue if still_open(q)]
    if best is None:
        if all(r.status == "infeasible" for r in results):
            raise infeasible_error(cm, uniform, req.global_batch, req.space)
        raise timeout_error(cm, req)
    return layout_to_plan(cm, best.layout, global_batch=req.global_batch,
                          solver=_report(req, best, results, uniform_us, candidates,
                                         time.perf_counter() - start + uniform.wall_s))


def _report(req, best: Incumbent, results: list[ShapeResult], uniform_us: int, candidates: int,
            wall_s: float) -> SolverReport:
    """Status, bound and gap of the search: optimal only when the bound meets the plan within
    the integer rounding of its terms (every shape settled, or the bounds close enough)."""
    bound = min([best.us] + [r.bound_us for r in results])
    objective = to_us(best.evaluation.step_time_s)
    exact = all(r.status in ("optimal", "infeasible", "pruned") for r in results)  # every shape settled
    lay = best.layout
    slack = (lay.num_micro_batches - 1 + lay.pp) * (max(len(l) for l in lay.stage_layers) + 1) / 2
    if exact and objective - bound > slack:
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
                 uneven=layout.dp * layout.micro_batch * layout.num_micro_batches != global_batch)
