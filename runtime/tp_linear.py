"""Column-parallel products of one input, with their input gradient's reduction beside the weight
gradients (Megatron-LM's scheme; search/engines.py, ``dgrad_overlap`` and ``sp_inputs``).

A block's q, k and v projections share one input, as do its MLP's first products (w1 and w3 of a
SwiGLU, w1 of a GELU MLP) and the head's output layer. Under tensor parallelism each rank holds
their column slices (``ColwiseParallel`` places the weights), and the input's gradient is the sum
of the ranks' partial products: an all-reduce, or a reduce-scatter to sequence shards under
sequence parallelism. DTensor's autograd runs each linear's backward as one node (the input's
and the weight's gradients together) and reduces the input gradient after it, with nothing left
to run beside the collective. ``columns`` runs the group as one autograd function instead:

* forward: under sequence parallelism, all-gather the rank's sequence shard, then the products;
  only the shard is kept for the backward (``sp_inputs: sharded``);
* backward: start the shard's all-gather again, compute the input gradient (the products with the
  weights), start its reduction, then the weight gradients (from the gathered input), and wait
  for the reduction last, so it runs beside them (``dgrad_overlap``; Megatron-LM's
  ``LinearWithGradAccumulationAndAsyncCommunication.backward``, which overlaps the same two
  collectives so).

Collectives in the forward are functional (``torch.distributed._functional_collectives``, as
DTensor's own), so selective recomputation sees and replays them; the backward's are plain
asynchronous ``torch.distributed`` calls on the tensor-parallel group. Numerically the function
equals the linears it replaces (tests/test_runtime_parallel.py trains every tensor-parallel plan
against one process).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, dist.Work]:
    """Start the all-gather of sequence shards [b, s/tp, h]: (buffer [tp * b, s/tp, h], the
    ranks' shards one after another; work)."""
    tp = dist.get_world_size(group)
    out = x.new_empty((tp * x.shape[0], *x.shape[1:]))
    return out, dist.all_gather_into_tensor(out, x.contiguous(), group=group, async_op=True)


class _Columns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, sequence: bool, *params: torch.Tensor | None):
        ctx.group, ctx.sequence = group, sequence
        full = funcol.all_gather_tensor(x.contiguous(), gather_dim=1, group=group) if sequence else x
        if isinstance(full, funcol.AsyncCollectiveTensor):
            full = full.wait()
        weights, biases = params[0::2], params[1::2]
        ctx.biases = tuple(b is not None for b in biases)
        ctx.save_for_backward(x, *weights)  # the input as given: a sequence shard under SP
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        x, *weights = ctx.saved_tensors
        group, tp = ctx.group, dist.get_world_size(ctx.group)
        if ctx.sequence:  # the input again, beside the input gradient's products
            stacked, gathering = _gather_sequence(x, group)
        shape = (*x.shape[:-2], x.shape[-2] * (tp if ctx.sequence else 1))
        grads = [g if g is not None else x.new_zeros((*shape, w.shape[0])) for g, w in zip(grads, weights)]
        # summed last product first, as autograd accumulates a tensor's gradients (the node made
        # last runs first): the same rounding as the linears run one by one
        dfull = sum(g @ w for g, w in reversed(list(zip(grads, weights))))
        if ctx.sequence:
            # The gathered input in the sequence's order, and rank r's gradient, the sum of its
            # sequence shard over the ranks: a reduce-scatter of the ranks' shards laid one after
            # another. Views at one sequence a micro-batch, copies beyond.
            b, h = dfull.shape[0], dfull.shape[-1]
            gathering.wait()
            rows = stacked.view(tp, b, -1, h).transpose(0, 1).reshape(-1, h)
            del stacked
            dfull = dfull.view(b, tp, -1, h).transpose(0, 1).reshape(tp * b, -1, h)
            dx = x.new_empty(x.shape)
            reducing = dist.reduce_scatter_tensor(dx, dfull, group=group, async_op=True)
        else:
            rows, dx = x.reshape(-1, x.shape[-1]), dfull
            reducing = dist.all_reduce(dx, group=group, async_op=True)
        dparams: list[torch.Tensor | None] = []
        for g, has_bias in zip(grads, ctx.biases):  # the weight gradients, beside the reduction
            g2 = g.reshape(-1, g.shape[-1])
            dparams += [g2.t() @ rows, g2.sum(0) if has_bias else None]
        reducing.wait()
        return (dx, None, None, *dparams)


def columns(owner: nn.Module, x: torch.Tensor, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """The outputs of ``linears`` on ``x``: as the linears compute them, or, where tensor
    parallelism marked ``owner`` (``mark``), as one ``_Columns`` over the group (``x`` then this
    rank's sequence shard under sequence parallelism, else the whole input)."""
    group = getattr(owner, "tp_group", None)
    if group is None:
        return tuple(linear(x) for linear in linears)
    if isinstance(x, DTensor):  # a sequence-parallel norm's output: this rank's shard
        x = x.to_local()
    params = [p for linear in linears for p in (_local(linear.weight), _local(linear.bias))]
    return _Columns.apply(x, group, owner.tp_sequence, *params)


def mark(owner: nn.Module, group: dist.ProcessGroup, *, sequence: bool) -> None:
    """Run ``owner``'s column-parallel linears through ``columns`` on ``group``; ``sequence``:
    its input comes as this rank's sequence shard."""
    owner.tp_group, owner.tp_sequence = group, sequence
