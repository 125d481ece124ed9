"""What each torch-free CLI command does, and how results are shown to people."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Sequence

from rich.console import Console
from rich.table import Table

from partita.cluster import load_cluster
from partita.devices import CATALOG
from partita.errors import InfeasibleError, PartitaError
from partita.model import BUILTIN, load_model
from partita.plan import LayerStrategy, Plan
from partita.profile import Profile
from partita.units import GiB, fmt_bytes, fmt_seconds

import sys

# Wide enough for the plan table when output is piped to a file or a log.
if TYPE_CHECKING:  # the search loads only when a plan is made
    from partita.search.uniform import SearchSpace

console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)


def _profiles(paths: Sequence[str]) -> tuple[Profile, ...]:
    return tuple(Profile.load(p) for p in paths)


def plan(args: argparse.Namespace) -> int:
    from partita.search.planner import PlanRequest, make_plan

    model = load_model(args.model)
    cluster = load_cluster(args.cluster)
    req = PlanRequest(model=model, cluster=cluster, seq_len=args.seq_len or model.seq_len,
                      global_batch=args.global_batch or model.default_global_batch, profiles=_profiles(args.profile),
                      search=args.search, time_limit_s=args.time_limit, workers=args.workers, seed=args.seed,
                      space=_space(args, model))
    start = time.perf_counter()
    with console.status("searching", spinner="dots") as status:
        result, _ = make_plan(req, progress=lambda what: status.update(what))
    wall = time.perf_counter() - start
    print_plan(result)
    result.save(args.output)
    console.print(f"\nwrote {args.output}  (planned in {wall:.2f} s)")
    return 0


def _space(args: argparse.Namespace, model) -> "SearchSpace":
    """The search space the flags allow; a choice that cannot work is one clear error."""
    from partita.search.uniform import SearchSpace

    for tp in args.tp or ():
        why = model.kinds["block"].tp_divides(tp) if tp > 0 else "it must be >= 1"
        if why:
            raise PartitaError(f"--tp {tp}: {why}; choose a degree that divides heads, kv_heads and ffn")
    if any(v < 1 for v in (args.pp or ()) + (args.micro_batch or ())):
        raise PartitaError("--pp and --micro-batch values must be >= 1")
    if any(z > 3 for z in args.zero or ()):
        raise PartitaError(f"--zero {','.join(map(str, args.zero))}: ZeRO levels are 0, 1, 2 and 3")
    return SearchSpace(zero_levels=args.zero or (0, 1, 2, 3),
                       recompute=(False,) if args.no_recompute else (False, True),
                       sequence_parallel=(False,) if args.no_sequence_parallel else (False, True),
                       micro_batches=args.micro_batch, tensor_parallel=args.tp, pipeline=args.pp)


def check(args: argparse.Namespace) -> int:
    from partita.search.costs import CostModel
    from partita.search.evaluate import evaluate_plan
    from partita.validate import validate_plan

    p = Plan.load(args.plan)
    cluster = load_cluster(args.cluster)
    from partita.model import ModelSpec

    model = ModelSpec.from_dict(p.model, where=f"{args.plan}: model")
    validate_plan(p, model, cluster)
    cm = CostModel(model, cluster, seq_len=p.seq_len, dtype=p.dtype, profiles=_profiles(args.profile))
    ev = evaluate_plan(p, cm)
    console.print(f"{args.plan}: valid for {model.name} on {cluster.short}; "
                  f"predicted step {fmt_seconds(ev.step_time_s)}")
    over = [s for s in ev.stages if s.peak_bytes > s.capacity]
    for i, s in enumerate(ev.stages):
        console.print(f"  stage {i}: peak {fmt_bytes(s.peak_bytes)} of {fmt_bytes(s.capacity)}")
    if over:
        worst = max(ev.stages, key=lambda s: s.peak_bytes / s.capacity)
        raise InfeasibleError(f"the plan does not fit: a device needs {fmt_bytes(worst.peak_bytes)} of "
                              f"{fmt_bytes(worst.capacity)}; re-plan, or add recompute / ZeRO-3 / a smaller micro-batch")
    return 0


def show(args: argparse.Namespace) -> int:
    print_plan(Plan.load(args.plan))
    return 0


def models() -> int:
    t = Table(title="built-in models")
    for col in ("name", "family", "params", "layers", "hidden", "heads/kv", "ffn", "vocab", "seq"):
        t.add_column(col, justify="right" if col not in ("name", "family") else "left")
    for m in BUILTIN.values():
        t.add_row(m.name, m.family, f"{m.n_params / 1e9:.2f} B" if m.n_params > 1e8 else f"{m.n_params / 1e6:.2f} M",
                  str(m.n_layers), str(m.hidden), f"{m.heads}/{m.kv_heads}", str(m.ffn), str(m.vocab), str(m.seq_len))
    console.print(t)
    console.print("Also: a model YAML file (ModelSpec fields) or a Hugging Face config.json "
                  "(llama, mistral, qwen2, gpt2, gpt_neox).")
    return 0


def devices() -> int:
    t = Table(title="device catalog (datasheet, dense)")
    for col in ("name", "memory", "bf16 TFLOP/s", "fp32 TFLOP/s", "HBM GB/s", "intra-node", "network GB/s", "source"):
        t.add_column(col)
    for d in CATALOG.values():
        t.add_row(d.name, f"{d.memory_bytes / GiB:.0f} GiB", f"{d.bf16_tflops:g}", f"{d.fp32_tflops:g}",
                  f"{d.hbm_gbps:g}", f"{d.intra_link} {d.intra_node_gbps:g} GB/s", f"{d.network_gbps:g}", d.source)
    console.print(t)
    return 0


# ---- showing a plan ---------------------------------------------------------------------
def _strategy_text(s: LayerStrategy) -> str:
    parts = [f"tp{s.tensor_parallel}" if s.tensor_parallel > 1 else "no-tp"]
    if s.sequence_parallel:
        parts.append("sp")
    parts.append(f"zero{s.zero}")
    if s.recompute:
        parts.append("recompute")
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


def print_plan(p: Plan) -> None:
    name = p.model.get("name", "?")
    console.print(f"[bold]{name}[/bold] on [bold]{p.cluster.get('name', '?')}[/bold]: "
                  f"{p.world_size} ranks = dp {p.dp} x tp {p.tp} x pp {p.pp}; seq {p.seq_len}, global batch "
                  f"{p.global_batch} = {p.dp} x micro-batch {p.micro_batch} x {p.num_micro_batches} micro-batches; "
                  f"{p.dtype}, {p.schedule}")
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
        t.add_row(str(s.index), f"{len(s.ranks)}x {s.device} ({s.group})", ranks, f"{blocks} blocks",
                  "\n".join(_runs(s.layers)),
                  fmt_seconds(pred.stage_time_s[s.index]) if pred else "", mem)
    console.print(t)
    if pred is not None:
        console.print(f"predicted step time [bold]{fmt_seconds(pred.step_time_s)}[/bold], "
                      f"{pred.tokens_per_s:,.0f} tokens/s, MFU {100 * pred.mfu:.1f}%  "
                      f"(costs: {', '.join(f'{d} {src}' for d, src in p.cost_sources.items())})")
        parts = [f"{k.replace('_', ' ')} {fmt_seconds(v)}" for k, v in pred.breakdown.items() if v > 0]
        console.print("  per step: " + ", ".join(parts))
    if p.solver is not None:
        r = p.solver
        line = f"search: {r.method}, {r.status}"
        if r.method == "cpsat":
            line += f", gap {100 * r.gap:.2f}% (bound {fmt_seconds(r.bound_us / 1e6)})"
            if r.uniform_objective_us:
                gain = r.uniform_objective_us / r.objective_us if r.objective_us else 1.0
                line += f"; {gain:.3f}x the best uniform plan ({fmt_seconds(r.uniform_objective_us / 1e6)})"
        else:
            line += f", {r.candidates} candidates"
        line += f"; {r.wall_s:.2f} s"
        console.print(line)
