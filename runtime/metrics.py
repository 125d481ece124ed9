"""Per-step metrics (``metrics.jsonl``, one JSON object a line, every rank) and the end-of-run
comparison of measured against predicted step time and per-stage peak memory.

Peak memory is ``torch.cuda.max_memory_allocated`` on GPUs; on CPUs it is the process's peak
resident set size, which includes the Python and torch runtime and so reads far above any
prediction of tensor memory. ``--memory-report`` measures one step's tensors by category with
torch's memory trackers (``partita.runtime.memory``), on CPU and GPU alike, and prints them
against the plan's breakdown (``memory_table``).

Every record carries the run's ``run_id`` (chosen by ``partita launch``, shared by all ranks), so
runs that append to one ``metrics.jsonl`` stay apart: ``read_metrics(path, run_id)`` reads one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from partita import fileio
from partita.devices import get_device
from partita.plan import Plan
from partita.units import fmt_bytes


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def peak_flops(plan: Plan) -> float:
    """Summed dense peak FLOP/s of every rank the plan uses, in the plan's dtype."""
    cluster = plan.cluster_spec
    return sum(get_device(cluster.group(name).device).peak_tflops(plan.dtype) * 1e12
               for _, name in plan.rank_groups())


def read_metrics(path: str | Path, run_id: str | None = None) -> list[dict[str, Any]]:
    """The records of ``path``, only the run ``run_id``'s when it is given."""
    records = fileio.load_jsonl(path)
    return [r for r in records if isinstance(r, dict) and (run_id is None or r.get("run_id") == run_id)]


class MetricsWriter:
    """Appends one line per step; each line is a single ``write`` on an O_APPEND descriptor, so
    ranks sharing one file do not interleave within a line."""

    def __init__(self, path: str | Path | None) -> None:
        self.fd, self.path = None, path
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        """A full disk is one line (``no space left on device writing PATH``), not a traceback;
        every rank appends to the one file, so all of them meet it at the same step."""
        if self.fd is not None:
            try:
                os.write(self.fd, (json.dumps(record, sort_keys=True) + "\n").encode())
            except OSError as e:
                raise fileio.write_error(f"--metrics {self.path}", e) from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass(frozen=True)
class RunSummary:
    """What rank 0 gathers at the end: measured against the plan's prediction."""

    steps: int
    measured_step_time_s: float  # median over the steps after the first (warm-up) one
    predicted_step_time_s: float | None
    measured_stage_peak_bytes: list[int]  # max over the stage's ranks
    predicted_stage_peak_bytes: list[int | None] | None
    memory_kind: str  # "allocated" (GPU) or "peak RSS" (CPU)
    losses: list[float]
    measured_tokens_per_s: float | None = None  # at the median step time
    predicted_tokens_per_s: float | None = None
    measured_mfu: float | None = None
    predicted_mfu: float | None = None
    # --memory-report: each rank's tracked bytes by category at one step's peak
    # ({"rank", "stage", "bytes": {category: bytes}}), and the plan's per-stage breakdown
    memory: list[dict[str, Any]] | None = None
    predicted_memory: list[dict[str, int]] | None = None
    run_id: str | None = None  # the run_id of this run's metrics records
    # For `partita calibrate`: the plan that ran, and rank 0's timings of its collectives at its
    # message sizes (``partita.runtime.commprobe``: op, link, ranks, message_bytes, seconds).
    plan: dict[str, Any] | None = None
    collectives: list[dict[str, Any]] | None = None
    op_overhead_s: float | None = None  # rank 0's host time per eager op (commprobe.probe_op_overhead)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunSummary":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def table(self) -> str:
        """Measured against predicted, with the error in percent of the prediction."""
        rows = [("step time", _seconds(self.measured_step_time_s),
                 _seconds(self.predicted_step_time_s), _error(self.measured_step_time_s, self.predicted_step_time_s))]
        if self.measured_tokens_per_s is not None:
            rows.append(("tokens/s", f"{self.measured_tokens_per_s:,.0f}", _maybe(self.predicted_tokens_per_s, "{:,.0f}"),
                         _error(self.measured_tokens_per_s, self.predicted_tokens_per_s)))
        if self.measured_mfu is not None:
            rows.append(("MFU", f"{self.measured_mfu:.2%}", _maybe(self.predicted_mfu, "{:.2%}"),
                         _error(self.measured_mfu, self.predicted_mfu)))
        for s, measured in enumerate(self.measured_stage_peak_bytes):
            predicted = self.predicted_stage_peak_bytes[s] if self.predicted_stage_peak_bytes else None
            rows.append((f"stage {s} peak memory ({self.memory_kind})", fmt_bytes(measured),
                         fmt_bytes(predicted) if predicted is not None else "-", _error(measured, predicted)))
        header = ("", "measured", "predicted", "error")
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in [header] + rows]
        return "\n".join(lines)


def summarize(step_times: list[float], stage_peaks: list[int], memory_kind: str, losses: list[float],
              plan: Plan, memory: list[dict[str, Any]] | None = None, run_id: str | None = None,
              collectives: list[dict[str, Any]] | None = None, op_overhead_s: float | None = None) -> RunSummary:
    timed = step_times[1:] or step_times
    prediction = plan.prediction
    median = statistics.median(timed) if timed else float("nan")
    tokens = plan.global_batch * plan.seq_len
    flops = plan.model_spec.train_flops_per_token(plan.seq_len) * tokens
    peak = peak_flops(plan)
    return RunSummary(
        steps=len(step_times),
        measured_step_time_s=median,
        predicted_step_time_s=prediction.step_time_s if prediction else None,
        measured_stage_peak_bytes=stage_peaks,
        predicted_stage_peak_bytes=_predicted_peaks(prediction, len(stage_peaks)) if prediction else None,
        memory_kind=memory_kind, losses=losses,
        measured_tokens_per_s=tokens / median if timed else None,
        predicted_tokens_per_s=prediction.tokens_per_s if prediction else None,
        measured_mfu=flops / median / peak if timed and peak else None,
        predicted_mfu=prediction.mfu if prediction else None,
        memory=memory,
        predicted_memory=[m.category_bytes() for m in sorted(prediction.memory, key=lambda m: m.stage)]
        if prediction and memory else None,
        run_id=run_id, plan=plan.to_dict(), collectives=collectives, op_overhead_s=op_overhead_s)


def memory_table(summary: RunSummary) -> str:
    """Per stage, its rank with the largest tracked peak: measured against predicted bytes by
    category (reserve is predicted but is not a tensor, so it is not measured)."""
    if not summary.memory:
        return "no memory report (run with --memory-report)"
    header = ("stage / category", "measured", "predicted", "error")
    rows = []
    for stage in sorted({m["stage"] for m in summary.memory}):
        worst = max((m for m in summary.memory if m["stage"] == stage), key=lambda m: sum(m["bytes"].values()))
        predicted = (summary.predicted_memory or [{}] * (stage + 1))[stage] if summary.predicted_memory else {}
        predicted = {k: v for k, v in predicted.items() if k != "reserve"}
        rows.append((f"stage {stage} (rank {worst['rank']})", fmt_bytes(sum(worst["bytes"].values())),
                     fmt_bytes(sum(predicted.values())) if predicted else "-",
                     _error(sum(worst["bytes"].values()), sum(predicted.values()) if predicted else None)))
        for category, measured in worst["bytes"].items():
            want = predicted.get(category)
            rows.append((f"  {category}", fmt_bytes(measured), fmt_bytes(want) if want is not None else "-",
                         _error(measured, want)))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in [header] + rows)


def _predicted_peaks(prediction, n_stages: int) -> list[int | None]:
    by_stage = {m.stage: m.peak_bytes for m in prediction.memory}
    return [by_stage.get(s) for s in range(n_stages)]


def _maybe(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


def _error(measured: float, predicted: float | None) -> str:
    if not predicted:
        return "-"
    return f"{(measured - predicted) / predicted * 100:+.1f}%"
