"""Candidates with several stages per rank: the uniform grid's fastest pipelines under the
interleaved and zero-bubble schedules.

The uniform grid's fastest pipelined candidates that fit (``UniformResult.pipelined``, 16) are
tried under interleaved 1F1B and interleaved zero-bubble with v = 2 and 4 virtual stages per
rank, and under ZB-V (v = 2), where torch's schedule runs them for every replica's micro-batch
count (``parallel.schedule_counts_rule``), the runtime runs their layer choices
(``parallel.schedule_layers_rule``: the zero-bubble schedules take
ZeRO 0/1 without recomputation) and every virtual stage holds at least one block: the blocks
split as evenly as possible over the pp * v virtual stages (in the schedule's order: virtual
stage c of stage i is the model's (c * pp + i)-th slice, under ZB-V the V), every layer making
the candidate's choice, priced by the evaluator (``evaluate.evaluate_interleaved``). The planner
keeps the fastest when it beats the 1F1B plan; the grid entries' work bounds (``bound_us``,
``entries``) are tightened by memory, and plans whose blocks mix choices added, by
``interleaved_bound.tighten``.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from partita.parallel import pipeline_zero_rule, schedule_counts_rule, schedule_layers_rule, schedules_for
from partita.search.costs.model import CostModel
from partita.search.costs.stage import choice_of
from partita.search.evaluate import Evaluation, evaluate_interleaved
from partita.search.uniform import (Layout, SearchSpace, grid, replica_counts, replicated_zeros, sp_choices,
                                    split_blocks, strategy)

# The (schedule, virtual stages per rank) pairs tried.
VARIANTS = (("interleaved-1f1b", 2), ("interleaved-1f1b", 4), ("interleaved-zb", 2), ("interleaved-zb", 4),
            ("zbv", 2))


@dataclass(frozen=True, kw_only=True)
class InterleavedLayout(Layout):
    """A candidate whose stages' layers (``stage_layers``) form virtual stages of
    ``chunk_sizes[stage]`` layers each, in order, run under ``schedule``."""

    chunk_sizes: tuple[tuple[int, ...], ...]
    schedule: str = "interleaved-1f1b"

    @property
    def virtual_stages(self) -> int:
        return len(self.chunk_sizes[0])


@dataclass
class InterleavedResult:
    best: InterleavedLayout | None = None
    best_eval: Evaluation | None = None
    evaluated: int = 0
    bound_us: float = float("inf")  # no plan of the grid's shapes under any schedule is faster (seconds x 1e6)
    # Each grid entry's work bound (us) and the entry (stage groups, tp, dp, micro-batch, m):
    # ``interleaved_bound.memory_bound_us`` tightens those below a plan's step.
    entries: list = field(default_factory=list)


def place(schedule: str, g: int, pp: int) -> tuple[int, int]:
    """(stage, chunk) of the model's g-th slice: torch's stage g is chunk g // pp of stage
    g % pp, under ZB-V chunk 0 of stage g for the first pp and chunk 1 of stage 2 pp - 1 - g
    after (``Plan.virtual_stage_index``)."""
    if schedule == "zbv":
        return (g, 0) if g < pp else (2 * pp - 1 - g, 1)
    c, i = divmod(g, pp)
    return i, c


def chunk_names(n_layers: int, pp: int, v: int, schedule: str = "interleaved-1f1b") -> list[list[list[str]]]:
    """[stage][virtual stage] -> layer names, the blocks split evenly over the pp * v virtual
    stages in pipeline order (embedding on the first, head on the last)."""
    counts = split_blocks(n_layers, pp * v)
    out: list[list[list[str]]] = [[[] for _ in range(v)] for _ in range(pp)]
    start = 0
    for g, count in enumerate(counts):
        i, c = place(schedule, g, pp)
        names = [f"layers.{j}" for j in range(start, start + count)]
        start += count
        if g == 0:
            names = ["embed"] + names
        if g == pp * v - 1:
            names = names + ["head"]
        out[i][c] = names
    return out


def _counts(names: list[str], choice: dict) -> Counter:
    """How many layers of a virtual stage make each choice (every block alike)."""
    return Counter(choice["layers.0" if n.startswith("layers.") else n] for n in names)


def interleaved_search(cm: CostModel, *, global_batch: int, space: SearchSpace, candidates: list,
                       deadline: float | None = None) -> InterleavedResult:
    """The fastest variant that fits of the given pipelined uniform candidates
    (``UniformResult.pipelined``: the grid's fastest ``uniform.Candidate``s) under the schedules of
    ``VARIANTS``, and a lower bound on every such plan of the grid's shapes."""
    result = InterleavedResult()
    model = cm.model
    variants = [(schedule, v) for schedule, v in VARIANTS if schedule in schedules_for(model, space.schedules)]
    for stage_groups, tp, dp, mb, m in grid(cm, global_batch, space):
        pp = len(stage_groups)
        shares = replica_counts(global_batch, dp, mb, m)
        if pp < 2 or not any(pp * v <= model.n_layers and not schedule_counts_rule(schedule, pp, v, shares)
                             for schedule, v in variants):
            continue
        # Whatever the schedule and v and however the layers split, the step is at least m x
        # the busiest rank's time (every closed form in ``schedules.closed_form_s`` is at least
        # m max T, zero-bubble too: their fill and drain add sum T / 3v - max T / 3v >= 0), so
        # at least m x W / pp, with W the least work of one micro-batch (each layer at its
        # cheapest choice on the shape's fastest group). Memory is ignored: a valid bound.
        if not sp_choices(cm, tp, space):
            continue  # a mixture of experts at tp > 1 without sequence parallelism: no layout
        least = 0.0
        for role, name, count in (("embed", "embed", 1), ("block", "layers.0", model.n_layers), ("head", "head", 1)):
            least += count * min(cm.layer_time(role, g, strategy(model, name, tp=tp, sp=sp, zero=z, recompute=rc),
                                               dp=dp, micro_batch=mb).total_s
                                 for g in set(stage_groups) for sp in sp_choices(cm, tp, space)
                                 for z in replicated_zeros(space, dp, cm.cp) for rc in space.recompute)
        result.bound_us = min(result.bound_us, m * least / pp * 1e6)
        result.entries.append((m * least / pp * 1e6, (stage_groups, tp, dp, mb, m)))
    for _, (stage_groups, _blocks, tp, dp, mb, m, sp, zero, recompute) in candidates:
        if deadline is not None and time.perf_counter() > deadline:
            break
        pp = len(stage_groups)
        kinds = {n: strategy(model, n, tp=tp, sp=sp, zero=zero, recompute=recompute)
                 for n in ("embed", "layers.0", "head")}
        choice = {n: choice_of(model, s) for n, s in kinds.items()}
        shares = replica_counts(global_batch, dp, mb, m)
        for schedule, v in variants:
            if (pp * v > model.n_layers or schedule_counts_rule(schedule, pp, v, shares)
                    or schedule_layers_rule(schedule, ((n, s.zero, s.recompute) for n, s in kinds.items()))
                    or pipeline_zero_rule(cm.engine.name, pp, ((n, s.zero) for n, s in kinds.items()), cm.cp)):
                continue
            names = chunk_names(model.n_layers, pp, v, schedule)
            counts = [[_counts(chunk, choice) for chunk in stage] for stage in names]
            ev = evaluate_interleaved(cm, list(zip(stage_groups, counts)), dp=dp, tp=tp, micro_batch=mb,
                                      num_micro_batches=m, schedule=schedule)
            result.evaluated += 1
            if ev.fits and (result.best_eval is None or ev.step_time_s < result.best_eval.step_time_s):
                layers = tuple(tuple(strategy(model, n, tp=tp, sp=sp, zero=zero, recompute=recompute)
                                     for chunk in stage for n in chunk) for stage in names)
                result.best = InterleavedLayout(stage_groups=stage_groups, stage_layers=layers, dp=dp, tp=tp,
                                                micro_batch=mb, num_micro_batches=m,
                                                chunk_sizes=tuple(tuple(len(c) for c in stage) for stage in names),
                                                schedule=schedule)
                result.best_eval = ev
    return result
