"""How a plan is shown to people: its summary line, the stage table with per-layer choices,
memory per device, the search's report, and the K best plans side by side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from rich.table import Table

from partita.cli.jsonout import plan_summary
from partita.cli.output import console
from partita.cli.pricing import TrainingCost, fmt_duration
from partita.plan import LayerStrategy, Plan, StageMemory
from partita.units import fmt_bytes, fmt_seconds


def print_alternatives(plans: "list[tuple[Path, Plan, TrainingCost | None]]", top: int) -> None:
    """The K plans side by side: shape, placement, prediction (and with --tokens the time and cost
    of training), and the file each is in."""
    priced = plans[0][2] is not None
    t = Table(title=f"the best plans of {len(plans)} shapes (--top {top})", title_justify="left", box=None,
              padding=(0, 1))
    cols = ["#", "degrees", "micro-batch", "groups", "blocks/stage", "step", "tokens/s", "MFU", "memory"]
    cols += ["time", "GPU-hours", "cost"] if priced else []
    for col in cols + ["search", "file"]:
        t.add_column(col, justify="right" if col in ("#", "step", "tokens/s", "MFU", "memory", "time", "GPU-hours",
                                                     "cost") else "left")
    for i, (path, p, cost) in enumerate(plans):
        s = plan_summary(p)
        counts = list(p.batch_shares) if uneven_shares(p) else p.num_micro_batches  # per replica
        sizes = "/".join(map(str, sorted(set(p.micro_batch_sizes), reverse=True))) if uneven_sizes(p) else p.micro_batch
        row = [str(i + 1), p.mesh.factors(), f"{sizes} x {counts}",
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
    cp = f" (cp {p.cp_variant.replace('_', '-')})" if p.cp > 1 else ""
    console.print(f"[bold]{name}[/bold] on [bold]{p.cluster.get('name', '?')}[/bold]: "
                  f"{p.mesh.describe()}{cp}; seq {p.seq_len}, global batch "
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
                      f"{pred.tokens_per_s:,.0f} tokens/s, MFU {100 * pred.mfu:.1f}%"
                      + (" of the bf16 peak" if p.fp8 else "")
                      + f"  (costs: {', '.join(f'{d} {src}' for d, src in p.cost_sources.items())}; "
                      f"engine: {p.engine}{', FP8 products' if p.fp8 else ''})")
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
                if gain < 1 and p.engine != "partita":  # after an engine's fit (cli/engine_fit.py): not one it runs
                    line += f", which {p.engine} does not run as it is"
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
    chosen = next((o for o in options if o.cp == p.cp and o.variant == p.cp_variant and o.fits and o.tp == p.tp), None)
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
            why = "for memory: " if chosen.recomputed_blocks < base.recomputed_blocks else ""
            faster = base.objective_us / chosen.objective_us if chosen.objective_us else 1.0
            lines.append(f"  cp {p.cp} chosen {why}{faster:.2f}x faster than cp 1; {tokens}, so it recomputes "
                         f"{chosen.recomputed_blocks} blocks at tp {chosen.tp} where cp 1 recomputes "
                         f"{base.recomputed_blocks} at tp {base.tp}")
    elif p.cp == 1 and len(options) > 1:
        lines.append("  cp 1 chosen: no context-parallel plan is faster")
    return lines


def print_memory(p: Plan) -> None:
    """Each stage's predicted peak on one device, by what holds it (categories no stage uses are left out)."""
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
