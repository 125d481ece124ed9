"""A run that fails (issue 27): a full disk under --metrics or --checkpoint-dir, a killed rank.
Each is one line on the console (rank 0's progress lines aside) naming the cause, and the rank
and its log file where a rank failed, with no traceback, the ranks' own output in their log
files under the run directory, the exit code (2 for a refusal such as a full disk, 1 for a rank
that died), within the bound, and every file that existed before unchanged.

The faults are deterministic: a rank SIGKILLed by the hidden --crash-after-step/--crash-rank
flags, and a full disk that is the kernel's own ``/dev/full`` (a shard file of the second
checkpoint linked to it; a metrics file linked to it).
"""

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from partita.cli import main  # noqa: E402
from partita.runtime import checkpoint, launch  # noqa: E402
from partita.runtime.launch import failure_line, failure_record  # noqa: E402
from partita.runtime.ranklog import record_error  # noqa: E402

PROGRESS = "[rank 0] "  # rank 0's progress lines, which stay on the console


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    """A plan on two CPU ranks, made by `partita plan`."""
    folder = tmp_path_factory.mktemp("two")
    assert main(["plan", "--model", "tiny-llama", "--cluster", "2xcpu", "-o", str(folder / "two.yaml")]) == 0
    return folder / "two.yaml"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def partita(*argv, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "partita.cli", *map(str, argv)], cwd=cwd, capture_output=True,
                          text=True, timeout=600)
    return proc, time.monotonic() - started


def failure_lines(err: str) -> list[str]:
    """The console's lines that are not rank 0's progress."""
    return [line for line in err.splitlines() if line.strip() and not line.startswith(PROGRESS)]


# ---- before any rank starts ---------------------------------------------------------------------

def test_metrics_on_a_full_disk_is_refused_before_any_rank_starts(two, tmp_path, monkeypatch, capsys):
    """`--metrics /dev/full`: opened as the ranks open it and written nothing, which the device
    refuses; a link to it too. One line, exit 2, no run directory, the plan unchanged."""
    before = digest(two)
    monkeypatch.chdir(tmp_path)
    os.symlink("/dev/full", tmp_path / "full.jsonl")
    for metrics in ("/dev/full", "full.jsonl"):
        started = time.monotonic()
        assert main(["launch", str(two), "--steps", "1", "--metrics", metrics]) == 2
        assert time.monotonic() - started < 20
        err = capsys.readouterr().err
        assert err.splitlines() == [f"partita: error: no space left on device writing --metrics {metrics}"], err
    assert digest(two) == before and not (tmp_path / "runs").exists()


def test_a_file_system_without_space_is_refused_before_any_rank_starts(two, tmp_path, monkeypatch, capsys):
    """A regular metrics file or checkpoint folder on a file system with no block left."""
    monkeypatch.chdir(tmp_path)
    full = os.statvfs_result((4096, 4096, 1000, 0, 0, 100, 0, 0, 0, 255))
    monkeypatch.setattr(launch.os, "statvfs", lambda path: full)
    assert main(["launch", str(two), "--steps", "1", "--metrics", "m.jsonl"]) == 2
    assert capsys.readouterr().err.splitlines() == ["partita: error: no space left on device writing --metrics m.jsonl"]
    (tmp_path / "ckpt").mkdir()
    assert main(["launch", str(two), "--steps", "1", "--metrics", "/dev/null", "--checkpoint-dir", "ckpt"]) == 2
    assert capsys.readouterr().err.splitlines() == ["partita: error: no space left on device writing --checkpoint-dir ckpt"]


# ---- which rank's failure is the cause -----------------------------------------------------------

def test_the_cause_is_the_killed_rank_not_its_peers_or_those_torchrun_stopped(tmp_path):
    """torchrun lists every rank it found failed, its own SIGTERMs included, timed to the second."""
    log = str(tmp_path)
    killed = failure_record({0: (1, 100, False), 1: (-9, 100, False), 2: (-15, 100, True), 3: (1, 100, False)}, log)
    assert (killed["rank"], killed["signal"], killed["ranks"]) == (1, "SIGKILL", [0, 1, 2, 3])
    assert failure_line(killed) == f"rank 1 was killed by SIGKILL; its log: {tmp_path}/rank-1.log"
    crashed = failure_record({0: (-15, 101, True), 1: (1, 101, False)}, log)
    assert failure_line(crashed) == f"rank 1 failed with exit code 1; its log: {tmp_path}/rank-1.log"
    by_hand = failure_record({0: (1, 100, False)}, None)
    assert failure_line(by_hand) == "rank 0 failed with exit code 1"


def test_a_refusal_is_the_line_the_rank_left(tmp_path, monkeypatch):
    monkeypatch.setenv("PARTITA_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    record_error("no space left on device writing D/step-000004")
    refused = failure_record({0: (-15, 100, True), 1: (2, 100, False), 2: (-9, 100, True)}, str(tmp_path))
    assert (refused["rank"], refused["exitcode"]) == (1, 2)
    assert failure_line(refused) == (f"no space left on device writing D/step-000004 (rank 1; its log: "
                                     f"{tmp_path}/rank-1.log)")


# ---- runs that fail ------------------------------------------------------------------------------

def test_a_killed_rank_is_one_line_naming_it_its_signal_and_its_log(two, tmp_path):
    """Rank 1 SIGKILLed after step 2: rank 0's progress on the console, then one line; the
    ranks' tracebacks (rank 0's collective loses its peer) are in their logs."""
    before = digest(two)
    proc, seconds = partita("launch", two, "--steps", 4, "--crash-after-step", 2, "--crash-rank", 1, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert seconds < 300
    assert "Traceback" not in proc.stderr + proc.stdout
    assert failure_lines(proc.stderr) == ["partita: error: rank 1 was killed by SIGKILL; its log: "
                                          "runs/two/logs/rank-1.log"], proc.stderr
    assert "[rank 0] step 2/4" in proc.stderr
    logs = tmp_path / "runs" / "two" / "logs"
    assert "[rank 1] step 2/4" in (logs / "rank-1.log").read_text()
    assert "[rank 0] step 2/4" in (logs / "rank-0.log").read_text()
    assert digest(two) == before


def test_a_checkpoint_that_fills_the_disk_is_one_line_and_the_older_step_is_kept(two, tmp_path):
    """The step-4 checkpoint's first shard file is the kernel's full device: the save fails on
    rank 0, hence on every rank (DCP hands its error to all), which stop with one line. Step 2
    stays whole and step 4, without ``.metadata``, is not taken for a checkpoint."""
    before = digest(two)
    (tmp_path / "D" / "step-000004").mkdir(parents=True)
    os.symlink("/dev/full", tmp_path / "D" / "step-000004" / "__0_0.distcp")
    proc, seconds = partita("launch", two, "--steps", 4, "--checkpoint-dir", "D", "--checkpoint-every", 2,
                            cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert seconds < 300
    assert "Traceback" not in proc.stderr + proc.stdout
    [line] = failure_lines(proc.stderr)
    assert line.startswith("partita: error: no space left on device writing D/step-000004 (rank "), line
    assert line.endswith(".log)") and "its log: runs/two/logs/rank-" in line, line
    assert "[rank 0] saved checkpoint D/step-000002" in proc.stderr
    assert checkpoint.latest_step(tmp_path / "D") == 2 and checkpoint.damage(tmp_path / "D", 2) is None
    assert not (tmp_path / "D" / "step-000004" / ".metadata").exists()
    assert digest(two) == before


def test_a_disk_that_fills_mid_run_under_metrics_is_one_line(two, tmp_path, monkeypatch, capfd):
    """The ranks meet the full disk at their first metrics line (the launcher's check is skipped
    here, as if the disk had filled after it): each refuses, the launcher says it once, exit 2."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "_check_appendable", lambda path, flag: None)
    os.symlink("/dev/full", tmp_path / "full.jsonl")
    started = time.monotonic()
    assert main(["launch", str(two), "--steps", "2", "--metrics", "full.jsonl"]) == 2
    assert time.monotonic() - started < 300
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err
    [line] = failure_lines(err)
    assert line.startswith("partita: error: no space left on device writing --metrics full.jsonl (rank "), err
    assert "its log: runs/two/logs/rank-" in line  # a device's folder is no run directory
    assert (tmp_path / "runs" / "two" / "logs").is_dir()
