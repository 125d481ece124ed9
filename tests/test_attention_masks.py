"""benchmarks/attention_masks.py: its dry run on the CPU times what a GPU session would (each
shape causal, and half its queries against all its keys unmasked, forward and forward +
backward) beside the cost model's price of the same calls, and writes every row; bad arguments
are one usage error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import attention_masks  # noqa: E402
from partita.devices import get_device  # noqa: E402
from partita.search.roofline import attention_time_s  # noqa: E402


def test_the_dry_run_writes_each_shape_measured_and_priced(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "masks.json"
    assert attention_masks.main(["--device", "cpu", "--seq-lens", "64,128", "--heads", "2", "--head-dim", "16",
                                 "--repeats", "1", "--device-type", "H100", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["seq"], r["heads"]) for r in rows] == [(64, 2), (128, 2)]
    for r in rows:
        assert min(r["causal_fwd_s"], r["causal_fwd_bwd_s"], r["half_fwd_s"], r["half_fwd_bwd_s"]) > 0
        assert r["causal_fwd_bwd_s"] > r["causal_fwd_s"]
        assert r["unmasked_speedup"] == pytest.approx(r["causal_fwd_bwd_s"] / r["half_fwd_bwd_s"])
        # the model's columns are the cost model's own calls (fp32 on the CPU run), not a copy
        causal = attention_time_s(get_device("H100"), 1, 2, r["seq"], 16, causal=True, dtype="fp32")
        full = attention_time_s(get_device("H100"), 1, 2, r["seq"], 16, causal=False, dtype="fp32")
        assert r["model_unmasked_speedup"] == pytest.approx(sum(causal) / (sum(full) / 2))
    assert [p.name for p in tmp_path.iterdir()] == ["masks.json"]  # no temporary left behind
    assert "speed-up over causal" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--seq-lens", "0"], ["--seq-lens", "63"], ["--heads", "x"], ["--repeats", "0"],
                                  ["--device-type", "Z100"]])
def test_bad_arguments_are_one_usage_error(argv):
    with pytest.raises(SystemExit) as exit_:
        attention_masks.main(["--device", "cpu", *argv])
    assert exit_.value.code == 2
