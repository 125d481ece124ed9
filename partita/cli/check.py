"""``partita check``, ``partita show``, ``partita models`` and ``partita devices``: reading a
plan (validated first: a hand edit that breaks it is refused, not shown) and the catalogs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from partita import parallel
from partita.cli import jsonout
from partita.cli.output import console
from partita.cli.plan import idle_devices_note
from partita.cli.profiles import usable_profiles
from partita.cli.pricing import cost_lines, parse_tokens, training_cost
from partita.cli.printing import params_text, print_plan
from partita.cluster import ClusterSpec, load_cluster, same_hardware
from partita.devices import CATALOG, PRICE_SOURCE
from partita.errors import InfeasibleError, PartitaError
from partita.model import BUILTIN, ModelSpec
from partita.plan import Plan
from partita.units import GiB, fmt_bytes, fmt_seconds


def check(args: argparse.Namespace) -> int:
    from partita.search.costs.model import CostModel
    from partita.search.engines import plan_engine
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
    cm = CostModel(model, cluster, seq_len=p.seq_len, dtype=p.dtype, profiles=profiles, engine=plan_engine(p))
    ev = evaluate_plan(p, cm)
    over = [i for i, s in enumerate(ev.stages) if s.peak_bytes > s.capacity]
    if getattr(args, "json", False):
        jsonout.emit(jsonout.check_output(path=args.plan, model=model.name, cluster=cluster.short,
                                          step_time_s=ev.step_time_s,
                                          stages=[(s.peak_bytes, s.capacity) for s in ev.stages]))
    if over:
        raise InfeasibleError(_overflow_text(p, ev.stages, over, args.plan, f"{cluster.short}{same}"))
    if not getattr(args, "json", False):
        console.print(f"{args.plan}: valid for {model.name} on {cluster.short}{same}; "
                      f"predicted step {fmt_seconds(ev.step_time_s)}")
        for i, s in enumerate(ev.stages):
            console.print(f"  stage {i}: peak {fmt_bytes(s.peak_bytes)} of {fmt_bytes(s.capacity)}")
    return 0


def _overflow_text(p: Plan, stages, over: list[int], path: str, where: str) -> str:
    """One line: the plan does not fit, naming the stage that overflows most and by how much."""
    worst = max(over, key=lambda i: stages[i].peak_bytes / stages[i].capacity)
    s = stages[worst]
    more = f" (and {len(over) - 1} more stage{'s' if len(over) > 2 else ''})" if len(over) > 1 else ""
    return (f"{path}: does not fit on {where}: stage {worst} needs {fmt_bytes(s.peak_bytes)} per device, more than "
            f"the {fmt_bytes(s.capacity)} of its {p.stages[worst].device}{more}; re-plan with `partita plan` for this "
            f"cluster")


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
    from partita.cli.report import REPORT_FORMATS, TIMELINE_FORMATS, output_path

    out = {}
    if getattr(args, "timeline", None):
        out["timeline"] = output_path("--timeline", args.timeline, TIMELINE_FORMATS, inputs=_inputs(args))
    if getattr(args, "report", None):
        out["report"] = output_path("--report", args.report, REPORT_FORMATS, inputs=_inputs(args))
    return out


def _inputs(args: argparse.Namespace) -> list[str]:
    """The files a command reads (a plan, a model, a cluster, profiles), none of which it may write."""
    return [v for v in (getattr(args, "plan", None), getattr(args, "model", None), getattr(args, "cluster", None),
                        *(getattr(args, "profile", None) or ())) if isinstance(v, str)]


def write_pictures(p: Plan, cluster: ClusterSpec, pictures: dict[str, Path], *, source: str) -> None:
    from partita.cli.report import write_report, write_timeline

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
        jsonout.emit(jsonout.models_output())
        return 0
    t = Table(title="built-in models")
    for col in ("name", "family", "params", "layers", "hidden", "heads/kv", "ffn", "vocab", "seq", "cp all-to-all"):
        t.add_column(col, justify="right" if col not in ("name", "family") else "left")
    for m in BUILTIN.values():
        # The context-parallel degrees the all-to-all variant allows at tp 1 (the ring: any).
        cps = [c for c in (2, 4, 8, 16, 32) if parallel.cp_rule(m.kinds["block"], c, seq_len=m.seq_len * c) is None]
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
        jsonout.emit(jsonout.devices_output())
        return 0
    t = Table(title="device catalog (datasheet, dense)")
    for col in ("name", "memory", "bf16 TFLOP/s", "fp8 TFLOP/s", "fp32 TFLOP/s", "HBM GB/s", "intra-node", "network GB/s",
                "$/GPU-hour", "source"):
        t.add_column(col, no_wrap=col in ("name", "memory"))
    for d in CATALOG.values():
        t.add_row(d.name, f"{d.memory_bytes / GiB:.2f} GiB" + (f" ({d.datasheet_gb:g} GB)" if d.datasheet_gb else ""), f"{d.bf16_tflops:g}",
                  f"{d.fp8_tflops:g}" if d.fp8_tflops else "-", f"{d.fp32_tflops:g}", f"{d.hbm_gbps:g}", f"{d.intra_link} {d.intra_node_gbps:g} GB/s", f"{d.network_gbps:g}",
                  f"{d.price_per_gpu_hour:g}" if d.price_per_gpu_hour is not None else "-", d.source)
    console.print(t)
    console.print(f"prices: {PRICE_SOURCE}; a node group's price_per_gpu_hour in a cluster YAML overrides them")
    return 0
