"""benchmarks/sustained_gemm.py: its dry run on the CPU writes what a GPU session would (the
burst, the windows, the steady rate and their ratio), whole; bad arguments are one usage error."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sustained_gemm  # noqa: E402


def test_the_dry_run_writes_the_burst_the_windows_and_what_is_kept(tmp_path, capsys):
    out = tmp_path / "sustained.json"
    assert sustained_gemm.main(["--device", "cpu", "--seconds", "0.3", "--window", "0.1",
                                "--shape", "64", "64", "64", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["shape"] == [64, 64, 64] and data["device"] == "cpu"
    assert len(data["window_tflops"]) >= 2 and all(w > 0 for w in data["window_tflops"])
    windows = data["window_tflops"]
    assert data["steady_tflops"] == pytest.approx(statistics.median(windows[len(windows) // 2:]))
    assert data["kept"] == pytest.approx(data["steady_tflops"] / data["burst_tflops"])
    assert [p.name for p in tmp_path.iterdir()] == ["sustained.json"]  # no temporary left behind
    assert "of the burst" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--seconds", "0"], ["--window", "5", "--seconds", "1"], ["--shape", "0", "8", "8"]])
def test_bad_arguments_are_one_usage_error(argv):
    with pytest.raises(SystemExit) as exit_:
        sustained_gemm.main(["--device", "cpu", *argv])
    assert exit_.value.code == 2
