"""torchtitan's FSDP inside a pipeline runs as ZeRO 1 (``parallel.pipeline_zero_rule``): torch's
pipelining keeps an FSDP stage's parameters gathered and its gradients unsharded until the last
micro-batch's backward, and torchtitan does not reshard after forward under pp; DeepSpeed's
pipeline engine and Megatron-FSDP refuse ZeRO 2 and 3 under pp. The rule, the validator, the searches that obey it, and the
export that writes it."""

import dataclasses

import pytest

from partita import parallel
from partita.cli.export import export_plan
from partita.cluster import parse_short
from partita.errors import PartitaError
from partita.model_io import load_model
from partita.search.planner import PlanRequest, make_plan
from partita.search.uniform import SearchSpace
from partita.validate import validate_plan

MODEL = load_model("llama-3-8b")
CLUSTER = parse_short("2x8xH100")


def test_the_rule_names_the_engine_the_layers_and_the_way_out():
    assert parallel.pipeline_zero_rule("torchtitan", 1, [("layers.0", 3)]) is None
    assert parallel.pipeline_zero_rule("partita", 4, [("layers.0", 3)]) is None  # its runtime sets each unit's policy
    assert parallel.pipeline_zero_rule("torchtitan", 2, [("layers.0", 1), ("head", 0)]) is None
    why = parallel.pipeline_zero_rule("torchtitan", 2, [("layers.0", 3), ("layers.1", 2), ("head", 1)])
    assert "2 layers (layers.0, layers.1)" in why and "use zero 0 or 1, or pp 1" in why
    assert parallel.pipeline_zero_levels("torchtitan", 2, (0, 1, 2, 3)) == (0, 1)
    # outside a pipeline torchtitan has no ZeRO 1 (DDP, or FSDP2 reducing every micro-batch), and under
    # context parallelism no ZeRO 0 (it shards over dp x cp): what its export writes, the rule now says
    assert parallel.pipeline_zero_levels("torchtitan", 1, (0, 1, 2, 3)) == (0, 2, 3)
    assert parallel.pipeline_zero_levels("torchtitan", 1, (0, 1, 2, 3), cp=2) == (2, 3)
    assert parallel.pipeline_zero_levels("torchtitan", 2, (0, 1, 2, 3), cp=2) == (1,)
    why = parallel.pipeline_zero_rule("torchtitan", 1, [("layers.0", 1), ("head", 2)])
    assert "engine torchtitan has no ZeRO 1 outside a pipeline" in why and "1 layers (layers.0) have zero 1 at pp 1" in why
    assert "use zero 0 or 2 or 3" in why
    assert "no ZeRO 0" in parallel.pipeline_zero_rule("torchtitan", 1, [("layers.0", 0)], cp=2)
    assert parallel.pipeline_zero_levels("partita", 1, (0, 1, 2, 3), cp=2) == (0, 1, 2, 3)
    # DeepSpeed's pipeline engine refuses ZeRO 2 and 3 outright (its PipelineEngine's assertion)
    why = parallel.pipeline_zero_rule("deepspeed", 2, [("layers.0", 2)])
    assert "engine deepspeed refuses ZeRO 2 and 3 in a pipeline" in why and "use zero 0 or 1, or pp 1" in why
    assert parallel.pipeline_zero_levels("deepspeed", 4, (0, 1, 2, 3)) == (0, 1)
    assert parallel.pipeline_zero_levels("deepspeed", 1, (0, 1, 2, 3)) == (0, 1, 2, 3)
    # Megatron-LM's ZeRO 2 and 3 are Megatron-FSDP, which refuses pipeline parallelism
    assert "engine megatron refuses ZeRO 2 and 3 in a pipeline" in parallel.pipeline_zero_rule(
        "megatron", 2, [("layers.0", 3)])
    assert parallel.pipeline_zero_levels("megatron", 2, (0, 1, 2, 3)) == (0, 1)


@pytest.fixture(scope="module", params=["uniform", "cpsat"])
def pipelined(request):
    """torchtitan and Partita's runtime planned at pp 2 (pinned) with every ZeRO level allowed."""
    plans = {}
    for engine in ("torchtitan", "deepspeed", "megatron", "partita"):
        req = PlanRequest(model=MODEL, cluster=CLUSTER, seq_len=4096, global_batch=64, engine=engine, dtype="bf16",
                          search=request.param, time_limit_s=20,
                          space=SearchSpace(pipeline=(2,), zero_levels=(0, 1, 2, 3)))
        plans[engine] = make_plan(req)[0]
    return plans


def test_the_search_plans_torchtitan_s_pipelines_at_zero_1_at_most(pipelined):
    tt = pipelined["torchtitan"]
    assert tt.pp == 2 and max(l.zero for l in tt.layer_strategies()) <= 1
    validate_plan(tt, MODEL, CLUSTER)
    for engine in ("deepspeed", "megatron"):  # pipelines that refuse ZeRO 2 and 3
        plan = pipelined[engine]
        assert plan.pp == 2 and max(l.zero for l in plan.layer_strategies()) <= 1
        validate_plan(plan, MODEL, CLUSTER)
    assert pipelined["partita"].pp == 2  # Partita's runtime sets each unit's policy itself


@pytest.fixture(scope="module")
def zero3_pipeline():
    """A plan for Partita's runtime at pp 2, every layer at ZeRO 3."""
    req = PlanRequest(model=MODEL, cluster=CLUSTER, seq_len=4096, global_batch=64, engine="partita", dtype="bf16",
                      search="uniform", space=SearchSpace(pipeline=(2,), zero_levels=(3,), tensor_parallel=(1,)))
    plan = make_plan(req)[0]
    assert plan.pp == 2 and {l.zero for l in plan.layer_strategies()} == {3}
    return plan


def test_the_validator_refuses_zero_3_in_a_torchtitan_pipeline(zero3_pipeline):
    validate_plan(zero3_pipeline, MODEL, CLUSTER)
    with pytest.raises(PartitaError, match="engine torchtitan runs FSDP inside a pipeline as ZeRO 1"):
        validate_plan(dataclasses.replace(zero3_pipeline, engine="torchtitan"), MODEL, CLUSTER)
    with pytest.raises(PartitaError, match="engine deepspeed refuses ZeRO 2 and 3 in a pipeline"):
        validate_plan(dataclasses.replace(zero3_pipeline, engine="deepspeed"), MODEL, CLUSTER)


def test_the_torchtitan_export_of_a_pipelined_zero_3_plan_writes_fsdp_as_zero_1(zero3_pipeline):
    """A plan for Partita's runtime at pp 2 and ZeRO 3 exports to torchtitan at ZeRO 1: FSDP over
    dp with parameters kept gathered, priced with their gathered copy and unsharded gradients."""
    import tomllib

    plan = zero3_pipeline
    ex = export_plan(plan, "torchtitan")
    assert {l.zero for l in ex.exported.layer_strategies()} == {1}
    par = tomllib.loads(ex.text)["parallelism"]
    assert par["data_parallel_shard_degree"] == plan.dp and par["fsdp_reshard_after_forward"] == "never"
    assert any("zero" in c.lower() for c in ex.changes)
    grads = lambda p: max(m.gradients_bytes for m in p.prediction.memory)  # noqa: E731
    assert grads(ex.exported) > 4 * grads(plan)  # unsharded over dp 8 where ZeRO 3 shards them


def test_the_reasons_are_the_barred_levels_own_and_said_once():
    """``engine_zeros`` bars each level with its own reason; a message names only the reasons of
    the levels asked for, each once (before, a torchtitan plan at cp 2 asked for ZeRO 0 listed
    every rule of both pipeline depths, the context-parallel one twice)."""
    allowed, barred = parallel.engine_zeros("torchtitan", 2, cp=2)
    assert allowed == (1,) and set(barred) == {0, 2, 3}
    why = parallel.zero_reasons([barred, parallel.engine_zeros("torchtitan", 1, cp=2)[1]], [0])
    assert why == "engine torchtitan shards the parameters over dp x cp under context parallelism (no ZeRO 0)"
    assert parallel.engine_zeros("partita", 4, cp=8) == ((0, 1, 2, 3), {})
