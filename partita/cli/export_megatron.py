"""A plan as Megatron-LM command-line arguments (``pretrain_gpt.py``), one flag a line.

Every flag was checked against Megatron-LM's source, NVIDIA/Megatron-LM at commit
d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22): ``megatron/training/arguments.py``
declares some flags itself and builds the rest from config dataclasses, one ``--field-name`` per
field (``megatron/training/argument_utils.py``, ``ArgumentGroupFactory._format_arg_name``):

  * ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``, ``--sequence-parallel``,
    ``--bf16``/``--fp16``: ``ModelParallelConfig`` (``megatron/core/model_parallel_config.py``);
  * ``--num-layers``, ``--hidden-size``, ``--ffn-hidden-size``, ``--num-attention-heads``,
    ``--num-query-groups``, ``--normalization``, ``--recompute-granularity``, ``--recompute-method``,
    ``--recompute-num-layers``, ``--recompute-modules`` (a list, ``nargs="+"``),
    ``--disable-bias-linear`` (the name ``add_bias_linear`` declares):
    ``TransformerConfig`` (``megatron/core/transformer/transformer_config.py``);
  * ``--micro-batch-size``, ``--global-batch-size``: ``TrainingConfig``; ``--vocab-size``:
    ``TokenizerConfig`` (``megatron/training/config/training_config.py``);
  * ``--group-query-attention``, ``--max-position-embeddings``, ``--position-embedding-type``,
    ``--swiglu``, ``--untie-embeddings-and-output-weights`` (``_add_network_size_args``),
    ``--seq-length`` (``_add_data_args``), ``--use-distributed-optimizer``, ``--use-megatron-fsdp``
    (``common_config.py``), ``--data-parallel-sharding-strategy`` and
    ``--pipeline-model-parallel-layout`` (``_add_distributed_args``);
  * ``--rotary-base`` and ``--make-vocab-size-divisible-by`` (``_add_network_size_args``);
    ``--attention-dropout``, ``--hidden-dropout``, ``--norm-epsilon``, ``--add-qkv-bias`` and the
    experts' ``--moe-router-topk``, ``--moe-ffn-hidden-size``, ``--moe-aux-loss-coeff``,
    ``--moe-router-load-balancing-type``, ``--moe-token-dispatcher-type``,
    ``--moe-shared-expert-intermediate-size``, ``--moe-shared-expert-gate``: ``TransformerConfig``;
    ``--expert-model-parallel-size``, ``--expert-tensor-parallel-size``: ``ModelParallelConfig``;
    ``--num-experts`` (``_add_moe_args``; the field ``num_moe_experts`` is excluded from the factory);
  * ``--context-parallel-size`` (``ModelParallelConfig.context_parallel_size``, through the same
    factory) and ``--cp-comm-type`` (declared in ``_add_distributed_args``, ``nargs="+"``: "p2p",
    "a2a", "allgather" or "a2a+p2p", one for all layers or one per layer; the field
    ``TransformerConfig.cp_comm_type``).

What maps how:
  * ZeRO 1 is the distributed optimizer; ZeRO 2 and 3 are Megatron-FSDP with sharding strategy
    ``optim_grads`` and ``optim_grads_params`` (v1 needs the distributed optimizer too, and
    ``validate_args`` the ``--ckpt-format fsdp_dtensor`` checkpoints, ``CheckpointConfig``). Megatron-FSDP
    is exported without pipeline parallelism only (pp = 1): its v2 refuses pp > 1
    (``megatron/core/distributed/fsdp/mcore_fsdp_adapter.py``), and v1 is not trusted with it here.
  * Full recomputation is ``--recompute-granularity full``: ``--recompute-method uniform
    --recompute-num-layers 1`` recomputes every block; ``block`` with N recomputes the first N
    blocks of every pipeline stage. Embedding and head are never recomputed. Selective
    recomputation is ``--recompute-granularity selective``, which Megatron applies to every
    block (``TransformerConfig.recompute_granularity``: "'selective' always uses all layers"),
    with ``--recompute-modules core_attn``, its default module: the attention core alone is rerun
    and everything else kept, as the megatron engine prices selective recomputation
    (search/engines.py, ``selective_scope``; Korthikanti et al. 2022). Partita's runtime reruns
    more (the norms and the MLP's activation too) and keeps less: the export is priced as
    Megatron runs it, beside the plan on its own engine.
  * An uneven split is ``--pipeline-model-parallel-layout`` (``E`` embedding, ``t`` a block, ``L``
    the loss with the output layer, stages split by ``|``; parsed by
    ``megatron/core/transformer/pipeline_parallel_layer_layout.py``); an even one needs no flag.
    An interleaved plan (v virtual stages per rank) is the same argument with pp x v entries in
    pipeline order (Megatron derives its virtual pipeline size from it and runs its interleaved
    1F1B schedule); the block recompute rule then counts blocks per virtual stage.
  * Megatron sets tensor and sequence parallelism, the ZeRO level and the recompute rule once
    for all layers: a plan whose layers differ exports as the closest plan with one setting.
  * Context parallelism: ``--context-parallel-size`` = cp with ``--cp-comm-type a2a`` for the
    all-to-all ("Like DeepSpeed Ulysses, scatter attention heads across the CP group",
    ``TransformerConfig.cp_comm_type``) or ``p2p`` for the ring (K/V chunks passed around the
    ring, overlapped with the attention: the ring Partita prices, rotate "alltoall"). Megatron's
    rank order (``--order`` default tp-cp-ep-dp-pp) puts tp innermost and cp next, as Partita's
    stages do; its distributed optimizer and FSDP shard over dp x cp, as Partita's ZeRO does.
    ``validate_args`` requires the sequence divisible by 2 x cp for either type (its load-balanced
    layout), which the export checks.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from partita.cluster import ClusterSpec
from partita.errors import PartitaError
from partita.cli.export import blocks_per_stage, context_variant, is_block, recompute_counts, resplit, uniform, virtual_stages
from partita.model import MOE_AUX_LOSS_COEF, ModelSpec
from partita.plan import Plan

FILE = "megatron.args"
MEGATRON_VERSION = "NVIDIA/Megatron-LM d98e8a64 (2026-08-22)"  # the source every flag was checked against
FSDP_STRATEGY = {2: "optim_grads", 3: "optim_grads_params"}
SELECTIVE_MODULES = ("core_attn",)  # TransformerConfig.recompute_modules' default: the megatron engine's selective scope
CP_COMM_TYPE = {"all_to_all": "a2a", "ring": "p2p", "all_gather": "allgather"}  # --cp-comm-type by Partita's cp_variant


def variants(plan: Plan, model: ModelSpec) -> Iterator[Plan]:
    """Every plan of this shape Megatron runs: one SP setting, one ZeRO level, the first N blocks
    of each stage recomputed, or every block selectively."""
    # Megatron has no zero-bubble schedule: interleaved zero-bubble becomes interleaved 1F1B on
    # the same virtual stages, ZB-V (a V over the ranks) plain 1F1B with the same blocks per stage.
    if plan.schedule == "interleaved-zb":
        plan = dataclasses.replace(plan, schedule="interleaved-1f1b", prediction=None)
    elif plan.schedule == "zbv":
        plan = resplit(plan, blocks_per_stage(plan))
    if plan.cp > 1 and plan.seq_len % (2 * plan.cp):
        raise PartitaError(f"--to megatron: Megatron needs the sequence length ({plan.seq_len}) divisible by 2 x cp = "
                           f"{2 * plan.cp} for context parallelism (validate_args); re-plan with a sequence length it "
                           f"divides, or a smaller --cp")
    plan = context_variant(plan, model, tuple(CP_COMM_TYPE), "megatron")
    most = max(n for _, n, _ in virtual_stages(plan))
    sps = (False, True) if plan.tp > 1 else (False,)
    zeros = (0, 1, 2, 3) if plan.pp == 1 else (0, 1)
    per_chunk = plan.virtual_stages > 1  # Megatron recomputes per model chunk (virtual stage)
    for sp in sps:
        for zero in zeros:
            for n in range(most + 1):
                yield uniform(plan, model, sequence_parallel=sp, zero=zero,
                              recompute=lambda s, b, n=n: "full" if b < n else "none", per_chunk=per_chunk)
            yield uniform(plan, model, sequence_parallel=sp, zero=zero, recompute=lambda s, b: "selective")


def render(plan: Plan, model: ModelSpec) -> str:
    args = arguments(plan, model)
    lines = [f"# Megatron-LM arguments for {model.name}: {plan.mesh.describe()}",
             f"# (from `partita export`; flags as declared by {MEGATRON_VERSION}; pass to pretrain_gpt.py with your "
             f"data and tokenizer flags)"]
    i = 0
    while i < len(args):  # a flag and its values on one line
        j = i + 1
        while j < len(args) and not args[j].startswith("--"):
            j += 1
        lines.append(" ".join([args[i], *map(_quote, args[i + 1:j])]))
        i = j
    return "\n".join(lines) + "\n"


def _quote(value: str) -> str:
    return f"'{value}'" if any(c in value for c in "|*() ") else value


def arguments(plan: Plan, model: ModelSpec) -> list[str]:
    """The argv list (flags and values); the plan must be one Megatron runs (``variants``)."""
    layers = plan.layer_strategies()
    blocks = [l for l in layers if is_block(l)]
    args = ["--num-layers", str(model.n_layers), "--hidden-size", str(model.hidden),
            "--ffn-hidden-size", str(model.ffn), "--num-attention-heads", str(model.heads)]
    if model.kv_heads != model.heads:
        args += ["--group-query-attention", "--num-query-groups", str(model.kv_heads)]
    args += ["--seq-length", str(plan.seq_len), "--max-position-embeddings", str(max(plan.seq_len, model.seq_len)),
             "--vocab-size", str(model.vocab), "--make-vocab-size-divisible-by", "1"]
    # The model as Partita trains it, where Megatron's defaults differ: no dropout (Megatron's
    # TransformerConfig defaults both to 0.1), the model's norm epsilon (its default 1e-5).
    args += ["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--norm-epsilon", repr(model.norm_eps)]
    if model.family != "gpt2":  # llama-style: RoPE, RMSNorm, SwiGLU, no biases
        args += ["--position-embedding-type", "rope", "--rotary-base", str(rotary_base(model)),
                 "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"]
        if model.qkv_bias:
            args.append("--add-qkv-bias")
    if model.is_moe:
        args += moe_arguments(plan, model)
    if not model.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    args += ["--tensor-model-parallel-size", str(plan.tp), "--pipeline-model-parallel-size", str(plan.pp)]
    if any(l.sequence_parallel for l in layers):
        args.append("--sequence-parallel")
        if plan.tp > 1:
            # The sequence-parallel collectives in chunks beside the products they feed (Transformer
            # Engine's userbuffers, which Megatron sets up itself: initialize.py,
            # _initialize_tp_communicators, NCCL bootstrap by default); the megatron engine prices them so.
            args.append("--tp-comm-overlap")
    if plan.cp > 1:
        args += ["--context-parallel-size", str(plan.cp), "--cp-comm-type", CP_COMM_TYPE[plan.cp_variant]]
    args += ["--micro-batch-size", str(plan.micro_batch), "--global-batch-size", str(plan.global_batch)]
    if plan.dtype in ("bf16", "fp16"):
        args.append(f"--{plan.dtype}")
    zero = layers[0].zero
    if plan.fp8:  # Transformer Engine's FP8 layers as the megatron engine prices them (search/engines.py, matmul)
        args += ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "1024",
                 "--fp8-amax-compute-algo", "max"] + (["--fp8-param-gather"] if zero >= 1 else [])
    # Gradient reductions as the backward frees them (the megatron engine prices them so:
    # search/engines.py); with the distributed optimizer, the parameter all-gathers overlapped too.
    args.append("--overlap-grad-reduce")
    if zero >= 1:
        args += ["--use-distributed-optimizer", "--overlap-param-gather"]
    if zero >= 2:
        # Megatron-FSDP checkpoints only in its own format (validate_args asserts it)
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", FSDP_STRATEGY[zero],
                 "--ckpt-format", "fsdp_dtensor"]
    counts = recompute_counts(plan)
    if blocks and all(l.recompute == "selective" for l in blocks):
        args += ["--recompute-granularity", "selective", "--recompute-modules", *SELECTIVE_MODULES]
    elif any(counts):
        args += ["--recompute-granularity", "full"]
        if all(l.recompute == "full" for l in blocks):
            args += ["--recompute-method", "uniform", "--recompute-num-layers", "1"]
        else:
            args += ["--recompute-method", "block", "--recompute-num-layers", str(max(counts))]
    split = blocks_per_stage(plan)
    if len(set(split)) > 1 or plan.virtual_stages > 1:
        args += ["--pipeline-model-parallel-layout", layout([n for _, n, _ in virtual_stages(plan)])]
    return args


def rotary_base(model: ModelSpec) -> int:
    """``--rotary-base``, which Megatron parses as an integer (default 10000; Llama 3's is 500000)."""
    if model.rope_theta != int(model.rope_theta):
        raise PartitaError(f"--to megatron: {model.name}'s rope_theta {model.rope_theta} is not an integer, and "
                           f"Megatron's --rotary-base takes one")
    return int(model.rope_theta)


def moe_arguments(plan: Plan, model: ModelSpec) -> list[str]:
    """The experts as Partita's runtime trains them (runtime/models.py, ``MoE``): ``experts``
    SwiGLU experts of width ``ffn``, top-k routing (softmax over the chosen experts' logits:
    Megatron's default score function without --moe-router-pre-softmax), no capacity limit
    (dropless: Megatron's default capacity factor None), the per-sequence load-balancing loss
    (Megatron's ``seq_aux_loss``) at ``MOE_AUX_LOSS_COEF``, expert parallelism over ``ep`` ranks
    with the experts unsharded by tp, tokens sent by all-to-all; a shared expert with its
    sigmoid gate (qwen2_moe's)."""
    out = ["--num-experts", str(model.experts), "--moe-router-topk", str(model.experts_per_token),
           "--moe-ffn-hidden-size", str(model.ffn), "--expert-model-parallel-size", str(plan.ep),
           "--expert-tensor-parallel-size", "1", "--moe-router-load-balancing-type", "seq_aux_loss",
           "--moe-aux-loss-coeff", repr(MOE_AUX_LOSS_COEF), "--moe-token-dispatcher-type", "alltoall"]
    if model.shared_expert_ffn:
        out += ["--moe-shared-expert-intermediate-size", str(model.shared_expert_ffn), "--moe-shared-expert-gate"]
    return out


def layout(split: list[int]) -> str:
    """``Et*3|t*5|t*4L``: the embedding, the blocks of each (virtual) stage in pipeline order, the
    loss (with the output layer). With pp x v entries Megatron runs v virtual stages per rank,
    entry c * pp + i on pipeline rank i, as Partita numbers them."""
    stages = []
    for i, n in enumerate(split):
        text = "t" * min(n, 1) + (f"*{n}" if n > 1 else "")
        stages.append(("E" if i == 0 else "") + text + ("L" if i == len(split) - 1 else ""))
    return "|".join(stages)


def notes(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> list[str]:
    out = ["the vocabulary is the model's (--make-vocab-size-divisible-by 1: Megatron pads it to a multiple of "
           "tp only); data, tokenizer, optimizer and schedule flags are yours to add"]
    if model.vocab % plan.tp:
        out.append(f"Megatron pads the vocabulary {model.vocab} to {-(-model.vocab // plan.tp) * plan.tp}, a multiple "
                   f"of tp {plan.tp}: the output layer has {-model.vocab % plan.tp} more rows than the plan's model")
    if model.family == "gpt2":
        out.append("gpt2 family: Megatron's defaults (learned positions, LayerNorm, GeLU, biases) match it")
    if plan.cp > 1:
        out.append("Megatron runs context parallelism in Transformer Engine's attention (the default "
                   "--transformer-impl transformer_engine) and shards each sequence in its own load-balanced "
                   "layout (2 x cp chunks)")
    if any(l.recompute == "selective" for l in plan.layer_strategies()):
        out.append("selective recomputation is Megatron's: the attention core alone is rerun (--recompute-modules "
                   "core_attn) and every other activation kept, priced so; Partita's runtime reruns the norms and the "
                   "MLP's activation too and keeps less")
    return out
