"""`partita show --timeline / --report`: the pictures hold what the plan says (stages, one box
per action of the schedule, the memory categories), and bad paths are one line, exit 2."""

import dataclasses
import re
import subprocess
import sys

import pytest

from partita.cli import main
from partita.cluster import ClusterSpec
from partita.model import ModelSpec
from partita.plan import Plan, StageMemory
from torch_blocker import BLOCK_TORCH

PP, M = 2, 4  # a two-stage pipeline of four micro-batches


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """A 1F1B plan of tiny-llama on 4 CPU ranks, and the same under interleaved 1F1B (two
    virtual stages per rank: virtual stage c of stage i is the (c * pp + i)-th slice)."""
    from partita.search.costs import CostModel
    from partita.search.planner import attach_prediction

    d = tmp_path_factory.mktemp("plans")
    one = d / "1f1b.yaml"
    assert main(["plan", "--model", "tiny-llama", "--cluster", "4xcpu", "--pp", str(PP), "--global-batch", str(2 * M),
                 "--micro-batch", "1", "--search", "uniform", "-o", str(one)]) == 0
    p = Plan.load(one)
    assert (p.pp, p.num_micro_batches, p.schedule) == (PP, M, "1f1b")
    layers = p.layer_strategies()  # embed, 6 blocks, head: slices of 2 + 2 + 2 + 2 layers
    slices = [layers[k * 2:(k + 1) * 2] for k in range(4)]
    stages = tuple(dataclasses.replace(s, layers=tuple(slices[s.index] + slices[PP + s.index]), chunks=(2, 2))
                   for s in p.stages)
    inter = dataclasses.replace(p, stages=stages, schedule="interleaved-1f1b")
    cluster = ClusterSpec.from_dict(p.cluster)
    cm = CostModel(ModelSpec.from_dict(p.model, where="model"), cluster, seq_len=p.seq_len, dtype=p.dtype)
    attach_prediction(inter, cm).save(d / "interleaved.yaml")
    return {"1f1b": one, "interleaved": d / "interleaved.yaml"}


def _ids(svg: str, kind: str) -> list[str]:
    return re.findall(rf'id="{kind}-r\d+-s\d+-mb\d+"', svg)


@pytest.mark.parametrize("which,v", [("1f1b", 1), ("interleaved", 2)])
def test_timeline_has_a_box_per_action_and_every_stage(plans, tmp_path, which, v):
    out = tmp_path / "t.svg"
    assert main(["show", str(plans[which]), "--timeline", str(out)]) == 0
    svg = out.read_text()
    assert len(_ids(svg, "F")) == len(_ids(svg, "B")) == PP * v * M  # every micro-batch through every (virtual) stage
    assert len(set(_ids(svg, "F"))) == PP * v * M
    assert len(re.findall(r'id="sync-r\d+', svg)) == PP  # each rank ends with its gradient sync and optimizer
    for i in range(PP):
        assert f"stage {i}" in svg
    assert "forward" in svg and "backward" in svg and "idle" in svg and "predicted step" in svg
    assert ("interleaved-1f1b (2 virtual stages per rank)" in svg) == (v == 2)
    # Virtual stage c of rank r is torch's stage c * pp + r.
    assert {int(s) for s in re.findall(r'id="F-r1-s(\d+)-', svg)} == {1 + c * PP for c in range(v)}


def test_timeline_png(plans, tmp_path):
    out = tmp_path / "t.png"
    assert main(["show", str(plans["1f1b"]), "--timeline", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG")


def test_timeline_plays_the_schedule():
    """The boxes follow the schedule's dependencies and end where schedules.simulate ends."""
    from partita.report import timeline
    from partita.search.schedules import simulate, torch_actions

    acts = torch_actions("1f1b", 3, 1, 5)
    f, b = [1.0, 2.0, 1.5], [2.0, 3.0, 2.5]
    boxes = timeline(acts, f, b, [0.0, 0.0, 0.0])
    assert max(x.end_s for x in boxes) == pytest.approx(simulate(acts, f, b).makespan_s)
    end = {(x.kind, x.stage, x.micro_batch): x.end_s for x in boxes}
    start = {(x.kind, x.stage, x.micro_batch): x.start_s for x in boxes}
    for s in (1, 2):
        for mb in range(5):
            assert start[("F", s, mb)] >= end[("F", s - 1, mb)]
            assert start[("B", s - 1, mb)] >= end[("B", s, mb)]
    with_sends = timeline(acts, f, b, [0.25, 0.25, 0.0])
    sends = [x for x in with_sends if x.kind == "send"]
    assert len(sends) == 2 * 2 * 5  # two boundaries, both ways
    # A send holds its sender: the rank's next action starts after it.
    for x in sends:
        later = [y.start_s for y in with_sends if y.rank == x.rank and y.kind != "send" and y.start_s >= x.start_s]
        assert not later or min(later) >= x.end_s - 1e-12
    assert max(x.end_s for x in with_sends) >= simulate(acts, f, b, send_s=0.25).makespan_s


def test_report_is_one_file_with_the_plan_the_bars_and_the_pictures(plans, tmp_path):
    out = tmp_path / "r.html"
    assert main(["show", str(plans["interleaved"]), "--report", str(out)]) == 0
    page = out.read_text()
    p = Plan.load(plans["interleaved"])
    assert page.count("<svg") == 2 and "data:image/png;base64," in page  # timeline, memory; the placement
    assert "src=\"http" not in page and "<link" not in page  # nothing to fetch
    assert p.model["name"] in page and "4xcpu" in page and "interleaved-1f1b" in page and "MFU" in page
    for i in range(PP):
        assert f"stage {i}" in page
    used = [c for c in StageMemory.CATEGORIES if any(m.category_bytes()[c] for m in p.prediction.memory)]
    assert "weights" in used and "activations" in used
    for c in used:
        assert c.replace("_", " ") in page  # in the bars' legend
        assert len(re.findall(rf'id="mem-{c}-s\d+"', page)) == PP  # a bar segment per stage
    assert "capacity" in page
    assert len(_ids(page, "F")) == PP * 2 * M
    for s in p.stages:  # the placement table: which group's ranks each stage runs on
        assert f"<td>stage {s.index}</td><td>{s.group}</td>" in page


@pytest.mark.parametrize("flag,name,needle", [
    ("--timeline", "t.jpg", "unknown file type '.jpg'; name it with .svg or .png"),
    ("--timeline", "t", "unknown file type '(none)'"),
    ("--report", "r.pdf", "name it with .html or .htm"),
    ("--timeline", "missing/t.svg", "no such directory"),
    ("--report", "{d}", "unknown file type"),
    ("--report", "folder.html", "is a directory"),
])
def test_bad_picture_paths_are_one_line_and_exit_2(plans, tmp_path, capsys, flag, name, needle):
    (tmp_path / "folder.html").mkdir()
    capsys.readouterr()
    target = name.replace("{d}", str(tmp_path)) if name == "{d}" else str(tmp_path / name)
    assert main(["show", str(plans["1f1b"]), flag, target]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and captured.err.startswith(f"partita: error: {flag} ")
    assert len(captured.err.strip().splitlines()) == 1 and captured.out == ""  # refused before the plan is shown


def test_without_torch_1f1b_draws_and_interleaved_says_why(plans, tmp_path):
    def run(plan, out):
        argv = ["show", str(plan), "--timeline", str(out)]
        program = BLOCK_TORCH + f"from partita.cli import main\nsys.exit(main({argv!r}))\n"
        return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)

    r = run(plans["1f1b"], tmp_path / "a.svg")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "a.svg").exists()
    r = run(plans["interleaved"], tmp_path / "b.svg")
    assert r.returncode == 2 and "torch is not installed" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "b.svg").exists()
