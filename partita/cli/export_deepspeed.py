"""A plan as a DeepSpeed JSON config (``deepspeed.initialize(config=...)``).

Every key was checked against DeepSpeed 0.19.8 (PyPI) and is read by its own parser,
``deepspeed.runtime.config.DeepSpeedConfig``: ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps`` (``runtime/constants.py``), ``zero_optimization.stage``
(``runtime/zero/config.py``), ``bf16.enabled`` / ``fp16.enabled`` (``runtime/precision_config.py``),
``activation_checkpointing`` (``runtime/activation_checkpointing/config.py``),
``tensor_parallel.autotp_size`` (``runtime/tensor_parallel/config.py``) and ``pipeline``
(``get_pipeline_config`` in ``runtime/config.py``). ``train_batch_size`` is left for DeepSpeed to
derive (micro-batch x accumulation x data-parallel ranks), so the file holds for the plan's dp
without naming the world size.

What maps how:
  * ZeRO level 0-3 is ``zero_optimization.stage``, one for all layers; DeepSpeed's pipeline
    engine runs ZeRO 0 and 1 only, so a pipelined plan exports with ZeRO <= 1.
  * Tensor parallelism is AutoTP (``tensor_parallel.autotp_size`` = tp), which has no sequence
    parallelism: exported with SP off.
  * Pipeline: stages and micro-batching are set in code, ``PipelineModule(layers, num_stages=pp,
    partition_method="uniform", activation_checkpoint_interval=...)``; the config's ``pipeline``
    section records the stage count. DeepSpeed splits by layer count, not by a given list, so an
    uneven plan exports with the blocks split as evenly as Partita's uniform planner splits them;
    its pipeline engine has no interleaved schedule, so an interleaved plan exports as 1F1B.
  * Recomputation is set by the model code (``deepspeed.checkpointing.checkpoint`` or the
    pipeline's checkpoint interval) for every block or none; ``activation_checkpointing`` holds
    DeepSpeed's options for it. DeepSpeed has no selective recomputation (its checkpointing
    recomputes a whole function): a plan with selectively recomputed blocks exports as the
    faster of none and full that fits, and the change is listed.
  * Context parallelism is Ulysses, DeepSpeed's all-to-all: ``sequence_parallel_size`` = cp and
    ``data_parallel_size`` = dp, which ``deepspeed.initialize`` reads to build its
    ("data_parallel", "sequence_parallel") device mesh (``deepspeed/__init__.py``; the config
    parser also reads ``sequence_parallel_size``, ``runtime/config.py``); the model code wraps its
    attention core in ``deepspeed.sequence.layer.DistributedAttention`` (or
    ``UlyssesSPAttentionHF``) over that mesh's sequence-parallel group, and ZeRO partitions over
    dp x cp (the sequence-data-parallel group), as Partita's. DeepSpeed has no ring: a ring plan
    exports as the all-to-all at the same cp where the heads allow it, priced, the change listed.
    That mesh has no tensor or pipeline axis, so a cp plan exports with tp 1 and pp 1 only.
    Checked against DeepSpeed 0.19.8 and deepspeedai/DeepSpeed edaa7221 (2026-08-22).
"""

from __future__ import annotations

import json
from typing import Iterator

from partita.cluster import ClusterSpec
from partita.errors import PartitaError
from partita.cli.export import blocks_per_stage, context_variant, resplit, uniform
from partita.model import ModelSpec
from partita.plan import Plan

FILE = "deepspeed.json"


# What of a uniform plan DeepSpeed runs as it is (``variants``): every block recomputed or none,
# no sequence parallelism (AutoTP), the pipeline engine's 1F1B (``engine_fit.engine_uniform``).
UNIFORM_SPACE = {"recompute": ("none", "full"), "sequence_parallel": (False,), "schedules": ("1f1b",)}


def variants(plan: Plan, model: ModelSpec) -> Iterator[Plan]:
    from partita.search.uniform import split_blocks

    if model.is_moe:
        raise PartitaError(f"--to deepspeed: a DeepSpeed config cannot give a model experts (DeepSpeed's MoE is a "
                           f"layer of the model's code, deepspeed.moe.layer.MoE with its ep_size), so this JSON would "
                           f"train {model.name} without them; export it --to megatron")
    if plan.cp > 1 and (plan.tp > 1 or plan.pp > 1):
        raise PartitaError(f"--to deepspeed: DeepSpeed's Ulysses mesh is data x sequence parallel only, and the plan "
                           f"has cp {plan.cp} with tp {plan.tp} and pp {plan.pp}; export it --to megatron or torchtitan, "
                           f"or re-plan with --tp 1 --pp 1")
    plan = context_variant(plan, model, ("all_to_all",), "deepspeed")
    zeros = (0, 1) if plan.pp > 1 else (0, 1, 2, 3)
    even = split_blocks(model.n_layers, plan.pp)
    base = plan if blocks_per_stage(plan) == even and plan.virtual_stages == 1 else resplit(plan, even)
    for zero in zeros:
        for recompute in ("none", "full"):
            yield uniform(base, model, sequence_parallel=False, zero=zero, recompute=lambda s, b, r=recompute: r)


def config(plan: Plan, model: ModelSpec) -> dict:
    layers = plan.layer_strategies()
    cfg: dict = {"train_micro_batch_size_per_gpu": plan.micro_batch,
                 "gradient_accumulation_steps": plan.num_micro_batches,
                 "zero_optimization": {"stage": layers[0].zero},
                 "bf16": {"enabled": plan.dtype == "bf16"}, "fp16": {"enabled": plan.dtype == "fp16"}}
    if plan.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": plan.tp}
    if plan.cp > 1:
        cfg |= {"sequence_parallel_size": plan.cp, "data_parallel_size": plan.dp}
    if plan.pp > 1:
        cfg["pipeline"] = {"stages": plan.pp, "partition": "uniform",
                           "activation_checkpoint_interval": 1 if recomputes(layers) else 0}
    if recomputes(layers):
        cfg["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False,
                                           "cpu_checkpointing": False}
    return cfg


def recomputes(layers) -> bool:
    """Whether the (exported, all-or-nothing) plan recomputes its blocks."""
    return any(l.recompute == "full" for l in layers)


def render(plan: Plan, model: ModelSpec) -> str:
    return json.dumps(config(plan, model), indent=2) + "\n"


def notes(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> list[str]:
    out = [f"DeepSpeed derives train_batch_size = {plan.micro_batch} x {plan.num_micro_batches} x data-parallel ranks "
           f"({plan.dp} here: {plan.global_batch})"]
    if recomputes(plan.layer_strategies()):
        out.append("recompute every block in the model code (deepspeed.checkpointing.checkpoint around each block, or "
                   "PipelineModule(activation_checkpoint_interval=1))")
    if plan.cp > 1:
        out.append(f"wrap each block's attention core in deepspeed.sequence.layer.DistributedAttention over the "
                   f"sequence-parallel group of deepspeed.initialize's mesh, and give each rank its 1/{plan.cp} of every "
                   f"sequence")
    if plan.pp > 1:
        out.append(f"build the model as PipelineModule(layers, num_stages={plan.pp}, partition_method='uniform'); "
                   f"blocks per stage {','.join(map(str, blocks_per_stage(plan)))}")
    return out
