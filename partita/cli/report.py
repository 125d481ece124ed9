"""Pictures of a plan: its pipeline timeline, its memory per device, its place on the cluster.

    partita show plan.yaml --timeline step.svg      # or step.png
    partita show plan.yaml --report plan.html       # one self-contained file: summary and all three

The timeline plays the schedule the plan runs (``partita.runtime.actions.torch_actions``:
torch's own action lists; 1F1B needs no torch) with each stage's forward and backward time from
the cost model, scaled so that a stage's forward + backward + sends equal the time the plan's
prediction records for it (a plan made with a measured profile keeps its own numbers). A send
holds its sender and delays its receiver (drawn under the action that sends); each rank ends its
step with its gradient sync, optimizer and the step's fixed overhead. The dashed line is the
plan's predicted step (the search's closed form, ``schedules.closed_form_s``).

A run's picture against its plan is ``partita.cli.runchart``'s.

matplotlib is imported inside the functions that draw, so ``import partita`` stays light.
"""

from __future__ import annotations

import base64
import html
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from partita import fileio
from partita.errors import PartitaError
from partita.plan import Plan, StageMemory
from partita.units import GiB, fmt_seconds

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from partita.cluster import ClusterSpec
    from partita.parallel import Action

TIMELINE_FORMATS = (".svg", ".png")
REPORT_FORMATS = (".html", ".htm")
COLOURS = {"F": "#4C78A8", "B": "#F58518", "I": "#F58518", "W": "#E45756", "send": "#54A24B",
           "sync": "#B279A2", "idle": "#EEEEEE"}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "weight gradient", "send": "send",
              "sync": "grad sync + optimizer"}
MEMORY_COLOURS = dict(zip(StageMemory.CATEGORIES, ("#4C78A8", "#9ECAE9", "#F58518", "#FFBF79", "#54A24B",
                                                    "#E45756", "#B279A2", "#BAB0AC")))


# ---- output paths --------------------------------------------------------------------------
def output_path(flag: str, text: str, formats: Sequence[str], inputs: Sequence[str] = ()) -> Path:
    """The file a picture goes to, refused before any work if it could not be written or is
    one of ``inputs``."""
    path = Path(text)
    for given in inputs:
        if fileio.same_file(path, given):
            raise PartitaError(f"{flag} {text}: is the input {given}; writing there would overwrite it, "
                               f"choose another path")
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


def pyplot():
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
    from partita.search.costs.stage import stage_cost
    from partita.runtime.actions import torch_actions

    pp, v = plan.pp, plan.virtual_stages
    try:
        actions = torch_actions(plan.schedule, pp, v, plan.num_micro_batches)
    except ImportError:
        raise PartitaError(f"the {plan.schedule} schedule's actions come from torch.distributed.pipelining, and torch "
                           f"is not installed; install torch to draw this plan's timeline") from None
    cm, ev = costed(plan, cluster)
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
    tails = [sum(parts.values()) for parts in tail_parts(plan, ev)]
    for r in range(pp):
        end = max(b.end_s for b in boxes if b.rank == r and b.kind != "send")
        boxes.append(Box(r, r, "sync", -1, end, end + tails[r]))
    return Timeline(boxes=tuple(boxes), pp=pp, virtual_stages=v,
                    predicted_step_s=plan.prediction.step_time_s if plan.prediction else None)


def costed(plan: Plan, cluster: "ClusterSpec") -> tuple:
    """The cost model for the plan's model on ``cluster``, and the plan evaluated under it."""
    from partita.model import ModelSpec
    from partita.search.costs.model import CostModel
    from partita.search.engines import plan_engine
    from partita.search.evaluate import evaluate_plan

    cm = CostModel(ModelSpec.from_dict(plan.model, where="plan: model"), cluster, seq_len=plan.seq_len,
                   dtype=plan.dtype, engine=plan_engine(plan))
    return cm, evaluate_plan(plan, cm)


def tail_parts(plan: Plan, ev) -> list[dict[str, float]]:
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
    return (f"{plan.model.get('name', '?')} on {plan.cluster.get('name', '?')}: {plan.mesh.factors()}, "
            f"{m} micro-batch{'es' if m > 1 else ''}, {schedule}{step}")


def timeline_figure(plan: Plan, tl: Timeline) -> "Figure":
    """One row per stage: forward and backward boxes (numbered by micro-batch when there is
    room), sends under them, the gradient sync and optimizer at the end, idle in grey."""
    plt = pyplot()
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
    plt = pyplot()
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
    plt = pyplot()
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


# ---- files ---------------------------------------------------------------------------------
def save_figure(fig: "Figure", path: Path) -> None:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()  # drawn in memory, then written whole (fileio.write_text)
    try:
        fig.savefig(buf, format=path.suffix.lower().lstrip(".") or "png",
                    dpi=150 if path.suffix.lower() == ".png" else None)
    finally:
        plt.close(fig)
    fileio.write_text(path, buf.getvalue())


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
    from partita.search.costs.model import CostModel
    from partita.search.engines import plan_engine
    from partita.search.plans import attach_prediction

    cm = CostModel(ModelSpec.from_dict(plan.model, where="plan: model"), cluster, seq_len=plan.seq_len,
                   dtype=plan.dtype, engine=plan_engine(plan))
    return attach_prediction(plan, cm), "The plan records no prediction; it is priced here by the analytic cost model."


def write_timeline(plan: Plan, cluster: "ClusterSpec", path: Path) -> None:
    plan, _ = with_prediction(plan, cluster)
    save_figure(timeline_figure(plan, plan_timeline(plan, cluster)), path)


def write_report(plan: Plan, cluster: "ClusterSpec", path: Path, *, source: str) -> None:
    """One HTML file, pictures inline: the summary, the timeline, memory per device, the placement."""
    plan, note = with_prediction(plan, cluster)
    pred = plan.prediction
    tl = plan_timeline(plan, cluster)
    e = html.escape
    summary = [("model", plan.model.get("name", "?")), ("cluster", cluster.short),
               ("degrees", plan.mesh.describe()),
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
        f"<tr><td>stage {s.index}</td><td>{e(' + '.join(s.groups))}</td><td>{e(s.device)}</td><td>{rank_ranges(s.ranks)}</td>"
        f"<td>{sum(1 for l in s.layers if l.name.startswith('layers.'))} blocks</td>"
        f"<td>{fmt_seconds(pred.stage_time_s[s.index])}</td></tr>" for s in plan.stages)
    group_rows = "".join(
        f"<tr><td>{e(g.name)}</td><td>{g.nodes} x {g.gpus_per_node} {e(g.device)}</td><td>{rank_ranges(ranks)}</td>"
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
    fileio.write_text(path, page)


def _groups(plan: Plan, cluster: "ClusterSpec") -> list[tuple]:
    """Each node group with its ranks and the stages that run on them."""
    owner = stage_of_ranks(plan)
    out = []
    for g in cluster.groups:
        ranks = range(cluster.first_rank(g.name), cluster.first_rank(g.name) + g.size)
        out.append((g, ranks, sorted({owner[r] for r in ranks if r in owner})))
    return out


def rank_ranges(ranks: Sequence[int]) -> str:
    """Ranks as runs: 0-7, 16-23."""
    ranks = sorted(ranks)
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
