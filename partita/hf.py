"""Hugging Face ``config.json`` files as Partita model specs.

    partita plan --model path/to/config.json --cluster 8xH100

``load_hf_config`` reads the file, ``spec_from_hf`` maps the parsed dict to a ``ModelSpec``.
Supported ``model_type`` values and the family each becomes:

    llama, mistral, qwen2 (q/k/v biases)   -> "llama"  (RMSNorm, rotary, GQA, SwiGLU)
    mixtral, qwen2_moe (mixtures of experts) -> "llama" with ``experts`` (docs/moe.md)
    gpt2, gpt_neox                         -> "gpt2"   (LayerNorm, GELU, biases)

Anything else is refused with one line that names what is unsupported: other
mixture-of-experts families, unknown model types, missing or malformed size keys, a ``head_dim`` that is not
hidden/heads, and biases or cross-attention the families do not price. Keys that do not
change the shapes Partita prices (token ids, dtype, dropout, rope scaling...) are ignored.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Mapping

from partita import fileio, specio
from partita.errors import PartitaError
from partita.model import ModelSpec

# The longest default training length we take from a config. Long-context models publish a
# context window (mistral-7b 32768, qwen2 32768-131072), not the length they were pre-trained
# at; 8192 is Llama 3's pre-training length, the longest common one. For another length,
# write a model YAML (``partita models --yaml``) and edit ``seq_len``.
MAX_DEFAULT_SEQ_LEN = 8192

# model_types that are mixtures of experts. mixtral and qwen2_moe are mapped (``MOE_MAPPERS``);
# the others' routers and expert layouts (fine-grained and grouped routing, dense layers between
# MoE ones, latent attention) are not priced, so they are refused, not approximated.
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "dbrx", "jamba", "olmoe",
                   "granitemoe", "phimoe", "jetmoe", "arctic", "grok-1", "switch_transformers", "nllb_moe")
# Keys whose value > 1 marks a mixture-of-experts config, whatever its model_type says.
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "n_shared_experts")


def load_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face ``config.json``. The spec is named after the file, or after its
    folder when the file is called ``config.json`` (``models/llama-3-8b/config.json``)."""
    p = Path(path)
    config = fileio.load_json(p)
    name = p.parent.name if p.stem == "config" and p.parent.name else p.stem
    return spec_from_hf(config, name, where=str(p))


def spec_from_hf(config: Any, name: str, where: str = "Hugging Face config") -> ModelSpec:
    """Map a parsed ``config.json`` to a ``ModelSpec``; refuse what the families cannot price."""
    config = specio.require_mapping(config, where)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        problem = "missing key 'model_type'" if model_type is None else f"model_type must be a string, got {model_type!r}"
        raise PartitaError(f"{where}: {problem}; supported: {', '.join(MAPPERS)}")
    if model_type not in MOE_MAPPERS:
        _refuse_moe(config, model_type, where)
    if model_type not in MAPPERS:
        raise PartitaError(f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(MAPPERS)}")
    if not isinstance(name, str) or not name:
        raise PartitaError(f"{where}: the model needs a non-empty name, got {name!r}")
    where = f"{where} ({model_type})"
    try:
        return MAPPERS[model_type](config, name, where)
    except PartitaError as e:
        if str(e).startswith(where):
            raise
        # ModelSpec's own checks (divisibility) speak its field names; say which file.
        raise PartitaError(f"{where}: {e}") from None


def _refuse_moe(config: Mapping[str, Any], model_type: str, where: str) -> None:
    if model_type in MOE_MODEL_TYPES:
        raise PartitaError(f"{where}: model_type {model_type!r} is a mixture-of-experts model Partita does not "
                           f"price; supported mixtures of experts: {', '.join(MOE_MAPPERS)}")
    for key, value in config.items():
        if not (key in MOE_KEYS or (isinstance(key, str) and key.startswith("moe_"))):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1:
            raise PartitaError(f"{where}: {key} = {value} makes this a mixture-of-experts model; "
                               "Partita plans dense transformers only")


# ---- one mapper per model_type family ---------------------------------------------------

def _llama_like(config: Mapping[str, Any], name: str, where: str, *, qkv_bias: bool) -> ModelSpec:
    hidden = _size(config, "hidden_size", where)
    heads = _size(config, "num_attention_heads", where)
    _check_head_dim(config, hidden, heads, where)
    for key in ("attention_bias", "mlp_bias"):
        # Llama's attention_bias also puts a bias on o_proj; the family prices q/k/v biases only.
        if _flag(config, key, where, default=False):
            raise PartitaError(f"{where}: {key} = true is not supported; the llama family has no "
                               "biases besides qwen2's q/k/v biases")
    return ModelSpec(
        name=name, family="llama", hidden=hidden, n_layers=_size(config, "num_hidden_layers", where),
        heads=heads, kv_heads=_size(config, "num_key_value_heads", where, default=heads),
        ffn=_size(config, "intermediate_size", where), vocab=_size(config, "vocab_size", where),
        # The context window, capped: see MAX_DEFAULT_SEQ_LEN.
        seq_len=min(_size(config, "max_position_embeddings", where), MAX_DEFAULT_SEQ_LEN),
        qkv_bias=qkv_bias, tie_embeddings=_flag(config, "tie_word_embeddings", where, default=False),
        rope_theta=_number(config, "rope_theta", where, default=10000.0),
        norm_eps=_number(config, "rms_norm_eps", where, default=1e-6),
    )


def _gpt2(config: Mapping[str, Any], name: str, where: str) -> ModelSpec:
    hidden = _size(config, "n_embd", where)
    heads = _size(config, "n_head", where)
    _check_head_dim(config, hidden, heads, where)
    if _flag(config, "add_cross_attention", where, default=False):
        raise PartitaError(f"{where}: add_cross_attention = true (an encoder-decoder) is not supported; "
                           "Partita plans decoder-only models")
    return ModelSpec(
        name=name, family="gpt2", hidden=hidden, n_layers=_size(config, "n_layer", where), heads=heads,
        kv_heads=heads, ffn=_size(config, "n_inner", where, default=4 * hidden),
        vocab=_size(config, "vocab_size", where),
        # Not capped: in this family seq_len is also the learned position table's row count,
        # and n_positions is that table's size in the checkpoint.
        seq_len=_size(config, "n_positions", where),
        tie_embeddings=_flag(config, "tie_word_embeddings", where, default=True),
        norm_eps=_number(config, "layer_norm_epsilon", where, default=1e-5),
    )


def _gpt_neox(config: Mapping[str, Any], name: str, where: str) -> ModelSpec:
    # Priced as the gpt2 family. GPT-NeoX blocks have the same matrices, biases and two
    # LayerNorms as GPT-2, so block parameters and FLOPs are identical. Its parallel residual
    # (attention and MLP both read the block input) changes the order of work, not its
    # amount, and partial rotary (rotary_pct of each head) is elementwise work the model does
    # not count. The one difference: NeoX has no learned position table, while the gpt2
    # family counts seq_len x hidden parameters for one (a lookup, no FLOPs), so n_params
    # here is too high by exactly that (pythia-160m: 2048 x 768 = 1.57M, 0.97%).
    hidden = _size(config, "hidden_size", where)
    heads = _size(config, "num_attention_heads", where)
    _check_head_dim(config, hidden, heads, where)
    if not _flag(config, "attention_bias", where, default=True):
        raise PartitaError(f"{where}: attention_bias = false is not supported; the gpt2 family has biases everywhere")
    return ModelSpec(
        name=name, family="gpt2", hidden=hidden, n_layers=_size(config, "num_hidden_layers", where), heads=heads,
        kv_heads=heads, ffn=_size(config, "intermediate_size", where), vocab=_size(config, "vocab_size", where),
        # The context window, capped: see MAX_DEFAULT_SEQ_LEN.
        seq_len=min(_size(config, "max_position_embeddings", where), MAX_DEFAULT_SEQ_LEN),
        tie_embeddings=_flag(config, "tie_word_embeddings", where, default=False),
        norm_eps=_number(config, "layer_norm_eps", where, default=1e-5),
    )


def _mixtral(config: Mapping[str, Any], name: str, where: str) -> ModelSpec:
    # Mixtral: every block's MLP is num_local_experts SwiGLU experts of intermediate_size, top
    # num_experts_per_tok, softmax over the chosen logits (the runtime's routing). sliding_window
    # is ignored (attention is priced over the whole sequence, an upper bound).
    spec = _llama_like(config, name, where, qkv_bias=False)
    return dataclasses.replace(spec, experts=_size(config, "num_local_experts", where),
                               experts_per_token=_size(config, "num_experts_per_tok", where))


def _qwen2_moe(config: Mapping[str, Any], name: str, where: str) -> ModelSpec:
    # Qwen2-MoE: num_experts experts of moe_intermediate_size, top num_experts_per_tok, and one
    # shared expert of shared_expert_intermediate_size behind a sigmoid gate. intermediate_size
    # is the width of dense MLP layers, which this family has only with decoder_sparse_step > 1
    # or mlp_only_layers: refused (every block is priced alike). norm_topk_prob = false (the
    # chosen experts' softmax weights not renormalised) changes no cost; the runtime renormalises.
    if _size(config, "decoder_sparse_step", where, default=1) != 1:
        raise PartitaError(f"{where}: decoder_sparse_step > 1 (dense MLP layers between expert layers) is not "
                           "supported; every block must be a mixture of experts")
    if config.get("mlp_only_layers"):
        raise PartitaError(f"{where}: mlp_only_layers (dense MLP layers among the expert layers) is not supported; "
                           "every block must be a mixture of experts")
    spec = _llama_like(config, name, where, qkv_bias=True)
    return dataclasses.replace(spec, ffn=_size(config, "moe_intermediate_size", where),
                               experts=_size(config, "num_experts", where),
                               experts_per_token=_size(config, "num_experts_per_tok", where),
                               shared_expert_ffn=_size(config, "shared_expert_intermediate_size", where, default=0))


MOE_MAPPERS = ("mixtral", "qwen2_moe")

MAPPERS: dict[str, Callable[[Mapping[str, Any], str, str], ModelSpec]] = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "llama": lambda c, n, w: _llama_like(c, n, w, qkv_bias=False),
    "mistral": lambda c, n, w: _llama_like(c, n, w, qkv_bias=False),
    "qwen2": lambda c, n, w: _llama_like(c, n, w, qkv_bias=True),
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
}


# ---- typed reads, each naming the config's own key ---------------------------------------

def _size(config: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    """A positive integer. ``null`` counts as absent (gpt2 writes ``"n_inner": null``)."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise PartitaError(f"{where}: missing key {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise PartitaError(f"{where}: {key} must be an integer, got {value!r}")
    if value < 1:
        raise PartitaError(f"{where}: {key} must be a positive integer, got {value}")
    return value


def _number(config: Mapping[str, Any], key: str, where: str, default: float) -> float:
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PartitaError(f"{where}: {key} must be a number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:
        raise PartitaError(f"{where}: {key} is too large, got {value}") from None
    if not math.isfinite(value) or value <= 0:
        raise PartitaError(f"{where}: {key} must be a positive finite number, got {value}")
    return value


def _flag(config: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise PartitaError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _check_head_dim(config: Mapping[str, Any], hidden: int, heads: int, where: str) -> None:
    """An explicit head_dim must be hidden/heads: the block shapes are derived from that."""
    head_dim = config.get("head_dim")
    if head_dim is None:
        return
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise PartitaError(f"{where}: head_dim must be an integer, got {head_dim!r}")
    if hidden % heads or head_dim != hidden // heads:
        raise PartitaError(f"{where}: head_dim {head_dim} is given explicitly and is not hidden / heads "
                           f"({hidden} / {heads}); Partita prices heads of width hidden/heads only")
