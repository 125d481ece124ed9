"""A memory-aware lower bound on every interleaved plan of one grid entry.

The interleaved search (``search/interleaved.py``) splits the blocks evenly over the pp x v
virtual stages (``interleaved.chunk_names``), so each rank's blocks and virtual stages are
fixed by (pp, v, schedule); what a plan still chooses is each layer's strategy. For each rank
the least time of its blocks within its memory is a small linear programme (each block may
mix choices fractionally), over the terms of the evaluator's memory (``costs.stage``) it never
undercounts:

* every layer's static state (weights, gradients, optimizer state, and the kept compute copy
  unless the layer frees it after its backward) and the device's reserve;
* the activations of the pairs the schedule keeps in flight (``StageCost.activations``): under
  interleaved 1F1B those of one moment of torch's order (``schedules.held_moments``), which the
  evaluator's fullest moment is at least, the running pair among them at no less than its own
  activations; the zero-bubble schedules charge every pair at the largest virtual stage's, at
  least the rank's mean;
* one output message per pair in flight.

Time: each rank's layers' forward and backward, the embedding and head at their fastest, and
its sides of its boundaries where the engine does not overlap them (interleaved 1F1B with
``p2p_overlap`` hides some: none counted there); the step is then at least the schedule's
closed form (``schedules.closed_form_s``, increasing in every rank's time) plus the least
ZeRO edge, exposed sync, optimizer step and the fixed overhead. tests/test_interleaved_bound.py
holds the bound below the evaluator for every uniform plan of small instances.
"""

from __future__ import annotations

import math
from collections import Counter
from functools import lru_cache
from typing import Sequence

from partita.cluster import NodeGroup
from partita.parallel import ZERO_BUBBLE, pipeline_zero_levels, schedule_counts_rule
from partita.search.costs.memory import (activation_message_bytes, kept_output_bytes, receive_buffers,
                                        retained_logits_bytes)
from partita.search.costs.model import CostModel
from partita.search.costs.stage import boundary_s, canonical_order, choice_of
from partita.search.evaluate import evaluate_interleaved, next_groups, weight_grad_bytes
from partita.search.interleaved import VARIANTS, InterleavedLayout, chunk_names
from partita.search.knapsack import least_time_s, least_whole, moment_least_s
from partita.search.schedules import (chunk_in_flight, closed_form_s, held_moments, in_flight_chunks,
                                      pending_weight_grads)
from partita.search.uniform import SearchSpace, replica_counts, replicated_zeros, sp_choices, strategy


def _choices(cm: CostModel, group: NodeGroup, name: str, *, tp: int, dp: int, mb: int, m: int,
             space: SearchSpace, schedule: str) -> list[tuple]:
    """(time, static bytes, activations, dp sync, optimizer, ZeRO edge, strategy, overlap window,
    transient bytes) of each choice the schedule runs for this layer (``parallel.schedule_layers_rule``:
    the zero-bubble schedules take ZeRO 0/1 without recomputation, and hide no sync behind their
    backward: ``evaluate._split_backward``)."""
    out = []
    # (every interleaved schedule pipelines: an engine's pipelined ZeRO rule applies, parallel.pipeline_zero_rule)
    zeros = pipeline_zero_levels(cm.engine.name, 2, replicated_zeros(space, dp, cm.cp), cm.cp)
    recomputes = space.recompute if name.startswith("layers.") else ("none",)
    for sp in sp_choices(cm, tp, space):
        for z in zeros:
            for rc in recomputes:
                if schedule in ZERO_BUBBLE and (z >= 2 or rc != "none"):
                    continue
                s = strategy(cm.model, name, tp=tp, sp=sp, zero=z, recompute=rc)
                role = cm.model.role_of(name)
                t = cm.layer_time(role, group, s, dp=dp, micro_batch=mb)
                mem = cm.layer_memory(role, group.device, s, dp=dp, micro_batch=mb, num_micro_batches=m)
                static = mem.weights + mem.gradients + mem.optimizer + (0 if mem.releases_copy else mem.gathered_weights)
                window = 0.0 if schedule in ZERO_BUBBLE else t.overlap_window_s
                out.append((t.forward_s + t.backward_s, static, mem.activations, t.dp_sync_s, t.optimizer_s,
                            t.zero_edge_s, s, window, mem.transient))
    return out


def _rank_terms(cm: CostModel, stage_groups: Sequence[NodeGroup], names, r: int, of, *, tp: int, dp: int, mb: int,
                m: int, schedule: str, v: int):
    """Rank r's (room for its blocks, each virtual stage's block count, weightings of their
    activations with what each weighting charges the end layers (``variant_bound_s`` takes the
    best), the choices of each end layer it holds, its sides of its boundaries per micro-batch);
    None if the schedule runs none of a layer's choices."""
    group = stage_groups[r]
    pp = len(stage_groups)
    blocks = of(group, "layers.0")
    if not blocks or not of(group, "embed") or not of(group, "head"):
        return None
    room = group.memory_bytes - cm.reserve_bytes(group)
    ends = [of(group, end) for end in ("embed", "head") if any(end in chunk for chunk in names[r])]
    room -= sum(min(c[1] for c in end) for end in ends)
    # The running micro-batch: its virtual stage's activations and, at its last layer, that
    # layer's transient (``stage._stage_cost``'s peak), at least the least of any layer here.
    room -= min(c[8] for c in list(blocks) + [c for end in ends for c in end])
    pairs = in_flight_chunks(schedule, r, pp, v, m)
    room -= kept_output_bytes(cm, mb, tp) * pairs + _buffers_bytes(cm, stage_groups, names, r,
                                                                           schedule=schedule, tp=tp, mb=mb, m=m)
    if schedule in ZERO_BUBBLE:  # the gradients kept between I and W (``evaluate._split_backward``)
        least = {n: min(weight_grad_bytes(cm, choice_of(cm.model, c[6]), mb) for c in of(group, n))
                 for n in ("layers.0", "embed", "head")}
        room -= pending_weight_grads(schedule, r, pp, m) * max(
            sum(least["layers.0" if n.startswith("layers.") else n] for n in chunk) for chunk in names[r])
    sizes = [sum(n.startswith("layers.") for n in chunk) for chunk in names[r]]
    # Each virtual stage's blocks are charged at w_c pairs, each w a bound. Interleaved 1F1B: the
    # pairs the rank holds at one moment of torch's order (``schedules.held_moments``; the running
    # one among them, its transient over at least its own activations), which the evaluator's
    # most over the moments is at least: the moment of most pairs and the one of most bytes at
    # the leanest activations. Zero-bubble (every pair at the largest virtual stage's), any w with
    # sum w <= pairs: in proportion, and the virtual stages of most activations first.
    # A virtual stage's activations are its blocks' and its end layers' (these at their leanest).
    ends_act = _ends_act(of, group, names[r])
    leanest = [size * min(c[2] for c in blocks) + e for size, e in zip(sizes, ends_act)]
    if schedule == "interleaved-1f1b":
        moments = [vec for _, vec, _ in held_moments(r, pp, v, m)]
        weights = (moments[0], max(moments, key=lambda vec: sum(n * a for n, a in zip(vec, leanest))))
    else:  # zero-bubble: up to every pair at one virtual stage
        largest, left = [0.0] * v, pairs
        for c in sorted(range(v), key=lambda c: -leanest[c]):
            largest[c] = min(pairs, left)
            left -= largest[c]
        weights = ([pairs / v] * v, largest)
    sides = _sides_s(cm, stage_groups, r, v, schedule, dp=dp, tp=tp, mb=mb)
    if schedule == "interleaved-1f1b" and cm.engine.p2p_overlap:
        # The transfers run beside the rank's compute and slow it (``stage.with_p2p_overlap``):
        # at least slowdown x min(compute, transfers) (``timing.overlapped_s``), the compute at
        # least its layers' least.
        compute = lambda c: cm.layer_time(cm.model.role_of(c[6].name), group, c[6], dp=dp, micro_batch=mb).compute_s  # noqa: E731
        least = (sum(sizes) * min(compute(c) for c in blocks)
                 + sum(min(compute(c) for c in end) for end in ends))
        sides = cm.time_constants(group.device).overlap_slowdown * min(sides, least)
    weightings = [(w, sum(x * e for x, e in zip(w, ends_act))) for w in weights]
    return room, sizes, weightings, ends, sides


def _ends_act(of, group: NodeGroup, chunks) -> list[int]:
    """Each virtual stage's end layers' least activations per pair."""
    return [sum(min(c[2] for c in of(group, n)) for n in chunk if n in ("embed", "head")) for chunk in chunks]


def _priced(blocks, ends, sizes, weightings, room: float, sides: float, cost) -> float:
    """A rank's least total ``cost`` (per micro-batch time -> per-layer cost, the sides at
    ``cost`` of pure time) within ``room``: its blocks' knapsack, the largest over the
    weightings of their activations, and its ends at their cheapest."""
    total = max(least_time_s([(size, [(c[1] + w * c[2], cost(c)) for c in blocks]) for size, w in zip(sizes, ws)],
                             room - ends_bytes) for ws, ends_bytes in weightings)
    return total + sum(min(cost(c) for c in end) for end in ends) + cost((sides, 0, 0, 0, 0, 0, None, 0, 0))


def variant_bound_s(cm: CostModel, stage_groups: Sequence[NodeGroup], *, tp: int, dp: int, mb: int, m: int,
                    space: SearchSpace, schedule: str, v: int, enough: float = math.inf, exact: bool = False) -> float:
    """No plan of this grid entry under ``schedule`` with v virtual stages per rank, its blocks
    split evenly (``interleaved.chunk_names``), is faster than this (seconds); inf where none
    fits. Each rank's blocks are a knapsack within its memory (``least_whole``), and the step is
    at least the largest of:

    * the schedule's closed form A over each rank's least time, plus the least edge, sync and
      optimizer step;
    * for each rank r and weight l in [0, s]: A + (l / s)(B - A) + the least of l x r's time plus
      its exposed data-parallel sync (at least its layers' sync less their overlap windows,
      ``StageCost.exposed_dp_s``), where B + s x T is the closed form's tangent in r's time T
      past every other rank's least (it is convex, so max(A, B + s T) bounds it, and the mix
      bounds the max): a rank that buys memory with ZeRO 2 pays per micro-batch what ZeRO 1
      pays once, and a rank off the critical path can still set the exposed sync.

    A bound that reaches ``enough`` (seconds) is returned as soon as it does. ``exact``: under
    interleaved 1F1B each rank's least time also holds every moment of torch's order at once
    (``moment_least_s``), at least the knapsacks' one weighting at a time (a few solver calls a
    rank: ``tighten`` asks for it where an entry's bound is below the best plan)."""
    names, of, edges = _entry(cm, stage_groups, tp=tp, dp=dp, mb=mb, m=m, space=space, schedule=schedule, v=v)
    # The step pays m x the largest ZeRO edge of any layer (``costs.step``): the plans whose
    # largest edge is e take only choices with edges up to e, and pay m x e.
    memo: dict = {}
    kw = dict(tp=tp, dp=dp, mb=mb, m=m, schedule=schedule, v=v, memo=memo,
              exact=exact and schedule == "interleaved-1f1b")
    base = _edgeless_bound_s(cm, stage_groups, names, of, enough=enough, **kw)
    bound = math.inf
    for e in edges:
        if base + m * e >= min(bound, enough):
            bound = min(bound, base + m * e)  # no class from here on is lower
            break
        bound = min(bound, m * e + (base if e == edges[-1] else _edgeless_bound_s(
            cm, stage_groups, names, _capped(of, e), enough=min(bound, enough) - m * e, **kw)))
    return bound


def _entry(cm: CostModel, stage_groups: Sequence[NodeGroup], *, tp: int, dp: int, mb: int, m: int,
           space: SearchSpace, schedule: str, v: int):
    """An entry's layer names per virtual stage (``interleaved.chunk_names``), its choices per
    (group, layer) (``_choices``, kept), and the ZeRO edges they take, least first."""
    names = chunk_names(cm.model.n_layers, len(stage_groups), v, schedule)
    kw = dict(tp=tp, dp=dp, mb=mb, m=m, space=space, schedule=schedule)

    @lru_cache(maxsize=None)
    def of(group: NodeGroup, name: str):
        return _choices(cm, group, name, **kw)

    edges = sorted({c[5] for g in set(stage_groups) for n in ("layers.0", "embed", "head") for c in of(g, n)})
    return names, of, edges


def _capped(of, edge: float):
    """The choices ``of`` gives whose ZeRO edge is at most ``edge`` (kept)."""
    return lru_cache(maxsize=None)(lambda g, n: tuple(c for c in of(g, n) if c[5] <= edge))


def _edgeless_bound_s(cm: CostModel, stage_groups: Sequence[NodeGroup], names, of, *, tp: int, dp: int, mb: int,
                      m: int, schedule: str, v: int, enough: float, memo: dict, exact: bool = False) -> float:
    """``variant_bound_s`` over the choices ``of`` gives, without the ZeRO edges; returned once
    it reaches ``enough``. ``memo`` keeps each rank's knapsacks (ranks alike give the same)."""
    def priced(blocks, ends, sizes, weightings, room, sides, key, cost):
        at = (id(blocks), tuple(sizes), tuple((tuple(w), e) for w, e in weightings), room, sides, tuple(map(id, ends)),
              key)
        if at not in memo:
            memo[at] = _priced(blocks, ends, sizes, weightings, room, sides, cost)
        return memo[at]

    pp = len(stage_groups)
    ranks, times, sync, optimizer = [], [], 0.0, 0.0
    tied = _least_tied_sync_s(cm, stage_groups, names, of, dp=dp)
    for r, group in enumerate(stage_groups):
        terms = _rank_terms(cm, stage_groups, names, r, of, tp=tp, dp=dp, mb=mb, m=m, schedule=schedule, v=v)
        if terms is None:
            return math.inf  # the schedule runs none of a layer's choices
        room, sizes, weightings, ends, sides = terms
        blocks = of(group, "layers.0")
        best = priced(blocks, ends, sizes, weightings, room, sides, "time", lambda c: c[0])
        if exact and math.isfinite(best):
            at = (id(blocks), tuple(sizes), room, r, "moments")
            if at not in memo:
                sent = kept_output_bytes(cm, mb, tp)  # what a tensor sent that only its send holds takes
                moments = [(vec, dead * sent) for _, vec, dead in held_moments(r, pp, v, m)]
                least = moment_least_s(blocks, sizes, moments, _ends_act(of, group, names[r]), room)
                memo[at] = least + sum(min(c[0] for c in end) for end in ends) + sides
            best = max(best, memo[at])
        if not math.isfinite(best):
            return math.inf
        times.append(best)
        ranks.append((blocks, ends, sizes, weightings, room, sides))
        n_blocks = sum(sizes)
        least_sync = min(c[3] for c in blocks)
        sync = max(sync, n_blocks * least_sync if schedule in ZERO_BUBBLE else least_sync)
        optimizer = max(optimizer, n_blocks * min(c[4] for c in blocks))
        fixed = optimizer + cm.step_overhead_s + tied
        # the closed form only grows with the ranks still to come
        so_far = closed_form_s(schedule, times + [0.0] * (pp - len(times)), m, v) + sync + fixed
        if so_far >= enough:
            return so_far
    least = closed_form_s(schedule, times, m, v)
    bound = least + sync
    if dp > 1 and bound + fixed < enough:
        top = max(times)
        for r, (blocks, ends, sizes, weightings, room, sides) in enumerate(ranks):
            at = lambda x: closed_form_s(schedule, times[:r] + [x] + times[r + 1:], m, v)  # noqa: E731
            step = max(top * 1e-3, 1e-9)
            slope = (at(top + step) - at(top)) / step  # past every other rank's time: the tangent's
            tangent = at(top) - slope * top  # B
            for part in (0.0, 0.125, 0.25, 0.5, 1.0):
                lam = part * slope
                joint = priced(blocks, ends, sizes, weightings, room, sides, lam,
                               lambda c: lam * c[0] + c[3] - c[7])
                bound = max(bound, least + part * (tangent - least) + joint)
            if bound + fixed >= enough:
                break
    return bound + fixed


def _least_tied_sync_s(cm: CostModel, stage_groups: Sequence[NodeGroup], names, of, *, dp: int) -> float:
    """The least per-step sum of a tied embedding's two copies the step pays (``costs.step``: a
    rank that holds the head and not the embedding, ``layer_time.tied_sync_s``), over the head's
    choices; 0 where the model ties none or one rank holds both."""
    if not cm.model.tie_embeddings:
        return 0.0
    holds = lambda end: next((r for r, chunks in enumerate(names) if any(end in c for c in chunks)), None)  # noqa: E731
    head, embed = holds("head"), holds("embed")
    if head is None or head == embed:
        return 0.0
    group = stage_groups[head]
    # no choice of the head runs under this schedule: the rank's terms make the entry inf
    return min((cm.tied_sync_s(group, dp=dp, tp=c[6].tensor_parallel, zero=c[6].zero) for c in of(group, "head")),
               default=0.0)


def _buffers_bytes(cm: CostModel, groups: Sequence[NodeGroup], names, r: int, *, schedule: str, tp: int, mb: int,
                   m: int) -> int:
    """Rank r's receive buffers and its head's logits kept in flight, as the evaluator counts
    them (``memory.pipeline_memory`` per virtual stage, ``interleaved_stage_cost``): whatever
    its layers' choices."""
    v = len(names[r])
    msg = activation_message_bytes(cm, mb, tp)
    nexts = next_groups(schedule, groups, r, v)
    held = chunk_in_flight(schedule, r, len(groups), v, m)
    total = 0
    for c, chunk in enumerate(names[r]):
        total += receive_buffers(cm, m) * msg * (("embed" not in chunk) + (nexts[c] is not None))
        if "head" in chunk:
            head = choice_of(cm.model, strategy(cm.model, "head", tp=tp, sp=False, zero=0, recompute="none"))
            total += held[c] * retained_logits_bytes(cm, {head: 1}, mb)
    return total


def _sides_s(cm: CostModel, groups: Sequence[NodeGroup], r: int, v: int, schedule: str, *, dp: int, tp: int,
             mb: int) -> float:
    """Rank r's sides of its boundaries per micro-batch: its sends and its receives, as the
    evaluator charges them (``evaluate_interleaved``); the V's turn stays on the rank."""
    b = lambda a, c: boundary_s(cm, a, c, dp=dp, tp=tp, micro_batch=mb)  # noqa: E731
    pp = len(groups)
    if schedule == "zbv":
        sends = sum(b(groups[r], n) for c, n in enumerate(next_groups(schedule, groups, r, v))
                    if n is not None and not (c == 0 and r == pp - 1))
        return sends + sum(b(groups[j], groups[r]) for j in (r - 1, r + 1) if 0 <= j < pp)
    own = sum(b(groups[r], n) for n in next_groups(schedule, groups, r, v) if n is not None)
    before = sum(b(groups[r - 1], n) for n in next_groups(schedule, groups, (r - 1) % pp, v) if n is not None)
    return own + before


def entry_bounds_s(cm: CostModel, stage_groups: Sequence[NodeGroup], *, tp: int, dp: int, mb: int, m: int,
                   global_batch: int, space: SearchSpace, schedules: Sequence[str],
                   enough: float = math.inf) -> dict[tuple[str, int], float]:
    """``variant_bound_s`` for each (schedule, v) pair torch runs for this entry (each returned
    once it reaches ``enough`` seconds)."""
    pp = len(stage_groups)
    shares = replica_counts(global_batch, dp, mb, m)
    return {(s, v): variant_bound_s(cm, stage_groups, tp=tp, dp=dp, mb=mb, m=m, space=space, schedule=s, v=v,
                                    enough=enough)
            for s, v in VARIANTS if s in schedules and pp * v <= cm.model.n_layers
            and not schedule_counts_rule(s, pp, v, shares)}


def tighten(cm: CostModel, found, *, below_us: float, global_batch: int, space: SearchSpace,
            schedules: Sequence[str], tries: int = 8) -> float:
    """The least bound over the interleaved search's grid entries (``InterleavedResult.entries``),
    each entry's work bound tightened by ``entry_bounds_s`` where it is below ``below_us`` (the
    others cannot beat that step anyway), its interleaved 1F1B variants below it again with every
    moment at once (``variant_bound_s``'s ``exact``); and, for the ``tries`` (entry, schedule, v) of least
    bound below it, a plan whose blocks mix choices (``mixed_layout``), kept in ``found`` when
    it fits and beats ``found.best``."""
    bound, open_ = math.inf, []
    for cheap, entry in sorted(found.entries, key=lambda e: e[0]):
        if cheap >= min(bound, below_us):
            bound = min(bound, cheap)
            break  # sorted: no later entry is lower
        groups, tp, dp, mb, m = entry
        tight = entry_bounds_s(cm, groups, tp=tp, dp=dp, mb=mb, m=m, global_batch=global_batch, space=space,
                               schedules=schedules, enough=min(bound, below_us) / 1e6)
        for (schedule, v), us in tight.items():  # below the best plan: every moment at once
            if schedule == "interleaved-1f1b" and us * 1e6 < min(bound, below_us):
                tight[schedule, v] = max(us, variant_bound_s(cm, groups, tp=tp, dp=dp, mb=mb, m=m, space=space,
                                                             schedule=schedule, v=v, exact=True,
                                                             enough=min(bound, below_us) / 1e6))
        bound = min(bound, max(cheap, min(tight.values(), default=math.inf) * 1e6))
        open_ += [(us * 1e6, entry, variant) for variant, us in tight.items() if us * 1e6 < below_us]
    if space.price_cap is not None:
        return bound  # the grid's entries are not held to a price bound: no plans from them
    for _, (groups, tp, dp, mb, m), (schedule, v) in sorted(open_, key=lambda e: e[0])[:tries]:
        mixed = mixed_layout(cm, groups, tp=tp, dp=dp, mb=mb, m=m, space=space, schedule=schedule, v=v)
        if mixed is not None and (found.best_eval is None or mixed[1].step_time_s < found.best_eval.step_time_s):
            found.best, found.best_eval = mixed
            found.evaluated += 1
    return bound


def mixed_layout(cm: CostModel, stage_groups: Sequence[NodeGroup], *, tp: int, dp: int, mb: int, m: int,
                 space: SearchSpace, schedule: str, v: int, tries: int = 6):
    """A plan of the entry under (schedule, v) whose blocks mix choices within each rank's memory,
    as the bound's knapsacks do (``least_whole``, memory rounded up): the fastest that fits of
    ``_candidates``' plans, without ZeRO 2/3 blocks (their edge costs m x it) and then with any.
    (InterleavedLayout, Evaluation), or None."""
    names, every, edges = _entry(cm, stage_groups, tp=tp, dp=dp, mb=mb, m=m, space=space, schedule=schedule, v=v)
    best = None
    # The end layers at their fastest choices, and (where that choice is unsharded and replicas
    # share them) at their fastest sharded one: what an unsharded end layer pays once a step (its
    # whole gradient's all-reduce; a tied embedding's two copies summed across the replicas,
    # ``layer_time.tied_sync_s``) is not in the layer time the choice is picked by. (Untied models
    # gain too: llama-3-405b on 16,384 H100, 7.130 -> 7.117 s, docs/benchmarks.md.)
    sharded = dp > 1 and any(_end_pick(every, g, end, sharded=False)[6].zero == 0
                             and _end_pick(every, g, end, sharded=True)[6].zero > 0
                             for g in set(stage_groups) for end in ("embed", "head"))
    for ends in ((False, True) if sharded else (False,)):
        for edge in (edges[0], math.inf):  # ZeRO 2/3 blocks cost m x their edge: plans without them, then any
            for found in _candidates(cm, stage_groups, names, _capped(every, edge), tries=tries, tp=tp, dp=dp,
                                     mb=mb, m=m, schedule=schedule, v=v, sharded_ends=ends):
                if best is None or found[1].step_time_s < best[1].step_time_s:
                    best = found
    if best is None:
        return None
    stages, ev = best
    layers = []
    for r, group in enumerate(stage_groups):
        rank = []
        for chunk, counts in zip(names[r], stages[r]):
            order = canonical_order(cm, group.device, counts, dp=dp, micro_batch=mb, num_micro_batches=m)
            ordered = iter([c for c in order for _ in range(counts[c])])
            for n in chunk:
                role, t, sp, z, rc = next(ordered)
                rank.append(strategy(cm.model, n, tp=tp, sp=sp, zero=z, recompute=rc))
        layers.append(tuple(rank))
    return InterleavedLayout(stage_groups=tuple(stage_groups), stage_layers=tuple(layers), dp=dp, tp=tp,
                             micro_batch=mb, num_micro_batches=m, schedule=schedule,
                             chunk_sizes=tuple(tuple(len(c) for c in stage) for stage in names)), ev


def _end_pick(of, group: NodeGroup, end: str, *, sharded: bool):
    """An end layer's fastest choice; ``sharded``: its fastest with ZeRO 1 or more, if it has one."""
    choices = of(group, end)
    if sharded and any(c[6].zero > 0 for c in choices):
        choices = [c for c in choices if c[6].zero > 0]
    return min(choices, key=lambda c: c[0])


def _candidates(cm: CostModel, stage_groups, names, of, *, tries: int, tp: int, dp: int, mb: int, m: int,
                schedule: str, v: int, sharded_ends: bool = False):
    """``mixed_layout``'s plans over the choices ``of`` gives, that fit, for two weightings of
    the in-flight activations: each rank's blocks for its least time; for its least m x time
    plus exposed sync; and (with data parallelism) for its least time, then blocks traded for
    less exposed sync while the rank stays within the slowest rank's time (``_less_exposed``)."""
    pp = len(stage_groups)
    ranks, weightings, fixed, fixed_e = [], [], [], []
    for r, group in enumerate(stage_groups):
        terms = _rank_terms(cm, stage_groups, names, r, of, tp=tp, dp=dp, mb=mb, m=m, schedule=schedule, v=v)
        if terms is None:
            return
        room, sizes, bounds, _, sides = terms
        fastest = {end: _end_pick(of, group, end, sharded=sharded_ends) for end in ("embed", "head")}
        here = [end for end in fastest if any(end in chunk for chunk in names[r])]
        held = [fastest[end] for end in here]
        # The plan's end layers take their fastest choices: their state beyond the leanest, which
        # the bound's room took off, and their activations in each weighting's charge.
        room -= sum(fastest[end][1] - min(c[1] for c in of(group, end)) for end in here)
        ends_act = [sum(fastest[n][2] for n in chunk if n in fastest) for chunk in names[r]]
        # every pair in flight (what the evaluator can charge), and the bound's first weighting,
        # each with what it charges the end layers
        every = chunk_in_flight(schedule, r, pp, v, m) if schedule not in ZERO_BUBBLE else bounds[1][0]
        weightings.append(tuple((w, sum(x * e for x, e in zip(w, ends_act))) for w in (every, bounds[0][0])))
        fixed.append(sides + sum(c[0] for c in held))
        fixed_e.append(sum(c[3] - c[7] for c in held))
        ranks.append((room, sizes, {end: c[6] for end, c in fastest.items()}))

    def classes(r: int, cost, k: int):
        blocks = of(stage_groups[r], "layers.0")
        return [(size, [(c[1] + w * c[2], cost(c), c) for c in blocks]) for size, w in zip(ranks[r][1], weightings[r][k][0])]

    def time_(c):
        return c[0]

    def exposure(picks) -> float:
        return sum(p[2][3] - p[2][7] for pick in picks for p in pick)

    for k in range(2):
        for cost in (time_, lambda c: m * c[0] + c[3] - c[7]):
            found = _fit(cm, stage_groups, names, ranks,
                         lambda r, room: least_whole(classes(r, cost, k), room - weightings[r][k][1], plan=True)[1],
                         tries=tries, dp=dp, tp=tp, mb=mb, m=m, schedule=schedule)
            if found is not None:
                yield found
        if dp == 1:
            continue
        rooms = [ranks[r][0] - weightings[r][k][1] for r in range(pp)]  # the blocks' own
        fastest_picks = [least_whole(classes(r, time_, k), rooms[r], plan=True)[1] for r in range(pp)]
        if any(p is None for p in fastest_picks):
            continue
        times = [f + sum(p[2][0] for pick in picks for p in pick) for f, picks in zip(fixed, fastest_picks)]
        top = max(times)
        # the exposed sync no rank can go below within the slowest rank's time: no rank need go
        # further (the stage's is at least its largest layer's, ``StageCost.exposed_dp_s``)
        floor = max(max(e + exposure(low), max(p[2][3] for pick in low for p in pick))
                    for r, (e, picks) in enumerate(zip(fixed_e, fastest_picks))
                    for low in [_less_exposed(picks, classes(r, time_, k), rooms[r], top - fixed[r], -math.inf)])
        # what a second more on a rank off the critical path adds to the step (its closed form's slope)
        base = closed_form_s(schedule, times, m, v)
        slopes = [(closed_form_s(schedule, times[:r] + [t + 1e-6] + times[r + 1:], m, v) - base) / 1e-6
                  for r, t in enumerate(times)]

        def lowered(r: int, room: float, k: int = k, top: float = top, floor: float = floor, slopes=slopes):
            room -= weightings[r][k][1]
            picks = least_whole(classes(r, time_, k), room, plan=True)[1]
            if picks is None:
                return None
            return _less_exposed(picks, classes(r, time_, k), room, top - fixed[r], floor - fixed_e[r], slopes[r])

        found = _fit(cm, stage_groups, names, ranks, lowered, tries=tries, dp=dp, tp=tp, mb=mb, m=m, schedule=schedule)
        if found is not None:
            yield found


def _less_exposed(picks, classes, room: float, limit_s: float, stop: float, slope: float = 0.0):
    """Blocks moved, one at a time, to choices with less sync left exposed (sync less overlap
    window), the move that gains the most first (the exposure saved down to ``stop``, less
    ``slope`` x the time it adds), while the blocks fit ``room`` and take at most ``limit_s``:
    a copy of ``picks``."""
    picks = [list(pick) for pick in picks]
    used = sum(p[0] for pick in picks for p in pick)
    busy = sum(p[2][0] for pick in picks for p in pick)
    exposed = sum(p[2][3] - p[2][7] for pick in picks for p in pick)
    while exposed > stop:
        move = None
        for k, pick in enumerate(picks):
            for p in set(pick):
                for q in classes[k][1]:
                    saved = (p[2][3] - p[2][7]) - (q[2][3] - q[2][7])
                    if saved <= 0 or used - p[0] + q[0] > room or busy - p[2][0] + q[2][0] > limit_s:
                        continue
                    net = slope * (q[2][0] - p[2][0]) - min(saved, exposed - stop)
                    if net < 0 and (move is None or net < move[0]):
                        move = (net, k, p, q)
        if move is None:
            break
        _, k, p, q = move
        picks[k][picks[k].index(p)] = q
        used, busy = used - p[0] + q[0], busy - p[2][0] + q[2][0]
        exposed -= (p[2][3] - p[2][7]) - (q[2][3] - q[2][7])
    return picks


def _fit(cm: CostModel, stage_groups, names, ranks, choose, *, tries: int, dp: int, tp: int, mb: int, m: int,
         schedule: str):
    """``mixed_layout``'s rounds for one way to ``choose`` a rank's blocks within a room:
    (choice counts per virtual stage per rank, Evaluation) of a plan that fits, or None."""
    caps = [math.inf] * len(stage_groups)  # each rank's room, cut below what it used by the evaluator's excess
    for _ in range(tries):
        stages, used = [], []
        for r, (room, _, ends) in enumerate(ranks):
            picks = choose(r, min(caps[r], room))
            if picks is None:
                return None
            used.append(sum(p[0] for pick in picks for p in pick))
            chunks = []
            for chunk, pick in zip(names[r], picks):
                layer = iter(p[2][6] for p in pick)
                chunks.append(Counter(choice_of(cm.model, ends[n] if n in ends else next(layer)) for n in chunk))
            stages.append(chunks)
        ev = evaluate_interleaved(cm, list(zip(stage_groups, stages)), dp=dp, tp=tp, micro_batch=mb,
                                  num_micro_batches=m, schedule=schedule)
        if ev.fits:
            return stages, ev
        for r, st in enumerate(ev.stages):
            if st.peak_bytes > st.capacity:
                caps[r] = used[r] - (st.peak_bytes - st.capacity) - 1
    return None
