"""One function evaluates any plan: predicted step time, its breakdown, each device's memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from partita.cluster import NodeGroup
from partita.devices import get_device
from partita.plan import LayerStrategy, Plan, Prediction, StageMemory
from partita.search.costs import (CostModel, LayerChoice, StageCost, interleaved_stage_cost, stage_cost,
                                  stage_cost_counts, step_time_s, with_receives)


@dataclass(frozen=True)
class Evaluation:
    step_time_s: float
    breakdown: dict[str, float]
    stages: tuple[StageCost, ...]

    @property
    def fits(self) -> bool:
        return all(s.peak_bytes <= s.capacity for s in self.stages)

    @property
    def peak_over_capacity(self) -> float:
        """Largest peak / capacity over stages (> 1: does not fit)."""
        return max(s.peak_bytes / s.capacity for s in self.stages)


def evaluate_layout(cm: CostModel, stages: Sequence[tuple[NodeGroup, Sequence[LayerStrategy]]], *, dp: int, tp: int,
                    micro_batch: int, num_micro_batches: int) -> Evaluation:
    """Evaluate stages given as (node group, layer strategies) in pipeline order."""
    pp = len(stages)
    costs = []
    for i, (group, layers) in enumerate(stages):
        next_group = stages[i + 1][0] if i + 1 < pp else None
        costs.append(stage_cost(cm, group, layers, stage=i, pp=pp, dp=dp, tp=tp, micro_batch=micro_batch,
                                num_micro_batches=num_micro_batches, next_group=next_group))
    costs = with_receives(costs)  # each stage also pays its side of the boundary before it
    step, breakdown = step_time_s(costs, num_micro_batches, step_overhead_s=cm.step_overhead_s)
    return Evaluation(step_time_s=step, breakdown=breakdown, stages=tuple(costs))


def evaluate_counts(cm: CostModel, stages: Sequence[tuple[NodeGroup, Mapping[LayerChoice, int]]], *, dp: int,
                    tp: int, micro_batch: int, num_micro_batches: int) -> Evaluation:
    """The same, with each stage given as counts of layer choices (the search's fast path)."""
    pp = len(stages)
    costs = [stage_cost_counts(cm, group, counts, stage=i, pp=pp, dp=dp, tp=tp, micro_batch=micro_batch,
                               num_micro_batches=num_micro_batches, next_group=stages[i + 1][0] if i + 1 < pp else None)
             for i, (group, counts) in enumerate(stages)]
    costs = with_receives(costs)  # each stage also pays its side of the boundary before it
    step, breakdown = step_time_s(costs, num_micro_batches, step_overhead_s=cm.step_overhead_s)
    return Evaluation(step_time_s=step, breakdown=breakdown, stages=tuple(costs))


def evaluate_plan(plan: Plan, cm: CostModel) -> Evaluation:
    if plan.virtual_stages > 1:
        return evaluate_interleaved(cm, [(cm.cluster.group(s.group), s.chunk_layers()) for s in plan.stages],
                                    dp=plan.dp, tp=plan.tp, micro_batch=plan.micro_batch,
                                    num_micro_batches=plan.num_micro_batches, schedule=plan.schedule)
    stages = [(cm.cluster.group(s.group), s.layers) for s in plan.stages]
    return evaluate_layout(cm, stages, dp=plan.dp, tp=plan.tp, micro_batch=plan.micro_batch,
                           num_micro_batches=plan.num_micro_batches)


def evaluate_interleaved(cm: CostModel, stages: Sequence[tuple[NodeGroup, Sequence]], *,
                         dp: int, tp: int, micro_batch: int, num_micro_batches: int,
                         schedule: str = "interleaved-1f1b") -> Evaluation:
    """Evaluate stages whose ranks run several virtual stages each, given as (node group, the
    layers of each virtual stage, or counts of their choices) in pipeline order; virtual stage c of stage i feeds virtual
    stage c of stage i + 1, and the last stage's feeds the first stage's c + 1."""
    pp, v = len(stages), len(stages[0][1])
    costs = []
    for i, (group, chunks) in enumerate(stages):
        nexts = [stages[i + 1][0] if i + 1 < pp else (stages[0][0] if c + 1 < v else None) for c in range(v)]
        costs.append(interleaved_stage_cost(cm, group, chunks, stage=i, pp=pp, dp=dp, tp=tp, micro_batch=micro_batch,
                                            num_micro_batches=num_micro_batches, next_groups=nexts))
    costs = with_receives(costs, wrap=True)  # each stage also pays its side of the boundaries before its chunks
    step, breakdown = step_time_s(costs, num_micro_batches, schedule=schedule, virtual_stages=v,
                                  step_overhead_s=cm.step_overhead_s)
    return Evaluation(step_time_s=step, breakdown=breakdown, stages=tuple(costs))


def prediction(cm: CostModel, ev: Evaluation, *, devices: Sequence[str], global_batch: int) -> Prediction:
    """The plan's prediction block. ``devices`` lists the device type of every rank used."""
    tokens = global_batch * cm.seq_len
    flops = cm.model.train_flops_per_token(cm.seq_len) * tokens
    peak = sum(get_device(d).peak_tflops(cm.dtype) * 1e12 for d in devices)
    memory = tuple(
        StageMemory(stage=i, device=devices_of_stage, capacity_bytes=s.capacity, weights_bytes=s.weights,
                    gathered_weights_bytes=s.gathered_weights, gradients_bytes=s.gradients,
                    optimizer_bytes=s.optimizer, activations_bytes=s.activations, transient_bytes=s.transient,
                    pipeline_buffers_bytes=s.pipeline_buffers, reserve_bytes=s.reserve,
                    peak_at=s.peak_at)
        for i, (s, devices_of_stage) in enumerate(zip(ev.stages, _stage_devices(devices, len(ev.stages)))))
    return Prediction(step_time_s=ev.step_time_s, tokens_per_s=tokens / ev.step_time_s,
                      mfu=flops / ev.step_time_s / peak, stage_time_s=tuple(s.time_s for s in ev.stages),
                      breakdown={k: round(v, 9) for k, v in ev.breakdown.items()}, memory=memory)


def _stage_devices(devices: Sequence[str], pp: int) -> list[str]:
    per = len(devices) // pp
    return [devices[i * per] for i in range(pp)]
