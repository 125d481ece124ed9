"""Every bad input a user can give, through the real entry point: one line on stderr, exit 2
(or 3 when no plan fits), never a traceback, and nothing half-written or lost.

Most cases call ``partita.cli.main`` in-process (fast); two run the installed command in a
subprocess to prove the whole program, interpreter exit included, prints no traceback.
``partita launch`` refuses its cases before it starts any process (starting one fails the test).
"""

import json
import os
import subprocess
import sys

import pytest
import yaml

from partita.cli import main
from partita.model_io import load_model
from partita.profile import LayerCost, Profile, Provenance

TINY = ["--model", "tiny-llama", "--cluster", "4xcpu"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The files the cases refer to, made once: a valid plan, a hand-broken one, profiles."""
    d = tmp_path_factory.mktemp("inputs")
    plan = d / "plan.yaml"
    assert main(["plan", *TINY, "--search", "uniform", "-o", str(plan)]) == 0
    data = yaml.safe_load(plan.read_text())
    data["mesh"]["dp"] = 3  # hand-edited: the arithmetic no longer adds up
    (d / "dp3.yaml").write_text(yaml.safe_dump(data))
    (d / "malformed.yaml").write_text("schema_version: 1\nstages: [1, 2\n")
    (d / "folder").mkdir()
    (d / "empty-hf").mkdir()
    model = load_model("tiny-llama")
    cost = LayerCost(kind=model.kinds["block"], tp=1, micro_batch=1, seq_len=64, forward_s=1e-3, backward_s=2e-3,
                     recompute_s=1e-3, activation_bytes=1 << 20, param_bytes=1 << 16)
    prov = Provenance(source="measured", device_name="test")
    Profile(device="cpu", dtype="fp16", provenance=prov, layers=(cost,)).save(d / "fp16.yaml")
    Profile(device="H100", dtype="bf16", provenance=prov, layers=(cost,)).save(d / "h100.yaml")
    # launch: text too short for one sequence, and checkpoints as a finished run leaves them
    (d / "empty.txt").write_bytes(b"")
    (d / "short.txt").write_bytes(b"hello")
    schedule = dict(schema_version=1, steps=4, lr=1e-3, warmup_steps=1, min_lr_ratio=0.1, data="synthetic", seed=0,
                    global_batch=data["global_batch"], seq_len=data["seq_len"])
    for name, model_name, fingerprint in (("ckpt-gpt2", "tiny-gpt2", load_model("tiny-gpt2").fingerprint),
                                          ("ckpt-llama", "tiny-llama", data["model_fingerprint"])):
        step = d / name / "step-000004"
        _intact_checkpoint(step)
        (step / "partita.json").write_text(json.dumps(dict(schedule, step=4, model_name=model_name,
                                                           model_fingerprint=fingerprint)))
    _intact_checkpoint(d / "ckpt-broken" / "step-000004")
    (d / "ckpt-broken" / "step-000004" / "partita.json").write_text("{not json")
    return d


def _intact_checkpoint(step):
    """A checkpoint directory that reads as whole (its .metadata and shard), whatever it holds:
    a resume checks the shards before it reads the record beside them."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"x": torch.zeros(2)}, checkpoint_id=str(step))


# (argv with {d} for the files folder, exit code, a phrase the one line must hold)
CASES = [
    # plan: names
    (["plan", "--model", "llama-2-7c", "--cluster", "8xH100"], 2, "did you mean llama-2-7b"),
    (["plan", "--model", "tiny-llama", "--cluster", "8xH1000"], 2, "did you mean H100"),
    (["plan", "--model", "tiny-llama", "--cluster", "8xA100"], 2, "ambiguous: it could be A100-40GB or A100-80GB"),
    (["plan", "--model", "tiny-llama", "--cluster", "2x8xV100"], 2, "ambiguous: it could be V100-16GB or V100-32GB"),
    (["plan", "--model", "tiny-llama", "--cluster", "0x8xH100"], 2, ">= 1"),
    (["plan", "--model", "tiny-llama"], 2, "--cluster"),
    (["plan", "--model", "{d}/folder", "--cluster", "4xcpu"], 2, "without a config.json"),
    (["plan", "--model", "{d}/missing.yaml", "--cluster", "4xcpu"], 2, "no such file"),
    # plan: numbers and flags
    (["plan", *TINY, "--global-batch", "-4"], 2, "must be >= 1"),
    (["plan", *TINY, "--seq-len", "0"], 2, "must be >= 1"),
    (["plan", "--model", "tiny-gpt2", "--cluster", "4xcpu", "--seq-len", "128"], 2, "learns 64 positions"),
    (["plan", *TINY, "--tp", "3"], 2, "not divisible"),
    (["plan", "--model", "llama-2-7b", "--cluster", "8xH100", "--tp", "16"], 2, "inside one node"),
    (["plan", "--model", "tiny-gpt2", "--cluster", "4xcpu", "--pp", "5"], 2, "at most 4 stages"),
    (["plan", *TINY, "--pp", "7"], 2, "6 blocks"),
    (["plan", *TINY, "--micro-batch", "16"], 2, "larger than the global batch 8"),
    (["plan", *TINY, "--micro-batch", "3", "--search", "uniform"], 3, "meets --micro-batch 3"),
    (["plan", *TINY, "--zero", "4"], 2, "ZeRO levels"),
    (["plan", *TINY, "--search", "greedy"], 2, "invalid choice"),
    (["plan", *TINY, "--search", "uniform", "--workers", "2"], 2, "--search uniform does not run"),
    (["plan", *TINY, "--time-limit", "0"], 2, "must be > 0"),
    (["plan", *TINY, "--gap", "100"], 2, "below 100"),
    (["plan", *TINY, "--gap", "tight"], 2, "expected a percentage"),
    (["plan", *TINY, "--dtype", "int8"], 2, "invalid choice"),
    (["plan", *TINY, "--dtype", "bf16"], 2, "CPU ranks train in fp32"),
    (["plan", "--model", "tiny-llama", "--cluster", "8xV100-32GB", "--dtype", "bf16"], 2, "has no bf16"),
    (["plan", *TINY, "--memory-margin", "-1"], 2, "must be >= 0"),
    (["plan", *TINY, "--memory-margin", "lots"], 2, "expected GiB"),
    (["plan", *TINY, "--memory-margin", "100%"], 2, "must be < 1"),
    (["plan", *TINY, "--memory-margin", "5"], 2, "leaving nothing"),
    (["plan", "--model", "tiny-llama", "--cluster", "1xcpu", "--memory-margin", "3.9"], 3, "--memory-margin"),
    # plan: files
    (["plan", *TINY, "-o", "{d}/no-such-dir/p.yaml"], 2, "no such directory"),
    (["plan", *TINY, "-o", "{d}"], 2, "is a directory"),
    (["plan", *TINY, "--profile", "{d}/nope.yaml"], 2, "no such file"),
    (["plan", *TINY, "--profile", "{d}/fp16.yaml"], 2, "measured in fp16, the plan trains in fp32"),
    (["plan", *TINY, "--profile", "{d}/h100.yaml"], 2, "measured on H100, but the cluster has cpu"),
    (["plan", *TINY, "--profile", "{d}/malformed.yaml"], 2, "malformed YAML"),
    # check
    (["check", "{d}/plan.yaml", "--cluster", "8xcpu"], 2, "4 vs 8 cpu"),
    (["check", "{d}/plan.yaml", "--cluster", "4xA100"], 2, "ambiguous"),
    (["check", "{d}/plan.yaml"], 2, "--cluster"),
    (["check", "{d}/nope.yaml", "--cluster", "4xcpu"], 2, "no such file"),
    (["check", "{d}/malformed.yaml", "--cluster", "4xcpu"], 2, "malformed YAML"),
    (["check", "{d}/dp3.yaml", "--cluster", "4xcpu"], 2, "global_batch 8 != dp 3"),
    # show
    (["show", "{d}/dp3.yaml"], 2, "global_batch 8 != dp 3"),
    (["show", "{d}/nope.yaml"], 2, "no such file"),
    (["show", "{d}/fp16.yaml"], 2, "unknown key"),
    (["show", "{d}"], 2, "cannot read"),
    # models, devices, the command itself
    (["models", "extra"], 2, "unrecognized arguments"),
    (["devices", "--all"], 2, "unrecognized arguments"),
    (["plans"], 2, "invalid choice"),
    # profile: argument errors, refused before anything is measured
    (["profile", "--device", "cpu", "--device-type", "H100", "--model", "tiny-llama"], 2, "measured on the CPU"),
    (["profile", "--device", "cpu", "--device-type", "A100", "--model", "tiny-llama"], 2, "ambiguous"),
    (["profile", "--device", "tpu", "--model", "tiny-llama"], 2, "unknown --device"),
    (["profile", "--device", "cpu", "--model", "tiny-lama"], 2, "did you mean tiny-llama"),
    (["profile", "--device", "cpu", "--model", "tiny-llama", "--micro-batches", "0"], 2, ">= 1"),
    (["profile", "--device", "cpu", "--model", "tiny-llama", "-o", "{d}"], 2, "is a directory"),
    # launch: the plan and the world
    (["launch", "{d}/nope.yaml"], 2, "no such file"),
    (["launch", "{d}/dp3.yaml"], 2, "global_batch 8 != dp 3"),
    (["launch", "{d}/plan.yaml", "--cluster", "8xcpu"], 2, "4 vs 8 cpu"),
    (["launch", "{d}/plan.yaml", "--model", "tiny-gpt2"], 2, "plan was made for model 'tiny-llama'"),
    (["launch", "{d}/plan.yaml", "--nproc", "3"], 2, "--nproc is 3"),
    # launch: data
    (["launch", "{d}/plan.yaml", "--data", "{d}/empty.txt"], 2, "0 bytes is shorter than one sequence"),
    (["launch", "{d}/plan.yaml", "--data", "{d}/short.txt"], 2, "5 bytes is shorter than one sequence"),
    (["launch", "{d}/plan.yaml", "--data", "{d}/nope.txt"], 2, "no such file"),
    (["launch", "{d}/plan.yaml", "--data", "{d}/folder"], 2, "a folder with neither meta.json nor .bin files"),
    # launch: numbers
    (["launch", "{d}/plan.yaml", "--lr=-1"], 2, "--lr must be a finite number > 0"),
    (["launch", "{d}/plan.yaml", "--lr", "nan"], 2, "--lr must be a finite number > 0, got nan"),
    (["launch", "{d}/plan.yaml", "--lr", "inf"], 2, "--lr must be a finite number > 0, got inf"),
    (["launch", "{d}/plan.yaml", "--lr", "fast"], 2, "invalid float value"),
    (["launch", "{d}/plan.yaml", "--steps", "0"], 2, "--steps must be at least 1"),
    (["launch", "{d}/plan.yaml", "--warmup-steps", "-1"], 2, "--warmup-steps must be between 0 and --steps 20"),
    (["launch", "{d}/plan.yaml", "--warmup-steps", "50"], 2, "never reaches --lr"),
    (["launch", "{d}/plan.yaml", "--seed", "-1"], 2, "--seed must be between 0 and"),
    (["launch", "{d}/plan.yaml", "--checkpoint-every", "-1"], 2, "--checkpoint-every must be >= 0"),
    (["launch", "{d}/plan.yaml", "--master-port", "70000"], 2, "--master-port must be between 1 and 65535"),
    # launch: where it writes
    (["launch", "{d}/plan.yaml", "--checkpoint-every", "5"], 2, "needs --checkpoint-dir"),
    (["launch", "{d}/plan.yaml", "--checkpoint-dir", "{d}/plan.yaml"], 2, "is a file, not a directory"),
    (["launch", "{d}/plan.yaml", "--checkpoint-dir", "{d}/plan.yaml/ckpt"], 2, "cannot hold a folder"),
    (["launch", "{d}/plan.yaml", "--metrics", "{d}/folder"], 2, "is a directory; give a file path"),
    (["launch", "{d}/plan.yaml", "--metrics", "{d}/plan.yaml/metrics.jsonl"], 2, "cannot hold a folder"),
    # launch: checkpoints
    (["launch", "{d}/plan.yaml", "--resume"], 2, "--resume needs --checkpoint-dir"),
    (["launch", "{d}/plan.yaml", "--resume", "--checkpoint-dir", "{d}/ckpt-gpt2"], 2, "holds model 'tiny-gpt2'"),
    (["launch", "{d}/plan.yaml", "--resume", "--checkpoint-dir", "{d}/ckpt-llama", "--steps", "4"], 2,
     "give --steps above 4"),
    (["launch", "{d}/plan.yaml", "--checkpoint-dir", "{d}/ckpt-llama"], 2, "add --resume to continue it"),
    (["launch", "{d}/plan.yaml", "--resume", "--checkpoint-dir", "{d}/ckpt-broken"], 2,
     "cannot read the checkpoint record"),
]


@pytest.mark.parametrize("argv, code, phrase", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_input_is_one_line(argv, code, phrase, files, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # where a default plan.yaml or profile.yaml would land
    before = sorted(p.name for p in files.iterdir())
    argv = [a.replace("{d}", str(files)) for a in argv]
    monkeypatch.setattr(subprocess, "Popen", _no_process)  # refused before anything starts
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert phrase in err, err
    assert err.startswith(("partita: error:", "partita: infeasible:")), err
    # nothing was written: no plan or profile beside the inputs, none in the working folder
    assert sorted(p.name for p in files.iterdir()) == before and not list(tmp_path.iterdir())


def _no_process(*args, **kwargs):
    raise AssertionError(f"a bad input started a process: {args}")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_launch_refuses_folders_it_cannot_write(files, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        for flag, path, phrase in (("--metrics", locked / "m.jsonl", "is not writable"),
                                   ("--checkpoint-dir", locked, "directory not writable"),
                                   ("--checkpoint-dir", locked / "ckpt", "is not writable")):
            assert main(["launch", str(files / "plan.yaml"), flag, str(path)]) == 2
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1 and phrase in err, err
    finally:
        locked.chmod(0o700)


def test_version_and_help_exit_0(capsys):
    from partita import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"partita {__version__}"
    assert main(["plan", "--help"]) == 0
    assert "--memory-margin" in capsys.readouterr().out


def _run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "partita.cli", *args], capture_output=True, text=True, timeout=120,
                          **kw)


def test_the_installed_command_prints_no_traceback(tmp_path):
    r = _run("plan", "--model", "tiny-llama", "--cluster", "4xA100", "-o", str(tmp_path / "p.yaml"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _run("show", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_closed_pipe_loses_no_plan(tmp_path):
    """`partita plan ... | head -1`: the plan is written, exit 0, nothing on stderr. The reader
    here closes its end before anything is printed, so every print meets a closed pipe."""
    out = tmp_path / "p.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "partita.cli", "plan", *TINY, "--search", "uniform", "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert err == ""
    assert yaml.safe_load(out.read_text())["schema_version"] == 2
    r = subprocess.run(f"{sys.executable} -m partita.cli models | head -1", shell=True, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr and r.stdout.count("\n") == 1
