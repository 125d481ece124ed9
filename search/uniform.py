"""The uniform planner: an exhaustive Megatron-style grid, every layer alike.

Over the whole cluster and, on a mixed cluster, over each node group alone, it tries every
tensor-parallel degree (inside a node), stage size (dp * tp ranks, stages never straddle
node groups), hence pipeline degree, micro-batch size, ZeRO level, recomputation (none,
selective or full) and sequence parallelism on/off, with blocks split as evenly as the
pipeline allows (embedding in the first stage, head in the last). It is the CP-SAT search's
warm start, fallback and yardstick.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Sequence

from partita import parallel
from partita.cluster import ClusterSpec, NodeGroup
from partita.errors import PartitaError
from partita.model import ModelSpec
from partita.plan import LayerStrategy
from partita.search.costs.model import CostModel
from partita.search.costs.stage import LayerChoice, choice_of, in_flight
from partita.search.evaluate import Evaluation, evaluate_counts

MAX_MICRO_BATCH = 32


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What a search may choose. Defaults are everything the runtime executes."""

    zero_levels: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "full")  # blocks' recompute modes (plan.RECOMPUTE)
    sequence_parallel: tuple[bool, ...] = (False, True)
    micro_batches: tuple[int, ...] | None = None  # None: every divisor up to MAX_MICRO_BATCH
    tensor_parallel: tuple[int, ...] | None = None  # None: every degree that fits a node
    pipeline: tuple[int, ...] | None = None  # None: any
    # The pipeline schedules a plan may run (``parallel.SCHEDULES``); empty: any the model trains
    # under. The grid and CP-SAT price 1F1B; the others come from the interleaved pass.
    schedules: tuple[str, ...] = ()
    # Every replica the same micro-batch count and size (``parallel.ep_shares_rule``: expert
    # parallelism pairs its ranks' all-to-alls micro-batch by micro-batch).
    even_shares: bool = False
    # The most the devices a plan runs on may cost, in micro-dollars per hour (``device_price``);
    # None: no bound. The cost objective (``planner.make_plan``) walks the time/price frontier with it.
    price_cap: int | None = None

    def leaves(self, plan) -> str | None:
        """How a plan (``partita.plan.Plan``) leaves this space, in the ``partita plan`` options'
        words (an engine's closest plan may: ``cli.engine_fit``); None where it stays inside."""
        layers = plan.layer_strategies()
        # without parameter replicas (dp x cp) a plan's layers are at ZeRO 0, whatever --zero allows (``zero_levels``)
        zeros = {s.zero for s in layers} - ({0} if plan.dp * plan.cp == 1 else set())
        out = [(f"ZeRO {z}", "--zero") for z in sorted(zeros) if z not in self.zero_levels]
        out += [(f"{r} recompute", "--recompute") for r in sorted({s.recompute for s in layers if s.name.startswith(
            "layers.")}) if r not in self.recompute]
        out += [(f"sequence parallelism {'on' if v else 'off'}", "--no-sequence-parallel") for v in sorted(
            {s.sequence_parallel for s in layers if s.tensor_parallel > 1}) if v not in self.sequence_parallel]
        for value, allowed, flag in ((plan.tp, self.tensor_parallel, "--tp"), (plan.pp, self.pipeline, "--pp"),
                                     (plan.micro_batch, self.micro_batches, "--micro-batch"),
                                     (plan.schedule, self.schedules or None, "--schedule")):
            if allowed is not None and value not in allowed:
                out.append((f"{flag[2:]} {value}", flag))
        return "; ".join(f"{what}, which {flag} leaves out" for what, flag in out) or None

    def options(self) -> str:
        """The restrictions this space puts on a search, as ``partita plan`` options ("" if none)."""
        default = SearchSpace()
        out = [f"--zero {','.join(map(str, self.zero_levels))}"] if self.zero_levels != default.zero_levels else []
        out += [f"--recompute {','.join(self.recompute)}"] if set(self.recompute) != set(default.recompute) else []
        out += ["--no-sequence-parallel"] if self.sequence_parallel == (False,) else []
        out += [f"{flag} {','.join(map(str, values))}" for flag, values in (
            ("--tp", self.tensor_parallel), ("--pp", self.pipeline), ("--micro-batch", self.micro_batches),
            ("--schedule", self.schedules)) if values]
        return " ".join(out)


def device_price(group: NodeGroup) -> int:
    """One device of the group per hour, in integer micro-dollars (prices sum exactly)."""
    if group.price is None:
        raise PartitaError(f"node group {group.name!r} ({group.device}) has no price per GPU-hour: set "
                           f"price_per_gpu_hour for it in a cluster YAML to plan for cost")
    return int(round(group.price * 1e6))


def layout_price(stage_groups: Sequence[NodeGroup], stage_size: int) -> int:
    """What the devices of a plan's stages cost per hour, micro-dollars."""
    return sum(stage_size * device_price(g) for g in stage_groups)


class Candidate(NamedTuple):
    """A uniform candidate before its layers are built (``Layout`` is the built one): the
    stages' node groups, each stage's block count, the degrees and micro-batching, and the one
    choice every layer makes."""

    stage_groups: tuple[NodeGroup, ...]
    blocks: tuple[int, ...]
    tp: int
    dp: int
    micro_batch: int
    num_micro_batches: int
    sp: bool
    zero: int
    recompute: str


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A candidate: which groups' ranks form the stages, the degrees, the per-layer strategies."""

    stage_groups: tuple[NodeGroup, ...]
    stage_layers: tuple[tuple[LayerStrategy, ...], ...]
    dp: int
    tp: int
    micro_batch: int
    num_micro_batches: int

    @property
    def pp(self) -> int:
        return len(self.stage_groups)


@dataclass
class UniformResult:
    best: Layout | None
    best_eval: Evaluation | None
    evaluated: int
    wall_s: float
    # The candidate closest to fitting, for the infeasibility message: kept while none fits.
    closest: Layout | None = None
    closest_eval: Evaluation | None = None
    # The best plan after rebalancing blocks between stages (a warm start for CP-SAT; the
    # uniform plan above stays the yardstick).
    balanced: Layout | None = None
    balanced_eval: Evaluation | None = None
    complete: bool = True  # False: the deadline stopped the grid before it had seen every candidate
    # Candidates not evaluated because their work bound (``work_bound_s``) could not beat the
    # best plan so far: neither could any split of their blocks or any pipeline schedule.
    skipped: int = 0
    # Could not fit, nor be the closest to fitting (while none fits) or a split to rebalance:
    # not evaluated.
    skipped_memory: int = 0

    # The fastest pipelined candidates that fit, as (step time, candidate), for the interleaved
    # schedule's search (search/interleaved.py).
    pipelined: list[tuple[float, Candidate]] = field(default_factory=list)

    def fastest(self) -> tuple[Layout, Evaluation] | None:
        """The uniform plan or its rebalanced variant, whichever is faster; None if neither fits."""
        found = [(lay, ev) for lay, ev in ((self.best, self.best_eval), (self.balanced, self.balanced_eval))
                 if lay is not None and ev is not None]
        return min(found, key=lambda t: t[1].step_time_s) if found else None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def device_subsets(cluster: ClusterSpec) -> list[tuple[NodeGroup, ...]]:
    """The whole cluster, and each node group alone when there are several."""
    subsets = [tuple(cluster.groups)]
    if len(cluster.groups) > 1:
        subsets += [(g,) for g in cluster.groups]
    return subsets


def split_blocks(n_blocks: int, pp: int) -> list[int]:
    """Blocks per stage, as even as possible; the remainder goes to the inner stages first
    (the first holds the embedding and the last the head)."""
    base, extra = divmod(n_blocks, pp)
    counts = [base] * pp
    order = list(range(1, pp - 1)) + [pp - 1, 0] if pp > 2 else list(range(pp - 1, -1, -1))
    for i in order[:extra]:
        counts[i] += 1
    return counts


def stage_layer_names(model: ModelSpec, block_counts: Sequence[int]) -> list[list[str]]:
    names: list[list[str]] = []
    start = 0
    for i, count in enumerate(block_counts):
        layer = [f"layers.{j}" for j in range(start, start + count)]
        start += count
        if i == 0:
            layer = ["embed"] + layer
        if i == len(block_counts) - 1:
            layer = layer + ["head"]
        names.append(layer)
    return names


def layer_tp(model: ModelSpec, role: str, tp: int) -> int:
    """The degree a layer takes in a stage of width tp: tp where its shapes divide, else 1."""
    return tp if parallel.tp_rule(model.kinds[role], tp) is None else 1


def strategy(model: ModelSpec, name: str, *, tp: int, sp: bool, zero: int, recompute: str) -> LayerStrategy:
    """The layer's choices in a uniform candidate; only blocks recompute (``recompute`` is their mode)."""
    role = model.role_of(name)
    t = layer_tp(model, role, tp)
    return LayerStrategy(name=name, tensor_parallel=t, sequence_parallel=sp and t > 1, zero=zero,
                         recompute=recompute if role == "block" else "none")


def uniform_choices(model: ModelSpec, *, tp: int, sp: bool, zero: int, recompute: str) -> dict[str, LayerChoice]:
    """The embedding's, every block's and the head's choice in a uniform candidate, by role."""
    return {role: choice_of(model, strategy(model, role, tp=tp, sp=sp, zero=zero, recompute=recompute))
            for role in ("embed", "block", "head")}


def hosts(group: NodeGroup, stage_size: int, tp: int) -> bool:
    """Can this group hold stages of ``stage_size`` ranks with tensor groups of ``tp``? Stages
    align with nodes (the stage divides the node or the node divides the stage), so the cost
    model knows which ranks share a node; tensor groups stay inside a node."""
    gpn = group.gpus_per_node
    aligned = gpn % stage_size == 0 or stage_size % gpn == 0
    return aligned and gpn % tp == 0 and group.size >= stage_size


EVERY_WIDTH_NODES = 32  # groups up to this many nodes offer stages of every number of nodes


def stage_sizes(group: NodeGroup) -> list[int]:
    """The stage widths a group can host: a part of a node (a divisor of its GPUs) or whole
    nodes. Widths need not divide the group (the rest stays idle), so on groups of up to
    ``EVERY_WIDTH_NODES`` nodes every plan of a smaller cluster is a plan of a larger one. A
    larger group offers the widths that divide it and, for each number of stages up to that
    bound, the widest that many stages can take (every width of a 256-node group would multiply
    the shapes by 8 for plans that leave nodes idle)."""
    gpn, nodes = group.gpus_per_node, group.nodes
    if nodes <= EVERY_WIDTH_NODES:
        counts = set(range(1, nodes + 1))
    else:
        counts = set(divisors(nodes)) | {nodes // j for j in range(1, EVERY_WIDTH_NODES + 1)}
    return sorted(set(divisors(gpn)) | {k * gpn for k in counts})


def grid(cm: CostModel, global_batch: int, space: SearchSpace) -> Iterator[tuple[tuple[NodeGroup, ...], int, int, int, int]]:
    """(stage groups, tp, dp, micro_batch, num_micro_batches) for every shape the grid allows:
    every stage of every group used, or, where the runtime cannot run that many stages, as
    many as it can (leaving the rest of the devices idle)."""
    model = cm.model
    for groups in device_subsets(cm.cluster):
        sizes = [g.size for g in groups]
        common = [s for s in divisors(min(sizes)) if all(n % s == 0 for n in sizes)]
        for stage_size in common:
            all_stages = tuple(g for g in groups for _ in range(g.size // stage_size))
            for tp in divisors(stage_size):
                if not all(hosts(g, stage_size, tp) for g in groups) or not tp_allowed(model, tp, space):
                    continue
                dp = stage_size // tp
                for mb, m in batch_splits(global_batch, dp, space):
                    pp = min(len(all_stages), max_stages(cm, fewest_micro_batches(global_batch, dp, mb, m)))
                    if not space.pipeline or pp in space.pipeline:
                        yield all_stages[:pp], tp, dp, mb, m


def sp_choices(cm: CostModel, tp: int, space: SearchSpace) -> tuple[bool, ...]:
    """Sequence parallelism needs tp > 1 and the tokens a rank holds to split tp ways evenly
    (``parallel.sequence_parallel_rule``, which the validator asks too); a mixture of experts at
    tp > 1 needs it (``parallel.moe_tp_rule``): none is left where it cannot have it."""
    if tp == 1:
        return (False,)
    if parallel.sequence_parallel_rule(cm.seq_len, tp) is not None:
        choices: tuple[bool, ...] = (False,)
    else:
        choices = space.sequence_parallel
    if cm.model.is_moe:
        return tuple(sp for sp in choices if parallel.moe_tp_rule(cm.model.kinds["block"], tp, sp) is None)
    return choices


def max_stages(cm: CostModel, fewest_micro_batches: int) -> int:
    """The deepest 1F1B pipeline the engine runs: under torch's schedules every replica needs at
    least as many micro-batches as stages (``parallel.schedule_rule``), so the replica with the
    fewest sets it; Megatron's and DeepSpeed's run fewer (``parallel.SHORT_PIPELINES``)."""
    if cm.engine.name in parallel.SHORT_PIPELINES:
        return cm.model.n_layers
    return max(1, min(cm.model.n_layers, fewest_micro_batches))


def fewest_micro_batches(global_batch: int, dp: int, micro_batch: int, num_micro_batches: int) -> int:
    """The fewest micro-batches a replica runs: one less than the largest share when the shares
    differ (``batch_shares``), else every replica's count."""
    return min(batch_shares(global_batch, dp, micro_batch, num_micro_batches) or (num_micro_batches,))


def replica_counts(global_batch: int, dp: int, micro_batch: int, num_micro_batches: int) -> tuple[int, ...]:
    """Every replica's micro-batch count (the shares, or the count on each)."""
    return batch_shares(global_batch, dp, micro_batch, num_micro_batches) or (num_micro_batches,) * dp


def tp_allowed(model: ModelSpec, tp: int, space: SearchSpace) -> bool:
    """The blocks split tp ways, and the space allows tp."""
    return parallel.tp_rule(model.kinds["block"], tp) is None and (not space.tensor_parallel or tp in space.tensor_parallel)


def batch_splits(global_batch: int, dp: int, space: SearchSpace) -> list[tuple[int, int]]:
    """(micro-batch size, micro-batch count) pairs that make up the global batch on dp replicas.
    Where no micro-batch size splits the batch evenly over dp replicas, the replicas take shares
    that differ by one: in micro-batch counts (``batch_shares``; the count is the largest share)
    or in micro-batch sizes (``micro_batch_sizes``; the size is the largest): any number of
    replicas works with any global batch, and 1024 sequences go to 80 replicas as one
    micro-batch of 13 or 12 each. (Uneven splits are offered only then: where even ones exist
    they are nearly always as fast, and the search stays the size it was.)"""
    if global_batch % dp == 0:
        per_replica = global_batch // dp
        mbs = space.micro_batches or tuple(d for d in divisors(per_replica) if d <= MAX_MICRO_BATCH)
        even = [(mb, per_replica // mb) for mb in mbs if per_replica % mb == 0]
        if even or space.even_shares:
            return even
    if space.even_shares:
        return []
    mbs = space.micro_batches or tuple(d for d in divisors(global_batch) if d <= MAX_MICRO_BATCH)
    out = [(mb, -(-(global_batch // mb) // dp)) for mb in mbs
           if global_batch % mb == 0 and (global_batch // mb) % dp and global_batch // mb >= dp]
    for m in divisors(global_batch):
        rows = global_batch // m  # per micro-batch round, over all replicas
        mb = -(-rows // dp)
        if rows >= dp and rows % dp and mb <= MAX_MICRO_BATCH and (not space.micro_batches or mb in space.micro_batches):
            out.append((mb, m))
    return sorted(set(out))


def micro_batch_sizes(global_batch: int, dp: int, micro_batch: int, num_micro_batches: int) -> tuple[int, ...]:
    """Each replica's micro-batch size when they differ (``Plan.micro_batch_sizes``): every
    replica runs ``num_micro_batches``, the rows of each round dealt as evenly as they go, the
    larger sizes first; () when the split is even or is one of micro-batch counts
    (``batch_shares``)."""
    if dp * micro_batch * num_micro_batches == global_batch or global_batch % num_micro_batches:
        return ()
    rows = global_batch // num_micro_batches
    if rows < dp or not dp * (micro_batch - 1) < rows < dp * micro_batch:
        return ()  # (fewer rows than replicas would leave some with none: that split is in counts)
    base, extra = divmod(rows, dp)
    return tuple(base + 1 if d < extra else base for d in range(dp))


def batch_shares(global_batch: int, dp: int, micro_batch: int, num_micro_batches: int) -> tuple[int, ...]:
    """Each replica's micro-batch count when they differ (``Plan.batch_shares``): the global
    batch's micro-batches dealt as evenly as they go, the larger shares first; () when every
    replica runs ``num_micro_batches`` (also when the replicas differ in micro-batch size
    instead, ``micro_batch_sizes``)."""
    if micro_batch_sizes(global_batch, dp, micro_batch, num_micro_batches):
        return ()
    total = global_batch // micro_batch
    if total == dp * num_micro_batches:
        return ()
    base, extra = divmod(total, dp)
    return tuple(base + 1 if d < extra else base for d in range(dp))


def replicated_zeros(space: SearchSpace, dp: int, cp: int) -> tuple[int, ...]:
    """The ZeRO levels a layer may take: the space's, or 0 alone without parameter replicas
    (dp x cp: under context parallelism ZeRO shards over the cp ranks too, as torchtitan's FSDP
    over dp x cp does and the validator allows)."""
    return space.zero_levels if dp * cp > 1 else (0,)


def zero_levels(space: SearchSpace, global_batch: int, dp: int, micro_batch: int, num_micro_batches: int,
                cp: int = 1) -> tuple[int, ...]:
    """The ZeRO levels a shape may use (``replicated_zeros``), at most 1 when replicas run
    different micro-batch counts (ZeRO 2 and 3 gather or reduce every micro-batch, which replicas
    must do together)."""
    zeros = replicated_zeros(space, dp, cp)
    if batch_shares(global_batch, dp, micro_batch, num_micro_batches):
        return tuple(z for z in zeros if z <= 1)
    return zeros


def shape_zeros(cm: CostModel, space: SearchSpace, global_batch: int, pp: int, dp: int, micro_batch: int,
                num_micro_batches: int) -> tuple[int, ...]:
    """The ZeRO levels a uniform shape of ``pp`` stages may use: ``zero_levels`` less those the
    engine does not run there (``parallel.pipeline_zero_levels``)."""
    return parallel.pipeline_zero_levels(cm.engine.name, pp, zero_levels(space, global_batch, dp, micro_batch,
                                                                         num_micro_batches, cm.cp), cm.cp)


def uniform_search(cm: CostModel, *, global_batch: int, space: SearchSpace = SearchSpace(),
                   deadline: float | None = None) -> UniformResult:
    """Evaluate every uniform candidate; keep the fastest that fits and the closest to fitting.
    At ``deadline`` (a ``time.perf_counter()`` value) it stops with what it has seen so far
    and says so (``complete=False``)."""
    start = time.perf_counter()
    model = cm.model
    result = UniformResult(best=None, best_eval=None, evaluated=0, wall_s=0.0)
    promising: list[tuple[float, tuple]] = []
    # Every candidate with its work bound (``work_bound_s``), evaluated in the order of that
    # bound: once it reaches the best plan found, no candidate left can beat it (nor any split
    # of its blocks, nor any schedule), and the rest are skipped unevaluated.
    candidates = []
    for stage_groups, tp, dp, mb, m in grid(cm, global_batch, space):
        if deadline is not None and time.perf_counter() > deadline:
            result.complete = False
            break
        if space.price_cap is not None and layout_price(stage_groups, dp * tp) > space.price_cap:
            continue
        for zero in shape_zeros(cm, space, global_batch, len(stage_groups), dp, mb, m):
            for recompute in space.recompute:
                for sp in sp_choices(cm, tp, space):
                    choice = uniform_choices(model, tp=tp, sp=sp, zero=zero, recompute=recompute)
                    bound = work_bound_s(cm, stage_groups, choice, dp=dp, micro_batch=mb, num_micro_batches=m)
                    candidates.append((bound, len(candidates), (stage_groups, tp, dp, mb, m, sp, zero, recompute),
                                       choice))
    candidates.sort(key=lambda c: c[:2])
    for i, (bound, _, (stage_groups, tp, dp, mb, m, sp, zero, recompute), choice) in enumerate(candidates):
        if deadline is not None and time.perf_counter() > deadline:
            result.complete = False
            break
        if result.best_eval is not None and bound >= result.best_eval.step_time_s:
            result.skipped += len(candidates) - i
            break
        blocks = split_blocks(model.n_layers, len(stage_groups))
        # A candidate whose state and waiting activations alone overflow a device cannot fit;
        # it is evaluated only if it could still be the closest to fitting while nothing fits,
        # or among the splits to rebalance (judged by lower bounds: ``least_peak_over`` on its
        # memory, the work bound on its step).
        over = least_peak_over(cm, stage_groups, choice, blocks, dp=dp, micro_batch=mb, num_micro_batches=m)
        if over > 1 and not (
                (result.best_eval is None
                 and (result.closest_eval is None or over < result.closest_eval.peak_over_capacity))
                or (len(stage_groups) > 1 and (len(promising) < REBALANCED
                                               or bound * over ** 4 < -promising[0][0]))):
            result.skipped_memory += 1
            continue
        ev = evaluate_counts(cm, list(zip(stage_groups, stage_counts(choice, blocks))), dp=dp, tp=tp,
                             micro_batch=mb, num_micro_batches=m)
        result.evaluated += 1
        lazy = Candidate(stage_groups, tuple(blocks), tp, dp, mb, m, sp, zero, recompute)
        if len(stage_groups) > 1:
            # The REBALANCED least penalised so far, in a heap keyed by minus the penalty (the
            # worst kept on top); ties keep the earlier candidate, as a stable sort would.
            item = (-_penalised(ev), -i, lazy)
            if len(promising) < REBALANCED:
                heapq.heappush(promising, item)
            elif item[:2] > promising[0][:2]:
                heapq.heapreplace(promising, item)
            if ev.fits:
                result.pipelined.append((ev.step_time_s, lazy))
        if ev.fits:
            if result.best_eval is None or ev.step_time_s < result.best_eval.step_time_s:
                result.best, result.best_eval = lazy, ev
        elif result.best_eval is None and (result.closest_eval is None
                                           or ev.peak_over_capacity < result.closest_eval.peak_over_capacity):
            result.closest, result.closest_eval = lazy, ev
    promising = [(-neg, lazy) for neg, _, lazy in sorted(promising, key=lambda t: (-t[0], -t[1]))]
    result.pipelined = sorted(result.pipelined, key=lambda t: t[0])[:PIPELINED_KEPT]
    for _, lazy in promising[:REBALANCED]:
        if deadline is not None and time.perf_counter() > deadline:
            break  # rebalancing only improves the warm start; the grid itself is what completes
        lazy, ev = rebalance(cm, lazy, deadline)
        if ev.fits and (result.balanced_eval is None or ev.step_time_s < result.balanced_eval.step_time_s):
            result.balanced, result.balanced_eval = lazy, ev
    result.best = _layout(model, *result.best) if result.best else None
    result.closest = _layout(model, *result.closest) if result.closest else None
    result.balanced = _layout(model, *result.balanced) if result.balanced else None
    result.wall_s = time.perf_counter() - start
    return result


def least_peak_over(cm: CostModel, stage_groups: Sequence[NodeGroup], choice: dict[str, LayerChoice],
                blocks: Sequence[int], *, dp: int, micro_batch: int, num_micro_batches: int) -> float:
    """A lower bound on the candidate's ``Evaluation.peak_over_capacity``: every stage holds
    its blocks' weights, gradients and optimizer state through the step, its device's reserve,
    and at its 1F1B peak all the activations of the micro-batches in flight but the running
    one (tests/test_search_space.py checks it against the evaluator on whole grids)."""
    worst, pp = 0.0, len(stage_groups)
    for i, (group, n) in enumerate(zip(stage_groups, blocks)):
        mem = cm.layer_memory_of(choice["block"], group.device, dp=dp, micro_batch=micro_batch,
                                 num_micro_batches=num_micro_batches)
        waiting = in_flight(i, pp, num_micro_batches) - 1
        held = n * (mem.weights + mem.gradients + mem.optimizer + waiting * mem.activations) + cm.reserve_bytes(group)
        worst = max(worst, held / group.memory_bytes)
    return worst


def work_bound_s(cm: CostModel, stage_groups: Sequence[NodeGroup], choice: dict[str, LayerChoice], *, dp: int,
                 micro_batch: int, num_micro_batches: int) -> float:
    """A lower bound on the step of every plan that puts these layer choices on these stages,
    whatever the split of blocks and whatever the pipeline schedule: each of the pp stages runs
    all m micro-batches through its layers, so the slowest takes at least m x the layers' time
    per micro-batch / pp, each layer at its time on the fastest of the stages' groups. (The
    grid's candidates, the rebalanced splits and the interleaved and zero-bubble variants of a
    candidate are all such plans; tests/test_search_space.py checks the bound against the
    evaluator on every candidate of two grids.)"""
    groups = frozenset(g.name for g in stage_groups)
    key = (groups, choice["embed"], choice["block"], choice["head"], dp, micro_batch)
    cache = cm.__dict__.setdefault("_work_per_mb", {})  # one micro-batch's least work, by groups and choices
    if key not in cache:
        cache[key] = sum(n * min(cm.layer_time_of(choice[role], cm.cluster.group(g), dp=dp,
                                                  micro_batch=micro_batch).total_s for g in groups)
                         for role, n in (("embed", 1), ("block", cm.model.n_layers), ("head", 1)))
    return num_micro_batches * cache[key] / len(stage_groups)


REBALANCED = 8  # multi-stage candidates whose block split is rebalanced
PIPELINED_KEPT = 16  # the fastest pipelined candidates the interleaved search starts from


def _penalised(ev: Evaluation) -> float:
    """Step time, inflated by how far the worst device is over its memory."""
    return ev.step_time_s * max(1.0, ev.peak_over_capacity) ** 4


def rebalance(cm: CostModel, lazy: Candidate, deadline: float | None = None) -> tuple[Candidate, Evaluation]:
    """Local search on the block split of a candidate (blocks are identical, so only counts
    matter): move one block from the slowest or most crowded stage to wherever it helps most,
    while the step (penalised for memory overflow) improves, or until ``deadline``."""
    stage_groups, blocks, tp, dp, mb, m, sp, zero, recompute = lazy
    model = cm.model
    choice = uniform_choices(model, tp=tp, sp=sp, zero=zero, recompute=recompute)

    def evaluate(counts: Sequence[int]) -> Evaluation:
        return evaluate_counts(cm, list(zip(stage_groups, stage_counts(choice, counts))), dp=dp, tp=tp,
                               micro_batch=mb, num_micro_batches=m)

    blocks = list(blocks)
    ev = evaluate(blocks)
    for _ in range(4 * model.n_layers):
        if deadline is not None and time.perf_counter() > deadline:
            break
        worst = max(range(len(blocks)), key=lambda i: (ev.stages[i].peak_bytes > ev.stages[i].capacity,
                                                       ev.stages[i].time_s))
        if blocks[worst] <= 1:
            break
        best_move = None
        for target in range(len(blocks)):
            if target == worst:
                continue
            trial = list(blocks)
            trial[worst] -= 1
            trial[target] += 1
            tev = evaluate(trial)
            if _penalised(tev) < _penalised(ev) and (best_move is None or _penalised(tev) < _penalised(best_move[1])):
                best_move = (trial, tev)
        if best_move is None:
            break
        blocks, ev = best_move
    return Candidate(stage_groups, tuple(blocks), tp, dp, mb, m, sp, zero, recompute), ev


def stage_counts(choice: dict[str, LayerChoice], blocks: Sequence[int]) -> list[dict[LayerChoice, int]]:
    """Per stage, how many layers make each choice: embed first, head last."""
    out = []
    for i, n in enumerate(blocks):
        counts: dict[LayerChoice, int] = {}
        if i == 0:
            counts[choice["embed"]] = 1
        if n:
            counts[choice["block"]] = counts.get(choice["block"], 0) + n
        if i == len(blocks) - 1:
            counts[choice["head"]] = counts.get(choice["head"], 0) + 1
        out.append(counts)
    return out


def _layout(model: ModelSpec, stage_groups: tuple[NodeGroup, ...], blocks: Sequence[int], tp: int, dp: int, mb: int,
            m: int, sp: bool, zero: int, recompute: str) -> Layout:
    layers = tuple(tuple(strategy(model, n, tp=tp, sp=sp, zero=zero, recompute=recompute) for n in names)
                   for names in stage_layer_names(model, blocks))
    return Layout(stage_groups=stage_groups, stage_layers=layers, dp=dp, tp=tp, micro_batch=mb, num_micro_batches=m)
