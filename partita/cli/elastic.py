"""``partita launch PLAN --elastic --checkpoint-dir D``: when a rank dies, re-plan on the devices
that remain and carry on from the last complete checkpoint.

The run is ``partita launch`` as usual (``partita.runtime.launch.launch_command``). When it fails
because a rank died (a process killed or crashed, a collective timed out: torchrun's first
failure, recorded through ``FAILURE_RECORD``), the launcher

1. takes the failed rank's device out of the cluster (``replan.shrunk_cluster``),
2. re-plans the same model, sequence and global batch on what is left (``replan.replan``: the
   nearest batch the new devices run if they cannot run the old one, said so),
3. writes the new plan into the run directory (``PLAN-replan-K.yaml``), appends one
   ``{"event": "replan", ...}`` record to the metrics and prints one line, and
4. resumes from the newest checkpoint under the new plan (``--resume``: the checkpoint reshards
   on load), training on to ``--steps``.

Steps trained after that checkpoint are trained again (the data order and the learning rate are
functions of the step, so the resumed run follows the same curve); the event says how many.
Fewer devices than ``--min-ranks`` left: one line, exit 3, the checkpoint untouched. A rank that
refused its input (exit 2) or a run interrupted by the user is not re-planned.

Re-planning here covers one node's ranks (CPU ranks, or the GPUs of one machine). A multi-node job
re-plans with ``partita replan`` and relaunches under torchrun's own elastic rendezvous.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable

from partita.cli.output import save_plan
from partita.cli.replan import replan, shrunk_cluster
from partita.errors import InfeasibleError, PartitaError
from partita.plan import Plan

REFUSED = 2  # a rank's exit code when it refused its input: re-planning would not help


def check_elastic(args: argparse.Namespace) -> None:
    if not args.checkpoint_dir:
        raise PartitaError("--elastic resumes from checkpoints after a lost rank: add --checkpoint-dir D "
                           "(and --checkpoint-every K, or a lost rank costs every step since the start)")
    if args.min_ranks is not None and args.min_ranks < 1:
        raise PartitaError(f"--min-ranks must be at least 1, got {args.min_ranks}")
    if getattr(args, "emit", None):
        raise PartitaError("--elastic re-plans a run on this machine; with --emit slurm drop it (a cluster job "
                           "re-plans with `partita replan` and torchrun's elastic rendezvous)")


def launch_elastic(args: argparse.Namespace, draw_chart: Callable | None = None) -> int:
    from partita.runtime import checkpoint
    from partita.runtime.launch import FAILURE_RECORD, failure_line, launch_command, plan_cluster, read_failure
    from partita.runtime.metrics import MetricsWriter

    check_elastic(args)
    args.metrics = args.metrics or str(Path("runs") / Path(args.plan).stem / "metrics.jsonl")
    args.run_id = args.run_id or f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    run_dir = Path(args.metrics).parent
    run_dir.mkdir(parents=True, exist_ok=True)
    record_path = run_dir / "failure.json"
    stem, replans = Path(args.plan).stem, 0
    while True:
        record_path.unlink(missing_ok=True)
        os.environ[FAILURE_RECORD] = str(record_path)
        started = time.monotonic()
        try:
            rc = launch_command(args, draw_chart, report_failure=False)
        finally:
            os.environ.pop(FAILURE_RECORD, None)
        failure = read_failure(record_path) if rc else None
        if failure is None or failure["exitcode"] == REFUSED:
            if failure is not None:
                print(f"partita: error: {failure_line(failure)}", file=sys.stderr)
            return rc
        plan = Plan.load(args.plan)
        lost = sorted(plan.ranks)[failure["rank"]]  # torchrun numbers the plan's ranks from zero
        remaining = plan.world_size - 1
        resumed = checkpoint.latest_step(args.checkpoint_dir) or 0
        reached = _last_step(args.metrics, args.run_id)
        where = f"{args.checkpoint_dir} (step {resumed})" if resumed else f"{args.checkpoint_dir} (no step saved yet)"
        how = f"killed by {failure['signal']}" if failure.get("signal") else f"exit code {failure['exitcode']}"
        died = f"{how}, its log: {failure['log']}" if failure.get("log") else how
        if remaining < (args.min_ranks or 1):
            raise InfeasibleError(f"rank {lost} died ({died}) at step {reached}; {remaining} ranks remain, fewer than "
                                  f"--min-ranks {args.min_ranks or 1}; the checkpoint {where} is intact: "
                                  f"resume it with `partita launch PLAN --resume --checkpoint-dir {args.checkpoint_dir}`")
        cluster = shrunk_cluster(plan_cluster(plan), [lost])
        try:
            result = replan(plan, cluster)
        except InfeasibleError as e:
            raise InfeasibleError(f"rank {lost} died ({died}) at step {reached}; no plan fits the {remaining} ranks left "
                                  f"({' '.join(str(e).split())}); the checkpoint {where} is intact") from None
        replans += 1
        new_path = run_dir / f"{stem}-replan-{replans}.yaml"
        save_plan(result.plan, new_path)
        event = {"event": "replan", "run_id": args.run_id, "old_plan": args.plan, "new_plan": str(new_path),
                 "lost_rank": lost, "exit_code": failure["exitcode"], "old_world_size": plan.world_size,
                 "new_world_size": result.plan.world_size, "old_mesh": plan.mesh.describe(),
                 "new_mesh": result.plan.mesh.describe(), "reached_step": reached, "resumed_from_step": resumed,
                 "lost_steps": max(0, reached - resumed), "global_batch": result.plan.global_batch,
                 "seconds": round(time.monotonic() - started, 3)}
        if result.batch_note:
            event["note"] = result.batch_note
        writer = MetricsWriter(args.metrics)  # one line, one O_APPEND write, as the ranks write theirs
        try:
            writer.write(event)
        finally:
            writer.close()
        print(f"partita: rank {lost} died ({died}) at step {reached}; re-planned for "
              f"{remaining} ranks ({result.plan.mesh.describe()}, {new_path}); resuming from step {resumed}, "
              f"{event['lost_steps']} steps to train again", file=sys.stderr)
        args.plan, args.resume = str(new_path), True
        args.log_dir = str(run_dir / "logs" / f"replan-{replans}")  # the lost rank's log stays where its line said
        args.crash_after_step = args.crash_rank = None  # the tests' fault happens once


def _last_step(metrics: str, run_id: str) -> int:
    from partita.runtime.metrics import read_metrics

    if not Path(metrics).is_file():
        return 0
    steps = [r["step"] for r in read_metrics(metrics, run_id) if isinstance(r.get("step"), int)]
    return max(steps, default=0)
