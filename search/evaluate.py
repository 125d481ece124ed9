"""One function evaluates any plan: predicted step time, its breakdown, each device's memory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

from partita.cluster import NodeGroup
from partita.devices import get_device
from partita.parallel import ZERO_BUBBLE
from partita.plan import LayerStrategy, Plan, Prediction, StageMemory
from partita.search import context
from partita.search.costs.model import CostModel
from partita.search.costs.stage import (LayerChoice, StageCost, boundary_s, choice_of, interleaved_stage_cost,
                                        stage_cost, stage_cost_counts, with_p2p_overlap, with_receives)
from partita.search.costs.step import step_time_s
from partita.search.schedules import in_flight_chunks, pending_weight_grads
from partita.search.timing import layer_ops, split_backward_host_s, weight_groups


@dataclass(frozen=True)
class Evaluation:
    step_time_s: float
    breakdown: dict[str, float]
    stages: tuple[StageCost, ...]
    # Replicas on different device types (``evaluate_replicas``): each kind of replica's device
    # types by stage and its own evaluation; ``stages`` and the step are the slowest kind's.
    replicas: tuple[tuple[tuple[str, ...], "Evaluation"], ...] = ()

    def _all_stages(self) -> list[StageCost]:
        return list(self.stages) + [s for _, ev in self.replicas for s in ev.stages]

    @property
    def fits(self) -> bool:
        return all(s.peak_bytes <= s.capacity for s in self._all_stages())

    @property
    def peak_over_capacity(self) -> float:
        """Largest peak / capacity over stages (> 1: does not fit)."""
        return max(s.peak_bytes / s.capacity for s in self._all_stages())

    def tightest(self, i: int) -> tuple[StageCost, str | None]:
        """Stage i's cost on its fullest device (largest peak / capacity) and, for replicas on
        different device types, that device's type (None: the stage's own)."""
        if not self.replicas:
            return self.stages[i], None
        cost, devices = max(((ev.stages[i], path) for path, ev in self.replicas),
                            key=lambda t: t[0].peak_bytes / t[0].capacity)
        return cost, devices[i]


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
    # a context-parallel plan is priced by its view (search/context.py)
    cm = cm.at_cp(plan.cp, plan.cp_variant, context.span_tp_of(cm.real_cluster, plan.cp, plan.tp))
    cm = cm.at_ep(plan.ep, plan.moe_imbalance)  # an expert-parallel one at the routing it was made for
    if plan.mixed_replicas:
        return evaluate_replicas(plan, cm)
    if plan.virtual_stages > 1:
        return evaluate_interleaved(cm, [(cm.cluster.group(s.group), s.chunk_layers()) for s in plan.stages],
                                    dp=plan.dp, tp=plan.tp, micro_batch=plan.micro_batch,
                                    num_micro_batches=plan.num_micro_batches, schedule=plan.schedule)
    stages = [(cm.cluster.group(s.group), s.layers) for s in plan.stages]
    return evaluate_layout(cm, stages, dp=plan.dp, tp=plan.tp, micro_batch=plan.micro_batch,
                           num_micro_batches=plan.num_micro_batches)


def evaluate_replicas(plan: Plan, cm: CostModel) -> Evaluation:
    """A plan whose replicas sit on different device types (``Stage.replica_groups``): each
    kind of replica (``Plan.replica_kinds``) is priced as a pipeline of its own groups, with its own
    micro-batch size and count, its collectives over dp at the pace of every group the
    replicas span (``CostModel.spanning``); the step is the slowest kind's, and every kind's
    devices must hold their memory."""
    span = cm.spanning(g for s in plan.stages for g in s.groups)
    kinds = []
    for (path, size, count), _ in plan.replica_kinds().items():
        groups = [cm.cluster.group(g) for g in path]
        ev = evaluate_layout(span, [(g, s.layers) for g, s in zip(groups, plan.stages)], dp=plan.dp, tp=plan.tp,
                             micro_batch=size, num_micro_batches=count)
        kinds.append((tuple(g.device for g in groups), ev))
    slowest = max((ev for _, ev in kinds), key=lambda ev: ev.step_time_s)
    return Evaluation(step_time_s=slowest.step_time_s, breakdown=slowest.breakdown, stages=slowest.stages,
                      replicas=tuple(kinds))


def evaluate_interleaved(cm: CostModel, stages: Sequence[tuple[NodeGroup, Sequence]], *,
                         dp: int, tp: int, micro_batch: int, num_micro_batches: int,
                         schedule: str = "interleaved-1f1b") -> Evaluation:
    """Evaluate stages whose ranks run several virtual stages each, given as (node group, the
    layers of each virtual stage, or counts of their choices) in pipeline order. Under the
    interleaved schedules virtual stage c of stage i feeds virtual stage c of stage i + 1, and
    the last stage's feeds the first stage's c + 1; under zbv (a V) chunk 0 runs down the
    stages and chunk 1 back up, the last stage's ranks turning from one to the other without a
    send. The zero-bubble schedules also hold their in-flight micro-batches until the weight
    gradient (``_split_backward``)."""
    pp, v = len(stages), len(stages[0][1])
    groups = [g for g, _ in stages]
    costs = []
    for i, (group, chunks) in enumerate(stages):
        nexts = next_groups(schedule, groups, i, v)
        cost = interleaved_stage_cost(cm, group, chunks, stage=i, pp=pp, dp=dp, tp=tp, micro_batch=micro_batch,
                                      num_micro_batches=num_micro_batches, next_groups=nexts, schedule=schedule)
        # The V's turn stays on the rank: its transfers, priced as a send, are taken off (the
        # shards it hands over are still gathered where its end layers take whole hidden states).
        if schedule == "zbv" and i == pp - 1:
            turn = boundary_s(cm, group, group, dp=dp, tp=tp, micro_batch=micro_batch)
            cost = dataclasses.replace(cost, time_s=cost.time_s - turn, p2p_s=cost.p2p_s - turn,
                                       send_s=cost.send_s - turn)
        costs.append(cost)
    if schedule == "zbv":
        costs = _zbv_receives(cm, costs, groups, dp=dp, tp=tp, micro_batch=micro_batch)
    else:
        costs = with_receives(costs, wrap=True)  # each stage also pays its side of the boundaries before its chunks
        if schedule == "interleaved-1f1b" and cm.engine.p2p_overlap:
            costs = with_p2p_overlap(costs, [cm.time_constants(g.device).overlap_slowdown for g in groups])
    if schedule in ZERO_BUBBLE:
        costs = [_split_backward(cm, cost, group, chunks, schedule=schedule, stage=i, pp=pp, micro_batch=micro_batch,
                                 num_micro_batches=num_micro_batches)
                 for i, (cost, (group, chunks)) in enumerate(zip(costs, stages))]
    step, breakdown = step_time_s(costs, num_micro_batches, schedule=schedule, virtual_stages=v,
                                  step_overhead_s=cm.step_overhead_s)
    return Evaluation(step_time_s=step, breakdown=breakdown, stages=tuple(costs))


def next_groups(schedule: str, groups: Sequence[NodeGroup], stage: int, v: int) -> list[NodeGroup | None]:
    """Where each virtual stage of ``stage`` sends its output (None: the pipeline's last)."""
    pp = len(groups)
    if schedule == "zbv":  # chunk 0 down the stages, turning on the last one; chunk 1 back up
        return [groups[stage + 1] if stage + 1 < pp else groups[stage], groups[stage - 1] if stage > 0 else None]
    return [groups[stage + 1] if stage + 1 < pp else (groups[0] if c + 1 < v else None) for c in range(v)]


def _zbv_receives(cm: CostModel, costs: list[StageCost], groups: Sequence[NodeGroup], *, dp: int, tp: int,
                  micro_batch: int) -> list[StageCost]:
    """Under zbv each stage also pays its side of the boundaries it receives across: chunk 0's
    from the stage before it, chunk 1's from the stage after it (``costs.stage.with_receives`` for
    the V)."""
    out = []
    for i, cost in enumerate(costs):
        receive = sum(boundary_s(cm, groups[j], groups[i], dp=dp, tp=tp, micro_batch=micro_batch)
                      for j in (i - 1, i + 1) if 0 <= j < len(groups))
        out.append(dataclasses.replace(cost, time_s=cost.time_s + receive, p2p_s=cost.p2p_s + receive))
    return out


def _split_backward(cm: CostModel, cost: StageCost, group: NodeGroup, chunks: Sequence, *, schedule: str, stage: int,
                    pp: int, micro_batch: int, num_micro_batches: int) -> StageCost:
    """A zero-bubble stage: its micro-batches stay in flight until their weight gradient
    (``schedules.in_flight_chunks``), those between I and W also keep the gradients at their
    weight products' outputs (``schedules.pending_weight_grads`` x the largest virtual
    stage's ``weight_grad_bytes``, counted with the retained outputs), the data-parallel
    reduction runs after the step with nothing to hide behind (``runtime.schedule``), and each
    backward costs the host the split's own work (``split_backward_host_s``)."""
    v = len(chunks)
    pending = pending_weight_grads(schedule, stage, pp, num_micro_batches)
    per_chunk = max(sum(n * weight_grad_bytes(cm, c, micro_batch) for c, n in _choices(cm, chunk)) for chunk in chunks)
    extra = _split_host_s(cm, group, chunks, stage=stage, backward_s=cost.backward_s)
    return dataclasses.replace(cost, in_flight=in_flight_chunks(schedule, stage, pp, v, num_micro_batches),
                               retained_output=cost.retained_output + pending * per_chunk, overlap_window_s=0.0,
                               time_s=cost.time_s + extra, backward_s=cost.backward_s + extra,
                               compute_s=cost.compute_s + extra)


def _split_host_s(cm: CostModel, group: NodeGroup, chunks: Sequence, *, stage: int, backward_s: float) -> float:
    """What splitting the backward adds to one micro-batch of a zero-bubble stage: every virtual
    stage's ``timing.split_backward_host_s`` but torch's first (stage 0's chunk 0, whose W is a
    whole backward: its input is the tokens), for the layers' parameter groups
    (``timing.weight_groups``) and forward ops. The host does it: on a CPU rank it adds; on a GPU
    it hides behind the backward's device time while the host's ops, with it, take less (the
    stage's backward taken as a whole against its ops, an approximation when its virtual stages
    differ)."""
    k = cm.time_constants(group.device)
    extra = host = 0.0
    for c, chunk in enumerate(chunks):
        groups = nodes = 0
        for choice, n in _choices(cm, chunk):
            kind = cm.model.kinds[choice[0]]
            fwd_ops, bwd_ops = layer_ops(kind)
            groups += n * weight_groups(kind, tied_head=choice[0] == "head" and cm.model.tie_embeddings)
            nodes += n * fwd_ops
            host += n * bwd_ops * k.op_overhead_s
        if stage or c:
            extra += split_backward_host_s(groups, nodes, k.op_overhead_s)
    if get_device(group.device).is_cpu:
        return extra
    return max(0.0, host + extra - backward_s)


def _choices(cm: CostModel, chunk) -> list[tuple[LayerChoice, int]]:
    if isinstance(chunk, Mapping):
        return list(chunk.items())
    return [(choice_of(cm.model, s), 1) for s in chunk]


def weight_grad_bytes(cm: CostModel, choice: LayerChoice, micro_batch: int) -> int:
    """What a layer's weight gradient W needs kept after its input gradient I, besides the
    activations: the gradient at the output of every product with a weight (torch's
    ``stage_backward_input`` saves them for ``stage_backward_weight``), in the compute dtype,
    per micro-batch of t tokens on one rank. A block: the norms' (2 h, split by the sequence
    under SP), q, k, v and the MLP's first products (split by columns under TP) and the two
    row-parallel outputs (2 h, whole); the head: its norm and the logits (vocab / tp). The
    embedding is the first stage's, whose I torch skips (W runs the whole backward)."""
    role, tp, sp = choice[0], choice[1], choice[2]
    m = cm.model
    t = micro_batch * cm.seq_len
    norm = m.hidden // (tp if sp else 1)
    if role == "block":
        up = 2 if m.family == "llama" else 1  # gated MLP: two first products
        columns = (m.heads + 2 * m.kv_heads) * m.head_dim + up * m.ffn
        per_token = 2 * norm + columns // tp + 2 * m.hidden
    elif role == "head":
        per_token = norm + m.vocab // tp
    else:
        per_token = 0
    return t * per_token * cm.elem


def prediction(cm: CostModel, ev: Evaluation, *, devices: Sequence[str], global_batch: int) -> Prediction:
    """The plan's prediction block. ``devices`` lists the device type of every rank used."""
    tokens = global_batch * cm.plan_seq_len  # the whole sequence (seq_len is s/cp under context parallelism)
    flops = cm.model.train_flops_per_token(cm.plan_seq_len) * tokens
    peak = sum(get_device(d).peak_tflops(cm.dtype) * 1e12 for d in devices)
    memory = []
    for i, devices_of_stage in enumerate(_stage_devices(devices, len(ev.stages))):
        s, device = ev.tightest(i)  # replicas on several device types: the fullest device's
        memory.append(StageMemory(
            stage=i, device=device or devices_of_stage, capacity_bytes=s.capacity, weights_bytes=s.weights,
            gathered_weights_bytes=s.gathered_weights, gradients_bytes=s.gradients, optimizer_bytes=s.optimizer,
            activations_bytes=s.activations, transient_bytes=s.transient, pipeline_buffers_bytes=s.pipeline_buffers,
            reserve_bytes=s.reserve, peak_at=s.peak_at))
    memory = tuple(memory)
    return Prediction(step_time_s=ev.step_time_s, tokens_per_s=tokens / ev.step_time_s,
                      mfu=flops / ev.step_time_s / peak, stage_time_s=tuple(s.time_s for s in ev.stages),
                      breakdown={k: round(v, 9) for k, v in ev.breakdown.items()}, memory=memory)


def _stage_devices(devices: Sequence[str], pp: int) -> list[str]:
    per = len(devices) // pp
    return [devices[i * per] for i in range(pp)]
