"""Torch models built from a ``ModelSpec``: the llama family and the gpt2 family.

    from partita.model_io import load_model
    from partita.runtime.models import build_model, build_layer, init_layer
    model = build_model(load_model("tiny-llama"), device="cpu")   # meta by default
    logits = model(tokens)                                         # [b, s] -> [b, s, vocab]

The model's children are the plan's module names: ``embed``, ``layers`` (an ``nn.ModuleDict``
with keys "0".."n-1") and ``head`` (final norm + LM projection). A pipeline stage deletes
what it does not own (``del model.embed`` or ``model.embed = None``); ``forward`` runs what
is left, so a stage takes whatever its first owned module takes (tokens or hidden states).

Every projection is its own ``nn.Linear`` (``wq``, ``wk``, ``wv``, ``wo``; ``w1``, ``w3``, ``w2``)
so tensor parallelism is a plain dict from module name to style. Attention reshapes with
``-1`` heads, so the same classes run a tensor-parallel shard: ``build_layer(spec, role, tp=k)``
builds the 1/k shard of one layer (heads, kv heads and ffn, or the vocabulary, divided by k;
head_dim kept), which is what the profiler times.

Initialisation is per layer from a seed and the layer's name (``init_layer``), so a rank that
materialises only its own layers gets the same numbers as a single process holding them all.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from partita import parallel
from partita.errors import PartitaError
from partita.model import MOE_AUX_LOSS_COEF, ModelSpec
from partita.runtime.tp_linear import columns

ROLES = ("embed", "block", "head")
INIT_STD = 0.02


# ---- building blocks ----------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding on [b, s, heads, head_dim], rotating the two halves."""
    seq, head_dim = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)[None, :, None, :].to(x.dtype)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1)[None, :, None, :].to(x.dtype)
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of q [b, H, s, d] over k, v [b, KV, s, d]: each kv head repeated for its
    H / KV query heads (grouped-query attention). SDPA is looked up on ``F`` at call time, which
    torch's ``context_parallel`` patches for the ring (``runtime.context``)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads; rotary positions for llama."""

    def __init__(self, *, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, out_bias: bool,
                 rope_theta: float | None, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.wq = nn.Linear(hidden, heads * head_dim, bias=bias, **kw)
        self.wk = nn.Linear(hidden, kv_heads * head_dim, bias=bias, **kw)
        self.wv = nn.Linear(hidden, kv_heads * head_dim, bias=bias, **kw)
        self.wo = nn.Linear(heads * head_dim, hidden, bias=out_bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # -1 heads: under tensor parallelism each rank holds a slice of the heads; under sequence
        # parallelism x is this rank's sequence shard and q, k, v cover the whole sequence
        # (``tp_linear.columns``).
        q, k, v = columns(self, x, self.wq, self.wk, self.wv)
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))
        if self.rope_theta is not None:
            q, k = _rotary(q, self.rope_theta), _rotary(k, self.rope_theta)
        out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.w1 = nn.Linear(hidden, ffn, bias=False, **kw)  # gate
        self.w3 = nn.Linear(hidden, ffn, bias=False, **kw)  # up
        self.w2 = nn.Linear(ffn, hidden, bias=False, **kw)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = columns(self, x, self.w1, self.w3)
        return self.w2(F.silu(gate) * up)


class GeluMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.w1 = nn.Linear(hidden, ffn, bias=True, **kw)
        self.w2 = nn.Linear(ffn, hidden, bias=True, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (inner,) = columns(self, x, self.w1)
        return self.w2(F.gelu(inner, approximate="tanh"))


# Weight of the load-balancing loss (Switch Transformer's alpha; Fedus et al. 2021, sec. 2.2):
# partita.model's, which the exports configure too.
AUX_LOSS_COEF = MOE_AUX_LOSS_COEF


class _AddAuxLoss(torch.autograd.Function):
    """Returns ``x`` unchanged; its backward also sends ``factor`` into ``aux``, as if
    ``factor * aux`` were added to the loss. So a block's balancing loss trains its router on any
    pipeline stage without travelling to the loss (Megatron-LM's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        ctx.aux_shape = aux.shape
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.factor, dtype=torch.float32, device=grad.device), None


class _SumOverShards(torch.autograd.Function):
    """All-reduce (sum) over the ranks that split each sequence, with the identity as its
    backward: the sum feeds a loss every one of those ranks computes alike, and each rank's part
    of its gradient is the gradient of its own tokens' share (Megatron-LM's
    reduce-from-tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def load_balance_loss(probs: torch.Tensor, chosen: torch.Tensor, *, sequences: int, group=None) -> torch.Tensor:
    """The balancing loss of each sequence: E x sum_e f_e P_e, with f_e the share of the
    sequence's k x s routing slots that went to expert e and P_e the router's mean probability of
    e over its tokens (Switch Transformer's loss, taken per sequence as DeepSeek-V2's
    sequence-wise loss is). Per sequence so that a batch's loss is a mean over its sequences,
    whichever ranks and micro-batches they are split over. ``probs`` [b*s, E] fp32, ``chosen``
    [b*s, k] of this rank's tokens; returns [b]. When ranks hold parts of each sequence (tensor
    or context parallelism, ``group`` their process group), f_e's counts and P_e's sums are
    summed over them first (one all-reduce of 2 b E fp32 values; Megatron-LM sums them over its
    tp x cp group likewise), so every rank has the whole sequence's loss."""
    experts = probs.shape[-1]
    slots = chosen.view(sequences, -1)
    counts = torch.zeros(sequences, experts, device=probs.device).scatter_add_(
        1, slots, torch.ones(slots.shape, device=probs.device))
    sums = probs.view(sequences, -1, experts).sum(1)
    tokens = torch.tensor(float(slots.shape[1] // chosen.shape[-1]), device=probs.device)
    if group is not None:
        stats = _SumOverShards.apply(torch.cat([counts, sums, tokens.expand(sequences, 1)], dim=1), group)
        counts, sums, tokens = stats[:, :experts], stats[:, experts:2 * experts], stats[:, -1:]
    k = chosen.shape[-1]
    return experts * ((counts / (tokens * k)) * (sums / tokens)).sum(-1)


class Experts(nn.ModuleDict):
    """The routed experts, keyed by their global index (a rank under expert parallelism holds
    some). Called on tokens grouped by expert (``counts[i]`` rows for expert ``ids[i]``); every
    expert runs, on no rows if none came, so each has a gradient on every rank. A module with a
    forward, so FSDP2 can gather it as a unit of its own."""

    def forward(self, grouped: torch.Tensor, counts: list[int], ids: list[int]) -> torch.Tensor:
        parts = grouped.split(counts)
        return torch.cat([self[str(e)](part) for e, part in zip(ids, parts)])


class MoE(nn.Module):
    """A mixture-of-experts MLP: a router picks each token's top ``k`` of ``experts`` SwiGLU
    experts (softmax over all logits, the chosen weights renormalised: Mixtral's routing), and
    the token's output is their weighted sum, plus a gated shared expert if there is one
    (qwen2_moe). Experts live in a ``ModuleDict`` keyed by their global index, so a rank under
    expert parallelism deletes those it does not hold and the names stay the plan's
    (``partita.runtime.experts``). Tokens go to their experts grouped by expert; ``dispatch``
    runs the grouped tokens through the experts, locally or across the ep group.

    Training adds the load-balancing loss (``load_balance_loss``) through the backward:
    ``AUX_LOSS_COEF`` x the mean over the batch's sequences, each micro-batch's part scaled by
    ``aux_loss_factor`` (what the runtime multiplies that micro-batch's loss by; 1 for one
    forward of the whole batch)."""

    def __init__(self, hidden: int, ffn: int, *, experts: int, top_k: int, shared_ffn: int = 0, device=None,
                 dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.num_experts, self.top_k = experts, top_k
        self.router = nn.Linear(hidden, experts, bias=False, **kw)
        self.experts = Experts({str(e): SwiGLU(hidden, ffn, **kw) for e in range(experts)})
        self.shared_expert = SwiGLU(hidden, shared_ffn, **kw) if shared_ffn else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, **kw) if shared_ffn else None
        self.aux_loss_factor = 1.0
        self.dispatch = self.run_local  # replaced under expert parallelism (runtime/experts.py)
        self.sequence_group = None  # the ranks that split each sequence, if any (runtime/experts.py)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(fp32 router probabilities [t, E], chosen experts [t, k], their weights [t, k])."""
        probs = self.router(flat).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # ties go to the lower index: deterministic
        return probs, chosen, (weights / weights.sum(-1, keepdim=True)).to(flat.dtype)

    def run_local(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.experts(grouped, counts.tolist(), list(range(self.num_experts)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        probs, chosen, weights = self.route(flat)
        slots = chosen.reshape(-1)  # token i's k choices are slots i*k .. i*k+k-1
        order = torch.argsort(slots, stable=True)  # the slots grouped by expert
        counts = torch.bincount(slots, minlength=self.num_experts)
        out = self.dispatch(flat.index_select(0, order // self.top_k), counts)
        out = out.new_zeros(out.shape).index_copy(0, order, out)  # back in slot order
        y = (out.view(-1, self.top_k, h) * weights.unsqueeze(-1)).sum(1)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        if self.training and torch.is_grad_enabled():
            aux = load_balance_loss(probs, chosen, sequences=b, group=self.sequence_group).sum()
            y = _AddAuxLoss.apply(y, aux, AUX_LOSS_COEF * self.aux_loss_factor / b)
        return y.view(b, s, h)


def set_aux_loss_factor(model: nn.Module, factor: float) -> None:
    """What every MoE block scales its load-balancing loss's gradient by: the factor the runtime
    puts on each micro-batch's loss times the micro-batch's rows (``MoE``)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.aux_loss_factor = factor


def _norm(spec: ModelSpec, device, dtype) -> nn.Module:
    if spec.family == "llama":
        return RMSNorm(spec.hidden, spec.norm_eps, device=device, dtype=dtype)
    return nn.LayerNorm(spec.hidden, eps=spec.norm_eps, device=device, dtype=dtype)


# ---- the three layer roles -----------------------------------------------------------------


class Embed(nn.Module):
    """Tokens [b, s] -> hidden [b, s, h]; gpt2 adds learned positions."""

    def __init__(self, spec: ModelSpec, *, vocab: int, device=None, dtype=None) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, spec.hidden, device=device, dtype=dtype)
        self.pos = nn.Embedding(spec.seq_len, spec.hidden, device=device, dtype=dtype) if spec.family == "gpt2" else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        if self.pos is not None:
            h = h + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return h


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, spec: ModelSpec, *, heads: int, kv_heads: int, ffn: int, device=None, dtype=None) -> None:
        super().__init__()
        llama = spec.family == "llama"
        self.attention_norm = _norm(spec, device, dtype)
        self.attention = Attention(hidden=spec.hidden, heads=heads, kv_heads=kv_heads, head_dim=spec.head_dim,
                                   bias=spec.qkv_bias or not llama, out_bias=not llama,
                                   rope_theta=spec.rope_theta if llama else None, device=device, dtype=dtype)
        self.ffn_norm = _norm(spec, device, dtype)
        if spec.is_moe:
            self.feed_forward = MoE(spec.hidden, ffn, experts=spec.experts, top_k=spec.experts_per_token,
                                    shared_ffn=spec.shared_expert_ffn, device=device, dtype=dtype)
        else:
            mlp = SwiGLU if llama else GeluMLP
            self.feed_forward = mlp(spec.hidden, ffn, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Head(nn.Module):
    """Final norm + LM projection: hidden [b, s, h] -> logits [b, s, vocab]."""

    def __init__(self, spec: ModelSpec, *, vocab: int, device=None, dtype=None) -> None:
        super().__init__()
        self.norm = _norm(spec, device, dtype)
        self.output = nn.Linear(spec.hidden, vocab, bias=False, device=device, dtype=dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        (logits,) = columns(self, self.norm(h), self.output)
        return logits


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec, *, device=None, dtype=None) -> None:
        super().__init__()
        self.spec = spec
        self.embed = Embed(spec, vocab=spec.vocab, device=device, dtype=dtype)
        self.layers = nn.ModuleDict({str(i): Block(spec, heads=spec.heads, kv_heads=spec.kv_heads, ffn=spec.ffn,
                                                   device=device, dtype=dtype) for i in range(spec.n_layers)})
        self.head = Head(spec, vocab=spec.vocab, device=device, dtype=dtype)
        if spec.tie_embeddings:
            self.head.output.weight = self.embed.tok.weight

    def forward(self, x: torch.Tensor, only: tuple[str, ...] | None = None) -> torch.Tensor:
        """Through every layer this module holds, or only those named (a virtual stage of an
        interleaved pipeline). Any part may be missing on a pipeline stage (deleted or None)."""
        embed = getattr(self, "embed", None)
        if embed is not None and (only is None or "embed" in only):
            x = embed(x)
        layers = getattr(self, "layers", None)
        if layers is not None:
            for key, block in layers.items():
                if only is None or f"layers.{key}" in only:
                    x = block(x)
        head = getattr(self, "head", None)
        if head is not None and (only is None or "head" in only):
            x = head(x)
        return x

    def owned_layer_names(self) -> list[str]:
        """The plan's names of the layers this module still holds, in order."""
        names = []
        if getattr(self, "embed", None) is not None:
            names.append("embed")
        if getattr(self, "layers", None) is not None:
            names += [f"layers.{k}" for k in self.layers]
        if getattr(self, "head", None) is not None:
            names.append("head")
        return names

    def layer(self, name: str) -> nn.Module:
        return self.get_submodule(name)


# ---- public constructors --------------------------------------------------------------------


def build_model(spec: ModelSpec, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32) -> Transformer:
    """The whole model, on ``device`` (meta by default: no memory until ``materialize``)."""
    return Transformer(spec, device=device, dtype=dtype)


def build_layer(spec: ModelSpec, role: str, *, tp: int = 1, device: str | torch.device = "meta",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """One layer of ``role`` ("embed", "block", "head"), or its 1/``tp`` tensor-parallel shard."""
    if role not in ROLES:
        raise PartitaError(f"unknown layer role {role!r}; valid: {', '.join(ROLES)}")
    why = parallel.tp_rule(spec.kinds[role], tp)
    if why:
        raise PartitaError(f"model {spec.name!r}: cannot build a 1/{tp} shard of the {role} layer: {why}")
    if role == "embed":
        return Embed(spec, vocab=spec.vocab // tp, device=device, dtype=dtype)
    if role == "head":
        return Head(spec, vocab=spec.vocab // tp, device=device, dtype=dtype)
    # A MoE block's experts stay whole under tp (on the rank's sequence shard: parallel.moe_tp_rule).
    return Block(spec, heads=spec.heads // tp, kv_heads=spec.kv_heads // tp, ffn=spec.ffn if spec.is_moe else spec.ffn // tp,
                 device=device, dtype=dtype)


def layer_seed(seed: int, layer_name: str) -> int:
    """A layer's own seed: the same on every rank and in a single-process reference."""
    return (seed * 1_000_003 + zlib.crc32(layer_name.encode())) % (2**63)


@torch.no_grad()
def init_layer(layer: nn.Module, layer_name: str, seed: int, *, n_layers: int) -> None:
    """Deterministic init of a materialised (non-meta) layer: normal(0, 0.02) weights with the
    output projections scaled by depth (GPT-2), zero biases, unit norms. Values are drawn on the
    CPU so every device type gets the same numbers."""
    gen = torch.Generator().manual_seed(layer_seed(seed, layer_name))
    expert_gens: dict[str, torch.Generator] = {}
    for name, p in layer.named_parameters(remove_duplicate=True):
        leaf = name.rsplit(".", 1)[-1]
        owner = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
        if isinstance(owner, (RMSNorm, nn.LayerNorm)):
            value = torch.ones(p.shape) if leaf == "weight" else torch.zeros(p.shape)
        elif leaf == "bias":
            value = torch.zeros(p.shape)
        else:
            std = INIT_STD
            if name.endswith(("wo.weight", "w2.weight")):
                std = INIT_STD / math.sqrt(2 * n_layers)
            draw = gen
            if ".experts." in name:  # each expert from its own seed: a rank holding some experts gets the same
                expert = name.split(".experts.", 1)[0] + ".experts." + name.split(".experts.", 1)[1].split(".")[0]
                if expert not in expert_gens:
                    expert_gens[expert] = torch.Generator().manual_seed(layer_seed(seed, f"{layer_name}.{expert}"))
                draw = expert_gens[expert]
            value = torch.empty(p.shape).normal_(0.0, std, generator=draw)
        p.copy_(value.to(dtype=p.dtype, device=p.device))


def materialize(model: Transformer, *, device: str | torch.device, seed: int) -> Transformer:
    """Allocate the layers ``model`` still holds on ``device`` and initialise each from ``seed``."""
    model.to_empty(device=device)
    for name in model.owned_layer_names():
        init_layer(model.layer(name), name, seed, n_layers=model.spec.n_layers)
    embed, head = getattr(model, "embed", None), getattr(model, "head", None)
    if model.spec.tie_embeddings and embed is not None and head is not None:
        model.head.output.weight = model.embed.tok.weight  # to_empty keeps the tie; say so anyway
    elif model.spec.tie_embeddings and head is not None:
        # The head on another pipeline stage than the embedding keeps its own copy of the tied
        # weight; it starts from the value a whole model gets, the embedding's.
        whole = build_layer(model.spec, "embed", device="cpu")
        init_layer(whole, "embed", seed, n_layers=model.spec.n_layers)
        with torch.no_grad():
            head.output.weight.copy_(whole.tok.weight.to(dtype=head.output.weight.dtype))
    return model
