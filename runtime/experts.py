"""Expert parallelism: each rank of an ep group holds experts/ep of every MoE block's experts,
and tokens travel to their experts and back by all-to-all.

    from partita.runtime.experts import apply_expert_parallel
    apply_expert_parallel(model, meshes)   # after keep_stage_layers, before materialising

Per MoE block and micro-batch, forward (``ExpertDispatch``):

  1. the routing counts: an all-to-all of this rank's tokens per expert (E int64 values), so
     every rank learns how many rows it receives from each rank for each of its experts;
  2. dispatch: ``all_to_all_single`` of the rank's t x k routed rows (grouped by expert, hence
     by destination) with variable split sizes;
  3. the local experts run on what they received (regrouped by expert);
  4. combine: the mirror all-to-all brings each row back to the rank of its token.

The backward runs the mirror of 2 and 4 on the gradients (``_AllToAll``). Expert weights are
sharded over the experts' replicas only (``Meshes.expert_dp``; parallelize.apply_fsdp), and each
expert's gradient already sums the tokens of its whole ep group. The cost model prices exactly
these calls (``partita.search.experts.all_to_all_bytes``; tests/test_moe_runtime.py counts them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from partita.runtime.mesh import Meshes
from partita.runtime.models import MoE, Transformer


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable split sizes; its backward is the mirror exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ExpertDispatch:
    """The MoE's ``dispatch`` under expert parallelism: rank i of the ep group runs experts
    ``local`` = i*E/ep .. (i+1)*E/ep - 1 on every ep rank's rows routed to them."""

    def __init__(self, moe: MoE, group, ep: int, index: int) -> None:
        self.moe, self.group, self.ep = moe, group, ep
        per = moe.num_experts // ep
        self.local = list(range(index * per, (index + 1) * per))

    def __call__(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, per = self.ep, len(self.local)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)  # [source rank, local expert]
        by_source = received_counts.view(ep, per)
        send = counts.view(ep, per).sum(1).tolist()
        receive = by_source.sum(1).tolist()
        rows = _AllToAll.apply(grouped, receive, send, self.group)  # source-major, then expert
        order = _expert_major(by_source)
        out = self.moe.experts(rows.index_select(0, order), by_source.sum(0).tolist(), self.local)
        out = out.new_zeros(out.shape).index_copy(0, order, out)  # source-major again
        return _AllToAll.apply(out, send, receive, self.group)


def _expert_major(by_source: torch.Tensor) -> torch.Tensor:
    """The row order that regroups rows received source-major ([source][expert] blocks of
    ``by_source`` rows) expert-major."""
    counts = by_source.tolist()
    starts, offset = [], 0
    for row in counts:
        starts.append([])
        for n in row:
            starts[-1].append(offset)
            offset += n
    pieces = [torch.arange(starts[s][e], starts[s][e] + counts[s][e])
              for e in range(len(counts[0])) for s in range(len(counts))]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def apply_sequence_split(model: Transformer, meshes: Meshes) -> None:
    """Under tensor (with sequence parallelism) or context parallelism every MoE block runs on
    this rank's tokens of each sequence with whole experts, so its balancing loss sums its
    statistics over the ``Meshes.seq`` ranks (``models.load_balance_loss``)."""
    group = meshes.seq.get_group()
    for module in model.modules():
        if isinstance(module, MoE):
            module.sequence_group = group


def apply_expert_parallel(model: Transformer, meshes: Meshes) -> None:
    """Every MoE block of the stage keeps its ep rank's experts (the others deleted while still on
    the meta device) and dispatches over the ep group."""
    ep_mesh = meshes.ep
    ep, index = ep_mesh.size(), ep_mesh.get_local_rank()
    group = ep_mesh.get_group()
    for module in model.modules():
        if isinstance(module, MoE):
            dispatch = ExpertDispatch(module, group, ep, index)
            for key in list(module.experts):
                if int(key) not in dispatch.local:
                    del module.experts[key]
            module.dispatch = dispatch
