"""Stage: one pipeline stage's costs on one of its devices, put together from its layers'.

A stage's time per micro-batch is its layers' forward + backward with their TP/ZeRO collectives
and its side of each stage boundary: the transfers (sender and receiver both pay; under TP each
rank sends and receives its 1/tp sequence shard, ``boundary_split``) and the all-gathers its end
layers run when they are not sequence-parallel (``boundary_gathers``). Its memory is its layers'
state, the micro-batches in flight and the running one's peak (``memory``), and the schedule's
buffers (``memory.pipeline_memory``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from partita.cluster import NodeGroup
from partita.model import ModelSpec
from partita.plan import LayerStrategy, boundary_split, gives_whole
from partita.search.costs.memory import (LayerMemory, Moment, activation_message_bytes, kept_output_bytes, neighbour_peak,
                                        pipeline_memory)
from partita.search.costs.model import CostModel
from partita.search.schedules import chunk_in_flight, held_moments, in_flight_chunks
from partita.search.timing import overlapped_s


@dataclass(frozen=True)
class StageCost:
    """One stage's costs on one of its devices."""

    time_s: float  # one micro-batch forward + backward, collectives and sends included
    forward_s: float
    backward_s: float
    compute_s: float
    tp_comm_s: float
    zero_comm_s: float
    p2p_s: float  # its sides of its stage boundaries: transfers and the all-gathers of its end layers
    dp_sync_s: float  # per step
    optimizer_s: float  # per step
    weights: int
    gathered_weights: int  # the copies kept from forward to backward + the peak layer's gathered part
    gradients: int
    optimizer: int
    activations_per_mb: int  # one micro-batch's kept activations, all the stage's layers
    current_activations: int  # the running micro-batch's at the peak: the layers up to the peak layer
    output_per_mb: int  # the stage output the schedule keeps per micro-batch in flight (not on the last stage)
    retained_output: int  # a last pipeline stage's logits, kept by the schedule until their backward
    in_flight: int  # micro-batches whose activations the stage holds at its peak
    transient: int  # the peak layer's extra bytes (its gathered part is in gathered_weights)
    pipeline_buffers: int  # the schedule's receive buffers: one per micro-batch and direction
    reserve: int
    capacity: int
    peak_layer: str = ""  # where the stage peaks: a layer name ("layers.N", or the role when unnamed)
    peak_phase: str = "backward"  # ... in its "forward" or its "backward"
    tied_sync_s: float = 0.0  # per step: a tied head's copy summed with the embedding's (runtime/tied.py)
    peak_gathered: int = 0  # the part of gathered_weights that is the peak layer's own gathers
    peak_released: int = 0  # kept copies of later layers freed by the peak (taken off gathered_weights)
    # time (search/timing.py, docs/search.md): per micro-batch, the exposed first gather / last
    # reduce-scatter (the largest of the stage's layers' ZeRO traffic, charged once per
    # micro-batch in step_time_s); per step, the largest layer's data-parallel reduction (it ends
    # the backward, nothing left to hide it) and the backward the others can hide behind; the
    # transfers of this stage's side of the boundary to the next stage (in p2p_s; the next stage
    # pays as much on its side).
    zero_edge_s: float = 0.0
    dp_edge_s: float = 0.0
    overlap_window_s: float = 0.0
    send_s: float = 0.0
    cp_comm_s: float = 0.0  # context parallelism's collectives on the critical path (LayerTime.cp_comm_s)
    # Several virtual stages per rank under interleaved 1F1B: the activations of the pairs held
    # besides the running one at the rank's peak, counted moment by moment (-1: not counted so,
    # every pair in flight at ``activations_per_mb``).
    waiting: int = -1

    @property
    def activations(self) -> int:
        waiting = self.waiting if self.waiting >= 0 else self.activations_per_mb * (self.in_flight - 1)
        return waiting + self.current_activations + self.output_per_mb * self.in_flight + self.retained_output

    @property
    def peak_bytes(self) -> int:
        return (self.weights + self.gathered_weights + self.gradients + self.optimizer + self.activations
                + self.transient + self.pipeline_buffers + self.reserve)

    @property
    def peak_at(self) -> str:
        return f"{self.peak_layer} {self.peak_phase}".strip()

    @property
    def exposed_dp_s(self) -> float:
        """Per-step gradient reductions run layer by layer as the last micro-batch's backward
        frees them; the last one (the stage's first layer) has nothing left to hide behind, and
        all of them together hide at most behind the backward's overlap window."""
        if self.dp_sync_s <= 0:
            return 0.0
        return max(self.dp_edge_s, self.dp_sync_s - self.overlap_window_s)


def in_flight(stage: int, pp: int, num_micro_batches: int) -> int:
    """Micro-batches whose activations a 1F1B stage holds at its peak."""
    return min(pp - stage, num_micro_batches)


# A layer's choices without its name: (role, tensor_parallel, sequence_parallel, zero, recompute).
LayerChoice = tuple[str, int, bool, int, str]
# A stage's layers in order as runs of one choice: ((choice, count, name of the run's last layer), ...).
Runs = tuple[tuple[LayerChoice, int, str], ...]


def choice_of(model: ModelSpec, s: LayerStrategy) -> LayerChoice:
    return (model.role_of(s.name), s.tensor_parallel, s.sequence_parallel, s.zero, s.recompute)


def stage_cost(cm: CostModel, group: NodeGroup, layers: Sequence[LayerStrategy], *, stage: int, pp: int, dp: int,
               tp: int, micro_batch: int, num_micro_batches: int, next_group: NodeGroup | None,
               embed_on_rank: bool = False) -> StageCost:
    """Cost of one pipeline stage holding these layers, in this order: a plan's prediction. Its
    memory peak also looks at each layer's neighbours (``neighbour_peak``) and is never more
    than the per-layer terms the search counts (``stage_cost_counts``)."""
    runs = tuple((choice_of(cm.model, s), 1, s.name) for s in layers)
    return _stage_cost_runs(cm, group, runs, stage=stage, pp=pp, dp=dp, tp=tp, micro_batch=micro_batch,
                            num_micro_batches=num_micro_batches, next_group=next_group, neighbours=True,
                            embed_on_rank=embed_on_rank)


def canonical_order(cm: CostModel, device: str, choices: Iterable[LayerChoice], *, dp: int, micro_batch: int,
                    num_micro_batches: int) -> list[LayerChoice]:
    """The order of a stage's layers that gives the least peak for given counts, and the order
    the search writes plans in: the embedding first and the head last (the model's order), the
    blocks by decreasing transient. (A stage peaks at max over its layers j of the activations
    of the layers up to j plus j's transient; ordering by decreasing transient minimises that
    maximum, as earliest-due-date minimises the greatest lateness on one machine.)"""
    choices = tuple(choices)
    cache_key = ("order", device, choices, dp, micro_batch, num_micro_batches)
    order = cm.stage_cache.get(cache_key)
    if order is None:
        def key(c: LayerChoice) -> tuple:
            m = cm.layer_memory_of(c, device, dp=dp, micro_batch=micro_batch, num_micro_batches=num_micro_batches)
            return ({"embed": 0, "block": 1, "head": 2}[c[0]], -m.transient, c)
        order = cm.stage_cache[cache_key] = sorted(choices, key=key)
    return order


def stage_cost_counts(cm: CostModel, group: NodeGroup, counts: Mapping[LayerChoice, int], *, stage: int, pp: int,
                      dp: int, tp: int, micro_batch: int, num_micro_batches: int,
                      next_group: NodeGroup | None, embed_on_rank: bool = False) -> StageCost:
    """Cost of one stage from how many of its layers make each choice, the layers in the
    canonical order (``canonical_order``)."""
    order = canonical_order(cm, group.device, (c for c, n in counts.items() if n), dp=dp, micro_batch=micro_batch,
                            num_micro_batches=num_micro_batches)
    runs = tuple((c, counts[c], c[0]) for c in order)
    return _stage_cost_runs(cm, group, runs, stage=stage, pp=pp, dp=dp, tp=tp, micro_batch=micro_batch,
                            num_micro_batches=num_micro_batches, next_group=next_group, embed_on_rank=embed_on_rank)


def _stage_cost_runs(cm: CostModel, group: NodeGroup, runs: Runs, *, stage: int, pp: int, dp: int, tp: int,
                     micro_batch: int, num_micro_batches: int, next_group: NodeGroup | None,
                     neighbours: bool = False, embed_on_rank: bool = False) -> StageCost:
    """Identical blocks cost the same, so each distinct run is priced once; stages alike but
    for their position share everything but the micro-batches in flight."""
    key = (group.name, runs, dp, tp, micro_batch, num_micro_batches, next_group.name if next_group else None,
           neighbours, embed_on_rank)
    k = in_flight(stage, pp, num_micro_batches)
    placed = cm.stage_cache.get(key + (k,))
    if placed is None:
        base = cm.stage_cache.get(key)
        if base is None:
            base = _stage_cost(cm, group, runs, dp=dp, tp=tp, micro_batch=micro_batch,
                               num_micro_batches=num_micro_batches, next_group=next_group, neighbours=neighbours,
                               embed_on_rank=embed_on_rank)
            cm.stage_cache[key] = base
        placed = copy.copy(base)  # dataclasses.replace re-runs __init__: this is the search's hot path
        object.__setattr__(placed, "in_flight", k)
        cm.stage_cache[key + (k,)] = placed
    return placed


def _stage_cost(cm: CostModel, group: NodeGroup, runs: Runs, *, dp: int, tp: int, micro_batch: int,
                num_micro_batches: int, next_group: NodeGroup | None, neighbours: bool = False,
                embed_on_rank: bool = False) -> StageCost:
    fwd = bwd = compute = tp_comm = zero_comm = dp_sync = cp_comm = 0.0
    zero_edge = dp_edge = window = optimizer_s = 0.0
    weights = gathered_weights = grads = opt = acts = 0
    # The running micro-batch at the stage's peak: the activations of the layers up to the peak
    # layer and that layer's transient (the other micro-batches in flight hold all of theirs).
    peak: tuple[int, int, LayerMemory, str] | None = None  # (acts so far + transient, acts so far, memory, name)
    roles = {r[0][0] for r in runs}
    # A tied head keeps its own copy where its rank does not hold the embedding (``embed_on_rank``:
    # another virtual stage of the rank does, as zbv's first rank: runtime/tied.py ties them there).
    tied_copy = cm.model.tie_embeddings and "head" in roles and "embed" not in roles and not embed_on_rank
    tied_sync = 0.0
    memories: list[tuple[LayerMemory, int, str]] = []
    for choice, n, name in runs:
        holds_copy = tied_copy and choice[0] == "head"
        t = cm.layer_time_of(choice, group, dp=dp, micro_batch=micro_batch)
        m = cm.layer_memory_of(choice, group.device, dp=dp, micro_batch=micro_batch,
                               num_micro_batches=num_micro_batches, tied_copy=holds_copy)
        if holds_copy:  # its state is in m; its gradient sum and update in the tied sync
            tied_sync = cm.tied_sync_s(group, dp=dp, tp=choice[1], zero=choice[3])
        fwd += n * t.forward_s
        bwd += n * t.backward_s
        compute += n * t.compute_s
        tp_comm += n * t.tp_comm_s
        cp_comm += n * t.cp_comm_s
        zero_comm += n * t.zero_comm_s
        dp_sync += n * t.dp_sync_s
        zero_edge, dp_edge = max(zero_edge, t.zero_edge_s), max(dp_edge, t.dp_sync_s)
        window += n * t.overlap_window_s
        optimizer_s += n * t.optimizer_s
        weights += n * m.weights
        gathered_weights += n * m.gathered_weights
        grads += n * m.gradients
        opt += n * m.optimizer
        acts += n * m.activations  # the run's last layer sees the most activations before it
        if neighbours:
            memories.append((m, n, name))
        if peak is None or acts + m.transient > peak[0]:
            peak = (acts + m.transient, acts, m, name)
    # This stage's side of the boundary to the next: the transfers (the next stage pays the same
    # on its side: ``with_receives``), and the all-gathers at its own ends (``boundary_gathers``).
    send = boundary_s(cm, group, next_group, dp=dp, tp=tp, micro_batch=micro_batch) if next_group is not None else 0.0
    gathers = sum(boundary_gathers(cm, runs, tp=tp, sends=next_group is not None))
    p2p = send + (gathers * boundary_gather_s(cm, group, tp=tp, micro_batch=micro_batch) if gathers else 0.0)
    # Reported by what holds the bytes: the peak layer's gathered parameters with the gathered
    # weights, the rest of its transient (recompute, working set, loss) as transient.
    assert peak is not None
    _, current, top, peak_layer = peak
    moment = Moment(current, top.transient_gathered, top.transient - top.transient_gathered, 0, peak_layer,
                    top.peak_phase)
    if neighbours:  # a plan's prediction: what the neighbours take away, never more than the search counts
        aware = neighbour_peak(memories)
        if aware.bytes <= moment.bytes:
            moment = aware
    gathered_weights += moment.gathered - moment.released
    buffers, output, retained = pipeline_memory(cm, {r[0]: r[1] for r in runs}, tp=tp, micro_batch=micro_batch,
                                                num_micro_batches=num_micro_batches, is_last=next_group is None)
    reserve = cm.reserve_bytes(group)
    return StageCost(time_s=fwd + bwd + p2p, forward_s=fwd, backward_s=bwd, compute_s=compute, tp_comm_s=tp_comm,
                     zero_comm_s=zero_comm, p2p_s=p2p, dp_sync_s=dp_sync, optimizer_s=optimizer_s,
                     weights=weights, gathered_weights=gathered_weights, gradients=grads, optimizer=opt,
                     activations_per_mb=acts, current_activations=moment.activations, output_per_mb=output,
                     retained_output=retained, in_flight=1, transient=moment.other,
                     pipeline_buffers=buffers, reserve=reserve, capacity=group.memory_bytes,
                     peak_layer=moment.layer, peak_phase=moment.phase, tied_sync_s=tied_sync,
                     peak_gathered=moment.gathered, peak_released=moment.released, zero_edge_s=zero_edge,
                     dp_edge_s=dp_edge, overlap_window_s=window, send_s=send, cp_comm_s=cp_comm)


def boundary_s(cm: CostModel, group: NodeGroup, other: NodeGroup, *, dp: int, tp: int, micro_batch: int) -> float:
    """One side's transfers at a stage boundary per micro-batch, which sender and receiver
    both pay (each waits on its blocking send or receive): the activation one way in forward,
    its gradient the other way in backward. Under tensor parallelism each rank sends and
    receives its 1/tp sequence shard (``boundary_split``; the runtime's stages exchange
    (b, s/tp, h) tensors); the all-gathers back to whole hidden states are the end layers'
    (``boundary_gathers``)."""
    msg = activation_message_bytes(cm, micro_batch, tp)
    link = cm.pp_link(group, other, dp * tp)
    # A transfer goes at the slower side's pace: each device's measured fit, and between node
    # groups the link that joins them (a fit measured inside one group knows nothing of it).
    one_way = max(cm.collective_s("p2p", msg, 2, link, d) for d in {group.device, other.device})
    if group.name != other.name:
        one_way = max(one_way, cm.collective_s("p2p", msg, 2, link))
    return 2 * one_way


def boundary_gather_s(cm: CostModel, group: NodeGroup, *, tp: int, micro_batch: int) -> float:
    """One all-gather of a split boundary's sequence shards back to the whole activation, over
    the stage's tensor group (``boundary_gathers`` says how many a stage runs)."""
    return cm.collective_s("all_gather", activation_message_bytes(cm, micro_batch), tp, cm.tp_link(group, tp),
                           group.device)


def boundary_gathers(cm: CostModel, runs: Runs, *, tp: int, sends: bool) -> tuple[int, int]:
    """(forward, backward) all-gathers per micro-batch at a (virtual) stage's boundaries, as the
    runtime runs them (``runtime.parallelize.apply_tensor_parallel``): when a boundary carries
    sequence shards (``boundary_split``), a first layer that takes whole hidden states gathers
    what it receives (in forward; the gradient it returns is sliced for free), and a last layer
    that gives whole hidden states gathers the gradient it gets back (in backward; its output
    is sliced for free). A sequence-parallel end gathers nothing. The embedding receives tokens
    and the head sends nothing. ``runs`` are the stage's layers in order."""
    if boundary_split(cm.seq_len, tp) == 1:
        return 0, 0
    first, last = runs[0][0], runs[-1][0]
    forward = first[0] != "embed" and gives_whole(first[1], first[2])
    backward = sends and last[0] != "head" and gives_whole(last[1], last[2])
    return int(forward), int(backward)


def with_p2p_overlap(stages: Sequence[StageCost], slowdowns: Sequence[float]) -> list[StageCost]:
    """Interleaved stages whose engine posts its sends and receives before the next virtual
    stage's compute and waits after it (search/engines.py, ``p2p_overlap``): each stage's
    transfers (its sends and the receives from the stage before it, the first's from the last)
    run beside its compute, which they slow by the stage's overlap ``slowdowns``, instead of
    after it. ``stages`` come with their receives (``with_receives(wrap=True)``)."""
    out = []
    for i, cost in enumerate(stages):
        transfers = cost.send_s + stages[i - 1].send_s
        exposed = overlapped_s(cost.compute_s, transfers, slowdowns[i]) - cost.compute_s
        saved = max(0.0, transfers - exposed)
        out.append(dataclasses.replace(cost, time_s=cost.time_s - saved, p2p_s=cost.p2p_s - saved))
    return out


def with_receives(stages: Sequence[StageCost], *, wrap: bool = False) -> list[StageCost]:
    """Each stage after the first also pays its side of the boundary before it: the same
    transfers as the sender's side (both ranks wait for a blocking send and receive). With
    ``wrap`` (interleaved schedules) the first stage receives what the last one sends on."""
    out = list(stages)
    for i in range(0 if wrap else 1, len(out)):
        receive = stages[i - 1].send_s
        # copy.copy, not dataclasses.replace (which re-runs __init__): the grid's hot path.
        out[i] = copy.copy(out[i])
        object.__setattr__(out[i], "time_s", out[i].time_s + receive)
        object.__setattr__(out[i], "p2p_s", out[i].p2p_s + receive)
    return out


def interleaved_stage_cost(cm: CostModel, group: NodeGroup,
                           chunks: Sequence[Sequence[LayerStrategy] | Mapping[LayerChoice, int]], *,
                           stage: int, pp: int, dp: int, tp: int, micro_batch: int, num_micro_batches: int,
                           next_groups: Sequence[NodeGroup | None],
                           schedule: str = "interleaved-1f1b") -> StageCost:
    """One plan stage whose ranks run v virtual stages under ``schedule``: ``chunks[c]`` are the
    layers of virtual stage c (or counts of their choices), ``next_groups[c]`` the group its output goes to (None for the
    pipeline's last). Times, static state, sends and the schedule's buffers add up over the
    virtual stages. Under interleaved 1F1B the activations are those of the rank's fullest
    moment on torch's order (``schedules.held_moments``): the pairs it holds then, each at its own
    virtual stage's activations, the running one at its virtual stage's peak, and the tensors it
    has sent that only their sends still hold. Under the zero-bubble schedules
    ``schedules.in_flight_chunks`` pairs, each at the largest virtual stage's activations, the
    running one at the peak of whichever virtual stage peaks highest. The head's logits once per
    pair of its virtual stage in flight."""
    def roles(layers) -> set[str]:
        if isinstance(layers, Mapping):
            return {c[0] for c, n in layers.items() if n}
        return {cm.model.role_of(s.name) for s in layers}

    embed_here = any("embed" in roles(layers) for layers in chunks)

    def part(layers, nxt: NodeGroup | None) -> StageCost:
        kw = dict(stage=0, pp=1, dp=dp, tp=tp, micro_batch=micro_batch, num_micro_batches=num_micro_batches,
                  next_group=nxt, embed_on_rank=embed_here)
        if isinstance(layers, Mapping):  # counts of choices (the search's fast path): canonical order
            return stage_cost_counts(cm, group, layers, **kw)
        return stage_cost(cm, group, layers, **kw)

    parts = [part(layers, nxt) for layers, nxt in zip(chunks, next_groups)]
    add = lambda field: sum(getattr(p, field) for p in parts)  # noqa: E731
    most = chunk_in_flight(schedule, stage, pp, len(chunks), num_micro_batches)
    # what each virtual stage's running pair holds at its peak: its layers' activations up to the
    # peak layer, that layer's transient and gathered copies
    peak = [p.current_activations + p.transient + p.peak_gathered - p.peak_released for p in parts]
    waiting = -1
    if schedule == "interleaved-1f1b":
        # The pairs held at once, moment by moment on torch's order (``schedules.held_moments``):
        # at each, the pairs waiting at their virtual stages' activations and the running one at
        # its virtual stage's peak; the rank's peak is the largest moment.
        # The tensors sent that only their sends hold (``held_moments``' third count) are stage
        # outputs and input gradients: an output's bytes each, none under an engine that frees
        # what it sent and waits for each send (Megatron-LM: ``kept_output_bytes``).
        acts = [p.activations_per_mb for p in parts]
        sent = kept_output_bytes(cm, micro_batch, tp)
        ranked, waiting = max(((c, sum(n * a for n, a in zip(vec, acts)) - acts[c] + dead * sent)
                               for c, vec, dead in held_moments(stage, pp, len(chunks), num_micro_batches)),
                              key=lambda cw: cw[1] + peak[cw[0]])
    else:
        # Zero-bubble schedules keep every pair at the largest virtual stage's activations: their
        # split backward holds more between I and W than the plan prices (measured +15 % on CPU
        # ranks with per-virtual-stage charging, tests/test_runtime_schedules.py), which that
        # bound covers; the running pair at the virtual stage that peaks highest.
        ranked = max(range(len(parts)), key=peak.__getitem__)
    running = parts[ranked]
    # Every virtual stage's kept copies, less those the running one has freed by its peak.
    kept_copies = sum(p.gathered_weights - p.peak_gathered + p.peak_released for p in parts) - running.peak_released
    return dataclasses.replace(
        parts[0], time_s=add("time_s"), forward_s=add("forward_s"), backward_s=add("backward_s"),
        compute_s=add("compute_s"), tp_comm_s=add("tp_comm_s"), zero_comm_s=add("zero_comm_s"), p2p_s=add("p2p_s"),
        dp_sync_s=add("dp_sync_s"), optimizer_s=add("optimizer_s"), weights=add("weights"),
        gathered_weights=kept_copies + running.peak_gathered, peak_gathered=running.peak_gathered,
        peak_released=running.peak_released,
        gradients=add("gradients"), optimizer=add("optimizer"),
        activations_per_mb=max(p.activations_per_mb for p in parts), current_activations=running.current_activations,
        output_per_mb=kept_output_bytes(cm, micro_batch, tp),
        # the head's logits, kept from its forward to its backward for each pair of its virtual stage in flight
        retained_output=sum(p.retained_output * n for p, n in zip(parts, most)),
        in_flight=in_flight_chunks(schedule, stage, pp, len(chunks), num_micro_batches), waiting=waiting,
        transient=running.transient, pipeline_buffers=add("pipeline_buffers"), peak_layer=running.peak_layer,
        peak_phase=running.peak_phase, tied_sync_s=add("tied_sync_s"),
        zero_edge_s=max(p.zero_edge_s for p in parts), dp_edge_s=max(p.dp_edge_s for p in parts),
        overlap_window_s=add("overlap_window_s"), send_s=add("send_s"), cp_comm_s=add("cp_comm_s"))
