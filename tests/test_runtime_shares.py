"""Uneven batch shares: data-parallel replicas running different numbers of micro-batches.

The gloo runs train a plan whose replicas take shares like 3:1 of the global batch and compare
the losses, the gradient norms (before clipping) and every parameter with one process training
on the whole batch (``runtime_helpers.run_reference``), at the tolerances of
``test_runtime_parallel``. Without the share-weighted loss, the replica with fewer micro-batches
would count each of its rows more than the others, and the gradient norms would differ by
percents. The plan-format and validator tests need no processes.
"""

import dataclasses

import pytest
import yaml

torch = pytest.importorskip("torch")

from partita.cluster import parse_short  # noqa: E402
from partita.errors import PartitaError  # noqa: E402
from partita.model import BUILTIN  # noqa: E402
from partita.plan import Plan  # noqa: E402
from partita.runtime.train import TrainConfig  # noqa: E402
from partita.validate import validate_plan  # noqa: E402
from runtime_helpers import assert_trains_like_one_process, interleaved, make_plan  # noqa: E402

CFG = TrainConfig(steps=2, warmup_steps=1, lr=1e-3)
SMALL = dataclasses.replace(BUILTIN["tiny-llama"], name="tiny-llama-4", n_layers=4)
# ZeRO 0 and 1 side by side: the two levels uneven shares run with.
ZERO01 = dict(layer=dict(zero=1), per_layer={"layers.1": dict(zero=0), "head": dict(zero=0)})


def with_shares(plan: Plan, shares: list[int]) -> Plan:
    """``plan`` with replica d running ``shares[d]`` micro-batches of the same size."""
    return dataclasses.replace(plan, batch_shares=tuple(shares), num_micro_batches=max(shares),
                               global_batch=plan.micro_batch * sum(shares))


def with_sizes(plan: Plan, sizes: list[int]) -> Plan:
    """``plan`` with replica d running ``num_micro_batches`` micro-batches of ``sizes[d]`` rows."""
    return dataclasses.replace(plan, micro_batch_sizes=tuple(sizes), micro_batch=max(sizes),
                               global_batch=plan.num_micro_batches * sum(sizes))


def validate(plan: Plan) -> None:
    validate_plan(plan, BUILTIN[plan.model["name"]] if plan.model["name"] in BUILTIN else SMALL,
                  parse_short("4xcpu"))


SHARED = {
    "dp2-3:1": with_shares(make_plan(SMALL, dp=2, **ZERO01), [3, 1]),
    "dp3-2:1:1": with_shares(make_plan(SMALL, dp=3, **ZERO01), [2, 1, 1]),
    "dp2-tp2-3:1": with_shares(make_plan(SMALL, dp=2, tp=2, layer=dict(tensor_parallel=2, sequence_parallel=True,
                                                                       zero=1)), [3, 1]),
    "pp2-dp2-3:2": with_shares(make_plan(SMALL, pp=2, dp=2, boundaries=[2], **ZERO01), [3, 2]),
    "tied-pp2-dp2-2:3": with_shares(make_plan("tiny-gpt2", pp=2, dp=2, boundaries=[1], layer=dict(zero=1)), [2, 3]),
    "pp2-v2-dp2-4:2": with_shares(interleaved(make_plan(SMALL, pp=2, dp=2, **ZERO01), [[2, 1], [1, 2]]), [4, 2]),
    # Replicas of different micro-batch sizes run the same count: every ZeRO level works.
    "sizes-dp2-3:1": with_sizes(make_plan(SMALL, dp=2, num_micro_batches=2, layer=dict(zero=3),
                                          per_layer={"layers.1": dict(zero=2), "head": dict(zero=0)}), [3, 1]),
    "sizes-dp3-2:1:1": with_sizes(make_plan(SMALL, dp=3, num_micro_batches=1, **ZERO01), [2, 1, 1]),
    "sizes-pp2-dp2-2:1": with_sizes(make_plan(SMALL, pp=2, dp=2, boundaries=[2], num_micro_batches=2,
                                              layer=dict(zero=3), per_layer={"head": dict(zero=1)}), [2, 1]),
    "sizes-dp2-tp2-1:2": with_sizes(make_plan(SMALL, dp=2, tp=2, num_micro_batches=2,
                                              layer=dict(tensor_parallel=2, sequence_parallel=True, zero=2)), [1, 2]),
}


@pytest.mark.parametrize("name", list(SHARED))
def test_uneven_shares_train_like_one_process(name, tmp_path):
    plan = SHARED[name]
    validate(plan)
    assert_trains_like_one_process(plan, CFG, tmp_path)


def test_replica_rows_partition_the_global_batch():
    from partita.runtime.data import TokenSource

    plan = with_shares(make_plan(SMALL, dp=3, micro_batch=2), [2, 1, 3])
    assert [plan.replica_rows(d) for d in range(3)] == [slice(0, 4), slice(4, 6), slice(6, 12)]
    source = TokenSource("synthetic", vocab=256, seq_len=8, global_batch=plan.global_batch, seed=0)
    whole, _ = source.batch(5)
    parts = [source.batch(5, rows=plan.replica_rows(d))[0] for d in range(3)]
    assert [len(p) for p in parts] == [4, 2, 6]
    assert torch.equal(torch.cat(parts), whole)


# ---- the plan format and the validator -----------------------------------------------------


def test_shares_round_trip_and_are_absent_by_default():
    plan = SHARED["dp3-2:1:1"]
    data = yaml.safe_load(yaml.safe_dump(plan.to_dict()))
    assert data["batch_shares"] == [2, 1, 1]
    assert Plan.from_dict(data) == plan
    plain = make_plan(SMALL, dp=2)
    assert "batch_shares" not in plain.to_dict()
    assert plain.replica_micro_batches() == (2, 2)


@pytest.mark.parametrize("value", [[3, 0], [], "3,1", [1.5, 2], [True, 1]])
def test_malformed_shares_are_refused_when_read(value):
    data = SHARED["dp2-3:1"].to_dict() | {"batch_shares": value}
    with pytest.raises(PartitaError, match="batch_shares must be a non-empty list of micro-batch counts"):
        Plan.from_dict(data)


@pytest.mark.parametrize("plan,message", [
    (with_shares(make_plan(SMALL, dp=2, layer=dict(zero=1), per_layer={"layers.2": dict(zero=3)}), [3, 1]),
     r"uneven batch_shares \[3, 1\] need zero 0 or 1 in every layer .* 1 layers have zero >= 2 \(layers.2\): use "
     r"zero 1, or equal shares"),
    (with_shares(make_plan(SMALL, dp=2, layer=dict(zero=2)), [3, 1]),
     r"uneven batch_shares \[3, 1\] need zero 0 or 1 .* 6 layers have zero >= 2 \(embed, layers.0, layers.1, \.\.\.\)"),
    (dataclasses.replace(SHARED["dp2-3:1"], global_batch=10),
     r"global_batch 10 != micro_batch 2 x the batch_shares' sum 4 \(3 \+ 1\); make the shares add up to 5 "
     r"micro-batches, or re-plan"),
    (dataclasses.replace(SHARED["dp2-3:1"], global_batch=9),
     r"global_batch 9 != .* sum 4 \(3 \+ 1\); global_batch must be a multiple of micro_batch"),
    (dataclasses.replace(SHARED["dp2-3:1"], batch_shares=(2, 1, 1)),
     r"batch_shares \[2, 1, 1\] lists 3 replicas, but dp is 2"),
    (dataclasses.replace(SHARED["dp2-3:1"], num_micro_batches=2),
     r"num_micro_batches 2 must be the largest of batch_shares \[3, 1\] \(3\)"),
    (with_shares(make_plan(SMALL, pp=2, dp=2, **ZERO01), [3, 1]),
     r"1f1b needs at least as many micro-batches as ranks: 1 < 2 \(a replica's batch share of 1\)"),
])
def test_validator_refuses_bad_shares(plan, message):
    with pytest.raises(PartitaError, match=message):
        validate(plan)


def test_sizes_round_trip_and_are_absent_by_default():
    plan = SHARED["sizes-dp3-2:1:1"]
    data = yaml.safe_load(yaml.safe_dump(plan.to_dict()))
    assert data["micro_batch_sizes"] == [2, 1, 1] and "batch_shares" not in data
    assert Plan.from_dict(data) == plan
    assert [plan.replica_rows(d) for d in range(3)] == [slice(0, 2), slice(2, 3), slice(3, 4)]
    assert "micro_batch_sizes" not in make_plan(SMALL, dp=2).to_dict()
    with pytest.raises(PartitaError, match="micro_batch_sizes must be a non-empty list of micro-batch sizes >= 1"):
        Plan.from_dict(data | {"micro_batch_sizes": [2, 0, 1]})


@pytest.mark.parametrize("plan,message", [
    (dataclasses.replace(SHARED["sizes-dp2-3:1"], micro_batch_sizes=(3, 1, 1)),
     r"micro_batch_sizes \[3, 1, 1\] lists 3 replicas, but dp is 2"),
    (dataclasses.replace(SHARED["sizes-dp2-3:1"], micro_batch=4),
     r"micro_batch 4 must be the largest of micro_batch_sizes \[3, 1\] \(3\)"),
    (dataclasses.replace(SHARED["sizes-dp2-3:1"], global_batch=9),
     r"global_batch 9 != the rows the replicas train on \(8: micro-batch counts x micro_batch_sizes \[3, 1\]\)"),
])
def test_validator_refuses_bad_sizes(plan, message):
    with pytest.raises(PartitaError, match=message):
        validate(plan)


def test_equal_shares_allow_every_zero_level():
    # Equal shares are today's plan spelled out: every replica runs the same micro-batches.
    validate(with_shares(make_plan(SMALL, dp=2, layer=dict(zero=3)), [2, 2]))


def test_a_plan_with_shares_is_priced_at_its_largest_share():
    """The step is the slowest replica (the largest share; the replicas of a stage sit on one
    device type) plus the data-parallel sync, which does not depend on the shares."""
    from partita.search.costs.model import CostModel
    from partita.search.evaluate import evaluate_plan

    cm = CostModel(SMALL, parse_short("4xcpu"), seq_len=16, dtype="fp32")
    step = {shares: evaluate_plan(with_shares(make_plan(SMALL, dp=2, **ZERO01), list(shares)), cm).step_time_s
            for shares in [(3, 1), (2, 2), (3, 3)]}
    assert step[(3, 1)] == step[(3, 3)] > step[(2, 2)]


def test_a_plan_with_sizes_is_priced_at_its_largest_size():
    from partita.search.costs.model import CostModel
    from partita.search.evaluate import evaluate_plan

    cm = CostModel(SMALL, parse_short("4xcpu"), seq_len=16, dtype="fp32")
    step = {sizes: evaluate_plan(with_sizes(make_plan(SMALL, dp=2, num_micro_batches=2), list(sizes)), cm).step_time_s
            for sizes in [(3, 1), (2, 2), (3, 3)]}
    assert step[(3, 1)] == step[(3, 3)] > step[(2, 2)]


def test_the_summary_shows_the_shares():
    from partita.cli.printing import batch_text

    assert "1 micro-batch per replica, of sizes [2, 1, 1]" in batch_text(SHARED["sizes-dp3-2:1:1"])
    eighty = dataclasses.replace(make_plan(SMALL, dp=2).with_mesh(dp=80), micro_batch=13, num_micro_batches=1,
                                 micro_batch_sizes=(13,) * 64 + (12,) * 16)
    assert batch_text(eighty) == "1 micro-batch per replica, of size 13 on 64 replicas and 12 on 16 replicas"
    assert "replica shares [2, 1, 1]" in batch_text(SHARED["dp3-2:1:1"])
    assert "shares" not in batch_text(make_plan(SMALL, dp=2))


def test_export_refuses_uneven_shares():
    from partita.cli.export import export_plan

    with pytest.raises(PartitaError, match=r"--to megatron: .* uneven batch shares \[3, 1\]; megatron runs one "
                                           r"micro-batch count on every replica"):
        export_plan(SHARED["dp2-3:1"], "megatron")
    with pytest.raises(PartitaError, match=r"--to torchtitan: .* different micro-batch sizes \(\[3, 1\]\); torchtitan runs "
                                           r"one micro-batch size on every replica"):
        export_plan(SHARED["sizes-dp2-3:1"], "torchtitan")
