"""The cost model: what one layer, one stage and one training step cost, in seconds and bytes.

There is one cost model. The uniform planner, the CP-SAT search and the plan evaluator all
price plans through ``CostModel``; the search turns its numbers into integers with
``partita.units`` and nothing else.

Conventions (all per device of a stage, per micro-batch unless said otherwise):

* Compute: forward, backward and recompute time of a layer's 1/tp shard come from a measured
  profile of that device type when it has the point (interpolated in micro-batch), else from
  the analytic roofline (``partita.search.analytic``). ``cost_sources`` records which. Full
  recomputation repeats the forward; selective recomputation its share that is not matrix
  products (``recompute_s``).
* Tensor parallelism (Megatron): a block does 2 all-reduces of the activation ``b*s*h`` in
  forward and 2 in backward; with sequence parallelism they become all-gather +
  reduce-scatter pairs of the same volume. The embedding (vocab-parallel) reduces once in
  forward, the head once in backward. Full recomputation repeats the forward collectives;
  selective recomputation (everything but the matrix products) repeats them all but the last
  product's reduction, where it stops. TP collectives are on the critical path (not overlapped).
* ZeRO over the dp group, on the layer's parameter shard: parameters are gathered in the
  compute dtype, gradients reduced in fp32 (FSDP2's ``reduce_dtype``). Level 0: all-reduce of
  gradients once per step; 1: reduce-scatter of gradients + all-gather of parameters once per
  step; 2: all-gather in forward and reduce-scatter in backward, every micro-batch; 3:
  all-gather in forward, all-gather + reduce-scatter in backward, every micro-batch.
  Per-micro-batch ZeRO traffic runs beside the layer's compute (FSDP prefetch) and slows it by
  the overlap slowdown while it runs (``timing.overlapped_s``); a stage's first gather and last
  reduce-scatter are exposed (its largest layer's traffic, times 1 - slowdown, charged m times
  at the largest stage in ``step_time_s``). Per-step traffic (levels 0, 1) is reduced layer by
  layer as the last backward frees it: at least the largest layer's reduction is exposed, and
  all of it beyond (1 - slowdown) x that backward. A tensor-parallel head's loss (``loss_parallel``)
  all-reduces three fp32 values a token in forward.
* Memory: what the runtime holds, by the plan's categories (``partita.plan.StageMemory``;
  docs/search.md has the table and tests/test_runtime_memory.py measures it). Per parameter,
  S = dp at ZeRO 1-3 and 1 at ZeRO 0: fp32 weights 4/S (the optimizer's master copy), the
  compute-dtype copy FSDP2 keeps from forward to backward at ZeRO 0-2, fp32 gradients (4,
  unsharded while they accumulate over micro-batches at ZeRO 0-1; else 4/S), Adam 8/S. Under
  a pipeline a stage also holds the schedule's receive buffers and kept outputs
  (``pipeline_memory``).
* Activations and transients: k = ``min(pp - stage, micro_batches)`` micro-batches are in
  flight at a 1F1B stage's peak (a fully recomputed layer keeps only its input, a selective
  one its input and its matrix products' outputs). k - 1 of them hold all their activations;
  the running one holds those of the layers up to some layer j, which
  adds its own transient (a ZeRO-2/3 gather in forward; in backward the re-gathered
  parameters, the recomputed activations, the working set, the loss's backward). The stage's
  peak is the largest such moment, taken over its layers in order (``_stage_cost``); the
  search writes layers in the order that makes it least (``canonical_order``). The search
  counts each layer's terms alone (what CP-SAT sums); a plan's prediction (``stage_cost``) also
  takes away what the layer's neighbours make absent (``_neighbour_peak``), never more.
* A fixed reserve per device for the CUDA context, communication buffers and allocator
  fragmentation: ``RESERVE_GPU_BYTES`` (3 GiB) on GPUs, ``RESERVE_CPU_BYTES`` on CPU ranks.
* Pipeline: 1F1B step time = (m - 1) * max_s T_s + sum_s T_s, with T_s one micro-batch's
  forward + backward at stage s including its TP/ZeRO collectives and its side of each stage
  boundary: the transfers (sender and receiver both pay; under TP each rank sends and receives
  its 1/tp sequence shard, ``boundary_split``) and the all-gathers its end layers run when they
  are not sequence-parallel (``boundary_gathers``); then the exposed ZeRO edge, data-parallel
  sync, optimizer and a fixed per-step overhead.
* Software: the runtime's attention kernel and overlapped gradient reductions unless the cost
  model is told otherwise (``timing.Software``: published runs of other frameworks).
* Host overhead: an analytic layer pass takes max(device time, ops x per-op overhead) on a GPU
  and their sum on a CPU rank (``timing.host_bound_s``); a profile's calibration scales the
  device time and sets the overhead (``time_constants``). On a CPU rank each micro-batch's
  passes over a layer's weights, and AdamW's over the parameters and their state, stream at a
  weight-stream bandwidth and add (``roofline.cpu_weight_stream_s``, ``weight_stream_gbps``).
* Collectives are ring algorithms priced on the links the ranks use, at the bus bandwidth NCCL
  achieves there (``timing.LINK_EFFICIENCY``), or a profile's measured fit; a data-parallel group
  across nodes uses the NICs of all its ranks in a node (``dp_link``). Stages are aligned to
  nodes (a stage's size divides the node size or is a multiple of it), so a group of ranks
  inside one stage sits in one node exactly when it is no wider than a node; sends between
  stages are intra-node only on a single-node group, else priced on the network; between node
  groups the slower side (or the cluster's inter-group bandwidth).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Mapping, NamedTuple, Sequence

from partita.cluster import ClusterSpec, NodeGroup
from partita.devices import get_device
from partita.errors import PartitaError
from partita.model import LayerKind, ModelSpec
from partita.plan import LayerStrategy, boundary_split, gives_whole
from partita.profile import LayerCost, Profile, bus_bytes, layer_cost_at
from partita.search.roofline import cpu_adam_s, cpu_weight_stream_s
from partita.search.timing import (LINK_EFFICIENCY, OPTIMIZER_OPS_PER_TENSOR, Software, TimeConstants,
                                   default_constants, host_bound_s, layer_ops, overlapped_s, param_tensors)
from partita.units import GiB, MiB, round_up_to_grain

RESERVE_GPU_BYTES = 3 * GiB
RESERVE_CPU_BYTES = 256 * MiB
# Per-message latency of one ring step, by link class (seconds). NVLink/NCCL ~ a few us,
# inter-node RDMA ~ 10 us; gloo between CPU ranks ~ 0.5 ms (`partita profile --comm` on the
# 2-core development machine: a 2-rank all-reduce of 4 KiB took ~1 ms for its 2 steps).
LINK_LATENCY_S = {"nvlink": 5e-6, "xgmi": 5e-6, "pcie": 10e-6, "network": 15e-6, "loopback": 500e-6}
# Adam's update reads and writes master weights, m, v (fp32) and reads the gradient: bytes
# touched per parameter of the local shard.
OPTIMIZER_BYTES_PER_PARAM = 32
# What the runtime keeps per parameter (runtime/train.py, runtime/parallelize.py): fp32
# parameters (FSDP2's sharded parameters are the optimizer's master weights), gradients reduced
# and accumulated in fp32 (MixedPrecisionPolicy(reduce_dtype=fp32)), Adam's m and v in fp32.
MASTER_BYTES = 4
REDUCE_BYTES = 4
ADAM_STATE_BYTES = 8

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Link:
    kind: str  # "nvlink", "pcie", "xgmi", "loopback" or "network"
    gbps: float  # per rank, per direction
    latency_s: float


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
    # The parts a stage whose neighbours are known (``_neighbour_peak``) puts together itself:
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


def ring_steps(op: str, n: int) -> int:
    if n <= 1:
        return 0
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "p2p": 1, "all_to_all": n - 1}[op]


class CostModel:
    """Prices layers, stages and steps for one model, cluster, sequence length and dtype."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, *, seq_len: int, dtype: str | None = None,
                 profiles: Iterable[Profile] = (), software: Software | None = None) -> None:
        self.model = model
        self.cluster = cluster
        self.seq_len = seq_len
        self.software = software or Software()  # Partita's runtime unless told otherwise (timing.Software)
        self.dtype = dtype or default_dtype(cluster)
        if self.dtype not in DTYPE_BYTES:
            raise PartitaError(f"unknown dtype {self.dtype!r}; valid: {', '.join(DTYPE_BYTES)}")
        self.elem = DTYPE_BYTES[self.dtype]
        self.profiles: dict[str, Profile] = {}
        for p in profiles:
            if p.device in self.profiles:
                raise PartitaError(f"two profiles for device {p.device}; give one profile per device type")
            if p.device not in cluster.device_types:
                raise PartitaError(f"profile for {p.device} but the cluster has {', '.join(cluster.device_types)}; "
                                   f"drop it or change the cluster")
            self.profiles[p.device] = p
        self._used_sources: dict[str, set[str]] = {d: set() for d in cluster.device_types}
        self._compute = lru_cache(maxsize=None)(self._compute_uncached)
        self._selective_recompute = lru_cache(maxsize=None)(self._selective_recompute_uncached)
        self._layer_time = lru_cache(maxsize=None)(self._layer_time_uncached)
        self._layer_memory = lru_cache(maxsize=None)(self._layer_memory_uncached)
        self.stage_cache: dict = {}  # stage costs by (group, layer choices, degrees), see stage_cost_counts
        self.dp_span: tuple[str, ...] = ()  # node groups a stage's replicas span (``spanning``)
        self._spans: dict[tuple[str, ...], CostModel] = {}
        # Context parallelism (``at_cp``; search/context.py): the degree and variant this model
        # prices, and the whole sequence (``seq_len`` is then the s/cp tokens a rank holds).
        self.cp, self.cp_variant, self.plan_seq_len = 1, "all_to_all", seq_len
        self._cp_views: dict[tuple[int, str], CostModel] = {}
        # Expert parallelism (``at_ep``; search/experts.py): the degree this model prices (1: a
        # mixture of experts keeps every expert on every rank), and the routing's imbalance.
        self.ep, self.moe_imbalance = 1, 1.0
        self._ep_views: dict[tuple[int, float], CostModel] = {}

    def at_cp(self, cp: int, variant: str = "all_to_all") -> "CostModel":
        """This cost model under context parallelism of degree ``cp``: a view in which one
        "rank" is a group of cp devices holding s/cp tokens each (``context.ContextCostModel``),
        so the grid and CP-SAT search it unchanged. Itself at cp 1."""
        if cp == self.cp and (cp == 1 or variant == self.cp_variant):
            return self
        base = getattr(self, "cp_base", self)
        if cp == 1:
            return base
        if (cp, variant) not in base._cp_views:
            from partita.search.context import ContextCostModel

            base._cp_views[(cp, variant)] = ContextCostModel(base, cp=cp, variant=variant)
        return base._cp_views[(cp, variant)]

    def at_ep(self, ep: int, imbalance: float = 1.0) -> "CostModel":
        """This cost model under expert parallelism of degree ``ep`` with the busiest expert
        rank receiving ``imbalance`` x the balanced share of tokens (``experts.ExpertCostModel``):
        a view the grid and CP-SAT search unchanged. Itself at ep 1 and balanced routing."""
        base = getattr(self, "ep_base", self)
        if ep == 1:  # every rank runs its own tokens through every expert: nothing to wait for
            return base
        if (ep, imbalance) not in base._ep_views:
            from partita.search.experts import ExpertCostModel

            base._ep_views[(ep, imbalance)] = ExpertCostModel(base, ep=ep, imbalance=imbalance)
        return base._ep_views[(ep, imbalance)]

    def spanning(self, groups: Iterable[str]) -> "CostModel":
        """This cost model for stages whose data-parallel replicas sit on several node groups
        (``Plan`` ``replica_groups``): their collectives over dp run at the slowest of the
        groups' networks and the links between them (``dp_link``). Itself for one group."""
        names = tuple(sorted(set(groups)))
        if len(names) <= 1:
            return self
        if names not in self._spans:
            other = copy.copy(self)
            other.dp_span, other._spans, other.stage_cache = names, {}, {}
            other._layer_time = lru_cache(maxsize=None)(other._layer_time_uncached)  # its times differ
            self._spans[names] = other
        return self._spans[names]

    # ---- compute ------------------------------------------------------------------------
    def compute(self, role: str, device: str, tp: int, micro_batch: int) -> LayerCost:
        return self._compute(role, device, tp, micro_batch)

    def _compute_uncached(self, role: str, device: str, tp: int, micro_batch: int) -> LayerCost:
        from partita.search.analytic import layer_cost

        kind = self.model.kinds[role]
        profile = self.profiles.get(device)
        if profile is not None and profile.dtype == self.dtype:
            measured = layer_cost_at(profile, kind, tp, micro_batch, self.seq_len)
            if measured is not None:
                self._used_sources[device].add("measured")
                return measured
        dev = get_device(device)
        c = layer_cost(kind, dev, tp=tp, micro_batch=micro_batch, seq_len=self.seq_len, dtype=self.dtype,
                       attention=self.software.attention)
        k = self.time_constants(device)
        self._used_sources[device].add("calibrated" if self._calibrated(device) else "analytic")
        # The roofline's device time, scaled by a calibration, and the host's eager ops: a pass
        # takes the larger of the two on a GPU, their sum on a CPU (search/timing.py).
        ops_fwd, ops_bwd = layer_ops(kind)
        fwd = host_bound_s(k.compute_scale * c.forward_s, ops_fwd, k.op_overhead_s, dev.is_cpu)
        bwd = host_bound_s(k.compute_scale * c.backward_s, ops_bwd, k.op_overhead_s, dev.is_cpu)
        stream = self.weight_stream_gbps(device)
        if stream is not None:  # CPU ranks: the passes over the weights add (roofline.cpu_weight_stream_s)
            fwd_w, bwd_w = cpu_weight_stream_s(c.param_bytes / self.elem, self.elem, stream,
                                               product=kind.role != "embed")
            fwd, bwd = fwd + fwd_w, bwd + bwd_w
        return dataclasses.replace(c, forward_s=fwd, backward_s=bwd, recompute_s=fwd)

    def recompute_s(self, role: str, device: str, tp: int, micro_batch: int, mode: str) -> float:
        """What recomputing the layer adds to one micro-batch's backward, by recompute mode:
        nothing, its forward ("full"), or its forward less the matrix products ("selective",
        ``_selective_recompute_uncached``)."""
        if mode == "none":
            return 0.0
        if mode == "full":
            return self.compute(role, device, tp, micro_batch).recompute_s
        return self._selective_recompute(role, device, tp, micro_batch)

    def _selective_recompute_uncached(self, role: str, device: str, tp: int, micro_batch: int) -> float:
        """A selectively recomputed block runs its forward again without the matrix products
        (``analytic.selective_recompute_time_s``), but every op of it passes through torch's
        selective-checkpoint dispatch again, a kept product's too: the host's ops are the
        forward's. From a measured profile: the profiler's measurement, or where it has none
        (older profiles) its full recompute time times the analytic share."""
        from partita.search.analytic import Shard, forward_time_s, selective_recompute_time_s

        kind, dev = self.model.kinds[role], get_device(device)
        sh = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=self.seq_len, dtype=self.dtype)
        selective = selective_recompute_time_s(kind, dev, sh, self.dtype, self.software.attention)
        profile = self.profiles.get(device)
        if profile is not None and profile.dtype == self.dtype:
            measured = layer_cost_at(profile, kind, tp, micro_batch, self.seq_len)
            if measured is not None and measured.selective_recompute_s is not None:
                return measured.selective_recompute_s
            if measured is not None:
                forward = forward_time_s(kind, dev, sh, self.dtype, self.software.attention)
                return measured.recompute_s * selective / forward
        k = self.time_constants(device)
        return host_bound_s(k.compute_scale * selective, layer_ops(kind)[0], k.op_overhead_s, dev.is_cpu)

    def _calibrated(self, device: str) -> bool:
        profile = self.profiles.get(device)
        return profile is not None and profile.calibration is not None and profile.dtype == self.dtype

    def time_constants(self, device: str) -> TimeConstants:
        """The device type's time constants: its profile's calibration, else the defaults, with
        the per-op overhead its profile measured (``Profile.op_overhead_s``) if it did."""
        if self._calibrated(device):
            cal = self.profiles[device].calibration
            return TimeConstants(compute_scale=cal.compute_scale, op_overhead_s=cal.op_overhead_s,
                                 overlap_slowdown=cal.overlap_slowdown, step_overhead_s=cal.step_overhead_s)
        defaults = default_constants(get_device(device).is_cpu)
        profile = self.profiles.get(device)
        if profile is not None and profile.op_overhead_s is not None:
            return dataclasses.replace(defaults, op_overhead_s=profile.op_overhead_s)
        return defaults

    def weight_stream_gbps(self, device: str) -> float | None:
        """The bandwidth passes over the weights and the optimizer's state stream at on a CPU
        rank (``roofline.cpu_weight_stream_s``), as its profile's calibration fitted it. None on
        GPUs, without a calibration (the plain CPU roofline, whose bytes term stands in for it)
        and for a calibration written before the term (its other constants were fitted without
        it): those price as they did."""
        if not get_device(device).is_cpu or not self._calibrated(device):
            return None
        return self.profiles[device].calibration.weight_stream_gbps

    @property
    def step_overhead_s(self) -> float:
        """The fixed per-step overhead: the largest of the cluster's device types' (a step ends
        when its slowest rank does)."""
        return max(self.time_constants(d).step_overhead_s for d in self.cluster.device_types)

    def cost_sources(self) -> dict[str, str]:
        """Per device type: "measured", "analytic", "calibrated" or "mixed", for the costs asked so far."""
        out = {}
        for device in self.cluster.device_types:
            used = self._used_sources[device] or {"measured" if device in self.profiles else "analytic"}
            out[device] = next(iter(used)) if len(used) == 1 else "mixed"
        return out

    @property
    def profile_fingerprint(self) -> str:
        if not self.profiles:
            return "analytic"
        return "+".join(self.profiles[d].fingerprint for d in sorted(self.profiles))

    # ---- per device --------------------------------------------------------------------
    def reserve_bytes(self, group: NodeGroup) -> int:
        """Memory a device keeps for the runtime itself (context, buffers, fragmentation)."""
        return RESERVE_CPU_BYTES if group.device_type.is_cpu else RESERVE_GPU_BYTES

    def optimizer_s(self, group: NodeGroup, params: int) -> float:
        """Adam's update of ``params`` local parameters: memory-bound."""
        return params * OPTIMIZER_BYTES_PER_PARAM / (group.device_type.hbm_gbps * 1e9)

    # ---- links --------------------------------------------------------------------------
    def _link(self, group: NodeGroup, span: int) -> Link:
        """The link a group of ``span`` consecutive ranks of ``group`` communicates over."""
        if span <= group.gpus_per_node:
            kind = group.intra_link
            return Link(kind, group.intra_node_gbps, LINK_LATENCY_S[kind])
        return Link("network", group.network_gbps, LINK_LATENCY_S["network"])

    def tp_link(self, group: NodeGroup, tp: int) -> Link:
        return self._link(group, tp)

    def dp_link(self, group: NodeGroup, dp: int, tp: int) -> Link:
        """dp peers are tp ranks apart; the group spans dp * tp consecutive ranks. Across nodes
        NCCL runs a ring (channel) through each NIC its ranks sit by, so a group with k = gpus per
        node / tp ranks in every node moves data between nodes over k NICs at once (the other tp
        ranks' groups use the other NICs): its bus bandwidth is k x the per-GPU network rate, up
        to what NVLink carries inside the node (NVIDIA/nccl-tests#119: 8 A100 a node with 4 HDR
        NICs reach 96 GB/s all-reduce bus bandwidth, "24GB/s ... per 200G NIC"; nccl-tests#319:
        8 x 400G NICs "aggregated to achieve up to ~396GB/s with the RING protocol")."""
        if self.dp_span:
            return self._spanning_dp_link(tp)
        link = self._link(group, dp * tp)
        if link.kind != "network":
            return link
        per_node = max(1, group.gpus_per_node // tp)
        intra = group.intra_node_gbps * LINK_EFFICIENCY.get(group.intra_link, 1.0) / LINK_EFFICIENCY["network"]
        return Link("network", min(per_node * group.network_gbps, max(intra, group.network_gbps)), link.latency_s)

    def _spanning_dp_link(self, tp: int) -> Link:
        """dp peers on several node groups: the ring crosses between the groups, so every group
        runs its part over its network (each node's NICs at once, as in ``dp_link``) and the
        slowest group's rate, or the slowest link between two groups, sets the pace."""
        groups = [self.cluster.group(n) for n in self.dp_span]
        per_node = max(1, min(g.gpus_per_node for g in groups) // tp)
        rates = [g.network_gbps for g in groups]
        rates += [self.cluster.between_groups_gbps(a, b) for i, a in enumerate(groups) for b in groups[i + 1:]]
        return Link("network", per_node * min(rates), LINK_LATENCY_S["network"])

    def pp_link(self, a: NodeGroup, b: NodeGroup, stage_size: int) -> Link:
        """Between consecutive stages: inside a node only when the group is that one node
        (a stage boundary in a multi-node group may fall between nodes: priced on the network)."""
        if a.name == b.name and a.nodes == 1 and 2 * stage_size <= a.gpus_per_node:
            return Link(a.intra_link, a.intra_node_gbps, LINK_LATENCY_S[a.intra_link])
        return Link("network", self.cluster.between_groups_gbps(a, b), LINK_LATENCY_S["network"])

    def collective_s(self, op: str, nbytes: float, n: int, link: Link, device: str | None = None) -> float:
        """Ring collective time: latency per step plus bus bytes over the bus bandwidth NCCL
        achieves on the link (``LINK_EFFICIENCY`` of its line rate; the latency term makes the
        achieved bandwidth grow with the message size). A measured comm fit of the device's
        profile replaces these datasheet figures."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        bus = bus_bytes(op, nbytes, n)
        profile = self.profiles.get(device) if device else None
        if profile is not None:
            fit = profile.comm_fit(op, link.kind, n)
            if fit is not None:
                return fit.time_s(bus)
        return ring_steps(op, n) * link.latency_s + bus / (LINK_EFFICIENCY.get(link.kind, 1.0) * link.gbps * 1e9)

    # ---- one layer ----------------------------------------------------------------------
    def layer_time(self, role: str, group: NodeGroup, s: LayerStrategy, *, dp: int, micro_batch: int) -> LayerTime:
        return self._layer_time(role, group.name, s.tensor_parallel, s.sequence_parallel, s.zero, s.recompute, dp,
                                micro_batch)

    def layer_time_of(self, choice: tuple[str, int, bool, int, str], group: NodeGroup, *, dp: int,
                      micro_batch: int) -> LayerTime:
        role, tp, sp, zero, recompute = choice
        return self._layer_time(role, group.name, tp, sp, zero, recompute, dp, micro_batch)

    def _layer_time_uncached(self, role: str, group_name: str, tp: int, sp: bool, zero: int, recompute: str,
                             dp: int, micro_batch: int) -> LayerTime:
        group = self.cluster.group(group_name)
        device = group.device
        c = self.compute(role, device, tp, micro_batch)
        act_bytes = micro_batch * self.seq_len * self.model.hidden * self.elem
        link = self.tp_link(group, tp)
        # TP collectives: (forward, backward) counts of activation-sized all-reduces.
        n_fwd, n_bwd = {"embed": (1, 0), "block": (2, 2), "head": (0, 1)}[role]
        one = self.collective_s("all_reduce", act_bytes, tp, link, device)
        if sp:  # all-gather + reduce-scatter of the same volume, and ring steps
            one = (self.collective_s("all_gather", act_bytes, tp, link, device)
                   + self.collective_s("reduce_scatter", act_bytes, tp, link, device))
        tp_fwd, tp_bwd = n_fwd * one, n_bwd * one
        if role == "head":  # the vocab-parallel loss: all-reduces of each token's max, sum and target logit
            tp_fwd += 3 * self.collective_s("all_reduce", micro_batch * self.seq_len * 4, tp, link, device)
        if recompute == "full":
            tp_bwd += tp_fwd
        elif recompute == "selective":
            # All but the last product's reduction (the recomputation stops before w2): with SP
            # both all-gathers and wo's reduce-scatter, without it wo's all-reduce.
            reduction = self.collective_s("reduce_scatter" if sp else "all_reduce", act_bytes, tp, link, device)
            tp_bwd += tp_fwd - reduction
        fwd_compute = c.forward_s
        bwd_compute = c.backward_s + self.recompute_s(role, device, tp, micro_batch, recompute)

        # Parameters are gathered in the compute dtype; gradients are reduced in fp32
        # (FSDP2's reduce_dtype, the standard mixed-precision recipe).
        params = self._param_count(role, tp)
        zero_fwd, zero_bwd, dp_sync = self._layer_zero_traffic(role, params, group, tp=tp, zero=zero, dp=dp)
        # Per-micro-batch ZeRO traffic runs beside the layer's compute (FSDP prefetch), which it
        # slows (``overlapped_s``); the stage's first gather and last reduce-scatter have nothing
        # to hide behind: the stage charges its largest layer's traffic once more, less what the
        # slowdown already charged (``zero_edge_s``; search/timing.py, docs/search.md).
        k = self.time_constants(device)
        slowdown = k.overlap_slowdown
        forward = overlapped_s(fwd_compute + tp_fwd, zero_fwd, slowdown)
        backward = overlapped_s(bwd_compute + tp_bwd, zero_bwd, slowdown)
        edge = max(0.0, 1.0 - slowdown) * (zero_fwd + zero_bwd)
        shard = dp if zero >= 1 and dp > 1 else 1
        tensors = param_tensors(self.model.kinds[role], tied_head=role == "head" and self.model.tie_embeddings)
        host_ops = OPTIMIZER_OPS_PER_TENSOR["cpu" if group.device_type.is_cpu else "gpu"] * tensors
        optimizer = k.compute_scale * self.optimizer_s(group, params // shard) + host_ops * k.op_overhead_s
        stream = self.weight_stream_gbps(device)
        if stream is not None:  # CPU ranks: AdamW's passes over the fp32 state (roofline.cpu_adam_s)
            optimizer = cpu_adam_s(params // shard, stream) + host_ops * k.op_overhead_s
        # Software that starts the gradient reductions only after the whole backward hides none.
        window = max(0.0, 1.0 - slowdown) * backward if self.software.grad_sync == "overlapped" else 0.0
        return LayerTime(forward_s=forward, backward_s=backward, compute_s=fwd_compute + bwd_compute,
                         tp_comm_s=tp_fwd + tp_bwd, zero_comm_s=zero_fwd + zero_bwd, dp_sync_s=dp_sync,
                         zero_edge_s=edge, overlap_window_s=window, optimizer_s=optimizer)

    def _layer_zero_traffic(self, role: str, params: int, group: NodeGroup, *, tp: int, zero: int,
                            dp: int) -> tuple[float, float, float]:
        """A layer's ZeRO traffic: its ``params`` over dp (``_zero_traffic``). An expert-parallel
        view adds its experts' over their replicas (search/experts.py)."""
        return self._zero_traffic(params, group, tp=tp, zero=zero, dp=dp)

    def _zero_traffic(self, params: int, group: NodeGroup, *, tp: int, zero: int, dp: int,
                      dlink: Link | None = None) -> tuple[float, float, float]:
        """(forward, backward per micro-batch, per step) ZeRO traffic of ``params`` parameters
        replicated over ``dp`` ranks (on ``dlink``, by default the data-parallel link)."""
        device = group.device
        dlink = dlink or self.dp_link(group, dp, tp)
        ag = self.collective_s("all_gather", params * self.elem, dp, dlink, device)
        rs = self.collective_s("reduce_scatter", params * REDUCE_BYTES, dp, dlink, device)
        zero_fwd, zero_bwd, dp_sync = 0.0, 0.0, 0.0
        if dp > 1:
            if zero == 0:
                dp_sync = self.collective_s("all_reduce", params * REDUCE_BYTES, dp, dlink, device)
            elif zero == 1:
                dp_sync = ag + rs
            elif zero == 2:
                zero_fwd, zero_bwd = ag, rs
            else:
                zero_fwd, zero_bwd = ag, ag + rs
        return zero_fwd, zero_bwd, dp_sync

    def tied_params(self, tp: int) -> int:
        """The weight a tied embedding and head share, per tp shard (vocab-parallel)."""
        return self.model.vocab * self.model.hidden // tp if self.model.tie_embeddings else 0

    def tied_sync_s(self, group: NodeGroup, *, dp: int, tp: int, zero: int) -> float:
        """Per step, a pipeline whose tied embedding and head sit on different stages sums the
        two copies' gradients between each pair of ranks (fp32, the ZeRO shard), after the last
        backward: exposed. Priced on the last stage's link to another stage (on a mixed cluster
        the first stage's group may be slower; not modelled). The copy's own data-parallel
        reduction at ZeRO 0-1 is exposed as well (it waits for the last micro-batch); at ZeRO 2-3
        its per-micro-batch gathers and reductions ride on the head's matrix product. The copy's
        optimizer update is counted here too (on this stage only)."""
        shard = dp if zero >= 1 and dp > 1 else 1
        grad = self.tied_params(tp) * REDUCE_BYTES // shard
        link = self.pp_link(group, group, dp * tp)
        t = self.collective_s("all_reduce", grad, 2, link, group.device)
        stream = self.weight_stream_gbps(group.device)  # CPU ranks: AdamW's passes (roofline.cpu_adam_s)
        copy_params = self.tied_params(tp) // shard
        t += cpu_adam_s(copy_params, stream) if stream is not None else self.optimizer_s(group, copy_params)
        if dp > 1 and zero == 0:
            t += self.collective_s("all_reduce", self.tied_params(tp) * REDUCE_BYTES, dp, self.dp_link(group, dp, tp),
                                   group.device)
        elif dp > 1 and zero == 1:
            dlink = self.dp_link(group, dp, tp)
            t += (self.collective_s("reduce_scatter", self.tied_params(tp) * REDUCE_BYTES, dp, dlink, group.device)
                  + self.collective_s("all_gather", self.tied_params(tp) * self.elem, dp, dlink, group.device))
        return t

    def _param_count(self, role: str, tp: int) -> int:
        """Parameters of one tp shard of the layer (norms and biases of replicated parts
        are counted whole on each shard; they are tiny). A head tied to the embedding owns only
        its norm: the shared weight is counted with the embedding (the runtime keeps both in
        one stage)."""
        kind = self.model.kinds[role]
        if role == "head" and self.model.tie_embeddings:
            return kind.params - kind.matmul_params
        return kind.matmul_params // tp + (kind.params - kind.matmul_params) // (1 if role != "embed" else tp)

    def layer_memory(self, role: str, device: str, s: LayerStrategy, *, dp: int, micro_batch: int,
                     num_micro_batches: int, tied_copy: bool = False) -> LayerMemory:
        return self._layer_memory(role, device, s.tensor_parallel, s.sequence_parallel, s.zero, s.recompute, dp,
                                  micro_batch, num_micro_batches, tied_copy)

    def layer_memory_of(self, choice: tuple[str, int, bool, int, str], device: str, *, dp: int,
                        micro_batch: int, num_micro_batches: int, tied_copy: bool = False) -> LayerMemory:
        """``tied_copy``: a tied head on another stage than the embedding, holding its own copy
        of the shared weight (runtime/tied.py)."""
        role, tp, sp, zero, recompute = choice
        return self._layer_memory(role, device, tp, sp, zero, recompute, dp, micro_batch, num_micro_batches,
                                  tied_copy)

    def _layer_memory_uncached(self, role: str, device: str, tp: int, sp: bool, zero: int, recompute: str,
                               dp: int, micro_batch: int, num_micro_batches: int,
                               tied_copy: bool = False) -> LayerMemory:
        from partita.search.analytic import activation_bytes

        params = self._param_count(role, tp) + (self.tied_params(tp) if tied_copy else 0)
        e = self.elem
        z = zero if dp > 1 else 0
        shard = dp if z >= 1 else 1
        # FSDP2 wraps every layer when there is data parallelism or mixed precision (the
        # runtime's rule); it then also keeps the compute-dtype copy it gathers.
        fsdp = dp > 1 or e != MASTER_BYTES
        weights = params * MASTER_BYTES // shard
        gathered = params * e if fsdp and z < 3 else 0
        if fsdp and z < 2 and num_micro_batches > 1:
            gradients = params * REDUCE_BYTES  # accumulated unsharded until the last micro-batch
        else:
            gradients = params * REDUCE_BYTES // shard
        optimizer = params * ADAM_STATE_BYTES // shard
        local_params = params // shard
        kind: LayerKind = self.model.kinds[role]
        kw = dict(tp=tp, micro_batch=micro_batch, seq_len=self.seq_len, dtype=self.dtype, sequence_parallel=sp,
                  on_cpu=get_device(device).is_cpu)
        full = activation_bytes(kind, recompute="none", **kw)
        kept = activation_bytes(kind, recompute=recompute, **kw)
        c = self.compute(role, device, tp, micro_batch)
        if device in self.profiles and c.activation_bytes:
            # A measured count (no SP, no recompute) replaces the analytic one; the variants
            # keep the analytic ratio to it.
            analytic_plain = activation_bytes(kind, recompute="none", **(kw | {"sequence_parallel": False}))
            scale = c.activation_bytes / analytic_plain if analytic_plain else 1.0
            full, kept = int(full * scale), int(kept * scale)
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
        # layer's neighbours (``_neighbour_peak``, which keeps the parts apart).
        gather_spike = {2: params * e, 3: 2 * params * e}.get(z, 0)
        resident = 2 * params * e if z == 3 else 0
        recompute_extra = max(0, full - kept)
        unsharded_grad = params * REDUCE_BYTES if fsdp and role != "head" else 0
        if role == "block":
            working = self._block_backward_transient(tp, micro_batch)
        elif role == "head":
            working = self._loss_transient(tp, micro_batch)
        else:
            working = 0
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
                           copy=up(params * e) if fsdp else 0, forward_extra=up(gather_spike),
                           backward_own=up(recompute_extra + working),
                           reduce_buffer=up(params * REDUCE_BYTES) if fsdp and every_micro_batch else 0,
                           regathers=fsdp and z == 3, releases_copy=bool(gathered) and every_micro_batch)

    def _block_backward_transient(self, tp: int, micro_batch: int) -> int:
        """A block's backward working set: the gradients of the MLP's three ffn/tp-wide
        intermediates and the hidden-wide gradient it passes on (measured: exactly this on CPU
        ranks, for tp 1 and 2)."""
        t = micro_batch * self.seq_len
        routed = t * max(1, self.model.experts_per_token)  # a mixture of experts: each token's k expert rows
        return 3 * routed * (self.model.ffn // tp) * self.elem + t * self.model.hidden * self.elem

    def _loss_transient(self, tp: int, micro_batch: int) -> int:
        """The loss's backward on this rank's vocab/tp logits (t tokens): the gradient of the
        fp32 log-probabilities and of the fp32 logits, the softmax it recomputes (4 bytes each per
        logit), the gradient cast back to the compute dtype, and the gradient of the head's input."""
        t = micro_batch * self.seq_len
        logits = t * (self.model.vocab // tp)
        return 12 * logits + (self.elem * logits if self.elem != 4 else 0) + 4 * t * self.model.hidden


@dataclass(frozen=True)
class StageCost:
    """One stage's costs on one of its devices."""

    time_s: float  # one micro-batch forward + backward, collectives and sends included
    forward_s: float
    backward_s: float
    compute_s: float
    tp_comm_s: float
    zero_comm_s: float
    p2p_s: float  # its sides of its stage boundaries: transfers and the all-gathers of its end layers
    dp_sync_s: float  # per step
    optimizer_s: float  # per step
    weights: int
    gathered_weights: int  # the copies kept from forward to backward + the peak layer's gathered part
    gradients: int
    optimizer: int
    activations_per_mb: int  # one micro-batch's kept activations, all the stage's layers
    current_activations: int  # the running micro-batch's at the peak: the layers up to the peak layer
    output_per_mb: int  # the stage output the schedule keeps per micro-batch in flight (not on the last stage)
    retained_output: int  # a last pipeline stage's logits, kept by the schedule until their backward
    in_flight: int  # micro-batches whose activations the stage holds at its peak
    transient: int  # the peak layer's extra bytes (its gathered part is in gathered_weights)
    pipeline_buffers: int  # the schedule's receive buffers: one per micro-batch and direction
    reserve: int
    capacity: int
    peak_layer: str = ""  # where the stage peaks: a layer name ("layers.N", or the role when unnamed)
    peak_phase: str = "backward"  # ... in its "forward" or its "backward"
    tied_sync_s: float = 0.0  # per step: a tied head's copy summed with the embedding's (runtime/tied.py)
    peak_gathered: int = 0  # the part of gathered_weights that is the peak layer's own gathers
    peak_released: int = 0  # kept copies of later layers freed by the peak (taken off gathered_weights)
    # time (search/timing.py, docs/search.md): per micro-batch, the exposed first gather / last
    # reduce-scatter (the largest of the stage's layers' ZeRO traffic, charged once per
    # micro-batch in step_time_s); per step, the largest layer's data-parallel reduction (it ends
    # the backward, nothing left to hide it) and the backward the others can hide behind; the
    # transfers of this stage's side of the boundary to the next stage (in p2p_s; the next stage
    # pays as much on its side).
    zero_edge_s: float = 0.0
    dp_edge_s: float = 0.0
    overlap_window_s: float = 0.0
    send_s: float = 0.0
    cp_comm_s: float = 0.0  # context parallelism's collectives on the critical path (LayerTime.cp_comm_s)

    @property
    def activations(self) -> int:
        return (self.activations_per_mb * (self.in_flight - 1) + self.current_activations
                + self.output_per_mb * self.in_flight + self.retained_output)

    @property
    def peak_bytes(self) -> int:
        return (self.weights + self.gathered_weights + self.gradients + self.optimizer + self.activations
                + self.transient + self.pipeline_buffers + self.reserve)

    @property
    def peak_at(self) -> str:
        return f"{self.peak_layer} {self.peak_phase}".strip()

    @property
    def exposed_dp_s(self) -> float:
        """Per-step gradient reductions run layer by layer as the last micro-batch's backward
        frees them; the last one (the stage's first layer) has nothing left to hide behind, and
        all of them together hide at most behind the backward's overlap window."""
        if self.dp_sync_s <= 0:
            return 0.0
        return max(self.dp_edge_s, self.dp_sync_s - self.overlap_window_s)


def in_flight(stage: int, pp: int, num_micro_batches: int) -> int:
    """Micro-batches whose activations a 1F1B stage holds at its peak."""
    return min(pp - stage, num_micro_batches)


# A layer's choices without its name: (role, tensor_parallel, sequence_parallel, zero, recompute).
LayerChoice = tuple[str, int, bool, int, str]
# A stage's layers in order as runs of one choice: ((choice, count, name of the run's last layer), ...).
Runs = tuple[tuple[LayerChoice, int, str], ...]


def choice_of(model: ModelSpec, s: LayerStrategy) -> LayerChoice:
    return (model.role_of(s.name), s.tensor_parallel, s.sequence_parallel, s.zero, s.recompute)


def stage_cost(cm: CostModel, group: NodeGroup, layers: Sequence[LayerStrategy], *, stage: int, pp: int, dp: int,
               tp: int, micro_batch: int, num_micro_batches: int, next_group: NodeGroup | None) -> StageCost:
    """Cost of one pipeline stage holding these layers, in this order: a plan's prediction. Its
    memory peak also looks at each layer's neighbours (``_neighbour_peak``) and is never more
    than the per-layer terms the search counts (``stage_cost_counts``)."""
    runs = tuple((choice_of(cm.model, s), 1, s.name) for s in layers)
    return _stage_cost_runs(cm, group, runs, stage=stage, pp=pp, dp=dp, tp=tp, micro_batch=micro_batch,
                            num_micro_batches=num_micro_batches, next_group=next_group, neighbours=True)


def canonical_order(cm: CostModel, device: str, choices: Iterable[LayerChoice], *, dp: int, micro_batch: int,
                    num_micro_batches: int) -> list[LayerChoice]:
    """The order of a stage's layers that gives the least peak for given counts, and the order
    the search writes plans in: the embedding first and the head last (the model's order), the
    blocks by decreasing transient. (A stage peaks at max over its layers j of the activations
    of the layers up to j plus j's transient; ordering by decreasing transient minimises that
    maximum, as earliest-due-date minimises the greatest lateness on one machine.)"""
    choices = tuple(choices)
    cache_key = ("order", device, choices, dp, micro_batch, num_micro_batches)
    order = cm.stage_cache.get(cache_key)
    if order is None:
        def key(c: LayerChoice) -> tuple:
            m = cm.layer_memory_of(c, device, dp=dp, micro_batch=micro_batch, num_micro_batches=num_micro_batches)
            return ({"embed": 0, "block": 1, "head": 2}[c[0]], -m.transient, c)
        order = cm.stage_cache[cache_key] = sorted(choices, key=key)
    return order


def stage_cost_counts(cm: CostModel, group: NodeGroup, counts: Mapping[LayerChoice, int], *, stage: int, pp: int,
                      dp: int, tp: int, micro_batch: int, num_micro_batches: int,
                      next_group: NodeGroup | None) -> StageCost:
    """Cost of one stage from how many of its layers make each choice, the layers in the
    canonical order (``canonical_order``)."""
    order = canonical_order(cm, group.device, (c for c, n in counts.items() if n), dp=dp, micro_batch=micro_batch,
                            num_micro_batches=num_micro_batches)
    runs = tuple((c, counts[c], c[0]) for c in order)
    return _stage_cost_runs(cm, group, runs, stage=stage, pp=pp, dp=dp, tp=tp, micro_batch=micro_batch,
                            num_micro_batches=num_micro_batches, next_group=next_group)


def _stage_cost_runs(cm: CostModel, group: NodeGroup, runs: Runs, *, stage: int, pp: int, dp: int, tp: int,
                     micro_batch: int, num_micro_batches: int, next_group: NodeGroup | None,
                     neighbours: bool = False) -> StageCost:
    """Identical blocks cost the same, so each distinct run is priced once; stages alike but
    for their position share everything but the micro-batches in flight."""
    key = (group.name, runs, dp, tp, micro_batch, num_micro_batches, next_group.name if next_group else None,
           neighbours)
    k = in_flight(stage, pp, num_micro_batches)
    placed = cm.stage_cache.get(key + (k,))
    if placed is None:
        base = cm.stage_cache.get(key)
        if base is None:
            base = _stage_cost(cm, group, runs, dp=dp, tp=tp, micro_batch=micro_batch,
                               num_micro_batches=num_micro_batches, next_group=next_group, neighbours=neighbours)
            cm.stage_cache[key] = base
        placed = copy.copy(base)  # dataclasses.replace re-runs __init__: this is the search's hot path
        object.__setattr__(placed, "in_flight", k)
        cm.stage_cache[key + (k,)] = placed
    return placed


def _stage_cost(cm: CostModel, group: NodeGroup, runs: Runs, *, dp: int, tp: int, micro_batch: int,
                num_micro_batches: int, next_group: NodeGroup | None, neighbours: bool = False) -> StageCost:
    fwd = bwd = compute = tp_comm = zero_comm = dp_sync = cp_comm = 0.0
    zero_edge = dp_edge = window = optimizer_s = 0.0
    weights = gathered_weights = grads = opt = acts = 0
    # The running micro-batch at the stage's peak: the activations of the layers up to the peak
    # layer and that layer's transient (the other micro-batches in flight hold all of theirs).
    peak: tuple[int, int, LayerMemory, str] | None = None  # (acts so far + transient, acts so far, memory, name)
    roles = {r[0][0] for r in runs}
    tied_copy = cm.model.tie_embeddings and "head" in roles and "embed" not in roles
    tied_sync = 0.0
    memories: list[tuple[LayerMemory, int, str]] = []
    for choice, n, name in runs:
        holds_copy = tied_copy and choice[0] == "head"
        t = cm.layer_time_of(choice, group, dp=dp, micro_batch=micro_batch)
        m = cm.layer_memory_of(choice, group.device, dp=dp, micro_batch=micro_batch,
                               num_micro_batches=num_micro_batches, tied_copy=holds_copy)
        if holds_copy:  # its state is in m; its gradient sum and update in the tied sync
            tied_sync = cm.tied_sync_s(group, dp=dp, tp=choice[1], zero=choice[3])
        fwd += n * t.forward_s
        bwd += n * t.backward_s
        compute += n * t.compute_s
        tp_comm += n * t.tp_comm_s
        cp_comm += n * t.cp_comm_s
        zero_comm += n * t.zero_comm_s
        dp_sync += n * t.dp_sync_s
        zero_edge, dp_edge = max(zero_edge, t.zero_edge_s), max(dp_edge, t.dp_sync_s)
        window += n * t.overlap_window_s
        optimizer_s += n * t.optimizer_s
        weights += n * m.weights
        gathered_weights += n * m.gathered_weights
        grads += n * m.gradients
        opt += n * m.optimizer
        acts += n * m.activations  # the run's last layer sees the most activations before it
        if neighbours:
            memories.append((m, n, name))
        if peak is None or acts + m.transient > peak[0]:
            peak = (acts + m.transient, acts, m, name)
    # This stage's side of the boundary to the next: the transfers (the next stage pays the same
    # on its side: ``with_receives``), and the all-gathers at its own ends (``boundary_gathers``).
    send = boundary_s(cm, group, next_group, dp=dp, tp=tp, micro_batch=micro_batch) if next_group is not None else 0.0
    gathers = sum(boundary_gathers(cm, runs, tp=tp, sends=next_group is not None))
    p2p = send + (gathers * boundary_gather_s(cm, group, tp=tp, micro_batch=micro_batch) if gathers else 0.0)
    # Reported by what holds the bytes: the peak layer's gathered parameters with the gathered
    # weights, the rest of its transient (recompute, working set, loss) as transient.
    assert peak is not None
    _, current, top, peak_layer = peak
    moment = Moment(current, top.transient_gathered, top.transient - top.transient_gathered, 0, peak_layer,
                    top.peak_phase)
    if neighbours:  # a plan's prediction: what the neighbours take away, never more than the search counts
        aware = _neighbour_peak(memories)
        if aware.bytes <= moment.bytes:
            moment = aware
    gathered_weights += moment.gathered - moment.released
    buffers, output, retained = pipeline_memory(cm, {r[0]: r[1] for r in runs}, tp=tp, micro_batch=micro_batch,
                                                num_micro_batches=num_micro_batches, is_last=next_group is None)
    reserve = cm.reserve_bytes(group)
    return StageCost(time_s=fwd + bwd + p2p, forward_s=fwd, backward_s=bwd, compute_s=compute, tp_comm_s=tp_comm,
                     zero_comm_s=zero_comm, p2p_s=p2p, dp_sync_s=dp_sync, optimizer_s=optimizer_s,
                     weights=weights, gathered_weights=gathered_weights, gradients=grads, optimizer=opt,
                     activations_per_mb=acts, current_activations=moment.activations, output_per_mb=output,
                     retained_output=retained, in_flight=1, transient=moment.other,
                     pipeline_buffers=buffers, reserve=reserve, capacity=group.memory_bytes,
                     peak_layer=moment.layer, peak_phase=moment.phase, tied_sync_s=tied_sync,
                     peak_gathered=moment.gathered, peak_released=moment.released, zero_edge_s=zero_edge,
                     dp_edge_s=dp_edge, overlap_window_s=window, send_s=send, cp_comm_s=cp_comm)


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


def _neighbour_peak(layers: Sequence[tuple[LayerMemory, int, str]]) -> Moment:
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


def boundary_s(cm: CostModel, group: NodeGroup, other: NodeGroup, *, dp: int, tp: int, micro_batch: int) -> float:
    """One side's transfers at a stage boundary per micro-batch, which sender and receiver
    both pay (each waits on its blocking send or receive): the activation one way in forward,
    its gradient the other way in backward. Under tensor parallelism each rank sends and
    receives its 1/tp sequence shard (``boundary_split``; the runtime's stages exchange
    (b, s/tp, h) tensors); the all-gathers back to whole hidden states are the end layers'
    (``boundary_gathers``)."""
    msg = activation_message_bytes(cm, micro_batch, tp)
    link = cm.pp_link(group, other, dp * tp)
    # A transfer goes at the slower side's pace: each device's measured fit, and between node
    # groups the link that joins them (a fit measured inside one group knows nothing of it).
    one_way = max(cm.collective_s("p2p", msg, 2, link, d) for d in {group.device, other.device})
    if group.name != other.name:
        one_way = max(one_way, cm.collective_s("p2p", msg, 2, link))
    return 2 * one_way


def boundary_gather_s(cm: CostModel, group: NodeGroup, *, tp: int, micro_batch: int) -> float:
    """One all-gather of a split boundary's sequence shards back to the whole activation, over
    the stage's tensor group (``boundary_gathers`` says how many a stage runs)."""
    return cm.collective_s("all_gather", activation_message_bytes(cm, micro_batch), tp, cm.tp_link(group, tp),
                           group.device)


def boundary_gathers(cm: CostModel, runs: Runs, *, tp: int, sends: bool) -> tuple[int, int]:
    """(forward, backward) all-gathers per micro-batch at a (virtual) stage's boundaries, as the
    runtime runs them (``runtime.parallelize.apply_tensor_parallel``): when a boundary carries
    sequence shards (``boundary_split``), a first layer that takes whole hidden states gathers
    what it receives (in forward; the gradient it returns is sliced for free), and a last layer
    that gives whole hidden states gathers the gradient it gets back (in backward; its output
    is sliced for free). A sequence-parallel end gathers nothing. The embedding receives tokens
    and the head sends nothing. ``runs`` are the stage's layers in order."""
    if boundary_split(cm.seq_len, tp) == 1:
        return 0, 0
    first, last = runs[0][0], runs[-1][0]
    forward = first[0] != "embed" and gives_whole(first[1], first[2])
    backward = sends and last[0] != "head" and gives_whole(last[1], last[2])
    return int(forward), int(backward)


def with_receives(stages: Sequence[StageCost], *, wrap: bool = False) -> list[StageCost]:
    """Each stage after the first also pays its side of the boundary before it: the same
    transfers as the sender's side (both ranks wait for a blocking send and receive). With
    ``wrap`` (interleaved schedules) the first stage receives what the last one sends on."""
    out = list(stages)
    for i in range(0 if wrap else 1, len(out)):
        receive = stages[i - 1].send_s
        # copy.copy, not dataclasses.replace (which re-runs __init__): the grid's hot path.
        out[i] = copy.copy(out[i])
        object.__setattr__(out[i], "time_s", out[i].time_s + receive)
        object.__setattr__(out[i], "p2p_s", out[i].p2p_s + receive)
    return out


def interleaved_stage_cost(cm: CostModel, group: NodeGroup,
                           chunks: Sequence[Sequence[LayerStrategy] | Mapping[LayerChoice, int]], *,
                           stage: int, pp: int, dp: int, tp: int, micro_batch: int, num_micro_batches: int,
                           next_groups: Sequence[NodeGroup | None]) -> StageCost:
    """One plan stage whose ranks run v virtual stages (interleaved 1F1B): ``chunks[c]`` are the
    layers of virtual stage c (or counts of their choices), ``next_groups[c]`` the group its output goes to (None for the
    pipeline's last). Times, static state, sends and the schedule's buffers add up over the
    virtual stages; in flight are ``schedules.in_flight_chunks`` virtual-stage micro-batches,
    each counted at the largest virtual stage's activations (an upper bound when they differ),
    the running one at the peak of whichever virtual stage peaks highest."""
    from partita.search.schedules import in_flight_chunks

    def part(layers, nxt: NodeGroup | None) -> StageCost:
        kw = dict(stage=0, pp=1, dp=dp, tp=tp, micro_batch=micro_batch, num_micro_batches=num_micro_batches,
                  next_group=nxt)
        if isinstance(layers, Mapping):  # counts of choices (the search's fast path): canonical order
            return stage_cost_counts(cm, group, layers, **kw)
        return stage_cost(cm, group, layers, **kw)

    parts = [part(layers, nxt) for layers, nxt in zip(chunks, next_groups)]
    add = lambda field: sum(getattr(p, field) for p in parts)  # noqa: E731
    running = max(parts, key=lambda p: p.current_activations + p.transient + p.peak_gathered - p.peak_released)
    # Every virtual stage's kept copies, less those the running one has freed by its peak.
    kept_copies = sum(p.gathered_weights - p.peak_gathered + p.peak_released for p in parts) - running.peak_released
    return dataclasses.replace(
        parts[0], time_s=add("time_s"), forward_s=add("forward_s"), backward_s=add("backward_s"),
        compute_s=add("compute_s"), tp_comm_s=add("tp_comm_s"), zero_comm_s=add("zero_comm_s"), p2p_s=add("p2p_s"),
        dp_sync_s=add("dp_sync_s"), optimizer_s=add("optimizer_s"), weights=add("weights"),
        gathered_weights=kept_copies + running.peak_gathered, peak_gathered=running.peak_gathered,
        peak_released=running.peak_released,
        gradients=add("gradients"), optimizer=add("optimizer"),
        activations_per_mb=max(p.activations_per_mb for p in parts), current_activations=running.current_activations,
        output_per_mb=activation_message_bytes(cm, micro_batch, tp), retained_output=add("retained_output"),
        in_flight=in_flight_chunks("interleaved-1f1b", stage, pp, len(chunks), num_micro_batches),
        transient=running.transient, pipeline_buffers=add("pipeline_buffers"), peak_layer=running.peak_layer,
        peak_phase=running.peak_phase, tied_sync_s=add("tied_sync_s"),
        zero_edge_s=max(p.zero_edge_s for p in parts), dp_edge_s=max(p.dp_edge_s for p in parts),
        overlap_window_s=add("overlap_window_s"), send_s=add("send_s"), cp_comm_s=add("cp_comm_s"))


def activation_message_bytes(cm: CostModel, micro_batch: int, tp: int = 1) -> int:
    """One micro-batch's hidden states on one rank, in the compute dtype (in whole allocation
    grains): b x s x h, or with ``tp`` the rank's b x s/tp x h sequence shard where a stage
    boundary splits them (``boundary_split``): what a stage sends on, gets a gradient of, and
    keeps per micro-batch in flight."""
    tokens = cm.seq_len // boundary_split(cm.seq_len, tp)
    return round_up_to_grain(micro_batch * tokens * cm.model.hidden * cm.elem)


def pipeline_memory(cm: CostModel, counts: Mapping[LayerChoice, int], *, tp: int, micro_batch: int,
                    num_micro_batches: int, is_last: bool) -> tuple[int, int, int]:
    """(receive buffers, output kept per micro-batch in flight, retained logits) of a pipeline
    stage, in bytes.

    ``torch.distributed.pipelining`` allocates, once and for good, one receive buffer per
    micro-batch for the activations a stage takes (every stage but the first) and one for the
    gradients it gets back (every stage but the last), each ``micro_batch * seq * hidden``
    elements, or the rank's 1/tp sequence shard of them (``activation_message_bytes``). The
    schedule also keeps each micro-batch's stage output (the same shard) until that
    micro-batch's backward: for every micro-batch in flight on the other stages, the logits on
    the last (one at a time under 1F1B). A stage that is both first and last (no pipeline)
    holds none of these."""
    roles = {choice[0] for choice in counts}
    is_first = "embed" in roles
    if is_first and is_last:
        return 0, 0, 0
    act_msg = activation_message_bytes(cm, micro_batch, tp)
    buffers = num_micro_batches * act_msg * ((not is_first) + (not is_last))
    if is_last:
        head_tp = next(choice[1] for choice in counts if choice[0] == "head")
        return buffers, 0, round_up_to_grain(micro_batch * cm.seq_len * (cm.model.vocab // head_tp) * cm.elem)
    return buffers, act_msg, 0


def pipeline_time_s(stage_times: Sequence[float], num_micro_batches: int) -> float:
    """1F1B: (m - 1) * slowest stage + sum of stages."""
    return (num_micro_batches - 1) * max(stage_times) + sum(stage_times)


def step_time_s(stages: Sequence[StageCost], num_micro_batches: int, *, schedule: str = "1f1b",
                virtual_stages: int = 1, step_overhead_s: float = 0.0) -> tuple[float, dict[str, float]]:
    """Step time and its breakdown by cause (seconds per step). Under an interleaved schedule
    each stage's time is its ranks' time for a micro-batch through all their virtual stages.
    ``stages`` come with their receives (``with_receives``); ``step_overhead_s`` is the fixed
    part (``CostModel.step_overhead_s``). The stages' exposed ZeRO edges are charged once per
    micro-batch at the largest: the slowest stage sets the pipeline's pace (the edge inside each
    stage's own time made CP-SAT's proofs several times slower)."""
    from partita.search.schedules import closed_form_s

    times = [s.time_s for s in stages]
    pipe = closed_form_s(schedule, times, num_micro_batches, virtual_stages)
    exposed_dp = max(s.exposed_dp_s for s in stages)
    optimizer = max(s.optimizer_s for s in stages)
    tied = max(s.tied_sync_s for s in stages)
    zero_edge = num_micro_batches * max(s.zero_edge_s for s in stages)
    total = pipe + zero_edge + exposed_dp + optimizer + tied + step_overhead_s
    m = num_micro_batches
    slowest = max(stages, key=lambda s: s.time_s)
    busy = m * slowest.time_s
    comm = slowest.tp_comm_s + slowest.cp_comm_s
    breakdown = {
        "compute": m * slowest.compute_s,
        "tensor_parallel_comm": m * slowest.tp_comm_s,
        # context parallelism's all-to-alls / exposed ring passes: only for plans with cp
        **({"context_parallel_comm": m * slowest.cp_comm_s} if any(s.cp_comm_s for s in stages) else {}),
        "zero_exposed": max(0.0, busy - m * (slowest.compute_s + comm + slowest.p2p_s)) + zero_edge,
        "pipeline_send": m * slowest.p2p_s,
        "pipeline_bubble": pipe - busy,
        "data_parallel_exposed": exposed_dp,
        "optimizer": optimizer,
        "step_overhead": step_overhead_s,
    }
    if tied:
        breakdown["tied_embedding_sync"] = tied
    return total, breakdown


def default_dtype(cluster: ClusterSpec) -> str:
    """fp32 on CPU ranks; bf16 on GPUs, or fp16 where a device has no bf16 (V100)."""
    if cluster.is_cpu:
        return "fp32"
    if any(get_device(d).bf16_tflops == 0 for d in cluster.device_types):
        return "fp16"
    return "bf16"
