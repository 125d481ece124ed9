"""Hugging Face weights in and out: ``partita launch --init-from DIR`` and ``partita export-weights``.

A Hugging Face model folder is its ``config.json`` and its ``*.safetensors`` (one file, or shards
with ``model.safetensors.index.json``). The folder's config must be the plan's model
(``partita.hf.spec_from_hf``, compared field by field: one line names the first that differs).
Names and layouts as the two families write them:

* llama (llama, mistral, qwen2): ``model.embed_tokens``, ``model.layers.N.self_attn.{q,k,v,o}_proj``
  (q/k/v biases for qwen2), ``mlp.{gate,up,down}_proj``, ``input_layernorm``,
  ``post_attention_layernorm``, ``model.norm``, ``lm_head`` (absent when tied). Partita's
  attention rotates the two halves of each head (``models._rotary``), as Hugging Face's llama
  does, so q and k load unpermuted.
* gpt2: ``transformer.wte``, ``wpe``, ``h.N.ln_1``, ``attn.c_attn`` (q, k and v in one Conv1D,
  stored [in, out]: split and transposed), ``attn.c_proj``, ``ln_2``, ``mlp.c_fc``,
  ``mlp.c_proj`` (Conv1D, transposed), ``ln_f``; the output is the tied ``wte``.

Loading fills each rank's own stage right after its layers are materialized whole, before tensor
parallelism and FSDP shard them (``parallelize.parallelize_stage``): a rank reads only the tensors
of the layers it holds (``safetensors``' lazy ``safe_open``), under TP, FSDP and PP alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from partita import fileio
from partita.errors import PartitaError
from partita.model import ModelSpec

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
# ModelSpec fields a folder's config must agree on (the name, the default batch and the trained
# sequence length are not the weights').
SAME = ("family", "hidden", "n_layers", "heads", "kv_heads", "ffn", "vocab", "qkv_bias", "tie_embeddings",
        "rope_theta", "norm_eps", "experts")

Get = Callable[[str], torch.Tensor]  # a Hugging Face tensor by name


def _llama(spec: ModelSpec) -> dict[str, tuple[str, Callable[[Get], torch.Tensor]]]:
    out = {"embed.tok.weight": "model.embed_tokens.weight", "head.norm.weight": "model.norm.weight",
           "head.output.weight": "model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"}
    for i in range(spec.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        out |= {ours + "attention_norm.weight": theirs + "input_layernorm.weight",
                ours + "ffn_norm.weight": theirs + "post_attention_layernorm.weight",
                ours + "feed_forward.w1.weight": theirs + "mlp.gate_proj.weight",
                ours + "feed_forward.w3.weight": theirs + "mlp.up_proj.weight",
                ours + "feed_forward.w2.weight": theirs + "mlp.down_proj.weight"}
        for w, proj in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            out[ours + f"attention.{w}.weight"] = theirs + f"self_attn.{proj}.weight"
            if spec.qkv_bias and w != "wo":
                out[ours + f"attention.{w}.bias"] = theirs + f"self_attn.{proj}.bias"
    return {k: (v, (lambda get, v=v: get(v))) for k, v in out.items()}


def _gpt2(spec: ModelSpec) -> dict[str, tuple[str, Callable[[Get], torch.Tensor]]]:
    h = spec.hidden
    plain = lambda name: (name, lambda get: get(name))  # noqa: E731
    conv = lambda name: (name, lambda get: get(name).t().contiguous())  # noqa: E731  Conv1D [in, out]
    out = {"embed.tok.weight": plain("transformer.wte.weight"), "embed.pos.weight": plain("transformer.wpe.weight"),
           "head.norm.weight": plain("transformer.ln_f.weight"), "head.norm.bias": plain("transformer.ln_f.bias"),
           "head.output.weight": plain("transformer.wte.weight")}
    for i in range(spec.n_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        for norm, ln in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
            for p in ("weight", "bias"):
                out[ours + f"{norm}.{p}"] = plain(theirs + f"{ln}.{p}")
        for j, w in enumerate(("wq", "wk", "wv")):
            name = theirs + "attn.c_attn.weight"
            out[ours + f"attention.{w}.weight"] = (name, lambda get, name=name, j=j: get(name)[:, j * h:(j + 1) * h]
                                                   .t().contiguous())
            bias = theirs + "attn.c_attn.bias"
            out[ours + f"attention.{w}.bias"] = (bias, lambda get, bias=bias, j=j: get(bias)[j * h:(j + 1) * h].clone())
        out[ours + "attention.wo.weight"] = conv(theirs + "attn.c_proj.weight")
        out[ours + "attention.wo.bias"] = plain(theirs + "attn.c_proj.bias")
        out[ours + "feed_forward.w1.weight"] = conv(theirs + "mlp.c_fc.weight")
        out[ours + "feed_forward.w1.bias"] = plain(theirs + "mlp.c_fc.bias")
        out[ours + "feed_forward.w2.weight"] = conv(theirs + "mlp.c_proj.weight")
        out[ours + "feed_forward.w2.bias"] = plain(theirs + "mlp.c_proj.bias")
    return out


def mapping(spec: ModelSpec) -> dict[str, tuple[str, Callable[[Get], torch.Tensor]]]:
    """Partita parameter name -> (the Hugging Face tensor it reads, how)."""
    if spec.is_moe:
        raise PartitaError(f"--init-from: {spec.name} is a mixture of experts; Hugging Face weights load into dense "
                           f"llama and gpt2 models only")
    return _llama(spec) if spec.family == "llama" else _gpt2(spec)


def _files(folder: Path) -> list[Path]:
    if (folder / INDEX).is_file():
        index = fileio.load_json(folder / INDEX)
        names = sorted(set((index.get("weight_map") or {}).values())) if isinstance(index, dict) else []
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


def check_folder(folder: str | Path, spec: ModelSpec) -> None:
    """The folder holds the plan's model: its config and every tensor the model reads (one line if not)."""
    from partita.hf import load_hf_config

    p = Path(folder)
    if not (p / CONFIG).is_file():
        raise PartitaError(f"--init-from {p}: no {CONFIG}; give a Hugging Face model folder")
    theirs = load_hf_config(p / CONFIG)
    for field in SAME:
        a, b = getattr(theirs, field), getattr(spec, field)
        if a != b:
            raise PartitaError(f"--init-from {p}: the folder's model has {field} {a!r}, the plan's {spec.name} has "
                               f"{b!r}; give the weights of the plan's model")
    files = _files(p)
    if not files or not all(f.is_file() for f in files):
        raise PartitaError(f"--init-from {p}: no .safetensors weights (or a shard its index names is missing)")
    from safetensors import safe_open

    have: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as reader:
            have |= set(reader.keys())
    missing = sorted({theirs_name for theirs_name, _ in mapping(spec).values()} - have)
    if missing:
        raise PartitaError(f"--init-from {p}: {len(missing)} tensors the model needs are missing, e.g. {missing[0]}")


def load_into(model: torch.nn.Module, folder: str | Path, spec: ModelSpec) -> None:
    """Copy the folder's tensors into this rank's layers (whole, before they are sharded)."""
    from safetensors import safe_open

    table = mapping(spec)
    where: dict[str, Path] = {}
    for f in _files(Path(folder)):
        with safe_open(str(f), framework="pt") as reader:
            where |= {k: f for k in reader.keys()}
    readers: dict[Path, object] = {}

    def get(name: str) -> torch.Tensor:
        f = where[name]
        if f not in readers:
            readers[f] = safe_open(str(f), framework="pt")
        return readers[f].get_tensor(name)

    with torch.no_grad():
        for name, param in model.state_dict(keep_vars=True).items():
            name = name.replace("._checkpoint_wrapped_module", "")
            if name not in table:
                raise PartitaError(f"--init-from: the model's {name} has no Hugging Face tensor")
            value = table[name][1](get)
            if value.shape != param.shape:
                raise PartitaError(f"--init-from {folder}: {table[name][0]} is {tuple(value.shape)}, {name} is "
                                   f"{tuple(param.shape)}")
            param.copy_(value.to(param.dtype))


# ---- out --------------------------------------------------------------------------------
def hf_config(spec: ModelSpec) -> dict:
    """The config.json ``transformers`` reads for the model."""
    if spec.family == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": spec.hidden,
                "num_hidden_layers": spec.n_layers, "num_attention_heads": spec.heads,
                "num_key_value_heads": spec.kv_heads, "intermediate_size": spec.ffn, "vocab_size": spec.vocab,
                "max_position_embeddings": spec.seq_len, "rope_theta": spec.rope_theta, "rms_norm_eps": spec.norm_eps,
                "tie_word_embeddings": spec.tie_embeddings, "attention_bias": False, "mlp_bias": False,
                "hidden_act": "silu", "torch_dtype": "float32"}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": spec.hidden, "n_layer": spec.n_layers,
            "n_head": spec.heads, "n_inner": spec.ffn, "vocab_size": spec.vocab, "n_positions": spec.seq_len,
            "layer_norm_epsilon": spec.norm_eps, "activation_function": "gelu_new", "tie_word_embeddings": True,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "torch_dtype": "float32"}


def to_hf(state: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Partita's full state dict as the Hugging Face tensors (the inverse of ``mapping``)."""
    table = mapping(spec)
    out: dict[str, torch.Tensor] = {}
    if spec.family == "llama":
        for ours, (theirs, _) in table.items():
            if ours == "head.output.weight" and spec.tie_embeddings:
                continue
            out[theirs] = state[ours].contiguous()
        return out
    h = spec.hidden
    for ours, (theirs, _) in table.items():
        if ours == "head.output.weight":
            continue  # tied to wte
        t = state[ours]
        if ".attention.w" in ours and ours.split(".")[-2] in ("wq", "wk", "wv"):
            continue  # fused below
        out[theirs] = t.t().contiguous() if theirs.endswith(("c_proj.weight", "c_fc.weight")) else t.contiguous()
    for i in range(spec.n_layers):
        ours = f"layers.{i}.attention."
        out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat(
            [state[ours + f"{w}.weight"].t() for w in ("wq", "wk", "wv")], dim=1).contiguous()
        out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([state[ours + f"{w}.bias"] for w in ("wq", "wk", "wv")])
        assert out[f"transformer.h.{i}.attn.c_attn.weight"].shape == (h, 3 * h)
    return out


def save_folder(state: dict[str, torch.Tensor], spec: ModelSpec, out: str | Path) -> Path:
    """Write ``out`` as a Hugging Face folder: config.json and model.safetensors, each whole."""
    from safetensors.torch import save

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = to_hf(state, spec)
    fileio.write_text(folder / "model.safetensors", save(tensors, metadata={"format": "pt"}))
    fileio.write_text(folder / CONFIG, json.dumps(hf_config(spec), indent=1) + "\n")
    return folder

