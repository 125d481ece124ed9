"""Fit a device type's time constants to measured runs: ``partita calibrate RUN_DIR ... -o P``.

    from partita.search.calibrate import load_run, calibrate
    runs = [load_run("runs/plan")]
    profile, report = calibrate(runs)
    profile.save("cpu-calibrated.yaml")       # then: partita plan ... --profile cpu-calibrated.yaml

A run directory is what ``partita launch`` leaves beside its metrics: ``metrics.jsonl`` (each
rank's step time, each micro-batch's forward, loss and backward, the optimizer; see
``partita.runtime.phases``) and ``summary.json`` (the plan that ran and rank 0's timings of the
plan's collectives at its message sizes, ``partita.runtime.commprobe``).

What is fitted, in this order:

1. Collectives: ``time = latency + bus bytes / bandwidth`` per (op, link, group size) through
   the probe's two message sizes (the plan's and 4 KiB); they become the profile's ``comm``
   entries, which the cost model prefers to the datasheet.
2. The time constants of ``partita.profile.Calibration`` (compute scale on the analytic
   device time, host overhead per eager op, overlap slowdown, fixed per-step overhead and, on
   CPU ranks, the bandwidth passes over the weights and the optimizer's state stream at): the
   cost model is evaluated on each run's plan with candidate constants, and the sum over the
   observations of log(predicted / measured)^2 is minimised (Nelder-Mead in log space, with a
   weak pull, ``PRIOR_WEIGHT``, towards the starting values). The start is the default, except
   for the host overhead per op, which every run measures on a shrunken copy of its own block
   (``runtime.commprobe.probe_op_overhead``): the fit starts there. The weight-stream bandwidth
   starts at the device's memory bandwidth; every CPU run shows it (its optimizer step is those
   passes, and each micro-batch's fixed part grows with them: ``roofline.cpu_weight_stream_s``).
   Observations per stage: the forward (with the loss) and backward of one micro-batch (a step's spans over its micro-batches:
   all of an interleaved stage's virtual stages) and the optimizer step; per run: the
   step time (less the longest wait of its ranks for a core, ``step_times``); each the median
   over every step but the first (warm-up) and the stage's ranks.

A constant is fitted only where the runs can show it; the others keep their start: the overlap
slowdown needs a run with ZeRO-2/3 traffic, the compute scale a run whose analytic device time
is at least ``MIN_ANALYTIC_SHARE`` of its measured compute (on a host-bound run the scale would
soak up host overheads). ``fitted`` in the profile lists them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from partita.cluster import ClusterSpec
from partita import fileio
from partita.errors import PartitaError
from partita.model import ModelSpec
from partita.plan import Plan
from partita.profile import Calibration, CommCost, Profile, Provenance, bus_bytes
from partita.search.costs.model import CostModel
from partita.search.engines import plan_engine
from partita.search.costs.step import step_time_s
from partita.search.evaluate import Evaluation, evaluate_plan
from partita.search.timing import default_constants

log = logging.getLogger(__name__)

PRIOR_WEIGHT = 1e-3  # pull of each log-constant towards its start, against squared log errors
# The compute scale is fitted only on runs whose analytic device time is at least this share of
# their measured compute; below it (host-bound runs) the scale would absorb host overheads.
MIN_ANALYTIC_SHARE = 0.5


@dataclass(frozen=True)
class StageTimes:
    forward_s: float  # one micro-batch, the loss included on the last stage
    backward_s: float
    optimizer_s: float


@dataclass(frozen=True)
class Run:
    """One measured run: its plan, per-stage medians, median step time, collective samples."""

    path: str
    run_id: str
    plan: Plan
    stages: tuple[StageTimes, ...]
    step_s: float
    collectives: tuple[dict[str, Any], ...]
    op_overhead_s: float | None = None  # measured by the run (runtime.commprobe.probe_op_overhead)

    @property
    def device(self) -> str:
        cluster = ClusterSpec.from_dict(self.plan.cluster)
        return cluster.group(self.plan.stages[0].group).device


def load_run(path: str | Path) -> Run:
    """Read a run directory (``metrics.jsonl`` and ``summary.json``); bad input is one line."""
    folder = Path(path)
    if not folder.is_dir():
        raise PartitaError(f"{path}: no such run directory; give the folder `partita launch` wrote "
                           f"metrics.jsonl and summary.json into (default runs/<plan name>)")
    summary_path, metrics_path = folder / "summary.json", folder / "metrics.jsonl"
    for p in (summary_path, metrics_path):
        if not p.is_file():
            raise PartitaError(f"{path}: no {p.name}; run `partita launch PLAN --metrics {folder / 'metrics.jsonl'}` "
                               f"on one node to record a run there")
    try:
        summary = fileio.load_json(summary_path)
        records = fileio.load_jsonl(metrics_path)
    except PartitaError as e:
        raise PartitaError(f"{e}; record the run again") from None
    if not isinstance(summary, dict) or not summary.get("plan"):
        raise PartitaError(f"{path}: summary.json holds no plan (written by an older partita); record the run again "
                           f"with this version's `partita launch`")
    plan = Plan.from_dict(summary["plan"])
    run_id = summary.get("run_id")
    records = [r for r in records if isinstance(r, dict) and r.get("run_id") == run_id]
    timed = [r for r in records if "forward_s" in r and r.get("step", 0) > min(x.get("step", 0) for x in records)]
    if not timed:
        steps = len({r.get("step") for r in records})
        raise PartitaError(f"{path}: run {run_id} has {steps} timed step(s) with per-micro-batch times; "
                           f"calibration needs at least 2 (the first is warm-up): launch with --steps 10 or more")
    stages = []
    for s in range(plan.pp):
        rows = [r for r in timed if r.get("stage") == s]
        if not rows:
            raise PartitaError(f"{path}: no timings of stage {s} in metrics.jsonl; record the run again")
        # Per micro-batch: a step's spans over its micro-batches (an interleaved stage runs several
        # virtual stages per micro-batch, one span each; the cost model's stage time is all of them).
        m = plan.num_micro_batches
        fwd = [(sum(r["forward_s"]) + sum(r.get("loss_s") or [])) / m for r in rows]
        bwd = [sum(r["backward_s"]) / m for r in rows]
        opt = [o for r in rows for o in r["optimizer_s"]]
        stages.append(StageTimes(statistics.median(fwd), statistics.median(bwd), statistics.median(opt)))
    step = statistics.median(step_times(timed))
    return Run(path=str(path), run_id=str(run_id), plan=plan, stages=tuple(stages), step_s=step,
               collectives=tuple(summary.get("collectives") or ()), op_overhead_s=summary.get("op_overhead_s"))


def step_times(records: Sequence[dict[str, Any]]) -> list[float]:
    """Each step's time, less the longest any of its ranks waited for a core (``run_delay_s``,
    recorded on CPU ranks; a rank kept off the cores stalls the whole pipeline at least that
    long): the step as the plan's work makes it, on a machine shared with other work."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r)
    return [max(r["step_time_s"] for r in rs) - max(r.get("run_delay_s", 0.0) for r in rs)
            for _, rs in sorted(by_step.items())]


# ---- collectives ------------------------------------------------------------------------------
def fit_collectives(runs: Sequence[Run]) -> tuple[CommCost, ...]:
    """Latency and bandwidth per (op, link, group size) through the probe's points, weighted by
    relative error; an op whose times do not grow with size gets no entry (the default stays)."""
    points: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for run in runs:
        for c in run.collectives:
            key = (c["op"], c["link"], int(c["ranks"]))
            points.setdefault(key, []).append((bus_bytes(c["op"], c["message_bytes"], c["ranks"]), c["seconds"]))
    out = []
    for (op, link, ranks), pts in sorted(points.items()):
        x = np.array([p[0] for p in pts])
        t = np.array([p[1] for p in pts])
        if len(set(x.tolist())) < 2 or np.any(t <= 0):
            continue
        a_mat = np.stack([1.0 / t, x / t], axis=1)
        (latency, per_byte), *_ = np.linalg.lstsq(a_mat, np.ones_like(t), rcond=None)
        if per_byte <= 0:
            continue
        out.append(CommCost(op=op, link=link, ranks=ranks, latency_s=max(0.0, float(latency)),
                            bandwidth_gbps=1.0 / (float(per_byte) * 1e9)))
    return tuple(out)


# ---- the time constants -------------------------------------------------------------------------
def _profile(device: str, dtype: str, comm: tuple[CommCost, ...], values: dict[str, float],
             fitted: Sequence[str] = (), runs: Sequence[str] = (), error: float = 0.0, command: str = "") -> Profile:
    cal = Calibration(**values, fitted=tuple(fitted), runs=tuple(runs), error=error)
    provenance = Provenance(source="calibrated", device_name=device, dtype=dtype,
                            date=time.strftime("%Y-%m-%d"), command=command)
    return Profile(device=device, dtype=dtype, provenance=provenance, comm=comm, calibration=cal)


def _evaluate(run: Run, profile: Profile | None) -> tuple[CostModel, Evaluation]:
    model = ModelSpec.from_dict(run.plan.model)
    cluster = ClusterSpec.from_dict(run.plan.cluster)
    cm = CostModel(model, cluster, seq_len=run.plan.seq_len, dtype=run.plan.dtype,
                   profiles=(profile,) if profile is not None else (), engine=plan_engine(run.plan))
    return cm, evaluate_plan(run.plan, cm)


def predictions(run: Run, profile: Profile | None) -> list[tuple[str, float, float]]:
    """(what, predicted, measured) for every observation of a run under ``profile``."""
    _, ev = _evaluate(run, profile)
    out = []
    for i, (sc, st) in enumerate(zip(ev.stages, run.stages)):
        out += [(f"stage {i} forward", sc.forward_s, st.forward_s), (f"stage {i} backward", sc.backward_s, st.backward_s),
                (f"stage {i} optimizer", sc.optimizer_s, st.optimizer_s)]
    out.append(("step", ev.step_time_s, run.step_s))
    return out


def step_from_phases(run: Run, profile: Profile | None) -> float:
    """The step the cost model's schedule makes of the run's own stage times: each stage's
    measured forward, backward and optimizer in place of the predicted ones, and the rest (the
    pipeline's closed form, its sends and receives, syncs, the per-step overhead) as ``profile``
    prices it. Against the measured step, it tells the schedule's terms apart from the stages'
    compute: on CPU ranks, within 10 % for 1F1B and interleaved runs alike (docs/calibration.md)."""
    cm, ev = _evaluate(run, profile)
    stages = [dataclasses.replace(sc, forward_s=st.forward_s, backward_s=st.backward_s, optimizer_s=st.optimizer_s,
                                  time_s=st.forward_s + st.backward_s + sc.p2p_s)
              for sc, st in zip(ev.stages, run.stages)]
    step, _ = step_time_s(stages, run.plan.num_micro_batches, schedule=run.plan.schedule,
                          virtual_stages=run.plan.virtual_stages, step_overhead_s=cm.step_overhead_s)
    return step


def calibrate(runs: Sequence[Run], command: str = "") -> tuple[Profile, list[tuple[str, str, float, float]]]:
    """The calibrated profile, and (run id, what, predicted, measured) under it for each observation."""
    if not runs:
        raise PartitaError("calibrate needs at least one run directory")
    devices = sorted({r.device for r in runs})
    if len(devices) > 1:
        raise PartitaError(f"the runs were on {', '.join(devices)}; calibrate one device type at a time "
                           f"(one profile per device type)")
    dtypes = sorted({r.plan.dtype for r in runs})
    if len(dtypes) > 1:
        raise PartitaError(f"the runs trained in {', '.join(dtypes)}; calibrate runs of one dtype together")
    device, dtype = devices[0], dtypes[0]
    if any(len({ClusterSpec.from_dict(r.plan.cluster).group(s.group).device for s in r.plan.stages}) > 1 for r in runs):
        raise PartitaError("a run's stages sit on several device types; calibrate runs on one device type")
    comm = fit_collectives(runs)
    from partita.devices import get_device

    dev = get_device(device)
    base = default_constants(dev.is_cpu)
    start = {"compute_scale": base.compute_scale, "op_overhead_s": base.op_overhead_s,
             "overlap_slowdown": base.overlap_slowdown, "step_overhead_s": base.step_overhead_s}
    if dev.is_cpu:  # the weights' passes on CPU ranks start at the device's memory bandwidth
        start["weight_stream_gbps"] = dev.hbm_gbps
    names = [n for n in Calibration.CONSTANTS + Calibration.OPTIONAL if n in start]
    probed = [r.op_overhead_s for r in runs if r.op_overhead_s]
    if probed:  # the runs' own measurement of a bare block's ops starts the fit (and is its prior)
        start["op_overhead_s"] = statistics.median(probed)
    free = [n for n in names if _shows(n, runs)]
    if "compute_scale" not in free:
        # Its plans' compute would rest on the device's nominal peak: on CPU ranks a plan of a
        # 16x wider model was then off by a quarter (docs/calibration.md).
        log.warning("the compute scale is not fitted: no run is compute-bound (analytic device time at least "
                    "%.0f %% of its compute); add one (partita calibrate RUN_A RUN_B) to predict compute-bound plans",
                    100 * MIN_ANALYTIC_SHARE)
    floor = {"compute_scale": 1e-3, "op_overhead_s": 1e-9, "overlap_slowdown": 1e-3, "step_overhead_s": 1e-6,
             "weight_stream_gbps": 1e-3}
    z0 = np.log([max(start[n], floor[n]) for n in free])

    def values(z: np.ndarray) -> dict[str, float]:
        return start | {n: float(v) for n, v in zip(free, np.exp(z))}

    def loss(z: np.ndarray) -> float:
        v = values(z)
        if v["overlap_slowdown"] > 2.0:
            return math.inf
        prof = _profile(device, dtype, comm, v)
        err = sum(math.log(p / m) ** 2 for run in runs for _, p, m in predictions(run, prof) if p > 0 and m > 0)
        return err + PRIOR_WEIGHT * float(np.sum((z - z0) ** 2))

    fitted_values = values(_nelder_mead(loss, z0, step=1.0)) if free else dict(start)
    fitted = free
    prof = _profile(device, dtype, comm, fitted_values)
    table = [(run.run_id, what, p, m) for run in runs for what, p, m in predictions(run, prof)]
    error = statistics.median(abs(p / m - 1) for _, _, p, m in table if m > 0)
    return _profile(device, dtype, comm, fitted_values, fitted=fitted, runs=[r.run_id for r in runs],
                    error=round(error, 4), command=command), table


def _shows(name: str, runs: Sequence[Run]) -> bool:
    """Whether the runs can tell this constant apart from the others."""
    if name == "overlap_slowdown":
        return any(r.plan.dp > 1 and any(l.zero >= 2 for s in r.plan.stages for l in s.layers) for r in runs)
    if name == "compute_scale":
        return any(_analytic_share(r) >= MIN_ANALYTIC_SHARE for r in runs)
    return True


def _analytic_share(run: Run) -> float:
    """The analytic device time's share of the run's compute under the default constants."""
    from partita.search.analytic import layer_cost
    from partita.devices import get_device

    model = ModelSpec.from_dict(run.plan.model)
    dev = get_device(run.device)
    device_s = sum(c.forward_s + c.backward_s for s in run.plan.stages for l in s.layers
                   for c in [layer_cost(model.kinds[model.role_of(l.name)], dev, tp=l.tensor_parallel,
                                        micro_batch=run.plan.micro_batch, seq_len=run.plan.seq_len,
                                        dtype=run.plan.dtype)])
    measured = sum(st.forward_s + st.backward_s for st in run.stages) * run.plan.dp * run.plan.tp
    return device_s / measured if measured > 0 else 0.0


def _nelder_mead(f, x0: np.ndarray, *, step: float, iterations: int = 300, tol: float = 1e-7) -> np.ndarray:
    """Minimise f from x0 (the textbook simplex: reflect, expand, contract, shrink)."""
    n = len(x0)
    simplex = [x0.astype(float)] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if abs(values[-1] - values[0]) <= tol * (abs(values[0]) + tol):
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]
