"""Replicas on different device types: every node group runs whole replicas of the model, and
the replicas on the faster devices take the larger shares of the batch.

On a mixed cluster the CP-SAT search places each pipeline stage on one node group, so a stage's
data-parallel replicas are all of one device type. When one type is much faster (H100 beside
V100), the best plan may instead run replicas on both, the fast ones taking more rows:
``Stage.replica_groups`` puts replica ``d`` of every stage on a group of its own, and
``Plan.micro_batch_sizes`` gives it its micro-batch size. Every replica runs the same
micro-batch count (so any ZeRO level works) and the same layers with the same choices (each
layer's gradient is reduced over the same replicas); the step is the slowest replica's, and the
collectives over dp run at the pace of the slowest group and the links between the groups
(``CostModel.spanning``).

The search (``replica_search``) is a heuristic over that space, tried after the CP-SAT search
(``planner.make_plan``), which keeps its plan unless one here is faster:

* every tensor degree the groups' nodes share, pipeline depth, micro-batch count and uniform
  layer choice (ZeRO level, recomputation, sequence parallelism), the blocks split evenly, each
  group running as many whole replicas as it holds (a stage's part on a group aligned with its
  nodes), visited in the order of their floors (``_floor_s``) and cut off once the floor
  reaches the best plan;
* for each, the micro-batch sizes by water-filling: every group starts at size 1 and the group
  whose replicas would be slowest least after growing by one row grows, until the rows of a
  micro-batch round are covered; the last group grown gives back the excess, one row from
  each of as many replicas. The step is the slowest group's.

Every shape of that space (every tensor degree, depth, micro-batch count and layer choice) is
either water-filled or ruled out by a floor no plan of the shape can beat (``_floor_s``: the
rows water-filled with each replica priced by its compute alone, through a 1F1B pipeline split
evenly), and the
water-filling is exact for its shape: the step is the slowest group's, each group's step grows
with its micro-batch size, so the greedy that grows the group left fastest reaches the least
slowest step any split of the rows reaches (the min-max exchange argument). So when the search
ends within its budget (``ReplicaResult.complete``) its best is the optimum of the replica space
and a bound for it; out of budget, the bound that holds for every plan on the cluster
(``throughput_bound_s``) stands in.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from partita import parallel
from partita.cluster import NodeGroup
from partita.plan import Plan, Stage
from partita.search.costs.model import CostModel
from partita.search.evaluate import evaluate_counts
from partita.search.uniform import (MAX_MICRO_BATCH, SearchSpace, device_price, divisors, replicated_zeros, sp_choices,
                                    split_blocks, stage_counts, stage_layer_names, strategy, tp_allowed,
                                    uniform_choices)

# Evaluations the search may spend (deterministic; each is one replica kind's pipeline priced).
EVALUATION_BUDGET = 2000


@dataclass(frozen=True)
class ReplicaCandidate:
    """Whole replicas on every group used: ``replicas[g]`` on ``groups[g]``, each running
    ``num_micro_batches`` micro-batches of ``sizes[g]`` rows, but for the group's last
    ``smaller[g]`` replicas, which take one row less; every layer makes the same choice."""

    groups: tuple[NodeGroup, ...]
    replicas: tuple[int, ...]
    tp: int
    pp: int
    num_micro_batches: int
    sizes: tuple[int, ...]
    smaller: tuple[int, ...]  # replicas of each group at sizes[g] - 1
    sp: bool
    zero: int
    recompute: str
    step_time_s: float

    @property
    def dp(self) -> int:
        return sum(self.replicas)

    def replica_sizes(self) -> tuple[int, ...]:
        """Each replica's micro-batch size, in dp-index order (group by group, larger first)."""
        out: list[int] = []
        for n, b, k in zip(self.replicas, self.sizes, self.smaller):
            out += [b] * (n - k) + [b - 1] * k
        return tuple(out)


@dataclass
class ReplicaResult:
    best: ReplicaCandidate | None = None
    evaluated: int = 0
    # Every shape was water-filled or ruled out within the budget: ``best`` (or, if None, the
    # incumbent) is then a lower bound on every plan of whole replicas on two or more types.
    complete: bool = False


def replicas_on(group: NodeGroup, tp: int, pp: int) -> int:
    """How many whole replicas of pp stages of tp ranks the group runs, each stage's part on
    the group aligned with its nodes (it divides a node or is whole nodes)."""
    n = group.size // (tp * pp)
    gpn = group.gpus_per_node
    while n > 0 and not (gpn % (n * tp) == 0 or (n * tp) % gpn == 0):
        n -= 1
    return n


def throughput_bound_s(cm: CostModel, global_batch: int) -> float:
    """A lower bound on the step of any plan on the cluster: every device at its best rate of
    rows per second through the whole model (each layer's compute alone, at the tensor degree
    and micro-batch size that make it cheapest per row and device; collectives, recomputation
    and the schedule only add), all devices busy all the step."""
    model = cm.model
    rate = 0.0
    for g in cm.cluster.groups:
        best = 0.0
        for tp in divisors(g.gpus_per_node):
            if parallel.tp_rule(model.kinds["block"], tp) is not None:
                continue
            for b in (1, 2, 4, 8, 16, MAX_MICRO_BATCH):
                per_mb = sum(n * (c.forward_s + c.backward_s) for n, c in (
                    (1, cm.compute("embed", g.device, tp if parallel.tp_rule(model.kinds["embed"], tp) is None else 1, b)),
                    (model.n_layers, cm.compute("block", g.device, tp, b)),
                    (1, cm.compute("head", g.device, tp if parallel.tp_rule(model.kinds["head"], tp) is None else 1, b))))
                best = max(best, b / (tp * per_mb))  # rows per second per device
        rate += g.size * best
    return global_batch / rate if rate else math.inf


def replica_search(cm: CostModel, *, global_batch: int, space: SearchSpace, incumbent_s: float) -> ReplicaResult:
    """The fastest plan of whole replicas on two or more device types found under
    ``EVALUATION_BUDGET`` evaluations that beats ``incumbent_s``; ``best`` None if none does."""
    result = ReplicaResult()
    groups = tuple(cm.cluster.groups)
    if len(groups) < 2 or len({g.device for g in groups}) < 2:
        return result
    span = cm.spanning(g.name for g in groups)
    best_s = incumbent_s
    # Every shape visited, the lowest floor first (a good incumbent early rules the rest out).
    floors = sorted(((_floor_s(span, shape, global_batch), i, shape)
                     for i, shape in enumerate(_shapes(cm, span, groups, global_batch, space))), key=lambda t: t[:2])
    for floor, _, shape in floors:
        if floor >= best_s:
            break  # the floors that follow are no lower
        if result.evaluated >= EVALUATION_BUDGET:
            return result
        found = _fill(span, shape, global_batch, best_s, result)
        if found is not None and found.step_time_s < best_s:
            result.best, best_s = found, found.step_time_s
    result.complete = result.evaluated <= EVALUATION_BUDGET
    return result


def _floor_s(cm: CostModel, shape, global_batch: int) -> float:
    """No plan of the shape is faster: the rows of a micro-batch round split over the groups'
    replicas as evenly in time as possible (water-filled, as ``_fill``), each replica priced by
    its layers' compute and recomputation alone through 1F1B's m + pp - 1 stage times of a stage
    holding at least 1/pp of the layers (collectives and the optimizer only add)."""
    used, tp, pp, m, _sp, _zero, recompute = shape
    model = cm.model
    rows = global_batch // m
    cache = cm.__dict__.setdefault("_replica_floor", {})  # one replica's compute, by device, tp, size, recompute

    def time(i: int, b: int) -> float:
        device = used[i][0].device
        key = (device, tp, b, recompute)
        if key not in cache:
            once = 0.0
            for role, k in (("embed", 1), ("block", model.n_layers), ("head", 1)):
                t = tp if parallel.tp_rule(model.kinds[role], tp) is None else 1
                c = cm.compute(role, device, t, b)
                again = cm.recompute_s(role, device, t, b, recompute) if role == "block" else 0.0
                once += k * (c.forward_s + c.backward_s + again)
            cache[key] = once
        return (m + pp - 1) * cache[key] / pp

    # The greedy takes the groups' growth steps in increasing time, so the rows are covered
    # first at the least slowest time any split reaches (a split over-covering them is no faster).
    sizes, _, _ = _water_fill(time, [n for _, n in used], rows)
    return max(time(i, b) for i, b in enumerate(sizes))


def _water_fill(step, replicas: Sequence[int], rows: int, limit: float = math.inf):
    """Micro-batch sizes, one per group, covering ``rows`` a micro-batch round: every group at
    one row a replica, then the group whose ``step(i, size + 1)`` is least grows by one row a
    replica until the rows are covered. Returns (sizes, the last group grown, rows covered), or
    None once a step reaches ``limit`` (no split of the rows beats it)."""
    sizes = [1] * len(replicas)
    if any(step(i, 1) >= limit for i in range(len(replicas))):
        return None  # every group runs at least one row per replica
    covered, last = sum(replicas), 0
    while covered < rows:
        i = min(range(len(replicas)), key=lambda i: (step(i, sizes[i] + 1), i))
        if step(i, sizes[i] + 1) >= limit:
            return None
        sizes[i] += 1
        covered += replicas[i]
        last = i
    return sizes, last, covered


def _shapes(cm: CostModel, span: CostModel, groups: Sequence[NodeGroup], global_batch: int, space: SearchSpace):
    """Every shape of the replica space: groups used with their replica counts, tp, pp,
    micro-batch count and layer choices."""
    model = cm.model
    common = [t for t in divisors(min(g.gpus_per_node for g in groups))
              if all(g.gpus_per_node % t == 0 for g in groups) and tp_allowed(model, t, space)]
    for tp in common:
        for pp in range(1, model.n_layers + 1):
            if space.pipeline and pp not in space.pipeline:
                continue
            counts = tuple(replicas_on(g, tp, pp) for g in groups)
            used = tuple((g, n) for g, n in zip(groups, counts) if n)
            if len({g.device for g, _ in used}) < 2:
                if not any(counts):
                    break  # deeper pipelines fit no group either
                continue
            dp = sum(n for _, n in used)
            if space.price_cap is not None and sum(n * tp * pp * device_price(g) for g, n in used) > space.price_cap:
                continue
            ms = [m for m in divisors(global_batch) if m >= pp and global_batch // m >= dp]
            for m in ms:
                rows = global_batch // m
                if space.micro_batches and not any(b in space.micro_batches for b in range(1, rows + 1)):
                    continue
                for zero in parallel.pipeline_zero_levels(cm.engine.name, pp, replicated_zeros(space, dp, cm.cp), cm.cp):
                    for recompute in space.recompute:
                        for sp in sp_choices(cm, tp, space):
                            yield (used, tp, pp, m, sp, zero, recompute)


def _choice(cm: CostModel, tp: int, sp: bool, zero: int, recompute: str) -> dict:
    key = (tp, sp, zero, recompute)
    cache = cm.__dict__.setdefault("_replica_choices", {})
    if key not in cache:
        cache[key] = uniform_choices(cm.model, tp=tp, sp=sp, zero=zero, recompute=recompute)
    return cache[key]


def _model_time_s(cm: CostModel, choice: dict, group: NodeGroup, dp: int, micro_batch: int) -> float:
    """One micro-batch through every layer at these choices on one device of the group."""
    key = (cm.dp_span, tuple(choice.values()), group.name, dp, micro_batch)  # (a spanning view's times differ)
    cache = cm.__dict__.setdefault("_replica_times", {})
    if key not in cache:
        cache[key] = sum(k * cm.layer_time_of(choice[role], group, dp=dp, micro_batch=micro_batch).total_s
                         for role, k in (("embed", 1), ("block", cm.model.n_layers), ("head", 1)))
    return cache[key]


def _fill(cm: CostModel, shape, global_batch: int, best_s: float, result: ReplicaResult) -> ReplicaCandidate | None:
    """Water-fill one shape's micro-batch sizes (module docstring); None if no sizes fit or
    the slowest group cannot beat ``best_s``."""
    used, tp, pp, m, sp, zero, recompute = shape
    rows = global_batch // m
    dp = sum(n for _, n in used)
    choice = _choice(cm, tp, sp, zero, recompute)
    blocks = split_blocks(cm.model.n_layers, pp)
    stages = stage_counts(choice, blocks)
    cache: dict[tuple[int, int], float] = {}

    def step(i: int, b: int) -> float:
        """Group i's replicas' step at micro-batch size b (inf: over memory or the size limit)."""
        if (i, b) not in cache:
            if b > MAX_MICRO_BATCH:
                cache[(i, b)] = math.inf
            else:
                g = used[i][0]
                ev = evaluate_counts(cm, [(g, c) for c in stages], dp=dp, tp=tp, micro_batch=b, num_micro_batches=m)
                result.evaluated += 1
                cache[(i, b)] = ev.step_time_s if ev.fits else math.inf
        return cache[(i, b)]

    filled = _water_fill(step, [n for _, n in used], rows, best_s)
    if filled is None:
        return None
    sizes, last, covered = filled
    smaller = [0] * len(used)
    smaller[last] = covered - rows
    slowest = max(step(i, b) for i, b in enumerate(sizes))
    if smaller[last] == used[last][1]:  # the whole group took one row less: its size is one less
        sizes[last] -= 1
        smaller[last] = 0
    return ReplicaCandidate(groups=tuple(g for g, _ in used), replicas=tuple(n for _, n in used), tp=tp, pp=pp,
                            num_micro_batches=m, sizes=tuple(sizes), smaller=tuple(smaller), sp=sp, zero=zero,
                            recompute=recompute, step_time_s=slowest)


def replica_stages(cm: CostModel, cand: ReplicaCandidate) -> tuple[Stage, ...]:
    """The candidate's stages: on each group, stage s takes the next ``replicas x tp`` ranks
    after the group's earlier stages; replicas are numbered group by group."""
    model = cm.model
    names = stage_layer_names(model, split_blocks(model.n_layers, cand.pp))
    stages = []
    for s in range(cand.pp):
        ranks: list[int] = []
        replica_groups: list[str] = []
        for g, n in zip(cand.groups, cand.replicas):
            first = cm.cluster.first_rank(g.name) + s * n * cand.tp
            ranks += range(first, first + n * cand.tp)
            replica_groups += [g.name] * n
        layers = tuple(strategy(model, name, tp=cand.tp, sp=cand.sp, zero=cand.zero, recompute=cand.recompute)
                       for name in names[s])
        stages.append(Stage(index=s, group=cand.groups[0].name, device=cand.groups[0].device, ranks=tuple(ranks),
                            layers=layers, replica_groups=tuple(replica_groups)))
    return tuple(stages)


def replica_plan(cm: CostModel, cand: ReplicaCandidate, base: Plan) -> Plan:
    """``base`` (a plan for the same request) reshaped to the candidate, without a prediction."""
    sizes = cand.replica_sizes()
    mesh = dataclasses.replace(base.mesh, dp=cand.dp, tp=cand.tp, pp=cand.pp)
    return dataclasses.replace(base, stages=replica_stages(cm, cand), mesh=mesh,
                               micro_batch=max(sizes), num_micro_batches=cand.num_micro_batches, batch_shares=(),
                               micro_batch_sizes=sizes if len(set(sizes)) > 1 else (), schedule="1f1b",
                               prediction=None)
