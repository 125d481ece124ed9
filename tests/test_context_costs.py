"""The context-parallel cost formulas (``partita.search.context``): hand-computed small cases,
the scaling laws they must obey (1/cp per rank, constant messages when s and cp grow together,
nothing at cp = 1), a brute-force count of the (query, key) pairs each rank computes, and the
limits. No torch: ``partita.search`` must import without it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from partita import parallel
from partita.errors import PartitaError
from partita.model import ModelSpec
from partita.model_io import load_model
from partita.search.analytic import activation_bytes
from partita.search.context import (all_to_all_limit, all_to_all_traffic, attention_flops, causal_attention_flops,
                                    cp_activation_bytes, ring_backward_time_s, ring_block_bytes, ring_forward_time_s,
                                    ring_kv_heads, ring_step_flops, ring_traffic, ring_transient_bytes, sequence_limit,
                                    te_ring_backward_time_s, te_ring_traffic)
from partita.search.costs.links import Link, collective_s
from torch_blocker import BLOCK_TORCH

SMALL = dict(batch=1, seq=8, head_dim=2, elem=2)  # L = 4 tokens a rank at cp 2
LLAMA_8B = load_model("llama-3-8b")  # 32 heads, 8 kv heads, hidden 4096


# ---- communication, by hand --------------------------------------------------------------------


def test_all_to_all_bytes_of_a_small_case():
    t = all_to_all_traffic(heads=4, kv_heads=2, cp=2, **SMALL)
    # q and out: 1 x 4 tokens x 4 heads x 2 x 2 B = 64; k and v: 2 heads: 32. Half leaves the rank.
    assert t.op == "all_to_all"
    assert t.forward_messages == t.backward_messages == (64, 32, 32, 64)
    assert t.forward_wire_bytes == t.backward_wire_bytes == 96
    assert t.total_wire_bytes == 192


def test_all_to_all_messages_shrink_as_1_over_cp_and_stay_put_when_s_grows_with_cp():
    shape = dict(batch=2, heads=32, kv_heads=8, head_dim=128, elem=2)
    by_cp = {cp: all_to_all_traffic(seq=65536, cp=cp, **shape) for cp in (2, 4, 8)}
    assert sum(by_cp[4].forward_messages) * 2 == sum(by_cp[2].forward_messages)
    assert sum(by_cp[8].forward_messages) * 2 == sum(by_cp[4].forward_messages)
    # Ulysses: sequence and degree grown together keep each rank's messages the same.
    assert all_to_all_traffic(seq=8192 * 8, cp=8, **shape).forward_messages == \
        all_to_all_traffic(seq=8192 * 2, cp=2, **shape).forward_messages


def test_ring_bytes_of_a_small_case():
    kv = ring_kv_heads(4, 2)  # the runtime repeats kv heads before SDPA: the ring moves all 4
    assert kv == 4 and ring_kv_heads(4, 2, repeated=False) == 2
    assert ring_block_bytes(kv_heads=kv, cp=2, **SMALL) == 2 * 4 * 4 * 2 * 2  # K and V, 4 tokens, 4 heads
    t = ring_traffic(kv_heads=kv, cp=2, **SMALL)
    assert t.op == "p2p"
    assert t.forward_messages == (128,)
    assert t.backward_messages == (128, 256, 256)  # K/V again, then dK/dV in fp32 at each of the 2 steps
    assert (t.forward_wire_bytes, t.backward_wire_bytes) == (128, 640)
    g = ring_traffic(kv_heads=kv, cp=2, rotate="allgather", **SMALL)
    assert g.op == "all_gather" and g.forward_messages == (256,) and g.forward_wire_bytes == 128


def test_transformer_engine_s_ring_by_hand():
    """Transformer Engine's ring (Megatron-LM's context parallelism): K/V at the kernel's kv
    heads in the compute dtype; its backward passes K/V on the first step, K/V with the dK/dV so
    far on each between, dK/dV alone on the last, all in the compute dtype."""
    b = ring_block_bytes(kv_heads=2, cp=4, **SMALL)  # K and V, 2 tokens, 2 kv heads: 32 bytes
    t = te_ring_traffic(kv_heads=2, cp=4, **SMALL)
    assert t.forward_messages == (b, b, b)
    assert t.backward_messages == (b, 2 * b, 2 * b, b)
    assert (t.forward_wire_bytes, t.backward_wire_bytes) == (3 * b, 6 * b)
    two = te_ring_traffic(kv_heads=2, cp=2, **SMALL)
    assert two.forward_messages == (ring_block_bytes(kv_heads=2, cp=2, **SMALL),)
    assert two.backward_messages == two.forward_messages * 2
    assert te_ring_traffic(kv_heads=2, cp=1, **SMALL).total_wire_bytes == 0
    # Against torch's ring at the same kv heads: no fp32 dK/dV travelling the whole ring.
    torch_ring = ring_traffic(kv_heads=2, cp=4, **SMALL)
    assert t.backward_wire_bytes < torch_ring.backward_wire_bytes
    # Every pass beside its step: what a step's compute hides costs nothing.
    assert te_ring_backward_time_s(step_compute_s=1.0, step_comm_s=[0.5, 0.9, 0.9, 0.5]) == 4.0
    assert te_ring_backward_time_s(step_compute_s=1.0, step_comm_s=[0.5, 1.5, 1.5, 0.5]) == 5.0
    te = ring_transient_bytes(heads=4, kv_heads=2, cp=2, ring="transformer_engine", **SMALL)
    block = ring_block_bytes(kv_heads=2, cp=2, **SMALL)
    assert te.backward == 4 * block + 1 * 4 * 4 * 2 * 2  # two K/V + dK/dV pairs and dQ (4 tokens, 4 heads)


def test_the_megatron_engine_prices_its_ring_at_the_kv_heads():
    """llama-3-8b (32 heads, 8 kv heads) at cp 2 on one node: under the megatron engine the ring
    moves a quarter of torch's K/V bytes and no fp32 gradients, so it hides behind the steps'
    attention; the same engine with torch's ring exposes some; the attention core is the same."""
    from partita.cluster import parse_short
    from partita.search.context import attention_time
    from partita.search.costs.model import CostModel
    from partita.search.engines import ENGINES
    cluster = parse_short("1x8xH100")
    times = {}
    for ring in ("torch", "transformer_engine"):
        engine = ENGINES["megatron"].with_options({"cp_ring": ring})
        cm = CostModel(LLAMA_8B, cluster, seq_len=65536, dtype="bf16", engine=engine).at_cp(2, "ring", 0)
        times[ring] = attention_time(cm, cm.cluster.groups[0], 1, 1)
    assert ENGINES["megatron"].cp_ring == "transformer_engine" and ENGINES["partita"].cp_ring == "torch"
    assert times["transformer_engine"].local_forward_s == times["torch"].local_forward_s
    exposed = {k: t.exposed_forward_s + t.exposed_backward_s for k, t in times.items()}
    assert exposed["torch"] > 0
    assert exposed["transformer_engine"] == pytest.approx(0.0, abs=1e-9)


def test_ring_wire_bytes_per_rank_grow_with_the_steps_but_each_block_shrinks():
    shape = dict(batch=1, seq=65536, kv_heads=32, head_dim=128, elem=2)
    blocks = {cp: ring_block_bytes(cp=cp, **shape) for cp in (2, 4, 8)}
    assert blocks[2] == 2 * blocks[4] == 4 * blocks[8]
    for cp in (2, 4, 8):  # the forward sends (cp - 1) blocks: (cp - 1) / cp of the whole K/V
        assert ring_traffic(cp=cp, **shape).forward_wire_bytes == (cp - 1) * blocks[cp]


@pytest.mark.parametrize("traffic", [
    lambda: all_to_all_traffic(heads=4, kv_heads=2, cp=1, **SMALL),
    lambda: ring_traffic(kv_heads=4, cp=1, **SMALL),
    lambda: ring_traffic(kv_heads=4, cp=1, rotate="allgather", **SMALL)])
def test_cp_1_communicates_nothing(traffic):
    t = traffic()
    assert t.forward_messages == t.backward_messages == ()
    assert t.total_wire_bytes == 0


def test_all_to_all_time_is_latencies_plus_the_bytes_sent():
    """As the cost model prices it: cp - 1 exchange latencies and (cp - 1)/cp of the buffer sent."""
    link = Link("loopback", 100, 1e-5)  # efficiency 1: the nominal rate
    assert collective_s({}, "all_to_all", 1e9, 4, link) == pytest.approx(3e-5 + 0.75e9 / 100e9)
    assert collective_s({}, "all_to_all", 1e9, 1, link) == 0.0


def test_ring_overlap_hides_what_fits_behind_each_step():
    assert ring_forward_time_s(step_compute_s=1.0, step_comm_s=0.5, cp=4) == 4.0  # all hidden
    assert ring_forward_time_s(step_compute_s=1.0, step_comm_s=3.0, cp=4) == 4.0 + 3 * 2.0  # 3 passes, 2 s over each
    assert ring_forward_time_s(step_compute_s=1.0, step_comm_s=3.0, cp=4, rotate="allgather") == 6.0
    assert ring_forward_time_s(step_compute_s=1.0, step_comm_s=3.0, cp=1) == 1.0
    # backward: K/V and dK/dV share the link in each of cp - 1 steps; the last dK/dV pass is exposed
    assert ring_backward_time_s(step_compute_s=1.0, kv_comm_s=1.0, grad_comm_s=2.0, cp=4) == 4.0 + 3 * 2.0 + 2.0
    assert ring_backward_time_s(step_compute_s=1.0, kv_comm_s=0.2, grad_comm_s=0.3, cp=4) == 4.0 + 0.3

    # a first step of its own (the masked one): the others as before, the transfers behind each
    assert ring_forward_time_s(step_compute_s=1.0, step_comm_s=0.5, cp=4, first_step_s=2.0) == 5.0
    assert ring_forward_time_s(step_compute_s=1.0, step_comm_s=1.5, cp=4, first_step_s=2.0) == 5.0 + 2 * 0.5
    assert ring_forward_time_s(step_compute_s=1.0, step_comm_s=3.0, cp=1, first_step_s=2.0) == 2.0
    assert ring_backward_time_s(step_compute_s=1.0, kv_comm_s=1.0, grad_comm_s=1.0, cp=3, first_step_s=2.0) == (
        4.0 + 0.0 + 1.0 + 1.0)
    assert te_ring_backward_time_s(step_compute_s=1.0, step_comm_s=[0.5, 1.5, 0.5], first_step_s=2.0) == 4.5


def test_the_rings_steps_after_the_first_run_unmasked():
    """Head-tail balanced, every step holds the same pairs, but only the first (the rank's own
    block) is causal; each other step is half a block against a whole one with no mask, which a
    fused kernel runs at its unmasked rate (the FlashAttention-3 paper's full-attention bars):
    the ring's compute is the causal core at L = s/cp plus cp - 1 halves of the unmasked core."""
    from partita.cluster import parse_short
    from partita.search import context
    from partita.search.costs.model import CostModel
    from partita.search.engines import ENGINES

    cluster = parse_short("2x8xH100")
    for engine in ("megatron", "partita"):
        cm = CostModel(LLAMA_8B, cluster, seq_len=131072, dtype="bf16", engine=ENGINES[engine]).at_cp(8, "ring", 0)
        at = context.attention_time(cm, cm.cluster.groups[0], 2, 1)
        local = context.Shard.of(LLAMA_8B.kinds["block"], tp=2, micro_batch=1, seq_len=cm.seq_len, dtype="bf16")
        causal = context.attention_core_s(cm, "H100", local)
        full = context.attention_core_s(cm, "H100", local, causal=False)
        assert (at.local_forward_s, at.local_backward_s) == causal
        assert at.forward_s == pytest.approx(causal[0] + 7 * full[0] / 2)
        assert at.backward_s == pytest.approx(causal[1] + 7 * full[1] / 2)
        # the same pairs as cp causal blocks, at the unmasked rate: faster, by less than 2x
        assert 0.5 * 8 * causal[0] < at.forward_s < 8 * causal[0]


# ---- compute --------------------------------------------------------------------------------------


def test_attention_flops_by_hand():
    assert causal_attention_flops(1, 1, 4, 4, 1) == 4 * 8  # 16 / 2 pairs
    assert causal_attention_flops(1, 1, 2, 4, 1) == 4 * (2 * 2 + 2)  # the last 2 of 4 queries: 4 + 2 pairs
    whole = causal_attention_flops(1, 4, 8, 8, 2)
    assert whole == 1024
    assert attention_flops(variant="all_to_all", batch=1, seq=8, heads=4, head_dim=2, cp=2) == 512
    assert attention_flops(variant="ring", batch=1, seq=8, heads=4, head_dim=2, cp=2) == 512
    assert ring_step_flops(batch=1, seq=8, heads=4, head_dim=2, cp=2) == 256
    assert attention_flops(variant="ring", batch=1, seq=8, heads=4, head_dim=2, cp=2, balanced=False) == 768


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_both_balanced_variants_split_the_causal_work_evenly(cp):
    shape = dict(batch=2, seq=4096, heads=32, head_dim=128)
    whole = causal_attention_flops(2, 32, 4096, 4096, 128)
    for variant in ("all_to_all", "ring"):
        assert attention_flops(variant=variant, cp=cp, **shape) == pytest.approx(whole / cp)


def _pairs(queries: list[int]) -> int:
    return sum(q + 1 for q in queries)  # causal: query q sees keys 0..q


def _positions(seq: int, cp: int, rank: int, head_tail: bool) -> list[int]:
    if not head_tail:
        per = seq // cp
        return list(range(rank * per, (rank + 1) * per))
    k = seq // (2 * cp)
    return list(range(rank * k, (rank + 1) * k)) + list(range((2 * cp - 1 - rank) * k, (2 * cp - rank) * k))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_head_tail_gives_every_rank_the_same_pairs_and_contiguous_does_not(cp):
    """Brute force: count the (query, key) pairs each rank's queries need under the causal mask."""
    seq = 1024
    balanced = [_pairs(_positions(seq, cp, r, True)) for r in range(cp)]
    assert len(set(balanced)) == 1 and sum(balanced) == seq * (seq + 1) // 2
    contiguous = [_pairs(_positions(seq, cp, r, False)) for r in range(cp)]
    assert contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1]
    # The formulas count s^2/2 pairs (no diagonal); with it the busiest rank's share is the same to O(1/s).
    ratio = attention_flops(variant="ring", batch=1, seq=seq, heads=1, head_dim=1, cp=cp, balanced=False) / \
        attention_flops(variant="ring", batch=1, seq=seq, heads=1, head_dim=1, cp=cp)
    assert max(contiguous) / balanced[0] == pytest.approx(ratio, rel=cp / seq)


# ---- memory ---------------------------------------------------------------------------------------


BLOCK = LLAMA_8B.kinds["block"]
MEM = dict(tp=1, micro_batch=1, seq_len=8192, dtype="bf16")


def test_cp_1_keeps_what_no_cp_keeps():
    for variant in ("all_to_all", "ring"):
        for role in ("embed", "block", "head"):
            assert cp_activation_bytes(LLAMA_8B.kinds[role], variant=variant, cp=1, **MEM) == \
                activation_bytes(LLAMA_8B.kinds[role], **MEM)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_activations_divide_by_cp(cp):
    whole = activation_bytes(BLOCK, **MEM)
    assert cp_activation_bytes(BLOCK, variant="ring", cp=cp, **MEM) * cp == whole
    for recompute in ("selective", "full"):
        assert cp_activation_bytes(BLOCK, variant="all_to_all", cp=cp, recompute=recompute, **MEM) * cp == \
            activation_bytes(BLOCK, recompute=recompute, **MEM)
    # all-to-all: wo's input is a copy of the attention output, 1 x 8192/cp tokens x 4096 x 2 B
    assert cp_activation_bytes(BLOCK, variant="all_to_all", cp=cp, **MEM) == whole // cp + 8192 // cp * 4096 * 2


def test_ring_transient_bytes_of_a_small_case():
    t = ring_transient_bytes(heads=4, kv_heads=4, cp=2, **SMALL)
    # forward: 2 blocks of 128 B in flight, fp32 output 4 tokens x 4 heads x 2 x 4 B = 128, logsumexp 64
    assert t.forward == 2 * 128 + 128 + 4 * 4 * 4
    # backward: 2 blocks, the dK/dV accumulator sent, received and this step's (3 x 256), fp32 dQ
    assert t.backward == 2 * 128 + 3 * 256 + 128
    assert ring_transient_bytes(heads=4, kv_heads=4, cp=2, rotate="allgather", **SMALL).forward == t.forward
    assert ring_transient_bytes(heads=4, kv_heads=4, cp=1, **SMALL).forward == 0


# ---- limits ---------------------------------------------------------------------------------------


def test_limits_say_what_does_not_divide():
    assert all_to_all_limit(32, 8, cp=4, tp=2) is None
    assert all_to_all_limit(32, 8, cp=4, tp=4) == \
        "all-to-all context parallelism needs kv_heads (8) divisible by cp x tp = 4 x 4 = 16"
    assert "heads (6)" in all_to_all_limit(6, 6, cp=4)
    assert parallel.cp_rule(BLOCK, 8, variant="ring", seq_len=131072) is None
    assert parallel.cp_rule(BLOCK, 4, variant="ring", seq_len=100) == \
        "ring attention needs the sequence length (100) divisible by 2 x cp = 8"
    assert sequence_limit(100, 3) == "sequence length 100 is not divisible by context-parallel degree 3"
    assert sequence_limit(100, 0) == "context-parallel degree must be >= 1, got 0"


def test_cp_limits_per_layer_kind():
    block, embed = BLOCK, LLAMA_8B.kinds["embed"]  # 32 heads, 8 kv heads
    assert parallel.cp_rule(block, 8, variant="all_to_all", seq_len=8192) is None
    assert "kv_heads (8)" in parallel.cp_rule(block, 4, variant="all_to_all", seq_len=8192, tp=4)
    assert parallel.cp_rule(block, 16, variant="ring", seq_len=8192, tp=8) is None  # the ring has no head limit
    assert "2 x cp = 32" in parallel.cp_rule(block, 16, variant="ring", seq_len=8208)
    assert parallel.cp_rule(embed, 16, variant="ring", seq_len=8208) is None  # no attention: the shards suffice
    assert parallel.cp_rule(block, 1, variant="ring", seq_len=8) is None
    with pytest.raises(PartitaError, match="unknown context-parallel variant 'ulysses'; valid: all_to_all, ring"):
        cp_activation_bytes(block, variant="ulysses", cp=2, tp=1, micro_batch=1, seq_len=8192, dtype="bf16")


def test_formulas_refuse_shapes_that_do_not_split():
    with pytest.raises(PartitaError, match="not divisible by context-parallel degree 3"):
        all_to_all_traffic(heads=4, kv_heads=2, cp=3, **SMALL)
    with pytest.raises(PartitaError, match="unknown ring rotate method 'p2p'"):
        ring_traffic(kv_heads=4, cp=2, rotate="p2p", **SMALL)


def test_the_cost_module_imports_without_torch():
    code = BLOCK_TORCH + "import partita.search.context as c\nprint(c.VARIANTS)\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "all_to_all" in r.stdout


def test_a_spec_with_gqa_heads_is_checked_like_the_runtime():
    spec = ModelSpec.from_dict(dict(load_model("tiny-llama").to_dict(), name="t", heads=8, kv_heads=4))
    assert parallel.cp_rule(spec.kinds["block"], 2, variant="all_to_all", seq_len=16, tp=2) is None
    assert parallel.cp_rule(spec.kinds["block"], 4, variant="all_to_all", seq_len=16, tp=2) is not None


def test_the_all_gather_variant_moves_kv_heads_and_does_1_over_cp_of_the_attention():
    """Llama 3's context parallelism (``gather_traffic``): K and V gathered at the rank's kv heads
    (llama-3-405b at tp 8: 1 of them, where the runtime's ring passes the 16 query heads'
    repeated K/V); the attention 1/cp of the whole sequence's pairs, nearly all of them unmasked
    (each of a rank's two chunks against the keys up to its end: only the chunk's own block is
    under the lower-right mask); the gathers and the gradients' reduce-scatters exposed."""
    from partita.cluster import parse_short
    from partita.model import BUILTIN
    from partita.search import context
    from partita.search.costs.model import CostModel

    t = context.gather_traffic(batch=1, seq=131072, kv_heads=1, head_dim=128, elem=2, cp=16)
    assert t.forward_messages == t.backward_messages == (131072 * 128 * 2,) * 2
    assert t.forward_wire_bytes == pytest.approx(2 * 15 / 16 * 131072 * 128 * 2)
    model, cluster = BUILTIN["llama-3-405b"], parse_short("16x8xH100")
    base = CostModel(model, cluster, seq_len=131072)
    gather, ring = (base.at_cp(16, v, span_tp=8) for v in ("all_gather", "ring"))
    group = gather.cluster.groups[0]
    g, r = (context.attention_time(cm, group, 8, 1) for cm in (gather, ring))
    shard = context.Shard.of(model.kinds["block"], tp=8, micro_batch=1, seq_len=131072, dtype="bf16")
    whole = context.attention_core_s(base, "H100", shard)
    full = context.attention_core_s(base, "H100", shard, causal=False)
    for i in (0, 1):  # 31 of 32 blocks' pairs unmasked, one under the mask: between the two rates
        at = (g.forward_s, g.backward_s)[i]
        assert at == pytest.approx(full[i] * 31 / 1024 + whole[i] / 512)
        assert full[i] / 32 < at < whole[i] / 16
    assert 0 < g.exposed_forward_s < r.exposed_forward_s / 4
    saved = context.cp_activation_bytes(model.kinds["block"], variant="all_gather", cp=16, tp=8, micro_batch=1,
                                        seq_len=131072, dtype="bf16")
    plain = context.cp_activation_bytes(model.kinds["block"], variant="ring", cp=16, tp=8, micro_batch=1,
                                        seq_len=131072, dtype="bf16")
    assert saved - plain == context.gather_saved_bytes(batch=1, seq=131072, heads=16, kv_heads=1, head_dim=128,
                                                       elem=2, cp=16)


def test_transformer_engine_s_all_gather_keeps_the_local_k_and_v_and_gathers_again():
    """Transformer Engine's all-gather context parallelism (``AttnFuncWithCPAndKVAllGather``: the
    megatron engine, ``cp_ring`` "transformer_engine") saves the rank's own k and v and all-gathers
    them again before its backward: it keeps what the ring keeps (nothing added to the local
    count), and its backward pays the gathers beside the gradients' reduce-scatters."""
    from partita.cluster import parse_short
    from partita.model import BUILTIN
    from partita.search import context
    from partita.search.costs.model import CostModel
    from partita.search.engines import ENGINES

    model, cluster = BUILTIN["llama-3-405b"], parse_short("16x8xH100")
    kind = model.kinds["block"]
    shape = dict(cp=16, tp=8, micro_batch=1, seq_len=131072, dtype="bf16")
    ring = context.cp_activation_bytes(kind, variant="ring", **shape)
    assert context.cp_activation_bytes(kind, variant="all_gather", regathers=True, **shape) == ring
    assert context.cp_activation_bytes(kind, variant="all_gather", **shape) > ring
    torch_cm, te_cm = (CostModel(model, cluster, seq_len=131072, engine=ENGINES[e]).at_cp(16, "all_gather", span_tp=8)
                       for e in ("torchtitan", "megatron"))
    assert ENGINES["megatron"].cp_ring == "transformer_engine" and ENGINES["torchtitan"].cp_ring == "torch"
    group = te_cm.cluster.groups[0]
    t, te = (context.attention_time(cm, group, 8, 1) for cm in (torch_cm, te_cm))
    assert te.exposed_forward_s == pytest.approx(t.exposed_forward_s)
    assert te.exposed_backward_s == pytest.approx(t.exposed_backward_s + t.exposed_forward_s)
