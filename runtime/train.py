"""The training loop of one rank: AdamW, warm-up + cosine learning rate, gradient clipping,
per-step metrics, checkpoints.

    # inside a process group (torchrun, or python -m partita.runtime.worker):
    from partita.plan import Plan
    from partita.runtime.train import TrainConfig, train
    summary = train(Plan.load("plan.yaml"), TrainConfig(steps=20))

``train`` decides nothing the plan does not say: the plan gives the meshes, the stage, every
layer's strategy, the micro-batching and the dtype; ``TrainConfig`` gives only what a plan
does not hold (steps, data, optimizer settings, checkpoints).
"""

from __future__ import annotations

import contextlib

import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from partita.errors import PartitaError
from partita.plan import Plan
from partita.runtime import checkpoint
from partita.runtime.data import TokenSource, check_data
from partita.runtime.memory import StepMemory
from partita.runtime.mesh import build_meshes
from partita.runtime.metrics import MetricsWriter, RunSummary, peak_flops, peak_memory_bytes, summarize
from partita.runtime.models import build_model, set_aux_loss_factor
from partita.runtime.parallelize import parallelize_stage
from partita.runtime.phases import PhaseTimer
from partita.runtime.schedule import MicroBatchRunner, PipelineRunner, loss_function, share_weight
from partita.runtime.tied import TiedWeights

log = logging.getLogger(__name__)
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 20
    data: str = "synthetic"  # or a path to a local text file (byte-level tokens)
    seed: int = 0  # model init and data
    lr: float = 1e-3
    warmup_steps: int | None = None  # None: a tenth of the steps, at least one
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    weight_decay: float = 0.1  # on matrices and embeddings only (not norms, not biases)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # on the global L2 norm over all stages
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: only at the end (when a directory is given)
    resume: bool = False
    metrics: str | None = None  # metrics.jsonl path, shared by all ranks
    memory_report: bool = False  # measure one step's memory by category (torch's memory trackers)
    run_id: str | None = None  # in every metrics record, so runs appending to one file stay apart
    init_from: str | None = None  # a Hugging Face model folder to start from (``hf_weights``), else random
    crash_after_step: int | None = None  # tests: exit abruptly after this many steps, as a kill would
    crash_rank: int | None = None  # tests: only this rank dies then, by SIGKILL; None: every rank exits

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 10)


MAX_SEED = 2**32 - 1
MAX_STEPS = 10**9  # far above any run (the longest published ones train for about a million steps)


def check_config(cfg: TrainConfig) -> None:
    """Refuse settings no run can train with, as one PartitaError naming the flag; the launcher
    calls it before any rank starts, and every rank again before its first collective."""
    if not 1 <= cfg.steps <= MAX_STEPS:
        raise PartitaError(f"--steps must be at least 1 and at most {MAX_STEPS:,}, got {cfg.steps:,}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise PartitaError(f"--lr must be a finite number > 0, got {cfg.lr}")
    if cfg.warmup_steps is not None and not 0 <= cfg.warmup_steps <= cfg.steps:
        raise PartitaError(f"--warmup-steps must be between 0 and --steps {cfg.steps}, got {cfg.warmup_steps}"
                           + ("; a longer warm-up never reaches --lr" if cfg.warmup_steps > cfg.steps else ""))
    if not 0 <= cfg.seed <= MAX_SEED:
        raise PartitaError(f"--seed must be between 0 and {MAX_SEED}, got {cfg.seed}")
    if cfg.checkpoint_every < 0:
        raise PartitaError(f"--checkpoint-every must be >= 0 (0: save at the end only), got {cfg.checkpoint_every}")
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        raise PartitaError(f"--checkpoint-every {cfg.checkpoint_every} needs --checkpoint-dir to save into")
    if cfg.resume and not cfg.checkpoint_dir:
        raise PartitaError("--resume needs --checkpoint-dir")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise PartitaError(f"--min-lr-ratio must be between 0 and 1, got {cfg.min_lr_ratio}")
    if not (math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0):
        raise PartitaError(f"--weight-decay must be a finite number >= 0, got {cfg.weight_decay}")
    if not all(0 <= b < 1 for b in cfg.betas):
        raise PartitaError(f"--betas must be two numbers in [0, 1), got {','.join(map(str, cfg.betas))}")
    if not (math.isfinite(cfg.grad_clip) and cfg.grad_clip > 0):
        raise PartitaError(f"--grad-clip must be a finite number > 0, got {cfg.grad_clip}")


def checkpoint_record(plan: Plan, cfg: TrainConfig, step: int) -> checkpoint.CheckpointRecord:
    """What a checkpoint says about the run that wrote it, checked before a resume."""
    return checkpoint.CheckpointRecord(step=step, model_name=str(plan.model.get("name")),
                                       model_fingerprint=plan.model_fingerprint, steps=cfg.steps, lr=cfg.lr,
                                       warmup_steps=cfg.warmup, min_lr_ratio=cfg.min_lr_ratio, data=cfg.data,
                                       seed=cfg.seed, global_batch=plan.global_batch, seq_len=plan.seq_len)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - 1 - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on tensors of two or more dimensions. Parameters are grouped by
    how they are distributed, so fused per-group updates never mix device meshes."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        key = (p.ndim >= 2, _dist_key(p))
        groups.setdefault(key, []).append(p)
    return torch.optim.AdamW([{"params": ps, "weight_decay": cfg.weight_decay if decay else 0.0}
                              for (decay, _), ps in groups.items()], lr=cfg.lr, betas=cfg.betas, eps=1e-8)


def _dist_key(t: torch.Tensor) -> tuple:
    if isinstance(t, DTensor):
        return (id(t.device_mesh), tuple(str(p) for p in t.placements))
    return ()


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, pp_group: dist.ProcessGroup | None,
                   excluded: set[int] = frozenset(), experts: set[int] = frozenset(),
                   ep_group: dist.ProcessGroup | None = None) -> float:
    """Clip to a global L2 norm over every gradient of every stage; returns the norm before
    clipping. DTensor gradients are grouped by mesh and placements so each group's norm is one
    reduction; pipeline stages hold disjoint parameters, so their squares add over ``pp``. The
    parameters whose ids are ``excluded`` (a tied weight's second copy) are clipped but not
    counted. Under expert parallelism the ranks of an ep group hold different experts (ids
    ``experts``): their squares add over ``ep_group``."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params if id(p) not in excluded]
    copies = [p.grad for p in params if id(p) in excluded]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if id(p) not in excluded:
            groups.setdefault((id(p) in experts, *_dist_key(p.grad)), []).append(p.grad)
    device = grads[0].device if grads else torch.device("cpu")
    total_sq = torch.zeros((), device=device, dtype=torch.float32)
    expert_sq = torch.zeros((), device=device, dtype=torch.float32)
    for key, group in groups.items():
        norms = torch.stack(torch._foreach_norm(group, 2.0))
        norm = torch.linalg.vector_norm(norms.float(), 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if key[0]:
            expert_sq += norm.to(device) ** 2
        else:
            total_sq += norm.to(device) ** 2
    if ep_group is not None:
        dist.all_reduce(expert_sq, group=ep_group)
    total_sq += expert_sq
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    total = float(total_sq.sqrt())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for group in groups.values():
            torch._foreach_mul_(group, coef)
        for g in copies:
            g.mul_(coef)
    return total


class StepClock:
    """Wall time of a step, with the device drained at both ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class Trainer:
    """This rank's part of a plan, set up in ``__init__`` (meshes, model, optimizer, schedule,
    resume) and trained by ``fit``. The default process group must be initialised."""

    def __init__(self, plan: Plan, cfg: TrainConfig, *, device: torch.device | None = None) -> None:
        self.plan, self.cfg = plan, cfg
        self.spec = spec = plan.model_spec
        # Input no run can train with is refused here, before the first collective (every rank
        # reads the same files, so every rank refuses alike); `partita launch` checked it already.
        check_config(cfg)
        check_data(cfg.data, vocab=spec.vocab, seq_len=plan.seq_len)
        resume_from = None
        if cfg.resume and cfg.checkpoint_dir:
            resume_from, _ = checkpoint.check_resume(cfg.checkpoint_dir, checkpoint_record(plan, cfg, 0))
        self.device = device = device or _default_device(plan)
        self.meshes = build_meshes(plan, device.type)
        compute_dtype = COMPUTE_DTYPES[plan.dtype]
        mixed = compute_dtype != torch.float32
        mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if mixed else None
        # FSDP2 over one rank shards and reduces nothing; it stays only where it brings mixed precision.
        # cp ranks hold partial gradients (averaged over dp x cp), and so do the tp ranks of a MoE
        use_fsdp = plan.dp * plan.cp > 1 or mixed or (spec.is_moe and plan.tp > 1)

        self.model = build_model(spec)  # meta: nothing is allocated for layers this rank does not own
        init = None
        if cfg.init_from and resume_from is None:  # a resume's checkpoint holds the weights
            from partita.runtime.hf_weights import load_into

            init = lambda model: load_into(model, cfg.init_from, spec)  # noqa: E731
        units = parallelize_stage(self.model, plan, self.meshes, device=device, seed=cfg.seed, mp_policy=mp_policy,
                                  use_fsdp=use_fsdp, init=init)
        self.optimizer = make_optimizer(self.model, cfg)
        # Expert parallelism: the experts' ids and the ep group, whose ranks hold different experts.
        self._experts: tuple[set[int], dist.ProcessGroup | None] = (frozenset(), None)
        if self.meshes.expert_parallel:
            ids = {id(p) for n, p in self.model.named_parameters() if ".experts." in n}
            self._experts = (ids, self.meshes.ep.get_group())
        # fp16 needs loss scaling; the scaler agrees on overflow across all ranks (all-reduce).
        self.scaler = ShardedGradScaler(device=device.type) if plan.dtype == "fp16" else None
        if self.scaler is not None:
            self.scaler.scale(torch.ones((), device=device))  # creates its scale tensor (the runners scale by value)
        loss = loss_function(plan, self.meshes)
        self.tied = TiedWeights(self.model, plan, self.meshes.place)
        self.timer = PhaseTimer(device)
        if plan.pp > 1:
            self.runner = PipelineRunner(self.model, units, plan, self.meshes, device=device,
                                         activation_dtype=compute_dtype, loss=loss, timer=self.timer)
        else:
            own = plan.replica_micro_batches()[self.meshes.place.dp_index]  # this replica's batch share
            self.runner = MicroBatchRunner(self.model, units, own, loss, timer=self.timer,
                                           loss_factor=share_weight(plan, self.meshes.place.dp_index) / plan.num_micro_batches)
        self.start_step = 0
        if cfg.resume and cfg.checkpoint_dir:
            if resume_from is None:
                log.warning("--resume: no checkpoint in %s; starting from step 0", cfg.checkpoint_dir)
            else:
                self.start_step = checkpoint.load(cfg.checkpoint_dir, resume_from, self.model, self.optimizer,
                                                  self.scaler)

    def _loss_factor(self) -> float:
        """What the runner multiplies each micro-batch's loss by (before any fp16 loss scale)."""
        if isinstance(self.runner, PipelineRunner):
            return self.runner.weight  # the runner divides the gradients by the micro-batch count after
        return self.runner.loss_factor

    def fit(self) -> RunSummary | None:
        """Train to ``cfg.steps``. Returns the run summary on rank 0, None elsewhere."""
        plan, cfg, device, place = self.plan, self.cfg, self.device, self.meshes.place
        data = TokenSource(cfg.data, vocab=self.spec.vocab, seq_len=plan.seq_len, global_batch=plan.global_batch,
                           seed=cfg.seed)
        writer = MetricsWriter(cfg.metrics)
        clock = StepClock(device)
        tokens_per_step = plan.global_batch * plan.seq_len
        flops_per_step = self.spec.train_flops_per_token(plan.seq_len) * tokens_per_step
        peak = peak_flops(plan)
        pp_group = self.meshes.pp.get_group() if plan.pp > 1 else None
        # The stage holding the head computes the loss: the last one, or under zbv the first.
        reports_loss = "head" in place.stage.layer_names and place.tp_index == 0
        self.step_times: list[float] = []  # this session's steps, for callers that time the runtime
        # The memory report tracks the session's second step (the optimizer's state exists by
        # then), or its only one.
        tracked_step = min(self.start_step + 1, cfg.steps - 1) if cfg.memory_report else None
        self.measured_memory: dict[str, int] | None = None
        self.measured_moments: dict[str, dict[str, int]] = {}  # each layer's forward and backward peak
        step_times, losses = self.step_times, []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        for step in range(self.start_step, cfg.steps):
            inputs, targets = data.batch(step, rows=plan.replica_rows(place.dp_index))
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            inputs, targets = context_shards(plan, place, inputs, targets)
            lr = lr_at(step, cfg)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            t0, delay0 = clock.now(), self.timer.delay.seconds()
            def one_step() -> tuple[torch.Tensor | None, float]:
                scale = self.scaler.get_scale() if self.scaler else 1.0
                if self.spec.is_moe:  # the balancing loss is scaled as the micro-batches' losses are
                    # x cp: each cp rank's loss is its own tokens' mean, its gradient averaged over cp
                    set_aux_loss_factor(self.model, scale * self._loss_factor() * plan.cp)
                with self._ring_context(inputs, targets):
                    loss_sum = self.runner.run(inputs, targets, scale)
                return loss_sum, self._update(pp_group)

            if step == tracked_step:
                memory = StepMemory(self.model, self.optimizer, device, self.runner.receive_buffers())
                loss_sum, grad_norm = memory.run(one_step)
                self.measured_memory = memory.peak
                self.measured_moments = memory.moments
            else:
                loss_sum, grad_norm = one_step()
            loss = _global_loss(loss_sum if reports_loss else None, plan, place.dp_index, device)
            elapsed = clock.now() - t0
            phases = self.timer.take()  # this step's forward/backward per micro-batch, and its optimizer
            phases["run_delay_s"] = self.timer.delay.seconds() - delay0  # waiting for a core (CPU ranks)
            step_times.append(elapsed)
            losses.append(loss)
            record = {"run_id": cfg.run_id, "step": step + 1, "rank": place.rank, "stage": place.stage.index, "loss": loss, "lr": lr,
                      "grad_norm": grad_norm, "step_time_s": elapsed, "tokens_per_s": tokens_per_step / elapsed,
                      "mfu": flops_per_step / elapsed / peak if peak else None,
                      "peak_memory_bytes": peak_memory_bytes(device), **phases}
            writer.write(record)
            log.info("step %d/%d  loss %.4f  %.1f ms  %.0f tok/s  MFU %.2f%%  peak %.0f MiB", step + 1, cfg.steps,
                     loss, elapsed * 1e3, record["tokens_per_s"], 100 * (record["mfu"] or 0),
                     record["peak_memory_bytes"] / 2**20)
            done = step + 1
            if cfg.checkpoint_dir and ((cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.steps):
                checkpoint.save(cfg.checkpoint_dir, done, self.model, self.optimizer, self.scaler,
                                record=checkpoint_record(plan, cfg, done))
            if cfg.crash_after_step is not None and done == cfg.crash_after_step:
                if cfg.crash_rank is None:
                    os._exit(17)  # tests: die like a killed process, without cleanup
                if dist.get_rank() == cfg.crash_rank:
                    os.kill(os.getpid(), signal.SIGKILL)
        writer.close()
        from partita.runtime.commprobe import probe_collectives, probe_op_overhead

        collectives = probe_collectives(plan, self.meshes, device)
        op_overhead = probe_op_overhead(plan, device)
        return _gather_summary(step_times, losses, plan, place, device, self.measured_memory, cfg.run_id,
                               collectives, op_overhead)


    def _ring_context(self, inputs: torch.Tensor, targets: torch.Tensor):
        """Ring plans run each step inside torch's ``context_parallel``, which shards the batch
        (head_tail) in place and routes attention to the ring; a no-op otherwise."""
        if self.plan.cp == 1 or self.plan.cp_variant != "ring":
            return contextlib.nullcontext()
        from partita.runtime.context import ring_attention

        return ring_attention(self.meshes.cp, [inputs, targets])

    def _update(self, pp_group: dist.ProcessGroup | None) -> float:
        """Clip and step; under fp16 unscale first and skip the step on overflow (every rank alike)."""
        # The optimizer's own time is recorded (the clip's all-reduce over stages would add the
        # pipeline's skew to it).
        if self.scaler is None:
            self.tied.sync_gradients()
            grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.grad_clip, pp_group, self.tied.norm_excluded(),
                                       *self._experts)
            with self.timer.span("optimizer"):
                self.optimizer.step()
        else:
            self.scaler.unscale_(self.optimizer)
            self.tied.sync_gradients()
            grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.grad_clip, pp_group, self.tied.norm_excluded(),
                                       *self._experts)
            with self.timer.span("optimizer"):
                self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm


def context_shards(plan: Plan, place, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens of each sequence under all-to-all or all-gather context parallelism (the ring's
    ``context_parallel`` shards them itself, head_tail, inside ``Trainer._ring_context``)."""
    if plan.cp == 1 or plan.cp_variant == "ring":
        return inputs, targets
    from partita.runtime.context import shard_sequence
    from partita.runtime.parallelize import CP_LAYOUT

    return tuple(shard_sequence(t, cp=plan.cp, index=place.cp_index, layout=CP_LAYOUT[plan.cp_variant])
                 for t in (inputs, targets))


def train(plan: Plan, cfg: TrainConfig, *, device: torch.device | None = None) -> RunSummary | None:
    """Train this rank's part of ``plan``; the run summary on rank 0, None elsewhere."""
    return Trainer(plan, cfg, device=device).fit()


def _global_loss(loss_sum: torch.Tensor | None, plan: Plan, dp_index: int, device: torch.device) -> float:
    """Mean loss over the global batch, known to every rank: the last stage's tensor-rank-0
    ranks contribute their micro-batch losses (each the mean over its rows, so weighted by the
    replica's micro-batch size), everyone else zero."""
    value = torch.zeros(1, dtype=torch.float64, device=device)
    if loss_sum is not None:  # under context parallelism each of the cp ranks has the mean of its equal shard
        value += loss_sum.to(torch.float64) * plan.replica_micro_batch_sizes()[dp_index] / plan.cp
    dist.all_reduce(value)
    return float(value) / plan.global_batch


def _gather_summary(step_times: list[float], losses: list[float], plan: Plan, place, device: torch.device,
                    measured_memory: dict[str, int] | None, run_id: str | None = None,
                    collectives: list | None = None, op_overhead_s: float | None = None) -> RunSummary | None:
    peaks: list = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, (place.stage.index, peak_memory_bytes(device), measured_memory))
    if dist.get_rank() != 0:
        return None
    stage_peaks = [max(b for s, b, _ in peaks if s == i) for i in range(plan.pp)]
    memory = None
    if measured_memory is not None:
        memory = [{"rank": r, "stage": s, "bytes": m} for r, (s, _, m) in enumerate(peaks)]
    return summarize(step_times, stage_peaks, "allocated" if device.type == "cuda" else "peak RSS", losses, plan,
                     memory, run_id=run_id, collectives=collectives, op_overhead_s=op_overhead_s)


def _default_device(plan: Plan) -> torch.device:
    if plan.cluster_spec.is_cpu:
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)
