"""The cost model against hand computation."""

import pytest

from partita.units import round_up_to_grain

from partita.cluster import parse_short
from partita.devices import get_device
from partita.model_io import load_model
from partita.plan import LayerStrategy
from partita.profile import bus_bytes
from partita.search.analytic import (Shard, alternate_recomputed, attention_s, forward_matmuls,
                                     selective_recompute_time_s)
from partita.search.costs.compute import sequence_parallel_savings
from partita.search.costs.links import Link
from partita.search.costs.memory import ON_RECEIVE_BUFFERS, block_backward_transient
from partita.search.costs.model import CostModel
from partita.search.engines import ENGINES
from partita.search.evaluate import evaluate_layout
from partita.search.roofline import matmul_time_s
from partita.search.schedules import closed_form_s
from partita.units import GB


def test_7b_bytes_per_parameter_are_what_the_runtime_keeps():
    model = load_model("llama-2-7b")
    cm = CostModel(model, parse_short("8xH100"), seq_len=4096)
    params = model.n_params  # 6.738e9: llama-2-7b is untied, so every layer's parameters count
    assert abs(params - 6.738e9) / 6.738e9 < 1e-3

    def per_param(**kw) -> dict[str, float]:
        total = {"weights": 0, "gathered_weights": 0, "gradients": 0, "optimizer": 0}
        for name in model.layer_names():
            mem = cm.layer_memory(model.role_of(name), "H100", LayerStrategy(name=name), **kw)
            for k in total:
                total[k] += getattr(mem, k)
        return {k: v / params for k, v in total.items()}

    # bf16 compute under FSDP2 mixed precision: fp32 parameters (the optimizer's master copy,
    # 4 B), the bf16 copy gathered for compute (2 B), fp32 gradients accumulated over the
    # micro-batches (4 B), Adam's m and v (8 B): 18 B/param, Megatron-LM's figure for bf16
    # parameters with fp32 gradients; one micro-batch reduces each gradient at once (4 B as well).
    assert per_param(dp=1, micro_batch=1, num_micro_batches=4) == pytest.approx(
        {"weights": 4, "gathered_weights": 2, "gradients": 4, "optimizer": 8}, rel=1e-6)


def test_zero_levels_shard_what_they_should():
    model = load_model("llama-2-7b")
    cm = CostModel(model, parse_short("8xH100"), seq_len=4096)
    p = model.kinds["block"].params

    def mem(z: int, m: int):
        return cm.layer_memory("block", "H100", LayerStrategy(name="layers.0", zero=z), dp=8, micro_batch=1,
                               num_micro_batches=m)

    fields = lambda x: (x.weights, x.gathered_weights, x.gradients, x.optimizer)  # noqa: E731
    # ZeRO-0: 4 + 2 + 4 + 8; ZeRO-1 with accumulation: 6 + 12/dp (Megatron's distributed optimizer)
    assert fields(mem(0, 4)) == (4 * p, 2 * p, 4 * p, 8 * p)
    assert fields(mem(1, 4)) == (4 * p // 8, 2 * p, 4 * p, 8 * p // 8)
    assert fields(mem(1, 1)) == (4 * p // 8, 2 * p, 4 * p // 8, 8 * p // 8)  # nothing to accumulate
    assert fields(mem(2, 4)) == (4 * p // 8, 2 * p, 4 * p // 8, 8 * p // 8)
    assert fields(mem(3, 4)) == (4 * p // 8, 0, 4 * p // 8, 8 * p // 8)
    # ZeRO-3's backward holds the layer gathered again and the one before it, prefetched; at
    # either ZeRO level the unsharded fp32 gradient and the working set outweigh the forward's
    # gather spike (ZeRO-2: the flat all-gather buffer beside the kept copy, 2 x p bytes).
    working = block_backward_transient(cm, 1, 1)
    assert (mem(3, 4).peak_phase, mem(3, 4).transient_gathered) == ("backward", 2 * 2 * p)
    assert mem(3, 4).transient == round_up_to_grain(2 * 2 * p + 4 * p + working)
    assert (mem(2, 4).peak_phase, mem(2, 4).transient_gathered) == ("backward", 0)
    assert mem(2, 4).transient == round_up_to_grain(4 * p + working) > 2 * p


def test_gradients_are_reduced_in_fp32():
    model = load_model("llama-2-7b")
    cluster = parse_short("2x8xH100")
    cm = CostModel(model, cluster, seq_len=4096)
    g = cluster.groups[0]
    t = cm.layer_time("block", g, LayerStrategy(name="layers.0", zero=0), dp=16, micro_batch=1)
    link = cm.dp_link(g, 16, 1)
    assert t.dp_sync_s == pytest.approx(cm.collective_s("all_reduce", 4 * model.kinds["block"].params, 16, link))


def test_one_f_one_b_on_four_stages():
    # 4 stages of 10, 12, 11, 9 ms and 8 micro-batches: (8 - 1) * 12 + (10 + 12 + 11 + 9) = 126 ms.
    assert closed_form_s("1f1b", [0.010, 0.012, 0.011, 0.009], 8, 1) == pytest.approx(0.126)
    # one micro-batch: the stages run one after another
    assert closed_form_s("1f1b", [0.010, 0.012, 0.011, 0.009], 1, 1) == pytest.approx(0.042)


def test_ring_all_reduce_time():
    cm = CostModel(load_model("llama-2-7b"), parse_short("8xH100"), seq_len=4096)
    link = Link("nvlink", 450.0, 5e-6)
    nbytes = 1 << 30
    # 8 ranks: each sends 2 * 7/8 of the buffer, in 2 * 7 latency-bound steps, at the bus
    # bandwidth NCCL achieves on NVLink (370 of 450 GB/s, search/timing.py).
    expected = 14 * 5e-6 + 2 * 7 / 8 * nbytes / (370 * GB)
    assert cm.collective_s("all_reduce", nbytes, 8, link) == pytest.approx(expected)
    assert bus_bytes("all_gather", nbytes, 4) == pytest.approx(0.75 * nbytes)
    assert cm.collective_s("all_reduce", nbytes, 1, link) == 0.0


def test_links_follow_where_ranks_sit():
    cluster = parse_short("2x8xH100")
    cm = CostModel(load_model("llama-2-7b"), cluster, seq_len=4096)
    g = cluster.groups[0]
    assert cm.tp_link(g, 8).kind == "nvlink"
    assert cm.dp_link(g, 2, 8).kind == "network"  # 16 ranks span two nodes
    mixed = parse_short("8xH100+8xA100-80GB")
    cm2 = CostModel(load_model("llama-2-7b"), mixed, seq_len=4096)
    link = cm2.pp_link(mixed.groups[0], mixed.groups[1], 8)
    assert link.kind == "network" and link.gbps == min(g.network_gbps for g in mixed.groups)


def test_a_data_parallel_group_across_nodes_uses_the_nics_of_its_ranks():
    """NCCL runs a ring through every NIC its ranks sit by (nccl-tests#119, #319): a group with k
    ranks in each node moves data between nodes at k x one GPU's network rate, at most what
    NVLink carries; the other tp ranks' groups use the other NICs."""
    cluster = parse_short("4x8xA100-80GB")  # 25 GB/s per GPU between nodes, 300 GB/s NVLink
    cm = CostModel(load_model("llama-2-7b"), cluster, seq_len=4096)
    g = cluster.groups[0]
    assert cm.dp_link(g, 32, 1).gbps == pytest.approx(8 * 25)  # all eight NICs of each node
    assert cm.dp_link(g, 16, 2).gbps == pytest.approx(4 * 25)
    assert cm.dp_link(g, 4, 8).gbps == pytest.approx(25)  # one rank, one NIC a node
    assert cm.dp_link(g, 4, 2).kind == "nvlink"  # inside a node: untouched
    fast_nics = parse_short("4x8xH100")
    h100 = CostModel(load_model("llama-2-7b"), fast_nics, seq_len=4096)
    capped = h100.dp_link(fast_nics.groups[0], 32, 1)  # 8 x 50 GB/s NICs, NVLink's 370 GB/s achieved
    assert capped.gbps * 24 / 25 == pytest.approx(450 * 370 / 450)


def test_gradients_synced_after_the_backward_hide_behind_nothing():
    """Megatron-LM's 'local' DDP and DeepSpeed's pipeline engine start the gradient all-reduce
    when the whole backward has ended: all of it is exposed."""
    model, cluster = load_model("llama-2-7b"), parse_short("2x8xH100")
    g = cluster.groups[0]
    layers = [LayerStrategy(name="embed")] + [LayerStrategy(name=f"layers.{i}") for i in range(32)] \
        + [LayerStrategy(name="head")]
    kw = dict(dp=16, tp=1, micro_batch=1, num_micro_batches=2)
    overlapped = evaluate_layout(CostModel(model, cluster, seq_len=4096), [(g, layers)], **kw)
    after = evaluate_layout(CostModel(model, cluster, seq_len=4096, engine=ENGINES["partita"].with_options({"grad_sync": "after_backward"})),
                            [(g, layers)], **kw)
    assert after.breakdown["data_parallel_exposed"] == pytest.approx(after.stages[0].dp_sync_s)
    assert after.breakdown["data_parallel_exposed"] > overlapped.breakdown["data_parallel_exposed"]
    assert after.breakdown["compute"] == pytest.approx(overlapped.breakdown["compute"])


def test_recompute_trades_time_for_memory_and_in_flight_scales_activations():
    model = load_model("llama-2-7b")
    cluster = parse_short("8xH100")
    cm = CostModel(model, cluster, seq_len=4096)
    g = cluster.groups[0]
    plain = LayerStrategy(name="layers.0", tensor_parallel=8)
    rc = LayerStrategy(name="layers.0", tensor_parallel=8, recompute="full")
    assert cm.layer_time("block", g, rc, dp=1, micro_batch=1).total_s > cm.layer_time("block", g, plain, dp=1, micro_batch=1).total_s
    m_plain = cm.layer_memory("block", "H100", plain, dp=1, micro_batch=1, num_micro_batches=1)
    m_rc = cm.layer_memory("block", "H100", rc, dp=1, micro_batch=1, num_micro_batches=1)
    assert m_rc.activations < m_plain.activations
    # two stages, 4 micro-batches: stage 0 holds 2 in flight, stage 1 holds 1
    names = model.layer_names()
    half = len(names) // 2
    stages = [(g, [LayerStrategy(name=n) for n in names[:half]]), (g, [LayerStrategy(name=n) for n in names[half:]])]
    ev = evaluate_layout(cm, stages, dp=1, tp=1, micro_batch=1, num_micro_batches=4)
    per_mb = [sum(cm.layer_memory(model.role_of(l.name), "H100", l, dp=1, micro_batch=1, num_micro_batches=1).activations for l in ls)
              for _, ls in stages]
    # stage 0 also keeps its output per micro-batch in flight (until that micro-batch's
    # backward); the last stage keeps one micro-batch's logits
    act_msg = 1 * 4096 * model.hidden * 2
    assert ev.stages[0].activations == 2 * (per_mb[0] + act_msg)
    assert ev.stages[1].activations == 1 * per_mb[1] + 1 * 4096 * model.vocab * 2
    # the schedule's receive buffers (Partita's runtime: each allocated as its receive is posted,
    # ON_RECEIVE_BUFFERS a direction), gradients on stage 0, activations on stage 1
    assert ev.stages[0].pipeline_buffers == ev.stages[1].pipeline_buffers == ON_RECEIVE_BUFFERS * act_msg


def test_selective_recompute_lies_between_none_and_full_in_memory_and_time():
    """Selective keeps the matrix products' outputs and recomputes the rest: fewer bytes kept
    than none, more than full; a backward longer than none's by the forward's non-product work
    and its collectives but w2's reduction, shorter than full's."""
    model = load_model("llama-2-70b")
    cluster = parse_short("8xH100")
    # torchtitan's DTensor linears: every collective exposed where it is issued (Partita's own
    # runtime reduces the column-parallel input gradients beside the weight gradients), with the
    # runtime's selective scope (torchtitan's own policy: test_torchtitan_s_selective_policy...)
    cm = CostModel(model, cluster, seq_len=4096, engine=ENGINES["torchtitan"].with_options({"selective_scope": "ops"}))
    g = cluster.groups[0]
    for tp, sp in ((1, False), (8, False), (8, True)):
        s = {mode: LayerStrategy(name="layers.0", tensor_parallel=tp, sequence_parallel=sp, recompute=mode)
             for mode in ("none", "selective", "full")}
        mem = {mode: cm.layer_memory("block", "H100", s[mode], dp=1, micro_batch=1, num_micro_batches=4)
               for mode in s}
        t = {mode: cm.layer_time("block", g, s[mode], dp=1, micro_batch=1) for mode in s}
        assert mem["full"].activations < mem["selective"].activations < mem["none"].activations
        assert t["none"].backward_s < t["selective"].backward_s < t["full"].backward_s
        assert t["none"].forward_s == t["selective"].forward_s == t["full"].forward_s
        selective = cm.recompute_s("block", "H100", tp, 1, "selective")
        # under SP the rerun norms and residual add run on the sequence shard, as the forward's do
        rerun = (sequence_parallel_savings(cm, "block", "H100", tp, 1, "selective")[1]
                 - sequence_parallel_savings(cm, "block", "H100", tp, 1, "none")[1]) if sp else 0.0
        assert rerun > 0 or not sp
        assert t["selective"].compute_s == pytest.approx(t["none"].compute_s + selective - rerun)
        assert 0 < selective < cm.recompute_s("block", "H100", tp, 1, "full")
        # the collectives repeated: the forward's, but w2's reduction (the recomputation stops before it)
        act = 4096 * model.hidden * 2
        link = cm.tp_link(g, tp)
        reduction = cm.collective_s("reduce_scatter" if sp else "all_reduce", act, tp, link, "H100")
        forward_tp = t["none"].tp_comm_s / 2  # a block's TP collectives: as many in backward as in forward
        assert t["selective"].tp_comm_s == pytest.approx(t["none"].tp_comm_s + forward_tp - reduction)
        assert t["full"].tp_comm_s == pytest.approx(t["none"].tp_comm_s + forward_tp)
    # bytes by hand at tp 8 with SP: the input's 1/8, q (8 heads), k and v (1 kv head each),
    # wo's [t, h] partial sum, w1 and w3 (ffn/8 each), bf16
    t_ = 4096
    by_hand = 2 * (t_ * model.hidden // 8 + t_ * (8 + 1 + 1) * 128 + t_ * model.hidden + 2 * t_ * model.ffn // 8)
    assert mem["selective"].activations == round_up_to_grain(by_hand)


def test_torchtitan_s_selective_policy_keeps_attention_and_every_other_product():
    """torchtitan's "op" policy keeps the attention kernel's outputs, the reduce-scatters' and
    the products' but every second one: a llama block runs wk, wo and w3 again, with the
    elementwise work, and not its attention core; under SP only the all-gathers run again."""
    model = load_model("llama-2-70b")
    cluster = parse_short("8xH100")
    g = cluster.groups[0]
    titan = CostModel(model, cluster, seq_len=4096, engine=ENGINES["torchtitan"])
    ops = CostModel(model, cluster, seq_len=4096, engine=ENGINES["torchtitan"].with_options({"selective_scope": "ops"}))
    assert ENGINES["torchtitan"].selective_scope == "alternate" and ENGINES["partita"].selective_scope == "ops"
    kind, h100 = model.kinds["block"], get_device("H100")
    # the block's products in forward order: every second one runs again, but the last (w2 in a
    # llama block; in a gpt2 block w2 is the sixth and last, so only wk and wo)
    for name, rerun in (("llama-2-70b", ["wk", "wo", "w3"]), ("gpt2-xl", ["wk", "wo"])):
        block = load_model(name).kinds["block"]
        shard = Shard.of(block, tp=1, micro_batch=1, seq_len=1024, dtype="bf16")
        assert [p[0] for p in alternate_recomputed(block, shard)[1]] == rerun
    for tp, sp in ((1, False), (8, True)):
        sh = Shard.of(kind, tp=tp, micro_batch=1, seq_len=4096, dtype="bf16")
        products = {name: (m, n, k) for name, m, n, k in forward_matmuls(kind, sh)}
        rerun_products = sum(matmul_time_s(h100, *products[name], "bf16") for name in ("wk", "wo", "w3"))
        core = attention_s(h100, sh, "bf16", "sdpa")[0]
        # the same elementwise rerun under both: the difference is the products against the core
        # (the roofline's passes; the cost model's take the host's ops when those are longer)
        alternate, kept = (selective_recompute_time_s(kind, h100, sh, "bf16", keeps=k) for k in ("alternate", "ops"))
        assert alternate - kept == pytest.approx(rerun_products - core)
        if tp == 1:  # device-bound: the cost model prices the same
            assert (titan.recompute_s("block", "H100", tp, 1, "selective")
                    - ops.recompute_s("block", "H100", tp, 1, "selective")) == pytest.approx(rerun_products - core)
        layer = LayerStrategy(name="layers.0", tensor_parallel=tp, sequence_parallel=sp, recompute="selective")
        mem = titan.layer_memory("block", "H100", layer, dp=1, micro_batch=1, num_micro_batches=4)
        t_, h, d, H, KV, f = 4096, model.hidden, 128, 64 // tp, max(1, 8 // tp), model.ffn // tp
        by_hand = 2 * (t_ * h // tp  # the block's input (its sequence shard under SP)
                       + t_ * H * d + t_ * KV * d  # wq's and wv's outputs
                       + t_ * f + t_ * h  # w1's and w2's (its [t, h] partial sum)
                       + t_ * H * d) + 4 * H * t_  # the attention kernel's output and logsumexp
        if sp:
            by_hand += 2 * 2 * t_ * h // tp  # the two reduce-scatters' outputs
        assert mem.activations == round_up_to_grain(by_hand)
        none = LayerStrategy(name="layers.0", tensor_parallel=tp, sequence_parallel=sp, recompute="none")
        t = {name: titan.layer_time("block", g, s, dp=1, micro_batch=1) for name, s in (("none", none), ("sel", layer))}
        if sp:  # the two all-gathers again; both reduce-scatters kept
            gather = titan.collective_s("all_gather", t_ * h * 2, tp, titan.tp_link(g, tp), "H100")
            assert t["sel"].tp_comm_s == pytest.approx(t["none"].tp_comm_s + 2 * gather)


def test_a_send_between_groups_goes_at_the_slower_side_and_the_link_between_them():
    """Issue 12: with a measured p2p fit on the H100 side only, a send to an A100 group over a
    0.001 GB/s link between the groups was priced by the fit (2 ms for 100 MB)."""
    from partita.cluster import ClusterSpec, make_group
    from partita.devices import get_device
    from partita.model_io import load_model
    from partita.profile import CommCost, Profile, Provenance
    from partita.search.costs.memory import activation_message_bytes
    from partita.search.costs.stage import boundary_s

    h100 = make_group(name="h", device=get_device("H100"), nodes=1, gpus_per_node=8)
    a100 = make_group(name="a", device=get_device("A100-80GB"), nodes=1, gpus_per_node=8)
    cluster = ClusterSpec(name="slow-link", groups=(h100, a100), inter_group_gbps=0.001)
    fast = Profile(device="H100", dtype="bf16", provenance=Provenance(source="measured", device_name="t"),
                   comm=(CommCost(op="p2p", link="network", ranks=2, latency_s=1e-5, bandwidth_gbps=50.0),))
    model = load_model("llama-2-7b")
    cm = CostModel(model, cluster, seq_len=4096, profiles=[fast])
    nbytes = activation_message_bytes(cm, 1)
    for a, b in ((h100, a100), (a100, h100)):
        assert boundary_s(cm, a, b, dp=1, tp=1, micro_batch=1) >= 2 * nbytes / (0.001e9)
    inside = boundary_s(cm, h100, h100, dp=8, tp=1, micro_batch=1)  # one group: its own fit stands
    assert inside < 1.0
