"""The one plan validator: used after solving, by `partita check`, and before launch.

It checks that a plan is well formed for the model and cluster given, and that every choice
in it is one the runtime executes. It does not price the plan (``partita check`` does that
with the cost model). Every failure is one PartitaError that names the numbers.
"""

from __future__ import annotations

from partita import parallel
from partita.cluster import ClusterSpec
from partita.errors import PartitaError
from partita.model import ModelSpec
from partita.plan import ZERO_LEVELS, Plan


def validate_plan(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> None:
    _check_inputs(plan, model, cluster)
    _check_degrees(plan)
    _check_batch_shares(plan)
    _check_ranks(plan, cluster)
    _check_layers(plan, model)
    _check_context_parallel(plan, model, cluster)
    _check_expert_parallel(plan, model)
    _check_dtype(plan, model, cluster)
    _check_runtime_limits(plan, model)


def _check_context_parallel(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> None:
    """Context parallelism: the limits of its variant for every layer (``parallel.cp_rule``), its
    groups inside a node or over whole nodes (``parallel.cp_locality_rule``), and the ring on CUDA
    ranks only; sequence parallelism on each rank's shard is
    ``_check_runtime_limits``'s. (With replicas on different node groups it is refused in
    ``_check_degrees``: not priced, not run.)"""
    if plan.cp == 1:
        return
    for l in plan.layer_strategies():
        why = parallel.cp_rule(model.kind_of(l.name), plan.cp, tp=l.tensor_parallel, variant=plan.cp_variant,
                               seq_len=plan.seq_len)
        if why:
            raise PartitaError(f"layer {l.name}: {why}; choose another cp (or cp_variant), or cp 1")
    for s in plan.stages:
        why = parallel.cp_locality_rule(plan.cp, plan.tp, cluster.group(s.group).gpus_per_node)
        if why:
            raise PartitaError(f"stage {s.index}: {why}; choose another cp or tp")
    if plan.cp_variant == "ring" and any(cluster.group(s.group).device_type.is_cpu for s in plan.stages):
        raise PartitaError("ring context parallelism (torch's context_parallel) runs on CUDA ranks only; use "
                           "cp_variant all_to_all on CPU ranks")


def _check_expert_parallel(plan: Plan, model: ModelSpec) -> None:
    """Expert parallelism (docs/moe.md): ep divides the experts and dp (``parallel.ep_rule``);
    not with replicas on several node groups, nor under a zero-bubble schedule."""
    if model.is_moe:
        why = parallel.schedule_model_rule(plan.schedule, model)
        if why:
            raise PartitaError(why)
    if plan.ep == 1:
        return
    why = parallel.ep_rule(model.kinds["block"], plan.ep, plan.dp)
    if why:
        raise PartitaError(f"ep {plan.ep}: {why}; choose ep dividing both, or ep 1")
    if plan.mixed_replicas:
        raise PartitaError(f"expert parallelism (ep {plan.ep}) with replicas on different node groups "
                           "(replica_groups) is not supported; use ep 1 or one node group per stage")
    why = parallel.ep_shares_rule(plan.ep, plan.replica_micro_batches(), plan.replica_micro_batch_sizes())
    if why:
        raise PartitaError(why)


def _check_runtime_limits(plan: Plan, model: ModelSpec) -> None:
    """What the runtime does not run (the search asks the same rules, ``partita.parallel``)."""
    why = parallel.schedule_layers_rule(plan.schedule,
                                        ((l.name, l.zero, l.recompute) for l in plan.layer_strategies()))
    if why:
        raise PartitaError(why)
    why = parallel.pipeline_zero_rule(plan.engine, plan.pp, ((l.name, l.zero) for l in plan.layer_strategies()), plan.cp)
    if why:
        raise PartitaError(why)
    what = "seq_len" if plan.cp == 1 else f"each rank's tokens (seq_len {plan.seq_len} / cp {plan.cp})"
    why = (parallel.sequence_parallel_rule(plan.seq_len // plan.cp, plan.tp, what=what)
           if any(l.sequence_parallel for l in plan.layer_strategies()) else None)
    if why:
        raise PartitaError(why)
    if model.tie_embeddings:
        # Across pipeline stages the runtime keeps a copy on the last stage and sums the two
        # copies' gradients (runtime/tied.py): both need the same shards.
        layers = {l.name: l for l in plan.layer_strategies()}
        e, h = layers["embed"], layers["head"]
        if (e.tensor_parallel, e.zero) != (h.tensor_parallel, h.zero):
            raise PartitaError(f"{model.name} ties its embedding and head weights: they need the same tensor_parallel "
                               f"and zero; the plan has embed {e.tensor_parallel}/{e.zero}, head "
                               f"{h.tensor_parallel}/{h.zero}")


def _check_inputs(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> None:
    if plan.model_fingerprint != model.fingerprint:
        raise PartitaError(f"plan was made for model {plan.model.get('name')!r}, not {model.name!r} "
                           f"({_model_difference(plan, model)}); re-plan with `partita plan`")
    if plan.cluster_fingerprint != cluster.fingerprint:
        raise PartitaError(f"plan was made for cluster {plan.cluster.get('name')!r}, not {cluster.name!r} "
                           f"({_cluster_difference(plan, cluster)}); re-plan for this cluster")
    if model.family == "gpt2" and plan.seq_len > model.seq_len:
        raise PartitaError(f"seq_len {plan.seq_len} exceeds the {model.seq_len} positions {model.name} learns")


def _check_degrees(plan: Plan) -> None:
    if plan.cp > 1 and plan.mixed_replicas:
        raise PartitaError(f"context parallelism (cp {plan.cp}) with replicas on different node groups "
                           f"(replica_groups) is not supported; use cp 1 or one node group per stage")
    if plan.pp != len(plan.stages):
        raise PartitaError(f"pp is {plan.pp} but the plan lists {len(plan.stages)} stages")
    if not (plan.batch_shares or plan.micro_batch_sizes) and (
            plan.global_batch != plan.dp * plan.micro_batch * plan.num_micro_batches):
        raise PartitaError(f"global_batch {plan.global_batch} != dp {plan.dp} x micro_batch {plan.micro_batch} x "
                           f"num_micro_batches {plan.num_micro_batches}; make them agree, or re-plan")
    for i, s in enumerate(plan.stages):
        if s.index != i:
            raise PartitaError(f"stage {i} has index {s.index}; stages must be listed in pipeline order 0..{plan.pp - 1}")
        if len(s.ranks) != plan.dp * plan.cp * plan.tp:
            raise PartitaError(f"stage {i} has {len(s.ranks)} ranks; every stage needs {plan.mesh.stage_factors()}")


def _one_per_replica(plan: Plan, values: tuple[int, ...], key: str, what: str) -> None:
    if len(values) != plan.dp:
        raise PartitaError(f"{key} {list(values)} lists {len(values)} replicas, but dp is {plan.dp}; give one {what} "
                           f"per data-parallel replica")


def _check_micro_batch_sizes(plan: Plan) -> None:
    """Replicas of different micro-batch sizes (``Plan.micro_batch_sizes``): one size per
    replica, the largest is ``micro_batch``, and the replicas' rows make up the global batch."""
    sizes = plan.micro_batch_sizes
    if not sizes:
        return
    _one_per_replica(plan, sizes, "micro_batch_sizes", "micro-batch size")
    if plan.micro_batch != max(sizes):
        raise PartitaError(f"micro_batch {plan.micro_batch} must be the largest of micro_batch_sizes {list(sizes)} "
                           f"({max(sizes)}): the slowest replica's size, which the memory plan is for")
    rows = plan.replica_batch_rows()
    if plan.global_batch != sum(rows):
        raise PartitaError(f"global_batch {plan.global_batch} != the rows the replicas train on ({sum(rows)}: micro-batch "
                           f"counts x micro_batch_sizes {list(sizes)}); make them agree, or re-plan")


def _check_batch_shares(plan: Plan) -> None:
    """Replicas running different numbers of micro-batches meet only at the step's end: every
    collective over dp must happen once per step, which holds at ZeRO 0/1 (gradients reduced at
    the last micro-batch, a ZeRO-1 shard gathered at the first and kept) but not at ZeRO 2/3
    (a reduce-scatter, and at 3 a gather, every micro-batch: the replicas would wait on each
    other's missing micro-batches)."""
    _check_micro_batch_sizes(plan)
    shares = plan.batch_shares
    if not shares:
        return
    _one_per_replica(plan, shares, "batch_shares", "micro-batch count")
    if not plan.micro_batch_sizes and plan.global_batch != plan.micro_batch * sum(shares):  # (with sizes: checked there)
        whole, rest = divmod(plan.global_batch, plan.micro_batch)
        fix = (f"make the shares add up to {whole} micro-batches" if not rest else
               "global_batch must be a multiple of micro_batch")
        raise PartitaError(f"global_batch {plan.global_batch} != micro_batch {plan.micro_batch} x the batch_shares' "
                           f"sum {sum(shares)} ({' + '.join(map(str, shares))}); {fix}, or re-plan")
    if plan.num_micro_batches != max(shares):
        raise PartitaError(f"num_micro_batches {plan.num_micro_batches} must be the largest of batch_shares "
                           f"{list(shares)} ({max(shares)}): the slowest replica's count")
    sharded = [l.name for l in plan.layer_strategies() if l.zero >= 2]
    if len(set(shares)) > 1 and sharded:
        raise PartitaError(f"uneven batch_shares {list(shares)} need zero 0 or 1 in every layer (ZeRO 2/3 reduce every "
                           f"micro-batch over dp, and replicas run different counts); {len(sharded)} layers have "
                           f"zero >= 2 ({', '.join(sharded[:3])}{', ...' if len(sharded) > 3 else ''}): use zero 1, "
                           f"or equal shares")


def _check_ranks(plan: Plan, cluster: ClusterSpec) -> None:
    ranks = plan.ranks
    if len(set(ranks)) != len(ranks):
        raise PartitaError("a rank appears in more than one stage (or twice in one)")
    if plan.world_size > cluster.world_size:
        raise PartitaError(f"plan needs {plan.mesh.describe()} but the cluster has {cluster.world_size}")
    for s in plan.stages:
        group = cluster.group(s.group)
        if s.device != group.device:
            raise PartitaError(f"stage {s.index} says device {s.device} but group {group.name!r} holds {group.device}")
        if s.replica_groups:
            _check_replica_groups(plan, s, cluster)
            continue
        if list(s.ranks) != list(range(s.ranks[0], s.ranks[0] + len(s.ranks))):
            raise PartitaError(f"stage {s.index}: ranks must be consecutive (the cost model and the meshes assume "
                               f"it), got {list(s.ranks)[:6]}")
        for d in range(plan.dp):
            _check_replica_ranks(plan, s, d, group, cluster)


def _check_replica_groups(plan: Plan, s, cluster: ClusterSpec) -> None:
    """A stage whose replicas sit on different node groups: one group per replica, the first
    is the stage's ``group``, and each replica's ranks lie in its group."""
    if len(s.replica_groups) != plan.dp:
        raise PartitaError(f"stage {s.index}: replica_groups lists {len(s.replica_groups)} groups, but dp is {plan.dp}; "
                           f"give one node group per data-parallel replica")
    if plan.virtual_stages > 1:
        raise PartitaError(f"stage {s.index}: replicas on several node groups (replica_groups) run the 1F1B schedule; "
                           f"the plan says {plan.schedule}: use schedule 1f1b, or one group per stage")
    if s.replica_groups[0] != s.group:
        raise PartitaError(f"stage {s.index}: group {s.group!r} must be the first replica's group "
                           f"({s.replica_groups[0]!r} in replica_groups)")
    for d, name in enumerate(s.replica_groups):
        _check_replica_ranks(plan, s, d, cluster.group(name), cluster)


def _check_replica_ranks(plan: Plan, s, d: int, group, cluster: ClusterSpec) -> None:
    """Replica ``d`` of stage ``s``: its tp ranks consecutive, in ``group``, inside one node."""
    first = cluster.first_rank(group.name)
    tp_ranks = list(s.ranks[d * plan.tp:(d + 1) * plan.tp])
    if tp_ranks != list(range(tp_ranks[0], tp_ranks[0] + plan.tp)):
        raise PartitaError(f"stage {s.index}: replica {d}'s ranks {tp_ranks} must be consecutive")
    outside = [r for r in tp_ranks if not first <= r < first + group.size]
    if outside:
        raise PartitaError(f"stage {s.index}: ranks {outside[:4]} are not in group {group.name!r} "
                           f"(ranks {first}..{first + group.size - 1})")
    nodes = {(r - first) // group.gpus_per_node for r in tp_ranks}
    if len(nodes) > 1:
        raise PartitaError(f"stage {s.index}: tensor-parallel group {tp_ranks} spans nodes; "
                           f"tp {plan.tp} must fit in one node of {group.gpus_per_node}")


def _check_layers(plan: Plan, model: ModelSpec) -> None:
    v = plan.virtual_stages
    counts = {len(s.chunks) for s in plan.stages}
    if plan.schedule == "1f1b" and not counts <= {0, 1}:
        raise PartitaError(f"schedule 1f1b runs one stage per rank; the plan splits stages into chunks "
                           f"{[list(s.chunks) for s in plan.stages]}: drop them or use interleaved-1f1b")
    if plan.schedule != "1f1b" and (len(counts) != 1 or v < 2):
        raise PartitaError(f"schedule {plan.schedule} needs every stage split into the same number (>= 2) of "
                           f"chunks; the plan has {[list(s.chunks) for s in plan.stages]}")
    why = parallel.schedule_counts_rule(plan.schedule, plan.pp, v, plan.replica_micro_batches(), plan.engine)
    if why:
        raise PartitaError(f"{why}; choose another schedule or number of micro-batches")
    names = [l.name for l in plan.layer_strategies()]
    expected = model.layer_names()
    if names != expected:
        missing = [n for n in expected if n not in names]
        extra = [n for n in names if n not in expected]
        detail = (f"missing {missing[:3]}" if missing else "") + (f" unknown {extra[:3]}" if extra else "")
        raise PartitaError(f"the stages must hold {expected[0]}, layers.0..layers.{model.n_layers - 1}, head exactly once "
                           f"and in order; {detail.strip() or 'they are out of order'}")
    for s in plan.stages:
        for l in s.layers:
            where = f"stage {s.index} layer {l.name}"
            if l.tensor_parallel not in (1, plan.tp):
                raise PartitaError(f"{where}: tensor_parallel {l.tensor_parallel} must be 1 or the stage's tp {plan.tp}")
            why = (parallel.tp_rule(model.kind_of(l.name), l.tensor_parallel)
                   or parallel.moe_tp_rule(model.kind_of(l.name), l.tensor_parallel, l.sequence_parallel))
            if why:
                raise PartitaError(f"{where}: {why}")
            if l.sequence_parallel and l.tensor_parallel == 1:
                raise PartitaError(f"{where}: sequence_parallel needs tensor_parallel > 1")
            if l.zero not in ZERO_LEVELS:
                raise PartitaError(f"{where}: zero {l.zero} is not one of {ZERO_LEVELS}")
            if l.zero > 0 and plan.dp * plan.cp == 1:  # under cp, ZeRO shards over dp x cp
                raise PartitaError(f"{where}: zero {l.zero} shards over data parallelism, but dp is 1; use zero 0")
            if l.recompute != "none" and model.role_of(l.name) != "block":
                raise PartitaError(f"{where}: recompute {l.recompute} applies to decoder blocks only; set it to none")


def _check_dtype(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> None:
    for s, name in ((s, name) for s in plan.stages for name in s.groups):
        group = cluster.group(name)
        if group.device == "cpu" and plan.dtype != "fp32":
            raise PartitaError(f"stage {s.index} runs on CPU ranks, which train in fp32; the plan says {plan.dtype}")
        if group.device != "cpu" and plan.dtype == "bf16" and group.device_type.bf16_tflops == 0:
            raise PartitaError(f"stage {s.index}: {group.device} has no bf16; plan with dtype fp16")
    if plan.fp8:
        why = parallel.fp8_rule(plan.engine, plan.dtype, cluster.groups, moe=model.is_moe)
        if why:
            raise PartitaError(f"plan: fp8: {why}")


def _model_difference(plan: Plan, model: ModelSpec) -> str:
    from partita.model import model_difference

    return _spec_difference("model", plan.model_fingerprint, plan.model, model, ModelSpec.from_dict, model_difference,
                            model.name)


def _cluster_difference(plan: Plan, cluster: ClusterSpec) -> str:
    from partita.cluster import cluster_difference

    return _spec_difference("cluster", plan.cluster_fingerprint, plan.cluster, cluster, ClusterSpec.from_dict,
                            cluster_difference, cluster.short)


def _spec_difference(what: str, recorded: str, data, given, load, differ, name: str) -> str:
    """How the spec a plan records differs from the one given: both fingerprints, and the
    fields that differ (or that the plan's fingerprint was edited by hand)."""
    fingerprints = f"fingerprint {recorded} vs {given.fingerprint}"
    try:
        own = load(data, where=f"plan: {what}")
    except (PartitaError, TypeError):
        return fingerprints
    if own.fingerprint == given.fingerprint:
        return f"{fingerprints}; the plan's own {what} fields match {name}, so its fingerprint was edited"
    return f"{fingerprints}: {differ(own, given)}"
