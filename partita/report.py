"""Pictures of a plan: its pipeline timeline, its memory per device, its place on the cluster.

    partita show plan.yaml --timeline step.svg      # or step.png
    partita show plan.yaml --report plan.html       # one self-contained file: summary and all three

The timeline plays the schedule the plan runs (``partita.search.schedules.torch_actions``:
torch's own action lists; 1F1B needs no torch) with each stage's forward and backward time from
the cost model, scaled so that a stage's forward + backward + sends equal the time the plan's
prediction records for it (a plan made with a measured profile keeps its own numbers). A send
holds its sender and delays its receiver (drawn under the action that sends); each rank ends its
step with its gradient sync, optimizer and the step's fixed overhead. The dashed line is the
plan's predicted step (the search's closed form, ``schedules.closed_form_s``).

After a run, ``partita launch`` draws ``run_figure`` into the run directory (``RUN_CHART``): per
stage, the measured step by part and memory beside the plan's prediction, from the run's files.

matplotlib is imported inside the functions that draw, so ``import partita`` stays light.
"""

from __future__ import annotations

import base64
import html
import io
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from partita.errors import PartitaError
from partita.plan import Plan, StageMemory
from partita.units import GiB, MiB, fmt_bytes, fmt_seconds

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from partita.cluster import ClusterSpec
    from partita.search.schedules import Action

TIMELINE_FORMATS = (".svg", ".png")
REPORT_FORMATS = (".html", ".htm")
COLOURS = {"F": "#4C78A8", "B": "#F58518", "I": "#F58518", "W": "#E45756", "send": "#54A24B",
           "sync": "#B279A2", "idle": "#EEEEEE"}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "weight gradient", "send": "send",
              "sync": "grad sync + optimizer"}
MEMORY_COLOURS = dict(zip(StageMemory.CATEGORIES, ("#4C78A8", "#9ECAE9", "#F58518", "#FFBF79", "#54A24B",
                                                    "#E45756", "#B279A2", "#BAB0AC")))


# ---- output paths --------------------------------------------------------------------------
def output_path(flag: str, text: str, formats: Sequence[str]) -> Path:
    """The file a picture goes to, refused before any work if it could not be written."""
    path = Path(text)
    if path.suffix.lower() not in formats:
        raise PartitaError(f"{flag} {text}: unknown file type {path.suffix or '(none)'!r}; "
                           f"name it with {' or '.join(formats)}, e.g. {flag} {path.stem or 'plan'}{formats[0]}")
    try:
        if path.is_dir():
            raise PartitaError(f"{flag} {text}: is a directory; give a file name inside it")
        if not path.parent.is_dir():
            raise PartitaError(f"{flag} {text}: no such directory {str(path.parent)!r}; "
                               f"create it first or write elsewhere")
        if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise PartitaError(f"{flag} {text}: no permission to write there; choose another path")
    except (OSError, ValueError):  # a name no file can have (too long, a NUL byte)
        raise PartitaError(f"{flag} {text!r}: not a path a file can be written to") from None
    return path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PartitaError("pictures need matplotlib, which is not installed; pip install matplotlib") from None
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text in an SVG (searchable, smaller)
    matplotlib.rcParams["svg.hashsalt"] = "partita"  # the same plan draws the same file
    import matplotlib.pyplot as plt

    return plt


# ---- the timeline: numbers -----------------------------------------------------------------
@dataclass(frozen=True)
class Box:
    """One action of the step on one rank of a stage, in seconds from the step's start."""

    rank: int  # pipeline rank = plan stage
    stage: int  # torch's stage number (virtual stage under an interleaved schedule)
    kind: str  # "F", "B", "I", "W", "send" or "sync" (gradient sync and optimizer)
    micro_batch: int  # -1 for the sync
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Timeline:
    boxes: tuple[Box, ...]
    pp: int
    virtual_stages: int
    predicted_step_s: float | None  # the plan's prediction, None for a plan without one

    @property
    def end_s(self) -> float:
        return max(b.end_s for b in self.boxes)

    def count(self, kind: str) -> int:
        return sum(1 for b in self.boxes if b.kind == kind)


def timeline(actions: Sequence[Sequence["Action"]], forward_s: Sequence[float], backward_s: Sequence[float],
             send_s: Sequence[float], *, weight_share: float = 0.5) -> list[Box]:
    """Every action's start and end as ``schedules.play`` plays it: ``forward_s[s]``/
    ``backward_s[s]`` per micro-batch of torch stage s, ``send_s[s]`` for a message between
    stages s and s + 1 (either way) when they sit on different ranks. A send also holds its
    sender (both sides of a blocking send wait, as ``costs.with_receives`` prices it) and comes
    back as a box of kind "send" on the sending rank. Without sends this is ``simulate``'s play."""
    from partita.search.schedules import play

    return [Box(e.rank, e.stage, e.kind, e.micro_batch, e.start_s, e.end_s)
            for e in play(actions, forward_s, backward_s, weight_share=weight_share,
                          send_s=lambda a, b: send_s[min(a, b)], blocking_sends=True)]


def plan_timeline(plan: Plan, cluster: "ClusterSpec") -> Timeline:
    """One step of the plan, as the schedule it runs plays it with the plan's stage times."""
    from partita.search.costs import stage_cost
    from partita.search.schedules import torch_actions

    pp, v = plan.pp, plan.virtual_stages
    try:
        actions = torch_actions(plan.schedule, pp, v, plan.num_micro_batches)
    except ImportError:
        raise PartitaError(f"the {plan.schedule} schedule's actions come from torch.distributed.pipelining, and torch "
                           f"is not installed; install torch to draw this plan's timeline") from None
    cm, ev = _costed(plan, cluster)
    forward, backward, send = [0.0] * (pp * v), [0.0] * (pp * v), [0.0] * (pp * v)
    for i, s in enumerate(plan.stages):
        group = cluster.group(s.group)
        cost = ev.stages[i]
        # The plan's own time for the stage when it records one (it may come from a measured profile).
        scale = plan.prediction.stage_time_s[i] / cost.time_s if plan.prediction and cost.time_s else 1.0
        chunks = s.chunk_layers()
        if v == 1:
            parts = [cost]
        else:  # each virtual stage's own share of the stage's time (the embedding and head are heavier)
            parts = [stage_cost(cm, group, layers, stage=0, pp=1, dp=plan.dp, tp=plan.tp, micro_batch=plan.micro_batch,
                                num_micro_batches=plan.num_micro_batches, next_group=group) for layers in chunks]
        fwd_total = sum(p.forward_s for p in parts) or 1.0
        bwd_total = sum(p.backward_s for p in parts) or 1.0
        own = [plan.virtual_stage_index(i, c) for c in range(v)]  # torch's stage numbers of the chunks
        hops = sum(1 for k in own if k < pp * v - 1 and k + 1 not in own)  # outputs sent to another rank
        # The exposed first gather and last reduce-scatter of ZeRO (the step charges them per
        # micro-batch) are drawn inside the forward and the backward, half each.
        edge = cost.zero_edge_s / 2
        for c, part in enumerate(parts):
            k = own[c]
            forward[k] = scale * (cost.forward_s + edge) * part.forward_s / fwd_total
            backward[k] = scale * (cost.backward_s + edge) * part.backward_s / bwd_total
            # A boundary's two messages (activations on, their gradient back), each way one.
            send[k] = scale * cost.send_s / (2 * hops) if hops and k + 1 not in own else 0.0
    boxes = timeline(actions, forward, backward, send)
    tails = [sum(parts.values()) for parts in _tail_parts(plan, ev)]
    for r in range(pp):
        end = max(b.end_s for b in boxes if b.rank == r and b.kind != "send")
        boxes.append(Box(r, r, "sync", -1, end, end + tails[r]))
    return Timeline(boxes=tuple(boxes), pp=pp, virtual_stages=v,
                    predicted_step_s=plan.prediction.step_time_s if plan.prediction else None)


def _costed(plan: Plan, cluster: "ClusterSpec") -> tuple:
    """The cost model for the plan's model on ``cluster``, and the plan evaluated under it."""
    from partita.model import ModelSpec
    from partita.search.costs import CostModel
    from partita.search.evaluate import evaluate_plan

    cm = CostModel(ModelSpec.from_dict(plan.model, where="plan: model"), cluster, seq_len=plan.seq_len,
                   dtype=plan.dtype)
    return cm, evaluate_plan(plan, cm)


def _tail_parts(plan: Plan, ev) -> list[dict[str, float]]:
    """Each rank's end of the step after its last backward, by part: its gradient sync (data
    parallel, and a tied embedding's), its optimizer, and the step's fixed overhead. Scaled so
    that the longest matches what the plan's prediction records for them."""
    raw = [(c.exposed_dp_s + c.tied_sync_s, c.optimizer_s) for c in ev.stages]
    scale, overhead = 1.0, 0.0
    if plan.prediction is not None:
        recorded = plan.prediction.breakdown
        after = sum(recorded.get(k, 0.0) for k in ("data_parallel_exposed", "optimizer", "tied_embedding_sync"))
        longest = max(sync + opt for sync, opt in raw)
        scale = after / longest if longest > 0 else 0.0
        overhead = recorded.get("step_overhead", 0.0)
    return [{"gradient sync": sync * scale, "optimizer": opt * scale, "overhead": overhead} for sync, opt in raw]


# ---- the timeline: the picture -------------------------------------------------------------
def title_of(plan: Plan) -> str:
    schedule = plan.schedule + (f" ({plan.virtual_stages} virtual stages per rank)" if plan.virtual_stages > 1 else "")
    step = f", predicted step {fmt_seconds(plan.prediction.step_time_s)}" if plan.prediction else ""
    m = plan.num_micro_batches
    return (f"{plan.model.get('name', '?')} on {plan.cluster.get('name', '?')}: dp {plan.dp} x tp {plan.tp} x pp "
            f"{plan.pp}, {m} micro-batch{'es' if m > 1 else ''}, {schedule}{step}")


def timeline_figure(plan: Plan, tl: Timeline) -> "Figure":
    """One row per stage: forward and backward boxes (numbered by micro-batch when there is
    room), sends under them, the gradient sync and optimizer at the end, idle in grey."""
    plt = _pyplot()
    from matplotlib.patches import Patch, Rectangle

    scale, unit = (1.0, "s") if tl.end_s >= 2 else (1e3, "ms")
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * tl.pp), layout="constrained")
    room = tl.count("F") / tl.pp <= 24  # few enough boxes per row to number them
    for r in range(tl.pp):
        ax.add_patch(Rectangle((0, r - 0.4), tl.end_s * scale, 0.8, facecolor=COLOURS["idle"], edgecolor="none"))
    for r in range(tl.pp):  # one artist per rank for its sends: there are as many as actions
        sends = [(b.start_s * scale, (b.end_s - b.start_s) * scale)
                 for b in tl.boxes if b.kind == "send" and b.rank == r]
        if sends:
            ax.broken_barh(sends, (r + 0.3, 0.1), facecolors=COLOURS["send"], gid=f"sends-r{r}")
    for b in tl.boxes:
        if b.kind == "send":
            continue
        x, w = b.start_s * scale, (b.end_s - b.start_s) * scale
        # Virtual stages after the first are drawn lighter, so a rank's chunks can be told apart.
        chunk = b.stage // tl.pp if b.kind != "sync" else 0
        gid = f"sync-r{b.rank}" if b.kind == "sync" else f"{b.kind}-r{b.rank}-s{b.stage}-mb{b.micro_batch}"
        ax.add_patch(Rectangle((x, b.rank - 0.35), w, 0.65, facecolor=COLOURS[b.kind], edgecolor="white",
                               linewidth=0.4, alpha=1.0 - 0.35 * (chunk % 2), gid=gid))
        if room and b.kind != "sync":
            ax.text(x + w / 2, b.rank - 0.02, str(b.micro_batch), ha="center", va="center", fontsize=7, color="white")
    if tl.predicted_step_s is not None:
        ax.axvline(tl.predicted_step_s * scale, color="black", linestyle="--", linewidth=1)
    ax.set_xlim(0, max(tl.end_s, tl.predicted_step_s or 0) * scale * 1.01)
    ax.set_ylim(tl.pp - 0.5, -0.5)
    ax.set_yticks(range(tl.pp), [f"stage {r}" for r in range(tl.pp)])
    ax.set_xlabel(f"time in the step ({unit})")
    kinds = sorted({b.kind for b in tl.boxes}, key=list(COLOURS).index)
    handles = [Patch(color=COLOURS[k], label=KIND_NAMES[k]) for k in kinds]
    handles.append(Patch(color=COLOURS["idle"], label="idle"))
    if tl.virtual_stages > 1:
        handles.append(Patch(color=COLOURS["F"], alpha=0.65, label="lighter: the rank's 2nd, 4th, ... virtual stage"))
    if tl.predicted_step_s is not None:
        handles.append(plt.Line2D([], [], color="black", linestyle="--", label="predicted step"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False, fontsize=8)
    ax.set_title(title_of(plan), fontsize=10, loc="left")
    return fig


# ---- memory and the cluster ----------------------------------------------------------------
def memory_figure(plan: Plan) -> "Figure":
    """Each stage's peak on one device, stacked by what holds it, against the device's capacity."""
    plt = _pyplot()
    memory = plan.prediction.memory
    used = [c for c in StageMemory.CATEGORIES if any(m.category_bytes()[c] for m in memory)]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 + 0.7 * len(memory)), 4.5), layout="constrained")
    bottom = [0.0] * len(memory)
    for c in used:
        heights = [m.category_bytes()[c] / GiB for m in memory]
        bars = ax.bar(range(len(memory)), heights, bottom=bottom, color=MEMORY_COLOURS[c], label=c.replace("_", " "),
                      width=0.7)
        for i, bar in enumerate(bars):
            bar.set_gid(f"mem-{c}-s{i}")
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, m in enumerate(memory):
        ax.hlines(m.capacity_bytes / GiB, i - 0.45, i + 0.45, colors="black", linewidth=1.5,
                  label="capacity" if i == 0 else None)
    ax.set_xticks(range(len(memory)), [f"stage {m.stage}\n{m.device}" for m in memory], fontsize=8)
    ax.set_ylabel("GiB per device")
    ax.set_title("memory per device, by what holds it", fontsize=10, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return fig


def stage_of_ranks(plan: Plan) -> dict[int, int]:
    return {r: s.index for s in plan.stages for r in s.ranks}


def cluster_figure(plan: Plan, cluster: "ClusterSpec") -> "Figure":
    """Every device of the cluster, one row per node, coloured and numbered by the stage it runs."""
    plt = _pyplot()
    from matplotlib.patches import Rectangle

    owner = stage_of_ranks(plan)
    cmap = plt.get_cmap("tab20")
    rows = [(g, n) for g in cluster.groups for n in range(g.nodes)]
    width = max(g.gpus_per_node for g in cluster.groups)
    fig, ax = plt.subplots(figsize=(2.5 + 0.45 * width, 0.8 + 0.3 * len(rows)), layout="constrained")
    for y, (g, n) in enumerate(rows):
        first = cluster.first_rank(g.name) + n * g.gpus_per_node
        for k in range(g.gpus_per_node):
            stage = owner.get(first + k)
            colour = cmap(stage % 20) if stage is not None else COLOURS["idle"]
            ax.add_patch(Rectangle((k, y), 0.9, 0.8, facecolor=colour, edgecolor="grey", linewidth=0.3,
                                   gid=f"rank-{first + k}"))
            if len(rows) <= 64:
                ax.text(k + 0.45, y + 0.4, "-" if stage is None else str(stage), ha="center", va="center", fontsize=6)
    ax.set_xlim(0, width)
    ax.set_ylim(len(rows), 0)
    step = max(1, len(rows) // 32)  # at most ~32 node labels
    ax.set_yticks([y + 0.4 for y in range(0, len(rows), step)],
                  [f"{g.name} node {n}" for g, n in rows[::step]], fontsize=7)
    ax.set_xticks([k + 0.45 for k in range(width)], [str(k) for k in range(width)], fontsize=7)
    ax.set_xlabel("device in the node (numbers: the stage it runs; -: idle)")
    ax.set_title("stages placed on the cluster", fontsize=10, loc="left")
    return fig


# ---- a run: measured against predicted -----------------------------------------------------
RUN_CHART = "measured_vs_predicted.png"  # the picture `partita launch` leaves in the run directory
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
    tails = _tail_parts(plan, _costed(plan, cluster)[1])
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
    plt = _pyplot()
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
    fig.suptitle(f"{plan.model.get('name', '?')} on {cluster.short} (dp {plan.dp} x tp {plan.tp} x pp {plan.pp}): "
                 f"run {summary.get('run_id') or '?'}, {steps if steps is not None else '?'} steps, "
                 f"measured against predicted", fontsize=10, x=0.01, ha="left")
    return fig


def write_run_chart(plan: Plan, cluster: "ClusterSpec", summary: dict, records: Sequence[dict], path: Path) -> None:
    _save(run_figure(plan, cluster, summary, records), path, "run chart")


def _stage_ticks(ax, plan: Plan) -> None:
    """Each bar named "measured" or "predicted", and its stage's name under the pair."""
    ax.set_xticks([s + d for s in range(plan.pp) for d in (-_PAIR, _PAIR)], ["measured", "predicted"] * plan.pp,
                  fontsize=7)
    ax.set_xlim(-0.6, plan.pp - 0.4)
    for s in plan.stages:
        ax.text(s.index, -0.12, f"stage {s.index}\n{s.device}, ranks {_ranges(s.ranks)}", transform=_data_x(ax),
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


# ---- files ---------------------------------------------------------------------------------
def _save(fig: "Figure", path: Path, flag: str) -> None:
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=150 if path.suffix.lower() == ".png" else None)
    except OSError as e:
        raise PartitaError(f"{flag} {path}: cannot write the picture ({e.strerror or e})") from None
    finally:
        plt.close(fig)


def _svg(fig: "Figure") -> str:
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # inline: without the XML declaration and doctype


def _png_base64(fig: "Figure") -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def with_prediction(plan: Plan, cluster: "ClusterSpec") -> tuple[Plan, str]:
    """The plan with a prediction (priced by the analytic cost model when it has none), and a note saying so."""
    if plan.prediction is not None:
        return plan, ""
    from partita.model import ModelSpec
    from partita.search.costs import CostModel
    from partita.search.planner import attach_prediction

    cm = CostModel(ModelSpec.from_dict(plan.model, where="plan: model"), cluster, seq_len=plan.seq_len,
                   dtype=plan.dtype)
    return attach_prediction(plan, cm), "The plan records no prediction; it is priced here by the analytic cost model."


def write_timeline(plan: Plan, cluster: "ClusterSpec", path: Path) -> None:
    plan, _ = with_prediction(plan, cluster)
    _save(timeline_figure(plan, plan_timeline(plan, cluster)), path, "--timeline")


def write_report(plan: Plan, cluster: "ClusterSpec", path: Path, *, source: str) -> None:
    """One HTML file, pictures inline: the summary, the timeline, memory per device, the placement."""
    plan, note = with_prediction(plan, cluster)
    pred = plan.prediction
    tl = plan_timeline(plan, cluster)
    e = html.escape
    summary = [("model", plan.model.get("name", "?")), ("cluster", cluster.short),
               ("degrees", f"dp {plan.dp} x tp {plan.tp} x pp {plan.pp} = {plan.world_size} ranks"),
               ("batch", f"global {plan.global_batch} = dp {plan.dp} x micro-batch {plan.micro_batch} x "
                         f"{plan.num_micro_batches} micro-batches; sequence {plan.seq_len}; {plan.dtype}"),
               ("schedule", plan.schedule + (f", {plan.virtual_stages} virtual stages per rank"
                                             if plan.virtual_stages > 1 else "")),
               ("predicted step", fmt_seconds(pred.step_time_s)), ("tokens/s", f"{pred.tokens_per_s:,.0f}"),
               ("MFU", f"{100 * pred.mfu:.1f}%"),
               ("costs", ", ".join(f"{d} {src}" for d, src in plan.cost_sources.items()))]
    if plan.solver is not None:
        summary.append(("search", f"{plan.solver.method}, {plan.solver.status}, gap {100 * plan.solver.gap:.2f}%"))
    used = [c for c in StageMemory.CATEGORIES if any(m.category_bytes()[c] for m in pred.memory)]
    memory_rows = "".join(
        f"<tr><td>stage {m.stage}</td>" + "".join(f"<td>{m.category_bytes()[c] / GiB:.2f}</td>" for c in used)
        + f"<td><b>{m.peak_bytes / GiB:.2f}</b></td><td>{m.capacity_bytes / GiB:.2f}</td></tr>" for m in pred.memory)
    stage_rows = "".join(
        f"<tr><td>stage {s.index}</td><td>{e(' + '.join(s.groups))}</td><td>{e(s.device)}</td><td>{_ranges(s.ranks)}</td>"
        f"<td>{sum(1 for l in s.layers if l.name.startswith('layers.'))} blocks</td>"
        f"<td>{fmt_seconds(pred.stage_time_s[s.index])}</td></tr>" for s in plan.stages)
    group_rows = "".join(
        f"<tr><td>{e(g.name)}</td><td>{g.nodes} x {g.gpus_per_node} {e(g.device)}</td><td>{_ranges(ranks)}</td>"
        f"<td>{', '.join(f'stage {i}' for i in stages) or 'idle'}</td></tr>"
        for g, ranks, stages in _groups(plan, cluster))
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title_of(plan))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1300px; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }}
td, th {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; }}
svg, img {{ max-width: 100%; height: auto; }}
.note {{ color: #555; }}
</style></head><body>
<h1>{e(plan.model.get("name", "?"))} on {e(cluster.short)}</h1>
<p class="note">{e(source)}{(" &middot; " + e(note)) if note else ""}</p>
<h2>Summary</h2>
<table>{"".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in summary)}</table>
<h2>Pipeline timeline of one step</h2>
<p class="note">The schedule the plan runs, played with each stage's predicted times; a send (the thin bars under
the rank that sends) holds the sender; each rank ends with its gradient sync and optimizer; the dashed line is the
predicted step.</p>
{_svg(timeline_figure(plan, tl))}
<h2>Memory per device</h2>
{_svg(memory_figure(plan))}
<table><tr><th>GiB</th>{"".join(f"<th>{c}</th>" for c in used)}<th>peak</th><th>capacity</th></tr>{memory_rows}</table>
<h2>Stages on the cluster</h2>
<img alt="stages placed on the cluster" src="data:image/png;base64,{_png_base64(cluster_figure(plan, cluster))}">
<table><tr><th>stage</th><th>node group</th><th>device</th><th>ranks</th><th>layers</th>
<th>time per micro-batch</th></tr>
{stage_rows}</table>
<table><tr><th>node group</th><th>devices</th><th>ranks</th><th>stages</th></tr>{group_rows}</table>
</body></html>
"""
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as err:
        raise PartitaError(f"--report {path}: cannot write the report ({err.strerror or err})") from None


def _groups(plan: Plan, cluster: "ClusterSpec") -> list[tuple]:
    """Each node group with its ranks and the stages that run on them."""
    owner = stage_of_ranks(plan)
    out = []
    for g in cluster.groups:
        ranks = range(cluster.first_rank(g.name), cluster.first_rank(g.name) + g.size)
        out.append((g, ranks, sorted({owner[r] for r in ranks if r in owner})))
    return out


def _ranges(ranks: Sequence[int]) -> str:
    """Ranks as runs: 0-7, 16-23."""
    ranks = sorted(ranks)
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
