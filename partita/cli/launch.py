"""``partita launch PLAN``: train the plan here (``partita.runtime.launch``, torch), or with
``--emit slurm`` write a batch script that runs it (``partita.cli.slurm``, no torch needed).

After a run on one node the runtime leaves its summary and metrics in the run directory; the
app draws them as one picture there (``runchart.run_figure``, ``RUN_CHART``), so the runtime
never imports the app.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from partita.errors import PartitaError
from partita.plan import Plan


def launch(args: argparse.Namespace) -> int:
    if getattr(args, "emit", None):
        from partita.cli.slurm import emit_command

        return emit_command(args)
    given = [f for f, v in (("-o", getattr(args, "output", None)), ("--partition", getattr(args, "partition", None)),
                            ("--walltime", getattr(args, "walltime", None))) if v is not None]
    if given:
        raise PartitaError(f"{' and '.join(given)} only apply with --emit slurm; add it, or drop them to train here")
    if getattr(args, "elastic", False):
        from partita.cli.elastic import launch_elastic

        return launch_elastic(args, draw_chart=draw_run_chart)
    if getattr(args, "min_ranks", None) is not None:
        raise PartitaError("--min-ranks only applies with --elastic; add it, or drop --min-ranks")
    from partita.runtime.launch import launch_command

    return launch_command(args, draw_chart=draw_run_chart)


def draw_run_chart(plan: Plan, summary: dict, metrics: str, path: Path) -> bool:
    """Draw the run's measured-against-predicted picture (``runchart.run_figure``) from its
    summary and metrics records. The run has trained by now: a picture that cannot be drawn is a
    one-line warning, and False."""
    try:
        from partita.cli.runchart import write_run_chart
        from partita.runtime.launch import plan_cluster
        from partita.runtime.metrics import read_metrics

        write_run_chart(plan, plan_cluster(plan), summary, read_metrics(metrics, summary.get("run_id")), path)
    except Exception as e:  # noqa: BLE001 -- whatever drawing raises, the run stands
        reason = (str(e).strip().splitlines() or [""])[0]
        print(f"partita: warning: no chart of the run ({type(e).__name__}{': ' + reason if reason else ''}); "
              f"{path.with_name('summary.json')} holds its numbers", file=sys.stderr)
        return False
    return True
