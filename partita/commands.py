"""What each torch-free CLI command does, and how results are shown to people.

Every command checks its input before it works (a missing output folder is refused before a
search, not after), writes its files before it prints (a closed pipe loses nothing), and says
what it did not use or could not do instead of falling back in silence.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from rich.console import Console
from rich.table import Table

from partita.cluster import ClusterSpec, load_cluster, same_hardware
from partita.devices import CATALOG, PRICE_SOURCE
from partita.errors import InfeasibleError, PartitaError
from partita.model import BUILTIN, ModelSpec, load_model
from partita.plan import RECOMPUTE, LayerStrategy, Plan
from partita.pricing import TrainingCost, cost_lines, parse_tokens, training_cost
from partita.profile import Profile
from partita.units import GiB, fmt_bytes, fmt_seconds

if TYPE_CHECKING:  # the search loads only when a plan is made
    from partita.search.costs import CostModel
    from partita.search.uniform import SearchSpace

class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich exits with status 1 here; the CLI's handler decides (the work is done: exit 0)
        raise BrokenPipeError


# Wide enough for the plan table when output is piped to a file or a log.
console = _Console(highlight=False, width=None if sys.stdout.isatty() else 150)


def warn(message: str) -> None:
    """Something the user should know that does not stop the command: one line on stderr."""
    print(f"partita: warning: {message}", file=sys.stderr)


# ---- partita plan -----------------------------------------------------------------------
def plan(args: argparse.Namespace) -> int:
    from partita.search.costs import CostModel
    from partita.search.planner import PlanRequest, make_plan
    from partita.search.uniform import device_price

    # Every input is checked before the search, so bad input fails in a second, not after it.
    output = writable_output(args.output)
    model = load_model(args.model)
    cluster = load_cluster(args.cluster)
    seq_len = args.seq_len or model.seq_len
    global_batch = args.global_batch or model.default_global_batch
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
                      moe_imbalance=getattr(args, "moe_imbalance", None) or 1.0)
    start = time.perf_counter()
    as_json = getattr(args, "json", False)
    alternatives: list[Plan] = []
    objective = getattr(args, "objective", "time")
    release = getattr(args, "release_idle", False)
    if release and objective != "cost":
        raise PartitaError("--release-idle only changes --objective cost; add --objective cost or drop it")
    frontier = []
    try:
        with _Quiet() if as_json else console.status("searching", spinner="dots") as status:
            if objective == "cost" and release:
                from partita.search.planner import make_cost_plan

                result, frontier = make_cost_plan(req, progress=lambda what: status.update(what))
            else:
                if objective == "cost":
                    for g in cluster.groups:  # the cost is still reported: every group needs a price
                        device_price(g)
                result, _ = make_plan(req, progress=lambda what: status.update(what))
            if top > 1:
                status.update(f"the best plans of {top - 1} other shapes")
                alternatives = _alternatives(req, result, top - 1)
    except InfeasibleError as e:
        if any(margins.values()):
            raise InfeasibleError(f"{e} (that is with --memory-margin keeping "
                                  f"{_margin_text(margins)} free per device)") from None
        raise
    wall = time.perf_counter() - start
    cm = CostModel(model, cluster, seq_len=seq_len, dtype=dtype, profiles=profiles)
    cm.moe_imbalance = req.moe_imbalance  # a mixture of experts' plan is priced at the routing it was made for
    if any(margins.values()):  # the plan is for the real cluster: its devices' full memory, the margin unused
        from partita.search.planner import attach_prediction
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
    notes = []
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
        from partita import jsonout

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
    from partita.search.planner import plan_price, usd_per_million_tokens
    from partita.search.uniform import device_price

    if not release:
        whole = sum(g.size * device_price(g) for g in cluster.groups)
        return (f"objective cost: the whole cluster is paid for (${whole / 1e6:,.2f}/h), so the cheapest plan per "
                f"token is the fastest: ${usd_per_million_tokens(plan, whole):,.4f} per million tokens "
                f"(--release-idle if idle devices can be released)")
    price = plan_price(plan, cluster)
    fastest = frontier[0]
    proven = "proven" if all(p.exact for p in frontier) else "not proven (a search on the way stopped early)"
    line = (f"objective cost (idle devices released): ${usd_per_million_tokens(plan, price):,.4f} per million tokens "
            f"on {len(plan.ranks)} devices (${price / 1e6:,.2f}/h), {proven}; ")
    if fastest.plan is plan:
        return line + f"it is also the fastest plan ({len(frontier)} price bounds searched)"
    return line + (f"the fastest plan costs ${fastest.usd_per_mtok:,.4f} per million tokens on "
                   f"{len(fastest.plan.ranks)} devices at {fastest.plan.prediction.step_time_s:.3f} s/step "
                   f"({len(frontier)} price bounds searched)")


class _Quiet:
    """A stand-in for the progress spinner when stdout carries JSON."""

    def __enter__(self) -> "_Quiet":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, what: str) -> None:
        pass


def _alternatives(req, best: Plan, count: int) -> list[Plan]:
    """The best plans of ``count`` other shapes (``partita.search.topk``), in the search's budget."""
    from partita.search.costs import CostModel
    from partita.search.planner import SAFETY_WALL_S, work_limit
    from partita.search.topk import alternative_plans

    cm = CostModel(req.model, req.cluster, seq_len=req.seq_len, dtype=req.dtype, profiles=req.profiles)
    deadline = time.perf_counter() + (req.time_limit_s if req.time_limit_s is not None else SAFETY_WALL_S)
    return alternative_plans(cm, req, best, count, work_limit=work_limit(req), deadline=deadline)


def print_alternatives(plans: "list[tuple[Path, Plan, TrainingCost | None]]", top: int) -> None:
    """The K plans side by side: shape, placement, prediction (and with --tokens the time and cost
    of training), and the file each is in."""
    from partita.jsonout import plan_summary
    from partita.pricing import fmt_duration

    priced = plans[0][2] is not None
    t = Table(title=f"the best plans of {len(plans)} shapes (--top {top})", title_justify="left", box=None,
              padding=(0, 1))
    cols = ["#", "dp x tp x pp", "micro-batch", "groups", "blocks/stage", "step", "tokens/s", "MFU", "memory"]
    cols += ["time", "GPU-hours", "cost"] if priced else []
    for col in cols + ["search", "file"]:
        t.add_column(col, justify="right" if col in ("#", "step", "tokens/s", "MFU", "memory", "time", "GPU-hours",
                                                     "cost") else "left")
    for i, (path, p, cost) in enumerate(plans):
        s = plan_summary(p)
        counts = list(p.batch_shares) if uneven_shares(p) else p.num_micro_batches  # per replica
        sizes = "/".join(map(str, sorted(set(p.micro_batch_sizes), reverse=True))) if uneven_sizes(p) else p.micro_batch
        row = [str(i + 1), f"{p.dp} x {p.tp} x {p.pp}", f"{sizes} x {counts}",
               ",".join(dict.fromkeys(s["groups"])), ",".join(map(str, s["blocks_per_stage"])),
               fmt_seconds(s["step_time_s"]), f"{s['tokens_per_s']:,.0f}", f"{100 * s['mfu']:.1f}%",
               f"{100 * s['peak_fraction']:.0f}%"]
        if cost is not None:
            row += [fmt_duration(cost.seconds), f"{cost.gpu_hours:,.0f}",
                    f"${cost.cost_usd:,.0f}" if cost.cost_usd is not None else "-"]
        t.add_row(*row, p.solver.status if p.solver else "", str(path))
    console.print(t)
    if len(plans) < top:
        console.print(f"only {len(plans)} shapes hold a plan that fits (or were reached in the search's work limit)")


def writable_output(text: str) -> Path:
    """The -o path, refused before any work if the plan could not be written there."""
    path = Path(text)
    try:
        if path.is_dir():
            raise PartitaError(f"-o {text}: is a directory; give a file name, e.g. -o {path / 'plan.yaml'}")
        parent = path.parent
        if not parent.exists():
            raise PartitaError(f"-o {text}: no such directory {str(parent)!r}; create it first or write elsewhere")
        if not parent.is_dir():
            raise PartitaError(f"-o {text}: {str(parent)!r} is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise PartitaError(f"-o {text}: no permission to write there; choose another path")
    except (OSError, ValueError):  # a name no file can have (too long, a NUL byte)
        raise PartitaError(f"-o {text!r}: not a path a file can be written to") from None
    return path


def save_plan(p: Plan, path: Path) -> None:
    try:
        p.save(path)
    except OSError as e:
        raise PartitaError(f"-o {path}: cannot write the plan ({e.strerror or e})") from None


def plan_dtype(flag: str | None, cluster: ClusterSpec) -> str:
    """--dtype, or the default: fp32 on CPU ranks, bf16 on GPUs, fp16 where a device lacks bf16."""
    from partita.search.costs import default_dtype

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

    node_sizes = sorted({g.gpus_per_node for g in cluster.groups})
    for tp in args.tp or ():
        why = model.kinds["block"].tp_divides(tp) if tp > 0 else "it must be >= 1"
        if why:
            raise PartitaError(f"--tp {tp}: {why}; choose a degree that divides heads, kv_heads and ffn")
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
        if min(args.pp) > global_batch:
            raise PartitaError(f"--pp {_csv(args.pp)}: 1F1B needs a micro-batch per stage, and global batch "
                               f"{global_batch} makes at most {global_batch}; raise --global-batch or lower --pp")
    if args.micro_batch and min(args.micro_batch) > global_batch:
        raise PartitaError(f"--micro-batch {_csv(args.micro_batch)}: larger than the global batch {global_batch}")
    if any(z > 3 for z in args.zero or ()):
        raise PartitaError(f"--zero {_csv(args.zero)}: ZeRO levels are 0, 1, 2 and 3")
    recompute = getattr(args, "recompute", None)
    if args.no_recompute and recompute not in (None, ("none",)):
        raise PartitaError(f"--no-recompute and --recompute {','.join(recompute)} disagree; give one of them")
    return SearchSpace(zero_levels=args.zero or (0, 1, 2, 3),
                       recompute=("none",) if args.no_recompute else recompute or RECOMPUTE,
                       sequence_parallel=(False,) if args.no_sequence_parallel else (False, True),
                       micro_batches=args.micro_batch, tensor_parallel=args.tp, pipeline=args.pp)


def _csv(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


# ---- profiles ---------------------------------------------------------------------------
def usable_profiles(paths: Sequence[str], model: ModelSpec, cluster: ClusterSpec, *, seq_len: int,
                    dtype: str) -> tuple[Profile, ...]:
    """The profiles the cost model can use for this model, sequence length and dtype. One that
    it cannot use is named with the reason (and left out); none usable at all is bad input."""
    profiles = tuple(Profile.load(p) for p in paths)
    kept, refused = [], []
    for path, prof in zip(paths, profiles):
        if prof.device not in cluster.device_types:
            raise PartitaError(f"--profile {path}: measured on {prof.device}, but the cluster has "
                               f"{', '.join(cluster.device_types)}; drop it or change the cluster")
        why_not = layer_costs_unusable(prof, model, seq_len=seq_len, dtype=dtype)
        if prof.calibration is not None and prof.dtype != dtype:
            refused.append(f"{path} (calibrated on {prof.dtype} runs, the plan trains in {dtype})")
            continue
        if why_not is not None and not prof.comm and prof.calibration is None:
            refused.append(f"{path} ({why_not})")
            continue
        if any(k.device == prof.device for _, k in kept):
            raise PartitaError(f"--profile {path}: a second profile for {prof.device}; give one per device type")
        if why_not is not None and (prof.layers or prof.calibration is None):
            warn(f"profile {path}: its layer costs are not used ({why_not}); its collective fits"
                 f"{' and calibration are' if prof.calibration else ' are'}")
        kept.append((path, prof))
    if refused and not kept:
        raise PartitaError(f"no profile given can be used: {'; '.join(refused)}; re-measure with `partita profile` "
                           f"or drop --profile for analytic costs")
    for text in refused:
        warn(f"profile {text} is not used; analytic costs stand in for it")
    return tuple(p for _, p in kept)


def layer_costs_unusable(prof: Profile, model: ModelSpec, *, seq_len: int, dtype: str) -> str | None:
    """Why the profile's layer costs cannot price this model, or None if some can."""
    if not prof.layers:
        return "it holds no layer costs"
    if prof.dtype != dtype:
        return f"measured in {prof.dtype}, the plan trains in {dtype}; --dtype {prof.dtype} would use it"
    kinds = set(model.kinds.values())
    same_model = [l for l in prof.layers if l.kind in kinds]
    if not same_model:
        other = prof.layers[0].kind
        return (f"measured on other layer shapes (hidden {other.hidden}, ffn {other.ffn}, vocab {other.vocab}), "
                f"not {model.name}'s (hidden {model.hidden}, ffn {model.ffn}, vocab {model.vocab})")
    if not any(l.seq_len == seq_len for l in same_model):
        lens = sorted({l.seq_len for l in same_model})
        return (f"measured at sequence length {', '.join(map(str, lens))}, the plan uses {seq_len}; "
                f"--seq-len {lens[-1]} would use it")
    return None


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
            reasons.append(f"stages have equal widths of dp x tp ranks that divide the node groups they sit on, "
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
               if any(g.gpus_per_node % t == 0 for g in cluster.groups) and model.kinds["block"].tp_divides(t) is None
               and (space is None or not space.tensor_parallel or t in space.tensor_parallel)]
    return max(allowed, default=1)


def most_devices(cm: "CostModel", global_batch: int, space: "SearchSpace", search: str) -> int:
    """The most devices any plan shape the search considers can use (shapes only, no pricing)."""
    from partita.search.uniform import grid, hosts, max_stages

    if search == "uniform":
        return max((len(groups) * dp * tp for groups, tp, dp, _, _ in grid(cm, global_batch, space)), default=0)
    from partita.search.cpsat import shapes

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


# ---- partita calibrate -------------------------------------------------------------------
def calibrate(args: argparse.Namespace) -> int:
    """Fit the device type's time constants to the runs, write the profile, print the fit."""
    from partita.search.calibrate import calibrate as fit, load_run, predictions

    output = writable_output(args.output)
    runs = [load_run(path) for path in args.runs]
    held_out = [load_run(path) for path in args.check]
    devices = {r.device for r in runs}
    for path, run in zip(args.check, held_out):
        if run.device not in devices:
            raise PartitaError(f"--check {path}: a run on {run.device}, the profile is for {', '.join(devices)}; "
                               f"check runs of the same device type")
    command = "partita calibrate " + " ".join(args.runs) + f" -o {args.output}"
    profile, table = fit(runs, command=command)
    try:
        profile.save(output)
    except OSError as e:
        raise PartitaError(f"-o {output}: cannot write the profile ({e.strerror or e})") from None
    cal = profile.calibration
    assert cal is not None
    console.print(_prediction_table(f"calibration of {profile.device} ({profile.dtype}) on {len(runs)} run(s)",
                                    table))
    for name in cal.CONSTANTS + cal.OPTIONAL:
        value = getattr(cal, name)
        if value is None:
            continue  # an optional constant the fit left out
        shown = fmt_seconds(value) if name.endswith("_s") else f"{value:.3g}" + (" GB/s" if name.endswith("_gbps") else "")
        console.print(f"  {name.replace('_', ' ')}: {shown} ({'fitted' if name in cal.fitted else 'default'})")
    for c in profile.comm:
        console.print(f"  {c.op} on {c.ranks} {c.link} ranks: {c.latency_s * 1e6:.0f} us + bytes / {c.bandwidth_gbps:.3g} GB/s")
    console.print(f"median |error| {cal.error:.1%}\nwrote {output}")
    if held_out:
        console.print(_prediction_table("not fitted on: predicted by the new profile",
                                        [(path, *row) for path, run in zip(args.check, held_out)
                                         for row in predictions(run, profile)]))
    return 0


def _prediction_table(title: str, rows) -> Table:
    """(run, observation, predicted s, measured s) rows, with each prediction's error."""
    t = Table(title=title, title_justify="left")
    for col in ("run", "observation", "predicted", "measured", "error"):
        t.add_column(col, justify="left" if col in ("run", "observation") else "right")
    for run, what, predicted, measured in rows:
        t.add_row(run, what, fmt_seconds(predicted), fmt_seconds(measured), f"{(predicted / measured - 1) * 100:+.1f}%")
    return t


# ---- partita check / show ------------------------------------------------------------------
def check(args: argparse.Namespace) -> int:
    from partita.search.costs import CostModel
    from partita.search.evaluate import evaluate_plan
    from partita.validate import validate_plan

    p = Plan.load(args.plan)
    given = load_cluster(args.cluster)
    model = ModelSpec.from_dict(p.model, where=f"{args.plan}: model")
    cluster, same = given, ""
    if given.fingerprint != p.cluster_fingerprint:
        own = ClusterSpec.from_dict(p.cluster, where=f"{args.plan}: cluster")
        if own.fingerprint == p.cluster_fingerprint and same_hardware(own, given):
            # The same hardware, listed in another order or under other names: the plan's own
            # spec numbers the ranks, so it is the one to check against.
            cluster, same = own, f" (the same hardware as {given.short}, ranks numbered as the plan's {own.short})"
    validate_plan(p, model, cluster)
    profiles = usable_profiles(args.profile, model, cluster, seq_len=p.seq_len, dtype=p.dtype)
    cm = CostModel(model, cluster, seq_len=p.seq_len, dtype=p.dtype, profiles=profiles)
    ev = evaluate_plan(p, cm)
    over = [s for s in ev.stages if s.peak_bytes > s.capacity]
    if getattr(args, "json", False):
        from partita import jsonout

        jsonout.emit(jsonout.check_output(path=args.plan, model=model.name, cluster=cluster.short,
                                          step_time_s=ev.step_time_s,
                                          stages=[(s.peak_bytes, s.capacity) for s in ev.stages]))
    else:
        console.print(f"{args.plan}: valid for {model.name} on {cluster.short}{same}; "
                      f"predicted step {fmt_seconds(ev.step_time_s)}")
        for i, s in enumerate(ev.stages):
            console.print(f"  stage {i}: peak {fmt_bytes(s.peak_bytes)} of {fmt_bytes(s.capacity)}")
    if over:
        worst = max(ev.stages, key=lambda s: s.peak_bytes / s.capacity)
        raise InfeasibleError(f"the plan does not fit: a device needs {fmt_bytes(worst.peak_bytes)} of "
                              f"{fmt_bytes(worst.capacity)}; re-plan with `partita plan` for this cluster")
    return 0


def show(args: argparse.Namespace) -> int:
    """Print a plan, after checking it is one: a hand edit that breaks it is refused, not shown."""
    from partita.validate import validate_plan

    tokens = parse_tokens(args.tokens) if getattr(args, "tokens", None) else None
    pictures = picture_outputs(args)
    p = Plan.load(args.plan)
    model = ModelSpec.from_dict(p.model, where=f"{args.plan}: model")
    cluster = ClusterSpec.from_dict(p.cluster, where=f"{args.plan}: cluster")
    try:
        validate_plan(p, model, cluster)
        _check_prediction(p)
    except PartitaError as e:
        raise PartitaError(f"{args.plan}: {e}") from None
    idle = idle_devices_note(p, model, cluster)
    cost = training_cost(p, cluster, tokens) if tokens else None
    write_pictures(p, cluster, pictures, source=args.plan)
    if getattr(args, "json", False):
        from partita import jsonout

        jsonout.emit(jsonout.show_output(p, path=args.plan, notes=[idle] if idle else [], cost=cost))
        return 0
    print_plan(p, notes=[idle] if idle else [])
    if cost is not None:
        console.print("\n".join(cost_lines(cost)))
    for path in pictures.values():
        console.print(f"wrote {path}")
    return 0


def picture_outputs(args: argparse.Namespace) -> dict[str, Path]:
    """show's --timeline and --report files, refused before any work if they cannot be written."""
    from partita.report import REPORT_FORMATS, TIMELINE_FORMATS, output_path

    out = {}
    if getattr(args, "timeline", None):
        out["timeline"] = output_path("--timeline", args.timeline, TIMELINE_FORMATS)
    if getattr(args, "report", None):
        out["report"] = output_path("--report", args.report, REPORT_FORMATS)
    return out


def write_pictures(p: Plan, cluster: ClusterSpec, pictures: dict[str, Path], *, source: str) -> None:
    from partita.report import write_report, write_timeline

    if "timeline" in pictures:
        write_timeline(p, cluster, pictures["timeline"])
    if "report" in pictures:
        write_report(p, cluster, pictures["report"], source=source)


def _check_prediction(p: Plan) -> None:
    pred = p.prediction
    if pred is None:
        return
    if len(pred.memory) != p.pp or len(pred.stage_time_s) != p.pp:
        raise PartitaError(f"the prediction lists {len(pred.stage_time_s)} stage times and {len(pred.memory)} "
                           f"memory entries for pp {p.pp}; re-check the plan with `partita check` or re-plan")
    if any(m.capacity_bytes <= 0 for m in pred.memory) or pred.step_time_s <= 0:
        raise PartitaError("the prediction has a zero capacity or step time; re-plan")


def models(args: argparse.Namespace | None = None) -> int:
    if getattr(args, "json", False):
        from partita import jsonout

        jsonout.emit(jsonout.models_output())
        return 0
    t = Table(title="built-in models")
    for col in ("name", "family", "params", "layers", "hidden", "heads/kv", "ffn", "vocab", "seq", "cp all-to-all"):
        t.add_column(col, justify="right" if col not in ("name", "family") else "left")
    for m in BUILTIN.values():
        # The context-parallel degrees the all-to-all variant allows at tp 1 (the ring: any).
        cps = [c for c in (2, 4, 8, 16, 32) if m.kinds["block"].cp_divides(c, seq_len=m.seq_len * c) is None
               and not m.is_moe]  # a mixture of experts runs at cp 1 (docs/moe.md)
        params = f"{m.n_params / 1e9:.2f} B" if m.n_params > 1e8 else f"{m.n_params / 1e6:.2f} M"
        if m.is_moe:  # a mixture of experts: total and active per token
            params += f" ({params_text(m.n_active_params)} active, {m.experts_per_token} of {m.experts} experts)"
        t.add_row(m.name, m.family, params,
                  str(m.n_layers), str(m.hidden), f"{m.heads}/{m.kv_heads}", str(m.ffn), str(m.vocab), str(m.seq_len),
                  ",".join(map(str, cps)) or "-")
    console.print(t)
    console.print("Also: a model YAML file (ModelSpec fields) or a Hugging Face config.json "
                  "(llama, mistral, qwen2, gpt2, gpt_neox; the mixtures of experts mixtral, qwen2_moe).")
    console.print("Long sequences: `partita plan --seq-len N` searches context parallelism from 16384 tokens (`--cp` "
                  "to choose degrees): all-to-all at the degrees above (heads and kv heads divisible by cp x tp), "
                  "the ring on GPUs at any degree (docs/search.md).")
    return 0


def devices(args: argparse.Namespace | None = None) -> int:
    if getattr(args, "json", False):
        from partita import jsonout

        jsonout.emit(jsonout.devices_output())
        return 0
    t = Table(title="device catalog (datasheet, dense)")
    for col in ("name", "memory", "bf16 TFLOP/s", "fp32 TFLOP/s", "HBM GB/s", "intra-node", "network GB/s", "$/GPU-hour",
                "source"):
        t.add_column(col)
    for d in CATALOG.values():
        t.add_row(d.name, f"{d.memory_bytes / GiB:.0f} GiB", f"{d.bf16_tflops:g}", f"{d.fp32_tflops:g}",
                  f"{d.hbm_gbps:g}", f"{d.intra_link} {d.intra_node_gbps:g} GB/s", f"{d.network_gbps:g}",
                  f"{d.price_per_gpu_hour:g}" if d.price_per_gpu_hour is not None else "-", d.source)
    console.print(t)
    console.print(f"prices: {PRICE_SOURCE}; a node group's price_per_gpu_hour in a cluster YAML overrides them")
    return 0


# ---- showing a plan ---------------------------------------------------------------------
def _strategy_text(s: LayerStrategy) -> str:
    parts = [f"tp{s.tensor_parallel}" if s.tensor_parallel > 1 else "no-tp"]
    if s.sequence_parallel:
        parts.append("sp")
    parts.append(f"zero{s.zero}")
    if s.recompute != "none":
        parts.append(f"{s.recompute} recompute")
    return " ".join(parts)


def _runs(layers: Sequence[LayerStrategy]) -> list[str]:
    """Consecutive layers with the same choices, as 'layers.0-9: tp8 sp zero1'."""
    out: list[str] = []
    i = 0
    while i < len(layers):
        j = i
        key = _strategy_text(layers[i])
        while (layers[i].name.startswith("layers.") and j + 1 < len(layers)
               and layers[j + 1].name.startswith("layers.") and _strategy_text(layers[j + 1]) == key):
            j += 1
        first, last = layers[i].name, layers[j].name
        span = first if i == j else f"{first}-{last.split('.')[-1]}"
        out.append(f"{span}: {key}")
        i = j + 1
    return out


def uneven_shares(p: Plan) -> bool:
    return len(set(p.batch_shares)) > 1


def uneven_sizes(p: Plan) -> bool:
    return len(set(p.micro_batch_sizes)) > 1


def batch_text(p: Plan) -> str:
    """How the global batch is split: dp x micro-batch x micro-batches, or the replicas' shares."""
    if uneven_sizes(p):
        count = f"{p.num_micro_batches} micro-batch{'es' if p.num_micro_batches > 1 else ''} per replica"
        sizes = p.micro_batch_sizes
        if len(sizes) <= 8:
            return f"{count}, of sizes {list(sizes)}"
        runs = {b: sizes.count(b) for b in sorted(set(sizes), reverse=True)}
        return f"{count}, of size " + " and ".join(f"{b} on {n} replicas" for b, n in runs.items())
    if uneven_shares(p):
        return (f"micro-batch {p.micro_batch} x {sum(p.batch_shares)} micro-batches in replica shares "
                f"{list(p.batch_shares)}")
    return f"{p.dp} x micro-batch {p.micro_batch} x {p.num_micro_batches} micro-batches"


def replica_text(p: Plan) -> str:
    """Replicas on different device types: each kind's count and share of the batch, one line
    ("replicas: 16 on h100 (H100) x 2 micro-batches of 24 = 768 sequences, ..."); empty otherwise."""
    if not p.mixed_replicas:
        return ""
    devices = _group_devices(p)
    parts = []
    for (path, size, count), replicas in p.replica_kinds().items():
        n = len(replicas)
        where = " -> ".join(dict.fromkeys(f"{g} ({devices.get(g, '?')})" for g in path))
        parts.append(f"{n} on {where} x {count} micro-batch{'es' if count > 1 else ''} of {size} = {n * count * size} "
                     f"sequences")
    return "replicas: " + "; ".join(parts)


def _group_devices(p: Plan) -> dict[str, str]:
    """The device type of each node group of the plan's cluster, by group name."""
    return {g["name"]: g.get("device", "?") for g in p.cluster.get("groups", [])}


def _stage_devices_text(p: Plan, s) -> str:
    """'8x H100 (h100)', or per group for a stage whose replicas sit on several."""
    if not s.replica_groups:
        return f"{len(s.ranks)}x {s.device} ({s.group})"
    devices = _group_devices(p)
    return " + ".join(f"{s.replica_groups.count(g) * p.tp}x {devices.get(g, '?')} ({g})" for g in s.groups)


def bubble_text(p: Plan) -> str:
    """The pipeline bubble's share of the predicted step, for the summary line of a pipelined
    plan ("; bubble 6.2% of the step"); empty without a pipeline or a prediction."""
    if p.pp == 1 or p.prediction is None or not p.prediction.step_time_s:
        return ""
    bubble = p.prediction.breakdown.get("pipeline_bubble", 0.0)
    return f"; bubble {100 * bubble / p.prediction.step_time_s:.1f}% of the step"


def params_text(n: int) -> str:
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def moe_note(p: Plan, model, imbalance: float) -> str:
    """A mixture of experts' sizes and its expert parallelism, for the plan's summary."""
    routing = "balanced routing" if imbalance == 1.0 else f"routing imbalance {imbalance:g}"
    return (f"mixture of experts: {params_text(model.n_params)} parameters, {params_text(model.n_active_params)} "
            f"active per token ({model.experts_per_token} of {model.experts} experts); ep {p.ep}: "
            f"{model.experts // p.ep} expert{'s' if model.experts // p.ep > 1 else ''} a rank, {routing}")


def print_plan(p: Plan, notes: Sequence[str] = ()) -> None:
    name = p.model.get("name", "?")
    cp = f" x cp {p.cp} ({p.cp_variant.replace('_', '-')})" if p.cp > 1 else ""
    cp += f" (ep {p.ep} inside dp)" if p.ep > 1 else ""
    console.print(f"[bold]{name}[/bold] on [bold]{p.cluster.get('name', '?')}[/bold]: "
                  f"{p.world_size} ranks = dp {p.dp}{cp} x tp {p.tp} x pp {p.pp}; seq {p.seq_len}, global batch "
                  f"{p.global_batch} = {batch_text(p)}; "
                  f"{p.dtype}, {p.schedule}" + (f" with {p.virtual_stages} virtual stages per rank"
                                                 if p.virtual_stages > 1 else "") + bubble_text(p))
    if replica_text(p):
        console.print(replica_text(p))
    for note in notes:
        console.print(note)
    t = Table(show_lines=True)
    for col in ("stage", "devices", "ranks", "layers", "per-layer choices", "time/mb", "peak memory"):
        t.add_column(col)
    pred = p.prediction
    for s in p.stages:
        blocks = sum(1 for l in s.layers if l.name.startswith("layers."))
        mem = ""
        if pred is not None:
            m = pred.memory[s.index]
            pct = 100 * m.peak_bytes / m.capacity_bytes
            mem = f"{fmt_bytes(m.peak_bytes)} / {fmt_bytes(m.capacity_bytes)} ({pct:.0f}%)"
        ranks = f"{s.ranks[0]}-{s.ranks[-1]}" if len(s.ranks) > 1 else str(s.ranks[0])
        # Under an interleaved schedule, one paragraph per virtual stage.
        choices = "\n".join(f"virtual stage {p.virtual_stage_index(s.index, c)}:\n  " + "\n  ".join(_runs(chunk)) if s.chunks
                            else "\n".join(_runs(chunk)) for c, chunk in enumerate(s.chunk_layers()))
        t.add_row(str(s.index), _stage_devices_text(p, s), ranks, f"{blocks} blocks",
                  choices,
                  fmt_seconds(pred.stage_time_s[s.index]) if pred else "", mem)
    console.print(t)
    if pred is not None:
        print_memory(p)
        console.print(f"predicted step time [bold]{fmt_seconds(pred.step_time_s)}[/bold], "
                      f"{pred.tokens_per_s:,.0f} tokens/s, MFU {100 * pred.mfu:.1f}%  "
                      f"(costs: {', '.join(f'{d} {src}' for d, src in p.cost_sources.items())})")
        parts = [f"{k.replace('_', ' ')} {fmt_seconds(v)}"
                 + (f" ({100 * v / pred.step_time_s:.1f}% of the step)" if k == "pipeline_bubble" else "")
                 for k, v in pred.breakdown.items() if v > 0]
        console.print("  per step: " + ", ".join(parts))
    if p.solver is not None:
        r = p.solver
        line = f"search: {r.method}, {r.status}"
        if r.method == "cpsat":
            line += f", gap {100 * r.gap:.2f}% (bound {fmt_seconds(r.bound_us / 1e6)})"
            if r.status == "optimal" and r.proven_among == "1f1b":
                # CP-SAT's proof covers 1F1B plans; the other schedules are priced after it on the
                # uniform grid's candidates (docs/search.md), and their bound did not rule them out.
                line += " among 1F1B plans"
            if r.uniform_objective_us:
                gain = r.uniform_objective_us / r.objective_us if r.objective_us else 1.0
                line += f"; {gain:.3f}x the best uniform plan ({fmt_seconds(r.uniform_objective_us / 1e6)})"
        else:
            line += f", {r.candidates} candidates"
        line += f"; {r.wall_s:.2f} s"
        console.print(line)
        for text in context_parallel_lines(p):
            console.print(text)


def context_parallel_lines(p: Plan) -> list[str]:
    """Why the plan's context-parallel degree: every degree searched, its best plan's step time,
    tensor-parallel degree and recomputed blocks (what memory forced), against the one chosen."""
    options = p.solver.context_parallel if p.solver is not None else ()
    if not options:
        return []
    blocks = sum(1 for l in p.layer_strategies() if l.name.startswith("layers."))
    chosen = next((o for o in options if o.cp == p.cp and o.variant == p.cp_variant), None)
    parts = []
    for o in options:
        name = f"cp {o.cp}" + (f" {o.variant.replace('_', '-')}" if o.cp > 1 else "")
        if not o.fits:
            parts.append(f"{name}: {'no plan fits' if o.status == 'infeasible' else 'none found in time'}")
            continue
        ratio = f", {o.objective_us / chosen.objective_us:.2f}x" if chosen and o is not chosen else ""
        parts.append(f"{name}: {fmt_seconds(o.objective_us / 1e6)} (tp {o.tp}, {o.recomputed_blocks}/{blocks} blocks "
                     f"recomputed{ratio})")
    lines = ["context parallelism: " + "; ".join(parts)]
    base = next((o for o in options if o.cp == 1), None)
    if p.cp > 1 and base is not None:
        tokens = f"each device holds {p.seq_len // p.cp} of the {p.seq_len} tokens of a sequence"
        if not base.fits:
            lines.append(f"  cp {p.cp} chosen for memory: without context parallelism no plan fits; {tokens}")
        elif chosen is not None:
            why = ("for memory: " if chosen.recomputed_blocks < base.recomputed_blocks or chosen.tp < base.tp else "")
            lines.append(f"  cp {p.cp} chosen {why}{tokens}, so it recomputes {chosen.recomputed_blocks} blocks at tp "
                         f"{chosen.tp} where cp 1 recomputes {base.recomputed_blocks} at tp {base.tp}")
    elif p.cp == 1 and len(options) > 1:
        lines.append("  cp 1 chosen: no context-parallel plan is faster")
    return lines


def print_memory(p: Plan) -> None:
    """Each stage's predicted peak on one device, by what holds it (categories no stage uses are left out)."""
    from partita.plan import StageMemory

    memory = p.prediction.memory if p.prediction else ()
    used = [c for c in StageMemory.CATEGORIES if any(m.category_bytes()[c] for m in memory)]
    t = Table(title="memory per device, by what holds it", title_justify="left", box=None, padding=(0, 1))
    t.add_column("stage")
    for c in used:
        t.add_column(c.replace("_", " "), justify="right")
    t.add_column("peak / capacity", justify="right")
    t.add_column("peak at")
    for m in memory:
        cats = m.category_bytes()
        t.add_row(str(m.stage), *(fmt_bytes(cats[c]) for c in used),
                  f"{fmt_bytes(m.peak_bytes)} / {fmt_bytes(m.capacity_bytes)}", m.peak_at or "-")
    console.print(t)
