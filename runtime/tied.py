"""A tied embedding and head on different pipeline stages (Megatron's scheme).

The first stage owns the embedding's weight, the last stage a copy of it as the head's output
weight; both start equal (``models.materialize``). After every step's backward, each pair of
ranks at the same data- and tensor-parallel position on those two stages sums the two
gradients, so both copies take the same optimizer step and stay equal: one logical weight, the
gradient a single model would get. The copy on the last stage is left out of the gradient norm
(it would count the same gradient twice) but clipped by the same factor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from partita.plan import Plan
from partita.runtime.mesh import RankPlace
from partita.runtime.models import Transformer


class TiedWeights:
    """Keeps a tied embedding and head equal across the first and last pipeline stage."""

    def __init__(self, model: Transformer, plan: Plan, place: RankPlace) -> None:
        self.param: torch.nn.Parameter | None = None
        self.group: dist.ProcessGroup | None = None
        self.is_copy = False  # the last stage's copy: not counted in the gradient norm
        # The stages holding the embedding and the head: the first and the last, but under zbv
        # (a V) the first holds both, and the weight is tied within the rank as without stages.
        first = next(s for s in plan.stages if "embed" in s.layer_names)
        last = next(s for s in plan.stages if "head" in s.layer_names)
        if not model.spec.tie_embeddings or first.index == last.index:
            return
        # Every rank creates every pair's group, in the same order (torch.distributed requires it).
        for position in range(len(first.ranks)):
            pair = [first.ranks[position], last.ranks[position]]
            group = dist.new_group(pair)
            if place.rank in pair:
                self.group = group
        if place.stage.index == first.index:
            self.param = model.embed.tok.weight
        elif place.stage.index == last.index:
            self.param = model.head.output.weight
            self.is_copy = True

    def sync_gradients(self) -> None:
        """Sum the two copies' gradients (call after the step's backward, before clipping)."""
        if self.param is None or self.param.grad is None:
            return
        grad = self.param.grad
        if isinstance(grad, DTensor) and grad.placements != self.param.placements:
            # A vocab-parallel embedding's gradient comes back whole on every tensor rank
            # (Replicate); the head's copy is split (Shard(0)): take this rank's rows (a free slice).
            grad = self.param.grad = grad.redistribute(grad.device_mesh, self.param.placements)
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=self.group)

    def norm_excluded(self) -> set[int]:
        """ids of the parameters to leave out of the gradient norm on this rank."""
        return {id(self.param)} if self.is_copy and self.param is not None else set()
