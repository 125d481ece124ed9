"""A layer's memory-bound kernels: what each reads and writes, as the engine that runs it runs them.

    from partita.search.kernels import Kernels, forward_elementwise
    forward_elementwise(kind, shard, Kernels(rope="fused", glu="fused", kv="native"))

Each kernel is priced by its bytes (``roofline.memory_time_s``, in ``search/analytic.py``). What
a layer's elementwise work is depends on the software that runs it (``Kernels``, which an
engine's fields select: ``Engine.kernels``, search/engines.py):

* ``norm``: a llama RMSNorm as one fused kernel or as eager torch ops (``norm_bytes_per_element``).
* ``rope``: rotary positions as torch's rotate-half ops, five kernels a tensor (neg, cat, the two
  products and the add: Partita's runtime, torchtitan and Hugging Face models in eager mode), or
  one fused kernel that reads q (or k) and writes it (Transformer Engine's
  ``fused_apply_rotary_pos_emb``, which Megatron-LM runs by default: ``--no-rope-fusion`` turns it
  off; NeMo's ``apply_rope_fusion: true``). Its backward reads the gradient and writes it.
* ``glu``: SwiGLU as torch's silu and product (two kernels, five ffn-wide passes forward), or one
  fused kernel (Megatron-LM's ``SwiGLUFunction``, megatron/core/fusions/fused_bias_swiglu.py, on
  by default: ``--no-bias-swiglu-fusion`` turns it off) that reads both inputs and writes the
  product (3 passes); its backward reads both inputs and the gradient and writes the two input
  gradients (5 passes), recomputing silu inside.
* ``kv``: grouped-query attention's k and v repeated to the query heads before the kernel (torch
  SDPA under the runtime's and torchtitan's models, two copies a layer), or taken at their kv
  heads ("native": Transformer Engine's ``DotProductAttention`` with ``num_gqa_groups``).
* ``matmul``: a block's linear layers' products in the compute dtype, or in FP8 ("fp8":
  Transformer Engine's layers under ``fp8_autocast``, Megatron-LM's ``--fp8-format hybrid``;
  ``analytic.product_dtype`` says which products). FP8 adds casts (``fp8_casts``): Hopper's FP8
  products take both operands K-major, so each FP8 operand is written twice, as it is and
  transposed (Transformer Engine's ``cast_transpose``). Forward, the inputs of the attention's
  output projection and of the MLP's last product are cast from the compute dtype (read e, write
  1 + 1 bytes an element); the norms' outputs that feed q, k, v and the MLP's first products come
  out of Transformer Engine's fused norm in FP8 already (``LayerNormLinear``: no more bytes than
  the compute dtype's output), and are transposed (read 1, write 1). Backward, every linear's
  output gradient is cast and transposed (read e, write 1 + 1). The weights' casts run once a
  step (cached across micro-batches, ``is_first_microbatch``) and are not counted.
* ``fp8``: whose FP8 layers those are: Transformer Engine's ("transformer_engine", above) or
  torchao's ``Float8Linear`` with dynamic tensorwise scaling ("torchao": torchtitan's float8
  converter; torchao/float8/float8_linear.py at eab345c, the torchao of torchtitan's Dec 2024
  benchmarks). Each distinct linear input is scaled from its own amax and cast every forward
  (an abs-max pass reading e bytes an element, then a cast reading e and writing 1; the
  compiler's common-subexpression pass merges the casts of q, k and v's shared input, and of
  w1 and w3's); backward, each output gradient is scaled and cast the same way
  (``NoopFwToFloat8BwDynamic``), and the FP8 products' operand layouts (``_scaled_mm`` takes A
  row-major and B column-major) make three transposed copies a linear (read 1, write 1): the
  output gradient's and the saved FP8 input's for the weight gradient, and the FP8 weight's for
  the input gradient. Weights gathered in FP8 by FSDP (``Engine.fp8_gather``) arrive cast, their
  scales precomputed once a step over the shards. Counted kernel by kernel: what inductor fuses
  into the kernels around them is not subtracted. "torchao_hp": torchao from 2025
  (``matmul_with_hp_or_float8_args`` at 0afa4c1, June 2025), which saves the input in the
  compute dtype and abs-maxes and casts it again in the backward for the weight gradient.
* ``attention_padding``: the attention kernel called on the batch as it is ("none"), or through
  flash-attn's variable-length interface behind its ``bert_padding`` helpers ("unpad":
  llm-foundry's ``flash_attn_fn``, llmfoundry/models/layers/attention.py at 5e85bd62d, the path of
  ``attn_impl: flash``). Forward, ``unpad_input`` copies q, k and v into packed rows
  (``IndexFirstAxis``: a gather, each tensor read and written) and ``pad_input`` scatters the
  output back into a zero-filled [tokens, heads x head_dim] tensor (the zeros written, the rows
  read and written); backward, each gather's gradient is a zero-filled tensor the gradient is
  scattered into (three passes) and the output's is a gather (two): flash_attn/bert_padding.py at
  v2.4.2. Each ``unpad_input`` also waits for the device twice (``nonzero`` and ``.item()``),
  which is not priced.
"""

from __future__ import annotations

from dataclasses import dataclass

from partita import specio
from partita.errors import PartitaError

INDEX_BYTES = 8  # token ids, targets and position ids are int64
# How a llama layer's RMSNorm runs (``Engine.norm``): "fused", one kernel a pass (torch's fused
# CUDA ``rms_norm``, pytorch#153666, 2025; Transformer Engine's, apex's, or torch.compile's
# fusion), or "eager": the norm written as torch ops, an fp32 upcast, pow, mean, rsqrt, a
# product, a downcast and the weight's product, each its own kernel (torchtitan's ``RMSNorm``
# module, torchtitan/models/norms.py, run without torch.compile: its benchmarks up to Dec 2024;
# pytorch#153666 measured the fused kernel ~9x faster than such a module). GPT-2's LayerNorm is
# one native kernel either way.
NORMS = ("fused", "eager")
NORM_PARTS = ("attention norm", "ffn norm", "norm")  # forward_elementwise's names of a layer's norms
ROPES = ("unfused", "fused")
GLUS = ("separate", "fused")
KVS = ("repeated", "native")
ATTENTION_PADDINGS = ("none", "unpad")
MATMULS = ("compute", "fp8")
FP8_IMPLS = ("transformer_engine", "torchao", "torchao_hp")
FP8_CASTS = ("fp8 casts attention", "fp8 casts mlp")  # forward_elementwise's names of the FP8 casts
# ... and of the parts of torchao's that run on the residual stream: the norm output's cast, and
# backward the cast of the output gradient of the product that writes the residual stream (wo,
# w2). Under sequence parallelism torchao's float8 styles cast them on the rank's sequence shard,
# before the all-gather (``analytic.SEQUENCE_SHARDED``).
FP8_INPUT_CASTS = ("fp8 casts attention input", "fp8 casts mlp input")


def norm_bytes_per_element(norm: str, elem: int) -> tuple[int, int]:
    """(forward, backward) bytes one RMSNorm reads and writes per element of its [tokens, hidden]
    input (statistics aside). Fused: the input in and the output out; the backward twice that.
    Eager, from the aten ops autograd runs (``tests/test_eager_norm.py`` traces them): forward
    pow (8), mean (4), the product by rsqrt (8) and the weight's product (2e); backward the
    weight's two products and sum (6e), the rsqrt branch's product and sum (12 + 4), the product
    by rsqrt (8), the mean's expand divided (4), pow's backward (8 + 8 + 12) and the two branches'
    sum (12); below fp32 each pass also casts up (e + 4) and down (4 + e)."""
    if norm not in NORMS:
        raise PartitaError(f"unknown norm {norm!r}; valid: {', '.join(NORMS)}")
    if norm == "eager":
        casts = 0 if elem == 4 else 8 + 2 * elem
        return 20 + 2 * elem + casts, 68 + 6 * elem + casts
    return 2 * elem, 4 * elem


@dataclass(frozen=True)
class Kernels:
    """How a layer's memory-bound work runs (the module docstring has each choice and its source).
    The default is Partita's runtime: torch's fused RMSNorm, everything else as eager torch ops."""

    norm: str = "fused"
    rope: str = "unfused"
    glu: str = "separate"
    kv: str = "repeated"
    matmul: str = "compute"
    attention_padding: str = "none"
    fp8: str = "transformer_engine"

    def __post_init__(self) -> None:
        specio.check_choices(self, (("norm", NORMS), ("rope", ROPES), ("glu", GLUS), ("kv", KVS), ("matmul", MATMULS),
                                    ("attention_padding", ATTENTION_PADDINGS), ("fp8", FP8_IMPLS)))


def _rope_kernels(name: str, nbytes: float, rope: str) -> list[tuple[str, float]]:
    if rope == "fused":  # one kernel: the tensor in, the rotated tensor out
        return [(f"{name} fused", 2 * nbytes)]
    # The runtime's rotate-half form: neg of one half, cat, x*cos, rotated*sin, add.
    return [(f"{name} neg", nbytes), (f"{name} cat", 2 * nbytes), (f"{name} *cos", 2 * nbytes),
            (f"{name} *sin", 2 * nbytes), (f"{name} add", 3 * nbytes)]


def forward_elementwise(kind, sh, k: Kernels = Kernels()) -> list[tuple[str, float]]:
    """(name, bytes read + written) of each memory-bound forward kernel of ``kind`` on the shard
    ``sh`` (``analytic.Shard``) run as ``k`` says: a layer's RMSNorm as one entry for all its
    kernels under ``norm`` "eager"."""
    e, t, h = sh.elem, sh.tokens, sh.hidden
    act = t * h * e  # one [tokens, hidden] activation
    normed = t * h * norm_bytes_per_element(k.norm if kind.family == "llama" else "fused", e)[0]
    if kind.role == "embed":
        ops = [("token gather", 2 * act)]
        if kind.learned_positions:
            ops += [("position gather", 2 * sh.seq * h * e), ("add positions", 3 * act)]
        return ops
    if kind.role == "head":
        logits = t * sh.vocab
        ops = [("norm", normed)]
        if e != 4:
            ops.append(("logits to fp32", logits * (e + 4)))
        return ops + [("log_softmax", 2 * logits * 4), ("nll_loss", t * (INDEX_BYTES + 4))]
    q_bytes = t * sh.heads * sh.head_dim * e
    kv_bytes = t * sh.kv_heads * sh.head_dim * e
    ops = [("attention norm", normed)]
    if kind.family == "llama":
        ops += _rope_kernels("rope q", q_bytes, k.rope) + _rope_kernels("rope k", kv_bytes, k.rope)
    if sh.heads != sh.kv_heads and k.kv == "repeated":
        ops += [("repeat k", kv_bytes + q_bytes), ("repeat v", kv_bytes + q_bytes)]
    if k.attention_padding == "unpad":  # k and v as the kernel takes them (repeated or not)
        taken = q_bytes if sh.heads != sh.kv_heads and k.kv == "repeated" else kv_bytes
        ops += [("unpad q k v", 2 * (q_bytes + 2 * taken)), ("pad output", 3 * q_bytes)]
    fp8 = fp8_casts(kind, sh, k.fp8) if k.matmul == "fp8" else {}
    ops += [(name, forward) for name, (forward, _) in fp8.items() if name.startswith(FP8_CASTS[0])]
    ops += [("residual add", 3 * act), ("ffn norm", normed)]
    if kind.is_moe:
        return ops + moe_elementwise(kind, sh) + [("residual add", 3 * act)]
    mlp = t * sh.ffn * e
    if kind.family == "llama" and k.glu == "fused":
        ops += [("swiglu", 3 * mlp)]
    elif kind.family == "llama":
        ops += [("silu", 2 * mlp), ("gate mul", 3 * mlp)]
    else:
        ops += [("gelu", 2 * mlp)]
    ops += [(name, forward) for name, (forward, _) in fp8.items() if name.startswith(FP8_CASTS[1])]
    return ops + [("residual add", 3 * act)]


def fp8_casts(kind, sh, impl: str = "transformer_engine") -> dict[str, tuple[float, float]]:
    """{name: (forward, backward) bytes} of a block's FP8 casts (``Kernels.matmul`` "fp8"; the
    module docstring), its attention's and its MLP's (a mixture of experts' MLP runs its
    products in the compute dtype: none), as ``impl`` (``Kernels.fp8``) runs them.
    Transformer Engine: forward, the norm output that feeds the first products transposed (2
    bytes an element), the last product's input cast and transposed (e + 2); backward, each
    product's output gradient cast and transposed (e + 2). torchao: forward, each distinct input
    abs-maxed and cast (2e + 1); backward, each output gradient abs-maxed, cast and transposed
    (2e + 3), each saved FP8 input transposed (2) and each FP8 weight transposed (2 a parameter);
    "torchao_hp" casts each saved compute-dtype input again instead (2e + 3). torchao's casts of
    the residual stream (the norm outputs; backward, wo's and w2's output gradients) are their own
    entries (``FP8_INPUT_CASTS``), which sequence parallelism shards."""
    e, t, h = sh.elem, sh.tokens, sh.hidden
    q, kv = sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim
    first = 2 * sh.ffn if kind.family == "llama" else sh.ffn  # w1 and w3, or gpt2's w1
    if impl in ("torchao", "torchao_hp"):
        weights = {"attention": h * (q + 2 * kv) + q * h, "mlp": first * h + sh.ffn * h}
        saved = 2 if impl == "torchao" else 2 * e + 3  # the saved input transposed, or cast again
        # the residual stream's casts (FP8_INPUT_CASTS): the norm output's, and backward the
        # abs-max and cast of wo's (w2's) output gradient, whose transpose stays with the rest
        stream = t * (2 * e + 1) * h
        casts = {FP8_CASTS[0]: (t * (2 * e + 1) * q, t * (2 * e + 3) * (q + 2 * kv) + 2 * t * h
                                + saved * t * (h + q) + 2 * weights["attention"]),
                 FP8_INPUT_CASTS[0]: (stream, stream)}
        if not kind.is_moe:
            casts[FP8_CASTS[1]] = (t * (2 * e + 1) * sh.ffn, t * (2 * e + 3) * first + 2 * t * h
                                   + saved * t * (h + sh.ffn) + 2 * weights["mlp"])
            casts[FP8_INPUT_CASTS[1]] = (stream, stream)
        return casts
    casts = {FP8_CASTS[0]: (t * (2 * h + (e + 2) * q), t * (e + 2) * (q + 2 * kv + h))}
    if not kind.is_moe:
        casts[FP8_CASTS[1]] = (t * (2 * h + (e + 2) * sh.ffn), t * (e + 2) * (first + h))
    return casts


# A kernel whose backward moves other bytes than twice its forward's: the rotary kernel (the
# gradient in, the gradient out: its forward's bytes), the fused SwiGLU (both inputs and the
# gradient in, both input gradients out: 5/3 of its forward's), flash-attn's unpadding (zeros
# written, then the gradient read and scattered: 3/2 of the forward's copy) and padding (a
# gather of the output's gradient: 2/3 of the forward's zeros and scatter).
_BACKWARD_OVER_FORWARD = {"rope q fused": 1.0, "rope k fused": 1.0, "swiglu": 5 / 3, "unpad q k v": 1.5,
                          "pad output": 2 / 3}


def backward_elementwise(kind, sh, k: Kernels = Kernels()) -> list[tuple[str, float]]:
    """(name, bytes read + written) of the backward of each forward memory-bound kernel, in
    ``forward_elementwise``'s order: twice the forward's bytes (the gradient in and out beside
    what the forward read), a norm's its own (``norm_bytes_per_element``), a fused rotary or
    SwiGLU kernel's its own (``_BACKWARD_OVER_FORWARD``)."""
    backward = norm_bytes_per_element(k.norm if kind.family == "llama" else "fused", sh.elem)[1]
    fp8 = fp8_casts(kind, sh, k.fp8) if k.matmul == "fp8" else {}
    return [(name, sh.tokens * sh.hidden * backward if name in NORM_PARTS
             else fp8[name][1] if name in fp8 else _BACKWARD_OVER_FORWARD.get(name, 2.0) * nbytes)
            for name, nbytes in forward_elementwise(kind, sh, k)]


def moe_elementwise(kind, sh) -> list[tuple[str, float]]:
    """A mixture-of-experts MLP's memory-bound kernels (``runtime.models.MoE``): the router's
    fp32 softmax and top-k, the gather of each token's k rows grouped by expert and their
    scatter back, SwiGLU's activation on the expert rows, the weighted sum of a token's k
    outputs, and the shared expert's activation and gate (on the rank's MoE tokens)."""
    e, t, h, k = sh.elem, sh.moe_tokens, sh.hidden, kind.experts_per_token
    rows = t * k * h * e  # the k expert rows of every token
    mlp = t * k * sh.ffn * e
    ops = [("router softmax", t * kind.experts * (e + 8)), ("top-k", t * kind.experts * 4),
           ("gather rows", 2 * rows), ("silu", 2 * mlp), ("gate mul", 3 * mlp), ("scatter rows", 2 * rows),
           ("weighted sum", 2 * rows + t * h * e)]
    if kind.shared_expert_ffn:
        shared = t * kind.shared_expert_ffn * e
        ops += [("shared silu", 2 * shared), ("shared gate mul", 3 * shared), ("shared sigmoid", 3 * t * h * e)]
    return ops
