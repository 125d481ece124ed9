"""Expert parallelism's costs: the all-to-alls, the experts' sharded state, and routing imbalance.

    from partita.search.costs import CostModel
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
  router, shared expert) is sharded over dp as before. The expert part's transient terms (its
  ZeRO gathers, its unsharded gradient) add to the dense part's (an upper bound).

ep must divide the experts and dp. The grid and CP-SAT search the view unchanged; a layout
whose dp ep does not divide is priced as not fitting (``UNRUNNABLE_BYTES``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from partita.cluster import NodeGroup
from partita.errors import PartitaError
from partita.search.analytic import Shard, matmul_time_s
from partita.search.costs import ADAM_STATE_BYTES, MASTER_BYTES, REDUCE_BYTES, CostModel
from partita.search.roofline import cpu_adam_s
from partita.units import round_up_to_grain

COUNT_BYTES = 8  # the routing counts are int64
# What a layout whose data-parallel degree the ep degree does not divide is priced at: more than
# any device holds, so every search discards it.
UNRUNNABLE_BYTES = 1 << 50


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


def all_to_all_bytes(cm: CostModel, *, recompute: str, micro_batch: int) -> AllToAllBytes:
    """The all-to-alls of one MoE block per rank and micro-batch at the cost model's ep (none at
    ep 1): module docstring."""
    ep, model = cm.ep, cm.model
    if ep == 1 or not model.is_moe:
        return AllToAllBytes(0, 0.0, (), ())
    rows = micro_batch * cm.seq_len * model.experts_per_token * model.hidden * cm.elem
    forward = (COUNT_BYTES * model.experts, rows, rows)
    backward = (rows, rows) + (forward if recompute != "none" else ())
    buffer = sum(forward) + sum(backward)
    return AllToAllBytes(buffer, buffer * (ep - 1) / ep, forward, backward)


class ExpertCostModel(CostModel):
    """A ``CostModel`` at expert-parallel degree ep (``CostModel.at_ep``): blocks are priced as
    in the plain model with the routed experts taken out of their parameters (``_param_count``),
    plus the experts' own state, ZeRO traffic and optimizer over their replicas, the
    all-to-alls, and the routing imbalance's extra expert compute (module docstring)."""

    def __init__(self, base: CostModel, *, ep: int, imbalance: float) -> None:
        if not base.model.is_moe and ep > 1:
            raise PartitaError(f"expert parallelism (ep {ep}) needs a mixture-of-experts model; "
                               f"{base.model.name} is dense")
        if ep < 1 or (base.model.is_moe and base.model.experts % ep):
            raise PartitaError(f"expert-parallel degree {ep} must divide the {base.model.experts} experts")
        if not imbalance >= 1.0:
            raise PartitaError(f"the routing imbalance is the busiest rank's tokens over the mean: >= 1, got {imbalance}")
        super().__init__(base.model, base.cluster, seq_len=base.seq_len, dtype=base.dtype,
                         profiles=base.profiles.values(), software=base.software)
        self.ep, self.moe_imbalance, self.ep_base = ep, imbalance, base

    # -- the routed experts' share of a block ------------------------------------------------
    def _param_count(self, role: str, tp: int) -> int:
        """The block's parameters sharded over dp: all but the routed experts."""
        params = super()._param_count(role, tp)
        return params - self.model.kinds["block"].expert_params if role == "block" else params

    def expert_params(self) -> int:
        """The routed experts' parameters on one rank: E/ep of them."""
        return self.model.kinds["block"].expert_params // self.ep

    def ep_link(self, group: NodeGroup, tp: int):
        """An ep group: ep consecutive data-parallel ranks, tp devices apart."""
        return self._link(group, self.ep * tp)

    def all_to_all_s(self, group: NodeGroup, tp: int, micro_batch: int, recompute: str) -> tuple[float, float]:
        """(forward, backward) seconds of one block's all-to-alls on the ep group's link."""
        traffic = all_to_all_bytes(self, recompute=recompute, micro_batch=micro_batch)
        link = self.ep_link(group, tp)
        price = lambda sizes: sum(self.collective_s("all_to_all", b, self.ep, link, group.device)  # noqa: E731
                                  for b in sizes)
        return price(traffic.forward), price(traffic.backward)

    def imbalance_s(self, group: NodeGroup, tp: int, micro_batch: int, recompute: str) -> tuple[float, float]:
        """(forward, backward) extra seconds of the busiest rank's expert products: (imbalance - 1)
        x the balanced rows' products (the backward's two products a forward one, and the
        forward again when recomputed)."""
        if self.moe_imbalance == 1.0:
            return 0.0, 0.0
        kind = self.model.kinds["block"]
        from partita.devices import get_device

        dev = get_device(group.device)
        sh = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=self.seq_len, dtype=self.dtype)
        rows = sh.tokens * kind.experts_per_token
        f, h = sh.ffn, sh.hidden
        products = 2 * matmul_time_s(dev, rows, f, h, self.dtype) + matmul_time_s(dev, rows, h, f, self.dtype)
        extra = (self.moe_imbalance - 1.0) * self.time_constants(group.device).compute_scale * products
        return extra, 2 * extra + (extra if recompute != "none" else 0.0)

    # -- one layer -----------------------------------------------------------------------------
    def _layer_time_uncached(self, role, group_name, tp, sp, zero, recompute, dp, micro_batch):
        base = super()._layer_time_uncached(role, group_name, tp, sp, zero, recompute, dp, micro_batch)
        if role != "block" or dp % self.ep:
            return base
        group = self.cluster.group(group_name)
        replicas = dp // self.ep
        a2a_f, a2a_b = self.all_to_all_s(group, tp, micro_batch, recompute)
        imb_f, imb_b = self.imbalance_s(group, tp, micro_batch, recompute)
        k = self.time_constants(group.device)
        shard = replicas if zero >= 1 and replicas > 1 else 1
        local = self.expert_params() // shard
        stream = self.weight_stream_gbps(group.device)
        optimizer = cpu_adam_s(local, stream) if stream is not None else k.compute_scale * self.optimizer_s(group, local)
        # The all-to-alls are on the critical path (counted with tp's collectives); the experts'
        # ZeRO traffic is in the base's, beside the compute (``_layer_zero_traffic``).
        return dataclasses.replace(
            base, forward_s=base.forward_s + a2a_f + imb_f, backward_s=base.backward_s + a2a_b + imb_b,
            compute_s=base.compute_s + imb_f + imb_b, tp_comm_s=base.tp_comm_s + a2a_f + a2a_b,
            optimizer_s=base.optimizer_s + optimizer)

    def _layer_zero_traffic(self, role, params, group, *, tp, zero, dp):
        """The dense part's over dp, and a block's experts' over their dp/ep replicas (on the
        data-parallel group's link)."""
        dense = super()._layer_zero_traffic(role, params, group, tp=tp, zero=zero, dp=dp)
        if role != "block" or dp % self.ep:
            return dense
        experts = self._zero_traffic(self.expert_params(), group, tp=tp, zero=zero, dp=dp // self.ep,
                                     dlink=self.dp_link(group, dp, tp))
        return tuple(a + b for a, b in zip(dense, experts))

    def _layer_memory_uncached(self, role, device, tp, sp, zero, recompute, dp, micro_batch, num_micro_batches,
                               tied_copy=False):
        base = super()._layer_memory_uncached(role, device, tp, sp, zero, recompute, dp, micro_batch,
                                              num_micro_batches, tied_copy)
        if role != "block":
            return base
        if dp % self.ep:
            return dataclasses.replace(base, weights=UNRUNNABLE_BYTES)
        params, e, replicas = self.expert_params(), self.elem, dp // self.ep
        z = zero if replicas > 1 else 0
        shard = replicas if z >= 1 else 1
        # The experts are an FSDP2 unit whenever dp > 1 (always, at ep > 1): a compute-dtype copy
        # at ZeRO 0-2, gradients accumulated unsharded over micro-batches at ZeRO 0-1.
        gathered = params * e if z < 3 else 0
        gradients = params * REDUCE_BYTES if z < 2 and num_micro_batches > 1 else params * REDUCE_BYTES // shard
        spike = {2: params * e, 3: 2 * params * e}.get(z, 0) + params * REDUCE_BYTES  # a gather, the unsharded gradient
        up = round_up_to_grain
        return dataclasses.replace(
            base, weights=base.weights + up(params * MASTER_BYTES // shard),
            gathered_weights=base.gathered_weights + up(gathered), gradients=base.gradients + up(gradients),
            optimizer=base.optimizer + up(params * ADAM_STATE_BYTES // shard), params=base.params + params // shard,
            transient=base.transient + up(spike), backward_own=base.backward_own + up(params * REDUCE_BYTES),
            copy=base.copy + up(params * e))
