"""``partita plan``: search for the fastest plan that fits, write it, and say what it leaves out.

Every input is checked before the search (a missing output folder, a profile for another
device, a flag that cannot work is refused in a second, not after it), and the command says
what it did not use or could not do instead of falling back in silence. The profiles a plan can
use are chosen in ``partita.cli.profiles`` (``usable_profiles``), for ``check`` and ``export`` too.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import TYPE_CHECKING, Sequence

from partita import parallel
from partita.cli import jsonout
from partita.cli.output import Quiet, console, save_plan, stop_on_sigterm, writable_output
from partita.cli.pricing import cost_lines, parse_tokens, training_cost
from partita.cli.printing import moe_note, print_alternatives, print_plan
from partita.cli.profiles import usable_profiles
from partita.cluster import ClusterSpec, load_cluster
from partita.errors import InfeasibleError, PartitaError
from partita.model import ModelSpec
from partita.model_io import load_model
from partita.plan import RECOMPUTE, Plan
from partita.units import GiB, fmt_bytes

if TYPE_CHECKING:  # the search loads only when a plan is made
    from partita.search.costs.model import CostModel
    from partita.search.uniform import SearchSpace


# ---- partita plan -----------------------------------------------------------------------
def plan(args: argparse.Namespace) -> int:
    with stop_on_sigterm():  # the search stops on SIGTERM as on Ctrl-C, writing nothing
        return _plan(args)


def _plan(args: argparse.Namespace) -> int:
    from partita.search.costs.model import CostModel
    from partita.search.engines import get_engine
    from partita.search.planner import PlanRequest, check_numbers, make_plan
    from partita.search.uniform import device_price

    # Every input is checked before the search, so bad input fails in a second, not after it.
    output = writable_output(args.output, inputs=[args.model, args.cluster, *args.profile])
    model = load_model(args.model)
    cluster = load_cluster(args.cluster)
    seq_len = args.seq_len or model.seq_len
    global_batch = args.global_batch or model.default_global_batch
    check_numbers(seq_len, global_batch, args.seed or 0)  # before they size anything
    dtype = plan_dtype(args.dtype, cluster)
    _check_search_flags(args)
    tokens = parse_tokens(args.tokens) if getattr(args, "tokens", None) else None
    top = getattr(args, "top", 1) or 1
    if top > 1 and args.search != "cpsat":
        raise PartitaError(f"--top {top} lists CP-SAT's best plan of each shape; drop --search uniform")
    space = _space(args, model, cluster, global_batch)
    profiles = usable_profiles(args.profile, model, cluster, seq_len=seq_len, dtype=dtype)
    margins = memory_margins(args.memory_margin, cluster)
    req = PlanRequest(model=model, cluster=with_margins(cluster, margins), seq_len=seq_len,
                      global_batch=global_batch, profiles=profiles, dtype=dtype, search=args.search,
                      time_limit_s=args.time_limit, gap=getattr(args, "gap", 0.0), workers=args.workers or 1,
                      seed=args.seed or 0, space=space, context_parallel=getattr(args, "cp", None) or (),
                      cp_variant=getattr(args, "cp_variant", None), expert_parallel=getattr(args, "ep", None) or (),
                      moe_imbalance=1.0 if getattr(args, "moe_imbalance", None) is None else args.moe_imbalance,
                      engine=getattr(args, "engine", None) or "partita", fp8=getattr(args, "fp8", False))
    start = time.perf_counter()
    as_json = getattr(args, "json", False)
    alternatives: list[Plan] = []
    objective = getattr(args, "objective", "time")
    release = getattr(args, "release_idle", False)
    if release and objective != "cost":
        raise PartitaError("--release-idle only changes --objective cost; add --objective cost or drop it")
    frontier = []
    engine_note = ""
    try:
        with Quiet() if as_json else console.status("searching", spinner="dots") as status:
            if objective == "cost" and release:
                from partita.search.cost_objective import make_cost_plan

                result, frontier = make_cost_plan(req, progress=lambda what: status.update(what))
            else:
                if objective == "cost":
                    for g in cluster.groups:  # the cost is still reported: every group needs a price
                        device_price(g)
                result, uni = make_plan(req, progress=lambda what: status.update(what))
            if req.engine != "partita" and not (objective == "cost" and release):
                from partita.cli.engine_fit import engine_uniform, restrict_to_engine, uniform_candidate
                from partita.search.planner import cost_model

                status.update(f"the closest plans {req.engine} runs as they are")
                best = result

                def candidates(k: int) -> list[Plan]:  # asked only when the search's best does not map as it is
                    uniform = [uniform_candidate(cost_model(req), best, uni), engine_uniform(req, best)]
                    return [p for p in uniform if p is not None] + _alternatives(req, best, k)

                result, engine_note = restrict_to_engine(best, req.engine, candidates, profiles=profiles,
                                                         space=req.space)
            if top > 1:
                status.update(f"the best plans of {top - 1} other shapes")
                alternatives = _alternatives(req, result, top - 1)
    except InfeasibleError as e:
        if any(margins.values()):
            raise InfeasibleError(f"{e} (that is with --memory-margin keeping "
                                  f"{_margin_text(margins)} free per device)") from None
        raise
    wall = time.perf_counter() - start
    cm = CostModel(model, cluster, seq_len=seq_len, dtype=dtype, profiles=profiles, engine=get_engine(req.engine, req.fp8))
    if any(margins.values()):  # the plan is for the real cluster: its devices' full memory, the margin unused
        from partita.search.plans import attach_prediction
        from partita.validate import validate_plan

        result, *alternatives = [attach_prediction(dataclasses.replace(p, cluster=cluster.to_dict(),
                                                                       cluster_fingerprint=cluster.fingerprint), cm)
                                 for p in (result, *alternatives)]
        for p in (result, *alternatives):
            validate_plan(p, model, cluster)
    save_plan(result, output)  # before anything is printed: a closed pipe must not lose the plan
    alt_paths = [output.with_name(f"{output.stem}-{i + 2}{output.suffix}") for i in range(len(alternatives))]
    for alt, path in zip(alternatives, alt_paths):
        save_plan(alt, path)
    notes = [engine_note] if engine_note else []
    if model.is_moe:
        notes.append(moe_note(result, model, req.moe_imbalance))
    idle = idle_devices_note(result, model, cluster, cm=cm, space=space, search=args.search)
    if idle:
        notes.append(idle)
    if any(margins.values()):
        notes.append(f"memory margin: {_margin_text(margins)} kept free on every device (--memory-margin)")
    over = cpu_oversubscription(result, cluster)
    if over:
        notes.append(f"[bold]warning:[/bold] {over}")
    if objective == "cost":
        notes.append(cost_objective_note(result, cluster, frontier, release))
    cost = training_cost(result, cluster, tokens) if tokens else None
    alt_costs = [training_cost(alt, cluster, tokens) for alt in alternatives] if tokens else [None] * len(alternatives)
    if as_json:
        plain = [n.replace("[bold]", "").replace("[/bold]", "") for n in notes]
        jsonout.emit(jsonout.plan_output(result, output=str(output), notes=plain, cost=cost,
                                         alternatives=[(str(path), alt, alt.solver.status if alt.solver else "", c)
                                                       for path, alt, c in zip(alt_paths, alternatives, alt_costs)]))
        return 0
    print_plan(result, notes=notes)
    if cost is not None:
        console.print("\n".join(cost_lines(cost)))
    if top > 1:
        print_alternatives([(output, result, cost), *zip(alt_paths, alternatives, alt_costs)], top)
    console.print(f"\nwrote {output}  (planned in {wall:.2f} s)")
    return 0


def cost_objective_note(plan: Plan, cluster, frontier: list, release: bool) -> str:
    """What --objective cost chose, in dollars per million tokens, beside the fastest plan."""
    from partita.search.cost_objective import OUT_OF_TIME, cost_bound, plan_price, usd_per_million_tokens
    from partita.search.uniform import device_price

    if not release:
        whole = sum(g.size * device_price(g) for g in cluster.groups)
        return (f"objective cost: the whole cluster is paid for (${whole / 1e6:,.2f}/h), so the cheapest plan per "
                f"token is the fastest: ${usd_per_million_tokens(plan, whole):,.4f} per million tokens "
                f"(--release-idle if idle devices can be released)")
    price = plan_price(plan, cluster)
    fastest = frontier[0]
    cost = usd_per_million_tokens(plan, price)
    if all(p.exact for p in frontier) and frontier[-1].stopped != OUT_OF_TIME:
        proven = "proven"
    else:
        bound = cost_bound(frontier, min(device_price(g) for g in cluster.groups))
        why = "the time ran out before the cheaper prices were searched" if frontier[-1].stopped == OUT_OF_TIME \
            else "a search on the way stopped early"
        proven = (f"not proven ({why}): no plan costs less than ${bound:,.4f} "
                  f"(gap {(cost - bound) / cost if cost else 0:.1%})")
    line = (f"objective cost (idle devices released): ${cost:,.4f} per million tokens "
            f"on {len(plan.ranks)} devices (${price / 1e6:,.2f}/h), {proven}; ")
    if fastest.plan is plan:
        return line + f"it is also the fastest plan ({len(frontier)} price bounds searched)"
    return line + (f"the fastest plan costs ${fastest.usd_per_mtok:,.4f} per million tokens on "
                   f"{len(fastest.plan.ranks)} devices at {fastest.plan.prediction.step_time_s:.3f} s/step "
                   f"({len(frontier)} price bounds searched)")


def _alternatives(req, best: Plan, count: int) -> list[Plan]:
    """The best plans of ``count`` other shapes (``partita.search.topk``), in the search's budget."""
    from partita.search.costs.model import CostModel
    from partita.search.engines import get_engine
    from partita.search.planner import work_limit
    from partita.search.plans import SAFETY_WALL_S
    from partita.search.topk import alternative_plans

    cm = CostModel(req.model, req.cluster, seq_len=req.seq_len, dtype=req.dtype, profiles=req.profiles,
                   engine=get_engine(req.engine, req.fp8))
    deadline = time.perf_counter() + (req.time_limit_s if req.time_limit_s is not None else SAFETY_WALL_S)
    return alternative_plans(cm, req, best, count, work_limit=work_limit(req), deadline=deadline)


def plan_dtype(flag: str | None, cluster: ClusterSpec) -> str:
    """--dtype, or the default: fp32 on CPU ranks, bf16 on GPUs, fp16 where a device lacks bf16."""
    from partita.search.costs.compute import default_dtype

    if flag is None:
        return default_dtype(cluster)
    if any(g.device_type.is_cpu for g in cluster.groups) and flag != "fp32":
        raise PartitaError(f"--dtype {flag}: CPU ranks train in fp32; drop --dtype or give --dtype fp32")
    if flag == "bf16":
        lacking = sorted({g.device for g in cluster.groups if g.device_type.bf16_tflops == 0})
        if lacking:
            raise PartitaError(f"--dtype bf16: {' and '.join(lacking)} {'has' if len(lacking) == 1 else 'have'} "
                               f"no bf16; use --dtype fp16 (the default there) or fp32")
    return flag


def _check_search_flags(args: argparse.Namespace) -> None:
    if args.search == "uniform":
        given = [f for f, v in (("--workers", args.workers), ("--seed", args.seed)) if v is not None]
        if given:
            raise PartitaError(f"{' and '.join(given)} tune{'s' if len(given) == 1 else ''} the CP-SAT solver, which "
                               f"--search uniform does not run; drop {'it' if len(given) == 1 else 'them'}")


def _space(args: argparse.Namespace, model: ModelSpec, cluster: ClusterSpec, global_batch: int) -> "SearchSpace":
    """The search space the flags allow; a choice that cannot work is one clear error."""
    from partita.search.uniform import SearchSpace

    engine = getattr(args, "engine", None)
    node_sizes = sorted({g.gpus_per_node for g in cluster.groups})
    for tp in args.tp or ():
        why = parallel.tp_rule(model.kinds["block"], tp) if tp > 0 else "it must be >= 1"
        if why:
            parts = "heads and kv_heads" if model.is_moe else "heads, kv_heads and ffn"  # a MoE's experts stay whole
            raise PartitaError(f"--tp {tp}: {why}; choose a degree that divides {parts}")
        if not any(n % tp == 0 for n in node_sizes):
            raise PartitaError(f"--tp {tp}: a tensor-parallel group stays inside one node, and the nodes here have "
                               f"{' or '.join(map(str, node_sizes))} devices; choose a degree that divides the node size")
    if any(v < 1 for v in (args.pp or ()) + (args.micro_batch or ())):
        raise PartitaError("--pp and --micro-batch values must be >= 1")
    if args.pp:
        if min(args.pp) > model.n_layers:
            raise PartitaError(f"--pp {_csv(args.pp)}: {model.name} has {model.n_layers} blocks, so at most "
                               f"{model.n_layers} stages")
        if min(args.pp) > cluster.world_size:
            raise PartitaError(f"--pp {_csv(args.pp)}: the cluster has {cluster.world_size} devices, one stage needs "
                               f"at least one")
        if min(args.pp) > global_batch and engine not in parallel.SHORT_PIPELINES:
            raise PartitaError(f"--pp {_csv(args.pp)}: 1F1B needs a micro-batch per stage, and global batch "
                               f"{global_batch} makes at most {global_batch}; raise --global-batch or lower --pp")
    if args.micro_batch and min(args.micro_batch) > global_batch:
        raise PartitaError(f"--micro-batch {_csv(args.micro_batch)}: larger than the global batch {global_batch}")
    if any(z > 3 for z in args.zero or ()):
        raise PartitaError(f"--zero {_csv(args.zero)}: ZeRO levels are 0, 1, 2 and 3")
    if engine and args.pp and args.zero and not any(parallel.pipeline_zero_levels(engine, pp, args.zero) for pp in args.pp):
        # left to the search, only plans without data-parallel replicas (ZeRO 0) would remain
        raise PartitaError(f"--zero {_csv(args.zero)} with --pp {_csv(args.pp)}: "
                           f"{parallel.zero_advice(engine, args.pp, args.zero)}, or another --pp, or plan without "
                           f"--engine {engine}")
    recompute = getattr(args, "recompute", None)
    if args.no_recompute and recompute not in (None, ("none",)):
        raise PartitaError(f"--no-recompute and --recompute {','.join(recompute)} disagree; give one of them")
    return SearchSpace(zero_levels=args.zero or (0, 1, 2, 3),
                       recompute=("none",) if args.no_recompute else recompute or RECOMPUTE,
                       sequence_parallel=(False,) if args.no_sequence_parallel else (False, True),
                       micro_batches=args.micro_batch, tensor_parallel=args.tp, pipeline=args.pp,
                       schedules=getattr(args, "schedule", None) or ())


def _csv(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


# ---- memory margin ----------------------------------------------------------------------
def memory_margins(flag: tuple[str, float] | None, cluster: ClusterSpec) -> dict[str, int]:
    """Bytes to keep free per device, by node group; refused where nothing would be left."""
    if flag is None:
        return {g.name: 0 for g in cluster.groups}
    unit, value = flag
    out = {}
    for g in cluster.groups:
        margin = int(value * GiB) if unit == "gib" else int(value * g.memory_bytes)
        if margin >= g.memory_bytes:
            raise PartitaError(f"--memory-margin {value:g}{' GiB' if unit == 'gib' else ''}: keeps "
                               f"{fmt_bytes(margin)} free on a {g.device} of {fmt_bytes(g.memory_bytes)}, "
                               f"leaving nothing to train with")
        out[g.name] = margin
    return out


def with_margins(cluster: ClusterSpec, margins: dict[str, int]) -> ClusterSpec:
    """The cluster as the search sees it: each device's memory less its margin."""
    if not any(margins.values()):
        return cluster
    groups = tuple(dataclasses.replace(g, memory_bytes=g.memory_bytes - margins[g.name]) for g in cluster.groups)
    return dataclasses.replace(cluster, groups=groups)


def _margin_text(margins: dict[str, int]) -> str:
    lo, hi = min(margins.values()), max(margins.values())
    return fmt_bytes(lo) if lo == hi else f"{fmt_bytes(lo)} to {fmt_bytes(hi)}"


# ---- what a plan leaves unused ------------------------------------------------------------
def idle_devices_note(p: Plan, model: ModelSpec, cluster: ClusterSpec, *, cm: "CostModel | None" = None,
                      space: "SearchSpace | None" = None, search: str | None = None) -> str | None:
    """'uses 8 of 24 GPUs: why' when the plan leaves devices idle. Without the search space
    (``partita show``) only the reasons the plan itself proves are given."""
    total, used = cluster.world_size, p.world_size
    if used >= total:
        return None
    unit = "CPU ranks" if cluster.is_cpu else "GPUs" if not any(g.device_type.is_cpu for g in cluster.groups) \
        else "devices"
    reasons = []
    tp_max = _widest_tp(model, cluster, space)
    batch_cap = p.global_batch * tp_max  # dp x pp <= global batch (a sequence per replica, a micro-batch per stage)
    cap = min(total, batch_cap)
    if batch_cap < total:
        reasons.append(f"global batch {p.global_batch} allows at most {p.global_batch} data-parallel replicas x "
                       f"pipeline stages, times tp <= {tp_max}: {batch_cap:,} {unit} at most; a larger "
                       f"--global-batch would use more")
    if cm is not None and space is not None and search is not None:
        most = most_devices(cm, p.global_batch, space, search)
        if most < cap:
            limits = " within the --tp/--pp/--micro-batch limits" if (space.tensor_parallel or space.pipeline
                                                                          or space.micro_batches) else ""
            reasons.append(f"stages have equal widths of dp x cp x tp ranks that divide the node groups they sit on, "
                           f"and at most one stage per block and per micro-batch{limits}: no plan shape uses more "
                           f"than {most:,}")
        if used < most:
            proven = p.solver is not None and p.solver.status in ("optimal", "exhaustive")
            unused = [g for g in cluster.groups if g.name not in {n for s in p.stages for n in s.groups}]
            left_out = (f"; the {', '.join(_group_text(g) for g in unused)} group{'s' if len(unused) > 1 else ''} "
                        f"{'are' if len(unused) > 1 else 'is'} not worth adding") if unused else ""
            reasons.append(f"{'no' if proven else 'the search found no'} plan on more {unit} (up to {most:,}) "
                           f"{'is' if proven else 'that was'} predicted faster{left_out}")
    return f"uses {used:,} of {total:,} {unit}: " + "; ".join(reasons) if reasons else \
        f"uses {used:,} of {total:,} {unit}"


def _group_text(g) -> str:
    return f"{g.nodes}x{g.gpus_per_node}x{g.device}" if g.nodes > 1 else f"{g.gpus_per_node}x{g.device}"


def _widest_tp(model: ModelSpec, cluster: ClusterSpec, space: "SearchSpace | None") -> int:
    """The widest tensor-parallel degree any stage may take: inside a node, dividing the blocks."""
    allowed = [t for t in range(1, max(g.gpus_per_node for g in cluster.groups) + 1)
               if any(g.gpus_per_node % t == 0 for g in cluster.groups) and parallel.tp_rule(model.kinds["block"], t) is None
               and (space is None or not space.tensor_parallel or t in space.tensor_parallel)]
    return max(allowed, default=1)


def most_devices(cm: "CostModel", global_batch: int, space: "SearchSpace", search: str) -> int:
    """The most devices any plan shape the search considers can use (shapes only, no pricing)."""
    from partita.search.uniform import grid, hosts, max_stages

    if search == "uniform":
        return max((len(groups) * dp * tp for groups, tp, dp, _, _ in grid(cm, global_batch, space)), default=0)
    from partita.search.cpsat_problem import shapes

    most = 0
    for sh in shapes(cm, global_batch, space):
        slots = sum(g.size // sh.stage_size for g in cm.cluster.groups if hosts(g, sh.stage_size, sh.tp))
        slots = min(slots, max_stages(cm, sh.num_micro_batches), max(space.pipeline) if space.pipeline else slots)
        most = max(most, slots * sh.stage_size)
    return most


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_oversubscription(p: Plan, cluster: ClusterSpec) -> str | None:
    cpu_ranks = sum(1 for _, name in p.rank_groups() if cluster.group(name).device_type.is_cpu)
    cores = available_cores()
    if cpu_ranks <= cores:
        return None
    return (f"the plan runs {cpu_ranks} CPU ranks on a machine with {cores} cores: ranks would share cores, so "
            f"the predicted times are meaningless here; plan for {cores}xcpu at most to run it on this machine")
