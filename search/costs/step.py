"""Step: a training step's time from its stages' costs, and its breakdown by cause.

Pipeline: the schedule's closed form over the stages' times (1F1B: (m - 1) * max_s T_s + sum_s
T_s, ``schedules.closed_form_s``), then the exposed ZeRO edge, data-parallel sync, optimizer,
a tied embedding's sync and a fixed per-step overhead.
"""

from __future__ import annotations

from typing import Sequence

from partita.search.costs.stage import StageCost
from partita.search.schedules import closed_form_s


def step_time_s(stages: Sequence[StageCost], num_micro_batches: int, *, schedule: str = "1f1b",
                virtual_stages: int = 1, step_overhead_s: float = 0.0) -> tuple[float, dict[str, float]]:
    """Step time and its breakdown by cause (seconds per step). Under an interleaved schedule
    each stage's time is its ranks' time for a micro-batch through all their virtual stages.
    ``stages`` come with their receives (``with_receives``); ``step_overhead_s`` is the fixed
    part (``CostModel.step_overhead_s``). The stages' exposed ZeRO edges are charged once per
    micro-batch at the largest: the slowest stage sets the pipeline's pace (the edge inside each
    stage's own time made CP-SAT's proofs several times slower)."""
    times = [s.time_s for s in stages]
    pipe = closed_form_s(schedule, times, num_micro_batches, virtual_stages)
    exposed_dp = max(s.exposed_dp_s for s in stages)
    optimizer = max(s.optimizer_s for s in stages)
    tied = max(s.tied_sync_s for s in stages)
    zero_edge = num_micro_batches * max(s.zero_edge_s for s in stages)
    total = pipe + zero_edge + exposed_dp + optimizer + tied + step_overhead_s
    m = num_micro_batches
    slowest = max(stages, key=lambda s: s.time_s)
    busy = m * slowest.time_s
    comm = slowest.tp_comm_s + slowest.cp_comm_s
    breakdown = {
        "compute": m * slowest.compute_s,
        "tensor_parallel_comm": m * slowest.tp_comm_s,
        # context parallelism's all-to-alls / exposed ring passes: only for plans with cp
        **({"context_parallel_comm": m * slowest.cp_comm_s} if any(s.cp_comm_s for s in stages) else {}),
        "zero_exposed": max(0.0, busy - m * (slowest.compute_s + comm + slowest.p2p_s)) + zero_edge,
        "pipeline_send": m * slowest.p2p_s,
        "pipeline_bubble": pipe - busy,
        "data_parallel_exposed": exposed_dp,
        "optimizer": optimizer,
        "step_overhead": step_overhead_s,
    }
    if tied:
        breakdown["tied_embedding_sync"] = tied
    return total, breakdown
