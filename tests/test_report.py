"""`partita show --timeline / --report`: the pictures hold what the plan says (stages, one box
per action of the schedule, the memory categories), and bad paths are one line, exit 2."""

import dataclasses
import re
import subprocess
import sys

import pytest

from partita.cli import main
from partita.model import ModelSpec
from partita.plan import Plan, StageMemory
from torch_blocker import BLOCK_TORCH

PP, M = 2, 4  # a two-stage pipeline of four micro-batches


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """A 1F1B plan of tiny-llama on 4 CPU ranks, and the same under interleaved 1F1B (two
    virtual stages per rank: virtual stage c of stage i is the (c * pp + i)-th slice)."""
    from partita.search.costs.model import CostModel
    from partita.search.plans import attach_prediction

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
    cluster = p.cluster_spec
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
    from partita.cli.report import timeline
    from partita.runtime.actions import torch_actions
    from partita.search.schedules import simulate

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


# ---- a run's measured-against-predicted chart (`partita launch` draws it from the run files) ----


def figure_svg(fig) -> str:
    """The figure's SVG: text stays text and every bar keeps its id (``partita.report._pyplot``)."""
    import io

    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    return buf.getvalue()


def _record(stage, rank, step, step_s, *, phases=True):
    r = {"run_id": "r", "stage": stage, "rank": rank, "step": step, "step_time_s": step_s}
    if phases:  # two micro-batches; CPU ranks also record the time they waited for a core
        r.update(forward_s=[0.01, 0.01], loss_s=[0.002] if stage == PP - 1 else [], backward_s=[0.02, 0.02],
                 optimizer_s=[0.005], run_delay_s=0.03)
    return r


def _summary(plan, *, memory=False):
    pred = plan.prediction
    out = {"run_id": "r", "steps": 3, "measured_step_time_s": 0.2, "memory_kind": "peak RSS",
           "measured_stage_peak_bytes": [300 << 20] * PP,
           "predicted_stage_peak_bytes": [m.peak_bytes for m in pred.memory] if pred else None}
    if memory:
        held = {"weights": 1 << 18, "gradients": 1 << 18, "optimizer": 1 << 19, "activations": 3 << 20}
        out["memory"] = [{"rank": r, "stage": r // 2, "bytes": held} for r in range(2 * PP)]
        out["predicted_memory"] = [m.category_bytes() for m in pred.memory]
    return out


def test_measured_parts_are_the_median_step_split_by_the_phases_the_ranks_timed():
    from partita.cli.runchart import measured_step_parts

    # Step 1 warms up and is left out; each step is averaged over the stage's two ranks first.
    records = [_record(0, r, s, t) for r in (0, 1) for s, t in ((1, 9.0), (2, 0.2), (3, 0.3))]
    records += [_record(0, 1, 4, 0.5), _record(0, 0, 4, 0.3)]
    (stage,) = measured_step_parts(records, 1, cpu=True)
    assert stage.step_s == pytest.approx(0.3)  # the median of 0.2, 0.3, 0.4
    assert stage.parts["forward"] == pytest.approx(0.02) and stage.parts["backward"] == pytest.approx(0.04)
    assert stage.parts["optimizer"] == pytest.approx(0.005) and stage.parts["waiting for a core"] == pytest.approx(0.03)
    assert sum(stage.parts.values()) == pytest.approx(0.3)  # the rest: what no phase timed
    (gpu,) = measured_step_parts(records, 1, cpu=False)
    assert "waiting for a core" not in gpu.parts  # device time: the host's waits are not its to subtract
    # A stage no rank recorded is None; a run that timed no phases leaves its step unsplit.
    unsplit = [_record(0, 0, s, 0.1, phases=False) for s in (1, 2)]
    assert measured_step_parts(unsplit, 2, cpu=True) == [measured_step_parts(unsplit, 1, cpu=True)[0], None]
    assert measured_step_parts(unsplit, 1, cpu=True)[0].parts == {}


def test_run_chart_holds_every_stage_measured_beside_predicted(plans):
    from partita.cli.runchart import predicted_step_parts, run_figure

    plan = Plan.load(plans["1f1b"])
    cluster = plan.cluster_spec
    predicted = predicted_step_parts(plan, cluster)
    for parts in predicted:  # the timeline's boxes and the idle rest add up to the predicted step
        assert sum(parts.parts.values()) == pytest.approx(plan.prediction.step_time_s, rel=0.02)
        assert parts.parts["forward"] > 0 and parts.parts["backward"] > 0 and parts.parts["optimizer"] > 0
    records = [_record(s, r, step, 0.2) for s in range(PP) for r in (2 * s, 2 * s + 1) for step in (1, 2)]
    svg = figure_svg(run_figure(plan, cluster, _summary(plan, memory=True), records))
    for s in range(PP):
        assert f"stage {s}" in svg and f"cpu, ranks {2 * s}-{2 * s + 1}" in svg
        for part in ("forward", "backward", "optimizer", "waiting for a core", "rest"):
            assert f'id="time-measured-{part}-s{s}"' in svg
        for part in ("forward", "backward", "sends", "gradient sync", "optimizer"):
            assert f'id="time-predicted-{part}-s{s}"' in svg
        assert f'id="peak-measured-s{s}"' in svg and f'id="peak-predicted-s{s}"' in svg
        for c in ("weights", "activations"):
            assert f'id="category-measured-{c}-s{s}"' in svg and f'id="category-predicted-{c}-s{s}"' in svg
        assert f'id="category-predicted-reserve-s{s}"' not in svg  # no tensor, so not on either side
    assert svg.count(">measured<") == svg.count(">predicted<") == 3 * PP  # a pair of bars per stage and panel
    for label in ("forward (with the loss)", "pipeline sends", "idle (pipeline bubble)", "waiting for a core",
                  "measured together", "peak RSS", "predicted peak", "capacity 4.0 GiB", "gathered weights",
                  "reserve (predicted 256.0 MiB) is no tensor", "step time (ms)", "MiB per device", "run r, 3 steps"):
        assert label in svg, label
    assert "not measured" not in svg and "no prediction" not in svg


def test_run_chart_says_what_was_not_measured_or_predicted(plans):
    from partita.cli.runchart import run_figure

    plan = Plan.load(plans["1f1b"])
    cluster = plan.cluster_spec
    # Stage 1 recorded nothing; stage 0 recorded no phases; no memory report.
    records = [_record(0, r, step, 0.2, phases=False) for r in (0, 1) for step in (1, 2)]
    fig = run_figure(plan, cluster, _summary(plan), records)
    assert len(fig.axes) == 2  # no breakdown panel
    svg = figure_svg(fig)
    assert 'id="time-measured-unsplit-s0"' in svg and "step (its parts not recorded)" in svg
    assert 'id="time-measured-absent-s1"' in svg and 'id="time-measured-forward-s0"' not in svg
    assert "by category: not measured (run with --memory-report)" in svg
    # A plan without a prediction: its bars are said to be missing, not drawn as zero.
    bare = dataclasses.replace(plan, prediction=None)
    summary = dict(_summary(plan), predicted_stage_peak_bytes=None)
    svg = figure_svg(run_figure(bare, cluster, summary, records))
    for s in range(PP):
        assert f'id="time-predicted-absent-s{s}"' in svg and f'id="peak-predicted-absent-s{s}"' in svg
        assert f'id="capacity-s{s}"' in svg  # the cluster still knows the device's memory
    assert svg.count("no prediction in the plan") == 2 * PP
