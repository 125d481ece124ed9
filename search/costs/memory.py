"""Memory: every byte the cost model says a device holds, by the plan's categories
(``partita.plan.StageMemory``; docs/search.md has the table and tests/test_runtime_memory.py
measures it).

* Per parameter, S = its replicas at ZeRO 1-3 and 1 at ZeRO 0: fp32 weights 4/S (the
  optimizer's master copy), the compute-dtype copy FSDP2 keeps from forward to backward at ZeRO
  0-2, fp32 gradients (4, unsharded while they accumulate over micro-batches at ZeRO 0-1; else
  4/S), Adam 8/S. Under expert parallelism a block's routed experts are E/ep of them, replicated
  over dp/ep ranks (``expert_memory``).
* Activations and transients: k = ``min(pp - stage, micro_batches)`` micro-batches are in flight
  at a 1F1B stage's peak (a fully recomputed layer keeps only its input, a selective one its
  input and its matrix products' outputs). k - 1 of them hold all their activations; the running
  one holds those of the layers up to some layer j, which adds its own transient (a ZeRO-2/3
  gather in forward; in backward the re-gathered parameters, the recomputed activations, the
  working set, the loss's backward). The stage's peak is the largest such moment, taken over its
  layers in order (``stage._stage_cost``); the search writes layers in the order that makes it
  least (``stage.canonical_order``). The search counts each layer's terms alone (what CP-SAT
  sums); a plan's prediction also takes away what the layer's neighbours make absent
  (``neighbour_peak``), never more. Under context parallelism a rank keeps its s/cp tokens'
  activations and what the variant adds (``context.cp_activation_bytes``, and the ring's blocks
  in flight as a transient, ``context.ring_transient_bytes``).
* Under a pipeline a stage also holds the schedule's receive buffers and kept outputs
  (``pipeline_memory``).
* A fixed reserve per device for the CUDA context, communication buffers and allocator
  fragmentation: ``RESERVE_GPU_BYTES`` (3 GiB) on GPUs, ``RESERVE_CPU_BYTES`` on CPU ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from partita.cluster import NodeGroup
from partita.devices import get_device
from partita.model import LayerKind
from partita.plan import boundary_split
from partita.search.analytic import Shard, activation_bytes
from partita.search.context import block_gather_traffic, cp_activation_bytes, ring_heads, ring_transient_bytes
from partita.search.engines import ENGINES, Engine, block_module_params, largest_module_params, recompute_regathers
from partita.units import GiB, MiB, loss_chunk_tokens, round_up_to_grain

RESERVE_GPU_BYTES = 3 * GiB
RESERVE_CPU_BYTES = 256 * MiB
# What the runtime keeps per parameter (runtime/train.py, runtime/parallelize.py): fp32
# parameters (FSDP2's sharded parameters are the optimizer's master weights), gradients reduced
# and accumulated in fp32 (MixedPrecisionPolicy(reduce_dtype=fp32)), Adam's m and v in fp32.
MASTER_BYTES = 4
REDUCE_BYTES = 4
ADAM_STATE_BYTES = 8


def state_bytes(cm) -> tuple[int, int, int]:
    """Bytes a parameter's gradient, master copy and Adam moments take under the cost model's
    engine (``Engine.grad_buffer``, ``Engine.optimizer_state``): fp32 each (``REDUCE_BYTES``,
    ``MASTER_BYTES``, ``ADAM_STATE_BYTES``), or the compute dtype's where the engine keeps them so."""
    grad = cm.elem if cm.engine.grad_buffer == "compute" else REDUCE_BYTES
    if cm.engine.optimizer_state == "compute":
        return grad, cm.elem, 2 * cm.elem
    return grad, MASTER_BYTES, ADAM_STATE_BYTES


# What a layout whose data-parallel degree the ep degree does not divide is priced at: more than
# any device holds, so every search discards it.
UNRUNNABLE_BYTES = 1 << 50


@dataclass(frozen=True)
class LayerMemory:
    """One layer's share of a device's memory (bytes)."""

    weights: int  # the parameters as stored (fp32 master copy, sharded at ZeRO 1-3)
    gathered_weights: int  # the compute-dtype copy held from forward to backward (ZeRO 0-2)
    gradients: int  # at their peak: accumulated unsharded, or the sharded result
    optimizer: int
    activations: int  # one micro-batch, as kept for backward
    transient: int  # extra bytes at the layer's own peak moment (``peak_phase``), beyond the activations
    transient_gathered: int  # the part of ``transient`` that is gathered parameters
    params: int  # parameters on this device (for the optimizer step)
    peak_phase: str = "backward"  # "forward" (a ZeRO-2/3 gather) or "backward" (recompute, working set, loss)
    # The parts a stage whose neighbours are known (``neighbour_peak``) puts together itself:
    copy: int = 0  # the layer's parameters in the compute dtype: one gather (or prefetch) of it
    forward_extra: int = 0  # its forward gather's bytes (all gathered parameters)
    backward_own: int = 0  # what its backward computes with: the recomputed activations and the working set
    # FSDP2's reduce-scatter input for its gradient, kept until the next layer makes its own: a
    # buffer beside the sharded gradient when it reduces every micro-batch (ZeRO 2-3, or m = 1);
    # ZeRO 0-1 reduce once, out of the unsharded gradient they accumulated (nothing beside it).
    reduce_buffer: int = 0
    regathers: bool = False  # ZeRO-3: gathered again for its backward (and prefetched by the layer after it)
    releases_copy: bool = False  # its kept copy is freed after every backward (ZeRO-2; ZeRO 0-1 when m = 1)

    @property
    def static_bytes(self) -> int:
        """What the layer holds through the whole step."""
        return self.weights + self.gathered_weights + self.gradients + self.optimizer


def reserve_bytes(group: NodeGroup) -> int:
    """Memory a device keeps for the runtime itself (context, buffers, fragmentation)."""
    return RESERVE_CPU_BYTES if group.device_type.is_cpu else RESERVE_GPU_BYTES


def layer_memory(cm, role: str, device: str, *, tp: int, sp: bool, zero: int, recompute: str, dp: int,
                 micro_batch: int, num_micro_batches: int, tied_copy: bool = False) -> LayerMemory:
    """One layer's memory at the cost model ``cm``'s layout: its dense part over dp x cp
    replicas (``dense_memory``), then what context and expert parallelism add to a block."""
    m = dense_memory(cm, role, device, tp=tp, sp=sp, zero=zero, recompute=recompute, replicas=dp * cm.cp,
                     micro_batch=micro_batch, num_micro_batches=num_micro_batches, tied_copy=tied_copy)
    if role != "block":
        return m
    if cm.cp > 1 and cm.cp_variant == "ring":
        m = ring_memory(cm, m, tp=tp, micro_batch=micro_batch)
    if cm.cp > 1 and cm.cp_variant == "all_gather":
        m = gather_memory(cm, m, tp=tp, micro_batch=micro_batch)
    if cm.model.is_moe and dp % cm.ep:
        return dataclasses.replace(m, weights=UNRUNNABLE_BYTES)
    for part in cm.moe_parts(role, tp):
        m = expert_memory(cm, m, params=part.params, replicas=part.replicas(dp, cm.cp), zero=zero,
                          num_micro_batches=num_micro_batches)
    return m


def _kernels_keep(engine: Engine) -> dict[str, str]:
    """What ``engine``'s kernels keep for the backward, as ``analytic.activation_bytes`` takes it."""
    return dict(glu_saves=engine.glu_saves, qkv_saves=engine.qkv_saves, norm=engine.norm,
                selective_keeps=engine.selective_keeps,
                fp8_inputs=engine.matmul == "fp8" and engine.fp8_impl != "torchao_hp")


def _activations(cm, role: str, device: str, *, tp: int, sp: bool, recompute: str, micro_batch: int):
    """(without recomputation, with it, kept under the layout's context parallelism) activation
    bytes of one micro-batch of the layer on one rank; whatever its ZeRO level and replicas, so
    kept per cost model for the searches, which ask for every level of every shape."""
    cache = cm.__dict__.setdefault("_activations", {})  # a cost model's view, engine and sequence are fixed
    key = (role, device, tp, sp, recompute, micro_batch)
    if key in cache:
        return cache[key]
    kind: LayerKind = cm.model.kinds[role]
    on_cpu = get_device(device).is_cpu
    local_experts = cm.model.experts // cm.ep if kind.is_moe else 0
    sharded = cm.engine.sp_inputs == "sharded"
    saves = _kernels_keep(cm.engine)
    kw = dict(tp=tp, micro_batch=micro_batch, seq_len=cm.seq_len, dtype=cm.dtype, sequence_parallel=sp, on_cpu=on_cpu,
              local_experts=local_experts, sharded_inputs=sharded, **saves)
    full = activation_bytes(kind, recompute="none", **kw)
    # Megatron's selective recomputation keeps all but the attention core's own tensors, which the
    # count never holds (a fused kernel keeps q, k, v, its output and statistics either way).
    kept_as = "none" if recompute == "selective" and cm.engine.selective_scope == "attention" else recompute
    plain = activation_bytes(kind, recompute=kept_as, **kw)  # the rank's tokens, as a profile measures them
    kept = cp_activation_bytes(kind, variant=cm.cp_variant, cp=cm.cp, tp=tp, micro_batch=micro_batch,
                               seq_len=cm.plan_seq_len, dtype=cm.dtype, sequence_parallel=sp, recompute=kept_as,
                               on_cpu=on_cpu, local_experts=local_experts, sharded_inputs=sharded,
                               regathers=cm.engine.cp_ring == "transformer_engine", **saves)
    if role == "head" and tp == 1 and cm.engine.loss == "chunked":
        # The runtime's chunked loss keeps the logits themselves (compute dtype) and each token's
        # fp32 log-sum-exp where log_softmax kept an fp32 copy (``chunked_loss_saved``).
        delta = chunked_loss_saved(cm, micro_batch) - (4 * micro_batch * cm.seq_len * cm.model.vocab + 4)
        full, plain, kept = full + delta, plain + delta, kept + delta
    c = cm.compute(role, device, tp, micro_batch)
    if device in cm.profiles and c.activation_bytes:
        # A measured count (Partita's runtime, no SP, no recompute) replaces the analytic one; the
        # variants keep the analytic ratio to it. What the layout adds is not measured: it stays.
        analytic_plain = activation_bytes(kind, recompute="none", **(kw | {"sequence_parallel": False,
                                                                          "sharded_inputs": False}
                                                                        | _kernels_keep(ENGINES["partita"])))
        scale = c.activation_bytes / analytic_plain if analytic_plain else 1.0
        scaled = int(plain * scale)
        full, kept, plain = int(full * scale), kept - plain + scaled, scaled
    if kind.is_moe and role == "block" and tp > 1 and cm.engine.expert_tp == "split":
        # Experts split over tp keep the tp group's gathered rows for their weight gradients where
        # whole experts keep the rank's own (search/experts.py, ``expert_rows_bytes``); recomputed
        # (selectively: the products' outputs kept, the rows not) they keep neither.
        gathered = cm.expert_rows_bytes(micro_batch) * (tp - 1) // tp
        kept_rows = gathered if kept_as == "none" else 0
        full, plain, kept = full + gathered, plain + kept_rows, kept + kept_rows
    cache[key] = full, plain, kept
    return cache[key]


def dense_memory(cm, role: str, device: str, *, tp: int, sp: bool, zero: int, recompute: str, replicas: int,
                 micro_batch: int, num_micro_batches: int, tied_copy: bool = False) -> LayerMemory:
    """The layer's parameters (``cm.param_count``; ``tied_copy``: a tied head on another stage
    than the embedding, holding its own copy of the shared weight, runtime/tied.py) replicated
    over ``replicas`` ranks, its activations and its transients."""
    params = cm.param_count(role, tp) + (cm.tied_params(tp) if tied_copy else 0)
    e = cm.elem
    z = zero if replicas > 1 else 0
    shard = replicas if z >= 1 else 1
    # FSDP2 wraps every layer when there is data parallelism or mixed precision (the
    # runtime's rule); it then also keeps the compute-dtype copy it gathers.
    fsdp = replicas > 1 or e != MASTER_BYTES
    grad_bytes, master_bytes, adam_bytes = state_bytes(cm)
    weights = params * master_bytes // shard
    if cm.engine.matmul == "fp8" and cm.engine.fp8_impl == "transformer_engine" and role == "block" and zero == 0:
        # FP8 products: Transformer Engine casts each weight once a step into an FP8 copy and its
        # transpose, kept all step beside the bf16 weight. With the distributed optimizer (ZeRO >= 1,
        # where the export writes --fp8-param-gather) the weight itself is FP8: no more bytes.
        weights += 2 * params
    # A gathered parameter's bytes: FSDP's (FP8 under a float8 all-gather, ``CostModel.gather_bytes``)
    # when it shards, else the compute-dtype copy mixed precision keeps.
    g = cm.gather_bytes(role) if z >= 1 else e
    gathered = round(params * g) if fsdp and z < 3 else 0
    if fsdp and z < 2 and num_micro_batches > 1:
        gradients = params * grad_bytes  # accumulated unsharded until the last micro-batch
    else:
        gradients = params * grad_bytes // shard
    optimizer = params * adam_bytes // shard
    local_params = params // shard
    full, plain, kept = _activations(cm, role, device, tp=tp, sp=sp, recompute=recompute, micro_batch=micro_batch)
    # A layer's own extra memory peaks at one of two moments (measured per layer and phase with
    # torch's memory tracker on CPU ranks, tests/test_runtime_memory.py):
    # - its forward all-gather at ZeRO-2/3: the gather's output buffer and the parameters it
    #   is copied into are both alive (ZeRO-3: 2 x the compute-dtype layer; ZeRO-2: the
    #   buffer beside the copy the stage keeps, counted in gathered_weights);
    # - its backward: the parameters gathered again at ZeRO-3 (with FSDP2's prefetch of the
    #   layer before it: 2 copies), the unsharded gradient FSDP2 produces in the reduce dtype
    #   before reducing it, and the larger of the recomputed activations (freed as the
    #   backward consumes them; a selective recomputation brings the layer back to what it
    #   holds without recomputing, its kept products among it) and the backward's working
    #   set (a block's MLP gradients; the loss's backward on the logits for the head, whose
    #   gradient comes after it).
    # These per-layer terms are what the search sums; a plan's prediction also looks at the
    # layer's neighbours (``neighbour_peak``, which keeps the parts apart).
    # An engine that keeps ZeRO-2's parameters whole all step (DeepSpeed) gathers none per micro-batch.
    kept_whole = z == 2 and cm.engine.zero2_gather == "step"
    gather_spike = 0 if kept_whole else {2: round(params * g), 3: round(2 * params * g)}.get(z, 0)
    resident = round(2 * params * g) if z == 3 else 0
    recompute_extra = max(0, full - plain)
    unsharded_grad = params * grad_bytes if fsdp and role != "head" else 0
    copy = round(params * g)
    if z == 3 and fsdp and cm.engine.zero3_gathers == "module":
        # DeepSpeed gathers a module at a time into the parameter's own storage, the next one
        # prefetched, and reduces each module's gradient in the model dtype through its bucket:
        # a layer never holds more than two modules' parameters (search/engines.py).
        copy = min(params, largest_module_params(cm.model.kinds[role], tp)) * e
        gather_spike = resident = 2 * copy
        modules = block_module_params(cm.model.kinds[role], tp)
        if recompute == "full" and modules:
            # ... except what its recomputed forward keeps gathered for the backward: the modules
            # reused within stage3_max_reuse_distance (``engines.recompute_regathers``), all held
            # when the backward starts, beside the next one fetched.
            held = sum(map(sum, modules)) - sum(recompute_regathers(cm.model.kinds[role], tp,
                                                                   cm.engine.max_reuse_distance))
            resident = max(resident, held * e + copy)
        unsharded_grad = copy + min(params, cm.engine.reduce_bucket) * e if role != "head" else 0
    if role == "block":
        working = block_backward_transient(cm, tp, micro_batch)
    elif role == "head":
        working = loss_transient(cm, tp, micro_batch)
    else:
        working = 0
    if sp and tp > 1 and role != "embed" and cm.engine.sp_inputs == "sharded":
        # the input kept as a sequence shard, gathered again for the weight gradients (search/engines.py)
        working += micro_batch * cm.seq_len * cm.model.hidden * e
    backward_extra = resident + unsharded_grad + max(recompute_extra, working)
    if gather_spike > backward_extra:
        phase, transient, transient_gathered = "forward", gather_spike, gather_spike
    else:
        phase, transient, transient_gathered = "backward", backward_extra, resident
    every_micro_batch = z >= 2 or num_micro_batches == 1  # reduces (and, kept, reshards) in each backward
    up = round_up_to_grain  # every byte count in whole allocation grains (partita.units)
    return LayerMemory(weights=up(weights), gathered_weights=up(gathered), gradients=up(gradients),
                       optimizer=up(optimizer), activations=up(kept),
                       transient=up(transient_gathered) + up(transient - transient_gathered),
                       transient_gathered=up(transient_gathered), params=local_params, peak_phase=phase,
                       copy=up(copy) if fsdp else 0, forward_extra=up(gather_spike),
                       backward_own=up(recompute_extra + working),
                       reduce_buffer=up(params * grad_bytes) if fsdp and every_micro_batch else 0,
                       regathers=fsdp and z == 3,
                       releases_copy=bool(gathered) and every_micro_batch and not kept_whole)


def ring_memory(cm, m: LayerMemory, *, tp: int, micro_batch: int) -> LayerMemory:
    """A block under ring attention also holds the ring's blocks in flight while its attention
    runs (``context.ring_transient_bytes``): a transient of its backward."""
    sh = Shard.of(cm.model.kinds["block"], tp=tp, micro_batch=micro_batch, seq_len=cm.seq_len, dtype=cm.dtype)
    ring = ring_transient_bytes(batch=micro_batch, seq=cm.plan_seq_len, heads=sh.heads, kv_heads=ring_heads(cm, tp),
                                head_dim=sh.head_dim, elem=cm.elem, cp=cm.cp, ring=cm.engine.cp_ring)
    extra = round_up_to_grain(max(ring.forward, ring.backward))
    return dataclasses.replace(m, transient=m.transient + extra, backward_own=m.backward_own + extra)


def gather_memory(cm, m: LayerMemory, *, tp: int, micro_batch: int) -> LayerMemory:
    """A block under the all-gather variant holds the gathered K and V of the whole sequence
    while its attention runs, forward and backward (``context.gather_traffic``'s buffers): a
    transient (beyond what its activations keep without recomputation, ``cp_activation_bytes``)."""
    extra = round_up_to_grain(sum(block_gather_traffic(cm, tp, micro_batch).forward_messages))
    return dataclasses.replace(m, transient=m.transient + extra, backward_own=m.backward_own + extra)


def expert_memory(cm, m: LayerMemory, *, params: int, replicas: int, zero: int, num_micro_batches: int) -> LayerMemory:
    """A block's MoE part sharded apart (``experts.moe_parts``: the rank's E/ep routed experts
    under ep, the MoE's other weights under tp): ``params`` on the rank, sharded over its
    ``replicas``. (A dp that ep does not divide cannot run: ``layer_memory`` prices it at
    ``UNRUNNABLE_BYTES``.)"""
    e = cm.elem
    z = zero if replicas > 1 else 0
    shard = replicas if z >= 1 else 1
    # The experts are an FSDP2 unit whenever dp > 1 (always, at ep > 1): a compute-dtype copy
    # at ZeRO 0-2, gradients accumulated unsharded over micro-batches at ZeRO 0-1.
    grad_bytes, master_bytes, adam_bytes = state_bytes(cm)
    gathered = params * e if z < 3 else 0
    gradients = params * grad_bytes if z < 2 and num_micro_batches > 1 else params * grad_bytes // shard
    spike = {2: params * e, 3: 2 * params * e}.get(z, 0) + params * grad_bytes  # a gather, the unsharded gradient
    up = round_up_to_grain
    return dataclasses.replace(
        m, weights=m.weights + up(params * master_bytes // shard),
        gathered_weights=m.gathered_weights + up(gathered), gradients=m.gradients + up(gradients),
        optimizer=m.optimizer + up(params * adam_bytes // shard), params=m.params + params // shard,
        transient=m.transient + up(spike), backward_own=m.backward_own + up(params * grad_bytes),
        copy=m.copy + up(params * e))


def block_backward_transient(cm, tp: int, micro_batch: int) -> int:
    """A block's backward working set: the gradients of the MLP's three ffn/tp-wide
    intermediates and the hidden-wide gradient it passes on (measured: exactly this on CPU
    ranks, for tp 1 and 2)."""
    t = micro_batch * cm.seq_len
    if cm.model.is_moe:  # each of the rank's MoE tokens' k expert rows, on whole experts (t/tp tokens under tp)
        return 3 * (t // tp) * cm.model.experts_per_token * cm.model.ffn * cm.elem + t * cm.model.hidden * cm.elem
    return 3 * t * (cm.model.ffn // tp) * cm.elem + t * cm.model.hidden * cm.elem


def loss_transient(cm, tp: int, micro_batch: int) -> int:
    """The loss's backward on this rank's vocab/tp logits (t tokens) and the gradient of the
    head's input (4 t h), beside what the loss keeps (the head's activations):

    * a vocab-parallel head (tp > 1: torch's ``loss_parallel``): the gradients of the fp32
      log-probabilities and of the fp32 logits and the softmax it recomputes, 4 bytes each per
      logit; the gradient's cast back to the compute dtype comes after that peak (measured with
      torch's MemTracker on two gloo ranks, bf16 and fp32 logits alike: 12 bytes a logit;
      ``tests/test_fp32_loss_memory.py``);
    * at tp 1, an engine whose loss takes the logits in fp32 (search/engines.py, ``loss``:
      ``F.cross_entropy(logits.float(), ...)``, log_softmax and nll_loss): the log-probabilities'
      gradient (nll_loss's backward, dense) and the logits' (log_softmax's backward, fused: no
      softmax made), 4 bytes each, then the cast to the compute dtype once the first is freed
      (4 + e); measured on the CPU with a dispatch mode that tracks live storages: 8 bytes a
      logit (docs/calibration.md, "Activation memory");
    * Megatron-Core's cross entropy ("fp32_in_place", any tp): the gradient written over its kept
      fp32 softmax, only the cast back to the compute dtype new, e bytes a logit;
    * the runtime's chunked loss (``runtime.schedule.ChunkedCrossEntropy``): the logits' gradient
      in the compute dtype, written chunk by chunk, beside one chunk's fp32 softmax (c =
      ``loss_chunk_tokens`` tokens); its forward holds two such chunks (the fp32 logits and
      logsumexp's exponentials)."""
    t = micro_batch * cm.seq_len
    logits = t * (cm.model.vocab // tp)
    if tp == 1 and cm.engine.loss == "chunked":
        chunk = loss_chunk_tokens(t, cm.model.vocab) * cm.model.vocab
        return max(cm.elem * logits + 4 * chunk, 8 * chunk) + 4 * t * cm.model.hidden
    if cm.engine.loss == "fp32_in_place":  # the gradient written over the kept softmax; the cast back is new
        return (cm.elem * logits if cm.elem != 4 else 0) + 4 * t * cm.model.hidden
    if tp == 1:
        return max(8, 4 + cm.elem) * logits + 4 * t * cm.model.hidden
    return 12 * logits + 4 * t * cm.model.hidden


def chunked_loss_saved(cm, micro_batch: int) -> int:
    """What the chunked loss keeps from forward to backward for t tokens: the logits as the head
    made them (compute dtype), each token's fp32 log-sum-exp, and the int64 targets (counted by
    ``analytic.activation_bytes`` already). On a last pipeline stage the schedule also keeps the
    stage's output, the same logits, until its backward has run (``pipeline_memory``'s retained
    output): counted twice there, an upper bound."""
    t = micro_batch * cm.seq_len
    return cm.elem * t * cm.model.vocab + 4 * t


class Moment(NamedTuple):
    """The running micro-batch at a stage's peak: its activations so far, the peak layer's
    gathered parameters and its other extra bytes, and the kept copies of later layers already
    freed then (counted in the stage's gathered weights, so taken off them)."""

    activations: int
    gathered: int
    other: int
    released: int
    layer: str
    phase: str

    @property
    def bytes(self) -> int:
        return self.activations + self.gathered + self.other - self.released


def neighbour_peak(layers: Sequence[tuple[LayerMemory, int, str]]) -> Moment:
    """The running micro-batch's peak in a stage whose layers are known in order, as FSDP2 runs
    them (each layer's backward prefetches the layer before it in its stage,
    ``runtime.parallelize.set_backward_prefetch``). What the per-layer terms cannot see:

    * a layer's backward holds the prefetched copy of the layer before it only when that one is
      ZeRO-3 (the others keep theirs; the stage's first layer prefetches nothing), and a ZeRO-3
      layer copies its gather out (2 copies of its own) before its backward computes anything;
    * the reduce-scatter buffer FSDP2 keeps during a layer's backward is the layer after's (until
      this one makes its own), and only a layer that reduces every micro-batch has one;
    * the layers after it have done their backward: those that reshard after every backward
      (ZeRO-2; any FSDP2 layer when there is one micro-batch) have freed their copies;
    * a layer's forward gather and its backward both compete.

    Layers given as (memory, count, name) runs of one choice; each layer is a moment of its own."""
    flat = [(m, name) for m, n, name in layers for _ in range(n)]
    released_after = [0] * len(flat)
    freed = 0
    for i in range(len(flat) - 1, -1, -1):
        released_after[i] = freed
        if flat[i][0].releases_copy:
            freed += flat[i][0].gathered_weights
    best: Moment | None = None
    acts = 0
    for i, (m, name) in enumerate(flat):
        acts += m.activations
        before = flat[i - 1][0] if i else None
        prefetch = before.copy if before is not None and before.regathers else 0
        reducing = flat[i + 1][0].reduce_buffer if i + 1 < len(flat) else 0
        own = m.copy if m.regathers else 0
        moments = [Moment(acts, own + prefetch, reducing + m.backward_own, released_after[i], name, "backward")]
        if m.regathers:
            moments.append(Moment(acts, 2 * own, reducing, released_after[i], name, "backward"))
        if m.forward_extra:
            moments.append(Moment(acts, m.forward_extra, 0, 0, name, "forward"))
        for moment in moments:
            if best is None or moment.bytes > best.bytes:
                best = moment
    assert best is not None
    return best


def activation_message_bytes(cm, micro_batch: int, tp: int = 1) -> int:
    """One micro-batch's hidden states on one rank, in the compute dtype (in whole allocation
    grains): b x s x h, or with ``tp`` the rank's b x s/tp x h sequence shard where a stage
    boundary splits them (``boundary_split``): what a stage sends on, gets a gradient of, and
    keeps per micro-batch in flight."""
    tokens = cm.seq_len // boundary_split(cm.seq_len, tp)
    return round_up_to_grain(micro_batch * tokens * cm.model.hidden * cm.elem)


def kept_output_bytes(cm, micro_batch: int, tp: int) -> int:
    """The stage output a pipeline schedule keeps per micro-batch in flight, until that
    micro-batch's backward: its hidden states (``activation_message_bytes``) under an engine that
    keeps them (torch.distributed.pipelining), none under one that frees a sent output's storage
    (Megatron-LM's ``deallocate_output_tensor``; search/engines.py, ``p2p_buffers``)."""
    return 0 if cm.engine.p2p_buffers == "per_transfer" else activation_message_bytes(cm, micro_batch, tp)


# Receive buffers a stage of Partita's runtime holds per direction (``p2p_buffers`` "on_receive"):
# the one the running chunk reads and the one torch's schedules post for the next action before
# the running one is done (measured: tests/test_runtime_boundary.py, an interleaved stage holds two
# activation buffers at once, or two gradient buffers).
ON_RECEIVE_BUFFERS = 2


def receive_buffers(cm, num_micro_batches: int) -> int:
    """Receive buffers a pipeline stage holds per direction (search/engines.py, ``p2p_buffers``):
    one per micro-batch, allocated once (torch.distributed.pipelining as it comes); the one a
    posted receive fills (Megatron-LM, which allocates each as it posts it); or, in Partita's
    runtime, which allocates each as it posts it too, ``ON_RECEIVE_BUFFERS``. Either way a
    received activation is then its first block's input, counted with the activations of each
    micro-batch in flight."""
    return {"per_micro_batch": num_micro_batches, "on_receive": ON_RECEIVE_BUFFERS}.get(cm.engine.p2p_buffers, 1)


def pipeline_memory(cm, counts: Mapping[tuple, int], *, tp: int, micro_batch: int, num_micro_batches: int,
                    is_last: bool) -> tuple[int, int, int]:
    """(receive buffers, output kept per micro-batch in flight, retained logits) of a pipeline
    stage whose layers make the choices ``counts`` (``stage.LayerChoice``), in bytes.

    A stage receives activations (every stage but the first) and gradients (every stage but the
    last), each ``micro_batch * seq * hidden`` elements, or the rank's 1/tp sequence shard of
    them (``activation_message_bytes``), into buffers its engine holds per direction
    (``receive_buffers``): ``torch.distributed.pipelining`` as it comes allocates one per
    micro-batch, once and for good. The schedule also keeps each micro-batch's stage output (the
    same shard) until that micro-batch's backward: for every micro-batch in flight on the other
    stages, the logits on the last (one at a time under 1F1B). A stage that is both first and
    last (no pipeline) holds none of these. Under "on_receive" (Partita's runtime) a received
    activation is its first block's input and counted there; where that block takes whole hidden
    states from a split boundary, it gathers a copy and the received shard is kept beside it,
    1/tp of one block input per micro-batch in flight (a few per cent of one block's
    activations), which is not priced."""
    roles = {choice[0] for choice in counts}
    is_first = "embed" in roles
    if is_first and is_last:
        return 0, 0, 0
    act_msg = activation_message_bytes(cm, micro_batch, tp)
    buffers = receive_buffers(cm, num_micro_batches) * act_msg * ((not is_first) + (not is_last))
    if is_last:
        return buffers, 0, retained_logits_bytes(cm, counts, micro_batch)
    return buffers, kept_output_bytes(cm, micro_batch, tp), 0


def retained_logits_bytes(cm, counts, micro_batch: int) -> int:
    """The last stage's output, its head's logits, kept by the schedule per micro-batch until the
    loss's backward (torch.distributed.pipelining applies the loss to the stage output); none
    where the stage computes its loss itself and frees its output (Megatron-LM: the loss's own
    tensors are the head's activations, ``activation_bytes``)."""
    if cm.engine.p2p_buffers == "per_transfer":
        return 0
    head_tp = next(choice[1] for choice in counts if choice[0] == "head")
    return round_up_to_grain(micro_batch * cm.seq_len * (cm.model.vocab // head_tp) * cm.elem)
