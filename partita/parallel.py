"""The rule book: every rule on degrees, divisibility, node locality and pipeline schedules.

Each rule is a function that returns why a choice cannot run (one sentence naming the numbers)
or None when it can. The search asks before it proposes, the validator before it accepts
(``partita.validate``), and the runtime before it builds (``partita launch`` validates), so a
plan the search returns always validates. Nothing here prices anything.

Rules on one layer kind take a ``partita.model.LayerKind`` (its shapes); rules on a plan's
layout take plain degrees, so the search can ask them of candidates before any plan exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, NamedTuple

if TYPE_CHECKING:
    from partita.cluster import NodeGroup
    from partita.model import LayerKind, ModelSpec

# The pipeline schedules a plan may name (``Plan.schedule``), and their families.
SCHEDULES = ("1f1b", "interleaved-1f1b", "interleaved-zb", "zbv")
INTERLEAVED = ("interleaved-1f1b", "interleaved-zb")  # v >= 2 stages per rank, in rounds
ZERO_BUBBLE = ("interleaved-zb", "zbv")  # the backward split into input (I) and weight (W) gradients
# The engines a plan can be priced for and exported to (search/engines.py holds what each does).
ENGINES = ("partita", "torchtitan", "megatron", "deepspeed")
CP_VARIANTS = ("all_to_all", "ring", "all_gather")
# The engines that run a plan's FP8 products (``Plan.fp8``): Megatron-LM through Transformer
# Engine, torchtitan through torchao's Float8Linear. Partita's runtime and DeepSpeed are priced in
# the compute dtype.
FP8_ENGINES = ("megatron", "torchtitan")


# ---- numerics -----------------------------------------------------------------------------------

def fp8_rule(engine: str, dtype: str, groups: Iterable["NodeGroup"], *, moe: bool = False) -> str | None:
    """Why a plan on ``engine`` in ``dtype`` cannot run its products in FP8 on the node ``groups``
    (their device types' FP8 peaks in the catalog), or None. A mixture of experts' FP8 experts
    (Megatron pads their tokens for FP8) are not priced: refused."""
    if moe:
        return "FP8 products are priced for dense models only (a mixture's FP8 experts are not); plan without --fp8"
    if engine not in FP8_ENGINES:
        return (f"engine {engine} does not run FP8 products (engines that do: {', '.join(FP8_ENGINES)}); "
                f"plan with --engine {FP8_ENGINES[0]}, or without --fp8")
    if dtype != "bf16":
        return f"FP8 products keep everything else in bf16, and the dtype is {dtype}: plan with --dtype bf16"
    why = fp8_devices_rule(groups)
    return f"{why}; plan without --fp8" if why else None


def fp8_devices_rule(groups: Iterable["NodeGroup"]) -> str | None:
    """Why the node ``groups`` cannot run FP8 products (a device type without an FP8 peak in the
    catalog), or None: the part of ``fp8_rule`` a plan moved to other hardware can break."""
    lacking = sorted({g.device for g in groups if not g.device_type.fp8_tflops})
    if lacking:
        return (f"{', '.join(lacking)} has no FP8 peak in the catalog: FP8 products are priced on Hopper parts "
                f"(H100, H200)")
    return None


# ---- degrees of one layer kind ---------------------------------------------------------------

def tp_rule(kind: "LayerKind", tp: int) -> str | None:
    """Why ``kind`` cannot be split ``tp`` ways by tensor parallelism (heads, kv heads and ffn
    columns of a block, the vocabulary of the embedding and head), or None."""
    if tp == 1:
        return None
    if tp < 1:
        return f"tensor-parallel degree must be >= 1, got {tp}"
    if kind.role == "block":
        # A MoE block splits its attention only; its experts stay whole on each rank's tokens (moe_tp_rule).
        split = (("heads", kind.heads), ("kv_heads", kind.kv_heads)) + ((("ffn", kind.ffn),) if not kind.is_moe else ())
        for what, n in split:
            if n % tp:
                return f"{what} {n} is not divisible by tensor-parallel degree {tp}"
    elif kind.vocab % tp:
        return f"vocab {kind.vocab} is not divisible by tensor-parallel degree {tp}"
    return None


def cp_rule(kind: "LayerKind", cp: int, *, tp: int = 1, variant: str = "all_to_all", seq_len: int) -> str | None:
    """Why context parallelism of degree ``cp`` (``variant`` "all_to_all", "ring" or "all_gather") cannot run
    ``kind`` at tensor-parallel degree ``tp`` on ``seq_len`` tokens, or None. Every layer needs
    equal sequence shards; a block under all-to-all gives each of the cp x tp ranks whole query
    and kv heads, and under the ring and the all-gather the head-tail load balancing cuts the
    sequence into 2 x cp equal chunks (docs/context-parallel.md)."""
    if cp < 1:
        return f"context-parallel degree must be >= 1, got {cp}"
    if seq_len % cp:
        return f"sequence length {seq_len} is not divisible by context-parallel degree {cp}"
    if cp == 1 or kind.role != "block":
        return None
    if variant == "all_to_all":
        for what, n in (("heads", kind.heads), ("kv_heads", kind.kv_heads)):
            if n % (cp * tp):
                return (f"all-to-all context parallelism needs {what} ({n}) divisible by cp x tp = {cp} x {tp} = "
                        f"{cp * tp}")
        return None
    if seq_len % (2 * cp):
        what = "ring attention" if variant == "ring" else "all-gather context parallelism"
        return f"{what} needs the sequence length ({seq_len}) divisible by 2 x cp = {2 * cp}"
    return None


def moe_tp_rule(kind: "LayerKind", tp: int, sequence_parallel: bool) -> str | None:
    """Why a mixture-of-experts block cannot run at tensor-parallel degree ``tp`` with or without
    sequence parallelism, or None. Its attention is split tp ways; its MoE runs on each rank's
    sequence shard with whole experts (tokens, not weights, are what tp splits there: Megatron-LM's
    expert tensor parallelism 1), which needs the shards sequence parallelism makes (Megatron-LM
    refuses MoE with tp > 1 without --sequence-parallel alike)."""
    if kind.role == "block" and kind.is_moe and tp > 1 and not sequence_parallel:
        return (f"a mixture-of-experts block at tp {tp} runs its experts on sequence shards: it needs "
                "sequence parallelism (sequence_parallel: true)")
    return None


def ep_rule(kind: "LayerKind", ep: int, dp: int) -> str | None:
    """Why expert parallelism of degree ``ep`` cannot run with ``dp`` data-parallel ranks, or
    None: each of the ep ranks holds experts/ep whole experts, and the ep group sits inside the
    data-parallel group (dp = ep x the replicas of each expert)."""
    if ep < 1:
        return f"expert-parallel degree must be >= 1, got {ep}"
    if ep == 1:
        return None
    if not kind.is_moe:
        return f"expert parallelism (ep {ep}) needs a mixture-of-experts model"
    if kind.experts % ep:
        return f"experts ({kind.experts}) are not divisible by expert-parallel degree {ep}"
    if dp % ep:
        return f"the data-parallel degree {dp} is not divisible by expert-parallel degree {ep}"
    return None


def ep_shares_rule(ep: int, counts: Iterable[int], sizes: Iterable[int]) -> str | None:
    """Why replicas with these micro-batch counts and sizes cannot run expert parallelism of
    degree ``ep``, or None: an ep group's all-to-alls pair its ranks' micro-batches one by one."""
    if ep > 1 and (len(set(counts)) > 1 or len(set(sizes)) > 1):
        return (f"expert parallelism (ep {ep}) needs equal batch shares on every replica: the ep group's "
                "all-to-alls pair their micro-batches; use equal shares or ep 1")
    return None


def sequence_parallel_rule(tokens: int, tp: int, *, what: str = "each rank's tokens") -> str | None:
    """Why sequence parallelism cannot split a rank's ``tokens`` of each sequence (seq_len / cp)
    ``tp`` ways, or None; ``what`` names the tokens in the message (``seq_len`` without cp)."""
    if tp > 1 and tokens % tp:
        return f"sequence parallelism splits {what} {tp} ways; {what} {tokens} is not divisible by tp {tp}"
    return None


# ---- node locality ---------------------------------------------------------------------------

def tp_locality_rule(tp: int, gpus_per_node: int) -> str | None:
    """A tensor-parallel group runs inside one node (its collectives are on the critical path)."""
    if gpus_per_node % tp:
        return f"tp {tp} must fit in one node of {gpus_per_node} (and divide it)"
    return None


def cp_locality_rule(cp: int, tp: int, gpus_per_node: int) -> str | None:
    """A context-parallel group of cp x tp ranks sits inside one node, or spans whole nodes with
    each of its tp groups inside one (tp divides the node and cp x tp is a multiple of it: Llama
    3's tp 8 x cp 16 over 16 nodes of 8); its K/V passes then cross the network
    (``docs/context-parallel.md``)."""
    if cp == 1 or gpus_per_node % (cp * tp) == 0:
        return None
    if gpus_per_node % tp == 0 and (cp * tp) % gpus_per_node == 0:
        return None
    return (f"a context-parallel group of cp x tp = {cp} x {tp} = {cp * tp} ranks must fit in one node of "
            f"{gpus_per_node} or span whole nodes (cp x tp a multiple of {gpus_per_node}, tp dividing it)")


def cp_nodes(cp: int, tp: int, gpus_per_node: int) -> int:
    """The nodes one context-parallel group of cp x tp ranks spans (1: it sits inside one)."""
    return max(1, cp * tp // gpus_per_node)


# ---- pipeline schedules ----------------------------------------------------------------------

class Action(NamedTuple):
    """One step of a pipeline schedule on one rank: the forward ("F"), whole backward ("B"), or
    input-gradient ("I") and weight-gradient ("W") halves of one micro-batch through one stage
    (torch's numbering of stages: ``Plan.virtual_stage_index``)."""

    stage: int
    kind: str
    micro_batch: int


def rounds(pp: int, m: int) -> tuple[int, int]:
    """Torch's interleaved schedules take the micro-batches in rounds: (rounds, micro-batches
    per round) = (max(1, m // pp), m // rounds)."""
    n = max(1, m // pp)
    return n, m // n


# Engines whose 1F1B runs fewer micro-batches than stages: Megatron-LM warms up min(pp - rank - 1, m)
# micro-batches (megatron/core/pipeline_parallel/schedules.py,
# forward_backward_pipelining_without_interleaving) and DeepSpeed's TrainSchedule runs
# 2 (m + pp - 1) steps for any m (BLOOM's ramp-up: one micro-batch on 12 stages). torch's
# Schedule1F1B (Partita's runtime, torchtitan) refuses m < pp.
SHORT_PIPELINES = ("megatron", "deepspeed")


def schedule_rule(schedule: str, pp: int, v: int, m: int, engine: str = "partita") -> str | None:
    """Why ``engine``'s schedule does not run ``pp`` ranks of ``v`` stages each over ``m``
    micro-batches (one replica's count), or None: torch's schedules' rules, but 1F1B over fewer
    micro-batches than ranks on ``SHORT_PIPELINES``."""
    if schedule not in SCHEDULES:
        return f"unknown pipeline schedule {schedule!r}; valid: {', '.join(SCHEDULES)}"
    if schedule == "1f1b" and v != 1:
        return "1f1b runs one stage per rank (virtual_stages 1)"
    if schedule == "zbv" and v != 2:
        return "zbv runs two stages per rank, in a V (virtual_stages 2)"
    if schedule in INTERLEAVED and v < 2:
        return f"{schedule} needs at least two stages per rank (virtual_stages >= 2)"
    if pp > 1 and m < pp and not (schedule == "1f1b" and engine in SHORT_PIPELINES):
        return f"{schedule} needs at least as many micro-batches as ranks: {m} < {pp}"
    if schedule in INTERLEAVED:
        n, _ = rounds(pp, m)
        if m % n:
            return f"{schedule} needs the micro-batches ({m}) to be a multiple of the rounds ({n} = m // pp)"
    return None


def schedule_counts_rule(schedule: str, pp: int, v: int, counts: Iterable[int],
                         engine: str = "partita") -> str | None:
    """``schedule_rule`` for every replica's micro-batch count (a plan's batch shares differ)."""
    distinct = sorted(set(counts))
    for m in distinct:
        why = schedule_rule(schedule, pp, v, m, engine)
        if why:
            return why + (f" (a replica's batch share of {m})" if len(distinct) > 1 else "")
    return None


def schedule_layers_rule(schedule: str, layers: Iterable[tuple[str, int, str]]) -> str | None:
    """Why the runtime does not run layers given as (name, zero, recompute) under this
    schedule, or None. The zero-bubble schedules' weight gradients run outside the backward
    passes that FSDP2 and activation checkpointing hook into (``runtime/schedule.py``):

    * ZeRO 2/3: FSDP2 reduce-scatters (and at 3 reshards) when a micro-batch's backward ends,
      before its weight gradient exists; the weight pass then finds the resharded parameters.
      ZeRO 0/1 keep their gathered weights and reduce once after the step.
    * recompute: the input-gradient pass recomputes a checkpointed layer's forward and the
      weight pass recomputes it again (torch's checkpoint frees the recomputed activations after
      the first), a third forward no plan prices."""
    if schedule not in ZERO_BUBBLE:
        return None
    layers = list(layers)
    sharded = [name for name, zero, _ in layers if zero >= 2]
    if sharded:
        return (f"schedule {schedule} splits the backward, which FSDP2's ZeRO 2/3 reduce before the weight gradients "
                f"exist; {_some(sharded)} have zero >= 2: use zero 0 or 1, or interleaved-1f1b")
    recomputed = [name for name, _, recompute in layers if recompute != "none"]
    if recomputed:
        return (f"schedule {schedule} splits the backward, and the weight gradient would recompute a checkpointed "
                f"layer's forward a second time; {_some(recomputed)} recompute: use recompute none, or "
                f"interleaved-1f1b")
    return None


# Engines whose FSDP runs as ZeRO 1 inside a pipeline: torch.distributed.pipelining, meeting a
# stage module that is an FSDP module, turns off its resharding after backward and its gradient
# reduction for every micro-batch's backward but the last (``_PipelineStageBase.
# backward_maybe_with_nosync``: ``set_reshard_after_backward(False)``,
# ``set_requires_gradient_sync(False)``), and torchtitan's ``apply_fsdp`` does not reshard after
# forward under pipeline parallelism (torchtitan/parallelisms/parallelize_llama.py at 9dec370; the
# "default" reshard policy of torchtitan 0.2.2): the parameters stay gathered all step and the
# gradients accumulate unsharded until the last micro-batch, as ZeRO 1 holds them. (Partita's
# runtime sets each unit's policy itself, runtime/schedule.py.)
PIPELINED_FSDP_AS_ZERO1 = ("torchtitan",)
# Engines whose pipeline refuses ZeRO 2 and 3, and why: DeepSpeed's PipelineEngine asserts
# ``zero_optimization_stage() < 2`` (deepspeed/runtime/pipe/engine.py, v0.6.7 to 2026); Megatron-LM
# runs ZeRO 2 and 3 as Megatron-FSDP, which refuses pipeline parallelism
# (megatron/core/distributed/fsdp/mcore_fsdp_adapter.py; torch's FSDP2 under Megatron likewise:
# "--use-torch-fsdp2 is not supported with pipeline parallelism", megatron/training/arguments.py).
PIPELINE_ZERO_AT_MOST_1 = {
    "deepspeed": "its PipelineEngine: \"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism\"",
    "megatron": "they are Megatron-FSDP, which does not run under pipeline parallelism",
}


# torchtitan's data parallelism is DDP (``data_parallel_replicate_degree``) or FSDP2
# (``data_parallel_shard_degree``), whose reshard policies are ZeRO 3 ("always") and ZeRO 2
# ("never"); its training loop reduces every micro-batch's gradients (torchtitan/train.py at
# v0.2.2: no ``set_requires_gradient_sync`` around its gradient accumulation), so outside a
# pipeline it has no ZeRO 1; and under context parallelism it always shards the parameters over
# dp x cp (``ParallelDims.fsdp_enabled`` is ``dp_shard_enabled or cp_enabled``), so no ZeRO 0.
NO_UNPIPELINED_ZERO1 = ("torchtitan",)
SHARDS_UNDER_CP = ("torchtitan",)


def engine_zeros(engine: str, pp: int, cp: int = 1) -> tuple[tuple[int, ...], dict[int, str]]:
    """The ZeRO levels ``engine`` runs a layer at in a plan of ``pp`` stages and context-parallel
    degree ``cp``, and, for each level it does not, why ("engine X ...")."""
    barred: dict[int, str] = {}
    if pp > 1 and engine in PIPELINED_FSDP_AS_ZERO1 + tuple(PIPELINE_ZERO_AT_MOST_1):
        barred |= {2: pipeline_zero_why(engine), 3: pipeline_zero_why(engine)}
    if pp == 1 and engine in NO_UNPIPELINED_ZERO1:
        barred[1] = (f"engine {engine} has no ZeRO 1 outside a pipeline (its data parallelism is DDP or FSDP2, "
                     f"whose reshard policies are ZeRO 2 and 3, and it reduces every micro-batch's gradients)")
    if cp > 1 and engine in SHARDS_UNDER_CP:
        barred[0] = f"engine {engine} shards the parameters over dp x cp under context parallelism (no ZeRO 0)"
    return tuple(z for z in (0, 1, 2, 3) if z not in barred), barred


def zero_reasons(barred: Iterable[dict[int, str]], levels: Iterable[int]) -> str:
    """The reasons (``engine_zeros``' second half) that bar ``levels``, each once, in order."""
    levels = tuple(levels)
    return "; ".join(dict.fromkeys(why for b in barred for z in levels if (why := b.get(z))))


def zero_advice(engine: str, pps: Iterable[int], levels: Iterable[int], cp: int = 1) -> str:
    """Why ``engine`` runs none of ``levels`` at any of the pipeline degrees ``pps``, and the
    levels it runs there: "<reasons>; allow --zero <levels>" (the plan command's and the search's
    messages)."""
    rules = [engine_zeros(engine, pp, cp) for pp in pps]
    allowed = sorted({z for zeros, _ in rules for z in zeros})
    return f"{zero_reasons([barred for _, barred in rules], levels)}; allow --zero {','.join(map(str, allowed))}"


def pipeline_zero_rule(engine: str, pp: int, layers: Iterable[tuple[str, int]], cp: int = 1) -> str | None:
    """Why layers given as (name, zero) do not run as planned on ``engine`` in a plan of ``pp``
    stages (1: no pipeline) at context-parallel degree ``cp``, or None (``engine_zeros``): ZeRO 2
    and 3 in a pipeline, which that engine's FSDP runs as ZeRO 1 there (``PIPELINED_FSDP_AS_ZERO1``)
    or its pipeline refuses (``PIPELINE_ZERO_AT_MOST_1``); torchtitan's ZeRO 1 outside a pipeline
    and ZeRO 0 under context parallelism, which it does not run."""
    allowed, reasons = engine_zeros(engine, pp, cp)
    barred = [(name, zero) for name, zero in layers if zero not in allowed]
    if not barred:
        return None
    why = zero_reasons([reasons], sorted({z for _, z in barred}))
    levels = "/".join(map(str, sorted({z for _, z in barred})))
    where = f"pp {pp}" + (f" and cp {cp}" if cp > 1 else "")
    use = " or ".join(map(str, allowed))
    return f"{why}; {_some([n for n, _ in barred])} have zero {levels} at {where}: use zero {use}" + (
        ", or pp 1" if pp > 1 and 2 not in allowed else "")


def pipeline_zero_why(engine: str) -> str:
    """What ``engine`` does with ZeRO 2 and 3 inside a pipeline ("engine X ..."), for the
    messages of ``pipeline_zero_rule`` and of the plan command's flags."""
    return (f"engine {engine} runs FSDP inside a pipeline as ZeRO 1 (torch's pipelining keeps each stage's "
            "parameters gathered and its gradients unsharded until the last micro-batch's backward)"
            if engine in PIPELINED_FSDP_AS_ZERO1 else
            f"engine {engine} refuses ZeRO 2 and 3 in a pipeline ({PIPELINE_ZERO_AT_MOST_1[engine]})")


def pipeline_zero_levels(engine: str, pp: int, zeros: Iterable[int], cp: int = 1) -> tuple[int, ...]:
    """The ZeRO levels of ``zeros`` that ``pipeline_zero_rule`` lets a layer of a ``pp``-stage
    plan on ``engine`` at context-parallel degree ``cp`` take."""
    allowed = engine_zeros(engine, pp, cp)[0]
    return tuple(z for z in zeros if z in allowed)


def schedule_model_rule(schedule: str, model: "ModelSpec") -> str | None:
    """Why ``model`` does not train under ``schedule``, or None: a mixture of experts not under
    the zero-bubble schedules, whose split backward the experts' all-to-alls do not survive."""
    if model.is_moe and schedule in ZERO_BUBBLE:
        return (f"schedule {schedule}: zero-bubble schedules split the backward, which the experts' all-to-alls do "
                "not survive; use 1f1b or interleaved-1f1b for a mixture-of-experts model")
    return None


def schedules_for(model: "ModelSpec", pinned: Iterable[str] = ()) -> tuple[str, ...]:
    """The schedules the search may try for ``model``: those pinned (all when none is), less
    those the model does not train under."""
    chosen = tuple(pinned) or SCHEDULES
    return tuple(s for s in chosen if schedule_model_rule(s, model) is None)


def _some(names: list[str]) -> str:
    return f"{len(names)} layers ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
