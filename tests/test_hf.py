"""Hugging Face config.json -> ModelSpec: the shipped example configs, and every refusal."""

import copy
import json
from pathlib import Path

import pytest

from partita.errors import PartitaError
from partita.hf import MAX_DEFAULT_SEQ_LEN, load_hf_config, spec_from_hf
from partita.model_io import load_model

DATA = Path(__file__).parent / "data" / "hf"

# Parameter counts the models' publishers state (the HF checkpoints' exact totals where known).
PUBLISHED_PARAMS = {
    "llama-3-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096,
    "qwen2-0.5b": 494_032_768,
    "gpt2": 124_439_808,
    "pythia-160m": 162_322_944,
}


def config(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_param_count_matches_published(name):
    spec = load_model(str(DATA / f"{name}.json"))
    assert spec.name == name
    assert abs(spec.n_params - PUBLISHED_PARAMS[name]) <= 0.01 * PUBLISHED_PARAMS[name]


@pytest.mark.parametrize("name", ["llama-3-8b", "mistral-7b", "qwen2-0.5b", "gpt2"])
def test_param_count_is_exact_for_native_families(name):
    assert load_hf_config(DATA / f"{name}.json").n_params == PUBLISHED_PARAMS[name]


def test_gpt_neox_overcounts_by_the_position_table_it_does_not_have():
    # Priced as gpt2, which counts a learned seq_len x hidden position table; NeoX is rotary.
    spec = load_hf_config(DATA / "pythia-160m.json")
    assert spec.n_params - spec.seq_len * spec.hidden == PUBLISHED_PARAMS["pythia-160m"]


def test_shapes_and_flags():
    llama = load_hf_config(DATA / "llama-3-8b.json")
    assert (llama.family, llama.hidden, llama.n_layers, llama.heads, llama.kv_heads, llama.ffn, llama.vocab) == (
        "llama", 4096, 32, 32, 8, 14336, 128256)
    assert (llama.seq_len, llama.rope_theta, llama.norm_eps, llama.tie_embeddings, llama.qkv_bias) == (
        8192, 500000.0, 1e-5, False, False)
    qwen = load_hf_config(DATA / "qwen2-0.5b.json")
    assert qwen.qkv_bias and qwen.tie_embeddings and qwen.kv_heads == 2
    gpt2 = load_hf_config(DATA / "gpt2.json")
    assert (gpt2.family, gpt2.ffn, gpt2.seq_len, gpt2.tie_embeddings) == ("gpt2", 3072, 1024, True)
    neox = load_hf_config(DATA / "pythia-160m.json")
    assert (neox.family, neox.ffn, neox.seq_len, neox.tie_embeddings, neox.vocab) == ("gpt2", 3072, 2048, False, 50304)


def test_long_context_windows_are_capped_for_the_default_length():
    assert load_hf_config(DATA / "mistral-7b.json").seq_len == MAX_DEFAULT_SEQ_LEN  # window 32768
    assert load_hf_config(DATA / "qwen2-0.5b.json").seq_len == MAX_DEFAULT_SEQ_LEN  # window 131072
    short = config("llama-3-8b") | {"max_position_embeddings": 4096}
    assert spec_from_hf(short, "x").seq_len == 4096


def test_defaults_when_optional_keys_are_absent():
    c = config("llama-3-8b")
    for key in ("num_key_value_heads", "rope_theta", "rms_norm_eps", "tie_word_embeddings"):
        del c[key]
    spec = spec_from_hf(c, "x")
    assert spec.kv_heads == spec.heads and spec.rope_theta == 10000.0 and not spec.tie_embeddings
    g = config("gpt2") | {"n_inner": 2000}
    assert spec_from_hf(g, "x").ffn == 2000


def test_explicit_head_dim_equal_to_hidden_over_heads_is_fine():
    assert spec_from_hf(config("mistral-7b") | {"head_dim": 128}, "x").head_dim == 128


def test_config_json_is_named_after_its_folder(tmp_path):
    (tmp_path / "my-llama").mkdir()
    (tmp_path / "my-llama" / "config.json").write_text(json.dumps(config("llama-3-8b")))
    assert load_hf_config(tmp_path / "my-llama" / "config.json").name == "my-llama"


# ---- refusals: each one line, a PartitaError, naming the problem --------------------------

def refusal(cfg, *expected: str) -> str:
    with pytest.raises(PartitaError) as e:
        spec_from_hf(cfg, "m")
    msg = str(e.value)
    assert "\n" not in msg
    for text in expected:
        assert text in msg, msg
    return msg


def test_mixtral_file_is_a_mixture_of_experts():
    # Mixtral 8x7B's published sizes: 46.7B parameters, 12.9B active per token.
    m = load_model(str(DATA / "mixtral-8x7b.json"))
    assert (m.experts, m.experts_per_token, m.ffn) == (8, 2, 14336)
    assert round(m.n_params / 1e9, 1) == 46.7 and round(m.n_active_params / 1e9, 1) == 12.9


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v2", "deepseek_v3", "dbrx"])
def test_moe_model_types_are_refused(model_type):
    refusal(config("mistral-7b") | {"model_type": model_type}, "mixture-of-experts", model_type)


@pytest.mark.parametrize("key", ["num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"])
def test_moe_keys_are_refused_whatever_the_model_type(key):
    refusal(config("llama-3-8b") | {key: 8}, "mixture-of-experts", key)


def test_moe_keys_at_one_or_null_are_dense():
    c = config("llama-3-8b") | {"num_local_experts": 1, "num_experts": None, "moe_intermediate_size": 0}
    assert spec_from_hf(c, "x").n_params == PUBLISHED_PARAMS["llama-3-8b"]


def test_unknown_model_type_lists_supported():
    refusal(config("llama-3-8b") | {"model_type": "gemma"}, "'gemma'", "llama", "mistral", "qwen2", "gpt2", "gpt_neox")
    c = config("llama-3-8b")
    del c["model_type"]
    refusal(c, "model_type", "supported")


@pytest.mark.parametrize("name,key", [("llama-3-8b", "hidden_size"), ("llama-3-8b", "intermediate_size"),
                                      ("mistral-7b", "max_position_embeddings"), ("gpt2", "n_embd"),
                                      ("gpt2", "n_positions"), ("pythia-160m", "vocab_size")])
def test_missing_required_key_is_named(name, key):
    c = config(name)
    del c[key]
    refusal(c, "missing", repr(key))


@pytest.mark.parametrize("value", [0, -4096, 4096.0, "4096", True, [4096]])
def test_bad_sizes_are_refused(value):
    refusal(config("llama-3-8b") | {"hidden_size": value}, "hidden_size")


def test_head_dim_that_is_not_hidden_over_heads_is_refused():
    refusal(config("llama-3-8b") | {"head_dim": 256}, "head_dim 256", "4096 / 32")


def test_indivisible_shapes_name_the_file_and_numbers():
    refusal(config("llama-3-8b") | {"num_key_value_heads": 7}, "heads 32", "kv_heads 7")


@pytest.mark.parametrize("name,key,value", [("llama-3-8b", "attention_bias", True), ("llama-3-8b", "mlp_bias", True),
                                            ("gpt2", "add_cross_attention", True),
                                            ("pythia-160m", "attention_bias", False)])
def test_biases_and_cross_attention_the_families_do_not_price_are_refused(name, key, value):
    refusal(config(name) | {key: value}, key)


@pytest.mark.parametrize("value", [float("inf"), -1e-5, 0, "1e-5", True])
def test_bad_numbers_are_refused(value):
    refusal(config("llama-3-8b") | {"rms_norm_eps": value}, "rms_norm_eps")


@pytest.mark.parametrize("bad", [None, [], "llama", 3])
def test_config_that_is_not_an_object_is_refused(bad):
    refusal(bad, "expected a mapping")


def test_malformed_json_names_file_and_line(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text('{\n  "model_type": "llama",\n  "hidden_size": 4096,,\n}\n')
    with pytest.raises(PartitaError, match=r"broken\.json:3:\d+: malformed JSON"):
        load_hf_config(p)


def test_unreadable_files_are_one_line(tmp_path):
    with pytest.raises(PartitaError, match="no such file"):
        load_hf_config(tmp_path / "missing.json")
    (tmp_path / "latin1.json").write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(PartitaError, match="cannot read"):
        load_hf_config(tmp_path / "latin1.json")
    (tmp_path / "deep.json").write_text("[" * 100_000)
    with pytest.raises(PartitaError, match="malformed JSON"):
        load_hf_config(tmp_path / "deep.json")


def test_the_input_dict_is_not_modified():
    c = config("qwen2-0.5b")
    before = copy.deepcopy(c)
    spec_from_hf(c, "x")
    assert c == before
