"""benchmarks/profile_gpu.py's summary: the measured decoder blocks against the planner's analytic
default, the figure issue 23 (item 5) is judged on. Checked on a CPU profile of tiny-llama."""

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import profile_gpu  # noqa: E402

from partita.cli.profile import main as profile_main  # noqa: E402
from partita.cluster import parse_short  # noqa: E402
from partita.model_io import load_model  # noqa: E402
from partita.profile import Profile  # noqa: E402
from partita.search.costs.model import CostModel  # noqa: E402


def test_decoder_blocks_are_compared_with_what_the_planner_prices_them_at(tmp_path):
    out = tmp_path / "cpu-tiny-llama.yaml"
    assert profile_main(["--model", "tiny-llama", "--device", "cpu", "--tp", "1,2", "--micro-batches", "1,2",
                         "--repeats", "3", "-o", str(out)]) == 0
    prof = Profile.load(out)
    blocks = [p for p in prof.layers if p.kind.role == "block"]
    assert len(blocks) == 4
    errors = profile_gpu.planner_block_errors("tiny-llama", prof)
    assert set(errors) == {"plain", "recompute"}
    cm = CostModel(load_model("tiny-llama"), parse_short("1x1xcpu"), seq_len=blocks[0].seq_len, dtype=prof.dtype)
    expected = {"plain": [], "recompute": []}
    for p in blocks:
        priced = cm.compute("block", "cpu", p.tp, p.micro_batch)
        plain = priced.forward_s + priced.backward_s
        expected["plain"].append(100 * (plain / (p.forward_s + p.backward_s) - 1))
        expected["recompute"].append(100 * ((plain + priced.recompute_s)
                                            / (p.forward_s + p.backward_s + p.recompute_s) - 1))
    for key, values in expected.items():
        n, median, worst = errors[key]
        assert n == 4
        assert median == pytest.approx(statistics.median(abs(v) for v in values))
        assert worst in values and abs(worst) == max(abs(v) for v in values)
