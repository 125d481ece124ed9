"""``partita export PLAN --to megatron|torchtitan|deepspeed``: the plan in the words of the stack
a team already runs, or the closest plan that stack can run, with both priced.

    partita export plan.yaml --to megatron -o megatron.args
    partita export plan.yaml --to torchtitan -o job.toml
    partita export plan.yaml --to deepspeed -o ds_config.json

A plan chooses every layer's strategy; the targets take one setting for all layers (and
DeepSpeed's pipeline one even split). Each target module (``export_megatron``,
``export_torchtitan``, ``export_deepspeed``) says what it can express by listing the plans it
can run that keep the plan's shape (degrees, micro-batching, placement): the plan itself when it
is expressible, else every combination of the settings the target has. The export takes the
plan unchanged when it can; otherwise the fastest variant that fits, priced with Partita's own
cost model (``search/evaluate.py``); with none fitting, the one closest to fitting, said so.
Both predictions and every change are printed, and the file holds the exported plan's settings.

Context parallelism (``cp`` > 1) maps where the target has it (``context_variant``): Megatron
runs all three (``--cp-comm-type a2a`` / ``p2p`` / ``allgather``), torchtitan the ring only, DeepSpeed the
all-to-all only (Ulysses); a plan whose variant the target lacks exports with the other one,
priced, and the change listed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from partita import fileio, parallel
from partita.cluster import ClusterSpec
from partita.errors import InfeasibleError, PartitaError
from partita.model import ModelSpec
from partita.plan import LayerStrategy, Plan
from partita.units import fmt_bytes, fmt_seconds

TARGETS = {"megatron": "partita.cli.export_megatron", "torchtitan": "partita.cli.export_torchtitan",
           "deepspeed": "partita.cli.export_deepspeed"}


@dataclass(frozen=True)
class Export:
    """What an export wrote: the plan the file expresses, the original, and what changed."""

    target: str
    original: Plan  # re-priced with the export's cost model
    exported: Plan  # the plan the file runs, priced the same way
    changes: tuple[str, ...]  # empty: the file expresses the plan exactly
    text: str  # the file's content
    notes: tuple[str, ...] = ()
    fits: bool = True


def target_module(name: str):
    if name not in TARGETS:
        raise PartitaError(f"--to {name!r}: choose {', '.join(TARGETS)}")
    return importlib.import_module(TARGETS[name])


# ---- building the plans a target can run --------------------------------------------------
def is_block(layer: LayerStrategy) -> bool:
    return layer.name.startswith("layers.")


def with_layers(plan: Plan, choose: Callable[[int, int, LayerStrategy], LayerStrategy], *,
                per_chunk: bool = False) -> Plan:
    """The plan with every layer replaced by ``choose(stage index, block index, layer)``: the
    block's place among its stage's blocks (in the order the stage's virtual stages hold them),
    or with ``per_chunk`` among its virtual stage's; -1 for the embedding and the head."""
    stages = []
    for s in plan.stages:
        layers, block = [], 0
        for chunk in s.chunk_layers():
            block = 0 if per_chunk else block
            for layer in chunk:
                layers.append(choose(s.index, block if is_block(layer) else -1, layer))
                block += is_block(layer)
        stages.append(dataclasses.replace(s, layers=tuple(layers)))
    return dataclasses.replace(plan, stages=tuple(stages), prediction=None)


def uniform(plan: Plan, model: ModelSpec, *, sequence_parallel: bool, zero: int,
            recompute: Callable[[int, int], str], per_chunk: bool = False) -> Plan:
    """Every layer alike, as the targets set them: tensor parallel wherever the layer's shapes
    divide the stage's tp (``search.uniform.layer_tp``), one sequence-parallel setting and ZeRO
    level for all, the recompute mode ``recompute(stage, block)`` says (blocks only; the block
    counted per virtual stage with ``per_chunk``)."""
    from partita.search.uniform import layer_tp

    def choose(stage: int, block: int, layer: LayerStrategy) -> LayerStrategy:
        role = "embed" if layer.name == "embed" else "head" if layer.name == "head" else "block"
        tp = layer_tp(model, role, plan.tp)
        return LayerStrategy(name=layer.name, tensor_parallel=tp, sequence_parallel=sequence_parallel and tp > 1,
                             zero=zero, recompute=recompute(stage, block) if block >= 0 else "none")

    return with_layers(plan, choose, per_chunk=per_chunk)


def resplit(plan: Plan, blocks_per_stage: Sequence[int]) -> Plan:
    """A 1F1B plan with the blocks dealt to the stages in these counts, in the model's order (each
    layer keeps its choices; an interleaved plan's virtual stages are merged)."""
    layers = plan.layer_strategies()
    embed = [l for l in layers if l.name == "embed"]
    head = [l for l in layers if l.name == "head"]
    blocks = [l for l in layers if is_block(l)]
    stages, start = [], 0
    for s, count in zip(plan.stages, blocks_per_stage):
        own = blocks[start:start + count]
        start += count
        own = (embed if s.index == 0 else []) + own + (head if s.index == plan.pp - 1 else [])
        stages.append(dataclasses.replace(s, layers=tuple(own), chunks=()))
    return dataclasses.replace(plan, stages=tuple(stages), schedule="1f1b", prediction=None)


def virtual_stages(plan: Plan) -> list[tuple[bool, int, bool]]:
    """(holds the embedding, blocks, holds the head) of every virtual stage in pipeline order
    (one per stage under 1F1B; under an interleaved schedule chunk c of stage i is c * pp + i)."""
    return [(any(l.name == "embed" for l in chunk), sum(1 for l in chunk if is_block(l)),
             any(l.name == "head" for l in chunk)) for chunk in plan.virtual_stage_layers()]


def blocks_per_stage(plan: Plan) -> list[int]:
    return [sum(1 for l in s.layers if is_block(l)) for s in plan.stages]


def same_layers(a: Plan, b: Plan) -> bool:
    return a.schedule == b.schedule and [(s.layers, s.chunks) for s in a.stages] == [(s.layers, s.chunks)
                                                                                  for s in b.stages]


def recompute_counts(plan: Plan, mode: str = "full") -> list[int]:
    """Blocks of each virtual stage recomputed in ``mode``, in pipeline order."""
    return [sum(1 for l in chunk if is_block(l) and l.recompute == mode) for chunk in plan.virtual_stage_layers()]


# ---- choosing and pricing -----------------------------------------------------------------
def context_variant(plan: Plan, model: ModelSpec, runs: Sequence[str], target: str) -> Plan:
    """The plan with a context-parallel variant the target runs (``runs``, in its order of
    preference): the plan's own where the target has it, else the first the model's shapes and
    the sequence allow (``parallel.cp_rule``); with none, an error that says why."""
    if plan.cp == 1 or plan.cp_variant in runs:
        return plan
    reasons = []
    for variant in runs:
        why = parallel.cp_rule(model.kinds["block"], plan.cp, tp=plan.tp, variant=variant, seq_len=plan.seq_len)
        if why is None:
            return dataclasses.replace(plan, cp_variant=variant, prediction=None)
        reasons.append(why)
    raise PartitaError(f"--to {target}: the plan's {_variant(plan.cp_variant)} context parallelism (cp {plan.cp}) is "
                       f"not in {target}, which runs {' or '.join(map(_variant, runs))} only, and {'; '.join(reasons)}; "
                       f"re-plan with --cp-variant {runs[0]} or --cp 1")


def _variant(v: str) -> str:
    return v.replace("_", "-")


def describe_changes(original: Plan, exported: Plan) -> list[str]:
    """Each setting whose values over the layers differ between the two plans, as counts."""
    changes = []
    if original.fp8 != exported.fp8:
        changes.append(f"products {'FP8' if original.fp8 else 'bf16'} -> {'FP8' if exported.fp8 else 'bf16'} "
                       f"({exported.engine} runs them so, as priced)")
    if original.cp > 1 and original.cp_variant != exported.cp_variant:
        changes.append(f"context parallelism (cp {original.cp}) {_variant(original.cp_variant)} -> "
                       f"{_variant(exported.cp_variant)}")
    if original.schedule != exported.schedule or original.virtual_stages != exported.virtual_stages:
        changes.append(f"schedule {_schedule(original)} -> {_schedule(exported)}")
    if blocks_per_stage(original) != blocks_per_stage(exported):
        changes.append(f"blocks per stage {_csv(blocks_per_stage(original))} -> {_csv(blocks_per_stage(exported))}")
    for attr, label in (("tensor_parallel", "tensor parallel"), ("sequence_parallel", "sequence parallel"),
                        ("zero", "ZeRO level"), ("recompute", "recompute")):
        before = [getattr(l, attr) for l in original.layer_strategies()]
        after = [getattr(l, attr) for l in exported.layer_strategies()]
        if before != after:
            changes.append(f"{label}: {_counts(before)} -> {_counts(after)}")
    return changes


def _schedule(p: Plan) -> str:
    return p.schedule + (f" ({p.virtual_stages} virtual stages per rank)" if p.virtual_stages > 1 else "")


def _counts(values: list) -> str:
    c = Counter(values)
    if len(c) == 1:
        return f"{_value(next(iter(c)))} on all {len(values)} layers"
    return ", ".join(f"{_value(v)} on {n}" for v, n in sorted(c.items(), key=lambda kv: str(kv[0])))


def _value(v) -> str:
    return ("on" if v else "off") if isinstance(v, bool) else str(v)


def _csv(values: Iterable[int]) -> str:
    return ",".join(map(str, values))


def closest(plan: Plan, variants: Iterable[Plan], price: Callable[[Plan], Plan]) -> tuple[Plan, bool]:
    """The plan itself if a variant equals it; else the fastest variant that fits; else the one
    closest to fitting. Returns (priced plan, fits)."""
    priced = []
    for v in variants:
        if same_layers(v, plan):
            p = price(v)
            return p, _fits(p)
        priced.append(price(v))
    if not priced:
        raise PartitaError("the target can run no variant of this plan")
    fitting = [p for p in priced if _fits(p)]
    if fitting:
        return min(fitting, key=lambda p: p.prediction.step_time_s), True
    return min(priced, key=_peak_fraction), False


def _peak_fraction(p: Plan) -> float:
    return max(m.peak_bytes / m.capacity_bytes for m in p.prediction.memory)


def _fits(p: Plan) -> bool:
    return _peak_fraction(p) <= 1.0


def export_plan(plan: Plan, target: str, *, profiles: Sequence = (), space=None) -> Export:
    """Price the plan and the closest one the target runs; render the target's file. ``space``
    (a ``search.uniform.SearchSpace``: ``partita plan``'s options) keeps the variants inside it."""
    from partita.search.costs.model import CostModel
    from partita.search.engines import get_engine, plan_engine
    from partita.search.plans import attach_prediction

    mod = target_module(target)
    if plan.mixed_replicas:
        raise PartitaError(f"--to {target}: the plan's data-parallel replicas sit on different device types "
                           f"(replica_groups); {target} runs every replica alike, so export a plan for one node "
                           f"group (partita plan --cluster with that group alone)")
    if len(set(plan.batch_shares)) > 1:
        raise PartitaError(f"--to {target}: the plan gives its data-parallel replicas uneven batch shares "
                           f"{list(plan.batch_shares)}; {target} runs one micro-batch count on every replica, so "
                           f"export a plan with equal shares")
    if len(set(plan.micro_batch_sizes)) > 1:
        raise PartitaError(f"--to {target}: the plan gives its data-parallel replicas different micro-batch sizes "
                           f"({sorted(set(plan.micro_batch_sizes), reverse=True)}); {target} runs one micro-batch size "
                           f"on every replica, so export a plan with equal shares (e.g. re-plan with a global batch "
                           f"that dp {plan.dp} divides)")
    model = ModelSpec.from_dict(plan.model, where="plan: model")
    cluster = plan_cluster(plan)
    # The plan as priced for its own engine; its exports as the target engine runs them.
    original = attach_prediction(plan, CostModel(model, cluster, seq_len=plan.seq_len, dtype=plan.dtype,
                                                 profiles=profiles, engine=plan_engine(plan)))
    fp8 = plan.fp8 and target in parallel.FP8_ENGINES  # another engine runs the products in bf16
    cm = CostModel(model, cluster, seq_len=plan.seq_len, dtype=plan.dtype, profiles=profiles,
                   engine=get_engine(target, fp8))
    price = lambda p: attach_prediction(dataclasses.replace(p, engine=target, fp8=fp8), cm)  # noqa: E731
    variants = list(mod.variants(plan, model))
    if space is not None:
        inside = [v for v in variants if space.leaves(v) is None]
        if not inside:
            raise PartitaError(f"--to {target}: every plan {target} runs in this plan's shape leaves the options "
                               f"(e.g. {space.leaves(variants[0]) if variants else 'no variant at all'})")
        variants = inside
    exported, fits = closest(plan, variants, price)
    notes = list(mod.notes(exported, model, cluster)) + mixed_device_notes(exported, cluster)
    return Export(target=target, original=original, exported=exported,
                  changes=tuple(describe_changes(plan, exported)), text=mod.render(exported, model),
                  notes=tuple(notes), fits=fits)


def mixed_device_notes(plan: Plan, cluster: ClusterSpec) -> list[str]:
    """Stages on different device types run under one config, if the ranks start in stage order."""
    devices = [s.device for s in plan.stages]
    if len(set(devices)) < 2:
        return []
    order = ", ".join(f"stage {s.index}: {s.device} ({s.group}, ranks {s.ranks[0]}-{s.ranks[-1]})" for s in plan.stages)
    return [f"the stages sit on different device types; the target runs them under one config if its pipeline "
            f"ranks start in stage order (pipeline-major rank order): {order}"]


# ---- the command ------------------------------------------------------------------------
def export_command(args: argparse.Namespace) -> int:
    from partita.cli.output import console, writable_output
    from partita.cli.profiles import usable_profiles
    from partita.validate import validate_plan

    mod = target_module(args.to)
    output = writable_output(args.output or str(Path(args.plan).with_name(mod.FILE)), inputs=[args.plan, *args.profile])
    plan = Plan.load(args.plan)
    model = ModelSpec.from_dict(plan.model, where=f"{args.plan}: model")
    cluster = plan_cluster(plan)
    try:
        validate_plan(plan, model, cluster)
    except PartitaError as e:
        raise PartitaError(f"{args.plan}: {e}") from None
    profiles = usable_profiles(args.profile, model, cluster, seq_len=plan.seq_len, dtype=plan.dtype)
    ex = export_plan(plan, args.to, profiles=profiles)
    if not ex.fits:
        peak = max(ex.exported.prediction.memory, key=lambda m: m.peak_bytes / m.capacity_bytes)
        raise InfeasibleError(
            f"--to {args.to}: no plan {args.to} runs in this plan's shape fits: the closest needs "
            f"{fmt_bytes(peak.peak_bytes)} of {fmt_bytes(peak.capacity_bytes)} on stage {peak.stage}; nothing written; "
            f"re-plan for it: partita plan --model {_model_arg(plan)} --cluster {plan.cluster_spec.short} "
            f"--seq-len {plan.seq_len} --global-batch {plan.global_batch} --engine {args.to}")
    fileio.write_text(output, ex.text)
    for line in report_lines(ex):
        console.print(line, markup=False)
    console.print(f"wrote {output}", markup=False)
    return 0


def _model_arg(plan: Plan) -> str:
    """The model as ``partita plan --model`` takes it: a built-in name, or a YAML to write."""
    from partita.model import BUILTIN

    name = plan.model_spec.name
    return name if BUILTIN.get(name) == plan.model_spec else f"MODEL.yaml ({name}, as the plan records it)"


def report_lines(ex: Export) -> list[str]:
    lines = []
    if not ex.changes:
        lines.append(f"{ex.target} expresses the plan exactly")
    else:
        lines.append(f"{ex.target} cannot express the plan as it is; exported the closest plan it runs "
                     f"(same degrees, micro-batching and placement), changed:")
        lines += [f"  {c}" for c in ex.changes]
    engine = ex.original.engine
    for label, p in ((f"plan ({engine})", ex.original), (f"{ex.target} export", ex.exported)):
        pred = p.prediction
        peak = max(pred.memory, key=lambda m: m.peak_bytes / m.capacity_bytes)
        lines.append(f"{label + ':':<20} step {fmt_seconds(pred.step_time_s)}, {pred.tokens_per_s:,.0f} tokens/s, "
                     f"MFU {100 * pred.mfu:.1f}%, peak memory {fmt_bytes(peak.peak_bytes)} of "
                     f"{fmt_bytes(peak.capacity_bytes)} (stage {peak.stage})")
    if ex.changes or engine != ex.target:
        slow = ex.exported.prediction.step_time_s / ex.original.prediction.step_time_s - 1
        priced = f", priced as {ex.target} runs it," if engine != ex.target else ""
        lines.append(f"the export{priced} is predicted {abs(slow) * 100:.1f}% {'slower' if slow >= 0 else 'faster'} "
                     f"than the plan on {engine}")
    lines += [f"note: {n}" for n in ex.notes]
    return lines


def plan_cluster(plan: Plan) -> ClusterSpec:
    """The cluster the plan holds, with the fingerprint it was planned for (as ``partita launch``
    reads it)."""
    return plan.cluster_spec
