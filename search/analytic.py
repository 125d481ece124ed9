"""The analytic profile: one layer's time and memory from its shapes and a device's datasheet.

    from partita.devices import get_device
    from partita.model_io import load_model
    from partita.search.analytic import analytic_profile, layer_cost
    spec = load_model("llama-2-7b")
    cost = layer_cost(spec.kinds["block"], get_device("H100"), tp=2, micro_batch=1, seq_len=4096, dtype="bf16")
    profile = analytic_profile(get_device("H100"), spec.kinds.values(), tps=(1, 2, 4, 8),
                               micro_batches=(1, 2, 4), seq_len=4096, dtype="bf16")

A layer's forward is the sum of the kernels PyTorch eager runs for it (``partita.runtime.models``):
its matrix products (``roofline.matmul_time_s`` with m = micro_batch * seq_len tokens), fused
attention, and the memory-bound elementwise kernels (norms, rotary, activations, residual adds),
each priced by the bytes it reads and writes (``search/kernels.py``, with the fused kernels other
engines run instead). The backward runs two products per forward product
(dX = dY @ W^T and dW = X^T @ dY), the attention backward, and elementwise kernels that move
twice the forward's bytes (a norm its own, ``norm_bytes_per_element``), plus the reductions only
the backward has (bias gradients, the embedding's gradient table). Recomputing a checkpointed
layer repeats its forward; a selectively recomputed block repeats what it did not keep
(``selective_recompute_time_s``).

Tensor parallelism over ``tp`` ranks splits q, k, v, w1, w3 by columns and wo, w2 by rows, so a
rank holds heads/tp query heads, kv_heads/tp kv heads and ffn/tp of the MLP; embed and head hold
vocab/tp rows. The collectives that tensor parallelism adds are not here: the cost model prices
them from the profile's comm entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from partita import parallel
from partita.devices import DeviceType
from partita.errors import PartitaError
from partita.model import LayerKind
from partita.plan import RECOMPUTE
from partita.profile import LayerCost, Profile, Provenance
from partita.search.kernels import (FP8_INPUT_CASTS, INDEX_BYTES, Kernels, backward_elementwise, forward_elementwise,
                                    norm_bytes_per_element)
from partita.search.roofline import (ATTENTION_KERNELS, attention_time_s, batched_matmul_time_s, element_bytes,
                                     matmul_time_s, memory_time_s)

QKV_SAVES = ("repeated", "fused")  # activation_bytes: what attention keeps of q, k and v
GLU_SAVES = ("outputs", "input")  # activation_bytes: what llama's SwiGLU keeps
STAT_BYTES = 4  # norm statistics and attention's logsumexp are fp32 whatever the dtype
@dataclass(frozen=True)
class Shard:
    """One rank's share of a layer for one micro-batch: the dimensions its kernels see."""

    batch: int
    seq: int
    hidden: int
    heads: int  # query heads on this rank
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    elem: int  # bytes per element of the compute dtype
    # A mixture of experts under tensor parallelism runs its MoE on the rank's 1/tp of the tokens
    # with whole experts (``parallel.moe_tp_rule``): ``ffn`` is then whole and this is tp.
    moe_split: int = 1

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def moe_tokens(self) -> int:
        """The tokens this rank's MoE runs (its sequence shard under tensor parallelism)."""
        return self.tokens // self.moe_split

    @classmethod
    def of(cls, kind: LayerKind, *, tp: int, micro_batch: int, seq_len: int, dtype: str) -> "Shard":
        if micro_batch < 1 or seq_len < 1 or tp < 1:
            raise PartitaError(f"micro_batch, seq_len and tp must be positive, got {micro_batch}, {seq_len}, {tp}")
        why = parallel.tp_rule(kind, tp)
        if why:
            raise PartitaError(f"{kind.role} layer cannot be split {tp} ways: {why}")
        if kind.learned_positions and seq_len > kind.learned_positions:
            raise PartitaError(f"sequence length {seq_len} exceeds the model's {kind.learned_positions} learned "
                               f"positions; train with seq_len <= {kind.learned_positions}")
        moe = kind.role == "block" and kind.is_moe
        return cls(batch=micro_batch, seq=seq_len, hidden=kind.hidden, heads=kind.heads // tp,
                   kv_heads=kind.kv_heads // tp, head_dim=kind.head_dim, ffn=kind.ffn if moe else kind.ffn // tp,
                   vocab=kind.vocab // tp, elem=element_bytes(dtype), moe_split=tp if moe else 1)


# ---- what the forward runs ------------------------------------------------------------------
def forward_matmuls(kind: LayerKind, sh: Shard) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of each forward product C[m,n] = X[m,k] @ W[k,n]."""
    t, h, q, kv, f = sh.tokens, sh.hidden, sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim, sh.ffn
    if kind.role == "embed":
        return []
    if kind.role == "head":
        return [("output", t, sh.vocab, h)]
    attention = [("wq", t, q, h), ("wk", t, kv, h), ("wv", t, kv, h), ("wo", t, h, q)]
    if kind.is_moe:  # the router, the k expert rows of every token (balanced), the shared expert
        tm = sh.moe_tokens
        routed = tm * kind.experts_per_token
        moe = [("router", tm, kind.experts, h), ("w1", routed, f, h), ("w3", routed, f, h), ("w2", routed, h, f)]
        if kind.shared_expert_ffn:
            sf = kind.shared_expert_ffn
            moe += [("shared w1", tm, sf, h), ("shared w3", tm, sf, h), ("shared w2", tm, h, sf),
                    ("shared gate", tm, 1, h)]
        return attention + moe
    if kind.family == "llama":
        return attention + [("w1", t, f, h), ("w3", t, f, h), ("w2", t, h, f)]
    return attention + [("w1", t, f, h), ("w2", t, h, f)]


# The products FP8 runs in (``Kernels.matmul`` "fp8"): a block's linear layers, the attention's and
# a dense MLP's. Transformer Engine's FP8 covers its own layers (TELayerNormColumnParallelLinear,
# TERowParallelLinear); Megatron-LM's output layer is its own ColumnParallelLinear, in the compute
# dtype, as is the attention core (FP8 attention is a separate option, off by default). A mixture's
# experts run in FP8 under Megatron too, which is not priced: parallel.fp8_rule refuses mixtures.
FP8_PRODUCTS = {"attention": ("wq", "wk", "wv", "wo"), "mlp": ("w1", "w3", "w2")}


def product_dtype(kind: LayerKind, name: str, dtype: str, kernels: Kernels = Kernels()) -> str:
    """The dtype the product ``name`` of ``forward_matmuls`` runs in: "fp8" for a block's linear
    layers (``FP8_PRODUCTS``) under ``kernels.matmul`` "fp8", else the compute dtype."""
    if kernels.matmul != "fp8" or kind.role != "block":
        return dtype
    fp8 = FP8_PRODUCTS["attention"] + (() if kind.is_moe else FP8_PRODUCTS["mlp"])
    return "fp8" if name in fp8 else dtype


def moe_activation_bytes(kind: LayerKind, sh: Shard) -> int:
    """What a mixture-of-experts MLP keeps for its backward beyond what a dense block keeps
    before its MLP (its norm's output, counted there): the router's fp32 probabilities and the
    chosen weights, the k gathered rows every token sends to its experts (each expert's w1 and
    w3 input), SwiGLU's four ffn-wide tensors on those rows, the experts' outputs (the weighted
    sum's input), and the shared expert's SwiGLU and gate (on the rank's MoE tokens)."""
    e, t, h, k = sh.elem, sh.moe_tokens, sh.hidden, kind.experts_per_token
    kept = t * kind.experts * 4 + t * k * (INDEX_BYTES + e) + 2 * t * k * h * e + 4 * t * k * sh.ffn * e
    if kind.shared_expert_ffn:
        kept += 4 * t * kind.shared_expert_ffn * e + 2 * t * e
    return kept


def backward_only_kernels(kind: LayerKind, sh: Shard) -> list[tuple[str, float]]:
    """Memory-bound backward kernels with no forward counterpart."""
    e, t = sh.elem, sh.tokens
    if kind.role == "embed":
        # Zero the gradient table, then scatter-add the incoming gradient rows into it.
        ops = [("zero token grad", sh.vocab * sh.hidden * e), ("scatter token grad", 3 * t * sh.hidden * e)]
        if kind.learned_positions:
            ops += [("zero position grad", kind.learned_positions * sh.hidden * e),
                    ("scatter position grad", 3 * t * sh.hidden * e)]
        return ops
    biased = []
    if kind.role == "block" and kind.family == "gpt2":
        biased = ["wq", "wk", "wv", "wo", "w1", "w2"]
    elif kind.role == "block" and kind.qkv_bias:
        biased = ["wq", "wk", "wv"]
    return [(f"{name} bias grad", m * n * e) for name, m, n, _ in forward_matmuls(kind, sh) if name in biased]


# ---- attention --------------------------------------------------------------------------------
# How a block computes softmax(q k^T) v: a fused kernel ("sdpa", the runtime's; "flash1",
# FlashAttention v1 and its 2022 Triton port; "flash2", FlashAttention-2; "cudnn", cuDNN's fused
# attention; "flash3", FlashAttention-3: ``roofline.ATTENTION_KERNELS``, each by its throughput
# curve by sequence length), or "unfused" as Megatron-LM did before fused attention (its SC'21
# runs; Megatron-DeepSpeed's BLOOM): ``unfused_attention_time_s``.
ATTENTION = (*ATTENTION_KERNELS, "unfused")


def unfused_attention_time_s(dev: DeviceType, sh: Shard, dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of Megatron-LM's unfused attention (``ParallelAttention``,
    megatron/model/transformer.py, 2021): the scores of all b x heads as one batched product
    (``baddbmm``, the full s x s square: the causal mask is applied after), a fused
    scale-mask-softmax kernel that reads and writes the square, dropout on the probabilities
    (Megatron's default ``--attention-dropout 0.1``: reads the square, writes it and a byte of
    mask a score), and the batched product with v. The backward runs the two products' gradients
    (four batched products), dropout's backward (the gradient and the mask in, the gradient
    out) and softmax's (its output and the gradient in, the gradient out). Each score is
    written and read several times in HBM: at micro-batch 16 and 2048 tokens a 24-head layer
    moves ~20 GB per pass this way, which fused kernels never do."""
    batch, s, d, e = sh.batch * sh.heads, sh.seq, sh.head_dim, sh.elem
    square = batch * s * s  # score elements
    scores = batched_matmul_time_s(dev, batch, s, s, d, dtype)  # q k^T, and d(p) = d(ctx) v^T
    by_v = batched_matmul_time_s(dev, batch, s, d, s, dtype)  # p v, and dV, dQ, dK: [s, d] from [s, s] x [s, d]
    dropout = memory_time_s(dev, square * (2 * e + 1))
    forward = scores + memory_time_s(dev, 2 * square * e) + dropout + by_v
    backward = scores + 3 * by_v + dropout + memory_time_s(dev, 3 * square * e)
    return forward, backward


def attention_s(dev: DeviceType, sh: Shard, dtype: str, attention: str, *, causal: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of one block's attention core by the ``attention`` implementation
    (``causal`` False: every query against every key, as a ring's off-diagonal steps run; the
    unfused core computes the whole square either way)."""
    if attention not in ATTENTION:
        raise PartitaError(f"unknown attention implementation {attention!r}; valid: {', '.join(ATTENTION)}")
    if attention == "unfused":
        return unfused_attention_time_s(dev, sh, dtype)
    return attention_time_s(dev, sh.batch, sh.heads, sh.seq, sh.head_dim, causal=causal, dtype=dtype, kernel=attention)


# ---- time -----------------------------------------------------------------------------------
def forward_time_s(kind: LayerKind, dev: DeviceType, sh: Shard, dtype: str, attention: str = "sdpa",
                   kernels: Kernels = Kernels()) -> float:
    total = sum(matmul_time_s(dev, m, n, k, product_dtype(kind, name, dtype, kernels))
                for name, m, n, k in forward_matmuls(kind, sh))
    total += sum(memory_time_s(dev, nbytes) for _, nbytes in forward_elementwise(kind, sh, kernels))
    if kind.role == "block":
        total += attention_s(dev, sh, dtype, attention)[0]
    return total


# What a block's selective recomputation keeps (search/engines.py, ``selective_scope``): "ops",
# every matrix product's output (Partita's runtime); "alternate", torchtitan's "op" policy (its
# ``_save_list`` of mm, SDPA, reduce_scatter_tensor and max, "except every second mm").
SELECTIVE_KEEPS = ("ops", "alternate")


def alternate_recomputed(kind: LayerKind, sh: Shard) -> tuple[list, list]:
    """(kept, recomputed) products of a block under torchtitan's policy (``SELECTIVE_KEEPS``):
    the 2nd, 4th, ... of ``forward_matmuls`` are recomputed, but for the last product, whose
    output only the final residual add reads (the recomputation stops before it); the others,
    the last included, are kept. A llama block keeps wq, wv, w1, w2 and recomputes wk, wo, w3.
    A mixture of experts' products are counted in the same order (torchtitan runs its experts
    as grouped products, which the policy does not count: an approximation)."""
    products = forward_matmuls(kind, sh)
    recomputed = [p for i, p in enumerate(products) if i % 2 == 1 and i < len(products) - 1]
    return [p for p in products if p not in recomputed], recomputed


def selective_recompute_time_s(kind: LayerKind, dev: DeviceType, sh: Shard, dtype: str,
                               attention: str = "sdpa", kernels: Kernels = Kernels(), keeps: str = "ops") -> float:
    """What a selectively recomputed block runs again in backward: its forward without the
    matrix products (the runtime keeps their outputs, ``runtime.parallelize.selective_context``)
    and without what follows the last product (the final residual add: the recomputation stops
    once the last product's inputs are back): the other memory-bound kernels and the attention
    core. Under ``keeps`` "alternate" the attention core is kept and every second product is
    run again instead (``alternate_recomputed``)."""
    if keeps not in SELECTIVE_KEEPS:
        raise PartitaError(f"unknown selective keeps {keeps!r}; valid: {', '.join(SELECTIVE_KEEPS)}")
    elementwise = forward_elementwise(kind, sh, kernels)[:-1]  # the block's last kernel is the final residual add
    rerun = sum(memory_time_s(dev, nbytes) for _, nbytes in elementwise)
    if keeps == "alternate":
        return rerun + sum(matmul_time_s(dev, m, n, k, product_dtype(kind, name, dtype, kernels))
                           for name, m, n, k in alternate_recomputed(kind, sh)[1])
    return rerun + attention_s(dev, sh, dtype, attention)[0]


# The memory-bound kernels a layer runs outside its tensor-parallel region, on the residual
# stream: under sequence parallelism each runs on the rank's t/tp tokens (Megatron-LM's and
# DTensor's SequenceParallel norms; the residual adds on the sequence shards between them).
# The residual stream's kernels, which sequence parallelism runs on the rank's 1/tp of the tokens
# (torchao's FP8 casts of it among them: kernels.FP8_INPUT_CASTS).
SEQUENCE_SHARDED = {"block": ("attention norm", "residual add", "ffn norm", *FP8_INPUT_CASTS), "head": ("norm",)}


def sequence_parallel_savings_s(kind: LayerKind, dev: DeviceType, sh: Shard, tp: int,
                                kernels: Kernels = Kernels()) -> list[tuple[float, float]]:
    """For each forward memory-bound kernel of the layer, in ``forward_elementwise``'s order, the
    (forward, backward) seconds sequence parallelism over ``tp`` tensor-parallel ranks takes off
    it: the residual-stream kernels (``SEQUENCE_SHARDED``) on 1/tp of the tokens, forward and
    backward (``backward_elementwise``); (0, 0) for the others. Korthikanti et
    al. 2022, Table 4: a 22B layer's forward 7.7 -> 7.2 ms with it."""
    sharded = SEQUENCE_SHARDED.get(kind.role, ())

    def saved(nbytes: float) -> float:
        return memory_time_s(dev, nbytes) - memory_time_s(dev, nbytes / tp)

    return [(saved(nbytes), saved(back)) if name in sharded and tp > 1 else (0.0, 0.0)
            for (name, nbytes), (_, back) in zip(forward_elementwise(kind, sh, kernels),
                                                 backward_elementwise(kind, sh, kernels))]


# The column-parallel products of a layer (Megatron's ColumnParallelLinear: split by output
# columns, so its input gradient is a partial sum the tensor-parallel group reduces), grouped as
# Megatron fuses them into one linear: the attention's q, k, v; the MLP's first product(s).
COLUMN_PARALLEL = {"block": (("wq", "wk", "wv"), ("w1", "w3")), "head": (("output",),)}


def column_groups(kind: LayerKind) -> list[tuple[str, ...]]:
    """The layer's column-parallel products of one input (``COLUMN_PARALLEL``) as the kind has
    them: a gpt2 MLP's first product is w1 alone; a mixture of experts' block has only its
    attention's (its experts run whole, on sequence shards)."""
    groups = COLUMN_PARALLEL.get(kind.role, ())
    if kind.role == "block" and kind.is_moe:
        groups = groups[:1]
    if kind.role == "block" and kind.family != "llama":
        groups = tuple(tuple(name for name in group if name != "w3") for group in groups)
    return [tuple(group) for group in groups]


def column_wgrad_times_s(kind: LayerKind, dev: DeviceType, sh: Shard, dtype: str,
                         kernels: Kernels = Kernels()) -> list[float]:
    """The weight-gradient products (dW = X^T dY) of each of the layer's column-parallel linears,
    one entry a linear: what each one's input-gradient reduction can run beside in an engine that
    starts it before them (search/engines.py, ``dgrad_overlap``)."""
    products = {name: (m, n, k) for name, m, n, k in forward_matmuls(kind, sh)}
    return [sum(matmul_time_s(dev, k, n, m, product_dtype(kind, name, dtype, kernels)) for name in group if name in products
                for m, n, k in [products[name]]) for group in column_groups(kind)]


# A block's tensor-parallel segments: the column-parallel products of one input whose input is
# all-gathered under sequence parallelism, and the row-parallel product whose output is
# reduce-scattered (``tp_segments``).
ROW_PARALLEL = {"block": ("wo", "w2")}


def tp_segments(kind: LayerKind) -> list[tuple[tuple[str, ...], str]]:
    """(column-parallel group, row-parallel product) of each of a block's tensor-parallel regions
    as the kind has them: the attention's (wq, wk, wv; wo) and the MLP's ((w1, w3); w2, a gpt2
    MLP's w1 alone); a mixture of experts' block the attention's only (``column_groups``)."""
    if kind.role != "block":
        return []
    return list(zip(column_groups(kind), ROW_PARALLEL["block"]))


def linear_times_s(kind: LayerKind, dev: DeviceType, sh: Shard, dtype: str,
                   kernels: Kernels = Kernels()) -> dict[str, tuple[float, float]]:
    """(forward, backward: input and weight gradients) seconds of each product of
    ``forward_matmuls`` by name, on the roofline: the products a tensor-parallel collective
    chunked beside them can hide behind (search/costs/layer_time.py, ``tp_overlap_exposed_s``)."""
    times = {}
    for name, m, n, k in forward_matmuls(kind, sh):
        mm = product_dtype(kind, name, dtype, kernels)
        times[name] = (matmul_time_s(dev, m, n, k, mm), backward_matmul_s(dev, m, n, k, mm))
    return times


def backward_matmul_s(dev: DeviceType, m: int, n: int, k: int, dtype: str) -> float:
    """The backward of the forward product C[m,n] = X[m,k] @ W[k,n]: dX[m,k] = dY[m,n] @ W^T[n,k]
    and dW[k,n] = X^T[k,m] @ dY[m,n]."""
    return matmul_time_s(dev, m, k, n, dtype) + matmul_time_s(dev, k, n, m, dtype)


def backward_time_s(kind: LayerKind, dev: DeviceType, sh: Shard, dtype: str, attention: str = "sdpa",
                    kernels: Kernels = Kernels()) -> float:
    total = sum(backward_matmul_s(dev, m, n, k, product_dtype(kind, name, dtype, kernels))
                for name, m, n, k in forward_matmuls(kind, sh))
    total += sum(memory_time_s(dev, nbytes) for _, nbytes in backward_elementwise(kind, sh, kernels))
    total += sum(memory_time_s(dev, nbytes) for _, nbytes in backward_only_kernels(kind, sh))
    if kind.role == "block":
        total += attention_s(dev, sh, dtype, attention)[1]
    return total


# ---- memory ---------------------------------------------------------------------------------
def activation_bytes(kind: LayerKind, *, tp: int, micro_batch: int, seq_len: int, dtype: str,
                     sequence_parallel: bool = False, recompute: str = "none",
                     on_cpu: bool = False, local_experts: int = 0, sharded_inputs: bool = False,
                     glu_saves: str = "outputs", qkv_saves: str = "repeated", norm: str = "fused",
                     selective_keeps: str = "ops", fp8_inputs: bool = False) -> int:
    """Bytes autograd keeps from one micro-batch's forward for the backward, on one rank
    (``local_experts``: the routed experts a rank of a mixture of experts holds, E/ep; 0: all).

    Counted as distinct storages (a tensor saved by several ops, like the norm output that
    wq, wk and wv all save, counts once), parameters excluded. With b = micro_batch, s = seq_len,
    t = b*s tokens, e = bytes per element of ``dtype``, h = hidden, d = head_dim, the per-rank
    H = heads/tp, f = ffn/tp, V = vocab/tp, n = t*h*e (one residual-stream activation), and R
    what one norm keeps::

        R (RMSNorm, CUDA fused kernel)   = t*h*e + 4t               input, fp32 rstd
        R (RMSNorm, CPU: torch composite) = 2*t*h*max(e,4) + 4t     fp32 upcast input, fp32 x*rstd, rstd
        R (RMSNorm, ``norm`` "eager")    = t*h*(4+e) + 4t           fp32 upcast input, rstd, the
                                                                   downcast x*rstd the weight's product keeps
        R (LayerNorm, CUDA)              = t*h*e + 8t               input, fp32 mean and rstd
        R (LayerNorm, CPU)               = t*h*e + 2*t*e            input, mean and rstd in e

    ``on_cpu`` picks the CPU rows (``layer_cost`` sets it for the catalog's "cpu" device).

        block, llama = 2*(R + n) + 4*t*H*d*e + 4*b*H*s + 4*s*d*e + 4*t*f*e
        block, gpt2  = 2*(R + n) + 4*t*H*d*e + 4*b*H*s           + 2*t*f*e
        head         =    R + n  + 4*t*V + 8t + 4
        embed        = 8t  (+ 8s for gpt2's position ids)

    Term by term, for the block, in the runtime's order (``partita.runtime.models``):
      * each of the two norms keeps R; its output (n), the linears' shared input, is kept once
        for wq, wk, wv (and once for w1, w3 / gpt2's w1);
      * rotary (llama): the cos and sin tables, [1, s, 1, d] each, for q and for k (4*s*d*e);
      * SDPA (CUDA flash / efficient, CPU flash): q, k, v, the output, and the fp32 logsumexp
        [b, H, s]. k and v are kept at H heads, not kv_heads: the runtime repeats kv heads
        (``repeat_interleave``) before SDPA, and with no repetition kv_heads = heads anyway.
        wo keeps the output's [b, s, H*d] view, the same storage;
      * MLP, llama: w1's output (silu's input), silu's output and w3's output (the gate product's
        two inputs), and the product (w2's input): 4*t*f*e. gpt2: w1's output (gelu's input) and
        gelu's output (w2's input): 2*t*f*e;
      * residual adds, bias adds, transposes and reshapes keep nothing; dropout is off.
    The head: final norm (R), the output linear's input (n), then the loss, which the planner
    counts with the head: ``cross_entropy(logits.float())`` keeps log_softmax's fp32 output
    (4*t*V; the logits themselves are not kept), the int64 targets (8t) and nll_loss's fp32
    total weight (4). The embedding keeps only its int64 indices.

    Variants:
      * ``sequence_parallel``: the residual stream and the norms run on t/tp tokens, so R
        divides by tp. The linears' input is the all-gathered norm output, which DTensor's
        autograd keeps whole: n does not divide (unlike Megatron-LM, PyTorch does not re-gather it in the backward).
        ``sharded_inputs``: an engine that keeps the linears' input as its sequence shard and
        all-gathers it again in the backward for the weight gradient (Megatron-LM's
        ``LinearWithGradAccumulationAndAsyncCommunication``; Korthikanti et al. 2022, sec. 4.2.2):
        n divides by tp too (``search/engines.py``, ``sp_inputs``).
      * ``glu_saves="input"`` (llama's dense MLP): a fused SwiGLU kernel that keeps only its
        input, w1's and w3's outputs (one [t, 2f] tensor), and recomputes silu in its backward
        (Megatron-LM's ``SwiGLUFunction``, megatron/core/fusions/fused_bias_swiglu.py, on unless
        ``--no-bias-swiglu-fusion``): the product (w2's input) stays, silu's output is not
        kept: 3*t*f*e instead of 4*t*f*e.
      * ``qkv_saves="fused"``: one qkv projection whose output is split into q, k and v as views
        (Megatron-Core's ``get_query_key_value_tensors``: ``SplitAlongDim``), an attention kernel
        that takes k and v at their kv heads (Transformer Engine's ``DotProductAttention`` with
        ``num_gqa_groups``; no ``repeat_interleave``), and an out-of-place rotary: the kernel
        keeps the rotated q (H heads) and k (KV heads), the projection's whole output through v's
        view (H + 2 KV heads), and its output (H): t*d*e*(3H + 3KV) with rotary, t*d*e*(2H + 2KV)
        without (q, k and v all views then), against 4*t*H*d*e with the kv heads repeated.
      * ``fp8_inputs`` (FP8 products, ``Kernels.matmul`` "fp8"; a dense block, no recomputation):
        Transformer Engine's linears keep their inputs for the weight gradients in FP8, a byte an
        element (``LayerNormLinear`` its norm's FP8 output, ``Linear`` the transposed FP8 cast,
        ``cast_transpose``): the two norm outputs and w2's input shrink from e bytes to one, and
        wo keeps an FP8 copy of the attention output beside the kernel's own (+ t*H*d).
      * ``recompute="full"`` (full activation checkpointing of the layer): only the layer's
        input is kept: n for a block or the head (n/tp with sequence parallelism), the token ids
        for embed.
      * ``recompute="selective"`` (a block only): its input and the output of every matrix
        product but the last (``forward_matmuls``: C[m, n] keeps m*n*e), which the runtime's
        selective checkpointing saves (``runtime.parallelize.selective_context``); the rest is
        recomputed from them in backward::

            selective, llama = n/sp + t*(H + 2*KV)*d*e + t*h*e + 2*t*f*e
            selective, gpt2  = n/sp + t*(H + 2*KV)*d*e + t*h*e +   t*f*e

        (q, k, v; wo; w1, w3 or w1; KV = kv_heads/tp; w2's output feeds only the final residual
        add, which the recomputation never reaches). wo keeps its hidden-wide [t, h] partial sum
        from before the tensor-parallel reduction: it divides by neither tp nor sp. Korthikanti
        et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sec. 4)
        count 34*s*b*h + 5*a*s^2*b bytes a layer (fp16, every term /t with tensor and sequence
        parallelism) and recompute only the attention core, whose 5*a*s^2*b (softmax, its
        dropout mask and output) dominates; a fused attention kernel keeps no s^2 term, so the
        runtime recomputes the cheap elementwise work (norms, rotary, activation functions) too.
        Under ``selective_keeps`` "alternate" (torchtitan's policy, ``alternate_recomputed``) the
        block keeps its input, the kept products' outputs, the attention kernel's output and
        logsumexp, and under sequence parallelism the two reduce-scatters' outputs (n/sp each)::

            alternate, llama = n/sp + t*(H + KV)*d*e + t*f*e + t*h*e + t*H*d*e + 4*b*H*s (+ 2 n/sp)

    Not counted: CUDA SDPA's two int64 RNG scalars, the memory-efficient kernel's padding of
    logsumexp to a multiple of 32 rows, and tensors that live only during the forward.
    """
    if recompute not in RECOMPUTE:
        raise PartitaError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    sh = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=seq_len, dtype=dtype)
    t, e, h = sh.tokens, sh.elem, sh.hidden
    sp = tp if sequence_parallel else 1
    if kind.role == "embed":
        return t * INDEX_BYTES + (seq_len * INDEX_BYTES if kind.learned_positions else 0)
    if recompute == "full":
        return t * h * e // sp
    if recompute == "selective":
        if kind.role != "block":
            raise PartitaError(f"selective recomputation applies to decoder blocks, not the {kind.role}")
        if selective_keeps == "alternate":
            kept = sum(m * n for _, m, n, _ in alternate_recomputed(kind, sh)[0])
            attention_out = t * sh.heads * sh.head_dim * e + STAT_BYTES * sh.batch * sh.heads * seq_len
            reduced = 2 * (t * h * e // sp) if sp > 1 else 0
            return t * h * e // sp + e * kept + attention_out + reduced
        products = sum(m * n for _, m, n, _ in forward_matmuls(kind, sh))
        return t * h * e // sp + e * (products - last_product_elements(kind, sh, local_experts))
    norm_output = t * h * e  # saved by the linears that follow the norm
    if sharded_inputs:
        norm_output //= sp  # kept as the sequence shard, gathered again in the backward
    # A MoE under tensor parallelism takes its norm's output on the rank's sequence shard.
    ffn_input = norm_output // sh.moe_split
    if kind.role == "head":
        loss = t * sh.vocab * 4 + t * INDEX_BYTES + 4
        return _norm_bytes(kind, sh, on_cpu, norm) // sp + norm_output + loss
    if qkv_saves not in QKV_SAVES or glu_saves not in GLU_SAVES:
        raise PartitaError(f"qkv_saves must be one of {', '.join(QKV_SAVES)} and glu_saves one of "
                           f"{', '.join(GLU_SAVES)}, got {qkv_saves!r}, {glu_saves!r}")
    H, KV = sh.heads, sh.kv_heads
    if qkv_saves == "fused":
        heads_kept = (3 * H + 3 * KV) if kind.family == "llama" else (2 * H + 2 * KV)
    else:
        heads_kept = 4 * H
    attention = t * heads_kept * sh.head_dim * e + STAT_BYTES * sh.batch * H * seq_len
    if kind.family == "llama":
        rotary = 4 * seq_len * sh.head_dim * e
        gated = 3 if glu_saves == "input" else 4
        mlp = moe_activation_bytes(kind, sh) if kind.is_moe else gated * t * sh.ffn * e
    else:
        rotary = 0
        mlp = 2 * t * sh.ffn * e
    if fp8_inputs and not kind.is_moe:  # the linears' inputs in FP8: a byte an element
        norm_output, ffn_input = norm_output // e, ffn_input // e
        mlp -= t * sh.ffn * (e - 1)  # w2's input
        attention += t * H * sh.head_dim  # wo's FP8 copy of the attention output
    return 2 * (_norm_bytes(kind, sh, on_cpu, norm) // sp) + norm_output + ffn_input + attention + rotary + mlp


def last_product_elements(kind: LayerKind, sh: Shard, local_experts: int = 0) -> int:
    """The output elements of a block's last matrix product in the runtime's order, which
    selective recomputation does not keep (``runtime.parallelize.selective_context``): the MLP's
    w2 (t x h); a mixture of experts' shared expert's w2 (t' x h, it runs after the routed
    experts), else its last routed expert's w2 (its share of the t' k rows under balanced
    routing: t' k h / E_local)."""
    if kind.is_moe:
        if kind.shared_expert_ffn:
            return sh.moe_tokens * sh.hidden
        return sh.moe_tokens * kind.experts_per_token * sh.hidden // (local_experts or kind.experts)
    _, m, n, _ = forward_matmuls(kind, sh)[-1]
    return m * n


def _norm_bytes(kind: LayerKind, sh: Shard, on_cpu: bool, norm: str = "fused") -> int:
    """What one norm keeps for all t tokens (R in ``activation_bytes``)."""
    t, e, h = sh.tokens, sh.elem, sh.hidden
    if kind.family == "gpt2":
        # LayerNorm: input, mean and rstd; the CUDA kernel keeps the statistics in fp32, the CPU one in e.
        return t * h * e + 2 * t * (e if on_cpu else STAT_BYTES)
    if norm == "eager":
        # The module's ops keep the fp32 upcast input (pow's and the product's), rsqrt's output and
        # the downcast product the weight multiplies: saved-tensor hooks, tests/test_eager_norm.py.
        return t * h * (4 + e) + STAT_BYTES * t
    if on_cpu:
        # torch's composite rms_norm: the fp32 upcast input and the fp32 normalised tensor, fp32 rstd.
        return 2 * t * h * max(e, 4) + STAT_BYTES * t
    return t * h * e + STAT_BYTES * t  # the fused CUDA kernel: input, fp32 rstd


def param_bytes(kind: LayerKind, *, tp: int, dtype: str) -> int:
    """This rank's shard of the layer's parameters: split matrices and column-split biases
    divide by tp; norms, row-split biases and learned positions are replicated."""
    e = element_bytes(dtype)
    h, q, kv = kind.hidden, kind.heads * kind.head_dim, kind.kv_heads * kind.head_dim
    norm = h if kind.family == "llama" else 2 * h  # LayerNorm has a bias
    if kind.role == "embed":
        return e * (kind.vocab // tp * h + kind.learned_positions * h)
    if kind.role == "head":
        return e * (kind.vocab // tp * h + norm)
    split = (kind.matmul_params - kind.moe_params) // tp
    replicated = kind.moe_params  # a MoE's weights stay whole under tensor parallelism
    if kind.family == "gpt2":
        split += (q + 2 * kv + kind.ffn) // tp  # wq, wk, wv, w1 biases
        replicated += 2 * h  # wo and w2 biases
    else:
        split += (q + 2 * kv) // tp if kind.qkv_bias else 0
    return e * (split + replicated + 2 * norm)


# ---- public ---------------------------------------------------------------------------------
def layer_cost(kind: LayerKind, dev: DeviceType, *, tp: int, micro_batch: int, seq_len: int,
               dtype: str, attention: str = "sdpa", kernels: Kernels = Kernels()) -> LayerCost:
    """Time and memory of one layer on one rank of a ``tp``-wide tensor-parallel group, for one
    micro-batch, without tensor-parallel communication. ``activation_bytes`` is the plain
    variant (no sequence parallelism, no recomputation); see ``activation_bytes`` for the others.
    ``attention``: how a block's attention runs (``ATTENTION``; the runtime's is "sdpa");
    ``kernels``: how its memory-bound kernels run (``kernels.Kernels``; the runtime's is the
    default)."""
    sh = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=seq_len, dtype=dtype)
    fwd = forward_time_s(kind, dev, sh, dtype, attention, kernels)
    return LayerCost(kind=kind, tp=tp, micro_batch=micro_batch, seq_len=seq_len, forward_s=fwd,
                     backward_s=backward_time_s(kind, dev, sh, dtype, attention, kernels), recompute_s=fwd,
                     activation_bytes=activation_bytes(kind, tp=tp, micro_batch=micro_batch, seq_len=seq_len,
                                                       dtype=dtype, on_cpu=dev.is_cpu, norm=kernels.norm),
                     param_bytes=param_bytes(kind, tp=tp, dtype=dtype))


def analytic_profile(dev: DeviceType, kinds: Iterable[LayerKind], tps: Iterable[int],
                     micro_batches: Iterable[int], seq_len: int, dtype: str) -> Profile:
    """A profile of ``dev`` derived from its datasheet: every kind at every tp it can be split
    to (a width a kind's heads or vocabulary do not divide is left out: no plan can use it),
    every micro-batch. It has no comm entries."""
    kinds, tps, micro_batches = list(dict.fromkeys(kinds)), sorted(set(tps)), sorted(set(micro_batches))
    layers = tuple(layer_cost(kind, dev, tp=tp, micro_batch=mb, seq_len=seq_len, dtype=dtype)
                   for kind in kinds for tp in tps if parallel.tp_rule(kind, tp) is None for mb in micro_batches)
    provenance = Provenance(source="analytic", device_name=dev.name, dtype=dtype,
                            command="partita.search.analytic.analytic_profile")
    return Profile(device=dev.name, dtype=dtype, provenance=provenance, layers=layers)
