"""From a model, a cluster and profiles to a validated plan: the glue behind `partita plan`."""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from partita import parallel
from partita.cluster import ClusterSpec
from partita.errors import InfeasibleError, PartitaError
from partita.model import ModelSpec
from partita.parallel import CP_VARIANTS
from partita.plan import ContextOption, Plan, SolverReport
from partita.profile import Profile
from partita.search.costs.compute import default_dtype
from partita.search.costs.model import CostModel
from partita.search.engines import get_engine
from partita.search.evaluate import evaluate_plan
from partita.search.plans import (SAFETY_WALL_S, SearchTimeout, attach_prediction, interleaved_to_plan, layout_to_plan,
                                  timeout_error)
from partita.search.infeasible import infeasible_error
from partita.search.uniform import SearchSpace, UniformResult, uniform_search
from partita.units import to_us

log = logging.getLogger(__name__)

# The default stop is work, not wall time, so the same input gives the same plan on a busy
# machine and an idle one: CP-SAT's deterministic time (roughly a second of one core's work
# per unit), summed over every shape solved. The benchmark instances
# (benchmarks/search_targets.py) prove optimality within about 1 unit; the hardest shape seen
# (llama-2-70b on 1x8xH100+4x8xL4) within 7.2, and a shape's first attempt gets a quarter.
DEFAULT_WORK_LIMIT = 30.0


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: ModelSpec
    cluster: ClusterSpec
    seq_len: int
    global_batch: int
    profiles: tuple[Profile, ...] = ()
    dtype: str | None = None
    search: str = "cpsat"  # or "uniform"
    # A wall-clock bound on the whole search (grid, model building, solving); None: the
    # deterministic work limit alone decides (with the SAFETY_WALL_S bound).
    time_limit_s: float | None = None
    # CP-SAT deterministic time over all shapes; None: DEFAULT_WORK_LIMIT, or time_limit_s if
    # that is larger (a longer limit buys more search).
    work_limit: float | None = None
    # Stop once the plan is proven within this fraction of the optimum (0: prove it optimal).
    gap: float = 0.0
    workers: int = 1
    seed: int = 0
    space: SearchSpace = field(default_factory=SearchSpace)
    # Context-parallel degrees to search (1 included to compare against no cp); empty: 1, and
    # for long sequences every degree a node allows (``context_options``).
    context_parallel: tuple[int, ...] = ()
    cp_variant: str | None = None  # "all_to_all" or "ring"; None: all-to-all where the heads allow it
    # Expert-parallel degrees to search for a mixture-of-experts model (1 included to compare);
    # empty: every degree that divides the experts and fits a node (``expert_options``).
    expert_parallel: tuple[int, ...] = ()
    # The busiest expert-parallel rank's tokens over the balanced share (docs/moe.md); 1: balanced.
    moe_imbalance: float = 1.0
    # The engine that will run the plan (search/engines.py): the search prices plans as it runs them.
    engine: str = "partita"
    fp8: bool = False  # the blocks' products in FP8 (``Plan.fp8``; parallel.fp8_rule says where)


# Bounds far above any real run, so that an absurd number is refused at once instead of sizing
# the search by it: Llama 3 405B trained on 2,048 sequences a step, the longest published
# contexts are about a million tokens; CP-SAT's random_seed is a 32-bit signed integer.
MAX_GLOBAL_BATCH = 1 << 20
MAX_SEQ_LEN = 1 << 24
MAX_SEED = (1 << 31) - 1


def check_numbers(seq_len: int, global_batch: int, seed: int = 0) -> None:
    """The request's numbers within the bounds above; each refusal one line naming the flag."""
    if not 1 <= seq_len <= MAX_SEQ_LEN:
        raise PartitaError(f"--seq-len must be between 1 and {MAX_SEQ_LEN:,} tokens, got {seq_len:,}")
    if not 1 <= global_batch <= MAX_GLOBAL_BATCH:
        raise PartitaError(f"--global-batch must be between 1 and {MAX_GLOBAL_BATCH:,} sequences, got {global_batch:,}")
    if not 0 <= seed <= MAX_SEED:
        raise PartitaError(f"--seed must be between 0 and {MAX_SEED:,} (CP-SAT's seed is a 32-bit integer), "
                           f"got {seed:,}")


def check_request(req: PlanRequest) -> None:
    check_numbers(req.seq_len, req.global_batch, req.seed)
    if req.model.family == "gpt2" and req.seq_len > req.model.seq_len:
        raise PartitaError(f"{req.model.name} learns {req.model.seq_len} positions; --seq-len {req.seq_len} is longer")
    if req.search not in ("cpsat", "uniform"):
        raise PartitaError(f"--search {req.search!r}: choose cpsat or uniform")
    dtype = req.dtype or default_dtype(req.cluster)  # the validator's FP8 rule, asked before the search
    if why := req.fp8 and parallel.fp8_rule(req.engine, dtype, req.cluster.groups, moe=req.model.is_moe):
        raise PartitaError(f"--fp8: {why}")
    if req.time_limit_s is not None and req.time_limit_s <= 0:
        raise PartitaError(f"--time-limit must be > 0 seconds, got {req.time_limit_s}")
    if not 0 <= req.gap < 1:
        raise PartitaError(f"--gap must be a fraction in [0, 1) (e.g. 0.01 for 1 %), got {req.gap:g}")
    if req.cp_variant is not None and req.cp_variant not in CP_VARIANTS:
        raise PartitaError(f"--cp-variant {req.cp_variant!r}: choose {' or '.join(CP_VARIANTS)}")
    if any(cp < 1 for cp in req.context_parallel):
        raise PartitaError(f"--cp degrees must be >= 1, got {list(req.context_parallel)}")
    if any(ep < 1 for ep in req.expert_parallel):
        raise PartitaError(f"--ep degrees must be >= 1, got {list(req.expert_parallel)}")
    if not 1.0 <= req.moe_imbalance < math.inf:
        raise PartitaError(f"--moe-imbalance is the busiest rank's tokens over the mean: a finite number >= 1, "
                           f"got {req.moe_imbalance:g}")
    for schedule in req.space.schedules:
        if schedule not in parallel.SCHEDULES:
            raise PartitaError(f"--schedule {schedule!r}: choose from {', '.join(parallel.SCHEDULES)}")
        why = parallel.schedule_model_rule(schedule, req.model)
        if why:
            raise PartitaError(f"--schedule {schedule}: {why}")
    tps = req.space.tensor_parallel
    if req.model.is_moe and tps and min(tps) > 1:  # every degree asked for needs sequence parallelism
        block = req.model.kinds["block"]
        why = next((parallel.moe_tp_rule(block, t, False) for t in tps), None)
        if True not in req.space.sequence_parallel:
            raise PartitaError(f"--tp {','.join(map(str, tps))}: {why}; drop --no-sequence-parallel or add --tp 1")
        cps = req.context_parallel or (1,)
        if all(parallel.sequence_parallel_rule(req.seq_len // cp, t) for t in tps for cp in cps):
            raise PartitaError(f"--tp {','.join(map(str, tps))}: {why}, which splits each rank's "
                               f"{req.seq_len // min(cps)} tokens of a sequence tp ways; choose a sequence length "
                               "tp divides, or add --tp 1")
    if req.expert_parallel and req.expert_parallel != (1,) and not req.model.is_moe:
        raise PartitaError(f"--ep: {req.model.name} is not a mixture-of-experts model; expert parallelism needs one")
    if req.work_limit is not None and req.work_limit <= 0:
        raise PartitaError(f"the work limit must be > 0, got {req.work_limit}")


def work_limit(req: PlanRequest) -> float:
    """The CP-SAT deterministic-time budget of the request."""
    if req.work_limit is not None:
        return req.work_limit
    return max(DEFAULT_WORK_LIMIT, req.time_limit_s or 0.0)


def _interleaved(cm: CostModel, req: PlanRequest, uni: UniformResult, deadline: float):
    """The interleaved schedules' search over the grid's fastest pipelines, or None where the
    request leaves no other schedule (no pipelines, or 1F1B alone)."""
    from partita.search.interleaved import interleaved_search
    if (req.space.pipeline and max(req.space.pipeline) < 2) or req.space.schedules == ("1f1b",):
        return None
    return interleaved_search(cm, global_batch=req.global_batch, space=req.space, candidates=uni.pipelined,
                              deadline=deadline)


def _consider_interleaved(cm: CostModel, req: PlanRequest, plan: Plan, uni: UniformResult, deadline: float,
                          found=None) -> Plan:
    """The grid's fastest pipelines under the other schedules (``search/interleaved.py``) replace a
    slower 1F1B plan. Their bound (``interleaved_bound``) and the 1F1B search's within the gap prove
    the plan over every schedule; the 1F1B search's alone, among 1F1B plans (``proven_among``)."""
    from partita.search.interleaved_bound import tighten
    pinned = req.space.schedules
    found = found if found is not None else _interleaved(cm, req, uni, deadline)
    if found is None:
        return plan  # no pipelines (every schedule is the same), or 1F1B alone asked for
    forced = bool(pinned) and "1f1b" not in pinned  # the 1F1B plan is no answer
    if forced and found.best is None:
        raise InfeasibleError(f"no pipeline of {cm.model.name} on {req.cluster.short} runs under --schedule "
                              f"{','.join(pinned)} and fits (tried the {len(uni.pipelined)} fastest uniform "
                              f"pipelines); add 1f1b to --schedule, or allow more stages or micro-batches")
    old = plan.solver
    beat = [e.step_time_s * 1e6 for e in (plan.prediction if not forced else None, found.best_eval) if e is not None]
    il_bound = tighten(cm, found, below_us=min(beat, default=math.inf), global_batch=req.global_batch,
                       space=req.space, schedules=parallel.schedules_for(cm.model, pinned))
    keep = not forced and (found.best is None or plan.prediction is None or
                           found.best_eval.step_time_s >= plan.prediction.step_time_s)
    if keep:
        if old is None or il_bound >= old.bound_us or old.status == "exhaustive":
            return plan
        if old.status == "optimal" and il_bound < old.objective_us * (1 - req.gap):  # proven among 1F1B's
            return dataclasses.replace(plan, solver=dataclasses.replace(old, proven_among="1f1b"))
        gap = round((old.objective_us - int(il_bound)) / old.objective_us, 6) if old.objective_us else 0.0
        return dataclasses.replace(plan, solver=dataclasses.replace(old, bound_us=int(il_bound), gap=gap))
    if old is None:
        return interleaved_to_plan(cm, found.best, global_batch=req.global_batch, solver=None)
    objective = to_us(found.best_eval.step_time_s)
    bound = min(old.bound_us, int(il_bound), objective)
    proven = old.method != "uniform" and old.status == "optimal" and objective - bound <= req.gap * objective
    report = dataclasses.replace(old, status="optimal" if proven else "feasible", objective_us=objective,
                                 bound_us=bound, gap=round((objective - bound) / objective, 6) if objective else 0.0,
                                 candidates=old.candidates + found.evaluated, proven_among="")
    return interleaved_to_plan(cm, found.best, global_batch=req.global_batch, solver=report)


def _consider_replicas(cm: CostModel, req: PlanRequest, plan: Plan) -> Plan:
    """Whole replicas on two or more device types, the faster taking larger micro-batches
    (``search/replicas.py``): the fastest found replaces the plan when it is faster. That
    search covers its space exactly when it ends within its budget, so the plan's bound is then
    the lower of CP-SAT's bound over its space and the replica space's optimum; else the bound
    that holds for every plan on the cluster (``replicas.throughput_bound_s``) stands in for the
    replica space."""
    from partita.search.replicas import replica_plan, replica_search, throughput_bound_s

    if req.space.micro_batches or plan.prediction is None or plan.solver is None:
        return plan  # micro-batch sizes are the search's lever: a fixed size leaves it nothing
    found = replica_search(cm, global_batch=req.global_batch, space=req.space,
                           incumbent_s=plan.prediction.step_time_s)
    if found.best is None:
        return plan
    candidate = replica_plan(cm, found.best, plan)
    ev = evaluate_plan(candidate, cm)
    if not ev.fits:
        return plan
    candidate = attach_prediction(candidate, cm, ev)
    if candidate.prediction.step_time_s >= plan.prediction.step_time_s:
        return plan
    objective = to_us(candidate.prediction.step_time_s)
    replicas_bound_us = to_us(found.best.step_time_s) if found.complete else int(
        throughput_bound_s(cm, req.global_batch) * 1e6)
    bound = min(plan.solver.bound_us, objective, replicas_bound_us)
    # Proven when CP-SAT proved its space and the replica search covered its own; among 1F1B
    # plans still, where the other schedules could not be ruled out (``proven_among``).
    proven = found.complete and plan.solver.status == "optimal"
    status = "optimal" if proven and bound == objective else "feasible"
    report = dataclasses.replace(plan.solver, status=status, objective_us=objective, bound_us=bound,
                                 gap=round((objective - bound) / objective, 6) if objective else 0.0,
                                 candidates=plan.solver.candidates + found.evaluated)
    return dataclasses.replace(candidate, solver=report)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused (and resumed after): a search allocates millions
    of short-lived objects that reference counting frees, and the collector's passes over them
    find little but cost 15-25 % of a large search's CPU (the benchmark's instances, timed with
    and without it by a one-off script not kept, median of three runs each: the mixed-cluster
    instance 10.7 -> 9.0 s, gpt3-175b 3.4 -> 2.6 s; peak memory +220 MB)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def make_plan(req: PlanRequest, progress: Callable[[str], None] | None = None, *,
              cost_model: CostModel | None = None) -> tuple[Plan, UniformResult]:
    """Run the search the request asks for and return a validated plan and the uniform result
    (with the garbage collector paused: ``collector_paused``). ``cost_model``: the request's own
    (``cost_model(req)``), kept by a caller that runs several searches of one request."""
    with collector_paused():
        return _make_plan(req, progress, cost_model)


def cost_model(req: PlanRequest) -> CostModel:
    """The cost model of a request's model, cluster, sequence, dtype, profiles and engine."""
    return CostModel(req.model, req.cluster, seq_len=req.seq_len, dtype=req.dtype, profiles=req.profiles,
                     engine=get_engine(req.engine, req.fp8))


def _make_plan(req: PlanRequest, progress: Callable[[str], None] | None = None,
               cm: CostModel | None = None) -> tuple[Plan, UniformResult]:
    """Run the search the request asks for and return a validated plan and the uniform result.

    The dimensions that change what a rank is (context parallelism: a rank of the search is a
    cp group; expert parallelism: the experts an ep group shares) are searched one value at a
    time (``dimension_options``): the search runs on that value's view of the cost model
    (``CostModel.at_cp``, ``at_ep``) and the fastest plan over the values wins. Each search is
    exact for its value, so the winner is proven optimal over them only if every one was (a
    value with no plan proven infeasible); under cp its report lists every degree's best
    (``SolverReport.context_parallel``)."""
    from partita.validate import validate_plan

    check_request(req)
    start = time.perf_counter()
    deadline = start + (req.time_limit_s if req.time_limit_s is not None else SAFETY_WALL_S)
    cm = cm or cost_model(req)
    options = dimension_options(req, cm)
    if len(options) == 1 and options[0] == Dimensions() and not req.model.is_moe:
        plan, uni = _search(cm, req, deadline, progress)
        validate_plan(plan, req.model, req.cluster)
        return plan, uni
    found: list[tuple[Plan, UniformResult]] = []
    compared: list[ContextOption] = []
    failure: PartitaError | None = None
    complete = True  # every value searched
    for opt in options:
        if found and time.perf_counter() > deadline:
            complete = False
            break
        space = _option_space(req, opt)
        if space is None:  # no tensor-parallel degree fits beside cp in a node: nothing to search
            if any(o.cp == opt.cp and o.span_tp for o in options):
                continue  # cp groups across nodes are searched at this degree instead
            compared.append(ContextOption(cp=opt.cp, variant=opt.variant, fits=False, status="infeasible"))
            failure = failure or InfeasibleError(_no_cp_layout(req, opt.cp, opt.variant))
            continue
        view = cm.at_cp(opt.cp, opt.variant, opt.span_tp).at_ep(opt.ep, req.moe_imbalance)
        sub = dataclasses.replace(req, space=space)
        tag = opt.tag(req.model.is_moe)
        try:
            plan, uni = _search(view, sub, deadline, (lambda what: progress(what + tag)) if progress else None)
        except (InfeasibleError, SearchTimeout) as e:
            compared.append(ContextOption(cp=opt.cp, variant=opt.variant, fits=False,
                                          status="infeasible" if isinstance(e, InfeasibleError) else "timeout"))
            if opt is options[0] or failure is None:  # the first value's reason (cp 1, ep 1) is the one to show
                failure = e
            continue
        log.info("%s: %.3f s a step (%s)", tag.strip(" ()"), plan.prediction.step_time_s,
                 plan.solver.status if plan.solver else "")
        found.append((plan, uni))
        compared.append(_context_option(plan))
    if not found:
        assert failure is not None
        raise failure
    plan, uni = min(found, key=lambda t: t[0].prediction.step_time_s)
    if req.model.is_moe:  # each cp degree's best over the ep degrees
        compared = _best_per_cp(compared)
    plan = dataclasses.replace(plan, solver=_over_options(plan.solver, [p.solver for p, _ in found], compared,
                                                          complete=complete, list_cp=any(o.cp > 1 for o in options)))
    validate_plan(plan, req.model, req.cluster)
    return plan, uni


@dataclass(frozen=True)
class Dimensions:
    """One value of the dimensions searched value by value: a context-parallel degree with its
    variant, and an expert-parallel degree."""

    cp: int = 1
    variant: str = "all_to_all"
    ep: int = 1
    span_tp: int = 0  # cp groups that span nodes at this tp (``context.cluster_view``); 0: inside a node

    def tag(self, moe: bool) -> str:
        """How progress lines and the log name this value."""
        across = f", tp {self.span_tp} across nodes" if self.span_tp else ""
        cp = f"cp {self.cp}, {self.variant.replace('_', '-')}{across}" if self.cp > 1 else "cp 1"
        if moe:
            return f" (ep {self.ep})" if self.cp == 1 else f" (ep {self.ep}, {cp})"
        return f" ({cp})"


def dimension_options(req: PlanRequest, cm: CostModel) -> list[Dimensions]:
    """The values to search, the plainest first: the context-parallel degrees
    (``context_options``), each with a mixture of experts' expert-parallel degrees
    (``expert_options``)."""
    eps = expert_options(req) if req.model.is_moe else [1]
    return [Dimensions(cp=cp, variant=variant, span_tp=span, ep=ep) for cp, variant in context_options(req, cm)
            for span in _cp_spans(req, cp)
            if not span or req.context_parallel or _spans_reach(req, cp, span)
            for ep in eps]


def _best_per_cp(compared: list[ContextOption]) -> list[ContextOption]:
    """Of several values at one context-parallel degree and variant (a mixture of experts' ep
    degrees), the best that fits, in the order first searched."""
    best: dict[tuple[int, str], ContextOption] = {}
    for o in compared:
        key = (o.cp, o.variant)
        old = best.get(key)
        if old is None or (o.fits and (not old.fits or o.objective_us < old.objective_us)):
            best[key] = o
    return list(best.values())


def _reaching_degrees(req: PlanRequest) -> list[int]:
    """For the free search of a long sequence: the cp degrees over several nodes that let a
    global batch too small to fill the cluster reach it (dp x pp <= the global batch, so at most
    global batch x tp x cp devices): for each tp dividing the node, the least power of two cp with
    tp x cp x global batch >= the devices, when that cp x tp spans nodes. None when cp inside a
    node already reaches every device."""
    gpn = min(g.gpus_per_node for g in req.cluster.groups)
    total = req.cluster.world_size
    if req.global_batch * gpn >= total:
        return []
    out = set()
    for tp in (t for t in range(1, gpn + 1) if gpn % t == 0):
        cp = 1
        while tp * cp * req.global_batch < total:
            cp *= 2
        if tp * cp > gpn and req.seq_len % (2 * cp) == 0:
            out.add(cp)
    return sorted(out)


def _spans_reach(req: PlanRequest, cp: int, span_tp: int) -> bool:
    """A free search's view of cp groups over nodes at tp ``span_tp`` is searched only where it
    is the least cp at that tp that reaches every device (``_reaching_degrees``)."""
    total = req.cluster.world_size
    return cp * span_tp * req.global_batch >= total > cp // 2 * span_tp * req.global_batch


def _cp_spans(req: PlanRequest, cp: int) -> list[int]:
    """The views to search at cp: 0 (cp groups inside a node) where cp divides every group's
    GPUs per node, and each tensor-parallel degree whose cp x tp group spans whole nodes of some
    group (``parallel.cp_locality_rule``): of ``--tp`` if given, else every degree dividing a node."""
    if cp == 1:
        return [0]
    gpns = [g.gpus_per_node for g in req.cluster.groups]
    spans = [0] if all(n % cp == 0 for n in gpns) else []
    tps = req.space.tensor_parallel or tuple(t for t in range(1, min(gpns) + 1) if min(gpns) % t == 0)
    spans += [t for t in sorted(set(tps)) if any(cp * t > n for n in gpns)
              and all(parallel.cp_locality_rule(cp, t, n) is None for n in gpns)
              and any(g.nodes >= parallel.cp_nodes(cp, t, g.gpus_per_node) for g in req.cluster.groups)]
    return spans


def _option_space(req: PlanRequest, opt: Dimensions) -> SearchSpace | None:
    """The search space at one value (None: nothing to search). Under expert parallelism every
    replica runs the same micro-batches
    (``parallel.ep_shares_rule``); under cp the tensor-parallel degrees the variant can split
    (``_cp_space``)."""
    space = _cp_space(req, opt.cp, opt.variant, opt.span_tp)
    if space is not None and req.model.is_moe:
        return dataclasses.replace(space, even_shares=opt.ep > 1)
    return space


def expert_options(req: PlanRequest) -> list[int]:
    """The expert-parallel degrees to search, 1 first: the request's (``--ep``), else every
    degree that divides the experts and the smallest node group's GPUs per node (the ep group
    inside a node: its all-to-alls on NVLink)."""
    experts = req.model.experts
    gpn = min(g.gpus_per_node for g in req.cluster.groups)
    if req.expert_parallel:
        for ep in req.expert_parallel:
            if experts % ep:
                raise PartitaError(f"--ep {ep}: the expert-parallel degree must divide the {experts} experts")
        return sorted(set(req.expert_parallel))
    return [ep for ep in range(1, min(experts, gpn) + 1) if experts % ep == 0 and gpn % ep == 0]


# Sequences from this length on are long enough for context parallelism to pay (the
# activations grow with s, the attention with s^2): the planner then also searches cp > 1. Shorter
# ones plan as before, unless the request names cp degrees (``--cp``).
CP_MIN_SEQ_LEN = 16384


def context_options(req: PlanRequest, cm: CostModel) -> list[tuple[int, str]]:
    """The (cp, variant) pairs to search, cp 1 first. Named degrees (``PlanRequest.context_parallel``)
    or, for long sequences (``CP_MIN_SEQ_LEN``), every degree > 1 that divides each node group's
    GPUs per node (cp groups stay inside a node) and the sequence. Variants: the request's, else
    each one the rules allow at the smallest tp, searched apart and compared by the engine's price
    (all-to-all where the model's heads and kv heads allow it; the all-gather for any heads, the
    sequence in 2 cp chunks; the ring on GPUs, for a sequence divisible by 2 cp)."""
    if req.context_parallel:
        degrees = sorted(set(req.context_parallel))
    elif req.seq_len >= CP_MIN_SEQ_LEN:
        gpn = min(g.gpus_per_node for g in cm.cluster.groups)
        degrees = [1] + [d for d in range(2, gpn + 1) if gpn % d == 0] + _reaching_degrees(req)
    else:
        degrees = [1]
    block = cm.model.kinds["block"]
    tp0 = min(req.space.tensor_parallel) if req.space.tensor_parallel else 1  # the variant must split its blocks
    out = []
    for cp in degrees:
        if cp == 1:
            out.append((1, "all_to_all"))
            continue
        if not _cp_spans(req, cp) or req.seq_len % cp:
            if req.context_parallel:
                raise PartitaError(f"--cp {cp}: a cp group sits inside a node or spans whole nodes, and cp splits the "
                                   f"sequence evenly; choose cp dividing the GPUs per node "
                                   f"({', '.join(str(g.gpus_per_node) for g in cm.cluster.groups)}) or cp x tp a "
                                   f"multiple of them, and cp dividing the sequence length {req.seq_len}")
            continue
        variants = (req.cp_variant,) if req.cp_variant else ("all_to_all", "all_gather", "ring")
        runnable = [v for v in variants if not (v == "ring" and cm.cluster.is_cpu)
                    and parallel.cp_rule(block, cp, tp=tp0, variant=v, seq_len=req.seq_len) is None]
        if not runnable and req.context_parallel:
            why = parallel.cp_rule(block, cp, tp=tp0, variant=variants[0], seq_len=req.seq_len) or "the ring runs on GPUs only"
            raise PartitaError(f"--cp {cp}: {why}")
        out += [(cp, variant) for variant in runnable]
    return out


def _cp_space(req: PlanRequest, cp: int, variant: str, span_tp: int = 0) -> SearchSpace | None:
    """The search space at cp: tensor-parallel degrees whose blocks the variant can split cp x tp
    ways (``parallel.cp_rule``) and whose cp x tp group fits a node (``parallel.cp_locality_rule``),
    or with ``span_tp`` that degree alone (its cp groups span nodes); None when no degree is left."""
    if cp == 1:
        return req.space
    block = req.model.kinds["block"]
    gpn = min(g.gpus_per_node for g in req.cluster.groups)
    candidates = (span_tp,) if span_tp else tuple(t for t in range(1, gpn + 1)
                                                  if all(g.gpus_per_node % (cp * t) == 0 for g in req.cluster.groups))
    allowed = tuple(t for t in candidates
                    if all(parallel.cp_locality_rule(cp, t, g.gpus_per_node) is None for g in req.cluster.groups)
                    and parallel.cp_rule(block, cp, tp=t, variant=variant, seq_len=req.seq_len) is None
                    and (not req.space.tensor_parallel or t in req.space.tensor_parallel))
    return dataclasses.replace(req.space, tensor_parallel=allowed) if allowed else None


def _no_cp_layout(req: PlanRequest, cp: int, variant: str) -> str:
    """Why no tensor-parallel degree runs beside context parallelism of degree cp."""
    gpn = min(g.gpus_per_node for g in req.cluster.groups)
    tps = req.space.tensor_parallel or (1,)
    most = max(g.nodes for g in req.cluster.groups)
    span = parallel.cp_nodes(cp, min(tps), gpn)
    why = (parallel.cp_locality_rule(cp, min(tps), gpn)
           or (f"a cp x tp group of {cp} x {min(tps)} = {cp * min(tps)} ranks spans {span} nodes and no node group "
               f"has more than {most}" if span > most else None)
           or parallel.cp_rule(req.model.kinds["block"], cp, tp=min(tps), variant=variant, seq_len=req.seq_len)
           or f"no tensor-parallel degree of --tp {','.join(map(str, tps))} runs beside it")
    return (f"no plan of {req.model.name} at cp {cp} ({variant.replace('_', '-')}) on {req.cluster.short}: {why}; "
            f"choose a smaller --cp or --tp")


def _context_option(plan: Plan) -> ContextOption:
    pred = plan.prediction
    fullest = max(pred.memory, key=lambda m: m.peak_bytes / m.capacity_bytes)
    return ContextOption(cp=plan.cp, variant=plan.cp_variant, fits=True, objective_us=to_us(pred.step_time_s),
                         tp=plan.tp, activations_bytes=fullest.activations_bytes, peak_bytes=fullest.peak_bytes,
                         capacity_bytes=fullest.capacity_bytes,
                         recomputed_blocks=sum(1 for l in plan.layer_strategies() if l.recompute != "none"),
                         status=plan.solver.status if plan.solver else "")


def _over_options(chosen: SolverReport | None, reports: list[SolverReport | None], compared: list[ContextOption],
                  *, complete: bool, list_cp: bool) -> SolverReport | None:
    """The chosen plan's report over every value searched (``_make_plan``): optimal only if every
    value's search was proven (or proven infeasible) and none was left unsearched; the bound is
    the least of theirs. ``list_cp``: the report lists each context-parallel degree's best."""
    if chosen is None:
        return None
    settled = complete and all(o.status in ("optimal", "exhaustive", "infeasible") for o in compared)
    bound = min([r.bound_us for r in reports if r is not None] + [chosen.objective_us])
    objective = chosen.objective_us
    status = chosen.status if settled else "feasible"
    # A value's proof was 1F1B's: so is the whole's (said of an optimum only).
    among = "1f1b" if status == "optimal" and any(r is not None and r.proven_among for r in reports) else ""
    return dataclasses.replace(chosen, status=status, bound_us=bound,
                               gap=round((objective - bound) / objective, 6) if objective else 0.0,
                               context_parallel=tuple(compared) if list_cp else (), proven_among=among)


def _search(cm: CostModel, req: PlanRequest, deadline: float,
            progress: Callable[[str], None] | None) -> tuple[Plan, UniformResult]:
    """One search on one cost model (a context-parallel view included): the uniform grid, CP-SAT
    warm-started from it, then the interleaved schedules and replicas on several device types."""
    if progress:
        progress("uniform grid")
    uni = uniform_search(cm, global_batch=req.global_batch, space=req.space, deadline=deadline)
    found = None  # the interleaved schedules' search (``_interleaved``), once run
    if req.search == "uniform":
        if uni.best is None:
            raise infeasible_error(cm, uni, req.global_batch, req.space) if uni.complete else timeout_error(cm, req)
        uni_us = to_us(uni.best_eval.step_time_s)
        # A grid cut short proves nothing about the candidates it did not see.
        status, bound = ("exhaustive", uni_us) if uni.complete else ("feasible", 0)
        report = SolverReport(method="uniform", status=status, objective_us=uni_us, bound_us=bound,
                              gap=round((uni_us - bound) / uni_us, 6) if uni_us else 0.0,
                              wall_s=round(uni.wall_s, 4), uniform_objective_us=uni_us, candidates=uni.evaluated)
        plan = layout_to_plan(cm, uni.best, global_batch=req.global_batch, solver=report)
    elif time.perf_counter() > deadline:
        plan = _out_of_time_plan(cm, req, uni)  # without even loading the solver (a second's import)
    else:
        from partita.search.cpsat import solve_plan

        # The other schedules first: a faster interleaved plan prunes every 1F1B shape CP-SAT
        # would otherwise prove unable to beat it (the 405B on 16,384 H100: 50 s -> see
        # docs/benchmarks.md); the plan and its bound are the same.
        if progress:
            progress("interleaved pipelines")
        found = _interleaved(cm, req, uni, deadline)
        beat = to_us(found.best_eval.step_time_s) if found is not None and found.best is not None else None
        if progress:
            progress("CP-SAT search")
        plan = solve_plan(cm, req, uni, deadline=deadline, work_limit=work_limit(req), beat_us=beat)
    if time.perf_counter() < deadline:
        if progress and found is None:
            progress("interleaved pipelines")
        plan = _consider_interleaved(cm, req, plan, uni, deadline, found)
    if req.search == "cpsat" and cm.cp == 1 and not cm.model.is_moe and time.perf_counter() < deadline:
        # (replicas on several device types are dense models' only: the runtime's experts
        # assume one device type, and context parallelism's ranks are cp groups)
        if progress:
            progress("replicas on several device types")
        plan = _consider_replicas(cm, req, plan)
    return plan, uni


def _out_of_time_plan(cm: CostModel, req: PlanRequest, uni: UniformResult) -> Plan:
    """The time limit ran out before CP-SAT could start: the grid's best plan, with nothing
    proven about the rest of the space (bound 0, gap 1)."""
    from importlib.metadata import version

    warm = uni.fastest()
    if warm is None:
        raise timeout_error(cm, req)
    layout, ev = warm
    objective = to_us(ev.step_time_s)
    report = SolverReport(method="cpsat", status="feasible", objective_us=objective, bound_us=0, gap=1.0,
                          wall_s=round(uni.wall_s, 4), workers=req.workers, seed=req.seed,
                          ortools_version=version("ortools"),
                          uniform_objective_us=to_us(uni.best_eval.step_time_s) if uni.best_eval else 0,
                          candidates=0)
    return layout_to_plan(cm, layout, global_batch=req.global_batch, solver=report)
