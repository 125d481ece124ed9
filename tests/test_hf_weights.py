"""Hugging Face weights in (`launch --init-from`) and out (`partita export-weights`): a tiny llama
and a tiny gpt2 saved by the test with the families' names and layouts, loaded under dp 2 x tp 2
and pp 2, train as one process started from the same folder; a checkpoint exported and read back
equals it bit for bit; another model's folder, or one missing a tensor, is one line."""

import dataclasses
import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from partita.errors import PartitaError  # noqa: E402
from partita.model import BUILTIN  # noqa: E402
from partita.runtime.hf_weights import check_folder, load_into, save_folder  # noqa: E402
from partita.runtime.models import build_model, materialize  # noqa: E402
from partita.runtime.train import TrainConfig  # noqa: E402
from runtime_helpers import assert_matches_one_process, make_plan, run_parallel  # noqa: E402


def _folder(name: str, tmp_path, seed: int = 123):
    """The model at another init than the runs' seed, written as its Hugging Face folder."""
    spec = BUILTIN[name]
    model = materialize(build_model(spec), device="cpu", seed=seed)
    return save_folder({k: v.detach() for k, v in model.state_dict().items()}, spec, tmp_path / name), model


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_the_folder_holds_the_families_names_and_loads_back_exactly(name, tmp_path):
    from safetensors import safe_open

    folder, model = _folder(name, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    if name == "tiny-llama":
        assert config["model_type"] == "llama" and "model.layers.0.self_attn.q_proj.weight" in keys
    else:
        assert config["model_type"] == "gpt2" and "transformer.h.0.attn.c_attn.weight" in keys
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            h = BUILTIN[name].hidden
            assert tuple(f.get_tensor("transformer.h.0.attn.c_attn.weight").shape) == (h, 3 * h)  # Conv1D [in, out]
    check_folder(folder, BUILTIN[name])
    again = materialize(build_model(BUILTIN[name]), device="cpu", seed=0)
    load_into(again, folder, BUILTIN[name])
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


@pytest.mark.parametrize("name,shape", [("tiny-llama", dict(dp=2, tp=2)), ("tiny-llama", dict(pp=2, dp=2)),
                                        ("tiny-gpt2", dict(dp=2, tp=2))])
def test_loaded_under_tp_fsdp_and_pp_it_trains_as_one_process_from_the_folder(name, shape, tmp_path):
    folder, _ = _folder(name, tmp_path)
    layer = dict(tensor_parallel=2, zero=3) if shape.get("tp") else dict(zero=1)
    plan = make_plan(name, **shape, layer=layer, **({"boundaries": [3]} if shape.get("pp") else {}))
    cfg = TrainConfig(steps=3, warmup_steps=1, init_from=str(folder), metrics=str(tmp_path / "m.jsonl"))
    losses, params = run_parallel(plan, cfg)
    assert_matches_one_process(plan, cfg, losses, params)
    plain, _ = run_parallel(plan, dataclasses.replace(cfg, init_from=None, metrics=str(tmp_path / "p.jsonl")))
    assert plain[0] != pytest.approx(losses[0], rel=1e-6)  # the folder's weights, not the seed's


def test_another_models_folder_or_a_missing_tensor_is_one_line(tmp_path):
    folder, _ = _folder("tiny-llama", tmp_path)
    with pytest.raises(PartitaError, match="the folder's model has family 'llama', the plan's tiny-gpt2 has 'gpt2'"):
        check_folder(folder, BUILTIN["tiny-gpt2"])
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(PartitaError, match="1 tensors the model needs are missing, e.g. model.layers.1.mlp.up_proj"):
        check_folder(folder, BUILTIN["tiny-llama"])


def test_a_checkpoint_exports_as_a_folder_that_reads_back_bit_for_bit(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    plan = make_plan("tiny-llama", dp=2, tp=2, layer=dict(tensor_parallel=2, zero=3))
    ckpt = tmp_path / "ckpt"
    run_parallel(plan, TrainConfig(steps=2, warmup_steps=1, checkpoint_dir=str(ckpt)))
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "partita.cli", "export-weights", str(ckpt), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    dcp_to_torch_save(str(ckpt / "step-000002"), str(tmp_path / "whole.pt"))
    saved = torch.load(tmp_path / "whole.pt", weights_only=True)["model"]
    model = materialize(build_model(BUILTIN["tiny-llama"]), device="cpu", seed=0)
    load_into(model, out, BUILTIN["tiny-llama"])
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key
    again = subprocess.run([sys.executable, "-m", "partita.cli", "export-weights", str(ckpt), "-o", str(out)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "not an empty folder" in again.stderr and "Traceback" not in again.stderr


def test_the_readme_loop_tokenize_launch_from_weights_and_export(tmp_path):
    """partita tokenize, launch --data --init-from and export-weights from the command line, as the
    README runs them on a laptop (a tiny llama's folder, a tokenizer the test trains)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    folder, _ = _folder("tiny-llama", tmp_path)
    docs = [" ".join(["alpha beta gamma delta epsilon"] * 40) + f" doc {i}" for i in range(30)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=100, special_tokens=["[UNK]", "</s>"]))
    tok.save(str(folder / "tokenizer.json"))

    def run(*argv):
        proc = subprocess.run([sys.executable, "-m", "partita.cli", *map(str, argv)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    run("plan", "--model", folder / "config.json", "--cluster", "2xcpu", "--global-batch", "4", "--seq-len", "32",
        "-o", "plan.yaml")
    run("tokenize", "corpus.jsonl", "--tokenizer", folder, "-o", "data")
    run("launch", "plan.yaml", "--steps", "3", "--data", "data", "--init-from", folder, "--checkpoint-dir", "ckpt",
        "--metrics", "m.jsonl")
    run("export-weights", "ckpt", "-o", "trained", "--model", folder / "config.json")
    assert (tmp_path / "trained" / "model.safetensors").is_file()
    check_folder(tmp_path / "trained", BUILTIN["tiny-llama"])
    bad = subprocess.run([sys.executable, "-m", "partita.cli", "launch", "plan.yaml", "--steps", "1", "--init-from",
                          tmp_path / "missing"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--init-from" in bad.stderr
