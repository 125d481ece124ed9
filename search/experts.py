"""Expert parallelism's costs: the all-to-alls, the experts' sharded state, and routing imbalance.

    from partita.search.costs.model import CostModel
    view = CostModel(model, cluster, seq_len=4096).at_ep(8)      # ep 8, balanced routing
    all_to_all_bytes(view, recompute="none", micro_batch=1)      # one block's bytes per micro-batch

A mixture-of-experts block (``partita.model``, docs/moe.md) at expert-parallel degree ep, on one
rank, per micro-batch of t = b x s tokens, k experts a token, E experts of width f, hidden h, e
bytes an element (``runtime.experts`` runs exactly this):

* Forward: an all-to-all of the E routing counts (int64), then dispatch and combine, each an
  all-to-all of the rank's t k h e bytes of expert rows. Backward: the mirror of dispatch and
  combine. A fully recomputed block runs its forward's three again in the backward. Of each
  buffer (ep - 1)/ep leaves the rank under balanced routing, priced on the ep group's link (ep
  consecutive data-parallel ranks, x tp devices: inside a node when ep x tp fits one).
* Compute: balanced routing gives every rank t k expert rows, as without ep. The busiest rank
  gets ``imbalance`` x that (the user's assumption, ``--moe-imbalance``); its expert products
  take that much longer, and the whole ep group waits for it.
* State: the rank holds E/ep experts: their weights, gradients and Adam state are sharded
  (ZeRO) over the dp/ep replicas of each expert only, and their ZeRO traffic runs over those
  replicas (on the data-parallel group's link). Everything else of the block (attention, norms,
  router, shared expert) is sharded over dp. The expert part's transient terms (its
  ZeRO gathers, its unsharded gradient) add to the dense part's (an upper bound).

Under tensor parallelism (with sequence parallelism, ``parallel.moe_tp_rule``) a MoE block splits
its attention tp ways and runs its MoE on the rank's 1/tp of the tokens with whole experts
(``analytic.Shard.moe_split``): one all-gather and one reduce-scatter a pass (the attention's),
the all-to-alls carry the rank's t/tp tokens, and the MoE's weights are replicated over the tp
ranks, which are data replicas of them: they are sharded and reduced over dp x cp x tp (the
experts over dp x cp / ep x tp), ``moe_parts``. An engine that splits the experts over tp
instead (``Engine.expert_tp`` "split", Megatron-Core's expert tensor parallelism = tp) holds a
tp-th of each of its experts, sharded over dp x cp / ep, and all-gathers the routed rows over tp
around them (``expert_tp_s``): the same FLOPs a rank, the gathered rows kept for the weight
gradients (``costs.memory``). Under tp or cp the balancing loss sums its
per-sequence statistics over the cp x tp ranks: one all-reduce of (2 E + 1) b fp32 values a
forward (``sequence_stats_s``).

ep must divide the experts and dp. The cost model (``costs.model.CostModel``) adds these terms to
a block when its layout has ep > 1: its time here (``with_moe_time``, ``zero_traffic``), its memory
in ``costs.memory.expert_memory``, where a layout whose dp ep does not divide is priced as not
fitting (``costs.memory.UNRUNNABLE_BYTES``). The grid and CP-SAT search it unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from partita.cluster import NodeGroup
from partita.devices import get_device
from partita.errors import PartitaError
from partita.model import ModelSpec
from partita.search.analytic import Shard, matmul_time_s
from partita.search.costs.compute import optimizer_s
from partita.search.costs.layer_time import rerun_products
from partita.search.costs.layer_time import zero_traffic as params_zero_traffic
from partita.search.costs.links import Link, link_within
from partita.search.roofline import cpu_adam_s

COUNT_BYTES = 8  # the routing counts are int64


@dataclass(frozen=True)
class AllToAllBytes:
    """One MoE block's all-to-alls on one rank for one micro-batch: the bytes of every buffer
    handed to ``all_to_all_single`` (``buffer``; what the runtime sends, itself included) and
    of those the bytes that leave the rank under balanced routing (``wire``)."""

    buffer: int
    wire: float
    forward: tuple[int, ...]  # the forward's buffers, in order: counts, dispatch, combine
    backward: tuple[int, ...]  # the backward's: combine's and dispatch's mirrors (+ the forward again)

    def __add__(self, other: "AllToAllBytes") -> "AllToAllBytes":
        return AllToAllBytes(self.buffer + other.buffer, self.wire + other.wire, self.forward + other.forward,
                             self.backward + other.backward)

    def __mul__(self, n: int) -> "AllToAllBytes":
        return AllToAllBytes(self.buffer * n, self.wire * n, self.forward * n, self.backward * n)


@dataclass(frozen=True)
class MoePart:
    """Weights of a MoE block sharded apart from its dense part: ``params`` on the rank, whose
    replicas are dp x cp / ``ep`` x ``split`` ranks; ``local_experts`` whole experts among them."""

    params: int
    ep: int
    split: int
    local_experts: int

    def replicas(self, dp: int, cp: int) -> int:
        return dp * cp // self.ep * self.split


def moe_parts(cm, role: str, tp: int) -> tuple[MoePart, ...]:
    """The parts of a ``role`` layer at tensor-parallel degree ``tp`` that are sharded apart
    (module docstring): under ep the rank's E/ep experts; under tp the MoE's other weights
    (router, shared expert, and the experts at ep 1 unless split). Under ``Engine.expert_tp``
    "split" the experts part is a tp-th of the rank's E/ep experts at any ep; the router and a
    shared expert stay whole on each tp rank (Megatron-Core splits a shared expert over tp: not
    priced). None for other layers."""
    kind = cm.model.kinds[role]
    if role != "block" or not kind.is_moe:
        return ()
    parts = []
    if tp > 1 and cm.engine.expert_tp == "split":  # a tp-th of each of the rank's E/ep experts
        parts.append(MoePart(cm.expert_params() // tp, cm.ep, 1, kind.experts // cm.ep))
        return (*parts, MoePart(kind.moe_params - kind.expert_params, 1, tp, 0))
    if cm.ep > 1:
        parts.append(MoePart(cm.expert_params(), cm.ep, tp, kind.experts // cm.ep))
    if tp > 1:
        rest = kind.moe_params - (kind.expert_params if cm.ep > 1 else 0)
        parts.append(MoePart(rest, 1, tp, kind.experts if cm.ep == 1 else 0))
    return tuple(parts)


def check_layout(model: ModelSpec, ep: int, imbalance: float) -> None:
    """Raise unless the cost model can price expert parallelism of degree ``ep`` with the busiest
    expert rank receiving ``imbalance`` x the balanced share of tokens."""
    if not model.is_moe and ep > 1:
        raise PartitaError(f"expert parallelism (ep {ep}) needs a mixture-of-experts model; {model.name} is dense")
    if ep < 1 or (model.is_moe and model.experts % ep):
        raise PartitaError(f"expert-parallel degree {ep} must divide the {model.experts} experts")
    if not imbalance >= 1.0:
        raise PartitaError(f"the routing imbalance is the busiest rank's tokens over the mean: >= 1, got {imbalance}")


def all_to_all_bytes(cm, *, recompute: str, micro_batch: int, tp: int = 1) -> AllToAllBytes:
    """The all-to-alls of one MoE block per rank and micro-batch at the cost model ``cm``'s ep
    (none at ep 1), on the rank's 1/tp of the tokens: module docstring."""
    ep, model = cm.ep, cm.model
    if ep == 1 or not model.is_moe:
        return AllToAllBytes(0, 0.0, (), ())
    rows = micro_batch * cm.seq_len // tp * model.experts_per_token * model.hidden * cm.elem
    forward = (COUNT_BYTES * model.experts, rows, rows)
    backward = (rows, rows) + (forward if cm.engine.reruns_communication(recompute) else ())
    buffer = sum(forward) + sum(backward)
    return AllToAllBytes(buffer, buffer * (ep - 1) / ep, forward, backward)


def ep_link(cm, group: NodeGroup, tp: int) -> Link:
    """An ep group: ep consecutive data-parallel ranks, tp devices apart (x cp under context
    parallelism); under an engine that folds the experts' ranks (``Engine.expert_ranks``
    "folded", Megatron-Core 0.10+), ep ranks the experts' own tp apart: consecutive ranks for
    whole experts."""
    return link_within(cm.real_cluster.group(group.name), ep_span(cm, tp))


def ep_span(cm, tp: int) -> int:
    """The ranks an ep group spans (``ep_link``): ep x cp x tp as data-parallel ranks, ep x the
    experts' own tp when folded."""
    if cm.engine.expert_ranks == "folded":
        return cm.ep * (tp if cm.engine.expert_tp == "split" else 1)
    return cm.ep * cm.cp * tp


def all_to_all_s(cm, group: NodeGroup, tp: int, micro_batch: int, recompute: str) -> tuple[float, float]:
    """(forward, backward) seconds of one block's all-to-alls on the ep group's link."""
    traffic = all_to_all_bytes(cm, recompute=recompute, micro_batch=micro_batch, tp=tp)
    link = ep_link(cm, group, tp)
    price = lambda sizes: sum(cm.collective_s("all_to_all", b, cm.ep, link, group.device)  # noqa: E731
                              for b in sizes)
    return price(traffic.forward), price(traffic.backward)


def imbalance_s(cm, group: NodeGroup, tp: int, micro_batch: int, recompute: str) -> tuple[float, float]:
    """(forward, backward) extra seconds of the busiest rank's expert products: (imbalance - 1)
    x the balanced rows' products (the backward's two products a forward one, and the forward
    products the recomputation runs again, ``layer_time.rerun_products``)."""
    if cm.moe_imbalance == 1.0:
        return 0.0, 0.0
    kind = cm.model.kinds["block"]
    dev = get_device(group.device)
    sh = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=cm.seq_len, dtype=cm.dtype)
    rows = sh.moe_tokens * kind.experts_per_token
    f, h = sh.ffn, sh.hidden
    up = matmul_time_s(dev, rows, f, h, cm.dtype)
    times = {"w1": up, "w3": up, "w2": matmul_time_s(dev, rows, h, f, cm.dtype)}
    scale = (cm.moe_imbalance - 1.0) * cm.time_constants(group.device).compute_scale
    extra = scale * sum(times.values())
    rerun = scale * sum(times[name] for name in rerun_products(cm, kind, sh, recompute, times))
    return extra, 2 * extra + rerun


def expert_rows_bytes(cm, micro_batch: int) -> int:
    """The routed rows a tp group's experts run under ``Engine.expert_tp`` "split": every token of
    the group's micro-batch k times (what each rank's experts all-gather before their products and
    reduce-scatter after)."""
    return micro_batch * cm.seq_len * cm.model.experts_per_token * cm.model.hidden * cm.elem


def expert_tp_s(cm, group: NodeGroup, tp: int, micro_batch: int, recompute: str) -> tuple[float, float]:
    """(forward, backward) seconds of the all-gather and the reduce-scatter of the routed rows
    over tp around experts split tp ways (``Engine.expert_tp`` "split"), on the tp link: forward
    the pair, backward its mirror (the reduce-scatter of the input rows' gradient, the gather of
    the output's), and the pair again where the MoE's forward is recomputed
    (``Engine.reruns_communication``). Not beside any product."""
    if cm.engine.expert_tp != "split" or tp == 1 or not cm.model.is_moe:
        return 0.0, 0.0
    nbytes, link = expert_rows_bytes(cm, micro_batch), cm.tp_link(group, tp)
    pair = (cm.collective_s("all_gather", nbytes, tp, link, group.device)
            + cm.collective_s("reduce_scatter", nbytes, tp, link, group.device))
    return pair, pair + (pair if cm.engine.reruns_communication(recompute) else 0.0)


def sequence_stats_s(cm, group: NodeGroup, tp: int, micro_batch: int, recompute: str) -> tuple[float, float]:
    """(forward, backward) seconds of the balancing loss's all-reduce over the cp x tp ranks of
    each sequence (module docstring): once a forward, again when the block is recomputed."""
    if cm.cp * tp == 1:
        return 0.0, 0.0
    nbytes = (2 * cm.model.experts + 1) * micro_batch * 4
    one = cm.collective_s("all_reduce", nbytes, cm.cp * tp, link_within(cm.real_cluster.group(group.name), cm.cp * tp),
                          group.device)
    return one, one if cm.engine.reruns_communication(recompute) else 0.0


def zero_traffic(cm, group: NodeGroup, *, tp: int, zero: int, dp: int) -> tuple[float, float, float, float]:
    """The ZeRO traffic (``layer_time.zero_traffic``) of a block's MoE parts (``moe_parts``),
    each over its replicas, on the data-parallel group's link."""
    total = (0.0, 0.0, 0.0, 0.0)
    for part in moe_parts(cm, "block", tp):
        replicas = part.replicas(dp, cm.cp)
        # Experts split over tp have their replicas one expert-parallel group apart (``ep_span``).
        split = cm.engine.expert_tp == "split" and tp > 1 and part.local_experts
        stride = ep_span(cm, tp) if split else tp
        t = params_zero_traffic(cm, part.params, group, tp=tp, zero=zero, replicas=replicas,
                                dlink=cm.dp_link(group, replicas, stride), local_experts=part.local_experts)
        total = tuple(a + b for a, b in zip(total, t))
    return total


def with_moe_time(cm, t, group: NodeGroup, *, tp: int, zero: int, recompute: str, dp: int, micro_batch: int):
    """A MoE block's ``costs.layer_time.LayerTime`` ``t`` (the dense part's, with its MoE parts'
    ZeRO traffic beside its compute: ``zero_traffic``) with the all-to-alls, the imbalance's
    extra expert compute, the balancing loss's all-reduce and the MoE parts' optimizer update
    added."""
    a2a_f, a2a_b = all_to_all_s(cm, group, tp, micro_batch, recompute) if cm.ep > 1 else (0.0, 0.0)
    imb_f, imb_b = imbalance_s(cm, group, tp, micro_batch, recompute) if cm.ep > 1 else (0.0, 0.0)
    st_f, st_b = sequence_stats_s(cm, group, tp, micro_batch, recompute)
    etp_f, etp_b = expert_tp_s(cm, group, tp, micro_batch, recompute)
    k = cm.time_constants(group.device)
    stream = cm.weight_stream_gbps(group.device)
    optimizer = 0.0
    for part in moe_parts(cm, "block", tp):
        replicas = part.replicas(dp, cm.cp)
        local = part.params // (replicas if zero >= 1 and replicas > 1 else 1)
        optimizer += cpu_adam_s(local, stream) if stream is not None else k.compute_scale * optimizer_s(group, local)
    # The all-to-alls, the statistics' all-reduce and split experts' gathers are on the critical
    # path (counted with tp's collectives).
    comm_f, comm_b = a2a_f + st_f + etp_f, a2a_b + st_b + etp_b
    return dataclasses.replace(
        t, forward_s=t.forward_s + comm_f + imb_f, backward_s=t.backward_s + comm_b + imb_b,
        compute_s=t.compute_s + imb_f + imb_b, tp_comm_s=t.tp_comm_s + comm_f + comm_b,
        optimizer_s=t.optimizer_s + optimizer)
