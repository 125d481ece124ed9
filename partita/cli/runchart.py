"""A finished run against its plan, per stage: after a run, ``partita launch`` draws
``run_figure`` into the run directory (``partita.runtime.launch.RUN_CHART``): the measured step
by part and memory beside the plan's prediction (``partita.cli.report.plan_timeline``), from the
run's ``summary.json`` and ``metrics.jsonl``.

matplotlib is imported inside the functions that draw, so ``import partita`` stays light.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from partita.cli.report import (COLOURS, MEMORY_COLOURS, costed, plan_timeline, pyplot, rank_ranges, save_figure,
                                tail_parts)
from partita.plan import Plan, StageMemory
from partita.units import GiB, MiB, fmt_bytes, fmt_seconds

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from partita.cluster import ClusterSpec

# A step's parts, in the order they are stacked; the colours follow the timeline's.
PART_COLOURS = {"forward": COLOURS["F"], "backward": COLOURS["B"], "sends": COLOURS["send"],
                "gradient sync": "#D4A6C8", "optimizer": COLOURS["sync"], "overhead": "#BAB0AC",
                "waiting for a core": "#79706E", "rest": "#D9D9D9", "idle": COLOURS["idle"], "unsplit": "#A0A0A0"}
PART_NAMES = {"forward": "forward (with the loss)", "backward": "backward", "sends": "pipeline sends",
              "gradient sync": "gradient sync", "optimizer": "optimizer", "overhead": "step overhead",
              "waiting for a core": "waiting for a core (CPU ranks)",
              "rest": "sends, gradient sync, idle (measured together)", "idle": "idle (pipeline bubble)",
              "unsplit": "step (its parts not recorded)"}
MEASURED, PREDICTED = "#3B4B5C", "#A0B4C8"  # the peak-memory bars
_PAIR = 0.2  # a stage's measured bar sits this far left of its centre, the predicted one right


@dataclass(frozen=True)
class StepParts:
    """One stage's step: its length and where it went, in seconds by part (``PART_NAMES``);
    ``parts`` is empty where the run did not record them."""

    step_s: float
    parts: dict[str, float]


def measured_step_parts(records: Sequence[dict], pp: int, *, cpu: bool) -> list[StepParts | None]:
    """Per stage, from one run's ``metrics.jsonl`` records: the median step and the median of each
    of its parts, each step averaged over the stage's ranks first (the first step is left out when
    there are others: it warms up, as in the run summary); None where no rank of the stage
    recorded a step. The parts are the phases a rank times (``runtime/phases.py``: forward with
    the loss, backward, optimizer), on CPU ranks the time spent waiting for a core, and the rest
    of the median step (pipeline sends and waits, gradient sync), which the run does not split."""
    out: list[StepParts | None] = []
    for stage in range(pp):
        rows = [r for r in records if r.get("stage") == stage and "step_time_s" in r]
        steps = sorted({r["step"] for r in rows})
        if not steps:
            out.append(None)
            continue
        step_s, parts = [], []
        for step in steps[1:] or steps:
            ranks = [r for r in rows if r["step"] == step]
            step_s.append(statistics.fmean(r["step_time_s"] for r in ranks))
            timed = [_record_parts(r, cpu) for r in ranks]
            # A rank from a run that did not time its phases leaves the step unsplit.
            keys = list(timed[0]) if all(t and list(t) == list(timed[0]) for t in timed) else []
            parts.append({k: statistics.fmean(t[k] for t in timed) for k in keys})
        median = statistics.median(step_s)
        keys = list(parts[0]) if all(p and list(p) == list(parts[0]) for p in parts) else []
        split = {k: statistics.median(p[k] for p in parts) for k in keys}
        if split:
            split["rest"] = max(0.0, median - sum(split.values()))
        out.append(StepParts(median, split))
    return out


def _record_parts(record: dict, cpu: bool) -> dict[str, float]:
    """The parts of one rank's step its record times; empty for a record without them."""
    if not all(f"{phase}_s" in record for phase in ("forward", "backward", "optimizer")):
        return {}
    parts = {"forward": sum(record["forward_s"]) + sum(record.get("loss_s", ())),
             "backward": sum(record["backward_s"]), "optimizer": sum(record["optimizer_s"])}
    # A CPU rank's phases leave out the time it waited for a core (phases.RunQueueDelay); a GPU's
    # are device time, so the host's waits are not theirs to subtract.
    if cpu and "run_delay_s" in record:
        parts["waiting for a core"] = max(0.0, record["run_delay_s"])
    return parts


def predicted_step_parts(plan: Plan, cluster: "ClusterSpec") -> list[StepParts] | None:
    """Per stage, one step as the plan's timeline plays it (``plan_timeline``): forward, backward
    (input and weight gradients alike), pipeline sends, gradient sync, optimizer and the step's
    fixed overhead, and idle for the rest of the predicted step. None for a plan without a
    prediction (there is nothing to compare against)."""
    if plan.prediction is None:
        return None
    tl = plan_timeline(plan, cluster)
    tails = tail_parts(plan, costed(plan, cluster)[1])
    step = plan.prediction.step_time_s

    def spent(rank: int, kinds: tuple[str, ...]) -> float:
        return sum(b.end_s - b.start_s for b in tl.boxes if b.rank == rank and b.kind in kinds)

    out = []
    for r in range(plan.pp):
        parts = {"forward": spent(r, ("F",)), "backward": spent(r, ("B", "I", "W")), "sends": spent(r, ("send",)),
                 **tails[r]}
        parts["idle"] = max(0.0, step - sum(parts.values()))
        out.append(StepParts(step, parts))
    return out


def run_figure(plan: Plan, cluster: "ClusterSpec", summary: dict, records: Sequence[dict]) -> "Figure":
    """A finished run against its plan, per stage, each stage's measured bar beside its predicted
    one: the step by part; the peak memory of a device against its capacity; and, where the run
    measured it (``--memory-report``), the memory at the peak by category. ``summary`` is the run's
    ``summary.json``, ``records`` its ``metrics.jsonl`` lines. What the run did not measure, or the
    plan does not predict, is said in place of its bar, never drawn as zero."""
    plt = pyplot()
    by_category = bool(summary.get("memory"))
    rows = 3 if by_category else 2
    fig, axes = plt.subplots(rows, 1, figsize=(max(9.0, 3.5 + 1.4 * plan.pp), 1.0 + 3.0 * rows),
                             layout="constrained")
    _time_panel(axes[0], plan, measured_step_parts(records, plan.pp, cpu=cluster.is_cpu),
                predicted_step_parts(plan, cluster))
    _peak_panel(axes[1], plan, cluster, summary, by_category)
    if by_category:
        _category_panel(axes[2], plan, summary)
    for ax in axes:
        _stage_ticks(ax, plan)
    steps = summary.get("steps")
    fig.suptitle(f"{plan.model.get('name', '?')} on {cluster.short} ({plan.mesh.factors()}): "
                 f"run {summary.get('run_id') or '?'}, {steps if steps is not None else '?'} steps, "
                 f"measured against predicted", fontsize=10, x=0.01, ha="left")
    return fig


def write_run_chart(plan: Plan, cluster: "ClusterSpec", summary: dict, records: Sequence[dict], path: Path) -> None:
    save_figure(run_figure(plan, cluster, summary, records), path)


def _stage_ticks(ax, plan: Plan) -> None:
    """Each bar named "measured" or "predicted", and its stage's name under the pair."""
    ax.set_xticks([s + d for s in range(plan.pp) for d in (-_PAIR, _PAIR)], ["measured", "predicted"] * plan.pp,
                  fontsize=7)
    ax.set_xlim(-0.6, plan.pp - 0.4)
    for s in plan.stages:
        ax.text(s.index, -0.12, f"stage {s.index}\n{s.device}, ranks {rank_ranges(s.ranks)}", transform=_data_x(ax),
                ha="center", va="top", fontsize=8)


def _absent(ax, x: float, text: str, gid: str) -> None:
    """A bar that is not there, said where it would stand."""
    ax.text(x, 0.02, text, transform=_data_x(ax), rotation=90, ha="center", va="bottom", fontsize=7, color="#555555",
            gid=gid)


def _data_x(ax):
    """Coordinates with x in the data's units and y in the axes' (0 bottom, 1 top)."""
    from matplotlib.transforms import blended_transform_factory

    return blended_transform_factory(ax.transData, ax.transAxes)


def _time_panel(ax, plan: Plan, measured: list[StepParts | None], predicted: list[StepParts] | None) -> None:
    known = [sp for sp in measured + (predicted or []) if sp is not None]
    longest = max((max(sp.step_s, sum(sp.parts.values())) for sp in known), default=0.0)
    scale, unit = (1.0, "s") if longest >= 2 else (1e3, "ms")
    used: set[str] = set()
    for s in range(plan.pp):
        for who, x, sp in (("measured", s - _PAIR, measured[s]),
                           ("predicted", s + _PAIR, predicted[s] if predicted else None)):
            if sp is None:
                _absent(ax, x, "not measured" if who == "measured" else "no prediction in the plan",
                        f"time-{who}-absent-s{s}")
                continue
            parts = sp.parts or {"unsplit": sp.step_s}
            bottom = 0.0
            for part in PART_COLOURS:
                seconds = parts.get(part, 0.0)
                if seconds <= 0:
                    continue
                used.add(part)
                ax.bar(x, seconds * scale, bottom=bottom, width=2 * _PAIR * 0.9, color=PART_COLOURS[part],
                       edgecolor="#999999" if part == "idle" else "white", linewidth=0.4,
                       hatch="//" if part in ("rest", "unsplit") else None, gid=f"time-{who}-{part}-s{s}")
                bottom += seconds * scale
            ax.text(x, max(bottom, sp.step_s * scale), fmt_seconds(sp.step_s), ha="center", va="bottom", fontsize=7)
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=PART_COLOURS[p], edgecolor="#999999" if p == "idle" else "none",
                     hatch="//" if p in ("rest", "unsplit") else None, label=PART_NAMES[p])
               for p in PART_COLOURS if p in used]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_ylim(0, longest * scale * 1.15 or 1.0)
    ax.set_ylabel(f"step time ({unit})")
    ax.set_title("step time by part: measured (the stage's median step, its ranks averaged) against predicted "
                 "(the plan's timeline)", fontsize=9, loc="left")


def _peak_panel(ax, plan: Plan, cluster: "ClusterSpec", summary: dict, by_category: bool) -> None:
    measured = summary.get("measured_stage_peak_bytes") or []
    predicted = summary.get("predicted_stage_peak_bytes") or (
        [m.peak_bytes for m in sorted(plan.prediction.memory, key=lambda m: m.stage)] if plan.prediction else [])
    capacity = {m.stage: m.capacity_bytes for m in plan.prediction.memory} if plan.prediction else {}
    capacity = [capacity.get(s.index, cluster.group(s.group).memory_bytes) for s in plan.stages]
    shown = [b for b in measured + predicted if b]
    top = max(shown, default=0)
    unit, name = (GiB, "GiB") if top >= GiB else (MiB, "MiB")
    kind = summary.get("memory_kind") or "peak"
    kind_name = {"peak RSS": "peak RSS: the whole process, Python and torch included",
                 "allocated": "torch.cuda.max_memory_allocated"}.get(kind, kind)
    sides = {"measured": (-_PAIR, measured, MEASURED, f"measured ({kind_name})"),
             "predicted": (_PAIR, predicted, PREDICTED, "predicted peak (with reserve)")}
    for s in range(plan.pp):
        for who, (offset, values, colour, label) in sides.items():
            value = values[s] if s < len(values) else None
            if value is None:
                _absent(ax, s + offset, "not measured" if who == "measured" else "no prediction in the plan",
                        f"peak-{who}-absent-s{s}")
                continue
            ax.bar(s + offset, value / unit, width=2 * _PAIR * 0.9, color=colour, gid=f"peak-{who}-s{s}",
                   label=label if s == 0 else None)
            ax.text(s + offset, value / unit, fmt_bytes(value), ha="center", va="bottom", fontsize=7)
        # The capacity as a line where it fits beside the bars; a device far larger is only named.
        if capacity[s] <= 3 * max(top, 1):
            ax.hlines(capacity[s] / unit, s - 0.45, s + 0.45, colors="black", linewidth=1.5,
                      label="capacity" if s == 0 else None, gid=f"capacity-s{s}")
        else:
            ax.text(s, 0.97, f"capacity {fmt_bytes(capacity[s])} (above the chart)", transform=_data_x(ax),
                    ha="center", va="top", fontsize=7, gid=f"capacity-s{s}")
    limit = max([top] + [c for c in capacity if c <= 3 * max(top, 1)]) / unit
    ax.set_ylim(0, limit * 1.2 or 1.0)
    ax.set_ylabel(f"{name} per device")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    note = "" if by_category else "; by category: not measured (run with --memory-report)"
    ax.set_title(f"peak memory per device (measured: the stage's largest){note}", fontsize=9, loc="left")


def _category_panel(ax, plan: Plan, summary: dict) -> None:
    """The memory report: each stage's rank with the largest tracked peak, by category, beside
    the plan's breakdown. Reserve is predicted but is no tensor, so neither side shows it."""
    predicted = summary.get("predicted_memory") or (
        [m.category_bytes() for m in sorted(plan.prediction.memory, key=lambda m: m.stage)] if plan.prediction else [])
    worst = {}
    for m in summary.get("memory") or []:
        if m["stage"] not in worst or sum(m["bytes"].values()) > sum(worst[m["stage"]]["bytes"].values()):
            worst[m["stage"]] = m
    sides = []  # (stage, "measured" or "predicted", x, bytes by category or None)
    for s in range(plan.pp):
        sides.append((s, "measured", s - _PAIR, dict(worst[s]["bytes"]) if s in worst else None))
        sides.append((s, "predicted", s + _PAIR,
                      {c: b for c, b in predicted[s].items() if c != "reserve"} if s < len(predicted) else None))
    top = max((sum(b.values()) for *_, b in sides if b), default=0)
    unit, name = (GiB, "GiB") if top >= GiB else (MiB, "MiB")
    used = [c for c in StageMemory.CATEGORIES if any(b and b.get(c) for *_, b in sides)]
    for s, who, x, held in sides:
        if held is None:
            _absent(ax, x, "not measured" if who == "measured" else "no prediction in the plan",
                    f"category-{who}-absent-s{s}")
            continue
        bottom = 0.0
        for c in used:
            height = held.get(c, 0) / unit
            ax.bar(x, height, bottom=bottom, width=2 * _PAIR * 0.9, color=MEMORY_COLOURS[c], edgecolor="white",
                   linewidth=0.4, gid=f"category-{who}-{c}-s{s}")
            bottom += height
        ax.text(x, bottom, fmt_bytes(sum(held.values())), ha="center", va="bottom", fontsize=7)
    from matplotlib.patches import Patch

    handles = [Patch(color=MEMORY_COLOURS[c], label=c.replace("_", " ")) for c in used]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_ylim(0, top / unit * 1.2 or 1.0)
    ax.set_ylabel(f"{name} per device")
    reserve = [p.get("reserve", 0) for p in predicted]
    aside = f"\nreserve (predicted {fmt_bytes(max(reserve))}) is no tensor, so it is left out" if any(reserve) else ""
    ax.set_title(f"memory at the peak of one step, by category (torch's memory trackers, the stage's largest rank)"
                 f"{aside}", fontsize=9, loc="left")
