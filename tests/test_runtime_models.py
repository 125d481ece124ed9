"""The runtime's torch models match the spec the planner reads."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from partita.errors import PartitaError
from partita.model import BUILTIN
from partita.runtime.models import build_layer, build_model, materialize

SPECS = [BUILTIN["tiny-llama"], BUILTIN["tiny-gpt2"], dataclasses.replace(BUILTIN["tiny-llama"], qkv_bias=True)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-{s.qkv_bias}")
def test_parameter_count_matches_spec(spec):
    model = build_model(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.n_params
    for name in spec.layer_names():
        layer = build_layer(spec, spec.role_of(name))
        assert sum(p.numel() for p in layer.parameters()) == spec.kind_of(name).params


@pytest.mark.parametrize("spec", SPECS[:2], ids=lambda s: s.name)
def test_forward_shapes_and_missing_parts(spec):
    model = materialize(build_model(spec), device="cpu", seed=0)
    tokens = torch.randint(0, spec.vocab, (2, spec.seq_len))
    assert model(tokens).shape == (2, spec.seq_len, spec.vocab)
    # A middle pipeline stage: hidden in, hidden out.
    del model.embed
    model.head = None
    for k in ["0", "1"]:
        del model.layers[k]
    assert model.owned_layer_names() == [f"layers.{i}" for i in range(2, spec.n_layers)]
    assert model(torch.randn(2, 8, spec.hidden)).shape == (2, 8, spec.hidden)


def test_init_is_per_layer_and_seeded():
    spec = BUILTIN["tiny-llama"]
    full = materialize(build_model(spec), device="cpu", seed=3)
    part = build_model(spec)
    del part.embed
    part = materialize(part, device="cpu", seed=3)
    torch.testing.assert_close(part.layers["2"].attention.wq.weight, full.layers["2"].attention.wq.weight, rtol=0, atol=0)
    other = materialize(build_model(spec), device="cpu", seed=4)
    assert not torch.equal(other.layers["2"].attention.wq.weight, full.layers["2"].attention.wq.weight)


@pytest.mark.parametrize("role", ["embed", "block", "head"])
def test_tensor_parallel_shard_is_a_fraction(role):
    spec = BUILTIN["tiny-llama"]
    whole = build_layer(spec, role)
    shard = build_layer(spec, role, tp=2, device="cpu")
    sharded = sum(p.numel() for n, p in shard.named_parameters() if "norm" not in n)
    assert sharded * 2 == sum(p.numel() for n, p in whole.named_parameters() if "norm" not in n)
    x = torch.randint(0, spec.vocab // 2, (1, 16)) if role == "embed" else torch.randn(1, 16, spec.hidden)
    assert shard(x).shape[:2] == (1, 16)
    with pytest.raises(PartitaError, match="not divisible"):
        build_layer(spec, role, tp=3)
