"""A mixture of experts under tensor and context parallelism, priced (search/experts.py, docs/moe.md):
the attention split tp ways, the MoE on each rank's sequence shard with whole experts, the MoE's
weights replicated over tp and sharded over dp x cp x tp; and the planner's search over tp and cp
for a mixture of experts (no torch)."""

import pytest

from partita import parallel
from partita.cluster import parse_short
from partita.model import BUILTIN
from partita.plan import LayerStrategy
from partita.search.analytic import Shard, activation_bytes, forward_matmuls
from partita.search.costs.model import CostModel
from partita.search.engines import ENGINES
from partita.search.experts import all_to_all_bytes, moe_parts
from partita.search.planner import PlanRequest, make_plan
from partita.search.uniform import SearchSpace, sp_choices
from partita.units import round_up_to_grain

MIXTRAL = BUILTIN["mixtral-8x7b"]
H100 = parse_short("4x8xH100")
KIND = MIXTRAL.kinds["block"]


def flops(tp: int) -> int:
    sh = Shard.of(KIND, tp=tp, micro_batch=1, seq_len=4096, dtype="bf16")
    return sum(2 * m * n * k for _, m, n, k in forward_matmuls(KIND, sh))


def test_tp_halves_a_moe_blocks_work_and_keeps_its_experts_whole():
    sh = Shard.of(KIND, tp=2, micro_batch=1, seq_len=4096, dtype="bf16")
    assert sh.ffn == KIND.ffn and sh.moe_tokens == 2048 and sh.heads == KIND.heads // 2
    assert flops(2) == flops(1) // 2
    # Its activations: the MoE's on half the tokens (attention's heads halved), so about half.
    full = activation_bytes(KIND, tp=1, micro_batch=1, seq_len=4096, dtype="bf16", sequence_parallel=False)
    split = activation_bytes(KIND, tp=2, micro_batch=1, seq_len=4096, dtype="bf16", sequence_parallel=True)
    assert 0.45 * full < split < 0.55 * full


def test_the_moes_weights_are_sharded_over_dp_x_tp():
    cm = CostModel(MIXTRAL, H100, seq_len=4096)
    s = LayerStrategy(name="layers.0", tensor_parallel=2, sequence_parallel=True, zero=3, recompute="full")
    m = cm.layer_memory("block", "H100", s, dp=8, micro_batch=1, num_micro_batches=4)
    dense = KIND.params - KIND.moe_params  # attention (split tp ways) and norms
    attention = KIND.matmul_params - KIND.moe_params
    assert cm.param_count("block", 2) == attention // 2 + (dense - attention)
    expected = round_up_to_grain(4 * (attention // 2 + dense - attention) // 8) + round_up_to_grain(4 * KIND.moe_params // 16)
    assert m.weights == expected
    # under ep 4 the rank's 2 experts over dp/ep x tp = 4 replicas, the router over dp x tp = 16
    parts = moe_parts(cm.at_ep(4), "block", 2)
    assert [(p.params, p.replicas(8, 1)) for p in parts] == [(KIND.expert_params // 4, 4),
                                                              (KIND.router_params + KIND.shared_expert_params, 16)]
    assert moe_parts(cm, "block", 1) == () and moe_parts(cm, "head", 2) == ()


def test_a_moe_block_at_tp_runs_the_attentions_collectives_only():
    cm = CostModel(MIXTRAL, H100, seq_len=4096, engine=ENGINES["torchtitan"])  # each collective exposed
    g = cm.cluster.groups[0]
    t = cm.layer_time("block", g, LayerStrategy(name="layers.0", tensor_parallel=2, sequence_parallel=True),
                      dp=1, micro_batch=1)
    act = 4096 * KIND.hidden * 2
    link = cm.tp_link(g, 2)
    pair = cm.collective_s("all_gather", act, 2, link, "H100") + cm.collective_s("reduce_scatter", act, 2, link, "H100")
    stats = cm.collective_s("all_reduce", (2 * KIND.experts + 1) * 4, 2, link, "H100")
    assert t.tp_comm_s == pytest.approx(2 * pair + stats)
    # the all-to-alls carry the rank's half of the tokens
    view = cm.at_ep(4)
    assert all_to_all_bytes(view, recompute="none", micro_batch=1, tp=2).forward[1] * 2 == \
        all_to_all_bytes(view, recompute="none", micro_batch=1).forward[1]


def test_experts_split_over_tp_hold_a_tp_th_gather_their_rows_and_keep_them():
    """Megatron-Core's expert tensor parallelism = tp (``Engine.expert_tp`` "split"): each rank
    holds a tp-th of its E/ep experts, replicated over dp x cp / ep only; it all-gathers the
    tp group's routed rows (t k h) before the experts and reduce-scatters after, forward and
    backward (and again for a recomputed forward), and keeps the gathered rows for the weight
    gradients, (tp - 1)/tp of them beyond what whole experts keep. The experts' FLOPs a rank do
    not change."""
    engine = ENGINES["megatron"]
    split = engine.with_options({"expert_tp": "split"})
    assert engine.expert_tp == "whole"
    whole_cm, split_cm = (CostModel(MIXTRAL, H100, seq_len=4096, engine=e).at_ep(4) for e in (engine, split))
    parts = moe_parts(split_cm, "block", 2)
    assert [(p.params, p.replicas(8, 1)) for p in parts] == [(KIND.expert_params // 4 // 2, 2),
                                                              (KIND.router_params + KIND.shared_expert_params, 16)]
    g = H100.groups[0]
    rows = 4096 * KIND.experts_per_token * KIND.hidden * 2
    assert split_cm.expert_rows_bytes(1) == rows
    link = split_cm.tp_link(g, 2)
    pair = split_cm.collective_s("all_gather", rows, 2, link, "H100") + split_cm.collective_s("reduce_scatter", rows, 2,
                                                                                              link, "H100")
    for recompute, backward_pairs in (("none", 1), ("full", 2)):
        s = LayerStrategy(name="layers.0", tensor_parallel=2, sequence_parallel=True, zero=1, recompute=recompute)
        w, sp = (cm.layer_time("block", g, s, dp=8, micro_batch=1) for cm in (whole_cm, split_cm))
        assert sp.tp_comm_s - w.tp_comm_s == pytest.approx((1 + backward_pairs) * pair)
        assert sp.compute_s == pytest.approx(w.compute_s)
    s = LayerStrategy(name="layers.0", tensor_parallel=2, sequence_parallel=True, zero=1, recompute="none")
    mw, ms = (cm.layer_memory("block", "H100", s, dp=8, micro_batch=1, num_micro_batches=4) for cm in (whole_cm, split_cm))
    assert ms.activations - mw.activations == pytest.approx(rows // 2, abs=2 * 1024 * 1024)
    # The compute-dtype copy and the gradients are a tp-th; the fp32 master and Adam's moments,
    # sharded (ZeRO 1) over the replicas of what the rank holds, are the same bytes either way.
    assert ms.gathered_weights < 0.55 * mw.gathered_weights and ms.gradients < 0.55 * mw.gradients
    assert ms.weights == mw.weights and ms.optimizer == mw.optimizer
    full = LayerStrategy(name="layers.0", tensor_parallel=2, sequence_parallel=True, zero=1, recompute="full")
    mw, ms = (cm.layer_memory("block", "H100", full, dp=8, micro_batch=1, num_micro_batches=4)
              for cm in (whole_cm, split_cm))
    assert ms.activations == mw.activations  # recomputed: only the block's input is kept
    with pytest.raises(Exception, match="expert_tp"):
        engine.with_options({"expert_tp": "halves"})


def test_megatron_folds_the_expert_ranks_into_a_node():
    """Megatron-Core 0.10+ builds the experts' groups with their own rank generator (the expert tp,
    then ep: ``Engine.expert_ranks`` "folded"), so at tp 4 x cp 2 the 8 ep ranks of whole experts
    are one node and all-to-all over NVLink, where ep taken from the data-parallel ranks (Partita's
    runtime, Megatron-Core 0.9) spans 64 GPUs, 8 nodes; split experts put them tp apart."""
    from partita.search.experts import ep_link

    cluster = parse_short("8x8xH100")
    g = cluster.groups[0]
    megatron = ENGINES["megatron"]
    assert megatron.expert_ranks == "folded" and ENGINES["partita"].expert_ranks == "data_parallel"
    links = {}
    for name, engine in (("folded", megatron), ("split", megatron.with_options({"expert_tp": "split"})),
                         ("data_parallel", megatron.with_options({"expert_ranks": "data_parallel"}))):
        cm = CostModel(MIXTRAL, cluster, seq_len=8192, engine=engine).at_cp(2, "ring").at_ep(8)
        links[name] = ep_link(cm, g, 4)
    assert links["folded"].kind == "nvlink"
    assert links["split"].kind == links["data_parallel"].kind == "network"
    assert links["folded"].gbps > links["data_parallel"].gbps


def test_sequence_parallelism_is_the_only_choice_for_a_moe_at_tp():
    cm = CostModel(MIXTRAL, H100, seq_len=4096)
    assert sp_choices(cm, 2, SearchSpace()) == (True,)
    assert sp_choices(cm, 2, SearchSpace(sequence_parallel=(False,))) == ()
    assert sp_choices(CostModel(BUILTIN["llama-2-7b"], H100, seq_len=4096), 2, SearchSpace()) == (False, True)
    assert parallel.tp_rule(KIND, 8) is None and "kv_heads 8" in parallel.tp_rule(KIND, 16)


def test_mixtral_plans_at_tp_2():
    req = PlanRequest(model=MIXTRAL, cluster=H100, seq_len=4096, global_batch=1024, workers=1, seed=0,
                      space=SearchSpace(tensor_parallel=(2,)))
    plan, _ = make_plan(req)
    assert plan.tp == 2
    blocks = [l for l in plan.layer_strategies() if MIXTRAL.role_of(l.name) == "block"]
    assert all(l.tensor_parallel == 2 and l.sequence_parallel for l in blocks)


def test_mixtral_at_32k_picks_context_parallelism():
    req = PlanRequest(model=MIXTRAL, cluster=parse_short("8x8xH100"), seq_len=32768, global_batch=1024, workers=1,
                      seed=0)
    plan, _ = make_plan(req)
    assert plan.cp >= 2
    compared = {o.cp: o for o in plan.solver.context_parallel}
    assert compared[1].fits and compared[plan.cp].objective_us < compared[1].objective_us


@pytest.mark.parametrize("args, says", [
    (["--tp", "3"], "heads 32 is not divisible by tensor-parallel degree 3; choose a degree that divides heads and "
                    "kv_heads"),
    (["--tp", "2", "--no-sequence-parallel"], "needs sequence parallelism"),
    (["--tp", "2", "--seq-len", "4095"], "choose a sequence length tp divides"),
    (["--cp", "3"], "cp dividing the sequence length 4096"),
])
def test_bad_moe_layouts_get_one_line(args, says, capsys, tmp_path):
    from partita.cli import main

    assert main(["plan", "--model", "mixtral-8x7b", "--cluster", "4x8xH100", *args, "-o", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "p.yaml").exists()


def test_a_moe_s_selective_recomputation_reruns_its_collectives_without_their_products():
    """Under a selective scope that reruns the block to its last product (Partita's "ops") a
    mixture's recomputed forward runs the attention's all-gather and reduce-scatter again but
    none of the products they were chunked beside: both exposed whole. Megatron-LM's
    attention-core scope reruns nothing that communicates: no TP collective, no all-to-all."""
    PARTITA = ENGINES["partita"]

    g = H100.groups[0]
    overlap = CostModel(MIXTRAL, H100, seq_len=4096, engine=PARTITA.with_options({"tp_overlap": True}))
    assert overlap.engine.selective_scope == "ops"
    t = {r: overlap.layer_time("block", g, LayerStrategy(name="layers.0", tensor_parallel=8, sequence_parallel=True,
                                                          recompute=r), dp=1, micro_batch=1) for r in ("none", "selective")}
    act = 4096 * KIND.hidden * 2
    link = overlap.tp_link(g, 8)
    pair = overlap.collective_s("all_gather", act, 8, link, "H100") + overlap.collective_s("reduce_scatter", act, 8,
                                                                                           link, "H100")
    stats = overlap.collective_s("all_reduce", (2 * KIND.experts + 1) * 4, 8, link, "H100")
    assert t["selective"].tp_comm_s - t["none"].tp_comm_s == pytest.approx(pair + stats)
    megatron = CostModel(MIXTRAL, H100, seq_len=4096, engine=ENGINES["megatron"]).at_ep(4)
    assert megatron.engine.selective_scope == "attention"
    m = {r: megatron.layer_time("block", g, LayerStrategy(name="layers.0", tensor_parallel=2, sequence_parallel=True,
                                                           recompute=r), dp=8, micro_batch=1) for r in ("none", "selective")}
    assert m["selective"].tp_comm_s == pytest.approx(m["none"].tp_comm_s)
    assert all_to_all_bytes(megatron, recompute="selective", micro_batch=1, tp=2) == \
        all_to_all_bytes(megatron, recompute="none", micro_batch=1, tp=2)


def test_split_experts_keep_no_gathered_rows_when_selectively_recomputed_and_reduce_across_their_group():
    """A selective scope keeps the products' outputs, not the experts' gathered input rows: split
    experts then keep what whole experts keep. Their replicas sit an expert-parallel group apart
    (ep x tp ranks folded, ep x cp x tp as Megatron-Core 0.9 placed them): at ep 2, tp 2, cp 2 the
    two replicas share a node folded and do not otherwise."""
    PARTITA = ENGINES["partita"]
    from partita.search.experts import zero_traffic

    s = LayerStrategy(name="layers.0", tensor_parallel=2, sequence_parallel=True, zero=1, recompute="selective")
    whole, split = (CostModel(MIXTRAL, H100, seq_len=4096, engine=PARTITA.with_options(o)).at_ep(2)
                    for o in ({}, {"expert_tp": "split"}))
    mw, ms = (cm.layer_memory("block", "H100", s, dp=8, micro_batch=1, num_micro_batches=4) for cm in (whole, split))
    assert ms.activations == mw.activations
    cluster = parse_short("8x8xH100")
    g = cluster.groups[0]
    folded, data_parallel = (CostModel(MIXTRAL, cluster, seq_len=4096, engine=ENGINES["megatron"].with_options(
        {"expert_tp": "split", "expert_ranks": r})).at_cp(2, "ring").at_ep(2) for r in ("folded", "data_parallel"))
    # the split experts' once-a-step sync (ZeRO 1) over 2 replicas: NVLink folded, the network otherwise
    sync = [zero_traffic(cm, g, tp=2, zero=1, dp=2)[2] for cm in (folded, data_parallel)]
    assert 0 < sync[0] < sync[1]
