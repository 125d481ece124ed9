"""A layer's memory-bound kernels as each engine runs them (``partita.search.kernels``): the
bytes of the fused rotary and SwiGLU kernels and of GQA-native attention, by hand, and which
engine runs which."""

from __future__ import annotations

import pytest

from partita.errors import PartitaError
from partita.model import BUILTIN
from partita.search.analytic import Shard
from partita.search.engines import ENGINES
from partita.search.kernels import Kernels, backward_elementwise, forward_elementwise

KIND = BUILTIN["llama-3-8b"].kinds["block"]  # 32 heads, 8 kv heads, head_dim 128, ffn 14336
SH = Shard.of(KIND, tp=1, micro_batch=1, seq_len=1024, dtype="bf16")
T, E = 1024, 2
Q, KV, MLP = T * 32 * 128 * E, T * 8 * 128 * E, T * 14336 * E


def _bytes(ops):
    return dict(ops)


def test_torch_s_kernels_by_hand():
    """The runtime's: rotate-half rotary in five kernels a tensor (10 bytes an element), k and v
    repeated to the query heads, silu then the gate's product."""
    fwd = _bytes(forward_elementwise(KIND, SH, Kernels()))
    assert sum(v for k, v in fwd.items() if k.startswith("rope q")) == 10 * Q
    assert sum(v for k, v in fwd.items() if k.startswith("rope k")) == 10 * KV
    assert fwd["repeat k"] == fwd["repeat v"] == KV + Q
    assert (fwd["silu"], fwd["gate mul"]) == (2 * MLP, 3 * MLP)
    assert "swiglu" not in fwd


def test_fused_kernels_by_hand():
    """Transformer Engine's rotary kernel reads and writes each tensor once, forward and backward;
    the fused SwiGLU reads both inputs and writes the product (3 passes), and its backward reads
    the inputs and the gradient and writes both input gradients (5); GQA-native attention copies
    nothing. The other kernels do not change."""
    fused = Kernels(rope="fused", glu="fused", kv="native")
    fwd, bwd = _bytes(forward_elementwise(KIND, SH, fused)), _bytes(backward_elementwise(KIND, SH, fused))
    assert (fwd["rope q fused"], fwd["rope k fused"]) == (2 * Q, 2 * KV)
    assert (bwd["rope q fused"], bwd["rope k fused"]) == (2 * Q, 2 * KV)
    assert fwd["swiglu"] == 3 * MLP and bwd["swiglu"] == pytest.approx(5 * MLP)
    assert not {"repeat k", "repeat v", "silu", "gate mul"} & set(fwd)
    plain = _bytes(forward_elementwise(KIND, SH, Kernels()))
    shared = {"attention norm", "ffn norm"}
    assert {k: fwd[k] for k in shared} == {k: plain[k] for k in shared}
    saved = sum(plain.values()) - sum(fwd.values())
    assert saved == 8 * (Q + KV) + 2 * (KV + Q) + 2 * MLP


def test_each_engine_runs_its_kernels():
    assert ENGINES["megatron"].kernels == Kernels(norm="fused", rope="fused", glu="fused", kv="native")
    for name in ("partita", "deepspeed"):
        assert ENGINES[name].kernels == Kernels()
    assert ENGINES["torchtitan"].kernels == Kernels(fp8="torchao_hp")  # its FP8 products are torchao's
    assert ENGINES["torchtitan"].with_options({"norm": "eager"}).kernels.norm == "eager"
    with pytest.raises(PartitaError, match="unknown norm 'compiled'; valid: fused, eager"):
        ENGINES["torchtitan"].with_options({"norm": "compiled"})
    with pytest.raises(PartitaError, match="unknown rope 'triton'; valid: unfused, fused"):
        Kernels(rope="triton")
    with pytest.raises(PartitaError, match="unknown rope 'triton'"):
        ENGINES["megatron"].with_options({"rope": "triton"})


def test_flash_attn_unpadding_by_hand():
    """llm-foundry's ``attn_impl: flash`` (``attention_padding`` "unpad"): forward, q, k and v
    gathered into packed rows (each read and written) and the output scattered back into zeros
    (written, then the rows read and written); backward, zeros and a scatter for each input's
    gradient (three passes) and a gather of the output's (two). With k and v repeated to the
    query heads the copies move the repeated tensors; with the kernel's kv heads, their own."""
    fwd = _bytes(forward_elementwise(KIND, SH, Kernels(attention_padding="unpad")))
    bwd = _bytes(backward_elementwise(KIND, SH, Kernels(attention_padding="unpad")))
    assert fwd["unpad q k v"] == 2 * (Q + 2 * Q) and fwd["pad output"] == 3 * Q
    assert bwd["unpad q k v"] == pytest.approx(3 * (Q + 2 * Q)) and bwd["pad output"] == pytest.approx(2 * Q)
    native = _bytes(forward_elementwise(KIND, SH, Kernels(kv="native", attention_padding="unpad")))
    assert native["unpad q k v"] == 2 * (Q + 2 * KV)
    plain = _bytes(forward_elementwise(KIND, SH, Kernels()))
    assert not {"unpad q k v", "pad output"} & set(plain)
    assert {k: v for k, v in fwd.items() if k not in ("unpad q k v", "pad output")} == plain
    assert ENGINES["torchtitan"].with_options({"attention_padding": "unpad"}).kernels.attention_padding == "unpad"
    with pytest.raises(PartitaError, match="unknown attention_padding 'varlen'; valid: none, unpad"):
        ENGINES["torchtitan"].with_options({"attention_padding": "varlen"})


def test_a_gpt2_block_has_no_rotary_and_no_gate():
    kind = BUILTIN["gpt2"].kinds["block"]
    sh = Shard.of(kind, tp=1, micro_batch=1, seq_len=1024, dtype="bf16")
    fused = Kernels(rope="fused", glu="fused", kv="native")
    assert forward_elementwise(kind, sh, fused) == forward_elementwise(kind, sh, Kernels())


def test_fp8_casts_by_hand():
    """FP8 products (``Kernels.matmul`` "fp8"): forward, the two norm outputs transposed (read and
    write a byte an element) and the inputs of wo and w2 cast and transposed (read 2, write 1 + 1);
    backward, every product's output gradient cast and transposed (4 bytes an element). The
    block's last kernel is still its residual add (selective recomputation stops before it)."""
    h, q, kv, f = 4096, 32 * 128, 8 * 128, 14336
    fwd = forward_elementwise(KIND, SH, Kernels(matmul="fp8"))
    casts = dict(fwd)
    assert casts["fp8 casts attention"] == T * (2 * h + 4 * q)
    assert casts["fp8 casts mlp"] == T * (2 * h + 4 * f)
    assert fwd[-1][0] == "residual add"
    back = dict(backward_elementwise(KIND, SH, Kernels(matmul="fp8")))
    assert back["fp8 casts attention"] == T * 4 * (q + 2 * kv + h)
    assert back["fp8 casts mlp"] == T * 4 * (2 * f + h)
    plain = dict(forward_elementwise(KIND, SH, Kernels()))
    assert {k: v for k, v in casts.items() if not k.startswith("fp8")} == plain
    with pytest.raises(PartitaError, match="unknown matmul"):
        Kernels(matmul="fp4")


def test_torchao_fp8_casts_by_hand():
    """torchao's Float8Linear (tensorwise dynamic scaling, torchtitan's float8): forward, each
    distinct linear input (the two norm outputs, wo's and w2's inputs) abs-maxed (read 2) and cast
    (read 2, write 1); backward, each output gradient abs-maxed, cast and transposed (2 + 3 + 2),
    each saved FP8 input transposed (2) and each FP8 weight transposed (2 a parameter)."""
    h, q, kv, f = 4096, 32 * 128, 8 * 128, 14336
    k = Kernels(matmul="fp8", fp8="torchao")
    fwd, bwd = dict(forward_elementwise(KIND, SH, k)), dict(backward_elementwise(KIND, SH, k))
    both = lambda d, part: d[f"fp8 casts {part}"] + d[f"fp8 casts {part} input"]  # noqa: E731
    assert both(fwd, "attention") == T * 5 * (h + q) and both(fwd, "mlp") == T * 5 * (h + f)
    assert both(bwd, "attention") == T * 7 * (q + 2 * kv + h) + 2 * T * (h + q) + 2 * (h * (q + 2 * kv) + q * h)
    assert both(bwd, "mlp") == T * 7 * (2 * f + h) + 2 * T * (h + f) + 2 * 3 * h * f
    # the residual stream's part, which sequence parallelism shards: the norm output's cast, and
    # backward wo's (w2's) output gradient's abs-max and cast
    assert fwd["fp8 casts mlp input"] == bwd["fp8 casts mlp input"] == T * 5 * h
    te = dict(forward_elementwise(KIND, SH, Kernels(matmul="fp8")))
    assert both(fwd, "mlp") > te["fp8 casts mlp"]  # no norm that writes FP8: every input cast
    hp = dict(backward_elementwise(KIND, SH, Kernels(matmul="fp8", fp8="torchao_hp")))
    assert both(hp, "mlp") - both(bwd, "mlp") == T * (7 - 2) * (h + f)  # the input cast again
    with pytest.raises(PartitaError, match="unknown fp8"):
        Kernels(matmul="fp8", fp8="te")


def test_fp8_runs_a_block_s_linear_layers_only():
    """The products FP8 covers: a block's attention and dense MLP linears; not the output layer,
    nor a mixture's router and experts (their products keep the compute dtype)."""
    from partita.search.analytic import product_dtype
    fp8 = Kernels(matmul="fp8")
    assert [product_dtype(KIND, n, "bf16", fp8) for n in ("wq", "wo", "w1", "w3", "w2")] == ["fp8"] * 5
    assert product_dtype(KIND, "wq", "bf16", Kernels()) == "bf16"
    head = BUILTIN["llama-3-8b"].kinds["head"]
    assert product_dtype(head, "output", "bf16", fp8) == "bf16"
    moe = BUILTIN["mixtral-8x7b"].kinds["block"]
    assert product_dtype(moe, "wq", "bf16", fp8) == "fp8" and product_dtype(moe, "w1", "bf16", fp8) == "bf16"
    assert "fp8 casts mlp" not in dict(forward_elementwise(moe, Shard.of(moe, tp=1, micro_batch=1, seq_len=1024,
                                                                         dtype="bf16"), fp8))


def test_an_fp8_product_runs_at_the_measured_share_of_the_fp8_peak():
    """A large FP8 product on an H100 takes the bf16 product's time over 2 x 0.883 (the FP8 peak,
    twice bf16's, at the share of it the H100's FP8 matrix products reach against bf16's:
    ml-engineering's Maximum Achievable Matmul FLOPS, 70.9 % against 80.3 %); a part without
    FP8 tensor cores refuses it."""
    from partita.devices import get_device
    from partita.search.roofline import FP8_OVER_BF16_SHARE, matmul_time_s
    assert FP8_OVER_BF16_SHARE == pytest.approx(0.883, abs=1e-3)
    h100 = get_device("H100")
    speedup = matmul_time_s(h100, 16384, 16384, 16384, "bf16") / matmul_time_s(h100, 16384, 16384, 16384, "fp8")
    assert speedup == pytest.approx(2 * FP8_OVER_BF16_SHARE, rel=0.02)
    with pytest.raises(PartitaError, match="no fp8 peak"):
        matmul_time_s(get_device("A100-80GB"), 1024, 1024, 1024, "fp8")
