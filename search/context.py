"""Context parallelism's costs: attention compute, communication, memory and limits, per rank.

    from partita.search.context import all_to_all_traffic, ring_traffic, cp_activation_bytes
    t = all_to_all_traffic(batch=1, seq=131072, heads=32, kv_heads=8, head_dim=128, elem=2, cp=8)
    t.forward_wire_bytes        # what one rank sends in one attention forward

Pure functions of the shapes (no torch). Symbols: b micro-batch, s the whole sequence, cp the
context-parallel degree, L = s/cp the tokens a rank holds, d head_dim, e bytes per element,
H and KV the query and kv heads a rank holds *before* context parallelism (heads/tp and
kv_heads/tp under tensor parallelism: pass those). Each function is per rank, per micro-batch,
per attention layer; the cost model multiplies by layers and micro-batches.

Three variants (``VARIANTS``), matching ``partita.runtime.context``:

* ``all_to_all`` (DeepSpeed-Ulysses: Jacobs et al. 2023, arXiv:2309.14509, sec. 3). Four
  all-to-alls a forward (q, k, v to head shards; the output back), the same four in the backward
  on the gradients: the bytes a rank sends shrink as 1/cp when s and cp grow together, so the
  traffic per link stays constant, unlike an all-gather of the sequence.
* ``ring`` (Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise Transformers for
  Near-Infinite Context", arXiv:2310.01889, sec. 3): each rank keeps its queries and passes its
  key/value block around the ring, overlapping each pass with the attention of the block it
  has. The runtime uses torch's ``context_parallel`` (the PyTorch tutorial "Introduction to
  Context Parallel"; torchtitan's ``context_parallel_rotate_method``) with head-tail load
  balancing: 2*cp chunks, rank r holding chunks r and 2*cp-1-r, as Llama 3 does.
* ``all_gather`` (Llama 3's: Llama Team 2024, arXiv:2407.21783, sec. 3.3.2): each rank all-gathers
  the keys and values of the whole sequence at their own kv heads (far fewer than the queries'
  under grouped-query attention: 1 a rank for Llama 3 405B at tp 8), then attends for its
  head_tail chunks (``gather_traffic``); the backward reduce-scatters dK and dV. Exposed: the
  attention waits for the gather. Transformer Engine's (``AttnFuncWithCPAndKVAllGather``, the
  megatron engine's ``cp_ring``) keeps the local k and v and gathers again in the backward.

Torch's ring (``torch/distributed/tensor/experimental/_context_parallel/_attention.py``, torch
2.13): cp forward steps, only the first masked (``_is_causal_behavior``); before step i < cp-1 it
starts sending its K/V block to the next rank (rotate "alltoall"), or all-gathers every rank's
block before step 0 ("allgather", torch's default). The backward passes K/V the same way and the
dK/dV accumulators at every step, in fp32 (``convert_to_f32``); the runtime repeats kv heads
before SDPA (``runtime.models.Attention``), so its blocks hold H heads: ``ring_kv_heads``.
Transformer Engine's ring (``AttnFuncWithCPAndKVP2P``, Megatron's ``cp_ring`` "transformer_engine":
``ring_heads``, ``te_ring_traffic``; TE 1.11's ``pytorch/attention.py``, today's
``dot_product_attention/context_parallel.py``) masks its first step only, passes the blocks at the
kernel's kv heads in the compute dtype, and in its backward sends K/V, then K/V with the dK/dV so
far, then dK/dV, each beside a step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from partita import parallel
from partita.cluster import ClusterSpec, NodeGroup
from partita.devices import get_device
from partita.errors import PartitaError
from partita.model import LayerKind
from partita.profile import attention_time_at
from partita.search.analytic import Shard, activation_bytes, attention_s
from partita.search.costs.links import Link, link_within

VARIANTS = ("all_to_all", "ring", "all_gather")
ROTATES = ("alltoall", "allgather")
GRAD_ACCUM_BYTES = 4  # the ring's dQ, dK, dV accumulators and merged output are fp32 (convert_to_f32)
STAT_BYTES = 4  # logsumexp


# ---- limits: None when the choice is possible, else why not and what to change -----------------


def sequence_limit(seq_len: int, cp: int) -> str | None:
    """Every variant splits the sequence into cp equal shards."""
    if cp < 1:
        return f"context-parallel degree must be >= 1, got {cp}"
    if seq_len % cp:
        return f"sequence length {seq_len} is not divisible by context-parallel degree {cp}"
    return None


def all_to_all_limit(heads: int, kv_heads: int, *, cp: int, tp: int = 1) -> str | None:
    """All-to-all gives each of the cp x tp ranks of a block whole query and kv heads."""
    for what, n in (("heads", heads), ("kv_heads", kv_heads)):
        if n % (cp * tp):
            return (f"all-to-all context parallelism needs {what} ({n}) divisible by cp x tp = {cp} x {tp} = "
                    f"{cp * tp}")
    return None


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise PartitaError(f"unknown context-parallel variant {variant!r}; valid: {', '.join(VARIANTS)}")


def _check_positive(**dims: int) -> None:
    bad = {k: v for k, v in dims.items() if v < 1}
    if bad:
        raise PartitaError(f"context-parallel costs need positive dimensions, got {bad}")


def _local_tokens(seq: int, cp: int) -> int:
    why = sequence_limit(seq, cp)
    if why:
        raise PartitaError(why)
    return seq // cp


# ---- compute ----------------------------------------------------------------------------------


def causal_attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int) -> float:
    """Forward FLOPs of q k^T and p v over the (query, key) pairs a causal mask keeps, queries
    being the last ``q_len`` of ``kv_len`` positions: 4 b H d per pair (two products, 2 FLOPs a
    multiply-add). q_len = kv_len = s gives 2 b H s^2 d, ``roofline.attention_flops_bytes``'s."""
    _check_positive(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim)
    pairs = q_len * (kv_len - q_len) + q_len * q_len / 2  # a full rectangle, then half the square
    return 4.0 * batch * heads * head_dim * pairs


def attention_flops(*, variant: str, batch: int, seq: int, heads: int, head_dim: int, cp: int,
                    balanced: bool = True) -> float:
    """Forward attention FLOPs of the busiest rank. The backward is ``ATTENTION_BWD_FLOPS_RATIO``
    times this (five block products to the forward's two).

    * all_to_all: the whole sequence for H/cp heads: 2 b (H/cp) s^2 d, equal on every rank.
    * ring, head-tail balanced: step 0 is the rank's own two chunks, causal (L^2/2 pairs);
      each of the other cp-1 steps needs half a block (its early chunk against all of the
      visiting block, or all of it against the visiting block's early chunk: L^2/2 pairs).
      So cp * L^2/2 pairs = s^2/(2 cp), 1/cp of the causal total, on every rank: 2 b H s^2 d / cp.
    * ring, contiguous shards (``balanced=False``): the last rank sees cp-1 full blocks and
      its own causal one, (cp - 1/2) L^2 pairs: 4 b H d (cp - 1/2) L^2, nearly twice the mean.
    Both balanced variants equal the single-rank FLOPs / cp (``tests/test_context_costs``)."""
    _check_variant(variant)
    local = _local_tokens(seq, cp)
    if variant == "all_to_all":
        if heads % cp:
            raise PartitaError(all_to_all_limit(heads, heads, cp=cp))
        return causal_attention_flops(batch, heads // cp, seq, seq, head_dim)
    if balanced:
        return cp * ring_step_flops(batch=batch, seq=seq, heads=heads, head_dim=head_dim, cp=cp)
    return 4.0 * batch * heads * head_dim * (cp - 0.5) * local * local


def ring_step_flops(*, batch: int, seq: int, heads: int, head_dim: int, cp: int) -> float:
    """Forward FLOPs of one step of the balanced ring: L^2/2 pairs, the same as one causal
    attention over L tokens; so a step's time is ``roofline.attention_time_s(dev, b, H, L, d)``
    and the ring's compute is cp of those."""
    local = _local_tokens(seq, cp)
    return causal_attention_flops(batch, heads, local, local, head_dim)


# ---- communication ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """One rank's communication for one attention layer's forward and backward: the messages
    (each a collective the cost model prices on the cp group's link) and the bytes that leave
    the rank. ``*_messages`` hold the buffer size of each collective, as
    ``costs.links.collective_s`` takes it."""

    op: str  # "all_to_all", "p2p" (one ring step) or "all_gather"
    forward_messages: tuple[int, ...]
    backward_messages: tuple[int, ...]
    forward_wire_bytes: float
    backward_wire_bytes: float

    @property
    def total_wire_bytes(self) -> float:
        return self.forward_wire_bytes + self.backward_wire_bytes


def all_to_all_bus_bytes(buffer_bytes: float, cp: int) -> float:
    """Bytes one rank sends in an all-to-all of a ``buffer_bytes`` buffer over cp ranks: all of
    it but the 1/cp it keeps. (For ``partita.profile.bus_bytes`` and ``costs.links.ring_steps``: an
    all-to-all is cp-1 pairwise exchanges of buffer/cp.)"""
    if cp <= 1:
        return 0.0
    return (cp - 1) / cp * buffer_bytes


def gather_traffic(*, batch: int, seq: int, kv_heads: int, head_dim: int, elem: int, cp: int) -> Traffic:
    """The all-gather variant: forward, one all-gather each of K and V over the whole sequence at
    the rank's ``kv_heads`` (a b s KV d e buffer, (cp-1)/cp of it arriving); backward, the
    reduce-scatter of each one's gradient, the same bytes (``runtime.context._GatherShards``).
    A recomputed block gathers once more in its backward. Zero at cp = 1."""
    _check_positive(batch=batch, kv_heads=kv_heads, head_dim=head_dim, elem=elem)
    _local_tokens(seq, cp)
    if cp == 1:
        return Traffic("all_gather", (), (), 0.0, 0.0)
    buffer = batch * seq * kv_heads * head_dim * elem
    wire = 2 * (cp - 1) / cp * buffer
    return Traffic("all_gather", (buffer, buffer), (buffer, buffer), wire, wire)


def gather_saved_bytes(*, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, elem: int, cp: int) -> int:
    """What the all-gather variant keeps, without recomputation, against the local attention's
    count (``analytic.activation_bytes``: k and v of the rank's L tokens at H heads, repeated
    before SDPA): the chunks' attention keeps the gathered K and V of all s tokens at their KV
    heads instead (``enable_gqa``: never repeated; the rank's own k and v, only gathered, are not
    kept), 2 b s KV d e - 2 b L H d e, and the output as a storage of its own (the chunks'
    outputs joined), b L H d e. Signed: under grouped-query attention with H / KV > 2 cp it keeps
    less than the local count. As a transient (recomputed blocks): the gathered K and V."""
    local = _local_tokens(seq, cp)
    d = batch * head_dim * elem
    return 2 * seq * kv_heads * d - 2 * local * heads * d + local * heads * d


def all_to_all_traffic(*, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, elem: int,
                       cp: int) -> Traffic:
    """Forward: q, k, v and the output, each this rank's [b, L, heads, d] buffer:
    b L d e (2H + 2 KV) bytes, of which (cp-1)/cp leaves the rank. Backward: the mirror (the
    output's gradient in, the q, k, v gradients back), the same four buffers. With s and cp
    grown together, L and so every message stays the same size (Ulysses' constant per-link
    volume). Zero at cp = 1. A recomputed block (full or selective) runs its forward's four
    again in the backward: the cost model adds ``forward_messages`` once more."""
    _check_positive(batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, elem=elem)
    local = _local_tokens(seq, cp)
    if cp == 1:
        return Traffic("all_to_all", (), (), 0.0, 0.0)
    q = batch * local * heads * head_dim * elem
    kv = batch * local * kv_heads * head_dim * elem
    messages = (q, kv, kv, q)
    wire = sum(all_to_all_bus_bytes(m, cp) for m in messages)
    return Traffic("all_to_all", messages, messages, wire, wire)


def ring_kv_heads(heads: int, kv_heads: int, *, repeated: bool = True) -> int:
    """The heads in a K/V block the ring passes: the runtime repeats kv heads to the query heads
    before SDPA (``repeated``), so the ring moves H heads; a GQA-aware kernel would move KV."""
    return heads if repeated else kv_heads


def ring_block_bytes(*, batch: int, seq: int, kv_heads: int, head_dim: int, elem: int, cp: int) -> int:
    """One rank's K and V block: 2 b L KV d e."""
    _check_positive(batch=batch, kv_heads=kv_heads, head_dim=head_dim, elem=elem)
    return 2 * batch * _local_tokens(seq, cp) * kv_heads * head_dim * elem


def ring_traffic(*, batch: int, seq: int, kv_heads: int, head_dim: int, elem: int, cp: int,
                 rotate: str = "alltoall") -> Traffic:
    """``kv_heads``: what the ring moves (``ring_kv_heads``). With B the K/V block
    (``ring_block_bytes``) and G the fp32 dK/dV block (B * 4 / e):

    * forward, rotate "alltoall": cp-1 point-to-point passes of B (each rank sends its block on
      and forwards the ones it receives); "allgather": one all-gather of cp blocks, the same
      (cp-1) B leaving the rank.
    * backward: K/V again as in the forward, plus cp passes of G (the accumulated dK/dV travel
      the whole ring to come home; torch always passes them point to point).
    Zero at cp = 1. A recomputed block passes the forward's K/V once more in the backward."""
    if rotate not in ROTATES:
        raise PartitaError(f"unknown ring rotate method {rotate!r}; valid: {', '.join(ROTATES)}")
    block = ring_block_bytes(batch=batch, seq=seq, kv_heads=kv_heads, head_dim=head_dim, elem=elem, cp=cp)
    if cp == 1:
        return Traffic("p2p" if rotate == "alltoall" else "all_gather", (), (), 0.0, 0.0)
    grad = block * GRAD_ACCUM_BYTES // elem
    if rotate == "alltoall":
        forward, op = (block,) * (cp - 1), "p2p"
    else:
        forward, op = (cp * block,), "all_gather"
    kv_wire = (cp - 1) * block
    return Traffic(op, forward, forward + (grad,) * cp, float(kv_wire), float(kv_wire + cp * grad))


def _ring_steps(a: float, cp: int, first: float | None) -> list[float]:
    """The ring's cp step times: ``first`` (the masked one, the rank's own block), then a."""
    return [a if first is None else first] + [a] * (cp - 1)


def ring_forward_time_s(*, step_compute_s: float, step_comm_s: float, cp: int, rotate: str = "alltoall",
                        first_step_s: float | None = None) -> float:
    """The ring's forward attention time on the busiest rank from its steps' times a_i (``_ring_steps``)
    and one K/V pass's time c, a transfer wholly beside the attention that runs while it is in flight
    (separate streams; the SMs NCCL takes are ignored): "alltoall" sends block i+1 during step i,
    "allgather" (c: the one all-gather) lands before step 1; only comm beyond compute is exposed:
        sum a_i + sum over the first cp-1 (allgather: the first) of max(0, c - a_i)."""
    steps = _ring_steps(step_compute_s, max(1, cp), first_step_s)
    behind = steps[:1] if rotate == "allgather" and cp > 1 else steps[:-1]
    return sum(steps) + sum(max(0.0, step_comm_s - a) for a in behind)


def ring_backward_time_s(*, step_compute_s: float, kv_comm_s: float, grad_comm_s: float, cp: int,
                         first_step_s: float | None = None) -> float:
    """The ring's backward: in each of the first cp-1 steps the next K/V block and the last
    step's dK/dV share the link (the forward's overlap); the last dK/dV pass, bringing each rank
    its gradients, hides behind nothing: sum a_i + sum_{i<cp-1} max(0, c_kv + c_grad - a_i) + c_grad."""
    steps = _ring_steps(step_compute_s, max(1, cp), first_step_s)
    tail = sum(max(0.0, kv_comm_s + grad_comm_s - a) for a in steps[:-1]) + grad_comm_s if cp > 1 else 0.0
    return sum(steps) + tail


def te_ring_traffic(*, batch: int, seq: int, kv_heads: int, head_dim: int, elem: int, cp: int) -> Traffic:
    """Transformer Engine's ring, ``kv_heads`` the kernel's kv heads and B the K/V block at the
    compute dtype (``ring_block_bytes``): forward, cp-1 passes of B (as torch's "alltoall"
    rotate); backward, one pass a step: B (K/V) on the first, 2B (K/V and the dK/dV so far) on
    each between, B (dK/dV) on the last. Zero at cp = 1."""
    block = ring_block_bytes(batch=batch, seq=seq, kv_heads=kv_heads, head_dim=head_dim, elem=elem, cp=cp)
    if cp == 1:
        return Traffic("p2p", (), (), 0.0, 0.0)
    forward = (block,) * (cp - 1)
    backward = (block,) + (2 * block,) * (cp - 2) + (block,)
    return Traffic("p2p", forward, backward, float(sum(forward)), float(sum(backward)))


def te_ring_backward_time_s(*, step_compute_s: float, step_comm_s: Sequence[float],
                            first_step_s: float | None = None) -> float:
    """Transformer Engine's ring backward: each step's pass (``te_ring_traffic``) is posted before
    the step's attention backward and waited for before the next, the last one before the dK/dV
    correction: sum of max(a_i, c_i), the overlap assumption of ``ring_forward_time_s``."""
    steps = _ring_steps(step_compute_s, len(step_comm_s), first_step_s)
    return sum(max(a, c) for a, c in zip(steps, step_comm_s))


# ---- memory ------------------------------------------------------------------------------------


def cp_activation_bytes(kind: LayerKind, *, variant: str, cp: int, tp: int, micro_batch: int, seq_len: int,
                        dtype: str, sequence_parallel: bool = False, recompute: str = "none",
                        on_cpu: bool = False, local_experts: int = 0, sharded_inputs: bool = False,
                        regathers: bool = False, **keeps) -> int:
    """Bytes autograd keeps from one micro-batch's forward on one rank under context parallelism
    of degree cp: ``analytic.activation_bytes`` of the rank's s/cp tokens (every term is per
    token, or per position for rotary tables and the logsumexp, so it all divides by cp), plus
    what the variant adds:

    * all_to_all, no recomputation: SDPA keeps q, k, v, its output and the logsumexp for H/cp
      heads over all s positions -- the same bytes as H heads over s/cp -- but wo's input is now
      the output after the second all-to-all, a storage of its own: + b L H d e. (The all-to-all
      itself keeps nothing: its backward is the mirror all-to-all; ``runtime.context`` reorders
      head_tail shards with views, flips and cats, which keep nothing either.) Measured to the
      byte on CPU ranks (``tests/test_runtime_context``).
    * ring: torch's ring op keeps q, k, v and the merged output and logsumexp of the local
      tokens, as the local SDPA does: nothing added (GPU-only; not measured here).
    * all_gather, no recomputation: ``gather_saved_bytes``; nothing added where the kernel keeps the
      local k and v and gathers again in the backward (``regathers``: Transformer Engine's).
    * recompute "selective" or "full": the kept tensors are products' outputs or the layer
      input, all sequence shards: nothing added.
    ``keeps``: what the engine's kernels keep (``activation_bytes``' ``glu_saves`` to ``fp8_inputs``).
    Embed and head layers keep per-token tensors only; cp divides them. At cp 1, the plain count.
    The cost model's count of a layer's activations (``costs.memory.dense_memory``)."""
    _check_variant(variant)
    local = _local_tokens(seq_len, cp)
    base = activation_bytes(kind, tp=tp, micro_batch=micro_batch, seq_len=local, dtype=dtype,
                            sequence_parallel=sequence_parallel, recompute=recompute, on_cpu=on_cpu,
                            local_experts=local_experts, sharded_inputs=sharded_inputs, **keeps)
    if cp == 1 or kind.role != "block" or variant == "ring" or recompute != "none" or (regathers and variant == "all_gather"):
        return base
    sh = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=local, dtype=dtype)
    if variant == "all_gather":
        return base + gather_saved_bytes(batch=micro_batch, seq=seq_len, heads=sh.heads,
                                         kv_heads=rank_kv_heads(kind, tp), head_dim=sh.head_dim, elem=sh.elem,
                                         cp=cp)
    return base + sh.tokens * sh.heads * sh.head_dim * sh.elem


@dataclass(frozen=True)
class RingTransient:
    """Bytes the ring holds only while one layer's attention runs (peak-memory terms)."""

    forward: int
    backward: int


def ring_transient_bytes(*, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, elem: int, cp: int,
                         rotate: str = "alltoall", ring: str = "torch") -> RingTransient:
    """With B the K/V block (``kv_heads`` as the ring moves them), G its fp32 twin, and O the
    fp32 output [b, L, H, d]:

    * forward: the blocks in flight -- the one computed on and the next ("alltoall": 2B, or
      cp B gathered at once by "allgather") -- plus the fp32 merged output and logsumexp
      (O + 4 b H L);
    * backward: K/V blocks as in the forward, the dK/dV accumulator being sent and the one
      received (2G), this step's dK/dV (G) and the fp32 dQ accumulator (O).
    Transformer Engine's ring (``ring`` "transformer_engine"): the forward as torch's; the
    backward's two buffer pairs of K/V and dK/dV in the compute dtype (4B) and dQ (b L H d e).
    Not kept across layers; one layer's worth sits on top of the activations at the peak."""
    if rotate not in ROTATES:
        raise PartitaError(f"unknown ring rotate method {rotate!r}; valid: {', '.join(ROTATES)}")
    if cp == 1:
        return RingTransient(0, 0)
    local = _local_tokens(seq, cp)
    block = ring_block_bytes(batch=batch, seq=seq, kv_heads=kv_heads, head_dim=head_dim, elem=elem, cp=cp)
    grad = block * GRAD_ACCUM_BYTES // elem
    out32 = batch * local * heads * head_dim * GRAD_ACCUM_BYTES
    in_flight = 2 * block if rotate == "alltoall" else cp * block
    if ring == "transformer_engine":
        return RingTransient(forward=in_flight + out32 + STAT_BYTES * batch * heads * local,
                             backward=4 * block + batch * local * heads * head_dim * elem)
    return RingTransient(forward=in_flight + out32 + STAT_BYTES * batch * heads * local,
                         backward=in_flight + 3 * grad + out32)


# ---- the cost model's terms at cp > 1 (``costs.model.CostModel``) ---------------------------------
#
# Under context parallelism the cost model prices a "rank" that is a cp group of devices holding
# s/cp tokens each (``cluster_view``, ``CostModel.seq_len``), so every per-token term of a layer
# (the TP collectives, activations, working sets, pipeline messages, the loss) is priced at s/cp
# and the grid and CP-SAT search it unchanged. On top of them, for a block:
#
# * the attention core's time is the variant's (``attention_time``): all-to-all, the whole
#   sequence for H/cp heads; ring, the rank's own causal L-token block and cp - 1 unmasked half
#   blocks, the K/V passes overlapping them (``ring_forward_time_s``); each core from the
#   profile's measured attention table where it covers the shape (``attention_core_s``);
# * the variant's collectives on the cp group's link (cp x tp consecutive devices): 4 all-to-alls
#   a forward and 4 a backward (4 more when the block is recomputed), priced by the profile's
#   all-to-all fit where it has one; they, and the ring's passes its blocks do not hide, are
#   ``cp_comm_s`` ("context parallel comm" in a step's breakdown), on the critical path
#   (``with_cp_time``);
# * ZeRO shards, gradient reductions and the optimizer run over dp x cp ranks on the real
#   cluster's links (parameters are replicated over cp): ``CostModel.dp_link``;
# * memory (``costs.memory``): ``cp_activation_bytes``, and the ring's blocks in flight as a
#   transient (``ring_transient_bytes``).


@dataclass(frozen=True, kw_only=True)
class ClusterView(ClusterSpec):
    """The cluster as the search sees it under context parallelism (``cluster_view``): its ranks
    are cp groups of the devices of ``devices``, which is the cluster messages name."""

    devices: ClusterSpec

    @property
    def short(self) -> str:
        return self.devices.short


def cluster_view(cluster: ClusterSpec, cp: int, span_tp: int = 0) -> ClusterSpec:
    """The cluster as the search sees it under context parallelism of degree ``cp``: one "rank"
    is a cp group of consecutive devices (``Plan`` orders tp innermost, then cp), so a node holds
    gpus_per_node / cp of them, each priced as cp devices. Every device keeps its own memory.

    ``span_tp`` (0: none): the view for cp groups that span nodes at that tensor-parallel degree
    (``parallel.cp_locality_rule``): where cp x tp exceeds a group's node, its k = cp x tp / gpus
    per node consecutive nodes are one node of the view, holding one cp group's tp ranks; nodes
    left over (nodes mod k) are not used. Its tp collectives stay in a real node; the K/V passes
    cross the network (``cp_link``), as do pipeline sends (``CostModel.pp_link``)."""
    if cp == 1:
        return cluster
    groups = []
    for g in cluster.groups:
        k = parallel.cp_nodes(cp, span_tp, g.gpus_per_node) if span_tp else 1
        if k == 1 and g.gpus_per_node % cp:
            raise PartitaError(f"context-parallel degree {cp} does not divide the {g.gpus_per_node} GPUs per node of "
                               f"group {g.name!r}; a cp group stays inside a node unless cp x tp spans whole nodes: "
                               f"choose cp dividing {g.gpus_per_node}, or a cp x tp that is a multiple of it")
        if k > 1 and (span_tp * cp) % g.gpus_per_node:
            raise PartitaError(f"cp x tp = {cp} x {span_tp} spans part of a node of group {g.name!r} "
                               f"({g.gpus_per_node} GPUs); choose cp x tp dividing or a multiple of {g.gpus_per_node}")
        if g.nodes // k == 0:
            continue  # too few nodes for one cp group
        groups.append(dataclasses.replace(g, nodes=g.nodes // k, gpus_per_node=k * g.gpus_per_node // cp,
                                          price_per_gpu_hour=g.price * cp if g.price is not None else None))
    if not groups:
        raise PartitaError(f"a context-parallel group of cp x tp = {cp} x {span_tp} spans "
                           f"{max(parallel.cp_nodes(cp, span_tp, g.gpus_per_node) for g in cluster.groups)} nodes; "
                           f"no node group of {cluster.short} has that many: choose a smaller --cp or --tp")
    return ClusterView(name=cluster.name, groups=tuple(groups), inter_group_gbps=cluster.inter_group_gbps,
                       devices=cluster)


def span_tp_of(cluster: ClusterSpec, cp: int, tp: int) -> int:
    """The ``cluster_view`` a plan of degrees cp and tp is priced on: tp when its cp groups span
    nodes of some group, else 0."""
    return tp if cp > 1 and any(cp * tp > g.gpus_per_node for g in cluster.groups) else 0


def check_layout(seq_len: int, cp: int, variant: str) -> None:
    """Raise unless the cost model can price context parallelism of degree ``cp`` (``variant``)
    on ``seq_len`` tokens."""
    _check_variant(variant)
    why = sequence_limit(seq_len, cp)
    if why:
        raise PartitaError(why)


@dataclass(frozen=True)
class AttentionTime:
    """One block's attention core under context parallelism, seconds per micro-batch."""

    forward_s: float  # the core's compute at cp (ring: cp steps)
    backward_s: float
    exposed_forward_s: float  # ring: K/V passes not hidden behind a step; 0 for the all-to-all
    exposed_backward_s: float
    local_forward_s: float  # what it replaces: the core at L = s/cp tokens over H/tp heads
    local_backward_s: float


def cp_link(cm, group: NodeGroup, tp: int) -> Link:
    """A cp group of the cost model ``cm``: cp x tp consecutive devices (inside a node,
    ``cluster_view``)."""
    return link_within(cm.real_cluster.group(group.name), cm.cp * tp)


def attention_core_s(cm, device: str, sh: Shard, *, causal: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core on shard ``sh`` (``causal`` False: every
    query against every key): the device's profile where its table covers the shape
    (``profile.attention_time_at``: the runtime's causal SDPA; the unmasked core by the roofline's
    ratio of the two), else the roofline scaled by the device's compute scale."""
    dev, kernel = get_device(device), cm.software.attention
    profile = cm.profiles.get(device)
    measured = None
    if profile is not None and profile.dtype == cm.dtype and kernel == "sdpa":
        measured = attention_time_at(profile, batch=sh.batch, heads=sh.heads, seq_len=sh.seq, head_dim=sh.head_dim)
    if measured is not None and not causal:
        full, masked = attention_s(dev, sh, cm.dtype, kernel, causal=False), attention_s(dev, sh, cm.dtype, kernel)
        return tuple(m * f / c for m, f, c in zip(measured, full, masked))
    if measured is not None:
        return measured
    scale = cm.time_constants(device).compute_scale
    return tuple(scale * t for t in attention_s(dev, sh, cm.dtype, kernel, causal=causal))


def attention_time(cm, group: NodeGroup, tp: int, micro_batch: int) -> AttentionTime:
    """One block's attention core at the cost model's cp and what it replaces: the core at
    L = s/cp tokens over H/tp heads, which the plain layer cost at ``seq_len`` = L holds. The
    ring's K/V passes its blocks do not hide are apart (``exposed_*``)."""
    device = group.device
    kind = cm.model.kinds["block"]
    local = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=cm.seq_len, dtype=cm.dtype)
    local_f, local_b = attention_core_s(cm, device, local)
    if cm.cp_variant == "all_to_all":
        whole = Shard.of(kind, tp=tp * cm.cp, micro_batch=micro_batch, seq_len=cm.plan_seq_len, dtype=cm.dtype)
        fwd, bwd = attention_core_s(cm, device, whole)
        return AttentionTime(fwd, bwd, 0.0, 0.0, local_f, local_b)
    link = cp_link(cm, group, tp)
    if cm.cp_variant == "all_gather":
        # 1/cp of the causal pairs (head_tail): a rank's two chunks of c = s/(2 cp) against the keys
        # to their ends, (2 cp - 1) c^2 pairs unmasked and c^2 masked, at the whole length's rates;
        # the gathers (again before the backward under TE's) and the reduce-scatters, exposed.
        whole = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=cm.plan_seq_len, dtype=cm.dtype)
        full, masked = attention_core_s(cm, device, whole, causal=False), attention_core_s(cm, device, whole)
        fwd, bwd = (f * (2 * cm.cp - 1) / (4 * cm.cp ** 2) + m / (2 * cm.cp ** 2) for f, m in zip(full, masked))
        traffic = block_gather_traffic(cm, tp, micro_batch)
        ag = sum(cm.collective_s("all_gather", m, cm.cp, link, device) for m in traffic.forward_messages)
        rs = sum(cm.collective_s("reduce_scatter", m, cm.cp, link, device) for m in traffic.backward_messages)
        return AttentionTime(fwd, bwd, ag, rs + (ag if cm.engine.cp_ring == "transformer_engine" else 0.0),
                             local_f, local_b)
    te = cm.engine.cp_ring == "transformer_engine"  # K/V at the kv heads, dK/dV riding with them
    shape = dict(batch=micro_batch, seq=cm.plan_seq_len, head_dim=local.head_dim, elem=cm.elem, cp=cm.cp)
    moved = ring_heads(cm, tp)
    traffic = te_ring_traffic(kv_heads=moved, **shape) if te else ring_traffic(kv_heads=moved, **shape)
    # Step 0 is the rank's own block, causal; each other, half a block unmasked: half that core.
    off_f, off_b = (t / 2 for t in attention_core_s(cm, device, local, causal=False))
    kv = cm.collective_s("p2p", traffic.forward_messages[0], 2, link, device)
    fwd = ring_forward_time_s(step_compute_s=off_f, step_comm_s=kv, cp=cm.cp, first_step_s=local_f)
    if te:
        passes = [cm.collective_s("p2p", m, 2, link, device) for m in traffic.backward_messages]
        bwd = te_ring_backward_time_s(step_compute_s=off_b, step_comm_s=passes, first_step_s=local_b)
    else:
        grad = cm.collective_s("p2p", traffic.backward_messages[-1], 2, link, device)
        bwd = ring_backward_time_s(step_compute_s=off_b, kv_comm_s=kv, grad_comm_s=grad, cp=cm.cp,
                                   first_step_s=local_b)
    compute_f = local_f + (cm.cp - 1) * off_f
    compute_b = local_b + (cm.cp - 1) * off_b
    return AttentionTime(compute_f, compute_b, fwd - compute_f, bwd - compute_b, local_f, local_b)


def ring_heads(cm, tp: int) -> int:
    """The heads of the K/V blocks the cost model's ring moves on a rank: the kv heads under
    Transformer Engine's ring, the query heads under torch's (``ring_kv_heads``)."""
    kind = cm.model.kinds["block"]
    return ring_kv_heads(kind.heads // tp, rank_kv_heads(kind, tp), repeated=cm.engine.cp_ring != "transformer_engine")


def rank_kv_heads(kind: LayerKind, tp: int) -> int:
    """The kv heads one tensor-parallel rank holds (one at least: tp beyond them replicates it)."""
    return max(1, kind.kv_heads // tp)


def block_gather_traffic(cm, tp: int, micro_batch: int) -> Traffic:
    """``gather_traffic`` of one block of the cost model ``cm`` at tp: its K and V buffers, which
    the attention also holds while it runs (``costs.memory.gather_memory``)."""
    kind = cm.model.kinds["block"]
    head_dim = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=cm.seq_len, dtype=cm.dtype).head_dim
    return gather_traffic(batch=micro_batch, seq=cm.plan_seq_len, kv_heads=rank_kv_heads(kind, tp), head_dim=head_dim,
                          elem=cm.elem, cp=cm.cp)


def all_to_all_s(cm, group: NodeGroup, tp: int, micro_batch: int) -> float:
    """One attention forward's 4 all-to-alls (q, k, v, output) on the cp group's link; the
    backward runs the same 4 on the gradients. 0 for the ring."""
    if cm.cp_variant != "all_to_all":
        return 0.0
    kind = cm.model.kinds["block"]
    sh = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=cm.seq_len, dtype=cm.dtype)
    traffic = all_to_all_traffic(batch=micro_batch, seq=cm.plan_seq_len, heads=sh.heads,
                                 kv_heads=rank_kv_heads(kind, tp), head_dim=sh.head_dim, elem=cm.elem, cp=cm.cp)
    link = cp_link(cm, group, tp)
    return sum(cm.collective_s("all_to_all", m, cm.cp, link, group.device) for m in traffic.forward_messages)


def with_cp_time(cm, t, group: NodeGroup, *, tp: int, recompute: str, micro_batch: int):
    """A block's ``costs.layer_time.LayerTime`` ``t`` (its dense terms at s/cp tokens) with the
    attention core at cp in place of the local one and the variant's communication added."""
    at = attention_time(cm, group, tp, micro_batch)
    extra_f, extra_b = at.forward_s - at.local_forward_s, at.backward_s - at.local_backward_s
    all_to_all = all_to_all_s(cm, group, tp, micro_batch)
    comm_f, comm_b = all_to_all + at.exposed_forward_s, all_to_all + at.exposed_backward_s
    if recompute != "none":  # the recomputation runs the attention core (and its collectives) again
        extra_b += extra_f
        comm_b += comm_f
    return dataclasses.replace(t, forward_s=t.forward_s + extra_f + comm_f, backward_s=t.backward_s + extra_b + comm_b,
                               compute_s=t.compute_s + extra_f + extra_b, cp_comm_s=t.cp_comm_s + comm_f + comm_b)
