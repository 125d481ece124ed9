"""Specs as files: YAML round trips, short forms, strict keys, suggestions, and no torch."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from partita import specio
from partita.cluster import ClusterSpec, load_cluster, parse_short
from partita.devices import CATALOG, get_device
from partita.errors import PartitaError
from partita.model import BUILTIN, ModelSpec
from partita.model_io import load_model
from partita.plan import LayerStrategy, Plan
from partita.profile import Profile
from partita.units import GiB
from spec_helpers import hand_plan, hand_profile

CONFIGS = Path(__file__).parent.parent / "configs"


def through_yaml(data):
    return specio.parse_yaml(specio.dump_yaml(data))


# ---- round trips: to_dict -> YAML text -> from_dict is the same object ----------------------

@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_model_round_trips(name):
    spec = BUILTIN[name]
    assert ModelSpec.from_dict(through_yaml(spec.to_dict())) == spec


def test_model_round_trips_through_a_file(tmp_path):
    spec = BUILTIN["llama-3-8b"]
    specio.save_yaml(spec.to_dict(), tmp_path / "m.yaml")
    assert load_model(str(tmp_path / "m.yaml")) == spec


SHORT_FORMS = ["8xH100", "4x8xA100-80GB+2x8xH100", "4xcpu", "H100", "2xH100+2xH100", "16x8xA100-40GB",
               "8xL40S+4xL4+2xV100-16GB"]


@pytest.mark.parametrize("short", SHORT_FORMS)
def test_short_form_cluster_round_trips(short):
    cluster = parse_short(short)
    assert ClusterSpec.from_dict(through_yaml(cluster.to_dict())) == cluster


@pytest.mark.parametrize("short", ["8xH200", "8xMI300X"])
def test_decimal_gb_devices_round_trip(short):
    cluster = parse_short(short)
    assert ClusterSpec.from_dict(through_yaml(cluster.to_dict())) == cluster


@pytest.mark.parametrize("path", sorted((CONFIGS / "clusters").glob("*.yaml")), ids=lambda p: p.name)
def test_cluster_files_load_and_round_trip(path):
    cluster = load_cluster(str(path))
    assert ClusterSpec.from_dict(through_yaml(cluster.to_dict())) == cluster


def test_cluster_file_contents():
    h100 = load_cluster(str(CONFIGS / "clusters" / "h100-64.yaml"))
    assert (h100.world_size, h100.device_types) == (64, ["H100"])
    mixed = load_cluster(str(CONFIGS / "clusters" / "mixed-h100-a100.yaml"))
    assert [(g.name, g.nodes, g.gpus_per_node) for g in mixed.groups] == [
        ("h100", 4, 8), ("a100-80gb", 8, 8), ("a100-40gb", 4, 8)]
    assert mixed.world_size == 128 and mixed.first_rank("a100-40gb") == 96
    assert mixed.group("a100-40gb").memory_bytes == 40 * GiB
    assert mixed.between_groups_gbps(mixed.group("h100"), mixed.group("a100-80gb")) == 12.5
    cpu = load_cluster(str(CONFIGS / "clusters" / "cpu4.yaml"))
    assert cpu.is_cpu and cpu.world_size == 4 and len(cpu.groups) == 1 and cpu.groups[0].nodes == 1


@pytest.mark.parametrize("path", sorted((CONFIGS / "models").glob("*.yaml")), ids=lambda p: p.name)
def test_model_files_load_and_round_trip(path):
    spec = load_model(str(path))
    assert ModelSpec.from_dict(through_yaml(spec.to_dict())) == spec


def test_benchmark_model_file():
    spec = load_model(str(CONFIGS / "models" / "llama-1b.yaml"))
    assert (spec.family, spec.hidden, spec.n_layers, spec.heads, spec.kv_heads, spec.ffn, spec.vocab,
            spec.seq_len, spec.default_global_batch) == ("llama", 2048, 16, 16, 8, 8192, 32000, 2048, 8)


def test_profile_round_trips(tmp_path):
    profile = hand_profile()
    assert Profile.from_dict(through_yaml(profile.to_dict())) == profile
    profile.save(tmp_path / "p.yaml")
    assert Profile.load(tmp_path / "p.yaml") == profile
    # a point without the selective measurement (the head; profiles from before it) has no key
    assert [("selective_recompute_s" in l) for l in profile.to_dict()["layers"]] == [True, False]


@pytest.mark.parametrize("with_results", [True, False])
def test_plan_round_trips(tmp_path, with_results):
    plan = hand_plan(with_results)
    assert Plan.from_dict(through_yaml(plan.to_dict())) == plan
    plan.save(tmp_path / "plan.yaml")
    assert Plan.load(tmp_path / "plan.yaml") == plan
    assert plan.world_size == 4 and plan.ranks == [0, 1, 2, 3]
    assert [l.recompute for l in plan.stages[1].layers] == ["selective", "full", "full", "none"]


def test_plans_written_before_selective_recomputation_still_load():
    """Schema-1 plans said ``recompute: true/false``; they read as full and none (and are
    written back as the mode's name)."""
    data = hand_plan().to_dict()
    data.update(data.pop("mesh"), schema_version=1)  # schema 1: the degrees at the top level
    for stage in data["stages"]:
        for layer in stage["layers"]:
            layer["recompute"] = layer["recompute"] == "full"
    plan = Plan.from_dict(through_yaml(data))
    assert plan.mesh == hand_plan().mesh
    assert [l.recompute for l in plan.stages[1].layers] == ["none", "full", "full", "none"]
    assert plan.stages[1].layers[1].to_dict()["recompute"] == "full"


@pytest.mark.parametrize("value", ["partial", "Full", 1, None])
def test_a_bad_recompute_mode_is_one_clear_error(value):
    data = hand_plan().to_dict()
    data["stages"][0]["layers"][1]["recompute"] = value
    with pytest.raises(PartitaError, match=r"recompute must be one of none, selective, full"):
        Plan.from_dict(data)


def test_a_layer_strategy_takes_a_mode_not_a_bool():
    """The truth of a string would read "none" as recomputing: a bool is refused outright."""
    with pytest.raises(PartitaError, match="recompute must be one of"):
        LayerStrategy(name="layers.0", recompute=True)


# ---- short forms --------------------------------------------------------------------------

@pytest.mark.parametrize("short,groups,world", [
    ("8xH100", [("h100", "H100", 1, 8)], 8),
    ("H100", [("h100", "H100", 1, 8)], 8),  # the catalog's node size
    ("4x8xA100-80GB+2x8xH100", [("a100-80gb", "A100-80GB", 4, 8), ("h100", "H100", 2, 8)], 48),
    ("4xcpu", [("cpu", "cpu", 1, 4)], 4),
    ("cpu", [("cpu", "cpu", 1, 1)], 1),
    ("2xH100+2xH100", [("h100", "H100", 1, 2), ("h100-2", "H100", 1, 2)], 4),
    ("8xa100-80gb", [("a100-80gb", "A100-80GB", 1, 8)], 8),  # any case
    (" 2 x 4 x h200 ", [("h200", "H200", 2, 4)], 8),
])
def test_short_form_parsing(short, groups, world):
    cluster = parse_short(short)
    assert [(g.name, g.device, g.nodes, g.gpus_per_node) for g in cluster.groups] == groups
    assert cluster.world_size == world


def test_short_form_rank_order():
    cluster = parse_short("4x8xA100-80GB+2x8xH100")
    assert cluster.first_rank("a100-80gb") == 0 and cluster.first_rank("h100") == 32
    assert cluster.short == "4x8xA100-80GB+2x8xH100"


@pytest.mark.parametrize("device", sorted(CATALOG))
def test_short_form_takes_defaults_from_the_catalog(device):
    group = parse_short(f"2x{device}").groups[0]
    dev = CATALOG[device]
    assert (group.memory_bytes, group.intra_link, group.intra_node_gbps, group.network_gbps) == (
        dev.memory_bytes, dev.intra_link, dev.intra_node_gbps, dev.network_gbps)


def test_yaml_group_defaults_come_from_the_catalog():
    cluster = ClusterSpec.from_dict({"groups": [{"device": "A100-40GB"}]})
    g = cluster.groups[0]
    assert (g.name, g.nodes, g.gpus_per_node, g.memory_bytes, g.network_gbps) == ("a100-40gb", 1, 8, 40 * GiB, 25)
    g = ClusterSpec.from_dict({"groups": [{"device": "H100", "memory_gib": 72}]}).groups[0]
    assert g.memory_bytes == 72 * GiB


@pytest.mark.parametrize("short,expected", [
    ("", "empty"), ("  ", "empty"), ("8xH100+", "cannot read ''"), ("0xH100", "counts must be >= 1"),
    ("2x0xH100", "counts must be >= 1"), ("8x8", "cannot read"), ("1x2x3xH100", "cannot read"),
    ("8xH100 8xA100", "cannot read"), ("8xFOO", "unknown device 'FOO'"),
])
def test_bad_short_forms_are_one_clear_error(short, expected):
    with pytest.raises(PartitaError, match=expected.replace("+", r"\+")):
        parse_short(short)


# ---- strict keys and suggestions ------------------------------------------------------------

def unknown_key_message(fn, data) -> str:
    with pytest.raises(PartitaError) as e:
        fn(data)
    msg = str(e.value)
    assert "unknown key 'colour'" in msg and "valid keys:" in msg, msg
    return msg


def test_unknown_keys_are_rejected_with_the_valid_keys_listed():
    msg = unknown_key_message(ModelSpec.from_dict, BUILTIN["gpt2"].to_dict() | {"colour": 1})
    assert "hidden, n_layers, heads, kv_heads, ffn" in msg
    cluster = parse_short("8xH100").to_dict()
    msg = unknown_key_message(ClusterSpec.from_dict, cluster | {"colour": 1})
    assert "groups, inter_group_gbps" in msg
    cluster["groups"][0]["colour"] = 1
    assert "memory_gib" in unknown_key_message(ClusterSpec.from_dict, cluster)
    msg = unknown_key_message(Plan.from_dict, hand_plan().to_dict() | {"colour": 1})
    assert "num_micro_batches" in msg
    plan = hand_plan().to_dict()
    plan["stages"][1]["layers"][0]["colour"] = 1
    assert "sequence_parallel" in unknown_key_message(Plan.from_dict, plan)
    msg = unknown_key_message(Profile.from_dict, hand_profile().to_dict() | {"colour": 1})
    assert "provenance" in msg
    profile = hand_profile().to_dict()
    profile["comm"][0]["colour"] = 1
    assert "bandwidth_gbps" in unknown_key_message(Profile.from_dict, profile)


def test_unknown_device_suggests_near_names():
    with pytest.raises(PartitaError, match="unknown device 'H10'; did you mean .*H100"):
        get_device("H10")
    with pytest.raises(PartitaError, match="did you mean .*A100-80GB"):
        parse_short("4x8xA100-80"),


def test_unknown_model_suggests_near_names():
    with pytest.raises(PartitaError, match="unknown model 'llama-3-8'; did you mean .*llama-3-8b"):
        load_model("llama-3-8")
    with pytest.raises(PartitaError, match="did you mean .*gpt2-medium"):
        load_model("gpt2-medum")


# ---- the spec layer never imports torch -------------------------------------------------------

BLOCK_TORCH = textwrap.dedent("""
    import importlib, importlib.util, pkgutil, sys

    class BlockTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test (imported as {name!r})")
            return None

    sys.meta_path.insert(0, BlockTorch())
    for name in ("partita", "partita.model", "partita.cluster", "partita.plan", "partita.profile", "partita.hf",
                 "partita.specio", "partita.devices", "partita.units", "partita.errors"):
        importlib.import_module(name)
    if importlib.util.find_spec("partita.search") is not None:
        search = importlib.import_module("partita.search")
        for mod in pkgutil.iter_modules(search.__path__):
            importlib.import_module(f"partita.search.{mod.name}")
    assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
    print("ok")
""")


def test_specs_and_search_import_with_torch_blocked():
    result = subprocess.run([sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
