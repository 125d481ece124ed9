"""Knapsacks over one pipeline rank's blocks, for the interleaved bound and its mixed plans
(``search/interleaved_bound.py``): each block takes one (memory, cost) choice, the blocks
together within the rank's room. ``least_whole`` weighs the activations one way at a time (a
dynamic programme over the room in ``UNITS`` parts); ``moment_least_s`` holds every moment of
the schedule at once (CP-SAT)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

UNITS = 4096  # the knapsack's memory grain: a rank's room in this many parts


def _pareto(points: Sequence[tuple]) -> list[tuple]:
    """The points no other is at most as large and as slow as, leanest first."""
    out = []
    for p in sorted(points, key=lambda p: (p[0], p[1])):
        if not out or p[1] < out[-1][1]:
            out.append(p)
    return out


def least_whole(classes: Sequence[tuple[int, Sequence[tuple]]], room: float, *, plan: bool = False):
    """The least total cost of ``count`` blocks of each class, each block taking one (memory,
    cost, ...) point of its class, within ``room`` bytes together: a knapsack over the room in
    ``UNITS`` parts. For a bound (``plan`` False) each point's memory is rounded down, so no
    choice that fits is missed; for a plan up, so what it picks fits. (total, picks: per class
    the points its blocks take; None for a bound), or (inf, None) if even the leanest do not
    fit."""
    if room < 0:
        return math.inf, None
    unit = max(room, 1.0) / UNITS
    best = np.zeros(UNITS + 1)  # least cost within u units, of the blocks so far
    steps = []
    for k, (count, points) in enumerate(classes):
        if not count:
            continue
        front = _pareto(points)
        if not front:
            return math.inf, None  # the schedule runs none of the block's choices
        need = [math.ceil(p[0] / unit - 1e-9) if plan else math.floor(p[0] / unit) for p in front]
        for _ in range(count):
            if not plan:  # a bound needs only the least cost, not which points give it
                nxt = np.full(UNITS + 1, np.inf)
                for w, p in zip(need, front):
                    if w <= UNITS:
                        np.minimum(nxt[w:], best[:UNITS + 1 - w] + p[1], out=nxt[w:])
                best = nxt
                continue
            cand = np.full((len(front), UNITS + 1), np.inf)
            for j, (w, p) in enumerate(zip(need, front)):
                if w <= UNITS:
                    cand[j, w:] = best[:UNITS + 1 - w] + p[1]
            arg = cand.argmin(axis=0)
            best = cand[arg, np.arange(UNITS + 1)]
            steps.append((k, front, need, arg))
    if not math.isfinite(best[UNITS]):
        return math.inf, None
    if not plan:
        return float(best[UNITS]), None
    picks: dict[int, list] = {k: [] for k in range(len(classes))}
    u = UNITS
    for k, front, need, arg in reversed(steps):
        j = int(arg[u])
        picks[k].append(front[j])
        u -= need[j]
    return float(best[UNITS]), [picks[k] for k in range(len(classes))]


def least_time_s(classes: Sequence[tuple[int, Sequence[tuple[float, float]]]], room: float) -> float:
    """``least_whole``'s bound: the least total time of the blocks within ``room`` (inf if the
    leanest do not fit)."""
    return least_whole(classes, room)[0]


# moment_least_s's memory grain (a rank's room in this many parts) and the deterministic work
# CP-SAT may spend on one rank (its models are a few dozen integers; its bound is valid unproven)
MOMENT_UNITS = 1 << 16
MOMENT_WORK = 1.0


def moment_least_s(blocks, sizes, moments, ends_act, room: float) -> float:
    """A rank's least blocks' time with every moment of its schedule within ``room`` at once:
    each virtual stage's count of each choice an integer, and at each moment (pairs held per
    virtual stage, bytes held besides) the blocks' static state, their activations times the
    pairs held, the end layers' leanest activations and those bytes within the room (the terms
    of ``_rank_terms``' weightings, one moment each, all together here). Every coefficient is
    rounded down and the time too, so it is a lower bound; CP-SAT's best bound when its work
    runs out (one worker: deterministic). inf where nothing fits."""
    from ortools.sat.python import cp_model

    if room <= 0:
        return math.inf
    front = [c for c in blocks if not any(o[0] <= c[0] and o[1] <= c[1] and o[2] <= c[2]
                                          and (o[0], o[1], o[2]) != (c[0], c[1], c[2]) for o in blocks)]
    unit = room / MOMENT_UNITS
    md = cp_model.CpModel()
    x = [[md.NewIntVar(0, size, "") for _ in front] for size in sizes]
    for c, size in enumerate(sizes):
        md.Add(sum(x[c]) == size)
    for vec, extra in moments:
        fixed = extra + sum(n * e for n, e in zip(vec, ends_act))
        md.Add(sum(int((p[1] + n * p[2]) // unit) * x[c][j] for c, n in enumerate(vec) for j, p in enumerate(front))
               <= math.floor((room - fixed) / unit))
    scale = 1e7  # 0.1 microseconds
    md.Minimize(sum(math.floor(p[0] * scale) * x[c][j] for c in range(len(sizes)) for j, p in enumerate(front)))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = MOMENT_WORK
    status = solver.Solve(md)
    if status == cp_model.INFEASIBLE:
        return math.inf
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return 0.0  # nothing proven within the work
    return solver.BestObjectiveBound() / scale
