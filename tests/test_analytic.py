"""The analytic layer profile: activation counts by hand and against autograd, time and parameters."""

from __future__ import annotations

import pytest

from partita.devices import get_device
from partita.errors import PartitaError
from partita.model import ModelSpec
from partita.model_io import load_model
from partita.profile import Profile
from partita.search.analytic import (Shard, activation_bytes, analytic_profile, attention_s, forward_matmuls, layer_cost,
                                     param_bytes)

H100 = get_device("H100")
TINY_LLAMA = load_model("tiny-llama")  # hidden 64, heads 4, kv_heads 2 (head_dim 16), ffn 128, vocab 256
TINY_GPT2 = load_model("tiny-gpt2")  # hidden 64, heads 4, ffn 256, vocab 256, 64 positions


# ---- activation bytes, by hand ----------------------------------------------------------------
def test_llama_block_activations_by_hand():
    # b=2, s=64: t=128 tokens, bf16 (2 bytes), GPU kernels (fused RMSNorm).
    expected = (
        128 * 64 * 2 + 128 * 4  # attention norm: input, fp32 rstd
        + 128 * 64 * 2  # its output, the input wq, wk, wv share
        + 4 * 64 * 16 * 2  # rotary cos and sin, [1, s, 1, d], for q and for k
        + 4 * 128 * 4 * 16 * 2  # SDPA: q, k and v (repeated to 4 heads), output
        + 2 * 4 * 64 * 4  # SDPA: fp32 logsumexp [b, heads, s]
        + 128 * 64 * 2 + 128 * 4  # ffn norm: input, rstd
        + 128 * 64 * 2  # its output, the input w1 and w3 share
        + 4 * 128 * 128 * 2  # w1 out (silu in), silu out, w3 out, product (w2 in)
    )
    assert expected == 273408
    got = activation_bytes(TINY_LLAMA.kinds["block"], tp=1, micro_batch=2, seq_len=64, dtype="bf16")
    assert got == expected
    assert layer_cost(TINY_LLAMA.kinds["block"], H100, tp=1, micro_batch=2, seq_len=64,
                      dtype="bf16").activation_bytes == expected


def test_llama_block_activations_with_tp_sequence_parallel_and_recompute():
    # tp=2: 2 query heads, 1 kv head, ffn 64 per rank; SP shards the norms' inputs over 128/2 tokens.
    expected = (
        2 * (64 * 64 * 2 + 64 * 4)  # two norms on 64 of the tokens: input, rstd
        + 2 * 128 * 64 * 2  # two all-gathered norm outputs, kept whole by the linears
        + 4 * 64 * 16 * 2  # rotary tables
        + 4 * 128 * 2 * 16 * 2 + 2 * 2 * 64 * 4  # SDPA on 2 heads: q, k, v, out; logsumexp
        + 4 * 128 * 64 * 2  # the MLP's four [t, ffn/2] tensors
    )
    kind = TINY_LLAMA.kinds["block"]
    common = dict(tp=2, micro_batch=2, seq_len=64, dtype="bf16")
    assert activation_bytes(kind, **common, sequence_parallel=True) == expected == 157184
    # Full recompute keeps the block's input only: [128, 64] bf16, split over 2 ranks with SP.
    assert activation_bytes(kind, **common, recompute="full") == 128 * 64 * 2
    assert activation_bytes(kind, **common, recompute="full", sequence_parallel=True) == 128 * 64
    # Selective keeps the input and the matrix products' outputs but w2's (t = 128 tokens, per
    # rank 2 query heads and 1 kv head of 16, ffn 64): q, k, v; wo's [t, h] partial sum, whole
    # under SP; w1 and w3.
    products = 128 * (32 + 16 + 16) * 2 + 128 * 64 * 2 + 2 * 128 * 64 * 2
    assert activation_bytes(kind, **common, recompute="selective") == 128 * 64 * 2 + products
    assert activation_bytes(kind, **common, recompute="selective", sequence_parallel=True) == 128 * 64 + products


def test_selective_recomputation_keeps_between_none_and_full_and_drops_the_attention_core():
    """Korthikanti et al. 2022 drop the attention core's a*s^2 terms; with fused attention
    there are none, and selective drops the norms, rotary, SDPA's saved tensors and the MLP's
    activation instead: less than none keeps, more than full."""
    for model, tp in ((TINY_LLAMA, 1), (TINY_LLAMA, 2), (TINY_GPT2, 1), (TINY_GPT2, 2)):
        kind = model.kinds["block"]
        for sp in (False, True) if tp > 1 else (False,):
            kept = {mode: activation_bytes(kind, tp=tp, micro_batch=2, seq_len=64, dtype="bf16", sequence_parallel=sp,
                                           recompute=mode) for mode in ("none", "selective", "full")}
            assert kept["full"] < kept["selective"] < kept["none"], (model.name, tp, sp, kept)
    with pytest.raises(PartitaError, match="decoder blocks"):
        activation_bytes(TINY_LLAMA.kinds["head"], tp=1, micro_batch=1, seq_len=64, dtype="bf16", recompute="selective")
    with pytest.raises(PartitaError, match="recompute must be one of"):
        activation_bytes(TINY_LLAMA.kinds["block"], tp=1, micro_batch=1, seq_len=64, dtype="bf16", recompute=True)


def test_selective_recomputation_repeats_the_forward_but_its_products():
    from partita.devices import get_device
    from partita.search.analytic import (Shard, forward_elementwise, forward_time_s, matmul_time_s,
                                         selective_recompute_time_s)
    from partita.search.roofline import memory_time_s

    dev = get_device("H100")
    kind = load_model("llama-2-7b").kinds["block"]
    sh = Shard.of(kind, tp=1, micro_batch=1, seq_len=4096, dtype="bf16")
    forward = forward_time_s(kind, dev, sh, "bf16")
    products = sum(matmul_time_s(dev, m, n, k, "bf16") for _, m, n, k in forward_matmuls(kind, sh))
    final_add = memory_time_s(dev, forward_elementwise(kind, sh)[-1][1])
    assert selective_recompute_time_s(kind, dev, sh, "bf16") == pytest.approx(forward - products - final_add)
    assert 0 < selective_recompute_time_s(kind, dev, sh, "bf16") < 0.3 * forward  # attention + elementwise


def test_gpt2_block_embed_and_head_activations_by_hand():
    block = (
        64 * 64 * 2 + 2 * 64 * 4  # LayerNorm: input, fp32 mean and rstd (b=1, s=64, bf16)
        + 64 * 64 * 2  # its output (wq, wk, wv input)
        + 4 * 64 * 4 * 16 * 2 + 4 * 64 * 4  # SDPA: q, k, v, out; logsumexp
        + 64 * 64 * 2 + 2 * 64 * 4 + 64 * 64 * 2  # second LayerNorm and its output
        + 2 * 64 * 256 * 2  # w1 out (gelu in), gelu out (w2 in)
    )
    assert activation_bytes(TINY_GPT2.kinds["block"], tp=1, micro_batch=1, seq_len=64, dtype="bf16") == block
    # Embed: int64 token ids [2, 64] and position ids [64].
    assert activation_bytes(TINY_GPT2.kinds["embed"], tp=1, micro_batch=2, seq_len=64, dtype="bf16") == 1536
    # Head, fp32: norm input + mean + rstd, norm output, fp32 log-probs [128, 256], targets, total weight.
    head = 128 * 64 * 4 + 2 * 128 * 4 + 128 * 64 * 4 + 128 * 256 * 4 + 128 * 8 + 4
    assert activation_bytes(TINY_GPT2.kinds["head"], tp=1, micro_batch=2, seq_len=64, dtype="fp32") == head


def test_cpu_counts_torchs_composite_rms_norm():
    # On the CPU, rms_norm keeps the fp32 input and the fp32 normalised tensor, not just the input.
    kind = TINY_LLAMA.kinds["head"]
    common = dict(tp=1, micro_batch=2, seq_len=64, dtype="fp32")
    cpu = activation_bytes(kind, **common, on_cpu=True)
    assert cpu == (2 * 128 * 64 * 4 + 128 * 4) + 128 * 64 * 4 + 128 * 256 * 4 + 128 * 8 + 4 == 230916
    assert cpu - activation_bytes(kind, **common) == 128 * 64 * 4
    assert layer_cost(kind, get_device("cpu"), **common).activation_bytes == cpu


def test_megatron_kernels_keep_the_swiglu_input_and_the_kv_heads_by_hand():
    """Megatron-LM with Transformer Engine (``glu_saves="input"``, ``qkv_saves="fused"``): the
    fused SwiGLU keeps its [t, 2 ffn] input and not silu's output; attention keeps the rotated q
    (4 heads) and k (2 kv heads), the qkv projection's output that v views (4 + 2 x 2 heads) and
    its output (4 heads) instead of q, k, v repeated to 4 heads and the output."""
    kind = TINY_LLAMA.kinds["block"]
    common = dict(tp=1, micro_batch=2, seq_len=64, dtype="bf16")
    plain = activation_bytes(kind, **common)
    fused = activation_bytes(kind, **common, glu_saves="input", qkv_saves="fused")
    silu_out = 128 * 128 * 2  # t x ffn, bf16
    attention_plain, attention_fused = 4 * 4 * 128 * 16 * 2, (3 * 4 + 3 * 2) * 128 * 16 * 2
    assert plain - fused == silu_out + attention_plain - attention_fused == 32768 + 65536 - 73728 == 24576
    # gpt2 under Megatron: q, k and v are all views of the projection's output (no rotary), so
    # with as many kv heads as heads the attention keeps what the repeated count says.
    gpt = TINY_GPT2.kinds["block"]
    assert activation_bytes(gpt, **common, qkv_saves="fused") == activation_bytes(gpt, **common)
    with pytest.raises(PartitaError, match="qkv_saves must be one of repeated, fused"):
        activation_bytes(kind, **common, qkv_saves="views")


# ---- activation bytes, against autograd ---------------------------------------------------------
MHA_LLAMA = ModelSpec(name="mha-llama", family="llama", hidden=96, n_layers=2, heads=6, kv_heads=6, ffn=160,
                      vocab=128, seq_len=32, qkv_bias=True)


@pytest.mark.parametrize("spec", [TINY_LLAMA, TINY_GPT2, MHA_LLAMA], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("tp", [1, 2])
def test_activation_bytes_match_what_autograd_saves_on_cpu(spec, dtype, tp):
    """Sum the distinct storages autograd saves for one layer of the runtime's model (parameters
    excluded); the head includes ``cross_entropy(logits.float())`` as the training loop runs it."""
    torch = pytest.importorskip("torch")
    models = pytest.importorskip("partita.runtime.models")
    import torch.nn.functional as F

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    batch, seq = 3, 16
    gen = torch.Generator().manual_seed(0)
    for role in ("embed", "block", "head"):
        layer = models.build_layer(spec, role, tp=tp, device="cpu", dtype=torch_dtype)
        models.init_layer(layer, role, seed=0, n_layers=spec.n_layers)
        if role == "embed":
            inputs = torch.randint(0, spec.vocab // tp, (batch, seq), generator=gen)
        else:
            inputs = torch.randn(batch, seq, spec.hidden, generator=gen).to(torch_dtype).requires_grad_()
        targets = torch.randint(0, spec.vocab // tp, (batch * seq,), generator=gen)
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        saved: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(inputs)
            if role == "head":
                F.cross_entropy(out.float().view(-1, out.shape[-1]), targets)
        expected = activation_bytes(spec.kinds[role], tp=tp, micro_batch=batch, seq_len=seq, dtype=dtype, on_cpu=True)
        assert sum(saved.values()) == expected, role


@pytest.mark.parametrize("spec", [TINY_LLAMA, TINY_GPT2, MHA_LLAMA], ids=lambda s: s.name)
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_bytes_match_what_the_runtimes_recomputation_keeps(spec, tp, recompute):
    """A block wrapped as the runtime wraps it (``apply_recompute``: torch's checkpoint, with the
    selective policy's cache of product outputs) keeps, after its forward, what
    ``activation_bytes`` counts, to the byte: the storages torch's memory tracker sees alive,
    less the block's output (fp32, where the block's input is among what every mode keeps)."""
    torch = pytest.importorskip("torch")
    from torch.distributed._tools.mem_tracker import MemTracker

    from partita.plan import LayerStrategy, Stage
    from partita.runtime import models
    from partita.runtime.parallelize import apply_recompute

    batch, seq = 3, 16
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict({"0": models.build_layer(spec, "block", tp=tp, device="cpu")})
    models.init_layer(holder.layers["0"], "layers.0", seed=0, n_layers=spec.n_layers)
    apply_recompute(holder, Stage(index=0, group="cpu", device="cpu", ranks=(0,),
                                  layers=(LayerStrategy(name="layers.0", recompute=recompute),)))
    tracker = MemTracker()
    tracker.track_external(holder)
    with tracker:
        x = torch.randn(batch, seq, spec.hidden).requires_grad_()
        y = holder.layers["0"](x)
        current = next(iter(tracker.get_tracker_snapshot("current").values()))
        alive = sum(v for k, v in current.items() if getattr(k, "value", str(k)) == "Activation")
        y.sum().backward()  # the recomputation runs: the cache matches the forward
    assert alive - y.untyped_storage().nbytes() == activation_bytes(
        spec.kinds["block"], tp=tp, micro_batch=batch, seq_len=seq, dtype="fp32", recompute=recompute, on_cpu=True)


# ---- time -----------------------------------------------------------------------------------
LLAMA_7B = load_model("llama-2-7b")


def test_time_and_activations_grow_with_micro_batch():
    costs = [layer_cost(LLAMA_7B.kinds["block"], H100, tp=1, micro_batch=mb, seq_len=4096, dtype="bf16")
             for mb in (1, 2, 4)]
    for small, large in zip(costs, costs[1:]):
        assert large.forward_s > small.forward_s and large.backward_s > small.backward_s
        assert large.activation_bytes > small.activation_bytes
        assert large.param_bytes == small.param_bytes


def test_time_grows_with_sequence_length():
    seqs = [layer_cost(LLAMA_7B.kinds["block"], H100, tp=1, micro_batch=1, seq_len=s, dtype="bf16") for s in
            (512, 1024, 2048, 4096)]
    assert all(b.forward_s > a.forward_s for a, b in zip(seqs, seqs[1:]))


def test_backward_costs_about_twice_the_forward_and_recompute_repeats_it():
    cost = layer_cost(LLAMA_7B.kinds["block"], H100, tp=1, micro_batch=2, seq_len=4096, dtype="bf16")
    assert 1.8 < cost.backward_s / cost.forward_s < 2.5
    assert cost.recompute_s == cost.forward_s


def test_tensor_parallel_roughly_halves_a_large_block():
    one, two = (layer_cost(LLAMA_7B.kinds["block"], H100, tp=tp, micro_batch=4, seq_len=4096, dtype="bf16")
                for tp in (1, 2))
    assert 0.48 < two.forward_s / one.forward_s < 0.6
    assert 0.48 < two.backward_s / one.backward_s < 0.6


def test_block_time_is_close_to_its_flops_at_the_gemm_efficiency():
    # A big block is mostly products at ~0.76 of peak, with attention and elementwise work on top.
    kind = LLAMA_7B.kinds["block"]
    cost = layer_cost(kind, H100, tp=1, micro_batch=4, seq_len=4096, dtype="bf16")
    model_flops = 3 * kind.forward_flops_per_token(4096) * 4 * 4096
    mfu = model_flops / (cost.forward_s + cost.backward_s) / 989e12
    assert 0.45 < mfu < 0.75


# ---- parameters -------------------------------------------------------------------------------
def test_unfused_attention_moves_the_score_square_through_memory():
    """Megatron-LM's 2021 attention (batched products around a softmax kernel, dropout on the
    probabilities) writes and reads every score in HBM: at micro-batch 16 and 2048 tokens its
    share of a narrow GPT's block is several times the fused kernel's, and it grows with s^2."""
    a100 = get_device("A100-80GB")
    kind = ModelSpec(name="gpt-1.7b", family="gpt2", hidden=2304, n_layers=24, heads=24, kv_heads=24, ffn=9216,
                     vocab=51200, seq_len=2048).kinds["block"]
    sh = Shard.of(kind, tp=1, micro_batch=16, seq_len=2048, dtype="fp16")
    fused = attention_s(a100, sh, "fp16", "sdpa")
    unfused = attention_s(a100, sh, "fp16", "unfused")
    assert unfused[0] > 3 * fused[0] and unfused[1] > 2 * fused[1]
    # The forward moves ~13 bytes a score (2 x 2 through the products' output and input, 4 through
    # softmax, 5 through dropout): at least that over HBM.
    scores = 16 * 24 * 2048**2
    assert unfused[0] > 13 * scores / (a100.hbm_gbps * 1e9)
    plain = layer_cost(kind, a100, tp=1, micro_batch=16, seq_len=2048, dtype="fp16")
    megatron = layer_cost(kind, a100, tp=1, micro_batch=16, seq_len=2048, dtype="fp16", attention="unfused")
    assert megatron.forward_s - plain.forward_s == pytest.approx(unfused[0] - fused[0])
    assert megatron.activation_bytes == plain.activation_bytes  # time only: the runtime's memory is priced
    long = Shard.of(kind, tp=1, micro_batch=16, seq_len=1024, dtype="fp16")
    assert attention_s(a100, long, "fp16", "unfused")[0] < 0.3 * unfused[0]
    with pytest.raises(PartitaError, match="unfused"):
        attention_s(a100, sh, "fp16", "xformers")


def test_param_bytes_add_up_to_the_model():
    layers = LLAMA_7B.layer_names()
    total = sum(param_bytes(LLAMA_7B.kind_of(n), tp=1, dtype="bf16") for n in layers)
    assert total == 2 * LLAMA_7B.n_params
    gpt2 = load_model("gpt2")  # ties the head to the embedding: the model counts that matrix once
    total = sum(param_bytes(gpt2.kind_of(n), tp=1, dtype="fp32") for n in gpt2.layer_names())
    assert total == 4 * (gpt2.n_params + gpt2.vocab * gpt2.hidden)


def test_tensor_parallel_replicates_norms_and_row_biases():
    llama = LLAMA_7B.kinds["block"]
    assert 2 * param_bytes(llama, tp=2, dtype="bf16") - param_bytes(llama, tp=1, dtype="bf16") == 2 * (2 * 4096)
    gpt2 = load_model("gpt2").kinds["block"]  # two LayerNorms (weight, bias) and the wo, w2 biases
    assert 2 * param_bytes(gpt2, tp=2, dtype="fp32") - param_bytes(gpt2, tp=1, dtype="fp32") == 4 * (4 * 768 + 2 * 768)


# ---- the profile and bad input ----------------------------------------------------------------
def test_analytic_profile_covers_every_splittable_width_and_round_trips(tmp_path):
    gpt2 = load_model("gpt2")  # vocab 50257 is odd: embed and head only at tp=1
    profile = analytic_profile(H100, gpt2.kinds.values(), tps=(1, 2), micro_batches=(1, 2), seq_len=1024,
                               dtype="bf16")
    assert profile.provenance.source == "analytic" and profile.device == "H100"
    widths = {(c.kind.role, c.tp) for c in profile.layers}
    assert widths == {("embed", 1), ("block", 1), ("block", 2), ("head", 1)}
    assert len(profile.layers) == 8
    profile.save(tmp_path / "p.yaml")
    assert Profile.load(tmp_path / "p.yaml") == profile


def test_bad_widths_and_lengths_raise_with_the_numbers():
    with pytest.raises(PartitaError, match="heads 4 is not divisible by tensor-parallel degree 3"):
        layer_cost(TINY_LLAMA.kinds["block"], H100, tp=3, micro_batch=1, seq_len=64, dtype="bf16")
    with pytest.raises(PartitaError, match="128 exceeds the model's 64 learned positions"):
        layer_cost(TINY_GPT2.kinds["embed"], H100, tp=1, micro_batch=1, seq_len=128, dtype="bf16")
    with pytest.raises(PartitaError, match="positive"):
        activation_bytes(TINY_GPT2.kinds["block"], tp=1, micro_batch=0, seq_len=64, dtype="bf16")
    with pytest.raises(PartitaError, match="positive"):
        layer_cost(TINY_GPT2.kinds["block"], H100, tp=0, micro_batch=1, seq_len=64, dtype="bf16")
