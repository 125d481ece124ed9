"""Price DeepSpeed's published ZeRO-3 runs (the ``ds-azure-*`` rows: its 2022 Azure sweep) with
the engine's ZeRO-3 traffic after the compute it feeds (``Engine.zero3_overlap`` False, what the
deepspeed engine prices) and beside it (True, FSDP's prefetch), and print each row's error, the
seconds its measured step spent beyond the priced compute, and the priced traffic one transfer
after another: the check behind ``zero3_overlap`` (search/engines.py). Then, by GPU count, the
median of the 175B rows' measured seconds against the priced traffic, and a straight line through each
over the ranks (seconds a step a rank, and at no rank): the ring latency's share grows with the
ranks, the bandwidth's does not (docs/calibration.md, "Collectives at scale").

    python benchmarks/zero3_overlap.py
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import published_runs as pr  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    runs = sorted((r for r in pr.load_runs() if r.engine.name == "deepspeed" and r.zero == 3),
                  key=lambda r: (r.model.hidden, r.dp, r.micro_batch))
    print("| run | measured step - priced compute (s) | priced ZeRO traffic, serial (s) "
          "| error after the compute | error beside it |")
    print("| --- | ---: | ---: | ---: | ---: |")
    after, beside, excess = [], [], {}
    for run in runs:
        ev = pr.evaluate_run(run)  # each run priced once a way: its step and its breakdown
        measured_step = run.global_batch * run.seq_len / (pr.measured_tokens_per_s_per_gpu(run) * run.gpus)
        other = dataclasses.replace(run, engine=dataclasses.replace(run.engine, zero3_overlap=True))
        if run.model.hidden == 12288:  # the 175B's rows, at sequence 512 and 1024: the same traffic a step
            excess.setdefault(run.gpus, []).append((measured_step - ev.breakdown['compute'], ev.stages[0].zero_comm_s))
        after.append(100.0 * (measured_step / ev.step_time_s - 1))
        beside.append(100.0 * (measured_step / pr.evaluate_run(other).step_time_s - 1))
        print(f"| {run.id} | {measured_step - ev.breakdown['compute']:.1f} | {ev.stages[0].zero_comm_s:.1f} "
              f"| {after[-1]:+.1f} % | {beside[-1]:+.1f} % |")
    for name, errors in (("after the compute", after), ("beside it", beside)):
        print(f"{name}: {len(errors)} rows, median |error| {statistics.median(abs(e) for e in errors):.1f} %, "
              f"max |error| {max(abs(e) for e in errors):.1f} %")
    print()
    print("175B, sequence 512 and 1024:")
    print("| GPUs | rows | measured step - priced compute, median (s) | priced traffic (s) |")
    print("| ---: | ---: | ---: | ---: |")
    for gpus, points in sorted(excess.items()):
        print(f"| {gpus} | {len(points)} | {statistics.median(m for m, _ in points):.1f} "
              f"| {statistics.median(p for _, p in points):.1f} |")
    for name, pick in (("measured", 0), ("priced", 1)):
        xs = [g for g, points in excess.items() for _ in points]
        ys = [p[pick] for points in excess.values() for p in points]
        slope, intercept = statistics.linear_regression(xs, ys)
        print(f"{name}: {1e3 * slope:.1f} ms a step a rank, {intercept:.1f} s at no rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
