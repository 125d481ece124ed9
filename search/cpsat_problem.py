"""The CP-SAT planner's problem: integer cost tables for one shape (``Problem``), the shapes a
plan can take, and their split by ZeRO edge level. ``search/cpsat.py`` describes the model."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from partita import parallel
from partita.cluster import NodeGroup
from partita.plan import ZERO_LEVELS, LayerStrategy, boundary_split, gives_whole
from partita.search.costs.memory import activation_message_bytes, kept_output_bytes, receive_buffers
from partita.search.costs.model import CostModel
from partita.search.costs.stage import boundary_gather_s, boundary_s, canonical_order, choice_of, stage_cost_counts
from partita.search.uniform import (SearchSpace, batch_shares, batch_splits, divisors, hosts, device_price, layer_tp,
                                    max_stages, replicated_zeros, sp_choices, stage_sizes, tp_allowed, zero_levels)
from partita.units import capacity_grains, to_grains, to_us

NEVER = 1 << 61  # the bound of a shape proven to hold no plan at all


# ---- the problem: integer cost tables for one shape ----------------------------------------
@dataclass(frozen=True)
class Shape:
    stage_size: int
    tp: int
    dp: int
    micro_batch: int
    num_micro_batches: int  # the largest replica's share when they differ
    uneven: bool = False  # replicas run micro-batch counts that differ by one (``uniform.batch_shares``)


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
    # Time terms a stage takes as the largest over its layers, or sums (costs.stage.StageCost):
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
    p2p_us: tuple[tuple[int, ...], ...]  # [g][h] the transfers of one side of a boundary from a stage on g to one on h
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
    output_bytes: int = 0  # a stage's output (micro_batch x seq x hidden, or its 1/tp shard), kept per micro-batch in flight
    receive_bytes: int = 0  # the receive buffers a stage holds per direction (``costs.memory.receive_buffers``)
    # [g]: one all-gather of a split boundary's shards on group g (0: boundaries carry whole
    # hidden states), paid by a stage for each end block that is not sequence-parallel
    # (``costs.stage.boundary_gathers``): its first if it receives, its last if it sends.
    gather_us: tuple[int, ...] = ()
    step_overhead_us: int = 0  # the fixed per-step overhead (CostModel.step_overhead_s)
    # A subproblem of the shape (``edge_levels``): only the choices whose exposed ZeRO edge is
    # at most the ceiling, and the edge term Z at least the floor; None: the whole shape.
    edge_ceiling_us: int | None = None
    edge_floor_us: int = 0
    # The ZeRO levels a layer may take once the pipeline has two stages or more, and while it has
    # one (``parallel.pipeline_zero_levels``: ZeRO 0 and 1 where the engine runs FSDP as ZeRO 1 in
    # a pipeline; torchtitan's no ZeRO 1 outside one, nor ZeRO 0 under context parallelism).
    pipelined_zeros: tuple[int, ...] = ZERO_LEVELS
    unpipelined_zeros: tuple[int, ...] = ZERO_LEVELS
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
    zeros = tuple(z for z in replicated_zeros(space, shape.dp, cm.cp) if z <= 1 or not shape.uneven)
    recomputes = space.recompute if role == "block" else ("none",)
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
    # A block at a stage's end that gives whole hidden states adds an all-gather at a split
    # boundary (``costs.stage.boundary_gathers``): it dominates no sequence-parallel block.
    split = role == "block" and boundary_split(cm.seq_len, shape.tp) > 1
    whole = [int(split and gives_whole(s.tensor_parallel, s.sequence_parallel)) for s in strategies]
    keep = list(range(len(strategies))) if cm.model.tie_embeddings and role != "block" else undominated([[rows[k][g][j] for k in ("time", "opt", "static", "act", "gath", "edge", "sync") for g in range(len(groups))]
                        + [-rows["win"][g][j] for g in range(len(groups))] + [whole[j]]
                        for j in range(len(strategies))])
    strategies = [strategies[j] for j in keep]
    tup = lambda k: tuple(tuple(r[j] for j in keep) for r in rows[k])  # noqa: E731
    # The order the evaluator prices a stage's layers in and the plan writes them in
    # (``costs.stage.canonical_order``), per group, as indices into ``strategies``.
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
            out += [Shape(stage_size, tp, dp, mb, m, uneven=bool(batch_shares(global_batch, dp, mb, m)))
                    for mb, m in batch_splits(global_batch, dp, space)
                    if zero_levels(space, global_batch, dp, mb, m)]  # (uneven shares take ZeRO 0/1 only)
    return out


def build_problem(cm: CostModel, shape: Shape, space: SearchSpace, *, extras: bool = True) -> Problem | None:
    """Integer tables for one shape, or None if no group can host a stage of it. Kept on the cost
    model (``CostModel.stage_cache``) without the price bound, which alone differs between the
    cost objective's searches on one cost model (``cost_objective.make_cost_plan``): each of them takes
    the tables as they are, with its own bound. Without ``extras`` the schedule's memory at each
    place (``Problem.extra_*``) is left out: the cheap bounds do not read it, and the search adds
    it (``with_extras``) to the shapes they leave open."""
    unpriced = dataclasses.replace(space, price_cap=None)
    key = ("problem", shape, unpriced)
    if key not in cm.stage_cache:
        cm.stage_cache[key] = _build_problem(cm, shape, unpriced)
    base = cm.stage_cache[key]
    if base is not None and extras:
        base = with_extras(cm, base, unpriced)
    if base is None or space.price_cap is None:
        return base
    # Under a price bound a shape has at most the stages its devices can buy: fewer slots (and
    # each group's stages) make a smaller model and a tighter work bound W (m - 1 + K) / K.
    prices, per_group, slots = _price_bounded(shape, base.groups, base.stages_per_group, base.slots, space.price_cap)
    return dataclasses.replace(base, price_cap=space.price_cap, stage_price=prices, stages_per_group=per_group,
                               slots=slots, lower_bound_us=max(base.lower_bound_us, _lower_bound_us(
                                   cm, shape, base.block, base.embed, base.head, slots)))


def _price_bounded(shape: Shape, groups: Sequence[NodeGroup], per_group: Sequence[int], slots: int,
                   cap: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """A shape's stage prices on ``groups``, and its stages per group and slots under the price
    bound ``cap`` (``affordable_stages``; one slot at least)."""
    prices = tuple(shape.stage_size * device_price(g) for g in groups)
    each, most = affordable_stages(per_group, prices, cap)
    return prices, each, max(1, min(slots, most))


def affordable_stages(per_group: Sequence[int], prices: Sequence[int], cap: int) -> tuple[tuple[int, ...], int]:
    """What devices costing at most ``cap`` an hour can host of a shape: the stages on each group
    (its share, and no more than the bound buys of it alone) and the most in one pipeline (the
    cheapest stages first, each group up to its share)."""
    each = tuple(min(n, cap // price) if price > 0 else n for n, price in zip(per_group, prices))
    most, spent = 0, 0
    for price, n in sorted(zip(prices, each)):
        take = n if price == 0 else min(n, (cap - spent) // price)
        most, spent = most + take, spent + take * price
        if take < n:
            break
    return each, most


def _build_problem(cm: CostModel, shape: Shape, space: SearchSpace) -> Problem | None:
    groups = tuple(g for g in cm.cluster.groups if hosts(g, shape.stage_size, shape.tp))
    if not groups:
        return None
    per_group = tuple(g.size // shape.stage_size for g in groups)
    slots = _slots(cm, shape, space, per_group)
    block = layer_table(cm, "block", shape, groups, space)
    embed = layer_table(cm, "embed", shape, groups, space)
    head = layer_table(cm, "head", shape, groups, space)
    p2p = tuple(tuple(_p2p_us(cm, a, b, shape) for b in groups) for a in groups)
    capacity = tuple(capacity_grains(g.memory_bytes - cm.reserve_bytes(g)) for g in groups)
    lb = _lower_bound_us(cm, shape, block, embed, head, slots)
    return Problem(shape=shape, groups=groups, slots=slots, stages_per_group=per_group, n_blocks=cm.model.n_layers,
                   block=block, embed=embed, head=head, p2p_us=p2p, capacity_bytes=capacity, lower_bound_us=lb,
                   tied=cm.model.tie_embeddings, pipeline=space.pipeline,
                   output_bytes=to_grains(kept_output_bytes(cm, shape.micro_batch, shape.tp)),
                   receive_bytes=to_grains(receive_buffers(cm, shape.num_micro_batches)
                                           * activation_message_bytes(cm, shape.micro_batch, shape.tp)),
                   gather_us=tuple(_gather_us(cm, g, shape) for g in groups),
                   step_overhead_us=to_us(cm.step_overhead_s),
                   pipelined_zeros=parallel.pipeline_zero_levels(cm.engine.name, 2, ZERO_LEVELS, cm.cp),
                   unpipelined_zeros=parallel.pipeline_zero_levels(cm.engine.name, 1, ZERO_LEVELS, cm.cp))


def with_extras(cm: CostModel, p: Problem, space: SearchSpace) -> Problem:
    """``p`` with the schedule's memory at each place in the pipeline (``Problem.extra_*``,
    ``_stage_extra_bytes``), kept on the cost model per shape: a shape's subproblems (its ZeRO
    edge levels, its price bounds) share its strategies, and so these."""
    if p.extra_first:
        return p
    key = ("extras", p.shape, dataclasses.replace(space, price_cap=None))
    if key not in cm.stage_cache:
        groups, block, embed, head = p.groups, p.block, p.embed, p.head
        extra = lambda g, first, last, k=0: _stage_extra_bytes(cm, p.shape, groups, g, block, embed, head,  # noqa: E731
                                                                first=first, last=last, head_k=k)
        heads = range(len(head.strategies))
        cm.stage_cache[key] = dict(
            extra_first=tuple(extra(g, True, False) for g in range(len(groups))),
            extra_middle=tuple(extra(g, False, False) for g in range(len(groups))),
            extra_last=tuple(tuple(extra(g, False, True, k) for k in heads) for g in range(len(groups))),
            extra_alone=tuple(tuple(extra(g, True, True, k) for k in heads) for g in range(len(groups))))
    return dataclasses.replace(p, **cm.stage_cache[key])


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
    """The transfers of one side of the boundary between a stage on ``a`` and the next on ``b``
    (each side pays them)."""
    return to_us(boundary_s(cm, a, b, dp=shape.dp, tp=shape.tp, micro_batch=shape.micro_batch))


def _gather_us(cm: CostModel, g: NodeGroup, shape: Shape) -> int:
    """One all-gather at a split boundary by a stage on ``g`` (0 where boundaries do not split)."""
    if boundary_split(cm.seq_len, shape.tp) == 1:
        return 0
    return to_us(boundary_gather_s(cm, g, tp=shape.tp, micro_batch=shape.micro_batch))


def _slots(cm: CostModel, shape: Shape, space: SearchSpace, per_group: Sequence[int]) -> int:
    """The most stages a plan of this shape can have: its groups' room, the micro-batches (1F1B
    needs one per stage) and ``--pp``."""
    slots = min(sum(per_group), max_stages(cm, shape.num_micro_batches - shape.uneven))  # the fewest share
    return min(slots, max(space.pipeline)) if space.pipeline else slots


def fastest_candidates(strategies: Sequence[LayerStrategy]) -> list[LayerStrategy]:
    """The strategies among which a layer's least time per micro-batch lies: those at the lowest
    ZeRO level and, where it is allowed, without recomputation. A layer's forward + backward
    never shrinks with either: recomputation adds its pass (and its collectives) to the
    backward, ZeRO 0 and 1 move nothing per micro-batch (the same time), 2 gathers in the
    forward and 3 gathers again in the backward, and ``timing.overlapped_s`` does not fall as
    the traffic beside a pass grows (tests/test_cpsat_bound.py checks the minimum against every
    strategy's)."""
    if not strategies:
        return []
    zero = min(s.zero for s in strategies)
    kept = [s for s in strategies if s.zero == zero]
    if any(s.recompute == "none" for s in kept):
        kept = [s for s in kept if s.recompute == "none"]
    return kept


def shape_bound_us(cm: CostModel, shape: Shape, space: SearchSpace) -> int | None:
    """The shape's ``Problem.lower_bound_us`` from the layers' times alone, without building its
    tables (their memory columns are most of the work): the same number, since the table keeps
    every choice of least time. None if no group hosts the shape."""
    groups = tuple(g for g in cm.cluster.groups if hosts(g, shape.stage_size, shape.tp))
    if not groups:
        return None
    per_group = tuple(g.size // shape.stage_size for g in groups)
    slots = _slots(cm, shape, space, per_group)
    if space.price_cap is not None:  # as build_problem bounds it
        slots = _price_bounded(shape, groups, per_group, slots, space.price_cap)[2]

    def least(role: str) -> int:
        return min(to_us(cm.layer_time(role, g, s, dp=shape.dp, micro_batch=shape.micro_batch).total_s)
                   for g in groups for s in fastest_candidates(strategies_for(cm, role, shape, space)))

    work = cm.model.n_layers * least("block") + least("embed") + least("head")
    m = shape.num_micro_batches
    return int(math.floor(work * (m - 1 + slots) / slots))


def _lower_bound_us(cm: CostModel, shape: Shape, block: LayerTable, embed: LayerTable, head: LayerTable,
                    slots: int) -> int:
    """A proven bound for the shape: the least total work W (each layer at its cheapest group and
    strategy), and (m - 1) * max T + sum T >= W * (m - 1 + pp) / pp >= W * (m - 1 + K) / K."""
    work = cm.model.n_layers * block.least("time_us") + embed.least("time_us") + head.least("time_us")
    m = shape.num_micro_batches
    return int(math.floor(work * (m - 1 + slots) / slots))


def memory_infeasible(p: Problem) -> bool:
    """Quick proof that a shape cannot fit: even the least static memory of every layer,
    spread over every slot of the largest group, exceeds what those slots hold."""
    need = p.n_blocks * p.block.least("static_bytes") + p.embed.least("static_bytes") + p.head.least("static_bytes")
    room = sum(n * cap for n, cap in zip(p.stages_per_group, p.capacity_bytes))
    return need > room
