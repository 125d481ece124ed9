"""partita launch PLAN --emit slurm: the sbatch script's content (one heterogeneous component per
node group of a mixed cluster, the torchrun commands the plan needs), checked as text and by bash -n."""

import re
import shutil
import subprocess

import pytest

from partita.cli import main
from partita.plan import Plan

pytest.importorskip("torch")  # `partita launch` and its flags come with torch


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    path = tmp_path_factory.mktemp("slurm") / "plan.yaml"
    assert main(["plan", "--model", "llama-3-8b", "--cluster", "2x8xH100+2x8xA100-80GB", "--global-batch", "64",
                 "-o", str(path)]) == 0
    return path


def emit(plan, tmp_path, *extra):
    out = tmp_path / "job.sbatch"
    assert main(["launch", str(plan), "--emit", "slurm", "-o", str(out), "--steps", "100", *extra]) == 0
    return out.read_text()


def test_mixed_cluster_is_one_component_per_node_group(mixed, tmp_path):
    text = emit(mixed, tmp_path, "--partition", "gpu", "--walltime", "24:00:00")
    p = Plan.load(mixed)
    groups = list(dict.fromkeys(g["name"] for g in p.cluster["groups"] if g["name"] in {s.group for s in p.stages}))
    assert text.startswith("#!/bin/bash\n")
    assert text.count("#SBATCH hetjob") == len(groups) - 1
    assert text.count("#SBATCH --partition=gpu") == len(groups) and "#SBATCH --time=24:00:00" in text
    assert text.count("#SBATCH --gpus-per-node=8") == len(groups)
    sruns = re.findall(r"^srun --het-group=(\d+) --nodes=(\d+) .*run_node \"\$SLURM_JOB_NODELIST_HET_GROUP_(\d+)\" "
                       r"(\d+) \"([\d ]+)\"", text, re.M)
    assert [int(g) for g, *_ in sruns] == list(range(len(groups)))
    ranks = [sum(map(int, per_node.split())) for *_, per_node in sruns]
    assert sum(ranks) == p.world_size
    first = [int(f) for *_, f, _ in sruns]
    nodes = [int(n) for _, n, *_ in sruns]
    assert first == [sum(nodes[:i]) for i in range(len(nodes))]  # node ranks continue across components
    assert f"NNODES={sum(nodes)}" in text
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n 1)' in text
    assert "--rdzv-backend=static" in text and f"-m partita.runtime.worker {mixed} --steps 100" in text
    assert 'wait "$pid"' in text


def test_one_node_group_is_a_plain_job(tmp_path):
    plan = tmp_path / "h100.yaml"
    assert main(["plan", "--model", "llama-3-8b", "--cluster", "2x8xH100", "--global-batch", "64", "-o", str(plan)]) == 0
    text = emit(plan, tmp_path)
    assert "hetjob" not in text and "--het-group" not in text
    assert 'run_node "$SLURM_JOB_NODELIST" 0' in text


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_script_is_valid_bash(mixed, tmp_path):
    text = emit(mixed, tmp_path)
    path = tmp_path / "check.sh"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


@pytest.mark.parametrize("extra,phrase", [(["--walltime", "1 day"], "--walltime"),
                                          (["--partition", "a b"], "--partition"),
                                          (["--steps", "0"], "steps")])
def test_bad_input_is_one_line(mixed, tmp_path, capsys, extra, phrase):
    argv = ["launch", str(mixed), "--emit", "slurm", "-o", str(tmp_path / "j.sbatch"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and phrase in err and not (tmp_path / "j.sbatch").exists()


def test_emit_flags_without_emit_are_refused(mixed, tmp_path, capsys):
    assert main(["launch", str(mixed), "--partition", "gpu"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--emit slurm" in err
