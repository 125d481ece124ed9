"""``partita calibrate RUN_DIR... -o profile.yaml``: fit a device type's time constants to
measured runs (``partita launch``'s run directories) and print the fit.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from partita.cli.output import console, writable_output
from partita.errors import PartitaError
from partita.units import fmt_seconds


def calibrate(args: argparse.Namespace) -> int:
    """Fit the device type's time constants to the runs, write the profile, print the fit."""
    from partita.search.calibrate import calibrate as fit, load_run, predictions

    output = writable_output(args.output, inputs=[Path(r) / name for r in [*args.runs, *args.check]
                                                  for name in ("summary.json", "metrics.jsonl")])
    runs = [load_run(path) for path in args.runs]
    held_out = [load_run(path) for path in args.check]
    devices = {r.device for r in runs}
    for path, run in zip(args.check, held_out):
        if run.device not in devices:
            raise PartitaError(f"--check {path}: a run on {run.device}, the profile is for {', '.join(devices)}; "
                               f"check runs of the same device type")
    command = "partita calibrate " + " ".join(args.runs) + f" -o {args.output}"
    profile, table = fit(runs, command=command)
    profile.save(output)
    cal = profile.calibration
    assert cal is not None
    console.print(_prediction_table(f"calibration of {profile.device} ({profile.dtype}) on {len(runs)} run(s)",
                                    table))
    for name in cal.CONSTANTS + cal.OPTIONAL:
        value = getattr(cal, name)
        if value is None:
            continue  # an optional constant the fit left out
        shown = fmt_seconds(value) if name.endswith("_s") else f"{value:.3g}" + (" GB/s" if name.endswith("_gbps") else "")
        console.print(f"  {name.replace('_', ' ')}: {shown} ({'fitted' if name in cal.fitted else 'default'})")
    for c in profile.comm:
        console.print(f"  {c.op} on {c.ranks} {c.link} ranks: {c.latency_s * 1e6:.0f} us + bytes / {c.bandwidth_gbps:.3g} GB/s")
    console.print(f"median |error| {cal.error:.1%}\nwrote {output}")
    if held_out:
        console.print(_prediction_table("not fitted on: predicted by the new profile",
                                        [(path, *row) for path, run in zip(args.check, held_out)
                                         for row in predictions(run, profile)]))
    return 0


def _prediction_table(title: str, rows) -> Table:
    """(run, observation, predicted s, measured s) rows, with each prediction's error."""
    t = Table(title=title, title_justify="left")
    for col in ("run", "observation", "predicted", "measured", "error"):
        t.add_column(col, justify="left" if col in ("run", "observation") else "right")
    for run, what, predicted, measured in rows:
        t.add_row(run, what, fmt_seconds(predicted), fmt_seconds(measured), f"{(predicted / measured - 1) * 100:+.1f}%")
    return t
