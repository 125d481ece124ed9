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
    for name in ("partita", "torchtitan", "deepspeed"):
        assert ENGINES[name].kernels == Kernels()
    assert ENGINES["torchtitan"].with_options({"norm": "eager"}).kernels.norm == "eager"
    with pytest.raises(PartitaError, match="unknown norm 'compiled'; valid: fused, eager"):
        ENGINES["torchtitan"].with_options({"norm": "compiled"})
    with pytest.raises(PartitaError, match="unknown rope 'triton'; valid: unfused, fused"):
        Kernels(rope="triton")
    with pytest.raises(PartitaError, match="unknown rope 'triton'"):
        ENGINES["megatron"].with_options({"rope": "triton"})


def test_a_gpt2_block_has_no_rotary_and_no_gate():
    kind = BUILTIN["gpt2"].kinds["block"]
    sh = Shard.of(kind, tp=1, micro_batch=1, seq_len=1024, dtype="bf16")
    fused = Kernels(rope="fused", glu="fused", kv="native")
    assert forward_elementwise(kind, sh, fused) == forward_elementwise(kind, sh, Kernels())
