"""Elastic training: `partita replan` for a changed cluster, and `partita launch --elastic`, which
re-plans on the ranks left when one dies and resumes from the last checkpoint."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from partita.cli.replan import nearest_batches, replan, shrunk_cluster
from partita.cluster import parse_short
from partita.errors import PartitaError
from partita.plan import Plan

ROOT = Path(__file__).resolve().parents[1]


def partita(*argv, cwd, timeout=600):
    return subprocess.run([sys.executable, "-m", "partita.cli", *map(str, argv)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def one_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    proc = partita("plan", "--model", "tiny-llama", "--cluster", "4xcpu", "-o", "tiny.yaml", cwd=folder)
    assert proc.returncode == 0, proc.stderr
    return folder / "tiny.yaml"


def test_nearest_batches_are_splittable_by_the_new_world_nearest_first():
    assert nearest_batches(8, 3) == [9, 6]
    assert nearest_batches(2048, 24)[:3] == [2049, 2046, 2050]  # multiples of 3, 2 (and 3, 6) and 2
    assert all(b % d == 0 for b in nearest_batches(100, 7) for d in (7,))


def test_shrunk_cluster_loses_the_dead_ranks_device():
    cluster = parse_short("4xcpu")
    assert shrunk_cluster(cluster, [1]).world_size == 3
    two = parse_short("8xH100+8xA100-80GB")
    left = shrunk_cluster(two, [9])
    assert [g.size for g in left.groups] == [8, 7]
    with pytest.raises(PartitaError, match="spans 2 nodes"):
        shrunk_cluster(parse_short("2x8xH100"), [3])


def test_replan_keeps_the_model_and_batch_and_says_what_moves(tiny_plan, tmp_path):
    old = Plan.load(tiny_plan)
    result = replan(old, parse_short("2xcpu"))
    new = result.plan
    assert new.world_size <= 2 and new.model_fingerprint == old.model_fingerprint
    assert (new.global_batch, new.seq_len, new.dtype) == (old.global_batch, old.seq_len, old.dtype)
    assert result.batch_note == ""
    proc = partita("replan", tiny_plan, "--cluster", "2xcpu", "-o", tmp_path / "new.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "what changes from" in proc.stdout and "state moved: the checkpoint" in proc.stdout
    assert Plan.load(tmp_path / "new.yaml").world_size == new.world_size


def test_replan_refuses_its_own_input_and_a_cluster_too_small(tiny_plan, tmp_path):
    before = tiny_plan.read_bytes()
    proc = partita("replan", tiny_plan, "--cluster", "2xcpu", "-o", tiny_plan, cwd=tmp_path)
    assert proc.returncode == 2 and "input" in one_line(proc)
    assert tiny_plan.read_bytes() == before
    big = tmp_path / "big.yaml"
    assert partita("plan", "--model", "llama-2-7b", "--cluster", "8xH100", "-o", big, cwd=tmp_path).returncode == 0
    proc = partita("replan", big, "--cluster", "1xL4", "--keep-batch", cwd=tmp_path)
    assert proc.returncode == 3 and "cannot be trained on 1xL4" in one_line(proc)
    assert not (tmp_path / "big-replan.yaml").exists()


def test_replan_llama_3_70b_from_four_nodes_to_three(tmp_path):
    """The issue's example: 32 H100 to 24; the new plan uses all 24."""
    assert partita("plan", "--model", "llama-3-70b", "--cluster", "4x8xH100", "-o", "p.yaml", cwd=tmp_path).returncode == 0
    proc = partita("replan", "p.yaml", "--cluster", "3x8xH100", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert Plan.load(tmp_path / "p-replan.yaml").world_size == 24
    words = " ".join(proc.stdout.split())  # the console wraps long lines where their numbers end
    assert "= 32 ranks ->" in words and "= 24 ranks" in words and "reloading takes" in words


# ---- partita launch --elastic -----------------------------------------------------------------
pytest.importorskip("torch")


def _losses(metrics: Path, run_id: str, after: int = 0) -> dict[int, float]:
    """Step -> loss of run ``run_id`` (every rank records the step's loss; rank 0's is kept)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records
            if r.get("run_id") == run_id and r.get("rank") == 0 and "event" not in r and r["step"] > after}


def test_elastic_run_survives_a_killed_rank_and_matches_a_resume_under_the_new_plan(tiny_plan, tmp_path):
    plan = shutil.copy(tiny_plan, tmp_path / "tiny.yaml")
    proc = partita("launch", plan, "--steps", 8, "--checkpoint-dir", "D", "--checkpoint-every", 2, "--elastic",
                   "--run-id", "elastic", "--crash-after-step", 4, "--crash-rank", 1, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = tmp_path / "runs" / "tiny" / "metrics.jsonl"
    events = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "replan"]
    assert len(events) == 1
    event = events[0]
    assert (event["lost_rank"], event["exit_code"], event["resumed_from_step"], event["lost_steps"]) == (1, -9, 4, 0)
    assert event["old_world_size"] == 4 and event["new_world_size"] <= 3
    assert sum("re-planned" in line for line in proc.stderr.splitlines()) == 1
    steps = _losses(metrics, "elastic")
    assert max(steps) == 8
    # The same checkpoint resumed by hand under the new plan trains the same losses.
    shutil.copytree(tmp_path / "D" / "step-000004", tmp_path / "D2" / "step-000004")
    again = partita("launch", event["new_plan"], "--steps", 8, "--checkpoint-dir", "D2", "--resume",
                    "--run-id", "again", "--metrics", "again.jsonl", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = _losses(tmp_path / "again.jsonl", "again", after=4)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert resumed == pytest.approx({s: steps[s] for s in resumed}, rel=1e-6)


def test_elastic_needs_a_checkpoint_dir(tiny_plan, tmp_path):
    proc = partita("launch", tiny_plan, "--steps", 2, "--elastic", cwd=tmp_path)
    assert proc.returncode == 2 and "--elastic resumes from checkpoints" in one_line(proc)
    proc = partita("launch", tiny_plan, "--steps", 2, "--min-ranks", 2, cwd=tmp_path)
    assert proc.returncode == 2 and "--min-ranks only applies with --elastic" in one_line(proc)


def test_too_few_ranks_left_stops_with_one_line_and_keeps_the_checkpoint(tiny_plan, tmp_path):
    proc = partita("launch", tiny_plan, "--steps", 6, "--checkpoint-dir", "D", "--checkpoint-every", 2, "--elastic",
                   "--min-ranks", 4, "--crash-after-step", 2, "--crash-rank", 3, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert "fewer than --min-ranks 4" in last and "(step 2) is intact" in last
    assert (tmp_path / "D" / "step-000002").is_dir()
