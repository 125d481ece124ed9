"""What `partita plan`, `check` and `show` tell a person: idle devices and why, profiles not used,
the memory margin and breakdown, the dtype, equivalent clusters, and what would make a plan fit."""

import json
import shutil
from pathlib import Path

import yaml

from partita.cli import plan as commands
from partita.cli import profiles
from partita.cli import main
from partita.cluster import parse_short
from partita.model_io import load_model
from partita.plan import Plan
from partita.profile import LayerCost, Profile, Provenance

DATA = Path(__file__).parent / "data" / "hf"


def _plan(tmp_path, *args):
    out = tmp_path / "p.yaml"
    code = main(["plan", *args, "--search", "uniform", "-o", str(out)])
    return code, out


def test_tied_embeddings_pipeline_over_both_groups(tmp_path, capsys):
    """A tied embedding and head may sit on different stages (the last keeps a copy), so a
    gpt2 model uses both node groups; before, it kept one stage and left a group idle."""
    code, out = _plan(tmp_path, "--model", "tiny-gpt2", "--cluster", "2xcpu+2xcpu", "--pp", "2")
    assert code == 0
    text = " ".join(capsys.readouterr().out.split())  # as one line, whatever the console's width
    assert "dp 2 x tp 1 x pp 2 = 4 ranks" in text and "ties its embedding" not in text
    assert "tied embedding sync" in text  # the copies' gradient sum, priced per step


def _show(path, capsys):
    assert main(["show", str(path)]) == 0
    return capsys.readouterr().out


def test_a_small_global_batch_leaves_devices_idle_and_says_so(tmp_path, capsys):
    code, _ = _plan(tmp_path, "--model", "tiny-llama", "--cluster", "16xcpu", "--global-batch", "2")
    assert code == 0
    assert "global batch 2 allows at most 2" in capsys.readouterr().out


def test_plan_prints_the_memory_breakdown_and_keeps_the_margin_free(tmp_path, capsys):
    code, out = _plan(tmp_path, "--model", "tiny-llama", "--cluster", "4xcpu", "--memory-margin", "3.5")
    assert code == 0
    text = capsys.readouterr().out
    assert "memory per device" in text and "optimizer" in text and "reserve" in text
    assert "3.5 GiB kept free" in text
    p = Plan.load(out)
    for m in p.prediction.memory:  # the plan is for the real cluster: full capacity, the margin unused
        assert m.capacity_bytes == 4 * 2**30 and m.peak_bytes <= m.capacity_bytes - 3.5 * 2**30
        assert set(m.category_bytes()) >= {"weights", "optimizer", "activations", "reserve"}
    assert main(["check", str(out), "--cluster", "4xcpu"]) == 0
    assert "memory per device" in _show(out, capsys)


def test_dtype_flag(tmp_path, capsys):
    code, out = _plan(tmp_path, "--model", "tiny-llama", "--cluster", "8xH100", "--dtype", "fp16")
    assert code == 0 and Plan.load(out).dtype == "fp16"
    code, out = _plan(tmp_path, "--model", "tiny-llama", "--cluster", "8xV100-32GB")
    assert code == 0 and Plan.load(out).dtype == "fp16"  # the default where a device lacks bf16


def _profile(path, *, dtype="fp32", seq_len=64, model="tiny-llama"):
    kind = load_model(model).kinds["block"]
    cost = LayerCost(kind=kind, tp=1, micro_batch=1, seq_len=seq_len, forward_s=1e-3, backward_s=2e-3,
                     recompute_s=1e-3, activation_bytes=1 << 20, param_bytes=1 << 16)
    Profile(device="cpu", dtype=dtype, provenance=Provenance(source="measured", device_name="test"),
            layers=(cost,)).save(path)
    return str(path)


def test_a_profile_that_cannot_be_used_is_named(tmp_path, capsys):
    model = load_model("tiny-llama")
    cluster = parse_short("4xcpu")
    good = _profile(tmp_path / "good.yaml")
    other_seq = _profile(tmp_path / "seq.yaml", seq_len=32)
    other_model = _profile(tmp_path / "model.yaml", model="tiny-gpt2")
    assert profiles.layer_costs_unusable(Profile.load(good), model, seq_len=64, dtype="fp32") is None
    why = profiles.layer_costs_unusable(Profile.load(other_seq), model, seq_len=64, dtype="fp32")
    assert "sequence length 32" in why and "--seq-len 32" in why
    why = profiles.layer_costs_unusable(Profile.load(other_model), model, seq_len=64, dtype="fp32")
    assert "other layer shapes" in why
    # a usable profile plans; an unusable one beside it is named on stderr and left out
    code, out = _plan(tmp_path, "--model", "tiny-llama", "--cluster", "4xcpu", "--profile", good)
    assert code == 0 and Plan.load(out).cost_sources["cpu"] in ("measured", "mixed")
    capsys.readouterr()
    kept = profiles.usable_profiles([other_model, good], model, cluster, seq_len=64, dtype="fp32")
    assert kept == (Profile.load(good),)
    err = capsys.readouterr().err
    assert err.startswith("partita: warning: profile") and "model.yaml" in err and "not used" in err
    # only unusable profiles: refused, each named, on one line
    assert main(["plan", "--model", "tiny-llama", "--cluster", "4xcpu", "--profile", other_seq,
                 "--profile", other_model]) == 2
    err = capsys.readouterr().err
    assert "seq.yaml" in err and "model.yaml" in err and len(err.strip().splitlines()) == 1


def test_check_accepts_the_same_hardware_in_another_order(tmp_path, capsys):
    code, out = _plan(tmp_path, "--model", "tiny-llama", "--cluster", "8xH100+8xL4")
    assert code == 0
    capsys.readouterr()
    assert main(["check", str(out), "--cluster", "8xL4+8xH100"]) == 0
    assert "the same hardware" in capsys.readouterr().out
    # and as YAML, under another group name
    spec = parse_short("8xL4+8xH100").to_dict()
    spec["groups"][0]["name"] = "inference-nodes"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(spec))
    assert main(["check", str(out), "--cluster", str(tmp_path / "c.yaml")]) == 0
    assert main(["check", str(out), "--cluster", "8xL4+8xH100-PCIe"]) == 2
    assert "8 vs 0 H100" in capsys.readouterr().err


def test_no_plan_fits_names_the_binding_limit(capsys):
    assert main(["plan", "--model", "llama-2-70b", "--cluster", "8xA100-80GB", "--search", "uniform"]) == 3
    err = capsys.readouterr().err
    assert "weights, gradients and optimizer state alone need" in err
    assert "ZeRO-3" not in err and "recompute" not in err  # both were searched
    assert "more node of 8x A100-80GB" in err and "--seq-len" not in err  # state alone is over: no seq help
    assert main(["plan", "--model", "llama-2-70b", "--cluster", "8xA100-80GB", "--search", "uniform",
                 "--zero", "0,1", "--no-recompute"]) == 3
    err = capsys.readouterr().err
    assert "ZeRO-3 (--zero 0,1,2,3)" in err and "recompute (drop --no-recompute)" in err
    assert main(["plan", "--model", "llama-2-70b", "--cluster", "8xA100-80GB", "--search", "uniform",
                 "--recompute", "none,selective"]) == 3
    assert "full recompute (--recompute none,selective,full)" in capsys.readouterr().err


def test_cpu_oversubscription_is_a_warning_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(commands, "available_cores", lambda: 1)
    code, _ = _plan(tmp_path, "--model", "tiny-llama", "--cluster", "4xcpu")
    assert code == 0
    assert "CPU ranks on a machine with 1 cores" in capsys.readouterr().out


def test_a_hugging_face_model_folder_is_a_model(tmp_path):
    folder = tmp_path / "Llama-3-8B"
    folder.mkdir()
    shutil.copy(DATA / "llama-3-8b.json", folder / "config.json")
    spec = load_model(str(folder))
    assert spec.name == "Llama-3-8B" and spec.hidden == json.loads((folder / "config.json").read_text())["hidden_size"]


def test_zero_2_in_a_pipeline_on_an_engine_that_refuses_it_is_one_clear_error(tmp_path, capsys):
    """--zero 2 with --pp 16 on megatron leaves only plans without data-parallel replicas (where
    ZeRO is 0): before, the plan command returned one on 128 of 8,192 GPUs. Now the flags are
    refused up front with the engine's reason and the fix, exit 2; the engine that runs it plans."""
    args = ["--model", "llama-3-405b", "--cluster", "1024x8xH100", "--seq-len", "8192", "--global-batch", "2048",
            "--tp", "8", "--pp", "16", "--zero", "2"]
    for engine, why in (("megatron", "refuses ZeRO 2 and 3 in a pipeline"),
                        ("deepspeed", "refuses ZeRO 2 and 3 in a pipeline"),
                        ("torchtitan", "runs FSDP inside a pipeline as ZeRO 1")):
        code, out = _plan(tmp_path, *args, "--engine", engine)
        err = " ".join(capsys.readouterr().err.split())
        assert code == 2 and not out.exists()
        assert f"--zero 2 with --pp 16: engine {engine} {why}" in err and "allow --zero 0,1," in err
    code, out = _plan(tmp_path, "--model", "llama-3-8b", "--cluster", "2x8xH100", "--seq-len", "4096",
                      "--global-batch", "64", "--pp", "1,2", "--zero", "2", "--engine", "megatron")  # pp 1 is allowed
    assert code == 0 and Plan.load(out).pp == 1


def test_the_uniform_search_names_the_engine_s_pipeline_zero_rule_when_it_empties_the_space():
    """Asked of the search itself (no flag check in front), the message names the ZeRO rule, not
    the --tp limit it used to blame."""
    from partita.search.planner import PlanRequest, make_plan
    from partita.search.uniform import SearchSpace
    from partita.errors import PartitaError
    import pytest

    space = SearchSpace(zero_levels=(2,), tensor_parallel=(8,), pipeline=(16,), micro_batches=(1,), recompute=("none",))
    req = PlanRequest(model=load_model("llama-3-405b"), cluster=parse_short("1024x8xH100"), seq_len=8192,
                      global_batch=2048, search="uniform", engine="megatron", space=space)
    with pytest.raises(PartitaError, match=r"meets --zero 2: engine megatron refuses ZeRO 2 and 3 in a pipeline .*"
                                           r"allow --zero 0,1, or plan without --engine megatron"):
        make_plan(req)
