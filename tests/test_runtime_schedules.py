"""The zero-bubble pipeline schedules on CPU ranks (gloo): the same training as one process.

torch's ``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble`` split each backward
into the input gradient (I) and the weight gradient (W, run later to fill the bubble). Both
run on gloo, with tensor parallelism, with FSDP2 at ZeRO 0/1 (reduced once after the step,
``runtime.schedule.reduce_after_split_backward``) and with FSDP2's mixed precision; the
validator refuses ZeRO 2/3 and recomputation with them (tests/test_schedules.py). After two
steps the losses and every parameter equal those of the same model trained in one process,
as in tests/test_runtime_parallel.py. Nothing here depends on timing: the schedules' orders
are fixed, and every comparison is of values.
"""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from runtime_helpers import interleaved, make_plan, run_parallel, run_reference  # noqa: E402
from runtime_plans import CFG, SMALL, TP2, assert_same_training  # noqa: E402

PLANS = {
    # two virtual stages per rank, uneven
    "izb-pp2": interleaved(make_plan(SMALL, pp=2, num_micro_batches=4), [[2, 1], [1, 2]], "interleaved-zb"),
    # micro-batches not a multiple of pp (one round of 3)
    "izb-pp2-m3": interleaved(make_plan(SMALL, pp=2, num_micro_batches=3), [[1, 2], [2, 1]], "interleaved-zb"),
    # the V: the first stage's ranks hold the embedding and the head
    "zbv-pp2": interleaved(make_plan(SMALL, pp=2, num_micro_batches=4), [[2, 1], [1, 2]], "zbv"),
    # three ranks, fewer micro-batches than ZB-V's full pipeline (2 pp - 1 = 5)
    "zbv-pp3-m3": interleaved(make_plan("tiny-llama", pp=3, num_micro_batches=3), [[2, 1], [1, 1], [1, 2]], "zbv"),
    # tensor parallel stages hand on a view (``to_local``), which the I pass detaches: copied
    "zbv-tp-sp": interleaved(make_plan(SMALL, pp=2, tp=2, num_micro_batches=4, layer=dict(TP2, sequence_parallel=True)),
                             [[2, 1], [1, 2]], "zbv"),
    # FSDP2 at ZeRO 0 and 1 over two replicas: one reduction after the step
    "izb-dp-zero01": interleaved(make_plan(SMALL, pp=2, dp=2, num_micro_batches=2, layer=dict(zero=1),
                                           per_layer={"layers.1": dict(zero=0), "head": dict(zero=0)}),
                                 [[2, 1], [1, 2]], "interleaved-zb"),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_zero_bubble_schedule_trains_like_one_process(name):
    assert_same_training(PLANS[name])


@pytest.mark.parametrize("schedule,chunks", [("zbv", [[1, 2], [2, 1]]), ("interleaved-zb", [[1, 2], [2, 1]])])
def test_tied_embeddings_under_zero_bubble(schedule, chunks):
    """gpt2 ties its embedding and head: under ZB-V both sit on the first stage's ranks (one
    weight, tied within the rank), under interleaved zero-bubble on two stages (the copies'
    gradients summed, ``runtime.tied``). Either way one logical weight, trained as in one
    process."""
    plan = interleaved(make_plan("tiny-gpt2", pp=2, num_micro_batches=2), chunks, schedule)
    assert ("embed" in plan.stages[0].layer_names and "head" in plan.stages[0].layer_names) == (schedule == "zbv")
    assert_same_training(plan)


def test_zero_bubble_with_mixed_precision_tracks_fp32():
    """bf16 puts FSDP2 on one rank per stage for its mixed precision (fp32 master weights): the
    weight pass writes the unsharded bf16 gradients that the step's one reduction then takes.
    The losses follow the fp32 run as in test_runtime_parallel's mixed-precision tests."""
    plan = interleaved(make_plan(SMALL, pp=2, num_micro_batches=4, dtype="bf16"), [[2, 1], [1, 2]], "zbv")
    cfg = dataclasses.replace(CFG, steps=3)
    losses, params = run_parallel(plan, cfg)
    ref_losses, ref_params = run_reference(plan, cfg)
    assert losses == pytest.approx(ref_losses, rel=1e-3)
    for name, ref in ref_params.items():
        assert params[name].dtype == torch.float32
        torch.testing.assert_close(params[name], ref, rtol=0, atol=2e-2)


def _held_micro_batches(rank: int, plan_dict: dict) -> dict:
    """Train one step, counting after every forward, input-gradient and weight-gradient pass
    the (stage, micro-batch) pairs this rank's pipeline stages hold: activations from a forward
    until its W (torch's ``fwd_cache`` until I, ``backward_state`` from I to W)."""
    from partita.plan import Plan
    from partita.runtime.train import Trainer

    trainer = Trainer(Plan.from_dict(plan_dict), dataclasses.replace(CFG, steps=1), device=torch.device("cpu"))
    stages = trainer.runner.stages
    most = {"in_flight": 0, "pending_w": 0}

    def count() -> None:
        pending = sum(len(s.backward_state) for s in stages)
        most["in_flight"] = max(most["in_flight"], sum(len(s.fwd_cache) for s in stages) + pending)
        most["pending_w"] = max(most["pending_w"], pending)

    for stage in stages:
        for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            def counted(*args, _inner=getattr(stage, method), **kwargs):
                out = _inner(*args, **kwargs)
                count()
                return out

            setattr(stage, method, counted)
    trainer.fit()
    return {"stage": trainer.meshes.place.stage.index, **most}


@pytest.mark.parametrize("name", ["izb-pp2", "izb-pp2-m3", "zbv-pp2", "zbv-pp3-m3"])
def test_the_runtime_holds_the_micro_batches_the_plan_prices(name):
    """The memory model's in-flight counts (``schedules.in_flight_chunks``: a micro-batch's
    activations from its forward until its weight gradient) and the weight-gradient inputs
    kept between I and W (``pending_weight_grads``) are what the runtime's stages hold, counted
    on each rank. (torch's memory trackers cannot follow the split backward, so the count of
    what holds the bytes is checked, not the bytes.)"""
    from partita.search.schedules import in_flight_chunks, pending_weight_grads
    from runtime_helpers import run_ranks

    plan = PLANS[name]
    m, pp, v = plan.num_micro_batches, plan.pp, plan.virtual_stages
    for held in run_ranks(_held_micro_batches, plan.world_size, plan.to_dict()):
        i = held["stage"]
        assert held["in_flight"] == in_flight_chunks(plan.schedule, i, pp, v, m)
        priced = pending_weight_grads(plan.schedule, i, pp, m)
        if plan.schedule == "zbv" and m < 2 * pp - 1:
            assert held["pending_w"] <= priced  # an upper bound there (search/schedules.py)
        else:
            assert held["pending_w"] == priced



def _measured_memory(rank: int, plan_dict: dict) -> dict:
    from partita.plan import Plan
    from partita.runtime.train import Trainer

    trainer = Trainer(Plan.from_dict(plan_dict), dataclasses.replace(CFG, memory_report=True),
                      device=torch.device("cpu"))
    trainer.fit()
    return {"stage": trainer.meshes.place.stage.index, "memory": trainer.measured_memory}


# Interleaved 1F1B (no split backward) for the memory test: each rank's in-flight pairs are
# charged at their own virtual stage's activations, moment by moment (``schedules.held_moments``).
MEMORY_PLANS = {**PLANS, "i1f1b-pp2": interleaved(make_plan(SMALL, pp=2, num_micro_batches=4), [[2, 1], [1, 2]],
                                                   "interleaved-1f1b")}


@pytest.mark.parametrize("name", ["izb-pp2", "zbv-pp2", "i1f1b-pp2"])
def test_zero_bubble_memory_is_measured_near_the_prediction(name):
    """``--memory-report`` follows the split backward (torch's trackers hook every module's
    inputs, so the stage glue hands the model its received leaf behind a view), and each rank's
    tracked peak is near the plan's (reserve excluded): measured -5 % to +12 % on these plans,
    within 15 % (1F1B's plans are held to 10 % in test_runtime_memory.py). What the tracker
    calls temporaries (the weight-gradient inputs held from I to W, made in a backward) the
    plan counts with the activations, so only the totals are compared. Interleaved 1F1B
    (i1f1b-pp2), whose in-flight pairs are charged at their own virtual stage's activations
    (``schedules.held_moments``), too. (Charged so, the zero-bubble plans measure +15 %: their
    split backward holds more than the plan prices, and they keep the largest virtual stage's
    activations for every pair.)"""
    from partita.cluster import parse_short
    from partita.search.costs.model import CostModel
    from partita.search.plans import attach_prediction
    from runtime_helpers import run_ranks

    plan = MEMORY_PLANS[name]
    cm = CostModel(plan.model_spec, parse_short(plan.cluster["name"]), seq_len=plan.seq_len,
                   dtype=plan.dtype)
    predicted = {m.stage: m.peak_bytes - m.reserve_bytes for m in attach_prediction(plan, cm).prediction.memory}
    for measured in run_ranks(_measured_memory, plan.world_size, plan.to_dict()):
        peak = sum(measured["memory"].values())
        assert peak == pytest.approx(predicted[measured["stage"]], rel=0.15)
