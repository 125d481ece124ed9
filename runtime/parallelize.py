"""Applying one stage of a plan to the model, with upstream parts only.

``parallelize_stage`` runs the steps in a fixed order (torchtitan's):

  1. keep the stage's layers, materialise them and initialise each from the seed;
  2. tensor / sequence parallelism per layer (``parallelize_module``, a dict of styles);
  1b. expert parallelism (``apply_expert_parallel``, mixture-of-experts models with ep > 1):
     each MoE block keeps its ep rank's experts (deleted on the meta device, before
     materialising) and dispatches tokens over the ep group (``partita.runtime.experts``);
  2b. context parallelism (``apply_context_parallel``): each attention (and gpt2's position
     table) swapped in place for its sequence-shard class, all-to-all or ring
     (``partita.runtime.context``); names and parameters unchanged, so it must come before
     FSDP2, which swaps classes itself;
  3. activation checkpointing per layer (``checkpoint_wrapper`` around the block, so the
     recomputation replays the block's tensor-parallel layout conversions too; module names
     gain ``._checkpoint_wrapped_module``, which ``torch.distributed.checkpoint`` strips):
     full, or selective (the matrix products' outputs kept, ``selective_context``);
  3b. the (virtual) stages' ends (``apply_stage_ends``): a stage's first and last layer take
     and give hidden states in the layout pipeline stages exchange, outside the recomputation;
  4. FSDP2 per layer at the layer's ZeRO level (``fully_shard``), then the stage root; each
     layer's backward prefetches the layer before it (``set_backward_prefetch``). Under expert
     parallelism a block's experts are a unit of their own first, over the experts' replicas.

Layouts between layers. Inside a tensor-parallel stage the hidden states between two layers
are either replicated over the tensor group ("full") or split along the sequence ("seq", when
the layer uses sequence parallelism). Each layer converts what its predecessor produced into
what it takes (an all-gather, or a free local slice). Pipeline stages exchange plain tensors:
each rank's sequence shard (b, s/tp, h) when the sequence splits tp ways, else the whole
hidden states (``boundary_layout``); a (virtual) stage's first layer takes, and its last layer
gives, that layout (``apply_stage_ends``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from typing import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from partita.plan import LayerStrategy, Plan, Stage, gives_whole
from partita.runtime.mesh import Meshes
from partita.runtime.models import Transformer, materialize
from partita.runtime.tp_linear import mark

FULL, SEQ = "full", "seq"
_LAYOUT = {FULL: Replicate(), SEQ: Shard(1)}


@dataclass
class ShardedLayer:
    """One FSDP2 unit and its ZeRO level, for the per-micro-batch gradient policy."""

    name: str
    module: FSDPModule
    zero: int


# ---- 1. keep the stage's layers -------------------------------------------------------------


def keep_stage_layers(model: Transformer, stage: Stage) -> Transformer:
    """Delete every layer the stage does not own (the model is still on the meta device)."""
    owned = set(stage.layer_names)
    if "embed" not in owned:
        model.embed = None
    if "head" not in owned:
        model.head = None
    for key in list(model.layers):
        if f"layers.{key}" not in owned:
            del model.layers[key]
    return model


# ---- 2. tensor and sequence parallelism -----------------------------------------------------


def _layout(strategy: LayerStrategy) -> str:
    return FULL if gives_whole(strategy.tensor_parallel, strategy.sequence_parallel) else SEQ


def _block_styles(family: str, seq: bool, moe: bool = False) -> dict[str, object]:
    """Megatron's split of a block: q/k/v and the MLP's first matrices by columns, the output
    projections by rows; with sequence parallelism the norms run on sequence shards. A
    mixture-of-experts block (always with sequence parallelism, ``parallel.moe_tp_rule``) splits
    its attention so and runs its MoE on the rank's sequence shard with whole experts: no
    collective of its own (Megatron-LM's expert tensor parallelism of 1)."""
    out = Shard(1) if seq else Replicate()
    styles: dict[str, object] = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=out),
    }
    if not moe:
        styles.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=out)})
        if family == "llama":
            styles["feed_forward.w3"] = ColwiseParallel()
    if seq:
        # Each takes this rank's sequence shard: the column-parallel products gather it themselves
        # (``tp_linear.columns``, marked by ``_mark_columns``); a MoE runs on it.
        local = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                   use_local_output=True)
        styles.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                       "attention": local, "feed_forward": local})
    return styles


def _embed_styles(family: str, seq: bool) -> dict[str, object]:
    # Vocabulary split by rows; llama under sequence parallelism reduce-scatters straight to
    # sequence shards. gpt2 adds replicated learned positions first, then slices.
    direct = seq and family == "llama"
    return {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if direct else Replicate())}


def _head_styles(seq: bool) -> dict[str, object]:
    # The logits stay split by vocabulary (no all-gather): the loss is computed on the shards
    # (``partita.runtime.schedule.LossFunction``, torch's ``loss_parallel``).
    styles: dict[str, object] = {"output": ColwiseParallel(input_layouts=Shard(1) if seq else Replicate(),
                                                          output_layouts=Shard(-1))}
    if seq:
        styles["norm"] = SequenceParallel()
    return styles


def _mark_columns(layer: nn.Module, role: str, group, seq: bool, moe: bool) -> None:
    """The layer's column-parallel products of one input run as one function that reduces the
    input's gradient beside their weight gradients and, under sequence parallelism, gathers the
    shard it keeps (``tp_linear.columns``): a block's q, k, v and its MLP's first products (a
    MoE's run whole on sequence shards), the head's output layer. ``ColwiseParallel`` has
    placed their weights; its input and output hooks no longer run."""
    if role == "embed":
        return
    for owner in [layer] if role == "head" else [layer.attention] + ([] if moe else [layer.feed_forward]):
        mark(owner, group, sequence=seq)


def _convert(src: str, dst: str, *, inputs: bool) -> nn.Module | None:
    if src == dst:
        return None
    if inputs:
        return PrepareModuleInput(input_layouts=(_LAYOUT[src],), desired_input_layouts=(_LAYOUT[dst],),
                                  use_local_output=True)
    return PrepareModuleOutput(output_layouts=(_LAYOUT[src],), desired_output_layouts=(_LAYOUT[dst],),
                               use_local_output=True)


def _layer_styles(role: str, family: str, seq: bool, moe: bool = False) -> dict[str, object]:
    if role == "embed":
        return _embed_styles(family, seq)
    if role == "head":
        return _head_styles(seq)
    return _block_styles(family, seq, moe)


def boundary_layout(plan: Plan) -> str:
    """The layout hidden states cross a stage boundary in under ``plan.tp > 1``: this rank's
    sequence shard (SEQ) when the tokens a rank holds split tp ways (``Plan.boundary_split``),
    else whole (FULL)."""
    return SEQ if plan.boundary_split > 1 else FULL


def _takes_gives(strategy: LayerStrategy, role: str) -> tuple[str, str]:
    """The layout a layer takes its input in and gives its output in: the embedding takes
    tokens, the head gives (vocab-split) logits."""
    layout = _layout(strategy)
    return (FULL if role == "embed" else layout), (FULL if role == "head" else layout)


def apply_tensor_parallel(model: Transformer, stage: Stage, meshes: Meshes) -> None:
    """Per-layer TP/SP styles, plus the layout conversions between neighbouring layers of each
    (virtual) stage. What a stage's ends take and give is ``apply_stage_ends``'s."""
    mesh = meshes.tp
    family = model.spec.family
    for chunk in stage.chunk_layers():
        previous = None  # the chunk's first layer: converted at the stage's end (apply_stage_ends)
        for strategy in chunk:
            layer = model.get_submodule(strategy.name)
            role = model.spec.role_of(strategy.name)
            takes, gives = _takes_gives(strategy, role)
            if strategy.tensor_parallel > 1:
                seq = _layout(strategy) == SEQ
                parallelize_module(layer, mesh, _layer_styles(role, family, seq, model.spec.is_moe))
                _mark_columns(layer, role, mesh.get_group(), seq, model.spec.is_moe)
            convert_in = _convert(previous, takes, inputs=True) if previous is not None else None
            if convert_in is not None:  # a hook on the layer itself, so recomputation replays it
                parallelize_module(layer, mesh, convert_in)
            if role == "embed" and gives == SEQ and family != "llama":  # positions are added whole, then split
                parallelize_module(layer, mesh, _convert(FULL, SEQ, inputs=False))
            previous = gives
    if model.spec.tie_embeddings and model.embed is not None and model.head is not None:
        model.head.output.weight = model.embed.tok.weight  # TP replaced both; tie them again


# ---- 3. activation checkpointing ------------------------------------------------------------


# What a selectively recomputed block keeps from its forward: the outputs of its matrix products
# (``nn.Linear`` dispatches ``mm``, or ``addmm`` with a bias; DTensor's local shards included),
# but the last one's (w2, the MLP's down projection). Its other ops are recomputed in backward
# from them and from the block's input: norms, rotary, the attention core (SDPA), activation
# functions, residual adds, and the tensor-parallel collectives (the sequence-parallel
# all-gathers of the norm outputs among them). The last product's output feeds only the final
# residual add, and the recomputation stops before it runs (torch's early stop: w2's inputs are
# the last tensors the backward needs), so keeping it would hold t*h elements for nothing. The
# cost model prices exactly this (``search/analytic.activation_bytes``,
# ``selective_recompute_time_s``).
SELECTIVE_SAVED_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


# The profiler's record_function markers are not computation: FSDP2 units inside a recomputed
# block (a MoE's experts under ep, tp or cp) mark their hooks with them, and a unit whose
# parameters are still gathered marks more of them in the recomputation than in the forward
# (ZeRO 1: measured, "record_function invocation index 2 ... not found in storage"). SAC runs
# the ops of this public set directly, uncounted.
torch.utils.checkpoint.SAC_IGNORED_OPS.update(
    {torch.ops.profiler._record_function_enter.default, torch.ops.profiler._record_function_enter_new.default,
     torch.ops.profiler._record_function_exit.default, torch.ops.profiler._record_function_exit._RecordFunction})


def selective_context(products: int):
    """The pair of contexts (forward, recomputation) of one selectively checkpointed call of a
    block with ``products`` matrix products: keep the outputs of all but the last, in the order
    the forward runs them, and recompute every other op. Fresh counters per call: the policy
    must decide alike for an op in the forward and in its recomputation."""
    counts = {False: 0, True: 0}  # products seen, by ctx.is_recompute

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op not in SELECTIVE_SAVED_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        index = counts[ctx.is_recompute]
        counts[ctx.is_recompute] += 1
        return CheckpointPolicy.MUST_SAVE if index < products - 1 else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_recompute(model: Transformer, stage: Stage) -> None:
    """Recomputation of the layers the plan marks: "full" drops a block's activations after
    forward and recomputes its forward in backward; "selective" keeps its matrix products'
    outputs (``selective_context``) and recomputes the rest (torch's selective activation
    checkpointing). (The composable ``checkpoint`` would keep module names but recomputes from
    inputs already converted by a tensor-parallel input hook.)"""
    for strategy in stage.layers:
        if strategy.recompute == "none":
            continue
        parent, _, child = strategy.name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        layer = getattr(owner, child)
        kwargs = {}
        if strategy.recompute == "selective":
            products = sum(isinstance(m, nn.Linear) for m in layer.modules())
            kwargs["context_fn"] = partial(selective_context, products)
        setattr(owner, child, checkpoint_wrapper(layer, preserve_rng_state=False, **kwargs))


# ---- 3b. the stage's ends --------------------------------------------------------------------


def apply_stage_ends(model: Transformer, stage: Stage, meshes: Meshes, boundary: str) -> None:
    """Each (virtual) stage takes hidden states in the ``boundary`` layout and hands them on in
    it (``boundary_layout``): its first layer (not the embedding, which takes tokens) converts
    what it receives, its last (not the head) what it gives.

    Under SEQ a boundary carries this rank's 1/tp of the activation each way. A
    sequence-parallel end converts nothing; a first layer that takes whole hidden states
    all-gathers its input in forward (its input gradient, replicated over the tensor group, is
    sliced for free), and a last layer that gives them slices its output for free (a copy: the
    whole output is freed) and all-gathers the output gradient in backward. One gather a side
    at most, as Megatron-LM's scatter/gather of pipeline sends; ``search.costs.stage.boundary_gathers``
    prices exactly these. After activation checkpointing, on the checkpoint wrapper: the
    conversion runs once, outside the recomputed region, which keeps the gathered input as
    the layer's input (what the memory model counts) rather than gathering it again."""
    mesh = meshes.tp
    for chunk in stage.chunk_layers():
        first, last = chunk[0], chunk[-1]
        first_role, last_role = model.spec.role_of(first.name), model.spec.role_of(last.name)
        convert_in = _convert(boundary, _takes_gives(first, first_role)[0], inputs=True)
        if first_role != "embed" and convert_in is not None:
            parallelize_module(model.get_submodule(first.name), mesh, convert_in)
        convert_out = _convert(_takes_gives(last, last_role)[1], boundary, inputs=False)
        if last_role != "head" and convert_out is not None:
            parallelize_module(model.get_submodule(last.name), mesh, convert_out)


# ---- 4. FSDP2 per layer ----------------------------------------------------------------------


def apply_fsdp(model: Transformer, stage: Stage, meshes: Meshes, mp_policy: MixedPrecisionPolicy) -> list[ShardedLayer]:
    """Each layer its own FSDP2 unit at its ZeRO level; the stage root last.

      zero 0: hybrid mode over (dp, dp_shard=1): replicated weights, all-reduced gradients;
      zero 1 and 2: sharded, kept gathered from forward to backward (reshard_after_forward=False);
      zero 3: sharded, gathered again for backward (reshard_after_forward=True).
    When gradients are reduced (every micro-batch for 2/3, the last for 0/1) is set per
    micro-batch by ``set_gradient_sync``.
    """
    tied = model.spec.tie_embeddings
    units = []
    for strategy in stage.layers:
        if tied and strategy.name in ("embed", "head"):
            continue  # the tied pair shares a weight: it lives in the root unit (checked before)
        layer = model.get_submodule(strategy.name)
        if meshes.expert_parallel or (model.spec.is_moe and meshes.sequence_split):
            units += _shard_experts(layer, strategy, meshes, mp_policy)
        mesh = meshes.dp_replicate if strategy.zero == 0 else meshes.dp
        fully_shard(layer, mesh=mesh, reshard_after_forward=strategy.zero == 3, mp_policy=mp_policy)
        units.append(ShardedLayer(name=strategy.name, module=layer, zero=strategy.zero))
    root_zero = next((s.zero for s in stage.layers if s.name in ("embed", "head")), 3) if tied else 3
    root_mesh = meshes.dp_replicate if root_zero == 0 else meshes.dp
    fully_shard(model, mesh=root_mesh, reshard_after_forward=root_zero == 3, mp_policy=mp_policy)
    if meshes.pp.size() > 1 or len(stage.chunk_layers()) > 1:
        set_backward_prefetch(model, stage, units)
    units.append(ShardedLayer(name="", module=model, zero=root_zero))
    return units


def _shard_experts(layer: nn.Module, strategy: LayerStrategy, meshes: Meshes,
                   mp_policy: MixedPrecisionPolicy) -> list[ShardedLayer]:
    """A block's MoE weights as FSDP2 units of their own at the block's ZeRO level: under expert
    parallelism its experts over their replicas (``Meshes.expert_dp``), and when the sequence is
    split (tp or cp > 1) the whole MoE over ``Meshes.moe_dp`` (its router and shared expert; its
    experts too without ep), since each of the cp x tp ranks of a sequence computes their
    gradient on its own tokens. Each unit sums its ranks' gradients and divides by dp x cp, as the
    dense parameters' average does: an expert's gradient already sums its ep group's tokens, and
    the tp ranks' parts add up to the gradient of their sequences (torchtitan's expert FSDP
    divides alike)."""
    from partita.runtime.models import MoE

    units = []
    for moe in [m for m in layer.modules() if isinstance(m, MoE)]:
        parts = []
        if meshes.expert_parallel:
            parts.append((moe.experts, "experts", meshes.expert_dp_replicate if strategy.zero == 0 else meshes.expert_dp))
        if meshes.sequence_split:
            parts.append((moe, "moe", meshes.moe_dp_replicate if strategy.zero == 0 else meshes.moe_dp))
        for module, what, mesh in parts:
            fully_shard(module, mesh=mesh, reshard_after_forward=strategy.zero == 3, mp_policy=mp_policy)
            _divide_gradients(module, mesh, float(meshes.dp.size()), hybrid=strategy.zero == 0)
            name = f"{strategy.name}.experts" if what == "experts" else f"{strategy.name}.feed_forward"
            units.append(ShardedLayer(name=name, module=module, zero=strategy.zero))
    return units


def _divide_gradients(module: FSDPModule, mesh, factor: float, *, hybrid: bool) -> None:
    """A unit's reduced gradient is the sum over ``mesh`` divided by ``factor``. Sharded: FSDP2's
    own divide factor, the reduction forced to a sum (gloo has no PREMUL_SUM; on one rank torch
    divides without a collective, and would divide twice). Hybrid mode (ZeRO 0, one-rank shards):
    FSDP2 applies a custom factor twice there (its one-rank copy, then the post-division: a
    gradient 1/factor too small, measured with ep 2 x dp_rep 2), so it averages over the mesh and
    an all-reduce hook rescales the average to the sum / ``factor``."""
    if hybrid:
        scale = mesh.size() / factor
        if scale != 1.0:
            module.set_all_reduce_hook(lambda grad: grad.mul_(scale))
        return
    module.set_gradient_divide_factor(factor)
    if mesh.size() > 1:
        module.set_force_sum_reduction_for_comms(True)


def set_backward_prefetch(root: FSDPModule, stage: Stage, units: list[ShardedLayer]) -> None:
    """Each layer's backward prefetches the layer before it in its (virtual) stage, which a
    ZeRO-3 layer has to gather again (the others keep theirs: a no-op). A chunk's first layer
    names the stage root, which FSDP2 keeps gathered from forward to backward: nothing to do.

    FSDP2's own choice replays the order of the forwards since the last backward; a pipeline
    schedule interleaves micro-batches there, so the stage's first layer would gather the last
    one of another micro-batch for nothing (an all-gather no plan prices), and the backwards
    after the last forward would prefetch nothing at all. Set for pipelined stages only: without
    a pipeline FSDP2's order is already this one, and setting it anyway made the moment of a
    ZeRO-3 stage's backward peak depend on thread timing on CPU ranks (gathered copy and
    gradient temporaries swapping places; 1 failure in 6 runs under load)."""
    by_name = {u.name: u.module for u in units}
    for chunk in stage.chunk_layers():
        previous = root
        for strategy in chunk:
            module = by_name.get(strategy.name)
            if module is None:
                continue  # a tied embedding or head: its weight is in the root
            module.set_modules_to_backward_prefetch([previous])
            previous = module


def set_gradient_sync(units: list[ShardedLayer], *, last_micro_batch: bool) -> None:
    """ZeRO 0/1 accumulate full gradients and reduce once, at the last micro-batch; ZeRO 2/3
    reduce-scatter every micro-batch."""
    for unit in units:
        sync = unit.zero >= 2 or last_micro_batch
        unit.module.set_requires_gradient_sync(sync, recurse=False)
        unit.module.set_reshard_after_backward(unit.zero >= 2 or last_micro_batch, recurse=False)


# ---- 2b. context parallelism ------------------------------------------------------------------

# The token layout of an all-to-all plan's shards: contiguous works for any sequence that splits
# cp ways (the all-to-all needs no load balancing); the ring always uses torch's head_tail.
ALL_TO_ALL_LAYOUT = "contiguous"
CP_LAYOUT = {"all_to_all": ALL_TO_ALL_LAYOUT, "all_gather": "head_tail"}  # the tokens a rank holds, by variant


def apply_context_parallel(model: Transformer, plan: Plan, meshes: Meshes) -> None:
    """Every attention of the stage on this rank's sequence shard over the plan's cp group."""
    from partita.runtime.context import apply_all_gather, apply_all_to_all, apply_ring

    if plan.cp_variant == "ring":
        apply_ring(model, meshes.cp)
    elif plan.cp_variant == "all_gather":
        apply_all_gather(model, meshes.cp, layout=CP_LAYOUT["all_gather"])
    else:
        apply_all_to_all(model, meshes.cp, tp=plan.tp, layout=ALL_TO_ALL_LAYOUT)


# ---- all of it, in order ---------------------------------------------------------------------


def parallelize_stage(model: Transformer, plan: Plan, meshes: Meshes, *, device: torch.device, seed: int,
                      mp_policy: MixedPrecisionPolicy | None, use_fsdp: bool,
                      init: Callable[[Transformer], None] | None = None) -> list[ShardedLayer]:
    """Turn the full meta model into this rank's part of the plan. Returns the FSDP2 units.
    ``init`` fills the stage's layers once they are whole, before anything shards them (the
    weights of ``--init-from``: ``hf_weights.load_into``)."""
    stage = meshes.place.stage
    keep_stage_layers(model, stage)
    if plan.ep > 1:
        from partita.runtime.experts import apply_expert_parallel

        apply_expert_parallel(model, meshes)
    materialize(model, device=device, seed=seed)  # full layers: identical on every rank of the stage
    if init is not None:
        init(model)
    if plan.tp > 1:
        apply_tensor_parallel(model, stage, meshes)
    if plan.cp > 1:
        apply_context_parallel(model, plan, meshes)
    if model.spec.is_moe and meshes.sequence_split:
        from partita.runtime.experts import apply_sequence_split

        apply_sequence_split(model, meshes)
    apply_recompute(model, stage)
    if plan.tp > 1:
        apply_stage_ends(model, stage, meshes, boundary_layout(plan))
    if not use_fsdp:
        return []
    return apply_fsdp(model, stage, meshes, mp_policy or MixedPrecisionPolicy())
