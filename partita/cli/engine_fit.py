"""``partita plan --engine megatron|torchtitan|deepspeed``: a plan the engine runs as it is.

The search prices every plan as the engine runs it (``search/engines.py``) but chooses among
Partita's whole space: per-layer strategies, ZeRO levels and schedules an engine may not express
(Megatron sets tensor parallelism, ZeRO and recomputation once for all layers; torchtitan has no
ZeRO-1; DeepSpeed's pipeline runs 1F1B on an even split). So for another engine the plan command
maps the search's best plan, and the best plans of a few other shapes, to the closest plan the
engine runs in each shape (the export's own variants: ``partita.cli.export.export_plan``),
priced as the engine runs it, and keeps the fastest that fits. The search's best uniform plan
(every layer the same strategy, which an engine sets once for all layers) is one more candidate
(``uniform_candidate``): the mapping must never return a plan slower than one the search priced
and the engine runs. Its export is then the plan itself (``partita export`` says "expresses the
plan exactly").

The search's bound stays a true lower bound (the engine's plans are a subset of the space it
covers), so the plan's gap is measured from it; the proof no longer says "optimal" unless the
search's optimum was itself expressible.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from partita.errors import InfeasibleError, PartitaError
from partita.plan import Plan

# Other shapes whose best plans are mapped too, beyond the search's best.
SHAPES = 3


def uniform_candidate(cm, plan: Plan, uni) -> Plan | None:
    """The uniform grid's best layout (``search.uniform.UniformResult.best``) of the view ``plan``
    was found on (``cm`` at the plan's ep), as a plan; None under context parallelism, whose views
    a plan does not say enough to rebuild, or when the grid found none."""
    from partita.search.plans import layout_to_plan

    if uni is None or uni.best is None or plan.cp > 1:
        return None
    view = cm.at_ep(plan.ep, plan.moe_imbalance) if cm.model.is_moe else cm
    return layout_to_plan(view, uni.best, global_batch=plan.global_batch, solver=None)


def engine_uniform(req, plan: Plan) -> Plan | None:
    """The uniform grid's best plan inside the request's options and the uniform plans the engine
    runs as they are (its export module's ``UNIFORM_SPACE``), one more candidate where the grid's
    own best is not one of them (DeepSpeed: a selectively recomputed uniform plan); None where the
    engine declares no such space, the space is empty, the plan was found at cp > 1 or on a
    mixture's expert view, or nothing there fits."""
    from partita.cli.export import target_module
    from partita.search.planner import cost_model
    from partita.search.plans import layout_to_plan
    from partita.search.uniform import uniform_search

    narrower = getattr(target_module(req.engine), "UNIFORM_SPACE", None)
    if narrower is None or plan.cp > 1 or req.model.is_moe:
        return None
    fields = {k: tuple(v for v in getattr(req.space, k) if v in allowed) if getattr(req.space, k) else allowed
              for k, allowed in narrower.items()}
    if not all(fields.values()):
        return None
    cm = cost_model(req)
    uni = uniform_search(cm, global_batch=req.global_batch, space=dataclasses.replace(req.space, **fields))
    return layout_to_plan(cm, uni.best, global_batch=req.global_batch, solver=None) if uni.best else None


def restrict_to_engine(plan: Plan, engine: str, alternatives: Callable[[int], list[Plan]],
                       profiles=(), space=None) -> tuple[Plan, str]:
    """The fastest plan ``engine`` runs as it is, among the closest ones in the shapes of
    ``plan`` and of ``alternatives(SHAPES)``, inside ``space`` (the request's ``SearchSpace``:
    an engine's closest plan never takes a ZeRO level, recompute mode or degree the options
    left out); and a note of what changed (empty if nothing did)."""
    from partita.cli.export import export_plan

    exports, refusals = [], []

    def consider(candidate: Plan):
        try:
            ex = export_plan(candidate, engine, profiles=profiles, space=space)
        except PartitaError as e:  # this shape is not one the engine runs (e.g. cp with tp on DeepSpeed)
            refusals.append(" ".join(str(e).split()))
            return None
        if ex.fits:
            exports.append(ex)
        return ex

    first = consider(plan)
    if first is None or first.changes or not first.fits:  # else the search's best is the engine's: nothing beats it
        for candidate in alternatives(SHAPES):
            consider(candidate)
    if not exports:
        why = f" ({refusals[0]})" if refusals else ""
        given = space.options() if space is not None else ""
        inside = f" inside {given}" if given else ""
        loosen = "loosen those options, " if given else ""
        raise InfeasibleError(f"--engine {engine}: no plan {engine} runs fits{inside} in the {1 + SHAPES} best shapes "
                              f"the search found{why}; {loosen}drop --engine to see Partita's own plan, or give more "
                              f"devices")
    best = min(exports, key=lambda ex: ex.exported.prediction.step_time_s)
    chosen = best.exported
    if plan.solver is not None:
        objective = round(chosen.prediction.step_time_s * 1e6)
        bound = min(plan.solver.bound_us, objective)
        exact = not best.changes and best.original.ranks == plan.ranks and best.original.stages == plan.stages
        status = plan.solver.status if exact else "feasible"
        chosen = dataclasses.replace(chosen, solver=dataclasses.replace(
            plan.solver, status=status, objective_us=objective, bound_us=bound,
            gap=(objective - bound) / objective if objective else 0.0))
    if not best.changes and best.original.stages == plan.stages:
        return chosen, ""
    moved = "; ".join(best.changes) if best.changes else "another shape"
    return chosen, (f"--engine {engine}: the search's best plan is not one {engine} runs as it is; this is the fastest "
                    f"that {engine} runs and fits ({moved}), {chosen.prediction.step_time_s / plan.prediction.step_time_s - 1:+.1%} "
                    f"against the search's best")
