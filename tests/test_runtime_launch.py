"""`partita launch`: refusals before any rank starts, multi-node commands, a real torchrun run,
the worker's shutdown, an interrupted run, and kill-and-resume through torch.distributed.checkpoint."""

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

from partita.errors import PartitaError  # noqa: E402
from partita.runtime.data import TokenSource  # noqa: E402
from partita.runtime import checkpoint  # noqa: E402
from partita.runtime.launch import RUN_CHART  # noqa: E402
from partita.runtime.launch import add_launch_arguments, check_launch, launch_command  # noqa: E402
from partita.runtime.metrics import RunSummary, read_metrics  # noqa: E402
from partita.runtime.train import TrainConfig, lr_at  # noqa: E402
from partita.model import BUILTIN  # noqa: E402
from runtime_helpers import free_port, make_plan, run_parallel, run_reference  # noqa: E402


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    return parser.parse_args([str(a) for a in argv])


def saved(plan, tmp_path, name="plan.yaml"):
    path = tmp_path / name
    plan.save(path)
    return path


# ---- refusals: one clear line, before anything starts -------------------------------------------


def test_world_size_mismatch_is_refused(tmp_path):
    path = saved(make_plan(dp=2, tp=2), tmp_path)
    with pytest.raises(PartitaError, match=r"world size 4 .*--nproc is 3"):
        launch_command(parse(path, "--nproc", 3))


def test_fingerprint_mismatch_is_refused(tmp_path):
    plan = dataclasses.replace(make_plan(dp=2), model_fingerprint="0123456789ab")
    with pytest.raises(PartitaError, match="fingerprint"):
        launch_command(parse(saved(plan, tmp_path)))


def test_other_model_or_cluster_is_refused(tmp_path):
    path = saved(make_plan(dp=2), tmp_path)
    with pytest.raises(PartitaError, match="fingerprint"):
        launch_command(parse(path, "--model", "tiny-gpt2"))
    with pytest.raises(PartitaError, match="fingerprint"):
        launch_command(parse(path, "--cluster", "8xcpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_gpu_plan_on_a_machine_without_gpus_is_refused(tmp_path):
    path = saved(make_plan(dp=2, cluster="2xH100", dtype="bf16"), tmp_path)
    with pytest.raises(PartitaError, match="runs on H100 but this machine has no CUDA device"):
        launch_command(parse(path))


def test_tied_embeddings_split_differently_are_refused(tmp_path):
    path = saved(make_plan("tiny-gpt2", pp=2, dp=2, per_layer={"embed": dict(zero=1), "head": dict(zero=3)}), tmp_path)
    with pytest.raises(PartitaError, match="ties its embedding and head weights: they need the same"):
        launch_command(parse(path))


def test_resume_needs_a_checkpoint_dir(tmp_path):
    with pytest.raises(PartitaError, match="--resume needs --checkpoint-dir"):
        launch_command(parse(saved(make_plan(dp=2), tmp_path), "--resume"))


def test_the_same_hardware_listed_in_another_order_launches(tmp_path):
    """Like `partita check`: --cluster may list the plan's node groups in another order; the
    plan's own cluster numbers the ranks. Other hardware is still refused."""
    plan = make_plan(dp=2, cluster="2xcpu+4xcpu")
    path = saved(plan, tmp_path)
    cluster, warnings = check_launch(plan, parse(path, "--cluster", "4xcpu+2xcpu"))
    assert cluster.fingerprint == plan.cluster_fingerprint and warnings == []
    with pytest.raises(PartitaError, match="6 vs 8 cpu"):
        check_launch(plan, parse(path, "--cluster", "4xcpu+4xcpu"))


def test_several_nodes_print_one_torchrun_command_per_node(tmp_path, capsys):
    path = saved(make_plan(dp=2, tp=2, cluster="2x2xcpu"), tmp_path)
    assert launch_command(parse(path, "--steps", 5, "--master-addr", "node0")) == 0
    out = capsys.readouterr().out
    commands = [l for l in out.splitlines() if l.startswith("torchrun")]
    assert len(commands) == 2
    for node, command in enumerate(commands):
        assert f"--node-rank={node}" in command and "--nnodes=2" in command and "--nproc-per-node=2" in command
        assert "--rdzv-backend=static" in command and "--master-addr=node0" in command
        assert "-m partita.runtime.worker" in command and "--steps 5" in command
    run_ids = {c.split("--run-id ")[1].split()[0] for c in commands}
    assert len(run_ids) == 1  # every node's ranks tag their records alike


# ---- pieces -------------------------------------------------------------------------------------


def test_learning_rate_warms_up_then_decays():
    cfg = TrainConfig(steps=10, warmup_steps=2, lr=1.0, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(10)]
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)
    assert lrs[2] == pytest.approx(1.0) and all(a > b for a, b in zip(lrs[2:], lrs[3:]))
    assert lrs[-1] == pytest.approx(0.1)


def test_text_data_is_bytes_and_reproducible(tmp_path):
    text = tmp_path / "input.txt"
    text.write_text("hello partita " * 50)
    source = TokenSource(str(text), vocab=256, seq_len=16, global_batch=4, seed=1)
    x, y = source.batch(3)
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert bytes(x[0].tolist()).decode() in "hello partita " * 50
    assert torch.equal(source.batch(3)[0], x) and not torch.equal(source.batch(4)[0], x)
    with pytest.raises(PartitaError, match="at least 256"):
        TokenSource(str(text), vocab=128, seq_len=16, global_batch=4, seed=1)


def test_metrics_of_one_run_are_read_apart_from_others(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"run_id": run, "step": 1, "rank": r}) + "\n" for run in ("a", "b") for r in (0, 1)))
    assert [(r["run_id"], r["rank"]) for r in read_metrics(path, "b")] == [("b", 0), ("b", 1)]
    assert len(read_metrics(path)) == 4


def test_worker_filters_exactly_the_known_torch_warnings():
    import logging
    import warnings

    from partita.runtime.worker import _norm_partial_redistribute, quiet_known_warnings
    from torch.distributed.tensor import Replicate, Shard

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings()
        warnings.warn("FSDP2-wrapped module (FSDPEmbed) returned a view tensor. An in-place op ...", UserWarning)
        warnings.warn("FSDP2-wrapped module (FSDPEmbed) did something else", UserWarning)
    assert [str(w.message) for w in caught] == ["FSDP2-wrapped module (FSDPEmbed) did something else"]
    try:
        from torch.distributed.tensor._ops._math_ops import _NormPartial
    except ImportError:
        pytest.skip("this torch has no _NormPartial")
    msg = "While redistributing from %s to %s, %d sequential %s operations will be performed. %s"

    def record(src):
        return logging.LogRecord("torch.distributed.tensor._redistribute", logging.WARNING, "", 0, msg,
                                 (src, (Replicate(), Replicate()), 2, "all_reduce", ""), None)

    assert not _norm_partial_redistribute(record((_NormPartial(2.0), _NormPartial(2.0))))
    assert _norm_partial_redistribute(record((Shard(0), Shard(0))))


def test_summary_table_reports_error_in_percent():
    summary = RunSummary(steps=3, measured_step_time_s=0.11, predicted_step_time_s=0.1,
                         measured_stage_peak_bytes=[2 << 30], predicted_stage_peak_bytes=[1 << 30],
                         memory_kind="allocated", losses=[1.0, 0.9, 0.8])
    table = summary.table()
    assert "+10.0%" in table and "+100.0%" in table and "110.0 ms" in table


# ---- real runs ----------------------------------------------------------------------------------


def test_launch_runs_ranks_under_torchrun(tmp_path, capfd):
    """dp 2 x tp 2 with FSDP and sequence parallelism: the 2-D mesh whose runs printed torch's
    view-tensor and sequential-all-reduce warnings from every rank. Two runs append to one
    metrics file; each run's records carry its own run id."""
    plan = make_plan(dp=2, tp=2, layer=dict(zero=3, tensor_parallel=2, sequence_parallel=True))
    path = saved(plan, tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    assert launch_command(parse(path, "--steps", 2, "--metrics", metrics)) == 0
    out, err = capfd.readouterr()
    summary = json.loads((tmp_path / "summary.json").read_text())
    records = read_metrics(metrics, summary["run_id"])
    assert sorted((r["rank"], r["step"]) for r in records) == [(r, s) for r in range(4) for s in (1, 2)]
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0 for r in records)
    assert "step time" in out and "stage 0 peak memory" in out and summary["run_id"] in out
    assert summary["steps"] == 2 and len(summary["measured_stage_peak_bytes"]) == 1
    assert "Warning" not in err and "sequential all_reduce" not in err and "Traceback" not in err, err
    assert launch_command(parse(path, "--steps", 1, "--metrics", metrics, "--run-id", "again")) == 0
    assert [(r["run_id"], r["step"]) for r in read_metrics(metrics, "again")] == [("again", 1)] * 4
    assert len(read_metrics(metrics)) == 12


def test_launch_draws_the_run_measured_against_predicted_per_stage(tmp_path, capfd, monkeypatch):
    """The laptop loop, `partita plan` then `partita launch --memory-report`: the run directory
    gets the chart and the printed summary names it. The figure is read as it was drawn: every
    stage with its measured and predicted bars, the step's parts, peak memory, the categories."""
    import io

    import partita.cli.runchart as report
    from partita.cli import main
    from partita.plan import Plan

    drawn = []
    draw = report.run_figure
    monkeypatch.setattr(report, "run_figure", lambda *a, **k: drawn.append(draw(*a, **k)) or drawn[-1])
    plan = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "tiny-llama", "--cluster", "4xcpu", "--pp", "2", "-o", str(plan)]) == 0
    pp = Plan.load(plan).pp
    capfd.readouterr()
    run = tmp_path / "run"
    assert main(["launch", str(plan), "--steps", "2", "--memory-report", "--metrics", str(run / "metrics.jsonl")]) == 0
    out, err = capfd.readouterr()
    chart = run / RUN_CHART
    assert chart.read_bytes().startswith(b"\x89PNG")
    assert f"measured against predicted, per stage: {chart}" in out and "warning" not in err
    (fig,) = drawn
    assert len(fig.axes) == 3  # step time, peak memory, memory by category
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    svg = buf.getvalue()
    for s in range(pp):
        assert f"stage {s}" in svg
        for part in ("forward", "backward", "optimizer"):
            assert f'id="time-measured-{part}-s{s}"' in svg and f'id="time-predicted-{part}-s{s}"' in svg
        assert f'id="peak-measured-s{s}"' in svg and f'id="peak-predicted-s{s}"' in svg
        for c in ("weights", "optimizer", "activations"):
            assert f'id="category-measured-{c}-s{s}"' in svg and f'id="category-predicted-{c}-s{s}"' in svg
    assert svg.count(">measured<") == svg.count(">predicted<") == 3 * pp
    summary = json.loads((run / "summary.json").read_text())
    for label in (summary["run_id"], "forward (with the loss)", "waiting for a core", "idle (pipeline bubble)",
                  "peak RSS", "capacity", "gathered weights", "step time"):
        assert label in svg, label
    assert "not measured" not in svg and "no prediction" not in svg


def test_a_chart_that_cannot_be_drawn_is_one_warning(tmp_path, capsys, monkeypatch):
    """The run has trained by then: drawing that fails says so in one line and the launch goes on."""
    import partita.cli.runchart as report
    from partita.cli.launch import draw_run_chart

    def broken(*args, **kwargs):
        raise RuntimeError("no backend\nand more")

    monkeypatch.setattr(report, "write_run_chart", broken)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("")
    assert not draw_run_chart(make_plan(dp=2), {"run_id": "x"}, str(metrics), tmp_path / RUN_CHART)
    err = capsys.readouterr().err
    assert err.startswith("partita: warning: no chart of the run (RuntimeError: no backend)")
    assert len(err.splitlines()) == 1 and str(tmp_path / "summary.json") in err


def _metrics_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(int(pid))
        except OSError:  # it ended while being read
            pass
    return found


@pytest.mark.skipif(not Path("/proc/self/cmdline").is_file(), reason="finds the ranks through /proc")
def test_ctrl_c_stops_every_rank_with_one_line(tmp_path):
    """Ctrl-C (SIGINT to the launcher's process group) once a rank has trained a step: exit 130,
    the launcher's one line, no traceback from torchrun or any rank, and no rank left running.
    The signal is sent once the metrics file has a line, whenever that is; the run is far too
    long to end by itself first."""
    plan = make_plan(dp=2, layer=dict(zero=2))
    path = saved(plan, tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    launcher = subprocess.Popen([sys.executable, "-m", "partita.cli", "launch", str(path), "--steps", "1000000",
                                 "--metrics", str(metrics)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # a guard against a hang, not part of the check
        while _metrics_lines(metrics) == 0 and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert launcher.poll() is None, launcher.communicate()
        os.killpg(launcher.pid, signal.SIGINT)
        out, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 130, err
    assert "Traceback" not in out + err, err
    assert err.strip().splitlines()[-1] == "partita: interrupted", err
    assert [l for l in err.splitlines() if not l.startswith("[rank 0] step ")] == ["partita: interrupted"], err
    assert _processes_mentioning(str(metrics)) == []


def _thread_names() -> list[str]:
    tasks = Path("/proc/self/task")
    return sorted((tasks / t / "comm").read_text().strip() for t in os.listdir(tasks))


def _worker_rank(rank: int, world: int, port: int, plan_path: str, out_dir: str) -> None:
    from partita.runtime import worker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    before = _thread_names()
    code = worker.main([plan_path, "--steps", "1", "--metrics", str(Path(out_dir) / "metrics.jsonl")])
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"code": code, "before": before,
                                                                 "after": _thread_names()}))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists the process's threads through /proc")
def test_worker_destroys_its_process_groups_before_python_exits(tmp_path):
    """A gloo group's threads stop only when the group is destroyed; one still running while
    Python finalizes can abort the finished run (SIGABRT, 'terminate called without an active
    exception'). The worker must leave only the threads it started with, whatever the timing:
    FSDP (DTensors, hence torch's mesh caches) and a pipeline stage's group on four ranks."""
    plan = make_plan(pp=2, dp=2, boundaries=[3], num_micro_batches=2, layer=dict(zero=2))
    path = saved(plan, tmp_path)
    mp.start_processes(_worker_rank, args=(plan.world_size, free_port(), str(path), str(tmp_path)),
                       nprocs=plan.world_size, join=True, start_method="fork")
    run_ids = {r["run_id"] for r in read_metrics(tmp_path / "metrics.jsonl")}
    assert len(run_ids) == 1 and None not in run_ids  # started without --run-id: rank 0 names the run
    for rank in range(plan.world_size):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["code"] == 0
        assert [n for n in report["after"] if "gloo" in n] == [], f"rank {rank}: {report['after']}"
        assert len(report["after"]) == len(report["before"]), f"rank {rank}: {report['before']} -> {report['after']}"


def test_sequence_parallel_needs_an_even_split(tmp_path):
    plan = make_plan(tp=2, seq_len=15, layer=dict(tensor_parallel=2, sequence_parallel=True))
    with pytest.raises(PartitaError, match="seq_len 15 is not divisible by tp 2"):
        launch_command(parse(saved(plan, tmp_path)))


def test_kill_and_resume_reproduces_the_uninterrupted_losses(tmp_path):
    plan = make_plan(pp=2, dp=2, boundaries=[2], num_micro_batches=2,
                     per_layer={"layers.1": dict(zero=3), "layers.4": dict(zero=1), "head": dict(zero=2)})
    whole = TrainConfig(steps=4, warmup_steps=1)
    losses, params = run_parallel(plan, whole)
    ckpt = str(tmp_path / "ckpt")
    killed = dataclasses.replace(whole, checkpoint_dir=ckpt, checkpoint_every=2, crash_after_step=3)
    with pytest.raises(mp.ProcessExitedException):
        run_parallel(plan, killed)
    resumed = dataclasses.replace(whole, checkpoint_dir=ckpt, checkpoint_every=2, resume=True)
    tail, resumed_params = run_parallel(plan, resumed)
    assert len(tail) == 2  # steps 3 and 4, from the checkpoint after step 2
    assert tail == pytest.approx(losses[2:], rel=1e-6)
    for name, p in params.items():
        torch.testing.assert_close(resumed_params[name], p, rtol=1e-6, atol=1e-7)
    record = checkpoint.read_record(ckpt, 4)
    assert (record.model_fingerprint, record.step, record.steps, record.warmup_steps) == (plan.model_fingerprint, 4, 4, 1)


def test_resume_is_checked_against_the_checkpoint_before_any_rank_starts(tmp_path):
    """The checkpoint's record says which model and schedule it holds: another model is refused,
    as is --steps at or below its step; a changed schedule or data is named in a warning."""
    plan = make_plan(dp=2)
    ckpt = tmp_path / "ckpt"
    run_parallel(plan, TrainConfig(steps=2, warmup_steps=1, checkpoint_dir=str(ckpt)))
    path = saved(plan, tmp_path)
    resume = ("--resume", "--checkpoint-dir", ckpt, "--warmup-steps", 1)
    with pytest.raises(PartitaError, match="holds model 'tiny-llama'.*the plan trains 'tiny-gpt2'"):
        launch_command(parse(saved(make_plan("tiny-gpt2", dp=2), tmp_path, "gpt2.yaml"), *resume))
    with pytest.raises(PartitaError, match="already trained 2 steps and --steps is 2; give --steps above 2"):
        launch_command(parse(path, *resume, "--steps", 2))
    with pytest.raises(PartitaError, match="already holds a checkpoint .*add --resume"):
        launch_command(parse(path, "--checkpoint-dir", ckpt))
    _, warnings = check_launch(plan, parse(path, *resume, "--steps", 4))
    assert len(warnings) == 1 and "--steps 2 -> 4" in warnings[0] and "learning rate from step 3" in warnings[0]
    _, warnings = check_launch(plan, parse(path, *resume, "--steps", 4, "--lr", 2e-3, "--seed", 1))
    assert "--lr 0.001 -> 0.002" in warnings[0] and "--seed 0 -> 1" in warnings[1]
    _, warnings = check_launch(plan, parse(path, "--resume", "--checkpoint-dir", tmp_path / "empty"))
    assert warnings == [f"--resume: no checkpoint in {tmp_path / 'empty'} yet; starting from step 0"]


def test_each_replica_gets_its_block_of_the_global_batch():
    source = TokenSource("synthetic", vocab=256, seq_len=8, global_batch=6, seed=0)
    whole, _ = source.batch(5)
    parts = [source.batch(5, dp=3, dp_index=d)[0] for d in range(3)]
    assert torch.equal(torch.cat(parts), whole)


def test_resume_under_another_plan_reshards_the_checkpoint(tmp_path):
    """torch.distributed.checkpoint reshards: a run saved as dp 2 x ZeRO-3 with recomputation
    continues as pp 2 x tp 2 with sequence parallelism (same global batch), on the same losses."""
    small = dataclasses.replace(BUILTIN["tiny-llama"], name="tiny-llama-4", n_layers=4)
    saved_as = make_plan(small, dp=2, layer=dict(zero=3, recompute="full"))
    resumed_as = make_plan(small, pp=2, tp=2, boundaries=[1], num_micro_batches=4,
                           layer=dict(tensor_parallel=2, sequence_parallel=True))
    assert saved_as.global_batch == resumed_as.global_batch
    whole = TrainConfig(steps=4, warmup_steps=1)
    reference, _ = run_reference(saved_as, whole)
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(mp.ProcessExitedException):
        run_parallel(saved_as, dataclasses.replace(whole, checkpoint_dir=ckpt, checkpoint_every=2, crash_after_step=2))
    _, warnings = check_launch(resumed_as, parse(saved(resumed_as, tmp_path), "--steps", 4, "--warmup-steps", 1,
                                                  "--checkpoint-dir", ckpt, "--resume"))
    assert warnings == []  # another plan of the same model, the same schedule: nothing to say
    tail, _ = run_parallel(resumed_as, dataclasses.replace(whole, checkpoint_dir=ckpt, resume=True))
    assert tail == pytest.approx(reference[2:], rel=1e-5)


def test_a_plan_on_part_of_a_cluster_launches(tmp_path):
    """The search may leave node groups idle: a plan on the second group alone (ranks 2 and 3)
    runs with torchrun ranks 0 and 1."""
    from partita.cluster import parse_short
    from partita.model_io import load_model
    from partita.plan import LayerStrategy
    from partita.search.costs.model import CostModel
    from partita.search.plans import layout_to_plan
    from partita.search.uniform import Layout

    model, cluster = load_model("tiny-llama"), parse_short("2xcpu+2xcpu")
    cm = CostModel(model, cluster, seq_len=16)
    layout = Layout(stage_groups=(cluster.groups[1],),
                    stage_layers=(tuple(LayerStrategy(name=n) for n in model.layer_names()),),
                    dp=2, tp=1, micro_batch=2, num_micro_batches=1)
    plan = layout_to_plan(cm, layout, global_batch=4, solver=None)
    assert plan.ranks == [2, 3]
    metrics = tmp_path / "metrics.jsonl"
    assert launch_command(parse(saved(plan, tmp_path), "--steps", 1, "--metrics", metrics)) == 0
    assert sorted(json.loads(l)["rank"] for l in metrics.read_text().splitlines()) == [0, 1]
