"""A memory-aware lower bound on every interleaved plan of one grid entry.

The interleaved search (``search/interleaved.py``) splits the blocks evenly over the pp x v
virtual stages (``interleaved.chunk_names``), so each rank's blocks and virtual stages are
fixed by (pp, v, schedule); what a plan still chooses is each layer's strategy. For each rank
the least time of its blocks within its memory is a small linear programme (each block may
mix choices fractionally), over the terms of the evaluator's memory (``costs.stage``) it never
undercounts:

* every layer's static state (weights, gradients, optimizer state, and the kept compute copy
  unless the layer frees it after its backward) and the device's reserve;
* the activations of the pairs the schedule keeps in flight besides the running one
  (``StageCost.activations``): under interleaved 1F1B virtual stage c holds n_c pairs
  (``schedules.chunk_in_flight``), one fewer for the running one's, and at least
  min(1, P / (sum n - 1)) of them count when only P = in_flight - 1 do (the largest first,
  ``held_bytes``); the zero-bubble schedules charge every pair at the largest virtual stage's,
  at least the rank's mean;
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
from functools import lru_cache
from typing import Sequence

import numpy as np

from partita.cluster import NodeGroup
from partita.parallel import ZERO_BUBBLE, schedule_counts_rule
from partita.search.costs.memory import activation_message_bytes, round_up_to_grain
from partita.search.costs.model import CostModel
from partita.search.costs.stage import boundary_s
from partita.search.cpsat_fit import _hull as cpsat_hull
from partita.search.evaluate import _next_groups
from partita.search.interleaved import VARIANTS, chunk_names
from partita.search.schedules import chunk_in_flight, closed_form_s, in_flight_chunks
from partita.search.uniform import SearchSpace, replica_counts, sp_choices, strategy


def _choices(cm: CostModel, group: NodeGroup, name: str, *, tp: int, dp: int, mb: int, m: int,
             space: SearchSpace, schedule: str) -> list[tuple]:
    """(time, static bytes, activations, dp sync, optimizer, ZeRO edge, strategy) of each choice the
    schedule runs for this layer (``parallel.schedule_layers_rule``: the zero-bubble schedules
    take ZeRO 0/1 without recomputation)."""
    out = []
    zeros = space.zero_levels if dp > 1 else (0,)
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
                out.append((t.forward_s + t.backward_s, static, mem.activations, t.dp_sync_s, t.optimizer_s,
                            t.zero_edge_s, s))
    return out


def _hull(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Lower convex envelope of (memory, time) points (``cpsat_fit._hull``), as pairs."""
    xs, ys = cpsat_hull(np.array([p[0] for p in points], float), np.array([p[1] for p in points], float))
    return [(float(x), float(y)) for x, y in zip(xs, ys)]


def least_time_s(classes: Sequence[tuple[int, Sequence[tuple[float, float]]]], room: float) -> float:
    """The least total time of ``count`` blocks of each class, each block taking a (memory,
    time) point of its class or a mix of them, within ``room`` bytes together: the linear
    programme's optimum (start every block at its leanest point, then buy the cheapest time per
    byte first); inf if even the leanest do not fit."""
    used, total, steps = 0.0, 0.0, []
    for count, points in classes:
        if not count:
            continue
        if not points:
            return math.inf  # the schedule runs none of the block's choices
        hull = _hull(points)
        used += count * hull[0][0]
        total += count * hull[0][1]
        steps += [((b[1] - a[1]) / (b[0] - a[0]), count * (b[0] - a[0]), count * (b[1] - a[1]))
                  for a, b in zip(hull, hull[1:])]
    if used > room:
        return math.inf
    left = room - used
    for _, dm, dt in sorted(steps):
        take = min(1.0, left / dm)
        total += take * dt
        left -= take * dm
        if take < 1.0:
            break
    return total


def variant_bound_s(cm: CostModel, stage_groups: Sequence[NodeGroup], *, tp: int, dp: int, mb: int, m: int,
                    space: SearchSpace, schedule: str, v: int) -> float:
    """No plan of this grid entry under ``schedule`` with v virtual stages per rank, its blocks
    split evenly (``interleaved.chunk_names``), is faster than this (seconds); inf where none
    fits."""
    pp = len(stage_groups)
    names = chunk_names(cm.model.n_layers, pp, v, schedule)
    msg = activation_message_bytes(cm, mb, tp)
    kw = dict(tp=tp, dp=dp, mb=mb, m=m, space=space, schedule=schedule)

    @lru_cache(maxsize=None)
    def of(group: NodeGroup, name: str):
        return _choices(cm, group, name, **kw)

    times, edge, sync, optimizer = [], 0.0, 0.0, 0.0
    for r, group in enumerate(stage_groups):
        blocks = of(group, "layers.0")
        if not blocks or not of(group, "embed") or not of(group, "head"):
            return math.inf  # the schedule runs none of a layer's choices
        room = group.memory_bytes - cm.reserve_bytes(group)
        fixed_t = 0.0
        for end in ("embed", "head"):
            if any(end in chunk for chunk in names[r]):
                room -= min(c[1] for c in of(group, end))
                fixed_t += min(c[0] for c in of(group, end))
        pairs = in_flight_chunks(schedule, r, pp, v, m)
        room -= msg * pairs + _buffers_bytes(cm, stage_groups, names, r, schedule=schedule, tp=tp, mb=mb, m=m)
        sizes = [sum(n.startswith("layers.") for n in chunk) for chunk in names[r]]
        if schedule in ZERO_BUBBLE:  # every pair at the largest virtual stage's: at least the mean
            weights = [[(pairs - 1) / v] * v]
        else:
            held = chunk_in_flight(schedule, r, pp, v, m)
            share = min(1.0, (pairs - 1) / max(1, sum(held) - 1))
            weights = [[share * (n - (c == ranked)) for c, n in enumerate(held)] for ranked in range(v)]
        best = min(least_time_s([(size, [(c[1] + w * c[2], c[0]) for c in blocks]) for size, w in zip(sizes, ws)], room)
                   for ws in weights)
        if not math.isfinite(best):
            return math.inf
        if schedule != "interleaved-1f1b" or not cm.engine.p2p_overlap:
            fixed_t += _sides_s(cm, stage_groups, r, v, schedule, dp=dp, tp=tp, mb=mb)
        times.append(best + fixed_t)
        n_blocks = sum(sizes)
        edge = max(edge, min(c[5] for c in blocks))
        least_sync = min(c[3] for c in blocks)
        sync = max(sync, n_blocks * least_sync if schedule in ZERO_BUBBLE else least_sync)
        optimizer = max(optimizer, n_blocks * min(c[4] for c in blocks))
    return closed_form_s(schedule, times, m, v) + m * edge + sync + optimizer + cm.step_overhead_s


def _buffers_bytes(cm: CostModel, groups: Sequence[NodeGroup], names, r: int, *, schedule: str, tp: int, mb: int,
                   m: int) -> int:
    """Rank r's receive buffers and its head's logits kept in flight, as the evaluator counts
    them (``memory.pipeline_memory`` per virtual stage, ``interleaved_stage_cost``): whatever
    its layers' choices."""
    v = len(names[r])
    msg = activation_message_bytes(cm, mb, tp)
    nexts = _next_groups(schedule, groups, r, v)
    held = chunk_in_flight(schedule, r, len(groups), v, m)
    total = 0
    for c, chunk in enumerate(names[r]):
        total += m * msg * (("embed" not in chunk) + (nexts[c] is not None))
        if "head" in chunk:
            head_tp = strategy(cm.model, "head", tp=tp, sp=False, zero=0, recompute="none").tensor_parallel
            total += held[c] * round_up_to_grain(mb * cm.seq_len * (cm.model.vocab // head_tp) * cm.elem)
    return total


def _sides_s(cm: CostModel, groups: Sequence[NodeGroup], r: int, v: int, schedule: str, *, dp: int, tp: int,
             mb: int) -> float:
    """Rank r's sides of its boundaries per micro-batch: its sends and its receives, as the
    evaluator charges them (``evaluate_interleaved``); the V's turn stays on the rank."""
    b = lambda a, c: boundary_s(cm, a, c, dp=dp, tp=tp, micro_batch=mb)  # noqa: E731
    pp = len(groups)
    if schedule == "zbv":
        sends = sum(b(groups[r], n) for c, n in enumerate(_next_groups(schedule, groups, r, v))
                    if n is not None and not (c == 0 and r == pp - 1))
        return sends + sum(b(groups[j], groups[r]) for j in (r - 1, r + 1) if 0 <= j < pp)
    own = sum(b(groups[r], n) for n in _next_groups(schedule, groups, r, v) if n is not None)
    before = sum(b(groups[r - 1], n) for n in _next_groups(schedule, groups, (r - 1) % pp, v) if n is not None)
    return own + before


def entry_bounds_s(cm: CostModel, stage_groups: Sequence[NodeGroup], *, tp: int, dp: int, mb: int, m: int,
                   global_batch: int, space: SearchSpace, schedules: Sequence[str]) -> dict[tuple[str, int], float]:
    """``variant_bound_s`` for each (schedule, v) pair torch runs for this entry."""
    pp = len(stage_groups)
    shares = replica_counts(global_batch, dp, mb, m)
    return {(s, v): variant_bound_s(cm, stage_groups, tp=tp, dp=dp, mb=mb, m=m, space=space, schedule=s, v=v)
            for s, v in VARIANTS if s in schedules and pp * v <= cm.model.n_layers
            and not schedule_counts_rule(s, pp, v, shares)}


def tighten(cm: CostModel, found, *, below_us: float, global_batch: int, space: SearchSpace,
            schedules: Sequence[str], tries: int = 8) -> float:
    """The least bound over the interleaved search's grid entries (``InterleavedResult.entries``),
    each entry's work bound tightened by ``entry_bounds_s`` where it is below ``below_us`` (the
    others cannot beat that step anyway); and, for the ``tries`` (entry, schedule, v) of least
    bound below it, a plan whose blocks mix choices (``mixed_layout``), kept in ``found`` when
    it fits and beats ``found.best``."""
    bound, open_ = math.inf, []
    for cheap, entry in sorted(found.entries, key=lambda e: e[0]):
        if cheap >= min(bound, below_us):
            bound = min(bound, cheap)
            break  # sorted: no later entry is lower
        groups, tp, dp, mb, m = entry
        tight = entry_bounds_s(cm, groups, tp=tp, dp=dp, mb=mb, m=m, global_batch=global_batch, space=space,
                               schedules=schedules)
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
    as the bound's programme does, in whole blocks: each rank's blocks start at their leanest
    choice and buy the most time per byte one block at a time; a rank the evaluator finds over
    its memory is redone with the memory it took less the excess (``tries`` rounds). (InterleavedLayout,
    Evaluation) of one that fits, or None."""
    from collections import Counter

    from partita.search.costs.stage import canonical_order, choice_of
    from partita.search.evaluate import evaluate_interleaved
    from partita.search.interleaved import InterleavedLayout

    pp = len(stage_groups)
    names = chunk_names(cm.model.n_layers, pp, v, schedule)
    msg = activation_message_bytes(cm, mb, tp)
    kw = dict(tp=tp, dp=dp, mb=mb, m=m, space=space, schedule=schedule)
    caps = [math.inf] * pp  # each rank's room, cut below what it used by the evaluator's excess
    for _ in range(tries):
        stages, used = [], []
        for r, group in enumerate(stage_groups):
            blocks = _choices(cm, group, "layers.0", **kw)
            if not blocks or not all(_choices(cm, group, end, **kw) for end in ("embed", "head")):
                return None
            ends = {end: min(_choices(cm, group, end, **kw), key=lambda c: c[0])[6] for end in ("embed", "head")}
            pairs = in_flight_chunks(schedule, r, pp, v, m)
            held = (pairs - 1) / v if schedule in ZERO_BUBBLE else None
            counts = chunk_in_flight(schedule, r, pp, v, m)
            room = min(caps[r], group.memory_bytes - cm.reserve_bytes(group) - msg * pairs
                       - _buffers_bytes(cm, stage_groups, names, r, schedule=schedule, tp=tp, mb=mb, m=m))
            room -= sum(min(c[1] for c in _choices(cm, group, end, **kw)) for end in ends
                        if any(end in chunk for chunk in names[r]))
            picks, bytes_ = _whole_blocks([(sum(n.startswith("layers.") for n in chunk),
                                    [(c[1] + (held if held is not None else counts[i]) * c[2], c[0], c[6])
                                     for c in blocks]) for i, chunk in enumerate(names[r])], room)
            if picks is None:
                return None
            used.append(bytes_)
            chunks = []
            for chunk, pick in zip(names[r], picks):
                layer = iter(pick)
                chunks.append(Counter(choice_of(cm.model, ends[n] if n in ends else next(layer)) for n in chunk))
            stages.append(chunks)
        ev = evaluate_interleaved(cm, list(zip(stage_groups, stages)), dp=dp, tp=tp, micro_batch=mb,
                                  num_micro_batches=m, schedule=schedule)
        if ev.fits:
            break
        for r, st in enumerate(ev.stages):
            if st.peak_bytes > st.capacity:
                caps[r] = used[r] - (st.peak_bytes - st.capacity) - 1
    else:
        return None
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


def _whole_blocks(classes, room: float):
    """Whole-block choices per class (count, [(memory, time, strategy)]) within ``room``, and the
    memory they take: the leanest first, then one block at a time along its class's envelope,
    the most time saved per byte first; (None, 0) if the leanest do not fit."""
    hulls, level = [], []
    for count, points in classes:
        if count and not points:
            return None, 0.0
        hull = _hull([(p[0], p[1]) for p in points])
        strategies = {(p[0], p[1]): p[2] for p in points}
        hulls.append([(x, y, strategies[(x, y)]) for x, y in hull])
        level.append([0] * count)
    used = sum(len(lv) * h[0][0] for lv, h in zip(level, hulls))
    if used > room:
        return None, 0.0
    while True:
        best = None
        for c, (lv, h) in enumerate(zip(level, hulls)):
            if not lv or min(lv) + 1 >= len(h):
                continue
            i = lv.index(min(lv))
            a, b = h[lv[i]], h[lv[i] + 1]
            if used + b[0] - a[0] <= room:
                rate = (b[1] - a[1]) / (b[0] - a[0])
                if best is None or rate < best[0]:
                    best = (rate, c, i, b[0] - a[0])
        if best is None:
            break
        _, c, i, dm = best
        level[c][i] += 1
        used += dm
    return [[h[j][2] for j in lv] for lv, h in zip(level, hulls)], used
