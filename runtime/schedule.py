"""One optimizer step's forward and backward over the plan's micro-batches.

Two runners, one interface (``run(inputs, targets, loss_scale) -> summed micro-batch losses as a
0-dim tensor, or None``; ``loss_scale`` is fp16's loss scaling, 1.0 otherwise, and the losses
returned are unscaled; nothing here waits for the device):

* ``MicroBatchRunner`` (pp = 1): gradient accumulation over the micro-batches.
* ``PipelineRunner`` (pp > 1): ``torch.distributed.pipelining``'s 1F1B schedule over this
  rank's ``PipelineStage``; the first stage feeds tokens, the last computes the loss.

Both leave gradients as the mean over the rank's micro-batches (with uneven batch shares, the
sum over them in units of the global batch: ``share_weight``), and both set each FSDP2 unit's
gradient policy per micro-batch (``set_gradient_sync``): the pipeline runner does it from a
hook on the stage output, which fires when that micro-batch's backward reaches the stage.
Neither keeps a micro-batch's logits beyond its own loss and backward (the pipeline schedule
runs with ``return_outputs=False``), and a vocab-parallel head's logits are never gathered
(``LossFunction``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from partita.plan import Plan
from partita.runtime.mesh import Meshes
from partita.runtime.parallelize import ShardedLayer, set_gradient_sync
from partita.runtime.phases import PhaseTimer


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


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


def share_weight(plan: Plan) -> float:
    """The factor on every micro-batch's loss when the runners divide gradients by the plan's
    ``num_micro_batches`` M (the largest share, so the same on every replica) rather than by a
    replica's own count: dp * M / N, N the micro-batches of all replicas. Replica d then holds
    (dp / N) sum_m g_dm, and FSDP2's average over the dp replicas gives (1/N) sum g, the full
    batch's mean gradient; a replica's weight grows with its share. Exactly 1.0 with equal
    shares (dp * M = N). The divisor must be common to all replicas because the pipeline
    schedules divide after the last micro-batch's backward, i.e. after the reduction."""
    return plan.dp * plan.num_micro_batches / sum(plan.replica_micro_batches())


class MicroBatchRunner:
    def receive_buffers(self) -> list[torch.Tensor]:
        return []

    def __init__(self, model: nn.Module, units: list[ShardedLayer], num_micro_batches: int,
                 loss: LossFunction | None = None, timer: PhaseTimer | None = None,
                 loss_factor: float | None = None) -> None:
        """``loss_factor``: what each micro-batch's loss is multiplied by before its backward;
        by default 1 / num_micro_batches (the mean), with uneven shares
        ``share_weight(plan) / plan.num_micro_batches``."""
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
                with span("backward"):
                    (loss * (loss_scale * self.loss_factor)).backward()
                total += loss.detach()
        return total


class _StageModule(nn.Module):
    """The stage's model as the schedule sees it. Not an FSDP module itself, so the schedule
    runs plain autograd and the plan's per-layer ZeRO policy (set here) stays in force."""

    def __init__(self, model: nn.Module, units: list[ShardedLayer], num_micro_batches: int,
                 only: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.model, self.units, self.n, self.only = model, units, num_micro_batches, only
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x, only=self.only) if self.only is not None else self.model(x)
        if self.units and out.requires_grad:
            index = self.forwards
            self.forwards += 1
            out.register_hook(lambda grad: self._before_backward(index, grad))
        return out

    def _before_backward(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        set_gradient_sync(self.units, last_micro_batch=index == self.n - 1)
        return grad


class PipelineRunner:
    def __init__(self, model: nn.Module, units: list[ShardedLayer], plan: Plan, meshes: Meshes, *,
                 device: torch.device, activation_dtype: torch.dtype, loss: LossFunction,
                 timer: PhaseTimer | None = None) -> None:
        stage = meshes.place.stage
        self.is_first, self.is_last = stage.index == 0, stage.index == plan.pp - 1
        # This replica's own pipeline runs its own number of micro-batches (its batch share); the
        # gradients are divided by the plan's count, the same on every replica (``share_weight``).
        self.n = plan.replica_micro_batches()[meshes.place.dp_index]
        self.mean_over = plan.num_micro_batches
        self.weight = share_weight(plan)
        self.loss = loss
        spec_hidden = int(plan.model["hidden"])
        vocab = int(plan.model["vocab"]) // (loss.vocab_mesh.size() if loss.vocab_mesh is not None else 1)
        b, s = plan.micro_batch, plan.seq_len
        # Static shapes: the schedule needs no shape-inference pass (which would run the stage
        # once more on empty tensors).
        def meta(*shape: int, dtype: torch.dtype = activation_dtype) -> torch.Tensor:
            # requires_grad marks what carries gradients between stages (everything but tokens)
            return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=dtype.is_floating_point)

        # One pipeline stage per virtual stage this rank runs (one under 1F1B): virtual stage c
        # of plan stage i is torch's stage c * pp + i; each runs only its own layers.
        chunks = stage.chunk_layers()
        n_stages = plan.pp * len(chunks)
        # Under an interleaved schedule each virtual stage sets the gradient policy of its own
        # layers' FSDP units; the root unit (a tied embedding or head, if any) goes with the
        # virtual stage that holds it.
        root_chunk = next((c for c, ls in enumerate(chunks) if {l.name for l in ls} & {"embed", "head"}), 0)
        self.model = model
        self.modules, self.stages = [], []
        for c, layers in enumerate(chunks):
            if len(chunks) > 1:
                names = {l.name for l in layers}
                own = [u for u in units if u.name in names or (u.name == "" and c == root_chunk)]
                module = _StageModule(model, own, self.n, only=tuple(sorted(names)))
            else:
                module = _StageModule(model, units, self.n)
            index = c * plan.pp + stage.index
            first, last = index == 0, index == n_stages - 1
            inputs = meta(b, s, dtype=torch.int64) if first else meta(b, s, spec_hidden)
            outputs = meta(b, s, vocab) if last else meta(b, s, spec_hidden)
            self.modules.append(module)
            self.stages.append(PipelineStage(module, index, n_stages, device, input_args=inputs, output_args=outputs,
                                             group=meshes.pp.get_group()))
        self.loss_scale = 1.0
        self.timer = timer or PhaseTimer(device)
        self._time_stage_chunks()
        # The runner divides the gradients once after the step, not torch: torch would divide by
        # this replica's own count, and under an interleaved schedule once per virtual stage
        # (each one's module wraps the whole model).
        if plan.schedule == "interleaved-1f1b":
            self.schedule = ScheduleInterleaved1F1B(self.stages, n_microbatches=self.n, loss_fn=self._scaled_loss,
                                                    scale_grads=False)
        else:
            self.schedule = Schedule1F1B(self.stages[0], n_microbatches=self.n, loss_fn=self._scaled_loss,
                                         scale_grads=False)

    def _time_stage_chunks(self) -> None:
        """Time each micro-batch's forward and backward as the schedule runs them on this stage
        (its receives are waited for before, its sends are started after)."""
        for stage in self.stages:
            for method, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward")):
                inner = getattr(stage, method)

                def timed(*args, _inner=inner, _phase=phase, **kwargs):
                    with self.timer.span(_phase):
                        return _inner(*args, **kwargs)

                setattr(stage, method, timed)

    def _scaled_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.timer.span("loss"):
            return self.loss(logits, targets) * (self.loss_scale * self.weight)

    def receive_buffers(self) -> list[torch.Tensor]:
        """The schedule's receive buffers (one per micro-batch for activations on every stage but
        the first, and for gradients on every stage but the last), allocated at the first step
        and kept."""
        infos = [info for stage in self.stages
                 for info in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())]
        return [i.buffer for info in infos for i in info if isinstance(getattr(i, "buffer", None), torch.Tensor)]

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
            if self.is_first:
                self.schedule.step(inputs, return_outputs=False)
            elif self.is_last:
                self.schedule.step(target=targets, losses=losses, return_outputs=False)
            else:
                self.schedule.step(return_outputs=False)
        for module in self.modules:
            if module.units and module.forwards != self.n:
                raise RuntimeError(f"pipeline stage ran {module.forwards} forwards for {self.n} micro-batches")
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(self.mean_over)
        return torch.stack([l.detach() for l in losses]).sum() / (loss_scale * self.weight) if self.is_last else None
