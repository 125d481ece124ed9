"""The memory contract: what each rank holds during a step, measured with torch's memory
trackers on CPU ranks (``partita.runtime.memory``), against the plan's predicted breakdown.

For every strategy the runtime tests train (DP, ZeRO 0-3, TP, TP+SP, full and selective
recompute, uneven pipeline, PP+TP, PP+FSDP, the mixed plans, and a bf16 plan), each rank's
tracked peak (reserve excluded: the CUDA context and allocator caching are not tensors) is within 10 % of the
prediction for its stage. The plan also names the moment of the peak (a layer's forward or
backward, ``StageMemory.peak_at``); at that moment the tracker's bytes are within 10 % of the
plan's, category by category. (Compared at the tracker's own peak instead, the categories would
depend on which of two moments a few KiB apart wins: a ZeRO gather in one layer's forward or
another's backward working set.) A category that is small next to the total may differ by up to
5 % of the rank's total instead. The prediction looks at each layer's neighbours as FSDP2 does
(whose gather is prefetched, whose reduce-scatter buffer is still held, which copies are freed
already): the mixed plans and PP+FSDP's lone ZeRO-3 block on the last stage depend on it.
"""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from partita.cluster import parse_short  # noqa: E402
from partita.model import BUILTIN  # noqa: E402
from partita.plan import Plan  # noqa: E402
from partita.runtime.train import TrainConfig  # noqa: E402
from partita.search.costs.model import CostModel  # noqa: E402
from partita.search.plans import attach_prediction  # noqa: E402
from runtime_helpers import interleaved, make_plan, run_ranks  # noqa: E402
from runtime_plans import PLANS, SMALL  # noqa: E402

CFG = TrainConfig(steps=2, warmup_steps=1, lr=1e-3, memory_report=True)
EIGHT = dataclasses.replace(BUILTIN["tiny-llama"], name="tiny-llama-8", n_layers=8)
FULL_2_TO_5 = {f"layers.{i}": dict(recompute="full") for i in (2, 3, 4, 5)}
FULL_4_TO_7 = {f"layers.{i}": dict(recompute="full") for i in (4, 5, 6, 7)}
MEMORY_PLANS = PLANS | {"bf16-zero1": make_plan(SMALL, dp=2, layer=dict(zero=1), dtype="bf16"),
                        "bf16-pp-tp": make_plan(SMALL, pp=2, tp=2, boundaries=[2], num_micro_batches=3,
                                                layer=dict(tensor_parallel=2, sequence_parallel=True), dtype="bf16"),
                        "interleaved": interleaved(make_plan(SMALL, pp=2, num_micro_batches=4), [[2, 1], [1, 2]]),
                        # many micro-batches of long sequences: a receive buffer per micro-batch
                        # (torch's own allocation) would be a third of a rank's memory; the runtime
                        # holds those of the transfers in flight (ReceiveOnDemandStage)
                        "pp-many-micro-batches": make_plan(SMALL, pp=2, num_micro_batches=8, seq_len=128),
                        # interleaved 1F1B whose virtual stages keep unlike activations (two
                        # recompute, two do not): the peak is the moment whose waiting pairs and
                        # running pair hold the most (``schedules.held_moments``)
                        "interleaved-mixed": interleaved(make_plan(EIGHT, pp=2, num_micro_batches=8, seq_len=64,
                                                                   per_layer=FULL_2_TO_5), [[3, 2], [2, 3]]),
                        "interleaved-mixed-ends": interleaved(make_plan(EIGHT, pp=2, num_micro_batches=6, seq_len=128,
                                                                        per_layer=FULL_4_TO_7), [[3, 2], [2, 3]]),
                        # stage ends without sequence parallelism: the boundary's shards gathered
                        # (the receiver's gathered input is its first block's), its receive buffers
                        # and kept outputs 1/tp of the hidden states
                        "pp-tp-whole-ends": make_plan(SMALL, pp=2, tp=2, boundaries=[2], num_micro_batches=3,
                                                      layer=dict(tensor_parallel=2))}


def _measure_rank(rank: int, plan_dict: dict, cfg: TrainConfig) -> dict:
    from partita.runtime.train import Trainer

    trainer = Trainer(Plan.from_dict(plan_dict), cfg, device=torch.device("cpu"))
    trainer.fit()
    return {"stage": trainer.meshes.place.stage.index, "memory": trainer.measured_memory,
            "moments": trainer.measured_moments}


def predicted(plan: Plan) -> dict[int, tuple[str, dict[str, int]]]:
    """The plan's own breakdown per stage (what `partita plan` writes), reserve excluded, and
    the moment it names."""
    cluster = parse_short(plan.cluster["name"])
    cm = CostModel(plan.model_spec, cluster, seq_len=plan.seq_len, dtype=plan.dtype)
    out = {}
    for m in attach_prediction(plan, cm).prediction.memory:
        categories = m.category_bytes()
        categories.pop("reserve")
        out[m.stage] = (m.peak_at, categories)
    return out


@pytest.mark.parametrize("name", list(MEMORY_PLANS))
def test_each_ranks_tracked_memory_is_the_plans_prediction(name):
    plan = MEMORY_PLANS[name]
    prediction = predicted(plan)
    for rank, measured in enumerate(run_ranks(_measure_rank, plan.world_size, plan.to_dict(), CFG)):
        moment, want = prediction[measured["stage"]]
        peak = sum(measured["memory"].values())
        assert moment in measured["moments"], f"rank {rank}: no layer {moment!r} in {sorted(measured['moments'])}"
        want, got = dict(want), dict(measured["moments"][moment])
        layers = plan.stage_of_rank(rank).layers
        if any(l.recompute != "none" for l in layers) or any(l.zero >= 2 for l in layers):
            # MemTracker labels a recomputed layer's activations as activations, FSDPMemTracker
            # (checkpointing sits inside the FSDP unit) as temporaries; the plan counts them as
            # transient. Compared together. With ZeRO 2/3 layers, which instant of a layer's
            # backward is its peak (saved activations still held, or already freed while the
            # gradient and reduce-scatter temporaries are held) depends on when gloo's thread
            # finishes the asynchronous reduce-scatter: under load, fsdp-zero3 moved about
            # 120 KB from activations to temporaries at the same moment in 1 run of 7, the sum
            # within 8 %. The sum is what the timing does not change.
            for d in (want, got):
                d["activations"] += d.pop("transient")
        if _copies_out_alone(plan.stage_of_rank(rank), moment):
            # A ZeRO-3 layer's backward has two instants a few KiB apart: its gather copied out
            # (the gather's buffer and the parameters both alive: two copies, little else) and
            # its working set (one copy, the recomputed activations). Which the tracker sees as
            # the larger depends on whether gloo's thread has finished the reduce-scatter of the
            # layer after it: CI saw pp-fsdp's layers.3 at 2 copies once (total within 5 % of
            # the prediction). Where the layer before it prefetches the same copy (also ZeRO-3),
            # both instants hold two copies and the gathered weights are still compared apart.
            for d in (want, got):
                d["activations"] += d.pop("gathered_weights")
        assert set(got) == set(want), f"rank {rank}: categories {sorted(got)} vs {sorted(want)}"
        total_want = sum(want.values())
        where = f"{name}, rank {rank} (stage {measured['stage']}, at {moment}), measured {got}, predicted {want}"
        assert abs(peak - total_want) <= 0.10 * total_want, f"{where}: peak {peak} B, predicted {total_want} B"
        for category in want:
            slack = max(0.10 * want[category], 0.05 * total_want)
            assert abs(got[category] - want[category]) <= slack, (
                f"{where}: {category} {got[category]} B, predicted {want[category]} B")


def _copies_out_alone(stage, moment: str) -> bool:
    """Whether the moment is the backward of a ZeRO-3 layer whose backward prefetches nothing
    (first in its chunk, or after a layer that keeps its copy)."""
    name, _, phase = moment.partition(" ")
    for chunk in stage.chunk_layers():
        for i, layer in enumerate(chunk):
            if layer.name == name:
                return phase == "backward" and layer.zero == 3 and (i == 0 or chunk[i - 1].zero != 3)
    return False


def test_a_tied_heads_copy_is_priced():
    """A tied embedding and head on different stages: the last stage keeps its own copy of the
    weight (runtime/tied.py). Each rank's peak is the prediction within 10 %, and so are the
    categories that hold the copy's state for the whole step (weights, optimizer state: the
    copy's fp32 shard is 14 % of the last stage's weights, so a rank without it fails). The
    copy's gathered weights and gradient are not compared apart: the tracker records block
    moments only, and the plan's peak here is the head's backward, so they can only be read at
    the tracker's own peak, where they depend on which of two moments wins, and that on when
    gloo's thread finishes the last micro-batch's asynchronous reduce-scatter (CI saw the last
    stage's peak once at a moment holding 266 KB of gathered weights and 366 KB of gradients
    against 466 KB each, the total within 10 %). (The activations and transients of gpt2 blocks
    are not compared either: their backward working set is over-predicted, by 160 KiB on these
    ranks.)"""
    plan = make_plan("tiny-gpt2", pp=2, dp=2, boundaries=[2], num_micro_batches=3, micro_batch=1, layer=dict(zero=1))
    prediction = predicted(plan)
    for rank, measured in enumerate(run_ranks(_measure_rank, plan.world_size, plan.to_dict(), CFG)):
        _, want = prediction[measured["stage"]]
        got, peak = measured["memory"], sum(measured["memory"].values())
        assert abs(peak - sum(want.values())) <= 0.10 * sum(want.values()), (rank, got, want)
        for category in ("weights", "optimizer"):
            assert abs(got[category] - want[category]) <= 0.10 * want[category], (rank, category, got, want)


# Mixtures of experts (docs/moe.md): the whole rank's tracked peak against the prediction. Their
# categories are not compared: the expert parts' transients are priced by the dense rules, an
# upper bound (measured at tp 2 with full recomputation: activations and transient 167 KB
# against 327 KB predicted, the total 9.8 % under).
MOE_SPEC = dataclasses.replace(BUILTIN["tiny-moe"], name="tiny-moe-2", n_layers=2)
_TP2 = dict(tensor_parallel=2, sequence_parallel=True)
MOE_MEMORY_PLANS = {
    "ep2-selective": make_plan(MOE_SPEC, dp=2, layer=dict(zero=1, recompute="selective")).with_mesh(ep=2),
    "tp2-selective": make_plan(MOE_SPEC, dp=2, tp=2, layer=dict(_TP2, zero=1, recompute="selective")),
    "cp2": make_plan(MOE_SPEC, dp=2, cp=2, layer=dict(zero=1)),
}


@pytest.mark.parametrize("name", list(MOE_MEMORY_PLANS))
def test_a_mixture_of_experts_peak_is_near_the_prediction(name):
    plan = MOE_MEMORY_PLANS[name]
    prediction = predicted(plan)
    for rank, measured in enumerate(run_ranks(_measure_rank, plan.world_size, plan.to_dict(), CFG)):
        want = sum(prediction[measured["stage"]][1].values())
        peak = sum(measured["memory"].values())
        assert abs(peak - want) <= 0.12 * want, f"{name}, rank {rank}: peak {peak} B, predicted {want} B"
