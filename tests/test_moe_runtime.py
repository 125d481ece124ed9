"""Mixture-of-experts training on CPU/gloo: expert parallelism against one process, routing
determinism, and the all-to-all bytes the runtime sends against the cost model's count.

The parallel runs train plans with ep > 1 through the ``Trainer`` and compare losses and every
parameter with one process training the whole batch (``runtime_helpers.run_reference``), at the
tolerances of ``test_runtime_shares``. The load-balancing loss is per sequence, so it splits over
ranks and micro-batches exactly as the token loss does.
"""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from partita.cluster import parse_short  # noqa: E402
from partita.errors import PartitaError  # noqa: E402
from partita.model import BUILTIN
from partita.plan import Plan  # noqa: E402
from partita.runtime.train import TrainConfig  # noqa: E402
from partita.validate import validate_plan  # noqa: E402
from runtime_helpers import interleaved, make_plan, run_parallel, run_ranks, run_reference  # noqa: E402

CFG = TrainConfig(steps=2, warmup_steps=1, lr=1e-3)
MOE = dataclasses.replace(BUILTIN["tiny-moe"], name="tiny-moe-2", n_layers=2)
SHARED = dataclasses.replace(MOE, name="tiny-moe-shared", shared_expert_ffn=32)


def with_ep(plan: Plan, ep: int) -> Plan:
    return plan.with_mesh(ep=ep)


PLANS = {
    "ep2": with_ep(make_plan(MOE, dp=2, layer=dict(zero=1)), 2),
    "ep2-dp2-zero3": with_ep(make_plan(MOE, dp=4, layer=dict(zero=3), per_layer={"head": dict(zero=0)}), 2),
    "ep2-shared-zero0-recompute": with_ep(make_plan(SHARED, dp=2, layer=dict(zero=0, recompute="full")), 2),
    "ep2-pp2": with_ep(make_plan(MOE, dp=2, pp=2, boundaries=[1], layer=dict(zero=2)), 2),
    # two replicas of each expert at ZeRO 0 (FSDP2's hybrid mode: parallelize._divide_gradients)
    "ep2-dp4-zero0": with_ep(make_plan(MOE, dp=4, layer=dict(zero=0)), 2),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_an_expert_parallel_plan_trains_like_one_process(name, tmp_path):
    plan = PLANS[name]
    validate_plan(plan, plan.model_spec, parse_short("4xcpu"))
    cfg = dataclasses.replace(CFG, metrics=str(tmp_path / "metrics.jsonl"))
    losses, params = run_parallel(plan, cfg)
    ref_losses, ref_params = run_reference(plan, cfg)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    assert set(params) == set(ref_params)
    for key, ref in ref_params.items():
        torch.testing.assert_close(params[key], ref, rtol=1e-4, atol=5e-5, msg=lambda m: f"{key}: {m}")
    assert losses[-1] != losses[0]


def test_routing_is_deterministic_under_a_seed():
    from partita.runtime.models import build_model, materialize

    def routes(seed: int):
        model = materialize(build_model(MOE), device="cpu", seed=seed)
        x = model.embed(torch.randint(0, MOE.vocab, (2, 16), generator=torch.Generator().manual_seed(1)))
        return model.layers["0"].feed_forward.route(x.reshape(-1, MOE.hidden))[1]

    assert torch.equal(routes(0), routes(0))
    assert not torch.equal(routes(0), routes(1))
    assert routes(0).unique().numel() > 1  # tokens spread over several experts


def test_the_balancing_loss_trains_the_router():
    from partita.runtime.models import build_model, materialize

    model = materialize(build_model(MOE), device="cpu", seed=0)
    x = model.embed(torch.randint(0, MOE.vocab, (2, 16)))
    moe = model.layers["0"].feed_forward
    moe(x).sum().mul(0).backward()  # no gradient from the output: only the balancing loss's
    assert moe.router.weight.grad.abs().sum() > 0


def _count_rank(rank: int, plan_dict: dict, cfg) -> dict:
    import torch.distributed as dist

    from partita.runtime.train import Trainer

    sent = {"buffer": 0, "wire": 0, "calls": 0}
    inner = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        size = input.numel() * input.element_size()
        sent["buffer"] += size
        sent["calls"] += 1
        n = dist.get_world_size(group)
        me = dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()
        rows = input_split_sizes or [input.shape[0] // n] * n
        per_row = size // max(1, input.shape[0])
        sent["wire"] += size - rows[me] * per_row  # what leaves the rank
        return inner(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

    dist.all_to_all_single = counting
    try:
        Trainer(Plan.from_dict(plan_dict), cfg, device=torch.device("cpu")).fit()
    finally:
        dist.all_to_all_single = inner
    return sent


@pytest.mark.parametrize("name", ["ep2-dp2-zero3", "ep2-shared-zero0-recompute"])
def test_all_to_all_bytes_match_the_cost_model(name):
    from partita.search.costs.model import CostModel
    from partita.search.experts import AllToAllBytes, all_to_all_bytes

    plan = PLANS[name]
    spec = plan.model_spec
    cfg = dataclasses.replace(CFG, steps=1)
    counted = run_ranks(_count_rank, plan.world_size, plan.to_dict(), cfg)
    cm = CostModel(spec, parse_short("4xcpu"), seq_len=plan.seq_len, dtype=plan.dtype).at_ep(plan.ep)
    layers = plan.layer_strategies()
    predicted = sum((all_to_all_bytes(cm, recompute=l.recompute, micro_batch=plan.micro_batch)
                     for l in layers if spec.role_of(l.name) == "block"), AllToAllBytes(0, 0.0, (), ())) * plan.num_micro_batches
    # Every rank's buffers: routing-independent per rank for dispatch, and summed over the ep
    # group for combine (what one rank combines is what the others dispatched to it).
    assert sum(c["buffer"] for c in counted) == plan.world_size * predicted.buffer
    # Under balanced routing (ep-1)/ep of the rows leave their rank; the real routing is close.
    wire = sum(c["wire"] for c in counted) / plan.world_size
    assert 0 < wire < predicted.buffer


def test_expert_parallel_plans_are_validated():
    spec = MOE
    cluster = parse_short("4xcpu")
    plan = with_ep(make_plan(MOE, dp=2), 2)
    assert Plan.from_dict(plan.to_dict()) == plan and plan.to_dict()["mesh"]["ep"] == 2
    assert "ep" not in make_plan(MOE, dp=2).to_dict()
    with pytest.raises(PartitaError, match="data-parallel degree 2 is not divisible by expert-parallel degree 4"):
        validate_plan(with_ep(plan, 4), spec, cluster)
    validate_plan(make_plan(MOE, dp=2, layer=dict(recompute="selective")), spec, cluster)  # selective runs
    with pytest.raises(PartitaError, match="mixture-of-experts model"):
        validate_plan(with_ep(make_plan("tiny-llama", dp=2), 2), BUILTIN["tiny-llama"], cluster)


# Tensor and context parallelism of a mixture of experts (docs/moe.md): the attention split tp
# ways with sequence parallelism, the MoE on each rank's sequence shard with whole experts; the
# balancing loss's statistics summed over the cp x tp ranks of each sequence.
TP2 = dict(tensor_parallel=2, sequence_parallel=True)
SPLIT_PLANS = {
    "tp2-dp2-zero1": make_plan(MOE, dp=2, tp=2, layer=dict(TP2, zero=1)),
    "tp2-ep2-zero3": with_ep(make_plan(MOE, dp=2, tp=2, layer=dict(TP2, zero=3), per_layer={"head": dict(TP2, zero=0)}), 2),
    "tp2-shared-recompute-pp2": make_plan(SHARED, tp=2, pp=2, boundaries=[1], layer=dict(TP2, recompute="full")),
    "cp2-dp2-zero2": make_plan(MOE, dp=2, cp=2, layer=dict(zero=2)),
    "cp2-ep2-shared": with_ep(make_plan(SHARED, dp=2, cp=2, layer=dict(zero=0)), 2),
    "cp2-tp2-all-gather": make_plan(MOE, cp=2, tp=2, cp_variant="all_gather", layer=dict(TP2)),
    # interleaved 1F1B: two virtual stages a rank, each a block (the experts' all-to-alls per chunk)
    "ep2-pp2-interleaved": interleaved(with_ep(make_plan(BUILTIN["tiny-moe"], dp=2, pp=2, num_micro_batches=4,
                                                         layer=dict(zero=1)), 2), [[2, 1], [1, 2]]),
    # selective recomputation: the products' outputs kept (every expert's), the rest run again
    # (the all-to-alls and the statistics' all-reduce among it)
    "tp2-ep2-selective": with_ep(make_plan(SHARED, dp=2, tp=2, layer=dict(TP2, zero=2, recompute="selective")), 2),
    "ep2-selective": with_ep(make_plan(MOE, dp=2, layer=dict(zero=0, recompute="selective")), 2),
    "tp2-pp2-interleaved": interleaved(make_plan(BUILTIN["tiny-moe"], tp=2, pp=2, num_micro_batches=4,
                                                 layer=dict(TP2)), [[2, 1], [1, 2]]),
}


@pytest.mark.parametrize("name", list(SPLIT_PLANS))
def test_a_moe_under_tensor_or_context_parallelism_trains_like_one_process(name, tmp_path):
    plan = SPLIT_PLANS[name]
    validate_plan(plan, plan.model_spec, parse_short("4xcpu" if plan.world_size <= 4 else "8xcpu"))
    cfg = dataclasses.replace(CFG, metrics=str(tmp_path / "metrics.jsonl"))
    losses, params = run_parallel(plan, cfg)
    ref_losses, ref_params = run_reference(plan, cfg)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    assert set(params) == set(ref_params)
    for key, ref in ref_params.items():
        torch.testing.assert_close(params[key], ref, rtol=1e-4, atol=5e-5, msg=lambda m: f"{key}: {m}")
    assert losses[-1] != losses[0]


def test_all_to_all_bytes_on_sequence_shards_match_the_cost_model():
    """At tp 2 each rank dispatches its own sequence shard: half the rows of tp 1."""
    from partita.search.costs.model import CostModel
    from partita.search.experts import AllToAllBytes, all_to_all_bytes

    plan = SPLIT_PLANS["tp2-ep2-zero3"]
    cfg = dataclasses.replace(CFG, steps=1)
    counted = run_ranks(_count_rank, plan.world_size, plan.to_dict(), cfg)
    cm = CostModel(MOE, parse_short("4xcpu"), seq_len=plan.seq_len, dtype=plan.dtype).at_ep(plan.ep)
    blocks = [l for l in plan.layer_strategies() if MOE.role_of(l.name) == "block"]
    predicted = sum((all_to_all_bytes(cm, recompute=l.recompute, micro_batch=plan.micro_batch, tp=plan.tp)
                     for l in blocks), AllToAllBytes(0, 0.0, (), ())) * plan.num_micro_batches
    assert sum(c["buffer"] for c in counted) == plan.world_size * predicted.buffer
    assert predicted.buffer < all_to_all_bytes(cm, recompute="none", micro_batch=plan.micro_batch).buffer * len(blocks) * 2


def test_moe_tensor_and_context_parallel_plans_are_validated():
    cluster = parse_short("4xcpu")
    no_sp = make_plan(MOE, dp=2, tp=2, layer=dict(tensor_parallel=2))
    with pytest.raises(PartitaError, match="needs sequence parallelism"):
        validate_plan(no_sp, MOE, cluster)
    validate_plan(SPLIT_PLANS["cp2-dp2-zero2"], MOE, cluster)  # cp of a mixture of experts runs
