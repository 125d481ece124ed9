"""Mixture-of-experts model specs: built-ins, Hugging Face configs, parameter counts, files."""

from pathlib import Path

import pytest

from partita import parallel
from partita.errors import PartitaError
from partita.hf import spec_from_hf
from partita.model import BUILTIN, LayerKind, ModelSpec
from partita.model_io import load_model

DATA = Path(__file__).parent / "data"


def test_qwen2_moe_config_counts_published_sizes():
    # Qwen1.5-MoE-A2.7B: 14.3B parameters, 2.7B active ("A2.7B"); 60 experts, top 4, a shared expert.
    m = load_model(str(DATA / "hf" / "qwen1.5-moe-a2.7b.json"))
    assert (m.experts, m.experts_per_token, m.ffn, m.shared_expert_ffn, m.qkv_bias) == (60, 4, 1408, 5632, True)
    assert round(m.n_params / 1e9, 1) == 14.3 and round(m.n_active_params / 1e9, 1) == 2.7


def test_builtin_mixtral_matches_its_config_json():
    from_file = load_model(str(DATA / "hf" / "mixtral-8x7b.json"))
    assert BUILTIN["mixtral-8x7b"].n_params == from_file.n_params
    assert BUILTIN["mixtral-8x7b"].kinds["block"] == from_file.kinds["block"]


def test_active_parameters_count_top_k_experts():
    m = BUILTIN["tiny-moe"]
    block = m.kinds["block"]
    h, f = m.hidden, m.ffn
    assert block.expert_params == m.experts * 3 * h * f
    assert m.n_params - m.n_active_params == m.n_layers * (m.experts - m.experts_per_token) * 3 * h * f
    dense = BUILTIN["tiny-llama"]
    assert dense.n_active_params == dense.n_params


def test_moe_fields_round_trip_and_dense_files_do_not_mention_them():
    m = BUILTIN["tiny-moe"]
    assert ModelSpec.from_dict(m.to_dict()) == m
    assert "experts" not in BUILTIN["tiny-llama"].to_dict()
    kind = m.kinds["block"]
    assert LayerKind.from_dict(kind.to_dict()) == kind
    assert "experts" not in BUILTIN["tiny-llama"].kinds["block"].to_dict()
    assert m.fingerprint != dataclass_dense(m).fingerprint


def dataclass_dense(m):
    import dataclasses
    return dataclasses.replace(m, experts=0, experts_per_token=0)


@pytest.mark.parametrize("change,text", [
    ({"experts_per_token": 5}, "experts_per_token"),
    ({"experts": 0}, "need experts > 0"),
    ({"family": "gpt2", "kv_heads": 4}, "llama family"),
])
def test_bad_moe_specs_are_refused(change, text):
    d = BUILTIN["tiny-moe"].to_dict() | change
    with pytest.raises(PartitaError, match=text):
        ModelSpec.from_dict(d)


def test_expert_parallel_limits():
    block = BUILTIN["tiny-moe"].kinds["block"]
    assert parallel.ep_rule(block, 2, dp=4) is None
    assert "not divisible by expert-parallel degree 3" in parallel.ep_rule(block, 3, dp=3)
    assert "data-parallel degree 2" in parallel.ep_rule(block, 4, dp=2)
    assert "mixture-of-experts" in parallel.ep_rule(BUILTIN["tiny-llama"].kinds["block"], 2, dp=2)
    # tp splits a MoE block's attention (heads 4, kv heads 2) and leaves its experts whole, on
    # sequence shards: it needs sequence parallelism
    assert parallel.tp_rule(block, 2) is None
    assert "kv_heads 2 is not divisible by tensor-parallel degree 4" in parallel.tp_rule(block, 4)
    assert "sequence parallelism" in parallel.moe_tp_rule(block, 2, sequence_parallel=False)
    assert parallel.moe_tp_rule(block, 2, sequence_parallel=True) is None
    assert parallel.moe_tp_rule(BUILTIN["tiny-llama"].kinds["block"], 2, sequence_parallel=False) is None


def test_qwen2_moe_with_dense_layers_is_refused():
    import json
    c = json.loads((DATA / "hf" / "qwen1.5-moe-a2.7b.json").read_text())
    with pytest.raises(PartitaError, match="decoder_sparse_step"):
        spec_from_hf(c | {"decoder_sparse_step": 2}, "x")
    with pytest.raises(PartitaError, match="mlp_only_layers"):
        spec_from_hf(c | {"mlp_only_layers": [0]}, "x")
