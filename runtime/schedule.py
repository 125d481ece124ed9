"""One optimizer step's forward and backward over the plan's micro-batches.

Two runners, one interface (``run(inputs, targets, loss_scale) -> summed micro-batch losses as a
0-dim tensor, or None``; ``loss_scale`` is fp16's loss scaling, 1.0 otherwise, and the losses
returned are unscaled; nothing here waits for the device):

* ``MicroBatchRunner`` (pp = 1): gradient accumulation over the micro-batches.
* ``PipelineRunner`` (pp > 1): the plan's schedule from ``torch.distributed.pipelining``
  (1F1B, interleaved 1F1B, interleaved zero-bubble or ZB-V) over this rank's
  ``PipelineStage``s; the stage holding the embedding feeds tokens, the one holding the head
  computes the loss.

Both leave gradients as the mean over the rank's micro-batches (with uneven batch shares, the
sum over them in units of the global batch: ``share_weight``), and both set each FSDP2 unit's
gradient policy per micro-batch (``set_gradient_sync``): the pipeline runner does it from a
hook on the stage output, which fires when that micro-batch's backward reaches the stage
(under a zero-bubble schedule once for the whole step: ``reduce_after_split_backward``).
Neither keeps a micro-batch's logits beyond its own loss and backward (the pipeline schedule
runs with ``return_outputs=False``), the pipeline's receive buffers hold memory only while a
transfer needs them (``ReceiveOnDemandStage``), the loss is computed a chunk of tokens at a time
(``lm_loss``: no fp32 copy of the logits), and a vocab-parallel head's logits are never gathered
(``LossFunction``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from partita.plan import Plan
from partita.runtime.mesh import Meshes
from partita.runtime.parallelize import ShardedLayer, set_gradient_sync
from partita.runtime.phases import PhaseTimer
from partita.units import loss_chunk_tokens


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of logits [t, V] (any float dtype) against targets [t], computed in
    fp32 one chunk of tokens at a time: the forward keeps the logits as given (the caller's own
    tensor, no copy), each token's fp32 log-sum-exp and the targets; the backward recomputes
    each chunk's softmax in fp32 and writes its gradient straight into a gradient of the
    logits' dtype. No fp32 copy, log-softmax or gradient of the whole vocabulary is made."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t, vocab = logits.shape
        step = loss_chunk_tokens(t, vocab)
        lse = torch.empty(t, dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, t, step):
            part = logits[start:start + step].float()
            lse[start:start + step] = torch.logsumexp(part, dim=1)
            picked = part.gather(1, targets[start:start + step, None]).squeeze(1)
            total += (lse[start:start + step] - picked).sum()
            del part
        ctx.save_for_backward(logits, targets, lse)
        return total / t

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        t, vocab = logits.shape
        step = loss_chunk_tokens(t, vocab)
        out = torch.empty_like(logits)
        scale = grad.float() / t
        for start in range(0, t, step):
            part = logits[start:start + step].to(torch.float32, copy=True)  # never the saved logits themselves
            part.sub_(lse[start:start + step, None]).exp_()  # the softmax, in place
            part.scatter_add_(1, targets[start:start + step, None],
                              torch.full((part.shape[0], 1), -1.0, dtype=part.dtype, device=part.device))
            out[start:start + step] = part.mul_(scale)
            del part
        return out, None


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32 whatever the compute dtype, a chunk of
    tokens at a time (``ChunkedCrossEntropy``: no fp32 copy of the whole vocabulary's logits is
    made or kept; the same loss and gradients as ``F.cross_entropy(logits.float(), targets)``,
    tests/test_chunked_loss.py)."""
    return ChunkedCrossEntropy.apply(logits.flatten(0, 1), targets.flatten())


class LossFunction:
    """``lm_loss`` on this rank's logits. Under a vocab-parallel head (``vocab_mesh``: the
    tensor mesh) each rank holds the logits of its vocab/tp slice, and torch's ``loss_parallel``
    computes the exact loss from the slices (all-reduces of each token's max, sum of
    exponentials and target logit): no rank gathers the full vocabulary. The loss and its
    backward must both run inside ``context()``."""

    def __init__(self, vocab_mesh: DeviceMesh | None = None) -> None:
        self.vocab_mesh = vocab_mesh

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.vocab_mesh is None:
            return lm_loss(logits, targets)
        # Inside context() (entered by the runner, not here: the context does not nest).
        shards = DTensor.from_local(logits.flatten(0, 1).float(), self.vocab_mesh, [Shard(1)], run_check=False)
        return F.cross_entropy(shards, targets.flatten()).to_local()

    def context(self) -> AbstractContextManager:
        return loss_parallel() if self.vocab_mesh is not None else nullcontext()


def loss_function(plan: Plan, meshes: Meshes) -> LossFunction:
    """The loss for this rank's stage: vocab-parallel when the plan splits the head."""
    head = next((l for l in meshes.place.stage.layers if l.name == "head"), None)
    split = head is not None and head.tensor_parallel > 1
    return LossFunction(meshes.tp if split else None)


def share_weight(plan: Plan, dp_index: int) -> float:
    """The factor on every micro-batch's loss of replica ``dp_index`` when the runners divide
    gradients by the plan's ``num_micro_batches`` M (the largest share, so the same on every
    replica) rather than by a replica's own count: dp * M * b_d / G, b_d the replica's
    micro-batch size and G the global batch's rows. Each micro-batch's loss is the mean over its
    b_d rows, so replica d then holds (dp / G) sum_m b_d g_dm, and FSDP2's average over the dp
    replicas gives the full batch's mean gradient; a replica's weight grows with its share (more
    micro-batches, or larger ones). Exactly 1.0 with equal shares (dp * M * b = G). The divisor
    must be common to all replicas because the pipeline schedules divide after the last
    micro-batch's backward, i.e. after the reduction."""
    return plan.dp * plan.num_micro_batches * plan.replica_micro_batch_sizes()[dp_index] / plan.global_batch


class MicroBatchRunner:
    def receive_buffers(self) -> list[torch.Tensor]:
        return []

    def receive_peak_bytes(self) -> int:
        return 0

    def __init__(self, model: nn.Module, units: list[ShardedLayer], num_micro_batches: int,
                 loss: LossFunction | None = None, timer: PhaseTimer | None = None,
                 loss_factor: float | None = None) -> None:
        """``loss_factor``: what each micro-batch's loss is multiplied by before its backward;
        by default 1 / num_micro_batches (the mean), with uneven shares
        ``share_weight(plan, dp_index) / plan.num_micro_batches``."""
        self.model, self.units, self.n = model, units, num_micro_batches
        self.loss_factor = loss_factor if loss_factor is not None else 1 / num_micro_batches
        self.loss = loss or LossFunction()
        self.timer = timer or PhaseTimer(torch.device("cpu"))

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, loss_scale: float = 1.0) -> torch.Tensor:
        total = torch.zeros((), device=inputs.device)
        span = self.timer.span
        with self.loss.context():
            for i, (x, y) in enumerate(zip(inputs.chunk(self.n), targets.chunk(self.n))):
                set_gradient_sync(self.units, last_micro_batch=i == self.n - 1)
                with span("forward"):
                    logits = self.model(x)
                with span("loss"):
                    loss = self.loss(logits, y)
                del logits  # held by the loss alone: freed by its backward, not kept into the next forward
                with span("backward"):
                    (loss * (loss_scale * self.loss_factor)).backward()
                total += loss.detach()
        return total


# The schedules that run several stages per rank, by the plan's name (search/schedules.py).
MULTI_STAGE = {
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "interleaved-zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
# The schedules that split a stage's backward into its input gradient (I) and its weight
# gradient (W), run later to fill the pipeline's bubble.
ZERO_BUBBLE = ("interleaved-zb", "zbv")


class ReceiveOnDemandStage(PipelineStage):
    """A ``PipelineStage`` whose receive buffers hold memory only while a transfer needs them.

    ``torch.distributed.pipelining`` allocates one receive buffer per micro-batch and direction
    when a step first runs and keeps them all for good: a stage of an interleaved schedule with
    many micro-batches holds gigabytes of buffers that no micro-batch in flight uses. Here each
    buffer is allocated when its receive is posted (``get_fwd_recv_ops``, ``get_bwd_recv_ops``)
    and let go of once the chunk that reads it has run: a received activation is then the stage
    input the schedule keeps for that micro-batch's backward (its first block's saved input,
    freed with it), and a received gradient lives through its backward only. In between, a
    buffer is a meta tensor of its shape, dtype and ``requires_grad``, which allocates nothing.
    Only the stage's public per-chunk methods and its ``args_recv_info`` / ``grad_recv_info``
    are relied on (their ``buffer`` attribute), and the two ``_prepare_*_infra`` hooks that
    allocate the buffers when the first step starts: on a torch whose hooks are named otherwise
    the first step's buffers stay until each is used once."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._held: dict[int, int] = {}  # id(receive info) -> bytes of the buffer allocated for it here
        self.receive_peak_bytes = 0  # the most bytes this stage's receive buffers held at once

    def _prepare_forward_infra(self, *args, **kwargs):
        out = super()._prepare_forward_infra(*args, **kwargs)
        for infos in self.args_recv_info.values():
            self._release(infos)
        return out

    def _prepare_backward_infra(self, *args, **kwargs):
        out = super()._prepare_backward_infra(*args, **kwargs)
        for infos in self.grad_recv_info.values():
            self._release(infos)
        return out

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        self._allocate(self.args_recv_info.get(fwd_chunk_id, ()))
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        self._allocate(self.grad_recv_info.get(bwd_chunk_id, ()))
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self._release(self.args_recv_info.get(fwd_chunk_id, ()))

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        try:
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        finally:
            self._release(self.grad_recv_info.get(bwd_chunk_id, ()))

    def held_receive_buffers(self) -> list[torch.Tensor]:
        """The receive buffers that hold memory now."""
        infos = (*self.args_recv_info.values(), *self.grad_recv_info.values())
        return [i.buffer for info in infos for i in info
                if isinstance(getattr(i, "buffer", None), torch.Tensor) and i.buffer.device.type != "meta"]

    def _allocate(self, infos) -> None:
        """Give each released receive buffer memory again, for the receive about to be posted."""
        for info in infos:
            buffer = getattr(info, "buffer", None)
            if isinstance(buffer, torch.Tensor) and buffer.device.type == "meta":
                info.buffer = torch.empty_like(buffer, device=self.device).requires_grad_(buffer.requires_grad)
                self._held[id(info)] = info.buffer.untyped_storage().nbytes()
        self.receive_peak_bytes = max(self.receive_peak_bytes, sum(self._held.values()))

    def _release(self, infos) -> None:
        """Replace each received tensor by a meta tensor like it (whoever still uses the tensor,
        the schedule's forward cache or autograd, keeps it alive; nothing else does)."""
        for info in infos:
            buffer = getattr(info, "buffer", None)
            if isinstance(buffer, torch.Tensor) and buffer.device.type != "meta":
                info.buffer = torch.empty_like(buffer, device="meta").requires_grad_(buffer.requires_grad)
            self._held.pop(id(info), None)


class _StageModule(nn.Module):
    """The stage's model as the schedule sees it. Not an FSDP module itself, so the schedule
    runs plain autograd and the plan's per-layer ZeRO policy (set here) stays in force."""

    def __init__(self, model: nn.Module, units: list[ShardedLayer], num_micro_batches: int,
                 only: tuple[str, ...] | None = None, split_backward: bool = False) -> None:
        super().__init__()
        self.model, self.units, self.n, self.only = model, units, num_micro_batches, only
        self.split_backward = split_backward
        self.forwards = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_backward:
            # The input-gradient pass is ``autograd.grad`` to the received tensor, a leaf, and
            # torch's module tracker (``--memory-report``) puts a backward hook on every
            # module's inputs, which ``autograd.grad`` refuses on a leaf. This glue module takes
            # no hooks (FSDP2's are on the model's layers), so it is called plainly, and the
            # model gets the received tensor behind a view: no module sees the leaf.
            return self.forward(x.view_as(x) if x.is_leaf and x.requires_grad else x)
        return super().__call__(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x, only=self.only) if self.only is not None else self.model(x)
        if self.split_backward and out._is_view():
            # A zero-bubble schedule's input-gradient pass detaches the stage output in place,
            # which torch refuses for a view (a tensor-parallel stage whose last layer is not
            # sequence-parallel hands on ``to_local()``'s view of its shard, or of its whole
            # hidden states when the sequence does not split): one copy of the output.
            out = out.clone()
        if self.units and out.requires_grad:
            index = self.forwards
            self.forwards += 1
            if not self.split_backward:  # split: one policy for the whole step (``PipelineRunner.run``)
                out.register_hook(lambda grad: self._before_backward(index, grad))
        return out

    def _before_backward(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        set_gradient_sync(self.units, last_micro_batch=index == self.n - 1)
        return grad


def reduce_after_split_backward(units: list[ShardedLayer]) -> None:
    """The step's gradient reduction under a zero-bubble schedule. Its weight gradients (W)
    run outside the backward passes FSDP2 hooks into, some after the last of them, so the
    runner keeps every unit's policy at "not the last micro-batch" for the whole step (no
    reduction, no reshard: ZeRO 0/1 layers keep their gathered weights and accumulate full
    gradients, as at 1F1B's earlier micro-batches; the validator refuses ZeRO 2/3) and reduces
    once after it, as torch's pipelining does for an FSDP stage (``perform_reduce_grad``): with
    the last micro-batch's policy set, FSDP2's end-of-backward callback on the root runs every
    unit's post-backward (the reduction, then the reshard) and waits for them."""
    set_gradient_sync(units, last_micro_batch=True)
    root = next(u.module for u in units if u.name == "")
    fully_shard.state(root)._root_post_backward_final_callback()


class PipelineRunner:
    def __init__(self, model: nn.Module, units: list[ShardedLayer], plan: Plan, meshes: Meshes, *,
                 device: torch.device, activation_dtype: torch.dtype, loss: LossFunction,
                 timer: PhaseTimer | None = None) -> None:
        stage = meshes.place.stage
        # This replica's own pipeline runs its own number of micro-batches (its batch share); the
        # gradients are divided by the plan's count, the same on every replica (``share_weight``).
        self.n = plan.replica_micro_batches()[meshes.place.dp_index]
        self.mean_over = plan.num_micro_batches
        self.weight = share_weight(plan, meshes.place.dp_index)
        self.loss = loss
        spec_hidden = int(plan.model["hidden"])
        vocab = int(plan.model["vocab"]) // (loss.vocab_mesh.size() if loss.vocab_mesh is not None else 1)
        # this replica's size; under context parallelism a rank holds s/cp tokens of each sequence,
        # and under tensor parallelism it sends and receives its 1/tp shard of them between stages
        # when they split evenly (``Plan.boundary_split``, ``parallelize.boundary_layout``)
        b, s = plan.replica_micro_batch_sizes()[meshes.place.dp_index], plan.seq_len // plan.cp
        shard = s // plan.boundary_split
        # Static shapes: the schedule needs no shape-inference pass (which would run the stage
        # once more on empty tensors).
        def meta(*shape: int, dtype: torch.dtype = activation_dtype) -> torch.Tensor:
            # requires_grad marks what carries gradients between stages (everything but tokens)
            return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=dtype.is_floating_point)

        # One pipeline stage per virtual stage this rank runs (one under 1F1B): virtual stage c
        # of plan stage i is torch's stage ``plan.virtual_stage_index(i, c)`` (c * pp + i, or the
        # V of zbv); each runs only its own layers. Under zbv the first stage's ranks hold both
        # ends of the pipeline: they feed the tokens and compute the loss.
        chunks = stage.chunk_layers()
        n_stages = plan.pp * len(chunks)
        indices = [plan.virtual_stage_index(stage.index, c) for c in range(len(chunks))]
        self.is_first, self.is_last = 0 in indices, n_stages - 1 in indices
        # Under an interleaved schedule each virtual stage sets the gradient policy of its own
        # layers' FSDP units; the root unit (a tied embedding or head, if any) goes with the
        # virtual stage that holds it.
        root_chunk = next((c for c, ls in enumerate(chunks) if {l.name for l in ls} & {"embed", "head"}), 0)
        split = self.split_backward = plan.schedule in ZERO_BUBBLE
        self.units = units
        self.model = model
        self.modules, self.stages = [], []
        for c, layers in enumerate(chunks):
            if len(chunks) > 1:
                names = {l.name for l in layers}
                own = [u for u in units if u.name in names or (u.name == "" and c == root_chunk)]
                module = _StageModule(model, own, self.n, only=tuple(sorted(names)), split_backward=split)
            else:
                module = _StageModule(model, units, self.n)
            index = indices[c]
            first, last = index == 0, index == n_stages - 1
            inputs = meta(b, s, dtype=torch.int64) if first else meta(b, shard, spec_hidden)
            outputs = meta(b, s, vocab) if last else meta(b, shard, spec_hidden)
            self.modules.append(module)
            self.stages.append(ReceiveOnDemandStage(module, index, n_stages, device, input_args=inputs,
                                                    output_args=outputs, group=meshes.pp.get_group()))
        self.loss_scale = 1.0
        self.timer = timer or PhaseTimer(device)
        self._time_stage_chunks()
        # The runner divides the gradients once after the step, not torch: torch would divide by
        # this replica's own count, and under an interleaved schedule once per virtual stage
        # (each one's module wraps the whole model).
        if plan.schedule in MULTI_STAGE:
            self.schedule = MULTI_STAGE[plan.schedule](self.stages, n_microbatches=self.n, loss_fn=self._scaled_loss,
                                                       scale_grads=False)
        else:
            self.schedule = Schedule1F1B(self.stages[0], n_microbatches=self.n, loss_fn=self._scaled_loss,
                                         scale_grads=False)

    def _time_stage_chunks(self) -> None:
        """Time each micro-batch's forward and backward as the schedule runs them on this stage
        (its receives are waited for before, its sends are started after)."""
        for stage in self.stages:
            # Zero-bubble schedules split a backward in two: the input gradient (I, in
            # backward_one_chunk) and the weight gradient (W, later); both are backward.
            for method, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                                  ("backward_weight_one_chunk", "backward")):
                inner = getattr(stage, method)

                def timed(*args, _inner=inner, _phase=phase, **kwargs):
                    with self.timer.span(_phase):
                        return _inner(*args, **kwargs)

                setattr(stage, method, timed)

    def _scaled_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.timer.span("loss"):
            return self.loss(logits, targets) * (self.loss_scale * self.weight)

    def receive_buffers(self) -> list[torch.Tensor]:
        """The schedule's receive buffers that hold memory now (each b x s/tp x h under tensor
        parallelism: ``Plan.boundary_split``). Between steps none does: each is allocated when
        its receive is posted and let go of after its chunk (``ReceiveOnDemandStage``)."""
        return [t for stage in self.stages for t in stage.held_receive_buffers()]

    def receive_peak_bytes(self) -> int:
        """The most bytes the receive buffers held at once, summed over this rank's stages (a
        bound on the rank's own most: its stages' peaks need not coincide)."""
        return sum(stage.receive_peak_bytes for stage in self.stages)

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, loss_scale: float = 1.0) -> torch.Tensor | None:
        for module in self.modules:
            module.forwards = 0
            # Until a unit's own first backward sets its policy: FSDP2 ends every backward by
            # finishing all units, also another virtual stage's that have not run backward yet,
            # and with the last step's (or the default) policy it would reshard them, to be
            # gathered again by their next forward: once more per step, and under uneven batch
            # shares on some replicas only (a deadlock).
            set_gradient_sync(module.units, last_micro_batch=False)
        self.loss_scale = loss_scale
        losses: list[torch.Tensor] = []
        # return_outputs=False: the last stage keeps no micro-batch's logits after its backward.
        with self.loss.context():
            args = (inputs,) if self.is_first else ()
            last = dict(target=targets, losses=losses) if self.is_last else {}
            self.schedule.step(*args, **last, return_outputs=False)
        for module in self.modules:
            if module.units and module.forwards != self.n:
                raise RuntimeError(f"pipeline stage ran {module.forwards} forwards for {self.n} micro-batches")
        if self.split_backward and self.units:
            reduce_after_split_backward(self.units)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(self.mean_over)
        return torch.stack([l.detach() for l in losses]).sum() / (loss_scale * self.weight) if self.is_last else None
