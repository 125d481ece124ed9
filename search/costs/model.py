"""The cost model: one object that prices layers for one model, cluster, sequence length, dtype,
profiles and layout.

There is one cost model. The uniform planner, the CP-SAT search and the plan evaluator all
price plans through ``CostModel``; the search turns its numbers into integers with
``partita.units`` and nothing else. What it prices beyond each layer's own choices (tp, sp,
ZeRO, recompute, dp) is its ``View``, a frozen description of the layout: context parallelism
(cp, its variant), expert parallelism (ep, the routing imbalance) and the node groups a stage's
replicas span. Each dimension adds its terms where the view says so, in one place:

* cp > 1 (``partita.search.context``): a rank is a cp group of devices (``cluster`` is
  ``context.cluster_view`` of ``real_cluster``) holding s/cp tokens (``seq_len``; the whole
  sequence is ``plan_seq_len``); parameters are replicated over dp x cp ranks; a block adds
  ``context.with_cp_time`` and its memory ``context.cp_activation_bytes`` and the ring's blocks
  in flight (``memory.ring_memory``).
* ep > 1 (``partita.search.experts``): a block's routed experts leave its dense parameters
  (``param_count``), and their ZeRO traffic, all-to-alls, imbalance and optimizer are
  ``experts.zero_traffic`` and ``experts.with_moe_time``; their memory ``memory.expert_memory``.
* dp_span: the data-parallel collectives run at the pace of every group the replicas span
  (``dp_link``).

``at``, ``at_cp``, ``at_ep`` and ``spanning`` return the model of another view; views share one
registry, so asking twice gives the same object (and its caches).

    from partita.search.costs.model import CostModel
    cm = CostModel(model, cluster, seq_len=4096)
    cm.at_cp(2, "ring").layer_time("block", group, strategy, dp=4, micro_batch=1)

The rest of the package: ``links`` (links and collectives), ``compute`` (a layer's compute),
``layer_time`` (a layer's time with its collectives), ``memory`` (every byte), ``stage`` (a
pipeline stage), ``step`` (a training step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable

from partita.cluster import ClusterSpec, NodeGroup
from partita.errors import PartitaError
from partita.model import ModelSpec
from partita.plan import LayerStrategy
from partita.profile import LayerCost, Profile
from partita.search import context, experts
from partita.search.costs import compute, layer_time, links, memory
from partita.search.costs.layer_time import LayerTime
from partita.search.costs.links import Link
from partita.search.costs.memory import LayerMemory
from partita.search.engines import Engine, get_engine
from partita.search.roofline import FP8_ELEMENT_BYTES
from partita.search.timing import Software, TimeConstants


@dataclass(frozen=True, kw_only=True)
class View:
    """The layout a cost model prices, beyond each layer's own choices."""

    cp: int = 1  # context-parallel degree: a rank of the search is a cp group of devices
    cp_variant: str = "all_to_all"  # "all_to_all" or "ring"; "all_to_all" at cp 1
    ep: int = 1  # expert-parallel degree (1: every expert on every rank)
    # The busiest expert rank's tokens over the mean; priced at ep > 1, kept at ep 1 for the
    # expert-parallel views made from it (``CostModel.at_ep``).
    imbalance: float = 1.0
    dp_span: tuple[str, ...] = ()  # the node groups a stage's data-parallel replicas span (2 or more)
    # cp groups that span nodes at this tensor-parallel degree (``context.cluster_view``); 0: inside a node
    cp_span_tp: int = 0


class CostModel:
    """Prices layers, stages and steps for one model, cluster, sequence length, dtype and view."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, *, seq_len: int, dtype: str | None = None,
                 profiles: Iterable[Profile] = (), engine: Engine | None = None, view: View = View()) -> None:
        """``cluster`` and ``seq_len`` are the plan's: its devices and its whole sequence."""
        if view.cp > 1:
            context.check_layout(seq_len, view.cp, view.cp_variant)
        experts.check_layout(model, view.ep, view.imbalance)
        self.model = model
        self.view = view
        self.real_cluster = cluster  # the devices
        self.cluster = context.cluster_view(cluster, view.cp, view.cp_span_tp)  # the ranks the search places
        self.plan_seq_len = seq_len
        self.seq_len = seq_len // view.cp  # the tokens one device holds
        self.engine = engine or get_engine(None)  # the engine that runs the plan (search/engines.py)
        self.dtype = dtype or compute.default_dtype(cluster)
        if self.dtype not in compute.DTYPE_BYTES:
            raise PartitaError(f"unknown dtype {self.dtype!r}; valid: {', '.join(compute.DTYPE_BYTES)}")
        self.elem = compute.DTYPE_BYTES[self.dtype]
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
        self._tp_pass = lru_cache(maxsize=None)(self._tp_pass_uncached)
        self._zero_traffic = lru_cache(maxsize=None)(self._zero_traffic_uncached)
        self.stage_cache: dict = {}  # stage costs by (group, layer choices, degrees), see stage.stage_cost_counts
        self._views: dict[View, CostModel] = {view: self}  # every view's model, shared among them

    # ---- the layout ----------------------------------------------------------------------
    @property
    def software(self) -> Software:
        """The engine's attention kernel and gradient synchronisation."""
        return self.engine.software

    @property
    def cp(self) -> int:
        return self.view.cp

    @property
    def cp_variant(self) -> str:
        return self.view.cp_variant

    @property
    def ep(self) -> int:
        return self.view.ep

    @property
    def dp_span(self) -> tuple[str, ...]:
        return self.view.dp_span

    @property
    def moe_imbalance(self) -> float:
        return self.view.imbalance

    def at(self, view: View) -> "CostModel":
        """The cost model of this model, cluster, sequence, dtype and profiles at ``view``."""
        if view == self.view:
            return self
        other = self._views.get(view)
        if other is None:
            other = CostModel(self.model, self.real_cluster, seq_len=self.plan_seq_len, dtype=self.dtype,
                              profiles=self.profiles.values(), engine=self.engine, view=view)
            other._views = self._views
            same = self._views.get(dataclasses.replace(view, dp_span=()))
            if view.dp_span and same is not None:  # only the dp links differ: the same compute and memory
                other._used_sources, other._compute = same._used_sources, same._compute
                other._selective_recompute, other._layer_memory = same._selective_recompute, same._layer_memory
            self._views[view] = other
        return other

    def at_cp(self, cp: int, variant: str = "all_to_all", span_tp: int = 0) -> "CostModel":
        """This cost model under context parallelism of degree ``cp`` (``variant``): a rank is a
        cp group of devices holding s/cp tokens each, so the grid and CP-SAT search it
        unchanged; ``span_tp``: its cp groups span nodes at that tp (``context.cluster_view``).
        Itself at its own cp."""
        return self.at(dataclasses.replace(self.view, cp=cp, cp_variant=variant if cp > 1 else "all_to_all",
                                           cp_span_tp=span_tp if cp > 1 else 0))

    def at_ep(self, ep: int, imbalance: float = 1.0) -> "CostModel":
        """This cost model under expert parallelism of degree ``ep`` with the busiest expert
        rank receiving ``imbalance`` x the balanced share of tokens. At ep 1 every rank runs its
        own tokens through every expert: there is no imbalance to wait for, and the model
        keeps the one it has."""
        if ep == 1:
            return self.at(dataclasses.replace(self.view, ep=1))
        return self.at(dataclasses.replace(self.view, ep=ep, imbalance=imbalance))

    def spanning(self, groups: Iterable[str]) -> "CostModel":
        """This cost model for stages whose data-parallel replicas sit on several node groups
        (``Plan`` ``replica_groups``): their collectives over dp run at the slowest of the
        groups' networks and the links between them (``dp_link``). Itself for one group."""
        names = tuple(sorted(set(groups)))
        return self if len(names) <= 1 else self.at(dataclasses.replace(self.view, dp_span=names))

    # ---- compute ------------------------------------------------------------------------
    def compute(self, role: str, device: str, tp: int, micro_batch: int) -> LayerCost:
        return self._compute(role, device, tp, micro_batch)

    def _compute_uncached(self, role: str, device: str, tp: int, micro_batch: int) -> LayerCost:
        cost, source = compute.layer_compute(self, role, device, tp, micro_batch)
        self._used_sources[device].add(source)
        return cost

    def recompute_s(self, role: str, device: str, tp: int, micro_batch: int, mode: str) -> float:
        """What recomputing the layer adds to one micro-batch's backward, by recompute mode:
        nothing, its forward ("full"), or its forward less the matrix products ("selective",
        ``compute.selective_recompute_s``)."""
        if mode == "none":
            return 0.0
        if mode == "full":
            return self.compute(role, device, tp, micro_batch).recompute_s
        return self._selective_recompute(role, device, tp, micro_batch)

    def _selective_recompute_uncached(self, role: str, device: str, tp: int, micro_batch: int) -> float:
        return compute.selective_recompute_s(self, role, device, tp, micro_batch)

    def time_constants(self, device: str) -> TimeConstants:
        return compute.time_constants(self.profiles.get(device), device, self.dtype)

    def weight_stream_gbps(self, device: str) -> float | None:
        return compute.weight_stream_gbps(self.profiles.get(device), device, self.dtype)

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

    def reserve_bytes(self, group: NodeGroup) -> int:
        return memory.reserve_bytes(group)

    @property
    def reduce_bytes(self) -> int:
        """Bytes a gradient element moves in a reduction: fp32 (``memory.REDUCE_BYTES``), or the
        compute dtype's under an engine that reduces fp16 gradients as they are
        (``Engine.fp16_grad_reduce``), keeps its gradients in the compute dtype
        (``Engine.grad_buffer``) or reduces them in it (``Engine.reduce_dtype``)."""
        as_computed = (self.engine.fp16_grad_reduce and self.dtype == "fp16" or self.engine.grad_buffer == "compute"
                       or self.engine.reduce_dtype == "compute")
        return self.elem if as_computed else memory.REDUCE_BYTES

    def gather_bytes(self, role: str) -> float:
        """Bytes a parameter of a ``role`` layer takes when FSDP gathers it (ZeRO 1-3): the
        compute dtype's, or, for a dense block whose FP8 products gather their weights cast
        (``Engine.fp8_gather``, torchao's float8 all-gather), one byte a linear weight and the
        compute dtype's for the rest (the norms)."""
        return self._weight_bytes(role, fp8=self.engine.fp8_gather)

    def step_gather_bytes(self, role: str) -> float:
        """Bytes a parameter of a ``role`` layer moves in ZeRO 1's once-a-step gather of the
        updated parameters (``layer_time.zero_traffic``): ``gather_bytes``', or, for a dense
        block whose FP8 products are Transformer Engine's under the distributed optimizer,
        one byte a linear weight: ``--fp8-param-gather`` (which ``partita export --to megatron``
        writes for an FP8 plan at ZeRO 1, as NVIDIA's recipes set ``fp8_params``) keeps those
        weights as FP8 tensors, which the distributed optimizer all-gathers as they are
        (megatron/core/optimizer/distrib_optimizer.py, the FP8 parameters' bucket). The bytes the
        rank holds are unchanged (``costs.memory.dense_memory``: the FP8 weight and its FP8
        transpose, one compute-dtype weight's)."""
        return self._weight_bytes(role, fp8=self.engine.fp8_gather or self.engine.fp8_impl == "transformer_engine")

    def _weight_bytes(self, role: str, *, fp8: bool) -> float:
        """Bytes a parameter of a ``role`` layer moves gathered: one a linear weight and the
        compute dtype's for the rest where ``fp8`` and the layer is a dense block whose products
        run in FP8, the compute dtype's otherwise."""
        kind = self.model.kinds[role]
        if not (fp8 and self.engine.matmul == "fp8" and role == "block" and not kind.is_moe):
            return float(self.elem)
        linear = kind.matmul_params / kind.params
        return linear * FP8_ELEMENT_BYTES + (1 - linear) * self.elem

    # ---- links --------------------------------------------------------------------------
    def tp_link(self, group: NodeGroup, tp: int) -> Link:
        return links.link_within(group, tp)

    def dp_link(self, group: NodeGroup, dp: int, tp: int) -> Link:
        """The link of ``dp`` ranks' collectives, tp apart (``links.dp_link``), on the devices
        (under cp a rank of ``group`` is a cp group of them: ``dp`` then counts their replicas),
        or across the groups the replicas span (``links.spanning_dp_link``)."""
        if self.dp_span:
            return links.spanning_dp_link(self.real_cluster, self.dp_span, tp)
        return links.dp_link(self.real_cluster.group(group.name), dp, tp)

    def pp_link(self, a: NodeGroup, b: NodeGroup, stage_size: int) -> Link:
        """Between stages of ``stage_size`` ranks of the search, on the devices: under cp a rank
        is cp of them, and a node of a view whose cp groups span nodes is several real ones."""
        real = self.real_cluster
        return links.pp_link(real, real.group(a.name), real.group(b.name), stage_size * self.cp)

    def collective_s(self, op: str, nbytes: float, n: int, link: Link, device: str | None = None) -> float:
        return links.collective_s(self.profiles, op, nbytes, n, link, device)

    # ---- one layer ----------------------------------------------------------------------
    def param_count(self, role: str, tp: int) -> int:
        """Parameters of one tp shard of the layer replicated over dp (norms and biases of
        replicated parts are counted whole on each shard; they are tiny). A head tied to the
        embedding owns only its norm: the shared weight is counted with the embedding (the
        runtime keeps both in one stage). Under expert parallelism a block's routed experts
        and, under tp, its MoE's other weights are apart (``experts.moe_parts``)."""
        kind = self.model.kinds[role]
        if role == "head" and self.model.tie_embeddings:
            return kind.params - kind.matmul_params
        whole = kind.moe_params if role == "block" else 0  # a MoE's weights stay whole under tp
        params = (kind.matmul_params - whole) // tp + whole + (kind.params - kind.matmul_params) // (1 if role != "embed" else tp)
        if role != "block" or not kind.is_moe:
            return params
        # The parts apart: under ep all E routed experts (a rank holds E/ep of them apart), under
        # tp the rest of the MoE's weights too.
        apart = kind.expert_params if self.ep > 1 else 0
        if tp > 1:
            apart = kind.moe_params
        return params - apart

    def moe_parts(self, role: str, tp: int) -> tuple:
        """A MoE block's parts sharded apart from its dense part (``experts.moe_parts``)."""
        return experts.moe_parts(self, role, tp)

    def expert_rows_bytes(self, micro_batch: int) -> int:
        """The routed rows a tp group's split experts run (``experts.expert_rows_bytes``)."""
        return experts.expert_rows_bytes(self, micro_batch)

    def expert_params(self) -> int:
        """The routed experts' parameters on one rank: E/ep of them."""
        return self.model.kinds["block"].expert_params // self.ep

    def tied_params(self, tp: int) -> int:
        """The weight a tied embedding and head share, per tp shard (vocab-parallel)."""
        return self.model.vocab * self.model.hidden // tp if self.model.tie_embeddings else 0

    def tied_sync_s(self, group: NodeGroup, *, dp: int, tp: int, zero: int) -> float:
        """A tied head's copy summed with the embedding's, per step (``layer_time.tied_sync_s``)."""
        return layer_time.tied_sync_s(self, group, replicas=dp * self.cp, tp=tp, zero=zero)

    def layer_time(self, role: str, group: NodeGroup, s: LayerStrategy, *, dp: int, micro_batch: int) -> LayerTime:
        return self._layer_time(role, group.name, s.tensor_parallel, s.sequence_parallel, s.zero, s.recompute, dp,
                                micro_batch)

    def layer_time_of(self, choice: tuple[str, int, bool, int, str], group: NodeGroup, *, dp: int,
                      micro_batch: int) -> LayerTime:
        role, tp, sp, zero, recompute = choice
        return self._layer_time(role, group.name, tp, sp, zero, recompute, dp, micro_batch)

    def tp_pass(self, role: str, group: NodeGroup, tp: int, sp: bool, recompute: str,
                micro_batch: int) -> tuple[float, float, float, float]:
        """A layer's compute and TP collectives per micro-batch (``layer_time.tp_pass``)."""
        return self._tp_pass(role, group.name, tp, sp, recompute, micro_batch)

    def _tp_pass_uncached(self, role: str, group_name: str, tp: int, sp: bool, recompute: str,
                          micro_batch: int) -> tuple[float, float, float, float]:
        return layer_time.tp_pass(self, role, self.cluster.group(group_name), tp=tp, sp=sp, recompute=recompute,
                                  micro_batch=micro_batch)

    def zero_traffic(self, role: str, group: NodeGroup, tp: int, zero: int,
                     replicas: int) -> tuple[float, float, float, float]:
        """A dense layer's ZeRO traffic over ``replicas`` ranks (``layer_time.zero_traffic``)."""
        return self._zero_traffic(role, group.name, tp, zero, replicas)

    def _zero_traffic_uncached(self, role: str, group_name: str, tp: int, zero: int,
                               replicas: int) -> tuple[float, float, float, float]:
        return layer_time.zero_traffic(self, self.param_count(role, tp), self.cluster.group(group_name), tp=tp,
                                       zero=zero, replicas=replicas, role=role)

    def _layer_time_uncached(self, role: str, group_name: str, tp: int, sp: bool, zero: int, recompute: str,
                             dp: int, micro_batch: int) -> LayerTime:
        """The dense terms over dp x cp replicas (``layer_time.layer_time``), then the view's."""
        group = self.cluster.group(group_name)
        moe = role == "block" and self.model.is_moe and dp % self.ep == 0
        expert_zero = experts.zero_traffic(self, group, tp=tp, zero=zero, dp=dp) if moe else None
        t = layer_time.layer_time(self, role, group, tp=tp, sp=sp, zero=zero, recompute=recompute,
                                  replicas=dp * self.cp, micro_batch=micro_batch, extra_zero=expert_zero)
        if role == "block" and self.cp > 1:
            t = context.with_cp_time(self, t, group, tp=tp, recompute=recompute, micro_batch=micro_batch)
        if moe:
            t = experts.with_moe_time(self, t, group, tp=tp, zero=zero, recompute=recompute, dp=dp,
                                      micro_batch=micro_batch)
        return t

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
        return memory.layer_memory(self, role, device, tp=tp, sp=sp, zero=zero, recompute=recompute, dp=dp,
                                   micro_batch=micro_batch, num_micro_batches=num_micro_batches, tied_copy=tied_copy)
