"""The engine that runs a plan is part of its price (search/engines.py): each behaviour changes
the term it names and nothing else, the plan records its engine, and `partita plan --engine`
searches for it."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from partita.cli import main
from partita.cluster import parse_short
from partita.errors import PartitaError
from partita.model import BUILTIN
from partita.parallel import ENGINES as NAMES
from partita.plan import Plan
from partita.search.costs.compute import gemm_shares
from partita.search.costs.memory import ON_RECEIVE_BUFFERS
from partita.search.costs.model import CostModel
from partita.search.engines import ENGINES, get_engine, linear_modules
from partita.search.evaluate import evaluate_interleaved, evaluate_layout
from partita.search.uniform import stage_layer_names, strategy

PARTITA = ENGINES["partita"]


def layers(model, *, tp=1, sp=False, zero=0, recompute="none", blocks=None):
    names = stage_layer_names(model, [blocks or model.n_layers])[0]
    return [strategy(model, n, tp=tp, sp=sp, zero=zero, recompute=recompute) for n in names]


def test_the_rule_book_and_the_cost_model_name_the_same_engines():
    assert tuple(ENGINES) == NAMES
    assert get_engine(None) == PARTITA
    with pytest.raises(PartitaError, match="unknown engine 'colossal'; valid: partita, torchtitan"):
        get_engine("colossal")
    with pytest.raises(PartitaError, match="unknown option 'prefetch'"):
        PARTITA.with_options({"prefetch": 2})


def test_deepspeed_gathers_a_block_module_by_module():
    kinds = {name: BUILTIN[name].kinds["block"] for name in ("gpt3-175b", "llama-3-8b", "mixtral-8x7b")}
    assert linear_modules(kinds["gpt3-175b"]) == 4  # fused qkv, o, fc, proj
    assert linear_modules(kinds["llama-3-8b"]) == 7  # q, k, v, o, gate, up, down
    assert linear_modules(kinds["mixtral-8x7b"]) == 5  # q, k, v, o, the router
    assert linear_modules(kinds["mixtral-8x7b"], local_experts=2) == 6


def test_zero3_module_gathers_pay_the_ring_s_latency_each_and_the_loss_grows_with_the_ranks():
    """At a fixed global batch, DeepSpeed's ZeRO-3 (a gather a linear layer, each a ring of n - 1
    steps) loses throughput per GPU as the ranks grow much faster than FSDP's one gather a block."""
    model = BUILTIN["gpt3-175b"]
    per_gpu, compute = {}, {}
    # FSDP's gathers without FSDP2's copies around them (``shard_copies``, a compute-stream term)
    engines = {"partita": PARTITA.with_options({"shard_copies": "none"}), "deepspeed": ENGINES["deepspeed"]}
    for engine in ("partita", "deepspeed"):
        for gpus in (384, 1536):
            cluster = parse_short(f"{gpus // 8}x8xA100-80GB")
            cm = CostModel(model, cluster, seq_len=2048, engine=engines[engine])
            ev = evaluate_layout(cm, [(cluster.groups[0], layers(model, zero=3, recompute="full"))], dp=gpus, tp=1,
                                 micro_batch=1, num_micro_batches=1536 // gpus)
            per_gpu[engine, gpus] = 1536 * 2048 / ev.step_time_s / gpus
            compute[engine, gpus] = ev.breakdown["compute"]
    for gpus in (384, 1536):  # the gathers change, the compute does not
        assert compute["deepspeed", gpus] == pytest.approx(compute["partita", gpus])
    assert per_gpu["partita", 384] / per_gpu["partita", 1536] < 1.15
    assert per_gpu["deepspeed", 384] / per_gpu["deepspeed", 1536] > 1.5
    assert per_gpu["deepspeed", 384] < per_gpu["partita", 384]


def test_zero_levels_below_3_are_gathered_alike_by_every_engine():
    model, cluster = BUILTIN["llama-3-8b"], parse_short("4x8xH100")
    times = {name: CostModel(model, cluster, seq_len=4096, engine=ENGINES[name]).at_ep(1).layer_time(
        "block", cluster.groups[0], strategy(model, "layers.0", tp=1, sp=False, zero=1, recompute="none"),
        dp=32, micro_batch=1).total_s for name in ("partita", "deepspeed")}
    assert times["partita"] == pytest.approx(times["deepspeed"])


def test_the_updated_parameters_gather_runs_beside_the_next_forward_or_after_the_update():
    """ZeRO-1's once-a-step all-gather of the updated parameters (Engine.param_gather): FSDP2's
    units and Megatron's --overlap-param-gather run it beside the next step's first forward, so the
    layer's forward joins the window its per-step sync hides behind; DeepSpeed gathers right after
    the update, exposed, charged with it. A ZeRO-0 layer gathers nothing and keeps the backward's
    window alone."""
    model, cluster = BUILTIN["llama-3-8b"], parse_short("4x8xH100")
    group = cluster.groups[0]

    def block(engine, zero):
        cm = CostModel(model, cluster, seq_len=4096, engine=engine).at_ep(1)
        spec = strategy(model, "layers.0", tp=1, sp=False, zero=zero, recompute="none")
        return cm, cm.layer_time("block", group, spec, dp=32, micro_batch=1)

    cm, beside = block(PARTITA, 1)
    _, after = block(PARTITA.with_options({"param_gather": "after_step"}), 1)
    _, replicated = block(PARTITA, 0)
    # the sync slows the block's passes as a data-parallel collective does (H100: its products more)
    k = cm.time_constants(group.device)
    keep_fwd, keep = (1.0 - k.collective_slowdown(share) for share in gemm_shares(cm, "block", group.device, 1, 1))
    assert keep < 1.0 - k.overlap_slowdown
    fwd, bwd, sync, gather = cm.zero_traffic("block", group, 1, 1, 32)
    assert 0 < gather < sync and (fwd, bwd) == (0.0, 0.0)
    assert beside.overlap_window_s == pytest.approx(keep * beside.backward_s + min(gather, keep_fwd * beside.forward_s))
    assert beside.overlap_window_s > keep * beside.backward_s
    assert beside.dp_sync_s == pytest.approx(sync)
    assert after.overlap_window_s == pytest.approx(keep * after.backward_s)
    assert after.dp_sync_s == pytest.approx(sync - gather)
    assert after.optimizer_s == pytest.approx(beside.optimizer_s + gather)
    assert replicated.overlap_window_s == pytest.approx(keep * replicated.backward_s)
    assert ENGINES["deepspeed"].param_gather == "after_step"
    assert {ENGINES[n].param_gather for n in ("partita", "torchtitan", "megatron")} == {"next_forward"}
    with pytest.raises(PartitaError, match="unknown param_gather 'never'"):
        PARTITA.with_options({"param_gather": "never"})


def test_megatron_prices_transformer_engines_attention_cudnn_on_hopper_flashattention_2_on_ampere():
    """Transformer Engine prefers cuDNN's fused attention on Hopper (get_attention_backend,
    "FusedAttention preference on Hopper+") and runs FlashAttention-2 on Ampere: the megatron
    engine's kernel is faster than FlashAttention-2 on an H100 and the same on an A100."""
    from partita.devices import get_device
    from partita.search.roofline import attention_time_s

    kernel = ENGINES["megatron"].attention
    assert kernel == "cudnn"
    h100, a100 = get_device("H100"), get_device("A100-80GB")
    shape = dict(batch=1, heads=8, seq=8192, head_dim=128)
    hopper = {k: sum(attention_time_s(h100, **shape, kernel=k)) for k in (kernel, "flash2")}
    assert hopper[kernel] < 0.8 * hopper["flash2"]
    assert attention_time_s(a100, **shape, kernel=kernel) == attention_time_s(a100, **shape, kernel="flash2")


def test_tensor_parallel_overlap_hides_all_but_the_first_chunk_and_needs_sequence_parallelism():
    model, cluster = BUILTIN["llama-3-70b"], parse_short("1x8xH100")
    group = cluster.groups[0]
    overlap = PARTITA.with_options({"tp_overlap": True, "column_linears": "fused"})

    def block(engine, sp):
        cm = CostModel(model, cluster, seq_len=4096, engine=engine)
        return cm.layer_time("block", group, strategy(model, "layers.0", tp=8, sp=sp, zero=0, recompute="none"),
                             dp=1, micro_batch=1)

    plain, hidden = block(PARTITA, True), block(overlap, True)
    assert hidden.compute_s == pytest.approx(plain.compute_s)
    assert plain.tp_comm_s / 8 <= hidden.tp_comm_s < 0.5 * plain.tp_comm_s
    assert hidden.total_s < plain.total_s
    assert block(overlap, False).total_s == pytest.approx(block(PARTITA, False).total_s)  # all-reduces: not split


def _block_tp_overlap(model_name: str, tp: int, seq_len: int):
    from partita.search.costs.layer_time import tp_exposed_s, tp_overlap_exposed_s

    model, cluster = BUILTIN[model_name], parse_short("1x8xH100")
    group = cluster.groups[0]
    cm = CostModel(model, cluster, seq_len=seq_len, engine=ENGINES["megatron"])
    link = cm.tp_link(group, tp)
    ag, rs = (cm.collective_s(op, seq_len * model.hidden * 2, tp, link, group.device)
              for op in ("all_gather", "reduce_scatter"))
    slowdown = cm.time_constants(group.device).overlap_slowdown
    paired = tp_overlap_exposed_s(cm, "block", group.device, tp, 1, "none", ag, rs, slowdown)[0]
    pooled = tp_exposed_s(cm.compute("block", group.device, tp, 1).forward_s, 2 * (ag + rs), tp, slowdown)
    return cm, group, rs, paired, pooled


def test_a_chunked_collective_hides_behind_its_own_products_only():
    """Under tp_overlap each collective is chunked beside the products it feeds or is fed by
    (Transformer Engine's userbuffers, torch's micro-pipelined TP): llama-3-8b's attention output
    at tp 8 (wo, 4096 x 512 a token) is shorter than its reduce-scatter, which shows by the
    difference though the MLP's products could have hidden it; where every collective fits
    beside its products (llama-2-13b at tp 2) the pass costs what the chunked pass cost before."""
    from partita.search.costs.compute import linear_windows_s

    cm, group, rs, paired, pooled = _block_tp_overlap("llama-3-8b", 8, 8192)
    wo = linear_windows_s(cm, "block", group.device, 8, 1)["wo"][0]
    assert wo < rs * 7 / 8
    assert paired >= rs * 7 / 8 - wo + rs / 8
    assert paired > pooled
    _, _, _, paired, pooled = _block_tp_overlap("llama-2-13b", 2, 4096)
    assert paired == pytest.approx(pooled)


def test_async_tp_leaves_the_summed_input_gradients_reduce_scatters_exposed():
    """torch's async TP chunks a reduce-scatter with the one product that makes its input; the
    input gradient of torchtitan's separate wq, wk, wv (and w1, w3) is a sum of products, so the
    block's two backward reduce-scatters run whole after them. Megatron's fused linears have one
    product each."""
    model, cluster = BUILTIN["llama-3-70b"], parse_short("1x8xH100")
    group = cluster.groups[0]
    layer = strategy(model, "layers.0", tp=8, sp=True, zero=0, recompute="none")
    cm = {columns: CostModel(model, cluster, seq_len=4096, engine=ENGINES["torchtitan"].with_options(
        {"tp_overlap": True, "column_linears": columns, "tp_overlap_impl": "userbuffers"}))  # the copies aside
          for columns in ("separate", "fused")}
    assert ENGINES["torchtitan"].column_linears == "separate" and ENGINES["megatron"].column_linears == "fused"
    separate, fused = (cm[c].layer_time("block", group, layer, dp=1, micro_batch=1) for c in ("separate", "fused"))
    link = cm["fused"].tp_link(group, 8)
    reduce_scatter = cm["fused"].collective_s("reduce_scatter", 4096 * model.hidden * 2, 8, link, group.device)
    # The two reduce-scatters leave the chunked pass, where each cost its first chunk (1/8) and
    # the slowdown of the compute beside the other 7/8, and are charged whole.
    slowdown = cm["fused"].time_constants(group.device).overlap_slowdown
    extra = separate.tp_comm_s - fused.tp_comm_s
    assert extra == pytest.approx(2 * reduce_scatter * 7 / 8 * (1 - slowdown))
    assert separate.compute_s == pytest.approx(fused.compute_s)
    head = [cm[c].layer_time("head", group, strategy(model, "head", tp=8, sp=True, zero=0, recompute="none"),
                             dp=1, micro_batch=1).tp_comm_s for c in ("separate", "fused")]
    assert head[0] == pytest.approx(head[1])  # the output layer is one product


def test_megatron_s_p2p_overlap_takes_the_interleaved_sends_off_the_critical_path():
    model, cluster = BUILTIN["llama-2-13b"], parse_short("4x8xH100")
    group = cluster.groups[0]
    names = stage_layer_names(model, [10, 10, 10, 10])
    per_stage = []
    for i, stage in enumerate(names):
        ls = [strategy(model, n, tp=8, sp=True, zero=1, recompute="none") for n in stage]
        blocks = [l for l in ls if l.name.startswith("layers.")]
        head, tail = [l for l in ls if l.name == "embed"], [l for l in ls if l.name == "head"]
        per_stage.append((group, [head + blocks[:5], blocks[5:] + tail]))
    kw = dict(dp=1, tp=8, micro_batch=1, num_micro_batches=8, schedule="interleaved-1f1b")
    assert PARTITA.p2p_overlap and ENGINES["torchtitan"].p2p_overlap and not ENGINES["deepspeed"].p2p_overlap
    blocking = evaluate_interleaved(CostModel(model, cluster, seq_len=4096,
                                              engine=PARTITA.with_options({"p2p_overlap": False})), per_stage, **kw)
    overlapped = evaluate_interleaved(CostModel(model, cluster, seq_len=4096), per_stage, **kw)
    assert blocking.breakdown["pipeline_send"] > 0
    assert overlapped.breakdown["pipeline_send"] < 0.5 * blocking.breakdown["pipeline_send"]
    assert overlapped.breakdown["compute"] == pytest.approx(blocking.breakdown["compute"])
    assert overlapped.step_time_s < blocking.step_time_s


def test_an_engine_whose_loss_casts_the_logits_to_fp32_holds_more_at_the_head():
    model, cluster = BUILTIN["gpt2"], parse_short("1x8xH100")
    head = strategy(model, "head", tp=1, sp=False, zero=0, recompute="none")
    memory = {name: CostModel(model, cluster, seq_len=1024, engine=ENGINES[name]).at_ep(1).layer_memory(
        "head", "H100", head, dp=8, micro_batch=8, num_micro_batches=1) for name in ("partita", "torchtitan")}
    tokens = 8 * 1024
    # kept for the backward: fp32 logits (4 bytes a logit), or the bf16 logits and a float a token
    kept = memory["torchtitan"].activations - memory["partita"].activations
    assert kept == pytest.approx(4 * tokens * model.vocab - (2 * tokens * model.vocab + 4 * tokens), abs=4096)  # the allocator grain
    # the fp32 loss's backward: 8 bytes a logit (tests/test_fp32_loss_memory.py measures it) and the
    # head input's fp32 gradient; the chunked loss's: the compute-dtype gradient and one fp32 chunk
    assert memory["torchtitan"].transient == pytest.approx(8 * tokens * model.vocab + 4 * tokens * model.hidden,
                                                           abs=4096)
    assert memory["torchtitan"].transient > 2.5 * memory["partita"].transient


@pytest.mark.parametrize("tp", [1, 8])
def test_megatron_writes_the_loss_gradient_over_its_kept_softmax(tp):
    """Megatron-Core's vocab-parallel cross entropy keeps the fp32 softmax and writes the gradient
    over it (``grad_input = softmax``): its head's backward adds only the gradient cast back to
    bf16 and the head input's fp32 gradient, where the torch stack's loss makes new fp32 gradients
    (8 bytes a logit at tp 1, measured; 14 under loss_parallel). Both keep the fp32 softmax or
    log-probabilities, 4 bytes a logit."""
    model, cluster = BUILTIN["llama-3-8b"], parse_short("1x8xH100")
    head = strategy(model, "head", tp=tp, sp=False, zero=0, recompute="none")
    memory = {name: CostModel(model, cluster, seq_len=4096, engine=ENGINES[name]).at_ep(1).layer_memory(
        "head", "H100", head, dp=8 // tp, micro_batch=1, num_micro_batches=1) for name in ("megatron", "torchtitan")}
    tokens, logits = 4096, 4096 * (model.vocab // tp)
    assert ENGINES["megatron"].loss == "fp32_in_place"
    assert memory["megatron"].transient == pytest.approx(2 * logits + 4 * tokens * model.hidden, abs=4096)
    assert memory["torchtitan"].transient > 3 * memory["megatron"].transient
    assert memory["megatron"].activations == pytest.approx(memory["torchtitan"].activations, rel=0.01)


def test_plan_engine_is_recorded_searched_for_and_refused_when_unknown(tmp_path):
    out = tmp_path / "p.yaml"
    args = ["plan", "--model", "gpt2", "--cluster", "2x8xH100", "--global-batch", "64", "--search", "uniform", "-o"]
    assert main(args + [str(out), "--engine", "deepspeed"]) == 0
    plan = Plan.load(out)
    assert plan.engine == "deepspeed" and yaml.safe_load(out.read_text())["engine"] == "deepspeed"
    assert main(args + [str(tmp_path / "q.yaml")]) == 0
    assert "engine" not in yaml.safe_load((tmp_path / "q.yaml").read_text())  # partita: left out
    assert Plan.load(tmp_path / "q.yaml").engine == "partita"
    bad = dataclasses.replace(plan).to_dict() | {"engine": "colossal"}
    with pytest.raises(PartitaError, match="engine 'colossal' is not one of partita, torchtitan, megatron, deepspeed"):
        Plan.from_dict(bad)


@pytest.mark.parametrize("sp", [False, True])
def test_megatron_reduces_a_column_parallel_input_gradient_beside_its_weight_gradient(sp):
    """Megatron-LM starts each column-parallel linear's input-gradient reduction (an all-reduce; a
    reduce-scatter under SP) before the linear's weight-gradient product and waits after it
    (LinearWithGradAccumulationAndAsyncCommunication.backward): a block's two (q, k, v and the
    MLP's first product) and the head's one run beside compute; the forward's collectives and the
    backward's all-gathers stay exposed. Priced per linear: the reduction's excess over its product
    and the product's slowdown while the two run."""
    from partita.search.costs.compute import dgrad_windows_s
    from partita.search.costs.layer_time import dgrad_exposed_s

    model, cluster = BUILTIN["llama-3-70b"], parse_short("2x8xH100")
    group = cluster.groups[0]
    on = ENGINES["megatron"].with_options({"tp_overlap": False})  # the reductions exposed but these
    off = on.with_options({"dgrad_overlap": False})
    passes = {}
    for name, engine in (("on", on), ("off", off)):
        cm = CostModel(model, cluster, seq_len=4096, engine=engine)
        for role in ("embed", "block", "head"):
            passes[name, role] = cm.tp_pass(role, group, 8, sp, "none", 1)
    cm = CostModel(model, cluster, seq_len=4096, engine=on)
    link = cm.tp_link(group, 8)
    act = 4096 * model.hidden * cm.elem
    reduction = cm.collective_s("reduce_scatter" if sp else "all_reduce", act, 8, link, group.device)
    slowdown = cm.time_constants(group.device).overlap_slowdown
    for role, linears in (("embed", 0), ("block", 2), ("head", 1)):
        windows = dgrad_windows_s(cm, role, group.device, 8, 1)
        assert len(windows) == linears
        fwd_on, bwd_on, tp_fwd_on, tp_bwd_on = passes["on", role]
        fwd_off, bwd_off, tp_fwd_off, tp_bwd_off = passes["off", role]
        assert (fwd_on, bwd_on, tp_fwd_on) == (fwd_off, bwd_off, tp_fwd_off)
        hidden = sum(reduction - dgrad_exposed_s(w, reduction, slowdown) for w in windows)
        assert tp_bwd_on == pytest.approx(tp_bwd_off - hidden, rel=1e-12)
        if linears:
            assert 0 < hidden <= linears * reduction
    # A product longer than the reduction hides it but for its slowdown; beside a shorter one the
    # reduction's excess is exposed.
    assert dgrad_exposed_s(2.0, 1.0, slowdown) == pytest.approx(slowdown * 1.0)
    assert dgrad_exposed_s(0.5, 1.0, slowdown) == pytest.approx(1.0 - 0.5)
    # Partita's runtime (DTensor) and torchtitan wait where they issue: nothing hidden.
    assert ENGINES["partita"].dgrad_overlap and not ENGINES["torchtitan"].dgrad_overlap  # runtime.tp_linear


# Korthikanti et al. 2022 (arXiv 2205.05198), Table 4: one 22B GPT layer (hidden 6144, 64 heads,
# tp 8, micro-batch 4, 2048 tokens) on A100-80GB under Megatron-LM, forward and backward in ms.
KORTHIKANTI_TABLE_4 = {(False, "none"): (7.7, 11.9), (True, "none"): (7.2, 11.8), (False, "full"): (7.7, 19.5),
                       (False, "selective"): (7.7, 13.2), (True, "selective"): (7.2, 13.1)}


def test_a_megatron_layer_is_priced_as_korthikanti_measured_it():
    """The 22B layer of Table 4 under the megatron engine (its 2022 attention, unfused): every
    variant's forward and backward within 5 % of the measurement, and the paper's orderings:
    sequence parallelism shortens the forward (the norms and residual adds on the sequence
    shard: 7.7 -> 7.2 ms), selective recomputation (the attention core alone) costs a few percent,
    full recomputation a third. Before the sequence shard's kernels and the attention-core scope
    were priced, sequence parallelism with selective recomputation was 17 % slow."""
    model = dataclasses.replace(BUILTIN["gpt3-175b"], name="gpt-22b", hidden=6144, n_layers=48, heads=64,
                                kv_heads=64, ffn=24576, seq_len=2048)
    cluster = parse_short("1x8xA100-80GB")
    group = cluster.groups[0]
    engine = ENGINES["megatron"].with_options({"attention": "unfused", "tp_overlap": False})  # Megatron-LM of 2022
    cm = CostModel(model, cluster, seq_len=2048, dtype="bf16", engine=engine)
    priced = {}
    for (sp, recompute), (fwd, bwd) in KORTHIKANTI_TABLE_4.items():
        f, b, tp_f, tp_b = cm.tp_pass("block", group, 8, sp, recompute, 4)
        priced[sp, recompute] = (f + tp_f) * 1e3, (b + tp_b) * 1e3
        assert priced[sp, recompute][0] == pytest.approx(fwd, rel=0.05)
        assert priced[sp, recompute][1] == pytest.approx(bwd, rel=0.05)
    total = {k: sum(v) for k, v in priced.items()}
    assert priced[True, "none"][0] < priced[False, "none"][0]
    assert total[False, "none"] < total[False, "selective"] < 1.1 * total[False, "none"] < total[False, "full"]
    # The torch stack's selective scope reruns the norms, activations and their collectives too.
    torch_stack = engine.with_options({"selective_scope": "ops"})
    ops = CostModel(model, cluster, seq_len=2048, dtype="bf16", engine=torch_stack).tp_pass("block", group, 8, True,
                                                                                            "selective", 4)
    assert (ops[1] + ops[3]) * 1e3 > 1.05 * priced[True, "selective"][1]


def test_megatron_selective_recomputation_keeps_all_but_the_attention_core():
    """Megatron's --recompute-granularity selective keeps what no recomputation keeps (a fused
    attention kernel holds no score matrix) and reruns the core's forward alone, without a
    collective; the torch stack's selective mode keeps less and reruns more."""
    model, cluster = BUILTIN["llama-3-70b"], parse_short("1x8xH100")
    group = cluster.groups[0]
    megatron = CostModel(model, cluster, seq_len=4096, engine=ENGINES["megatron"])
    ops = CostModel(model, cluster, seq_len=4096, engine=ENGINES["megatron"].with_options({"selective_scope": "ops"}))
    strat = {mode: strategy(model, "layers.0", tp=8, sp=True, zero=1, recompute=mode) for mode in ("none", "selective")}
    mem = {mode: megatron.layer_memory("block", "H100", strat[mode], dp=1, micro_batch=1, num_micro_batches=4)
           for mode in strat}
    assert mem["selective"].activations == mem["none"].activations
    ops_mem = ops.layer_memory("block", "H100", strat["selective"], dp=1, micro_batch=1, num_micro_batches=4)
    assert ops_mem.activations < mem["selective"].activations
    none, selective = (megatron.tp_pass("block", group, 8, True, mode, 1) for mode in ("none", "selective"))
    assert selective[3] == pytest.approx(none[3])  # no collective repeated
    rerun = selective[1] - none[1]
    assert 0 < rerun < ops.tp_pass("block", group, 8, True, "selective", 1)[1] - none[1]
    with pytest.raises(PartitaError, match="unknown selective_scope"):
        PARTITA.with_options({"selective_scope": "mlp"})


def test_deepspeed_zero2_keeps_the_parameters_whole_and_gathers_them_once_a_step():
    """DeepSpeed's ZeRO-2 (stage_1_and_2.py) keeps the bit16 parameters whole and all-gathers the
    updated partitions after the optimizer step; FSDP's SHARD_GRAD_OP (Partita's runtime) gathers
    them for every micro-batch. Both reduce-scatter every micro-batch's gradients. So per micro-batch
    DeepSpeed moves only the reduce-scatter, per step one all-gather more, and no layer peaks at a
    forward gather; at eight micro-batches a step it is the faster of the two."""
    model, cluster = BUILTIN["llama-3-8b"], parse_short("4x8xH100")
    spec = strategy(model, "layers.0", tp=1, sp=False, zero=2, recompute="none")
    t = {name: CostModel(model, cluster, seq_len=4096, engine=ENGINES[name]).at_ep(1).layer_time(
        "block", cluster.groups[0], spec, dp=32, micro_batch=1) for name in ("partita", "deepspeed")}
    zero1 = CostModel(model, cluster, seq_len=4096, engine=PARTITA).at_ep(1).layer_time(
        "block", cluster.groups[0], dataclasses.replace(spec, zero=1), dp=32, micro_batch=1)
    assert t["partita"].dp_sync_s == 0
    assert t["deepspeed"].zero_comm_s < t["partita"].zero_comm_s  # the reduce-scatter alone
    # the gather runs after the update (Engine.param_gather "after_step"), exposed, charged with it
    gather = t["deepspeed"].optimizer_s - t["partita"].optimizer_s
    assert t["deepspeed"].dp_sync_s == 0 and gather > 0
    # the gather and the reduce-scatter DeepSpeed splits between step and micro-batch are ZeRO-1's two
    assert t["deepspeed"].zero_comm_s + gather == pytest.approx(zero1.dp_sync_s, rel=1e-9)
    assert t["partita"].zero_comm_s == pytest.approx(zero1.dp_sync_s, rel=1e-9)
    # The same engine with FSDP's gathers (its loss and kernels alike): slower, and never below it in memory.
    engines = {"step": ENGINES["deepspeed"],
               "micro_batch": ENGINES["deepspeed"].with_options({"zero2_gather": "micro_batch"})}
    evs = {}
    for name, engine in engines.items():
        cm = CostModel(model, cluster, seq_len=4096, engine=engine)
        evs[name] = evaluate_layout(cm, [(cluster.groups[0], layers(model, zero=2))], dp=32, tp=1, micro_batch=1,
                                    num_micro_batches=8)
    assert evs["step"].step_time_s < evs["micro_batch"].step_time_s
    assert evs["step"].stages[0].peak_bytes <= evs["micro_batch"].stages[0].peak_bytes
    with pytest.raises(PartitaError, match="unknown zero2_gather 'never'"):
        PARTITA.with_options({"zero2_gather": "never"})


def test_deepspeed_holds_a_module_gathered_at_a_time_where_fsdp_holds_the_layer():
    """The 530B GPT DeepSpeed trained with ZeRO-3 alone on 512 A100-80GB at micro-batch 8
    (benchmarks/published_runs.yaml, ds-azure-530b-512xA100-zero3-mb8) fits only when priced as
    DeepSpeed gathers: a module (the MLP's 20480 x 81920 product) and the next, not the layer twice."""
    model = dataclasses.replace(BUILTIN["gpt3-175b"], name="gpt-530b", hidden=20480, n_layers=105, heads=128,
                                kv_heads=128, ffn=81920, seq_len=1024)
    cluster = parse_short("64x8xA100-80GB")
    peaks = {}
    for name in ("partita", "deepspeed"):
        cm = CostModel(model, cluster, seq_len=1024, dtype="fp16", engine=ENGINES[name])
        ev = evaluate_layout(cm, [(cluster.groups[0], layers(model, zero=3, recompute="full"))], dp=512, tp=1,
                             micro_batch=8, num_micro_batches=1)
        peaks[name] = ev.stages[0]
    assert peaks["partita"].peak_bytes > peaks["partita"].capacity
    assert peaks["deepspeed"].peak_bytes < peaks["deepspeed"].capacity
    module = 20480 * 81920 * 2
    assert peaks["deepspeed"].peak_gathered <= 2 * module + 2**20


def test_megatron_and_deepspeed_reduce_fp16_gradients_in_fp16_and_bf16_ones_in_fp32():
    """``Engine.fp16_grad_reduce``: a ZeRO-1 layer's per-step reduce-scatter moves 2 bytes a
    parameter under Megatron and DeepSpeed in fp16, 4 under FSDP2's fp32 ``reduce_dtype``
    (Partita, torchtitan) and under every engine in bf16; nothing else changes."""
    model, cluster = BUILTIN["llama-3-8b"], parse_short("4x8xA100-80GB")
    layer = strategy(model, "layers.0", tp=1, sp=False, zero=1, recompute="none")

    def timed(engine, dtype):
        cm = CostModel(model, cluster, seq_len=4096, dtype=dtype, engine=engine)
        return cm.reduce_bytes, cm.layer_time("block", cluster.groups[0], layer, dp=32, micro_batch=1)

    for dtype, megatron_bytes in (("fp16", 2), ("bf16", 4)):
        (pb, pt), (mb, mt), (db, _), (_, ft) = (timed(e, dtype) for e in (
            ENGINES["partita"], ENGINES["megatron"], ENGINES["deepspeed"],
            ENGINES["megatron"].with_options({"fp16_grad_reduce": False})))
        assert (pb, mb, db) == (4, megatron_bytes, megatron_bytes)
        assert mt.compute_s == pytest.approx(ft.compute_s) and mt.zero_comm_s == ft.zero_comm_s == 0
        if megatron_bytes == 2:
            assert mt.dp_sync_s < ft.dp_sync_s
        else:
            assert mt.dp_sync_s == pytest.approx(ft.dp_sync_s) == pytest.approx(pt.dp_sync_s)


def test_a_compute_dtype_gradient_buffer_and_optimizer_state():
    """``Engine.grad_buffer`` "compute" (NeMo's distributed_fused_adam with grad_sync_dtype bf16)
    holds and reduces the gradients in bf16: 2 bytes a parameter, unsharded at ZeRO-1 while they
    accumulate, and half the per-step reduction's bytes; ``optimizer_state`` "compute" (its dtype
    bf16) keeps the master copy and Adam's two moments in bf16: 6 bytes a parameter, sharded.
    Nothing else moves."""
    model, cluster = BUILTIN["llama-3-8b"], parse_short("4x8xH100")
    layer = strategy(model, "layers.0", tp=1, sp=False, zero=1, recompute="none")
    group = cluster.groups[0]
    params = CostModel(model, cluster, seq_len=4096, dtype="bf16").param_count("block", 1)
    base = ENGINES["megatron"]
    out = {}
    for key, opts in (("fp32", {}), ("grads", {"grad_buffer": "compute"}),
                      ("both", {"grad_buffer": "compute", "optimizer_state": "compute"})):
        cm = CostModel(model, cluster, seq_len=4096, dtype="bf16", engine=base.with_options(opts))
        mem = cm.layer_memory("block", group.device, layer, dp=32, micro_batch=1, num_micro_batches=4)
        out[key] = (cm.reduce_bytes, mem, cm.layer_time("block", group, layer, dp=32, micro_batch=1))
    (rb0, m0, t0), (rb1, m1, t1), (rb2, m2, t2) = out["fp32"], out["grads"], out["both"]
    assert (rb0, rb1, rb2) == (4, 2, 2)
    assert m0.gradients - m1.gradients == pytest.approx(2 * params, rel=0.01)
    assert (m1.weights, m1.optimizer) == (m0.weights, m0.optimizer)
    assert m2.weights == pytest.approx(m0.weights / 2, rel=0.01)
    assert m2.optimizer == pytest.approx(m0.optimizer / 2, rel=0.01)
    assert m1.activations == m0.activations and t1.compute_s == t0.compute_s
    assert t1.dp_sync_s < t0.dp_sync_s and t2.dp_sync_s == t1.dp_sync_s
    with pytest.raises(PartitaError, match="unknown grad_buffer 'fp8'"):
        base.with_options({"grad_buffer": "fp8"})


def test_megatron_keeps_the_linears_inputs_as_sequence_shards():
    """Under sequence parallelism Megatron-LM keeps each tensor-parallel linear's input as its
    sequence shard and gathers it again in the backward (``sp_inputs``): a llama block keeps
    (1 - 1/tp) x 2 t h e bytes less (its two linear inputs), and its backward pays the two
    gathers beside its compute; without sequence parallelism, or under full recomputation
    (whose kept input is already a shard), the two engines keep the same."""
    model, cluster = BUILTIN["llama-2-7b"], parse_short("1x8xH100")
    group, tp, seq = cluster.groups[0], 4, 4096
    kw = dict(dp=2, micro_batch=1, num_micro_batches=4)
    whole = ENGINES["torchtitan"]  # DTensor's linears keep the gathered input
    plain, megatron = CostModel(model, cluster, seq_len=seq, engine=whole), CostModel(model, cluster, seq_len=seq,
                                                                                      engine=ENGINES["megatron"])
    assert whole.sp_inputs == "whole" and PARTITA.sp_inputs == "sharded"  # Partita's runtime: runtime.tp_linear
    sharded = dataclasses.replace(whole, sp_inputs="sharded")
    alone = CostModel(model, cluster, seq_len=seq, engine=sharded)  # the one behaviour, nothing else
    kernels = CostModel(model, cluster, seq_len=seq, engine=sharded.with_options(
        {"glu_saves": "input", "qkv_saves": "fused"}))  # and Megatron's kernels' saved tensors
    whole_input = seq * model.hidden * 2
    for sp, rc, saved in ((True, "none", 2 * whole_input * (tp - 1) // tp), (False, "none", 0), (True, "full", 0)):
        s = strategy(model, "layers.0", tp=tp, sp=sp, zero=1, recompute=rc)
        a = plain.layer_memory("block", group.device, s, **kw).activations
        b = alone.layer_memory("block", group.device, s, **kw).activations
        assert a - b == pytest.approx(saved, abs=2 * 2**20)  # allocation grains
        assert (megatron.layer_memory("block", group.device, s, **kw).activations
                == kernels.layer_memory("block", group.device, s, **kw).activations)
    s = strategy(model, "layers.0", tp=tp, sp=True, zero=1, recompute="none")
    t_plain, t_alone = (cm.layer_time("block", group, s, dp=2, micro_batch=1) for cm in (plain, alone))
    assert t_alone.forward_s == t_plain.forward_s
    assert t_plain.backward_s < t_alone.backward_s < t_plain.backward_s + 2 * plain.collective_s(
        "all_gather", whole_input, tp, plain.tp_link(group, tp), group.device)
    with pytest.raises(PartitaError, match="unknown sp_inputs 'half'"):
        dataclasses.replace(PARTITA, sp_inputs="half")


def test_megatron_allocates_each_receive_as_it_posts_it_and_frees_a_sent_output():
    """``p2p_buffers``: torch.distributed.pipelining as it comes (torchtitan) holds a receive
    buffer per micro-batch and direction and keeps every stage output (and the last stage's
    logits) until its backward; Partita's runtime allocates each receive as it posts it and keeps
    the outputs as torch does; Megatron-LM holds the one receive in flight per direction and frees
    what it sent. Only the pipeline's own bytes change: the layers' activations and the step time
    stay."""
    model, cluster = BUILTIN["llama-2-13b"], parse_short("4x8xH100")
    group, m = cluster.groups[0], 8
    names = stage_layer_names(model, [10, 10, 10, 10])
    stages = [(group, [strategy(model, n, tp=8, sp=True, zero=1, recompute="full") for n in stage]) for stage in names]
    kw = dict(dp=1, tp=8, micro_batch=1, num_micro_batches=m)
    per_mb, on_receive, per_transfer = (
        CostModel(model, cluster, seq_len=4096, engine=PARTITA.with_options({"p2p_buffers": mode}))
        for mode in ("per_micro_batch", "on_receive", "per_transfer"))
    a, c, b = (evaluate_layout(cm, stages, **kw) for cm in (per_mb, on_receive, per_transfer))
    msg = 4096 // 8 * model.hidden * 2  # a rank's sequence shard of one micro-batch's hidden states
    middle_a, middle_c, middle_b = a.stages[1], c.stages[1], b.stages[1]
    assert middle_a.pipeline_buffers == pytest.approx(2 * m * msg, rel=0.01)
    assert middle_c.pipeline_buffers == pytest.approx(2 * ON_RECEIVE_BUFFERS * msg, rel=0.01)
    assert middle_b.pipeline_buffers == pytest.approx(2 * msg, rel=0.01)
    assert middle_a.output_per_mb == middle_c.output_per_mb == pytest.approx(msg, rel=0.01)
    assert middle_b.output_per_mb == 0
    assert a.stages[-1].retained_output == c.stages[-1].retained_output > 0 and b.stages[-1].retained_output == 0
    for x, z, y in zip(a.stages, c.stages, b.stages):
        assert x.activations_per_mb == z.activations_per_mb == y.activations_per_mb
        assert y.peak_bytes <= z.peak_bytes <= x.peak_bytes
    assert middle_c.peak_bytes == middle_a.peak_bytes - 2 * (m - ON_RECEIVE_BUFFERS) * msg
    assert a.step_time_s == pytest.approx(b.step_time_s) and c.step_time_s == pytest.approx(b.step_time_s)
    assert ENGINES["megatron"].p2p_buffers == "per_transfer" and PARTITA.p2p_buffers == "on_receive"
    assert ENGINES["torchtitan"].p2p_buffers == "per_micro_batch"
    with pytest.raises(PartitaError, match="unknown p2p_buffers 'pooled'"):
        dataclasses.replace(PARTITA, p2p_buffers="pooled")


def test_megatron_keeps_what_its_fused_swiglu_and_gqa_attention_save():
    """``glu_saves`` / ``qkv_saves``: under Megatron-LM a llama-3 block without recomputation keeps
    silu's output less (t x ffn/tp) and, with 8 kv heads of 32 query heads, the GQA-native
    attention's rotated q and k, the qkv output v views and the output instead of q, k, v repeated
    to the query heads and the output; a fully recomputed block keeps its input either way. The
    same kernels run less elementwise work (one SwiGLU kernel, no copies of k and v:
    ``tests/test_kernels.py`` counts the bytes), so both passes are shorter."""
    model, cluster = BUILTIN["llama-3-8b"], parse_short("1x8xH100")
    group, tp, seq = cluster.groups[0], 4, 8192
    kw = dict(dp=2, micro_batch=1, num_micro_batches=4)
    torch_stack = dataclasses.replace(PARTITA, sp_inputs="sharded")  # Megatron's sharded inputs, alone
    fused = torch_stack.with_options({"glu_saves": "input", "qkv_saves": "fused"})
    a, b = CostModel(model, cluster, seq_len=seq, engine=torch_stack), CostModel(model, cluster, seq_len=seq, engine=fused)
    H, KV, d, f = model.heads // tp, model.kv_heads // tp, model.head_dim, model.ffn // tp
    saved = seq * f * 2 + seq * d * 2 * (4 * H - 3 * H - 3 * KV)
    s = strategy(model, "layers.0", tp=tp, sp=True, zero=1, recompute="none")
    got = (a.layer_memory("block", group.device, s, **kw).activations
           - b.layer_memory("block", group.device, s, **kw).activations)
    assert got == pytest.approx(saved, abs=2 * 2**20)  # allocation grains
    assert saved > 0.1 * a.layer_memory("block", group.device, s, **kw).activations
    full = strategy(model, "layers.0", tp=tp, sp=True, zero=1, recompute="full")
    assert (a.layer_memory("block", group.device, full, **kw).activations
            == b.layer_memory("block", group.device, full, **kw).activations)
    ta, tb = a.layer_time("block", group, s, dp=2, micro_batch=1), b.layer_time("block", group, s, dp=2, micro_batch=1)
    assert tb.forward_s < ta.forward_s and tb.backward_s < ta.backward_s and tb.tp_comm_s == ta.tp_comm_s
    megatron = ENGINES["megatron"]
    assert (megatron.glu_saves, megatron.qkv_saves) == ("input", "fused")
    for name in ("partita", "torchtitan", "deepspeed"):
        assert (ENGINES[name].glu_saves, ENGINES[name].qkv_saves) == ("outputs", "repeated")
    with pytest.raises(PartitaError, match="unknown glu_saves 'none'"):
        dataclasses.replace(PARTITA, glu_saves="none")
    with pytest.raises(PartitaError, match="unknown qkv_saves 'views'"):
        dataclasses.replace(PARTITA, qkv_saves="views")


def test_deepspeed_regathers_what_its_recompute_released_and_reduces_large_gradients_alone():
    """DeepSpeed's ZeRO-3 under full recomputation: the recomputed forward gathers every module
    again and releases those reused beyond stage3_max_reuse_distance (1e9 elements of the traced
    order), which the backward then gathers a third time: of a 175B GPT block (qkv 3h^2, o h^2,
    w1 and w2 4h^2 each, h = 12288) all but w2, whose backward follows at once; a 7B llama block
    (0.2B parameters) keeps them all. Its gradients go through the reduce bucket, and one larger
    than the bucket is reduced alone: the 175B block's four weights and, between them, their
    biases are eight reduce-scatters at the recipe's 9e7, five at the default 5e8; the 7B one's
    fit one bucket. FSDP gathers a block once for both passes: no term."""
    from partita.search.costs.layer_time import zero3_recompute_s
    from partita.search.engines import recompute_regathers, reduce_flushes

    gpt = dataclasses.replace(BUILTIN["llama-2-7b"], name="gpt-175b", family="gpt2", hidden=12288, heads=96,
                              kv_heads=96, ffn=49152, n_layers=4, vocab=50304, seq_len=1024, tie_embeddings=True)
    h = 12288
    block = gpt.kinds["block"]
    assert recompute_regathers(block, 1) == [3 * h * h + 3 * h, h * h + h, 4 * h * h + 4 * h]
    assert reduce_flushes(block, 1, 90_000_000) == 8 and reduce_flushes(block, 1, 500_000_000) == 5
    small = BUILTIN["llama-2-7b"].kinds["block"]
    assert recompute_regathers(small, 1) == [] and reduce_flushes(small, 1, 500_000_000) == 1
    cluster = parse_short("16x8xA100-80GB")
    group = cluster.groups[0]
    ds = CostModel(gpt, cluster, seq_len=1024, engine=ENGINES["deepspeed"])
    fsdp = CostModel(gpt, cluster, seq_len=1024)
    extra = zero3_recompute_s(ds, "block", group, tp=1, replicas=128)
    link = ds.dp_link(group, 128, 1)
    assert extra == pytest.approx(sum(ds.collective_s("all_gather", m * 2, 128, link, group.device)
                                      for m in recompute_regathers(block, 1)))
    assert extra > 0 and zero3_recompute_s(fsdp, "block", group, tp=1, replicas=128) == 0.0
    kw = dict(tp=1, sp=False, zero=3)
    full, none = (strategy(gpt, "layers.0", recompute=r, **kw) for r in ("full", "none"))
    t_full, t_none = (ds.layer_time("block", group, s, dp=128, micro_batch=1) for s in (full, none))
    assert t_full.zero_comm_s == pytest.approx(t_none.zero_comm_s + extra)
    fewer = CostModel(gpt, cluster, seq_len=1024, engine=ENGINES["deepspeed"].with_options({"reduce_bucket": 10**10}))
    assert fewer.layer_time("block", group, none, dp=128, micro_batch=1).zero_comm_s < t_none.zero_comm_s
    with pytest.raises(PartitaError, match="reduce_bucket must be a positive whole number"):
        ENGINES["deepspeed"].with_options({"reduce_bucket": "big"})


def test_deepspeed_s_reuse_distance_keeps_a_recomputed_block_gathered_for_its_backward():
    """``Engine.max_reuse_distance`` (DeepSpeed's stage3_max_reuse_distance): at the Azure 175B
    recipe's 3e9 every module of a 175B GPT block is reused within the distance (the first's
    reuse lies 2 x (h^2 + 8h^2) = 2.7e9 parameters of the traced order away), so the recomputed
    forward keeps the whole block gathered for the backward: no third gather of any module, and
    the backward starts holding the block's parameters (1.8e9, 3.6 GB in fp16) beside the next
    module fetched. At the default 1e9 it keeps only the last module (w2 and its bias), beside
    the next one fetched."""
    from partita.search.costs.layer_time import zero3_recompute_s
    from partita.search.engines import block_module_params, recompute_regathers

    gpt = dataclasses.replace(BUILTIN["llama-2-7b"], name="gpt-175b", family="gpt2", hidden=12288, heads=96,
                              kv_heads=96, ffn=49152, n_layers=4, vocab=50304, seq_len=1024, tie_embeddings=True)
    h, block = 12288, gpt.kinds["block"]
    assert recompute_regathers(block, 1, 3_000_000_000) == []
    cluster = parse_short("16x8xA100-80GB")
    group = cluster.groups[0]
    far = ENGINES["deepspeed"].with_options({"max_reuse_distance": 3_000_000_000})
    cms = {e: CostModel(gpt, cluster, seq_len=1024, dtype="fp16", engine=e) for e in (ENGINES["deepspeed"], far)}
    assert zero3_recompute_s(cms[far], "block", group, tp=1, replicas=128) == 0.0
    assert zero3_recompute_s(cms[ENGINES["deepspeed"]], "block", group, tp=1, replicas=128) > 0
    full = strategy(gpt, "layers.0", tp=1, sp=False, zero=3, recompute="full")
    mem = {e: cm.layer_memory("block", group.device, full, dp=128, micro_batch=1, num_micro_batches=1)
           for e, cm in cms.items()}
    block_params = sum(map(sum, block_module_params(block, 1)))
    largest = 4 * h * h
    assert mem[ENGINES["deepspeed"]].transient_gathered == (largest + h) * 2 + largest * 2
    assert mem[far].transient_gathered == block_params * 2 + largest * 2
    with pytest.raises(PartitaError, match="max_reuse_distance must be a positive whole number"):
        ENGINES["deepspeed"].with_options({"max_reuse_distance": 0})


def test_fsdp2_copies_its_gathers_out_and_its_gradients_in_on_the_compute_stream():
    """FSDP2 (Partita's runtime, torchtitan) copies each all-gather's output out into the
    parameters and each micro-batch's gradients into the reduce-scatter input, on the compute
    stream (``Engine.shard_copies`` "fsdp2"): a ZeRO-3 block's passes run two copies of its
    gathered bytes and one of its gradients longer than with FSDP1's flat parameters ("none");
    ZeRO 2 gathering each micro-batch, one gather and one reduction; unsharded, nothing."""
    from partita.search.costs.layer_time import layer_time
    from partita.search.roofline import memory_time_s

    model, cluster = BUILTIN["llama-3-8b"], parse_short("4x8xH100")
    device = cluster.groups[0].device_type
    flat = PARTITA.with_options({"shard_copies": "none"})
    params = CostModel(model, cluster, seq_len=4096, engine=PARTITA).param_count("block", 1)
    gather = memory_time_s(device, 2 * params * 2)
    reduce = memory_time_s(device, params * (2 + 4))
    assert ENGINES["torchtitan"].shard_copies == "fsdp2"
    assert ENGINES["megatron"].shard_copies == ENGINES["deepspeed"].shard_copies == "none"
    step = {"zero2_gather": "step"}  # ZeRO 2 gathered once a step: its per-micro-batch reduction only
    for zero, dp, added, options in ((3, 32, 2 * gather + reduce, {}), (2, 32, gather + reduce, {}),
                                     (2, 32, reduce, step), (1, 32, 0.0, {}), (0, 32, 0.0, {}), (3, 1, 0.0, {})):
        spec = strategy(model, "layers.0", tp=1, sp=False, zero=zero, recompute="none")
        t = {name: CostModel(model, cluster, seq_len=4096, engine=engine.with_options(options)).at_ep(1).layer_time(
            "block", cluster.groups[0], spec, dp=dp, micro_batch=1) for name, engine in (("fsdp2", PARTITA), ("flat", flat))}
        assert t["fsdp2"].compute_s - t["flat"].compute_s == pytest.approx(added, rel=1e-9, abs=1e-12)
        assert t["fsdp2"].zero_comm_s == t["flat"].zero_comm_s
    with pytest.raises(PartitaError, match="unknown shard_copies 'fsdp3'"):
        PARTITA.with_options({"shard_copies": "fsdp3"})


def test_fsdp1_concatenates_the_gradients_then_casts_and_divides_them_beside_the_reduction():
    """FSDP1's flat parameters (``Engine.shard_copies`` "fsdp1": llm-foundry's Composer, IBM's
    fms-fsdp) are viewed by the parameters, so the forward copies nothing; the backward of those
    views concatenates the gradients into the flat gradient on the compute stream (its bf16
    bytes read and written), and the post-backward stream casts it to the reduce dtype and
    divides it in place before the reduce-scatter: ZeRO traffic, not compute. Reduced in bf16
    (``reduce_dtype`` "compute", fms-fsdp's bfSixteen policy) there is no cast, the division
    moves half the bytes, and so does the reduce-scatter."""
    from partita.search.costs.layer_time import layer_time
    from partita.search.roofline import memory_time_s

    model, cluster = BUILTIN["llama-3-8b"], parse_short("4x8xH100")
    group, device = cluster.groups[0], cluster.groups[0].device_type
    params = CostModel(model, cluster, seq_len=4096, engine=PARTITA).param_count("block", 1)
    concat = memory_time_s(device, 2 * params * 2)
    fsdp1 = PARTITA.with_options({"shard_copies": "fsdp1"})
    flat = PARTITA.with_options({"shard_copies": "none"})
    spec = strategy(model, "layers.0", tp=1, sp=False, zero=3, recompute="none")

    def block(engine):
        cm = CostModel(model, cluster, seq_len=4096, engine=engine).at_ep(1)
        return cm, cm.layer_time("block", group, spec, dp=32, micro_batch=1)

    (_, one), (_, none) = block(fsdp1), block(flat)
    assert one.compute_s - none.compute_s == pytest.approx(concat, rel=1e-9)
    side = memory_time_s(device, params * (2 + 4)) + memory_time_s(device, 2 * params * 4)
    assert one.zero_comm_s - none.zero_comm_s == pytest.approx(side, rel=1e-9)
    (cm16, bf16), (cm_flat16, flat16) = (block(e.with_options({"reduce_dtype": "compute"})) for e in (fsdp1, flat))
    assert cm16.reduce_bytes == 2 and cm_flat16.reduce_bytes == 2
    assert bf16.zero_comm_s - flat16.zero_comm_s == pytest.approx(memory_time_s(device, 2 * params * 2), rel=1e-9)
    assert flat16.zero_comm_s < none.zero_comm_s  # the reduce-scatter moves bf16
    zero1 = strategy(model, "layers.0", tp=1, sp=False, zero=1, recompute="none")
    t = [CostModel(model, cluster, seq_len=4096, engine=e).at_ep(1).layer_time("block", group, zero1, dp=32, micro_batch=1)
         for e in (fsdp1, flat)]
    assert t[0].compute_s == t[1].compute_s and t[0].zero_comm_s == t[1].zero_comm_s


def test_torch_s_symmetric_memory_tp_adds_a_shard_copy_and_a_partial_sum_per_fused_collective():
    """torchtitan's async TP runs torch's symmetric-memory collectives (``tp_overlap_impl``
    "symmetric_memory"): a fused all-gather first copies the rank's shard into its symmetric
    buffer (2 x act/tp bytes) and a fused reduce-scatter sums the tp partial chunks it pulled
    (act + act/tp), both on the compute stream; Transformer Engine's userbuffers are priced
    without them. A block's forward fuses two of each."""
    from partita.search.costs.layer_time import layer_time
    from partita.search.roofline import memory_time_s

    model, cluster = BUILTIN["llama-3-70b"], parse_short("1x8xH100")
    group = cluster.groups[0]
    layer = strategy(model, "layers.0", tp=8, sp=True, zero=0, recompute="none")
    assert ENGINES["torchtitan"].tp_overlap_impl == "symmetric_memory"
    assert ENGINES["megatron"].tp_overlap_impl == "userbuffers"
    symm = ENGINES["torchtitan"].with_options({"tp_overlap": True})
    ub = symm.with_options({"tp_overlap_impl": "userbuffers"})
    t = {name: CostModel(model, cluster, seq_len=4096, engine=e).layer_time("block", group, layer, dp=1, micro_batch=1)
         for name, e in (("symm", symm), ("ub", ub))}
    act = 4096 * model.hidden * 2
    dev = group.device_type
    per_forward = 2 * memory_time_s(dev, 2 * act / 8) + 2 * memory_time_s(dev, act + act / 8)
    # backward: the two gathers of the output gradients fused; the summed input gradients' two
    # reduce-scatters run whole (separate column-parallel linears), without the copies
    per_backward = 2 * memory_time_s(dev, 2 * act / 8)
    assert t["symm"].tp_comm_s - t["ub"].tp_comm_s == pytest.approx(per_forward + per_backward, rel=1e-6)
    assert t["symm"].compute_s == pytest.approx(t["ub"].compute_s)


def test_deepspeed_s_bf16_optimizer_all_reduces_the_gradients_zero_1_reduce_scatters():
    """``zero1_reduce``: DeepSpeed's BF16_Optimizer (bf16 under its pipeline engine) all-reduces
    the fp32 gradients before its sharded update (``PipelineEngine._bf16_reduce_grads``), twice
    the bytes of ZeRO 1's reduce-scatter; the all-gather after the update is the same."""
    model, cluster = BUILTIN["llama-3-8b"], parse_short("4x8xH100")
    group = cluster.groups[0]
    sync = {}
    for reduce in ("reduce_scatter", "all_reduce"):
        cm = CostModel(model, cluster, seq_len=4096, engine=ENGINES["deepspeed"].with_options({"zero1_reduce": reduce}))
        sync[reduce] = cm.zero_traffic("block", group, 1, 1, 32)
        link, params = cm.dp_link(group, 32, 1), cm.param_count("block", 1)
        rs = cm.collective_s("reduce_scatter", params * cm.reduce_bytes, 32, link, group.device)
        ar = cm.collective_s("all_reduce", params * cm.reduce_bytes, 32, link, group.device)
    assert sync["all_reduce"][2] - sync["reduce_scatter"][2] == pytest.approx(ar - rs)
    assert sync["all_reduce"][3] == sync["reduce_scatter"][3]  # the parameters' gather
    with pytest.raises(PartitaError, match="zero1_reduce"):
        ENGINES["deepspeed"].with_options({"zero1_reduce": "allreduce"})
    with pytest.raises(PartitaError, match="unknown fp8_impl 'te'"):  # the engine's own option named
        ENGINES["torchtitan"].with_options({"fp8_impl": "te"})


def test_deepspeed_s_bf16_optimizer_adds_each_micro_batch_s_gradients_in_a_pass_of_its_own():
    """``grad_accumulate`` "cast_add": after every micro-batch's backward BF16_Optimizer casts each
    bf16 gradient to fp32 and adds it into its fp32 copy (``update_hp_grads``): 2 + 16 bytes a
    parameter of the rank's tensor-parallel shard, in the backward at ZeRO 0-1, and so once a
    micro-batch in a step; at ZeRO 2-3 the gradients are reduced as they come, and nothing changes."""
    from partita.search.costs.layer_time import layer_time
    from partita.search.roofline import memory_time_s

    model, cluster = BUILTIN["llama-3-8b"], parse_short("2x8xA100-80GB")
    group = cluster.groups[0]
    cms = {a: CostModel(model, cluster, seq_len=2048, engine=ENGINES["deepspeed"].with_options({"grad_accumulate": a}))
           for a in ("in_place", "cast_add")}
    params = cms["cast_add"].param_count("block", 2)
    scale = cms["cast_add"].time_constants(group.device).compute_scale
    for zero in (0, 1, 2, 3):
        t = {a: layer_time(cm, "block", group, tp=2, sp=False, zero=zero, recompute="none", replicas=8, micro_batch=1)
             for a, cm in cms.items()}
        extra = scale * memory_time_s(group.device_type, params * 18) if zero <= 1 else 0.0
        assert t["cast_add"].backward_s - t["in_place"].backward_s == pytest.approx(extra, rel=1e-9, abs=1e-12)
        assert t["cast_add"].forward_s == t["in_place"].forward_s
    assert extra == 0.0 and params * 18 > 1e9  # a 2 GB pass a micro-batch at tp 2: milliseconds, not noise
    steps = {}
    for a, cm in cms.items():
        for m in (1, 8):
            ev = evaluate_layout(cm, [(group, layers(model, tp=2, zero=1))], dp=8, tp=2, micro_batch=1,
                                 num_micro_batches=m)
            steps[a, m] = ev.step_time_s
    one = scale * memory_time_s(group.device_type, params * 18) * model.n_layers
    assert steps["cast_add", 1] - steps["in_place", 1] > 0.9 * one
    assert steps["cast_add", 8] - steps["in_place", 8] == pytest.approx(8 * (steps["cast_add", 1] - steps["in_place", 1]), rel=0.05)
    with pytest.raises(PartitaError, match="grad_accumulate"):
        ENGINES["deepspeed"].with_options({"grad_accumulate": "fp32"})
