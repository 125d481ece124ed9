"""Mixture-of-experts costs and search: the expert-parallel view of the cost model
(search/experts.py) and the planner's search over ep (no torch)."""

import dataclasses

import pytest

from partita.cluster import parse_short
from partita.errors import PartitaError
from partita.model import BUILTIN
from partita.plan import LayerStrategy
from partita.search.costs.memory import UNRUNNABLE_BYTES
from partita.search.costs.model import CostModel
from partita.search.engines import ENGINES
from partita.search.experts import all_to_all_bytes, imbalance_s
from partita.search.planner import PlanRequest, expert_options, make_plan
from partita.search.uniform import SearchSpace
from partita.units import round_up_to_grain

MIXTRAL = BUILTIN["mixtral-8x7b"]
H100 = parse_short("4x8xH100")


def block_memory(cm, *, dp, zero, m=4):
    s = LayerStrategy(name="layers.0", zero=zero, recompute="full")
    return cm.layer_memory("block", cm.cluster.groups[0].device, s, dp=dp, micro_batch=1, num_micro_batches=m)


def test_expert_state_is_sharded_over_ep_and_zero_over_the_rest():
    cm = CostModel(MIXTRAL, H100, seq_len=4096)
    kind = MIXTRAL.kinds["block"]
    dense = kind.params - kind.expert_params
    for ep in (1, 2, 8):
        view = cm.at_ep(ep)
        m = block_memory(view, dp=16, zero=3)
        # fp32 master weights: the dense part over dp, the experts' E/ep over their dp/ep replicas
        expected = (round_up_to_grain(4 * dense // 16) if ep > 1 else round_up_to_grain(4 * kind.params // 16))
        if ep > 1:
            expected += round_up_to_grain(4 * (kind.expert_params // ep) // (16 // ep))
        assert m.weights == expected
    # With ZeRO over all of dp the experts' state per rank is the same whatever ep (sharded either
    # way); at ZeRO 0 expert parallelism divides it by ep.
    plain, ep8 = block_memory(cm, dp=16, zero=0), block_memory(cm.at_ep(8), dp=16, zero=0)
    assert ep8.optimizer < plain.optimizer / 4


def test_all_to_all_volume_formula():
    view = CostModel(MIXTRAL, H100, seq_len=4096).at_ep(8)
    rows = 1 * 4096 * 2 * 4096 * 2  # b s k h e
    t = all_to_all_bytes(view, recompute="none", micro_batch=1)
    assert t.forward == (8 * 8, rows, rows) and t.backward == (rows, rows)
    assert t.buffer == 64 + 4 * rows and t.wire == pytest.approx(t.buffer * 7 / 8)
    recomputed = all_to_all_bytes(view, recompute="full", micro_batch=1)
    assert recomputed.buffer == t.buffer + sum(t.forward)
    assert all_to_all_bytes(CostModel(MIXTRAL, H100, seq_len=4096), recompute="none", micro_batch=1).buffer == 0


def test_all_to_all_and_imbalance_slow_the_block():
    cm = CostModel(MIXTRAL, H100, seq_len=4096)
    s = LayerStrategy(name="layers.0", zero=1)
    g = cm.cluster.groups[0]
    balanced = cm.at_ep(8).layer_time("block", g, s, dp=16, micro_batch=1)
    skewed = cm.at_ep(8, 1.5).layer_time("block", g, s, dp=16, micro_batch=1)
    assert balanced.tp_comm_s > 0  # the all-to-alls, on the critical path
    assert skewed.compute_s > balanced.compute_s and skewed.forward_s > balanced.forward_s
    assert cm.at_ep(1, 1.5) is cm  # without ep every rank runs its own tokens: no imbalance to wait for


def test_the_busiest_rank_recomputes_only_the_expert_products_its_scope_runs_again():
    # (imbalance - 1) x the balanced products: forward once, backward twice, and the forward's
    # again only where the recomputation reruns them (full; torchtitan's policy: every second
    # product, w3 of w1, w3, w2; never under Partita's "ops" scope or Megatron's attention core).
    g = H100.groups[0]
    for engine, selective_reruns in (("partita", 0.0), ("megatron", 0.0), ("torchtitan", None)):
        cm = CostModel(MIXTRAL, H100, seq_len=4096, engine=ENGINES[engine]).at_ep(8, 1.5)
        fwd, none = imbalance_s(cm, g, 1, 1, "none")
        assert none == pytest.approx(2 * fwd) and fwd > 0
        assert imbalance_s(cm, g, 1, 1, "full")[1] == pytest.approx(3 * fwd)
        selective = imbalance_s(cm, g, 1, 1, "selective")[1] - none
        if selective_reruns is not None:
            assert selective == pytest.approx(selective_reruns)
        else:  # w3: one of three equal-FLOP products
            assert selective == pytest.approx(fwd / 3, rel=0.05)


def test_a_dp_that_ep_does_not_divide_does_not_fit():
    view = CostModel(MIXTRAL, H100, seq_len=4096).at_ep(8)
    assert block_memory(view, dp=4, zero=1).weights == UNRUNNABLE_BYTES


def test_ep_views_refuse_what_cannot_run():
    with pytest.raises(PartitaError, match="mixture-of-experts"):
        CostModel(BUILTIN["llama-2-7b"], H100, seq_len=4096).at_ep(2)
    with pytest.raises(PartitaError, match="divide the 8 experts"):
        CostModel(MIXTRAL, H100, seq_len=4096).at_ep(3)
    with pytest.raises(PartitaError, match=">= 1"):
        CostModel(MIXTRAL, H100, seq_len=4096).at_ep(2, 0.5)


def test_mixtral_plans_with_expert_parallelism():
    req = PlanRequest(model=MIXTRAL, cluster=H100, seq_len=4096, global_batch=1024, workers=1, seed=0)
    assert expert_options(req) == [1, 2, 4, 8]
    plan, _ = make_plan(req)
    assert plan.ep > 1 and plan.dp % plan.ep == 0 and plan.tp == 1
    # selective recomputation keeps a MoE block's products (every expert's) but its last one: between none and full
    cm = CostModel(MIXTRAL, H100, seq_len=4096).at_ep(plan.ep)
    acts = {rc: cm.layer_memory("block", "H100", LayerStrategy(name="layers.0", zero=1, recompute=rc), dp=plan.dp,
                                micro_batch=1, num_micro_batches=8).activations for rc in ("none", "selective", "full")}
    assert acts["full"] < acts["selective"] < acts["none"]
    assert plan.to_dict()["mesh"]["ep"] == plan.ep


def test_the_routing_a_plan_was_priced_at_is_in_its_file(tmp_path, capsys):
    """--moe-imbalance reaches the plan file, and `partita check` re-prices the plan at it (not
    at balanced routing): the step it prints is the plan's own."""
    from partita.cli import main
    from partita.plan import Plan

    out = tmp_path / "mixtral.yaml"
    assert main(["plan", "--model", "mixtral-8x7b", "--cluster", "4x8xH100", "--ep", "8", "--moe-imbalance", "1.5",
                 "--search", "uniform", "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.ep == 8 and plan.moe_imbalance == 1.5 and plan.to_dict()["moe_imbalance"] == 1.5
    balanced = make_plan(PlanRequest(model=MIXTRAL, cluster=H100, seq_len=plan.seq_len, global_batch=plan.global_batch,
                                     search="uniform", expert_parallel=(8,)))[0]
    assert balanced.prediction.step_time_s < plan.prediction.step_time_s  # waiting on the busiest rank costs
    capsys.readouterr()
    assert main(["check", str(out), "--cluster", "4x8xH100", "--json"]) == 0
    assert f"{plan.prediction.step_time_s}" in capsys.readouterr().out.replace(" ", "")


def test_ep_one_only_is_the_plain_search_and_dense_models_are_unchanged():
    space = SearchSpace(pipeline=(1,))
    small = parse_short("1x8xH100")
    req = PlanRequest(model=BUILTIN["llama-2-7b"], cluster=small, seq_len=4096, global_batch=64, space=space)
    dense, _ = make_plan(req)
    assert dense.ep == 1 and dense.to_dict()["mesh"]["ep"] == 1
    with pytest.raises(PartitaError, match="not a mixture-of-experts"):
        make_plan(dataclasses.replace(req, expert_parallel=(2,)))


def test_cli_plans_mixtral_and_prints_total_and_active_parameters(tmp_path, capsys):
    from partita.cli import main
    from partita.plan import Plan

    out = tmp_path / "mixtral.yaml"
    assert main(["plan", "--model", "mixtral-8x7b", "--cluster", "4x8xH100", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "46.7 B parameters, 12.9 B active per token" in text
    plan = Plan.load(out)
    assert plan.ep > 1 and f"dp {plan.dp} (ep {plan.ep}) x" in text
    assert main(["check", str(out), "--cluster", "4x8xH100"]) == 0


@pytest.mark.parametrize("config,cluster", [("hf/mixtral-8x7b.json", "4x8xH100"),
                                            ("hf/qwen1.5-moe-a2.7b.json", "1x8xH100"),
                                            ("moe/tiny-mixtral.json", "4xcpu")])
def test_moe_config_json_files_plan(config, cluster, tmp_path, capsys):
    from pathlib import Path

    from partita.cli import main

    path = Path(__file__).parent / "data" / config
    assert main(["plan", "--model", str(path), "--cluster", cluster, "-o", str(tmp_path / "p.yaml")]) == 0
    assert "active per token" in capsys.readouterr().out
