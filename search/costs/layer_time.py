"""Layer time: one layer's time per micro-batch on one device with its collectives, and its
per-step traffic and optimizer update.

* Tensor parallelism (Megatron): a block does 2 all-reduces of the activation ``b*s*h`` in
  forward and 2 in backward; with sequence parallelism they become all-gather +
  reduce-scatter pairs of the same volume. The embedding (vocab-parallel) reduces once in
  forward, the head once in backward. Full recomputation repeats the forward collectives;
  selective recomputation (everything but the matrix products) repeats them all but the last
  product's reduction, where it stops. TP collectives are on the critical path unless the engine overlaps them.
  A tensor-parallel head's loss (``loss_parallel``) all-reduces three fp32 values a token in
  forward. Under sequence parallelism the residual stream's norms and adds run on the rank's
  sequence shard (``compute.sequence_parallel_savings``).
* ZeRO over the parameters' replicas, on the layer's parameter shard: parameters are gathered in
  the compute dtype, gradients reduced in fp32 (FSDP2's ``reduce_dtype``). Level 0: all-reduce of
  gradients once per step; 1: reduce-scatter of gradients + all-gather of parameters once per
  step; 2: all-gather in forward and reduce-scatter in backward, every micro-batch; 3:
  all-gather in forward, all-gather + reduce-scatter in backward, every micro-batch.
  Per-micro-batch ZeRO traffic runs beside the layer's compute (FSDP prefetch) and slows it by
  the overlap slowdown while it runs (``timing.overlapped_s``); a stage's first gather and last
  reduce-scatter are exposed (its largest layer's traffic, times 1 - slowdown, charged m times
  at the largest stage in ``step.step_time_s``). Per-step traffic (levels 0, 1) is reduced layer
  by layer as the last backward frees it: at least the largest layer's reduction is exposed, and
  all of it beyond (1 - slowdown) x that backward.
* The engine (``search/engines.py``): its attention kernel, when its gradient reductions start,
  whether its tensor-parallel collectives run beside the products (``tp_exposed_s``), whether a
  column-parallel linear's input-gradient reduction runs beside its weight-gradient product
  (``dgrad_exposed_s``) and how many gathers its ZeRO-3 runs a layer (``zero_traffic``).

The functions here price a layer's dense part; the layout's own terms (context parallelism's
attention, expert parallelism's all-to-alls) are added by ``model.CostModel``.
"""

from __future__ import annotations

from dataclasses import dataclass

from partita.cluster import NodeGroup
from partita.devices import get_device
from partita.search.analytic import Shard, alternate_recomputed, column_groups, tp_segments
from partita.search.costs.compute import (dgrad_windows_s, gemm_shares, linear_windows_s, optimizer_s,
                                          sequence_parallel_savings)
from partita.search.costs.links import Link
from partita.search.engines import recompute_regathers, reduce_flushes, zero3_gathers
from partita.search.roofline import FP8_ELEMENT_BYTES, cpu_adam_s, memory_time_s
from partita.search.timing import OPTIMIZER_OPS_PER_TENSOR, overlapped_s, param_tensors

@dataclass(frozen=True)
class LayerTime:
    """One layer's time per micro-batch on one device, and its per-step traffic."""

    forward_s: float  # compute + TP collectives, overlapped with the ZeRO gather (``overlapped_s``)
    backward_s: float
    compute_s: float  # forward + backward + recompute, without communication
    tp_comm_s: float
    zero_comm_s: float  # per micro-batch ZeRO traffic (overlapped with compute)
    dp_sync_s: float  # per step: gradient all-reduce (ZeRO 0) or reduce-scatter + all-gather (1)
    zero_edge_s: float = 0.0  # exposed if this is the stage's edge layer: (1 - slowdown) x its ZeRO traffic
    overlap_window_s: float = 0.0  # the part of its backward the data-parallel sync can hide behind
    optimizer_s: float = 0.0  # per step: Adam on the local shard (memory-bound) + its host ops
    # context parallelism's all-to-alls, or the ring's K/V passes its blocks do not hide (search/context.py);
    # part of forward_s and backward_s, on the critical path like tp_comm_s
    cp_comm_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def zero_traffic(cm, params: int, group: NodeGroup, *, tp: int, zero: int, replicas: int,
                 dlink: Link | None = None, role: str = "block",
                 local_experts: int = 0) -> tuple[float, float, float, float]:
    """(forward, backward per micro-batch, per step, of which the parameters' gather) ZeRO
    traffic of ``params`` parameters of a ``role`` layer replicated over ``replicas`` ranks (on
    ``dlink``, by default the data-parallel link); ``local_experts``: they are the experts a rank
    holds. The per-step part is the gradients' reduction and, at ZeRO 1 (and ZeRO 2 gathered once
    a step), the updated parameters' all-gather, which the engine runs beside the next forward or
    after the update (``Engine.param_gather``)."""
    device = group.device
    dlink = dlink or cm.dp_link(group, replicas, tp)
    # An engine that gathers a ZeRO-3 layer module by module (DeepSpeed) runs k rings of 1/k of
    # the bytes each, every one paying its n - 1 steps' latency (search/engines.py).
    k = zero3_gathers(cm.engine, cm.model.kinds[role], local_experts=local_experts) if zero == 3 else 1
    # FSDP's gathers move the bytes it gathers (``CostModel.gather_bytes``: FP8 under a float8 all-gather).
    gathered = cm.gather_bytes(role)
    ag = k * cm.collective_s("all_gather", params * gathered / k, replicas, dlink, device)
    # ... and reduce-scatters its gradients a bucket at a time, a large gradient alone.
    r = reduce_flushes(cm.model.kinds[role], tp, cm.engine.reduce_bucket) if k > 1 else 1
    rs = r * cm.collective_s("reduce_scatter", params * cm.reduce_bytes / r, replicas, dlink, device)
    zero_fwd, zero_bwd, dp_sync, gather = 0.0, 0.0, 0.0, 0.0
    if replicas > 1:
        if zero == 0:
            dp_sync = cm.collective_s("all_reduce", params * cm.reduce_bytes, replicas, dlink, device)
        elif zero == 1:
            if cm.engine.zero1_reduce == "all_reduce":  # DeepSpeed's BF16_Optimizer (search/engines.py)
                rs = cm.collective_s("all_reduce", params * cm.reduce_bytes, replicas, dlink, device)
            step = cm.step_gather_bytes(role)  # FP8 under Megatron's --fp8-param-gather
            if step != gathered:
                ag = cm.collective_s("all_gather", params * step, replicas, dlink, device)
            dp_sync, gather = ag + rs, ag
        elif zero == 2 and cm.engine.zero2_gather == "step":  # DeepSpeed: whole parameters, gathered after the step
            zero_bwd, dp_sync, gather = rs, ag, ag
        elif zero == 2:
            zero_fwd, zero_bwd = ag, rs
        else:
            zero_fwd, zero_bwd = ag, ag + rs
    return zero_fwd, zero_bwd, dp_sync, gather


def shard_copies_s(cm, params: int, group: NodeGroup, *, zero: int, replicas: int,
                   role: str) -> tuple[float, float, float]:
    """(forward, backward, beside the backward's reduction) per micro-batch of the copies an
    engine's FSDP runs around its per-micro-batch gathers and reductions (``Engine.shard_copies``,
    search/engines.py). "fsdp2", on the compute stream: each all-gather's output copied out into
    the parameters (FSDP2's ``split_with_sizes_copy``: the layer's gathered bytes read and
    written), each reduce-scatter's input copied in from the gradients (``chunk_cat``: the
    compute-dtype gradients read, the reduce dtype written). "fsdp1": the backward's
    concatenation of the parameters' gradients into the flat gradient (the compute-dtype bytes
    read and written) on the compute stream, and on the post-backward stream, before the
    reduce-scatter, the cast to the reduce dtype (where it differs) and the in-place division by
    the pre-divide factor (the reduce dtype's bytes read and written; ZeRO 2 and 3 alike). ZeRO 3
    gathers in both passes and reduces in the backward, ZeRO 2 gathering each micro-batch
    gathers in the forward; the once-a-step gathers and reductions (ZeRO 1, ZeRO 2 gathered once
    a step) are not priced, nor those of a mixture's experts sharded on their own
    (``extra_zero``), nor the casts of the local shard before a gather (1/replicas of the bytes)."""
    if cm.engine.shard_copies == "none" or replicas < 2 or zero < 2:
        return 0.0, 0.0, 0.0
    device = group.device_type
    if cm.engine.shard_copies == "fsdp1":
        cast = memory_time_s(device, params * (cm.elem + cm.reduce_bytes)) if cm.reduce_bytes != cm.elem else 0.0
        return 0.0, memory_time_s(device, 2 * params * cm.elem), cast + memory_time_s(device, 2 * params * cm.reduce_bytes)
    gather = memory_time_s(device, 2 * params * cm.gather_bytes(role))
    reduce = memory_time_s(device, params * (cm.elem + cm.reduce_bytes))
    if zero == 3:
        return gather, gather + reduce, 0.0
    return (gather if cm.engine.zero2_gather == "micro_batch" else 0.0), reduce, 0.0


# DeepSpeed's BF16_Optimizer's pass: the gradient's cast to fp32 (4 bytes written) and its add
# into the fp32 copy (two read, one written), beside the compute-dtype gradient read.
CAST_ADD_FP32_BYTES = 4 + 3 * 4


def grad_accumulate_s(cm, params: int, group: NodeGroup, *, zero: int) -> float:
    """Seconds a micro-batch's backward spends joining ``params`` parameters' gradients to the
    step's in a pass of its own (``Engine.grad_accumulate``): none where they accumulate as they
    are written; "cast_add" (DeepSpeed's BF16_Optimizer, whose fp32 gradients are whole at ZeRO 0-1)
    casts each to fp32 and adds it, memory-bound, on the compute stream; at ZeRO 2-3 the gradients
    are reduced as they come, with no such pass."""
    if cm.engine.grad_accumulate != "cast_add" or zero >= 2:
        return 0.0
    return memory_time_s(group.device_type, params * (cm.elem + CAST_ADD_FP32_BYTES))


def zero3_recompute_s(cm, role: str, group: NodeGroup, *, tp: int, replicas: int) -> float:
    """What a fully recomputed ZeRO-3 layer's backward gathers beyond its one pass of gathers: under
    an engine that gathers module by module (DeepSpeed), the modules its recomputed forward
    released and its backward needs again (``engines.recompute_regathers``); FSDP gathers a block
    once for both (the checkpoint runs inside the unit's gathered parameters): nothing."""
    if cm.engine.zero3_gathers != "module":
        return 0.0
    dlink = cm.dp_link(group, replicas, tp)
    return sum(cm.collective_s("all_gather", m * cm.elem, replicas, dlink, group.device)
               for m in recompute_regathers(cm.model.kinds[role], tp, cm.engine.max_reuse_distance))


def tp_pass(cm, role: str, group: NodeGroup, *, tp: int, sp: bool, recompute: str,
            micro_batch: int) -> tuple[float, float, float, float]:
    """(forward compute, backward compute with its recomputation, forward TP collectives,
    backward TP collectives) of one micro-batch: the part of ``layer_time`` its ZeRO level and
    replicas leave alike, as the engine exposes the collectives."""
    device = group.device
    c = cm.compute(role, device, tp, micro_batch)
    act_bytes = micro_batch * cm.seq_len * cm.model.hidden * cm.elem
    link = cm.tp_link(group, tp)
    # TP collectives: (forward, backward) counts of activation-sized all-reduces.
    n_fwd, n_bwd = {"embed": (1, 0), "block": (2, 2), "head": (0, 1)}[role]
    if role == "block" and cm.model.is_moe:  # the attention's pair only: the MoE runs on sequence shards
        n_fwd, n_bwd = 1, 1
    one = cm.collective_s("all_reduce", act_bytes, tp, link, device)
    # FP8 layers cast a block's sequence-parallel inputs, and backward the output gradients, to
    # FP8 before their all-gathers; the reduce-scatters carry the products' compute-dtype outputs.
    # torchao's float8 tensor parallelism (Float8ColwiseParallel, PrepareFloat8ModuleInput,
    # Float8RowwiseParallel: torchao/float8/float8_tensor_parallel.py), and Transformer Engine's
    # modules: LayerNormLinear and LayerNormMLP write the norm's output in FP8 and gather that
    # (userbuffers or NCCL), Linear's backward casts the output gradient and then gathers it
    # (TE 1.9 to today: module/layernorm_linear.py forward, base.py grad_output_preprocess). A
    # mixture's attention is a Transformer Engine block's like any other.
    fp8_gathers = cm.engine.matmul == "fp8" and role == "block" and (
        cm.engine.fp8_impl == "transformer_engine" or not cm.model.is_moe)
    ag_bytes = act_bytes * FP8_ELEMENT_BYTES // cm.elem if fp8_gathers else act_bytes
    if sp:  # all-gather + reduce-scatter of the same volume, and ring steps
        one = (cm.collective_s("all_gather", ag_bytes, tp, link, device)
               + cm.collective_s("reduce_scatter", act_bytes, tp, link, device))
    tp_fwd, tp_bwd = n_fwd * one, n_bwd * one
    if role == "head":  # the vocab-parallel loss: all-reduces of each token's max, sum and target logit
        tp_fwd += 3 * cm.collective_s("all_reduce", micro_batch * cm.seq_len * 4, tp, link, device)
    reruns = cm.engine.reruns_communication(recompute)
    if reruns and (recompute == "full" or cm.model.is_moe):
        # (a mixture's selective too: its last product is in the MoE, after the attention's collectives)
        tp_bwd += tp_fwd
    elif reruns:  # selective
        # All but the last product's reduction (the recomputation stops before w2): with SP
        # both all-gathers and wo's reduce-scatter, without it wo's all-reduce. torchtitan's
        # policy keeps both reduce-scatters' outputs (its ``_save_list``). (Megatron's
        # attention-core scope recomputes nothing that communicates.)
        reduction = cm.collective_s("reduce_scatter" if sp else "all_reduce", act_bytes, tp, link, device)
        kept = 2 if sp and cm.engine.selective_scope == "alternate" and role == "block" else 1
        tp_bwd += tp_fwd - kept * reduction
    fwd_compute = c.forward_s
    bwd_compute = c.backward_s + cm.recompute_s(role, device, tp, micro_batch, recompute)
    if sp and tp > 1:  # the residual stream's kernels on the rank's sequence shard
        save_fwd, save_bwd = sequence_parallel_savings(cm, role, device, tp, micro_batch, recompute)
        fwd_compute, bwd_compute = fwd_compute - save_fwd, bwd_compute - save_bwd
    slowdown = cm.time_constants(device).overlap_slowdown
    if cm.engine.tp_overlap and sp and tp > 1 and role == "block":  # each beside its own products
        ag = cm.collective_s("all_gather", ag_bytes, tp, link, device)
        rs = cm.collective_s("reduce_scatter", act_bytes, tp, link, device)
        tp_fwd, tp_bwd = tp_overlap_exposed_s(cm, role, device, tp, micro_batch, recompute, ag, rs, slowdown)
    elif cm.engine.tp_overlap and sp and tp > 1:  # chunked beside the pass's products (search/engines.py)
        # A reduce-scatter of the summed input gradient of separate column-parallel linears has
        # no single product to be chunked with: it runs after them (``column_linears``).
        summed = 0.0
        if cm.engine.column_linears == "separate":
            groups = sum(1 for group in column_groups(cm.model.kinds[role]) if len(group) > 1)
            summed = groups * cm.collective_s("reduce_scatter", act_bytes, tp, link, device)
        tp_fwd = tp_exposed_s(fwd_compute, tp_fwd, tp, slowdown)
        tp_bwd = tp_exposed_s(bwd_compute, tp_bwd - summed, tp, slowdown) + summed + sum(symm_copies_s(cm, device, tp,
                                                                                                   micro_batch))
    elif cm.engine.dgrad_overlap and tp > 1:
        # Each column-parallel linear's input-gradient reduction (an all-reduce; a reduce-scatter
        # under SP) is started before its weight-gradient product and waited for after it.
        reduction = cm.collective_s("reduce_scatter" if sp else "all_reduce", act_bytes, tp, link, device)
        tp_bwd -= sum(reduction - dgrad_exposed_s(w, reduction, slowdown)
                      for w in dgrad_windows_s(cm, role, device, tp, micro_batch))
    if sp and tp > 1 and cm.engine.sp_inputs == "sharded" and role != "embed":
        # The linears' inputs kept as sequence shards are gathered again for the weight
        # gradients, beside the input-gradient products (search/engines.py, ``sp_inputs``): the
        # block's two (the attention's one when its MoE runs on sequence shards), the head's one.
        # Saved in FP8 they are gathered in FP8 (Transformer Engine's ln_out; torchao's but "torchao_hp"'s).
        n_inputs = 1 if role == "head" or cm.model.is_moe else 2
        saved = ag_bytes if cm.engine.fp8_impl != "torchao_hp" else act_bytes
        regather = n_inputs * cm.collective_s("all_gather", saved, tp, link, device)
        tp_bwd += overlapped_s(bwd_compute, regather, slowdown) - bwd_compute
    return fwd_compute, bwd_compute, tp_fwd, tp_bwd


def layer_time(cm, role: str, group: NodeGroup, *, tp: int, sp: bool, zero: int, recompute: str, replicas: int,
               micro_batch: int, extra_zero: tuple[float, float, float] | None = None) -> LayerTime:
    """The layer's time with its parameters (``cm.param_count``) replicated over ``replicas``
    ranks; ``extra_zero``: ZeRO traffic of parameters the layout shards otherwise (a block's
    experts), which runs beside the compute with the layer's own. Its two parts, the compute
    with the TP collectives (``tp_pass``) and the ZeRO traffic (``zero_traffic``), are each
    priced once per cost model (``CostModel.tp_pass``, ``CostModel.zero_traffic``)."""
    fwd_compute, bwd_compute, tp_fwd, tp_bwd = cm.tp_pass(role, group, tp, sp, recompute, micro_batch)
    # Parameters are gathered in the compute dtype; gradients are reduced in fp32
    # (FSDP2's reduce_dtype, the standard mixed-precision recipe).
    params = cm.param_count(role, tp)
    device = group.device
    k = cm.time_constants(device)
    # FSDP's copies, scaled as the optimizer's memory-bound passes are: on the compute stream, or
    # on FSDP1's post-backward stream ahead of the reduce-scatter they feed.
    copy_fwd, copy_bwd, copy_side = (k.compute_scale * s for s in shard_copies_s(cm, params, group, zero=zero,
                                                                                  replicas=replicas, role=role))
    fwd_compute, bwd_compute = fwd_compute + copy_fwd, bwd_compute + copy_bwd
    bwd_compute += k.compute_scale * grad_accumulate_s(cm, params, group, zero=zero)
    zero_fwd, zero_bwd, dp_sync, gather = cm.zero_traffic(role, group, tp, zero, replicas)
    zero_bwd += copy_side
    if zero == 3 and recompute == "full" and replicas > 1:
        zero_bwd += zero3_recompute_s(cm, role, group, tp=tp, replicas=replicas)
    if extra_zero is not None:
        zero_fwd, zero_bwd, dp_sync, gather = (a + b for a, b in zip((zero_fwd, zero_bwd, dp_sync, gather), extra_zero))
    # Per-micro-batch ZeRO traffic runs beside the layer's compute (FSDP prefetch), which it
    # slows (``overlapped_s``); the stage's first gather and last reduce-scatter have nothing
    # to hide behind: the stage charges its largest layer's traffic once more, less what the
    # slowdown already charged (``zero_edge_s``; search/timing.py, docs/search.md).
    # A data-parallel collective slows the matrix products beside it more than the rest on
    # Hopper parts (persistent GEMM kernels; ``timing.HOPPER_GEMM_OVERLAP_SLOWDOWN``).
    if zero == 3 and not cm.engine.zero3_overlap:  # after the compute, one after the other (search/engines.py)
        slow_fwd = slow_bwd = 1.0  # nothing hides behind the passes: no edge, no window
        forward, backward = fwd_compute + tp_fwd + zero_fwd, bwd_compute + tp_bwd + zero_bwd
    else:
        slow_fwd, slow_bwd = k.overlap_slowdown, k.overlap_slowdown
        if k.gemm_overlap_slowdown is not None:
            slow_fwd, slow_bwd = (k.collective_slowdown(share)
                                  for share in gemm_shares(cm, role, device, tp, micro_batch))
        forward = overlapped_s(fwd_compute + tp_fwd, zero_fwd, slow_fwd)
        backward = overlapped_s(bwd_compute + tp_bwd, zero_bwd, slow_bwd)
    edge = max(0.0, 1.0 - slow_fwd) * zero_fwd + max(0.0, 1.0 - slow_bwd) * zero_bwd
    shard = replicas if zero >= 1 and replicas > 1 else 1
    tensors = param_tensors(cm.model.kinds[role], tied_head=role == "head" and cm.model.tie_embeddings)
    host_ops = OPTIMIZER_OPS_PER_TENSOR["cpu" if group.device_type.is_cpu else "gpu"] * tensors
    optimizer = k.compute_scale * optimizer_s(group, params // shard) + host_ops * k.op_overhead_s
    stream = cm.weight_stream_gbps(device)
    if stream is not None:  # CPU ranks: AdamW's passes over the fp32 state (roofline.cpu_adam_s)
        optimizer = cpu_adam_s(params // shard, stream) + host_ops * k.op_overhead_s
    # Software that starts the gradient reductions only after the whole backward hides none.
    window = max(0.0, 1.0 - slow_bwd) * backward if cm.software.grad_sync == "overlapped" else 0.0
    # The updated parameters' once-a-step gather (search/engines.py, ``param_gather``): beside the
    # next step's first forward of the layer, which joins the window the per-step sync hides
    # behind up to the gather's own time (no reduction waits for the next forward; the stage's
    # reductions and gathers are priced as one sync against the one window), or exposed after
    # the update, with it.
    if gather and cm.engine.param_gather == "next_forward":
        window += min(gather, max(0.0, 1.0 - slow_fwd) * forward)
    elif gather:
        dp_sync -= gather
        optimizer += gather
    return LayerTime(forward_s=forward, backward_s=backward, compute_s=fwd_compute + bwd_compute,
                     tp_comm_s=tp_fwd + tp_bwd, zero_comm_s=zero_fwd + zero_bwd, dp_sync_s=dp_sync,
                     zero_edge_s=edge, overlap_window_s=window, optimizer_s=optimizer)


def dgrad_exposed_s(wgrad_s: float, reduction_s: float, slowdown: float) -> float:
    """What a column-parallel linear's input-gradient reduction (``reduction_s``) adds to the
    backward when it runs beside the linear's weight-gradient product (``wgrad_s``), as
    Megatron-LM runs it (search/engines.py, ``dgrad_overlap``): the part longer than the product,
    and the slowdown of the product while the two overlap (``timing.overlapped_s``)."""
    return overlapped_s(wgrad_s, reduction_s, slowdown) - wgrad_s


def tp_overlap_exposed_s(cm, role: str, device: str, tp: int, micro_batch: int, recompute: str,
                         ag: float, rs: float, slowdown: float) -> tuple[float, float]:
    """(forward, backward with its recomputation) seconds a block's sequence-parallel collectives
    add to its passes when each is chunked beside the products it belongs to and no others
    (Transformer Engine's userbuffers overlap one GEMM with its own all-gather or reduce-scatter;
    torch's micro-pipelined TP fuses a collective with the products that consume or produce it):
    per tensor-parallel region (``analytic.tp_segments``) the all-gather of the input runs beside
    the column-parallel products (forward), the reduce-scatter of the output beside the
    row-parallel product; in the backward the all-gather of the output gradient beside the
    row-parallel product's two gradient products, the reduce-scatter of the input gradient
    beside the column-parallel products' (``tp_exposed_s`` each). A collective longer than its
    own products is exposed by the difference even where the pass has other compute: the
    attention's core and elementwise kernels hide nothing. The input gradient of separate
    column-parallel linears is their sum, reduce-scattered after them, exposed (``column_linears``).
    The recomputed forward's collectives run again beside the products it runs again: all under
    full recomputation; under a selective scope that reruns the block to its last product the
    all-gathers, beside the products it recomputes ("alternate", which keeps the reduce-scatters'
    outputs; "ops", which reruns no product and all but the last reduce-scatter; a mixture's
    every reduce-scatter, its last product being in the MoE); none under Megatron-LM's
    attention-core scope."""
    kind = cm.model.kinds[role]
    times = linear_windows_s(cm, role, device, tp, micro_batch)
    fwd = lambda names: sum(times[n][0] for n in names if n in times)  # noqa: E731
    bwd = lambda names: sum(times[n][1] for n in names if n in times)  # noqa: E731
    sh = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=cm.seq_len, dtype=cm.dtype)
    rerun = rerun_products(cm, kind, sh, recompute, times)
    ag_copy, rs_copy = symm_copies_s(cm, device, tp, micro_batch)

    def fused(window: float, comm: float, copy: float) -> float:  # a collective chunked beside its products
        return tp_exposed_s(window, comm, tp, slowdown) + (copy if window > 0 else 0.0)

    segments = tp_segments(kind)
    exposed_fwd = exposed_bwd = 0.0
    for i, (group, row) in enumerate(segments):
        exposed_fwd += fused(fwd(group), ag, ag_copy) + fused(fwd([row]), rs, rs_copy)
        exposed_bwd += fused(bwd([row]), ag, ag_copy)
        if cm.engine.column_linears == "separate" and len(group) > 1:
            exposed_bwd += rs
        else:
            exposed_bwd += fused(bwd(group), rs, rs_copy)
        if not cm.engine.reruns_communication(recompute):
            continue
        exposed_bwd += fused(fwd([n for n in group if n in rerun]), ag, ag_copy)
        rs_rerun = (recompute == "full" or kind.is_moe
                    or (cm.engine.selective_scope == "ops" and i < len(segments) - 1))
        if rs_rerun:
            exposed_bwd += fused(fwd([row]) if row in rerun else 0.0, rs, rs_copy)
    return exposed_fwd, exposed_bwd


def rerun_products(cm, kind, sh: Shard, recompute: str, names) -> set[str]:
    """Which of a layer's forward products (``names``) its recomputation runs again: all under
    full recomputation; under a selective one those the engine's scope does not keep
    (``analytic.alternate_recomputed``'s under torchtitan's policy; none under the "ops" scope,
    which keeps every product's output, or Megatron-LM's attention core)."""
    if recompute == "full":
        return set(names)
    if recompute == "selective" and cm.engine.selective_scope == "alternate":
        return {name for name, *_ in alternate_recomputed(kind, sh)[1]} & set(names)
    return set()


def symm_copies_s(cm, device: str, tp: int, micro_batch: int) -> tuple[float, float]:
    """(per fused all-gather, per fused reduce-scatter) seconds torch's symmetric-memory
    collectives add on the compute stream (``Engine.tp_overlap_impl`` "symmetric_memory"): the
    rank's shard copied into its symmetric buffer, 2 x act/tp bytes; the tp partial chunks it
    pulled summed, act + act/tp; 0 for Transformer Engine's userbuffers."""
    if cm.engine.tp_overlap_impl != "symmetric_memory":
        return 0.0, 0.0
    act = micro_batch * cm.seq_len * cm.model.hidden * cm.elem
    dev, scale = get_device(device), cm.time_constants(device).compute_scale
    return scale * memory_time_s(dev, 2 * act / tp), scale * memory_time_s(dev, act + act / tp)


def tp_exposed_s(compute_s: float, comm_s: float, tp: int, slowdown: float) -> float:
    """What a pass adds to its ``compute_s`` when its tensor-parallel collectives (``comm_s``) are
    split into tp chunks that run beside the products they feed (Megatron's --tp-comm-overlap):
    the first chunk is exposed, the rest overlaps the compute and slows it by ``slowdown``
    (``timing.overlapped_s``)."""
    first = comm_s / tp
    return first + overlapped_s(compute_s, comm_s - first, slowdown) - compute_s


def tied_sync_s(cm, group: NodeGroup, *, replicas: int, tp: int, zero: int) -> float:
    """Per step, a pipeline whose tied embedding and head sit on different stages sums the
    two copies' gradients between each pair of ranks (in the engine's reduce dtype, ``cm.reduce_bytes``: the
    ZeRO shard), after the last
    backward: exposed. Priced on the last stage's link to another stage (on a mixed cluster
    the first stage's group may be slower; not modelled). The copy's own data-parallel
    reduction at ZeRO 0-1 is exposed as well (it waits for the last micro-batch); at ZeRO 2-3
    its per-micro-batch gathers and reductions ride on the head's matrix product. The copy's
    optimizer update is counted here too (on this stage only)."""
    shard = replicas if zero >= 1 and replicas > 1 else 1
    tied = cm.tied_params(tp)
    grad = tied * cm.reduce_bytes // shard
    link = cm.pp_link(group, group, replicas // cm.cp * tp)  # a stage of the search's ranks (a cp group each)
    t = cm.collective_s("all_reduce", grad, 2, link, group.device)
    stream = cm.weight_stream_gbps(group.device)  # CPU ranks: AdamW's passes (roofline.cpu_adam_s)
    copy_params = tied // shard
    t += cpu_adam_s(copy_params, stream) if stream is not None else optimizer_s(group, copy_params)
    if replicas > 1 and zero == 0:
        t += cm.collective_s("all_reduce", tied * cm.reduce_bytes, replicas, cm.dp_link(group, replicas, tp),
                             group.device)
    elif replicas > 1 and zero == 1:
        dlink = cm.dp_link(group, replicas, tp)
        t += (cm.collective_s("reduce_scatter", tied * cm.reduce_bytes, replicas, dlink, group.device)
              + cm.collective_s("all_gather", tied * cm.elem, replicas, dlink, group.device))
    return t
