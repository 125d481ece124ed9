"""Context parallelism as a plan degree: the plan file, the validator, the search, and training.

The gloo runs train plans with ``cp`` > 1 (all-to-all and all-gather attention, ``runtime/context.py``) through
the ``Trainer`` and compare the losses, the gradient norms and every parameter with one process
training on the whole batch (``runtime_helpers.run_reference``), at the tolerances of
``test_runtime_shares``; the models use grouped-query attention (fewer kv heads than heads).
The memory test measures what autograd keeps for a block on each cp rank and compares it with
the plan's cost model (``CostModel.at_cp``). The search tests solve with the uniform grid or
one CP-SAT worker.
"""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from partita.cluster import parse_short  # noqa: E402
from partita.errors import PartitaError  # noqa: E402
from partita.model import BUILTIN, ModelSpec  # noqa: E402
from partita.plan import Plan  # noqa: E402
from partita.runtime.train import TrainConfig  # noqa: E402
from partita.validate import validate_plan  # noqa: E402
from runtime_helpers import all_to_all_block_saved_bytes, assert_trains_like_one_process, make_plan, run_ranks  # noqa: E402,E501

CFG = TrainConfig(steps=2, warmup_steps=1, lr=1e-3)
LLAMA = dataclasses.replace(BUILTIN["tiny-llama"], name="tiny-llama-cp", n_layers=2)  # 4 heads, 2 kv heads
LLAMA_GQA = dataclasses.replace(BUILTIN["tiny-llama"], name="tiny-llama-gqa", n_layers=2, heads=8, kv_heads=4)
GPT2 = dataclasses.replace(BUILTIN["tiny-gpt2"], name="tiny-gpt2-cp", n_layers=2)
TP2_SP = dict(tensor_parallel=2, sequence_parallel=True)


def spec_of(plan: Plan) -> ModelSpec:
    return plan.model_spec


def validate(plan: Plan) -> None:
    validate_plan(plan, spec_of(plan), parse_short("4xcpu"))


PLANS = {
    "cp2": make_plan(LLAMA, cp=2, layer=dict(zero=1)),
    "cp2-tp2": make_plan(LLAMA_GQA, cp=2, tp=2, layer=TP2_SP),
    "dp2-cp2-zero3": make_plan(LLAMA, dp=2, cp=2, layer=dict(zero=3), per_layer={"head": dict(zero=0)}),
    "pp2-cp2-recompute": make_plan(LLAMA, pp=2, cp=2, boundaries=[1], layer=dict(zero=1, recompute="full")),
    "gpt2-cp2": make_plan(GPT2, cp=2),
    # the all-gather variant (Llama 3's): cp 4 over 2 kv heads, and beside tp 2 with sequence parallelism
    "all-gather-cp4": make_plan(LLAMA, cp=4, cp_variant="all_gather", layer=dict(zero=1)),
    "all-gather-cp2-tp2": make_plan(LLAMA_GQA, cp=2, tp=2, cp_variant="all_gather", layer=TP2_SP),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_a_context_parallel_plan_trains_like_one_process(name, tmp_path):
    plan = PLANS[name]
    validate(plan)
    assert_trains_like_one_process(plan, CFG, tmp_path)


# ---- the plan file and the validator -------------------------------------------------------------


def test_cp_round_trips_and_its_variant_is_absent_without_it():
    plan = PLANS["cp2-tp2"]
    assert Plan.from_dict(plan.to_dict()) == plan
    assert plan.to_dict()["mesh"]["cp"] == 2 and plan.world_size == 4
    plain = make_plan(LLAMA)
    assert plain.to_dict()["mesh"]["cp"] == 1 and "cp_variant" not in plain.to_dict()
    assert Plan.from_dict(plain.to_dict()).cp == 1


@pytest.mark.parametrize("plan, message", [
    (make_plan(LLAMA, cp=4), "kv_heads (2) divisible by cp x tp = 4 x 1"),
    (make_plan(LLAMA_GQA, cp=2, tp=4, layer=dict(tensor_parallel=4), cluster="8xcpu"), "cp x tp = 2 x 4"),
    (make_plan(LLAMA, cp=2, cp_variant="ring"), "CUDA ranks only"),
    (make_plan(LLAMA, cp=3, seq_len=16, cluster="3xcpu"), "not divisible by context-parallel degree 3"),
    (dataclasses.replace(make_plan(LLAMA, cp=2), stages=(dataclasses.replace(make_plan(LLAMA, cp=2).stages[0],
                                                                             ranks=(0, 1, 2)),)),
     "every stage needs dp 1 x cp 2 x tp 1 = 2"),
])
def test_the_validator_refuses_what_cp_cannot_run(plan, message):
    cluster = parse_short(f"{plan.cluster['groups'][0]['gpus_per_node']}xcpu")
    with pytest.raises(PartitaError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_plan(plan, spec_of(plan), cluster)


def test_replicas_on_several_groups_refuse_cp():
    plan = PLANS["cp2"]
    stage = dataclasses.replace(plan.stages[0], replica_groups=("cpu",))
    with pytest.raises(PartitaError, match="replica_groups"):
        validate(dataclasses.replace(plan, stages=(stage,)))


# ---- activation memory: the runtime against the plan's cost model --------------------------------


@pytest.mark.parametrize("cp", [2, 4])
def test_activation_memory_per_rank_matches_the_cost_model(cp):
    """The issue's check: within 10 % (it is exact but for the allocation grain)."""
    from partita.plan import LayerStrategy
    from partita.search.costs.model import CostModel

    seq = 512
    cm = CostModel(LLAMA_GQA, parse_short(f"{cp}xcpu"), seq_len=seq, dtype="fp32").at_cp(cp)
    want = cm.layer_memory("block", "cpu", LayerStrategy(name="layers.0"), dp=1, micro_batch=1,
                           num_micro_batches=1).activations
    measured = run_ranks(all_to_all_block_saved_bytes, cp, LLAMA_GQA.to_dict(), 1, seq)
    assert len(set(measured)) == 1
    assert measured[0] == pytest.approx(want, rel=0.10)
    whole = CostModel(LLAMA_GQA, parse_short(f"{cp}xcpu"), seq_len=seq, dtype="fp32").layer_memory(
        "block", "cpu", LayerStrategy(name="layers.0"), dp=1, micro_batch=1, num_micro_batches=1).activations
    assert measured[0] < whole / cp * 1.5  # the point of it: about 1/cp of one rank's activations without cp


# ---- the search ------------------------------------------------------------------------------------


def _request(model, cluster: str, **kw):
    from partita.search.planner import PlanRequest

    return PlanRequest(model=model if isinstance(model, ModelSpec) else BUILTIN[model], cluster=parse_short(cluster),
                       **kw)


def test_a_long_sequence_plan_uses_cp_and_records_why():
    """The issue's first acceptance case, on the uniform grid (CP-SAT finds the same choice)."""
    from partita.search.planner import make_plan

    plan, _ = make_plan(_request("llama-3-8b", "8x8xH100", seq_len=131072, global_batch=64, search="uniform"))
    assert plan.cp > 1 and plan.world_size == 64
    options = {(o.cp, o.variant): o for o in plan.solver.context_parallel}
    assert {cp for cp, _ in options} == {1, 2, 4, 8}
    chosen = options[plan.cp, plan.cp_variant]
    assert chosen.objective_us == plan.solver.objective_us
    assert all(o.objective_us >= chosen.objective_us for o in options.values() if o.fits)
    # memory is why: without cp the plan needs more tensor parallelism or more recomputation
    (without,) = [o for (cp, _), o in options.items() if cp == 1]
    assert without.tp > chosen.tp or without.recomputed_blocks > chosen.recomputed_blocks
    assert Plan.from_dict(plan.to_dict()) == plan


def test_zero_shards_over_the_cp_ranks_without_data_parallelism():
    """torchtitan's December 2024 Table 2 ran Llama 3.1 8B at 262,144 tokens on 8 H100 as FSDP 1 x
    CP 8: FSDP over dp x cp, the 8B's state sharded over the 8 cp ranks. The search once kept ZeRO
    0 wherever dp was 1 and refused it (137.6 GiB of state a device); the validator and the
    runtime's ``dp_cp`` mesh already sharded over dp x cp, and now every search does too."""
    from partita.search.planner import make_plan

    for search in ("uniform", "cpsat"):
        plan, _ = make_plan(_request("llama-3-8b", "1x8xH100", seq_len=262144, global_batch=1, search=search,
                                     context_parallel=(8,)))
        assert (plan.dp, plan.cp) == (1, 8)
        assert all(m.peak_bytes <= m.capacity_bytes for m in plan.prediction.memory)
        assert max(l.zero for l in plan.layer_strategies()) >= 1  # ZeRO 0 everywhere needs 137.6 GiB
        validate_plan(plan, spec_of(plan), parse_short("1x8xH100"))


def test_short_sequences_plan_as_before():
    from partita.search.planner import make_plan

    plan, _ = make_plan(_request("llama-2-7b", "8xH100", seq_len=4096, global_batch=8, search="uniform"))
    assert plan.cp == 1 and not plan.solver.context_parallel and "cp" not in plan.to_dict()


def test_a_cp_plan_on_cpu_ranks_prices_as_its_view_and_validates():
    from partita.search.costs.model import CostModel
    from partita.search.evaluate import evaluate_plan
    from partita.search.planner import make_plan

    req = _request(LLAMA_GQA, "4xcpu", seq_len=64, global_batch=4, context_parallel=(2,), workers=1)
    plan, _ = make_plan(req)
    assert plan.cp == 2 and len(plan.stages[0].ranks) == plan.dp * 2 * plan.tp
    validate_plan(plan, LLAMA_GQA, req.cluster)
    cm = CostModel(LLAMA_GQA, req.cluster, seq_len=64, dtype=plan.dtype)
    assert evaluate_plan(plan, cm).step_time_s == pytest.approx(plan.prediction.step_time_s, rel=1e-9)
    # Without --cp-variant every variant the rules allow is searched (the ring runs on GPUs only)
    # and the plan is the fastest of them.
    options = {o.variant: o for o in plan.solver.context_parallel}
    assert set(options) == {"all_to_all", "all_gather"}
    assert plan.cp_variant == min(options, key=lambda v: options[v].objective_us)


def test_cp_requests_that_cannot_work_fail_in_one_line():
    from partita.search.planner import make_plan

    with pytest.raises(PartitaError, match="--cp 3"):
        make_plan(_request(LLAMA, "4xcpu", seq_len=64, global_batch=4, context_parallel=(3,)))
    with pytest.raises(PartitaError, match=r"kv_heads \(2\)"):
        make_plan(_request(LLAMA, "4xcpu", seq_len=64, global_batch=4, context_parallel=(4,), cp_variant="all_to_all"))
    # More ranks than kv heads: the all-gather variant runs it (the gathered K/V keep their heads).
    plan, _ = make_plan(_request(LLAMA, "4xcpu", seq_len=64, global_batch=4, context_parallel=(4,)))
    assert (plan.cp, plan.cp_variant) == (4, "all_gather")
    with pytest.raises(PartitaError, match=r"divisible by 2 x cp = 8"):
        make_plan(_request(LLAMA, "4xcpu", seq_len=60, global_batch=4, context_parallel=(4,), cp_variant="all_gather"))


def test_the_cost_model_prices_cp_at_s_over_cp():
    """Per-token terms at s/cp; all-to-all adds its collectives; ZeRO over dp x cp."""
    from partita.plan import LayerStrategy
    from partita.search.costs.model import CostModel

    model, cluster = BUILTIN["llama-3-8b"], parse_short("8xH100")
    base = CostModel(model, cluster, seq_len=65536)
    view = base.at_cp(8)
    assert view.seq_len == 8192 and view.plan_seq_len == 65536 and view.cluster.groups[0].gpus_per_node == 1
    assert base.at_cp(1) is base and view.at_cp(8) is view and view.at_cp(1) is base
    s = LayerStrategy(name="layers.0", zero=1)
    plain = base.layer_memory("block", "H100", s, dp=1, micro_batch=1, num_micro_batches=1)
    split = view.layer_memory("block", "H100", s, dp=1, micro_batch=1, num_micro_batches=1)
    assert split.activations < plain.activations / 7  # about 1/8, plus wo's input under all-to-all
    assert split.optimizer == pytest.approx(plain.optimizer / 8, rel=1e-3)  # ZeRO 1 over dp x cp = 8
    t = view.layer_time("block", view.cluster.groups[0], LayerStrategy(name="layers.0"), dp=1, micro_batch=1)
    assert t.cp_comm_s > 0 and t.tp_comm_s == 0  # the all-to-alls, apart from tensor parallelism's (tp 1)
