"""The model spec: the layer sequence the planner reasons about.

A model is an embedding, ``n_layers`` identical decoder blocks and a head (final norm + LM
projection). Identical blocks share one *layer kind*, so the solver and the profiler see
three kinds however deep the model is. Layer names are the runtime's module names:
``embed``, ``layers.0`` ... ``layers.{n-1}``, ``head``.

Specs come from built-in names (``partita models``), YAML files, or Hugging Face
``config.json`` files (see ``partita.hf``); all become the same frozen ``ModelSpec``
(``partita.model_io.load_model`` reads any of them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

from partita.errors import PartitaError
from partita import specio

SCHEMA_VERSION = 1
FAMILIES = ("llama", "gpt2")
ROLES = ("embed", "block", "head")
MOE_FIELDS = ("experts", "experts_per_token", "shared_expert_ffn")  # 0: dense (left out of files)
# The weight of a mixture of experts' load-balancing loss (Switch Transformer's, taken per
# sequence; runtime/models.py trains with it, the exports configure it): Switch Transformer's and
# Mixtral's 0.01.
MOE_AUX_LOSS_COEF = 0.01


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    schema_version: int = SCHEMA_VERSION
    name: str
    # "llama": RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, no biases
    # (mistral and qwen2 are this family; qwen2 adds q/k/v biases).
    # "gpt2": LayerNorm, learned positions, GELU MLP, biases everywhere (gpt3, gpt_neox shapes).
    family: str
    hidden: int
    n_layers: int
    heads: int
    kv_heads: int
    ffn: int  # intermediate width of the MLP
    vocab: int
    seq_len: int  # the sequence length trained by default (and the learned-position table size)
    qkv_bias: bool = False
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Sequences per optimizer step when the user gives no --global-batch: the published
    # recipe's batch where there is one.
    default_global_batch: int = 512
    # Mixture of experts (docs/moe.md): every block's MLP is ``experts`` SwiGLU experts of width
    # ``ffn``, of which a router picks ``experts_per_token`` per token (top-k), plus optionally a
    # gated shared expert of width ``shared_expert_ffn`` that every token runs (qwen2_moe).
    # 0 experts: a dense model. Left out of the file (and the fingerprint) when dense.
    experts: int = 0
    experts_per_token: int = 0
    shared_expert_ffn: int = 0

    def __post_init__(self) -> None:
        what = f"model {self.name!r}"
        if self.family not in FAMILIES:
            raise PartitaError(f"{what}: family {self.family!r} is not supported; supported: {', '.join(FAMILIES)}")
        for key in ("hidden", "n_layers", "heads", "kv_heads", "ffn", "vocab", "seq_len", "default_global_batch"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PartitaError(f"{what}: {key} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise PartitaError(f"{what}: hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.kv_heads:
            raise PartitaError(f"{what}: heads {self.heads} is not divisible by kv_heads {self.kv_heads}")
        if self.family == "gpt2" and self.kv_heads != self.heads:
            raise PartitaError(f"{what}: the gpt2 family has no grouped-query attention (kv_heads must equal heads)")
        for key in MOE_FIELDS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PartitaError(f"{what}: {key} must be a non-negative integer, got {value!r}")
        if self.experts:
            if self.family != "llama":
                raise PartitaError(f"{what}: mixture-of-experts blocks are SwiGLU experts of the llama family, "
                                   f"not {self.family}")
            if not 1 <= self.experts_per_token <= self.experts:
                raise PartitaError(f"{what}: experts_per_token must be between 1 and experts ({self.experts}), "
                                   f"got {self.experts_per_token}")
        elif self.experts_per_token or self.shared_expert_ffn:
            raise PartitaError(f"{what}: experts_per_token and shared_expert_ffn need experts > 0 "
                               f"(a mixture-of-experts model)")

    # ---- shapes -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_names(self) -> list[str]:
        return ["embed"] + [f"layers.{i}" for i in range(self.n_layers)] + ["head"]

    def role_of(self, layer_name: str) -> str:
        if layer_name in ("embed", "head"):
            return layer_name
        return "block"

    @cached_property
    def kinds(self) -> dict[str, "LayerKind"]:
        return {role: LayerKind.of(self, role) for role in ROLES}

    def kind_of(self, layer_name: str) -> "LayerKind":
        return self.kinds[self.role_of(layer_name)]

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def n_params(self) -> int:
        total = sum(self.kind_of(n).params for n in self.layer_names())
        if self.tie_embeddings:
            total -= self.vocab * self.hidden
        return total

    @property
    def n_active_params(self) -> int:
        """Parameters one token runs through: a mixture of experts' routed experts count
        ``experts_per_token`` of ``experts`` times; equal to ``n_params`` for a dense model."""
        return self.n_params - self.n_layers * self.kinds["block"].inactive_params

    def train_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of forward + backward per token (3x forward), no recomputation:
        the numerator of MFU. Attention scores count in full (the Megatron convention)."""
        return 3.0 * sum(self.kind_of(n).forward_flops_per_token(seq_len) for n in self.layer_names())

    # ---- files --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        # The mixture-of-experts fields are left out when dense: dense files and fingerprints
        # stay as they were.
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not (f.name in MOE_FIELDS and getattr(self, f.name) == 0)}

    @classmethod
    def from_dict(cls, data: Any, where: str = "model spec") -> "ModelSpec":
        data = specio.require_mapping(data, where)
        specio.check_keys(data, cls, where, required=("name", "family", "hidden", "n_layers", "heads", "ffn", "vocab", "seq_len"))
        specio.check_version(data, SCHEMA_VERSION, where)
        kwargs = dict(data)
        kwargs.setdefault("kv_heads", kwargs.get("heads"))
        for key in ("qkv_bias", "tie_embeddings"):
            if key in kwargs:
                specio.get_bool(kwargs, key, where)
        for key in ("rope_theta", "norm_eps"):
            if key in kwargs:
                kwargs[key] = specio.get_float(kwargs, key, where)
        if not isinstance(kwargs.get("name"), str):
            raise PartitaError(f"{where}: name must be a string")
        return cls(**kwargs)

    @property
    def fingerprint(self) -> str:
        d = self.to_dict()
        d.pop("name")
        d.pop("default_global_batch")
        return specio.fingerprint(d)


@dataclass(frozen=True, kw_only=True)
class LayerKind:
    """One distinct layer shape. Its fields are what sets its cost; ``role`` is embed/block/head."""

    role: str
    family: str
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    qkv_bias: bool
    learned_positions: int  # rows of a learned position table (gpt2 embed), else 0
    # A mixture-of-experts block (``ModelSpec``): 0 for dense blocks, embeddings and heads.
    experts: int = 0
    experts_per_token: int = 0
    shared_expert_ffn: int = 0

    @classmethod
    def of(cls, model: ModelSpec, role: str) -> "LayerKind":
        moe = dict(experts=model.experts, experts_per_token=model.experts_per_token,
                   shared_expert_ffn=model.shared_expert_ffn) if role == "block" else {}
        return cls(role=role, family=model.family, hidden=model.hidden, heads=model.heads,
                   kv_heads=model.kv_heads, ffn=model.ffn, vocab=model.vocab, qkv_bias=model.qkv_bias,
                   learned_positions=model.seq_len if (model.family == "gpt2" and role == "embed") else 0, **moe)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not (f.name in MOE_FIELDS and getattr(self, f.name) == 0)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "layer kind") -> "LayerKind":
        specio.check_keys(data, cls, where,
                          required=[f.name for f in dataclasses.fields(cls) if f.name not in MOE_FIELDS])
        return cls(**data)

    # ---- parameters ---------------------------------------------------------------------
    @property
    def matmul_params(self) -> int:
        """Parameters that take part in matrix products (the 2*N FLOPs per token)."""
        h, hd = self.hidden, self.head_dim
        if self.role == "embed":
            return 0  # a lookup, no FLOPs
        if self.role == "head":
            return self.vocab * h
        qkv = h * hd * (self.heads + 2 * self.kv_heads)
        out = self.heads * hd * h
        if self.is_moe:
            return qkv + out + self.router_params + self.expert_params + self.shared_expert_params
        mlp = (3 if self.family == "llama" else 2) * h * self.ffn
        return qkv + out + mlp

    # ---- a mixture-of-experts block's parts (0 for others) ------------------------------
    @property
    def moe_params(self) -> int:
        """The MoE's weights (router, routed experts, shared expert and gate): what tensor
        parallelism leaves whole, running them on each rank's tokens (``parallel.moe_tp_rule``)."""
        return self.router_params + self.expert_params + self.shared_expert_params

    @property
    def router_params(self) -> int:
        """The router: one hidden -> experts projection, no bias."""
        return self.hidden * self.experts

    @property
    def expert_params(self) -> int:
        """All routed experts: 3 h ffn each (SwiGLU's w1, w3, w2). What expert parallelism shards."""
        return self.experts * 3 * self.hidden * self.ffn

    @property
    def shared_expert_params(self) -> int:
        """The shared expert (SwiGLU of width shared_expert_ffn) and its sigmoid gate (h -> 1)."""
        return 3 * self.hidden * self.shared_expert_ffn + self.hidden if self.shared_expert_ffn else 0

    @property
    def inactive_params(self) -> int:
        """Routed experts' parameters a token does not run through."""
        return (self.experts - self.experts_per_token) * 3 * self.hidden * self.ffn if self.is_moe else 0

    @property
    def params(self) -> int:
        h, hd = self.hidden, self.head_dim
        if self.role == "embed":
            return self.vocab * h + self.learned_positions * h
        norm = h if self.family == "llama" else 2 * h  # LayerNorm has a bias
        if self.role == "head":
            return self.vocab * h + norm
        biases = 0
        if self.family == "gpt2":
            biases = 3 * h + h + self.ffn + h
        elif self.qkv_bias:
            biases = hd * (self.heads + 2 * self.kv_heads)
        return self.matmul_params + 2 * norm + biases

    def forward_flops_per_token(self, seq_len: int) -> float:
        flops = 2.0 * (self.matmul_params - self.inactive_params)  # a token runs its top-k experts only
        if self.role == "block":
            # scores (QK^T) and weighted values (AV), counted over the full seq x seq square
            flops += 2.0 * 2.0 * seq_len * self.heads * self.head_dim
        return flops


def _llama(name: str, hidden: int, n_layers: int, heads: int, kv_heads: int, ffn: int, vocab: int,
           seq_len: int, batch: int, **kw: Any) -> ModelSpec:
    return ModelSpec(name=name, family="llama", hidden=hidden, n_layers=n_layers, heads=heads,
                     kv_heads=kv_heads, ffn=ffn, vocab=vocab, seq_len=seq_len, default_global_batch=batch, **kw)


def _gpt2(name: str, hidden: int, n_layers: int, heads: int, vocab: int, seq_len: int, batch: int,
          ffn: int | None = None) -> ModelSpec:
    return ModelSpec(name=name, family="gpt2", hidden=hidden, n_layers=n_layers, heads=heads, kv_heads=heads,
                     ffn=ffn or 4 * hidden, vocab=vocab, seq_len=seq_len, tie_embeddings=True,
                     default_global_batch=batch)


# Shapes from the models' published configs; batches from their papers where given
# (Llama 2: 4M tokens/step; Llama 3: 8k-token sequences, 16M tokens; GPT-3: 3.2M tokens = 1536 x 2048).
BUILTIN: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        _gpt2("gpt2", 768, 12, 12, 50257, 1024, 512),
        _gpt2("gpt2-medium", 1024, 24, 16, 50257, 1024, 512),
        _gpt2("gpt2-large", 1280, 36, 20, 50257, 1024, 512),
        _gpt2("gpt2-xl", 1600, 48, 25, 50257, 1024, 512),
        _llama("llama-2-7b", 4096, 32, 32, 32, 11008, 32000, 4096, 1024),
        _llama("llama-2-13b", 5120, 40, 40, 40, 13824, 32000, 4096, 1024),
        _llama("llama-2-70b", 8192, 80, 64, 8, 28672, 32000, 4096, 1024),
        _llama("llama-3-8b", 4096, 32, 32, 8, 14336, 128256, 8192, 2048, rope_theta=500000.0),
        _llama("llama-3-70b", 8192, 80, 64, 8, 28672, 128256, 8192, 2048, rope_theta=500000.0),
        _llama("llama-3-405b", 16384, 126, 128, 8, 53248, 128256, 8192, 2048, rope_theta=500000.0),
        _gpt2("gpt3-175b", 12288, 96, 96, 50257, 2048, 1536),
        # Tiny models that train on a CPU in seconds (tests, CI, laptops).
        _llama("tiny-llama", 64, 6, 4, 2, 128, 256, 64, 8),
        _gpt2("tiny-gpt2", 64, 4, 4, 256, 64, 8),
        # Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json; trained at 4096 tokens here).
        _llama("mixtral-8x7b", 4096, 32, 32, 8, 14336, 32000, 4096, 1024, rope_theta=1e6, experts=8,
               experts_per_token=2),
        _llama("tiny-moe", 64, 4, 4, 2, 64, 256, 64, 8, experts=4, experts_per_token=2),
    ]
}
BUILTIN_ALIASES = {"gpt2-small": "gpt2", "gpt-3-175b": "gpt3-175b", "gpt3": "gpt3-175b"}


def model_difference(a: ModelSpec, b: ModelSpec) -> str:
    """How two specs differ, field by field, for messages that name both ('hidden 4096 vs 5120')."""
    da, db = a.to_dict(), b.to_dict()
    keys = [k for k in dict.fromkeys([*da, *db]) if k not in ("name", "default_global_batch")]  # not fingerprinted
    diffs = [f"{k} {da.get(k)} vs {db.get(k)}" for k in keys if da.get(k) != db.get(k)]
    return ", ".join(diffs[:4]) + (f" and {len(diffs) - 4} more" if len(diffs) > 4 else "") if diffs else "no field differs"
