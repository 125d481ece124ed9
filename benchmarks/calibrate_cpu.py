"""The calibration loop on CPU ranks: run two plans, calibrate, predict two other plans, run them.

    python benchmarks/calibrate_cpu.py [--steps 15] [--rounds 3] [--out runs/calibrate_cpu] [--extra]

1. ``partita plan`` (analytic costs) two calibration plans on ``2xcpu``, each in two pipeline
   stages: tiny-llama with eight micro-batches of one sequence, whose time is mostly the host's
   per-op overhead, and calib-llama (benchmarks/data/calib-llama.yaml, 16x wider) with two
   micro-batches of four, whose time is mostly its matrix products. One run cannot tell the two
   apart (both grow with the work of a layer); the two runs together fit the per-op overhead
   and the compute scale. The weight-stream bandwidth (the passes over the weights each
   micro-batch and the optimizer make on a CPU rank) is fitted beside them: every run's
   optimizer step shows it.
2. Round 1: ``partita launch`` both, ``partita calibrate`` them, ``partita plan --profile``
   the two predicted plans (calib-llama with micro-batches of 2 and of 1; the planner picks
   their schedule) and launch them.
3. Rounds 2..R: launch all four plans again, in turn.
4. ``partita calibrate`` each calibration plan's quietest run (below) into
   ``cpu-calibrated.yaml``, and print, for every plan, the step time the analytic model, the
   first round's profile and the final profile predict against the measured one, and the step
   the final profile's schedule makes of the run's own measured stage times
   (``search.calibrate.step_from_phases``: the schedule's terms apart from the compute's).

Other work on a shared machine slows whole runs: on the 2-core development machine, by up to
1.7x while another session's tests ran, and not only by keeping the ranks off the cores (that
part ``partita calibrate`` takes off, ``runtime/phases.py``): a rank on a core also computes up
to a quarter slower while other processes share the caches. So every plan is launched once a
round, the four in turn, and each plan's quietest run (the least median step) counts: the
calibration plans' and the predicted plans' quietest runs come from the same stretch of time.
The predicted plans are never calibrated on. ``--extra`` adds data-parallel plans (FSDP2 over
gloo), which the calibration is not expected to predict (docs/calibration.md says why).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

from partita.cli import main as partita
from partita.plan import Plan
from partita.profile import Profile
from partita.search.costs.model import CostModel
from partita.search.calibrate import load_run, step_from_phases
from partita.search.evaluate import evaluate_plan

HERE = Path(__file__).parent
CALIB_MODEL = str(HERE / "data" / "calib-llama.yaml")
CLUSTER = "2xcpu"
# (name, model, plan flags). Calibrated on: host-bound, then compute-bound.
CALIBRATION = [
    ("tiny-pp2-mb1", "tiny-llama", ["--pp", "2", "--micro-batch", "1", "--global-batch", "8"]),
    ("calib-pp2-mb4", CALIB_MODEL, ["--pp", "2", "--micro-batch", "4"]),
]
PREDICTED = [
    ("calib-pp2-mb2", CALIB_MODEL, ["--pp", "2", "--micro-batch", "2"]),
    ("calib-pp2-mb1", CALIB_MODEL, ["--pp", "2", "--micro-batch", "1"]),
]
EXTRA = [
    ("calib-dp2-zero1", CALIB_MODEL, ["--pp", "1", "--tp", "1", "--zero", "1", "--micro-batch", "2"]),
    ("tiny-dp2-zero3", "tiny-llama", ["--pp", "1", "--tp", "1", "--zero", "3", "--micro-batch", "4",
                                      "--global-batch", "8"]),
]
COMMON = ["--cluster", CLUSTER, "--no-recompute", "--no-sequence-parallel"]


def run(args: list[str], quiet: bool = True) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out) if quiet else contextlib.nullcontext():
        rc = partita(args)
    if rc != 0:
        sys.exit(f"partita {' '.join(args)} failed ({rc}):\n{out.getvalue()}")


def predicted(plan_path: Path, profile: Profile | None) -> float:
    plan = Plan.load(plan_path)
    cm = CostModel(plan.model_spec, plan.cluster_spec, seq_len=plan.seq_len,
                   dtype=plan.dtype, profiles=(profile,) if profile else ())
    return evaluate_plan(plan, cm).step_time_s


def measured(run_dir: Path) -> float:
    """The median step time, less the ranks' waits for a core (as ``partita calibrate`` counts it)."""
    return load_run(run_dir).step_s


def raw(run_dir: Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["measured_step_time_s"]


def shape(plan: Plan) -> str:
    """What the planner chose: degrees, micro-batching, schedule and the layers of each stage."""
    stages = " / ".join("+".join(str(len(c)) for c in s.chunk_layers()) for s in plan.stages)
    v = f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else ""
    return (f"dp{plan.dp} tp{plan.tp} pp{plan.pp} mb{plan.micro_batch}x{plan.num_micro_batches} "
            f"{plan.schedule}{v} layers {stages}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3, help="launches of every plan, in turn; the quietest counts")
    ap.add_argument("--out", default="runs/calibrate_cpu")
    ap.add_argument("--extra", action="store_true", help="also run data-parallel plans (not expected to fit)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    first_profile, final_profile = out / "cpu-calibrated-round1.yaml", out / "cpu-calibrated.yaml"
    predicted_plans = PREDICTED + (EXTRA if args.extra else [])
    names = [name for name, _, _ in CALIBRATION + predicted_plans]

    def launch(name: str, rnd: int) -> None:
        run(["launch", str(out / f"{name}.yaml"), "--steps", str(args.steps),
             "--metrics", str(out / f"{name}-{rnd}" / "metrics.jsonl")])

    def runs_of(name: str) -> list[Path]:
        return [out / f"{name}-{rnd}" for rnd in range(args.rounds)]

    for name, model, flags in CALIBRATION:
        run(["plan", "--model", model, *COMMON, *flags, "-o", str(out / f"{name}.yaml")])
        launch(name, 0)
    run(["calibrate", *(str(out / f"{name}-0") for name, _, _ in CALIBRATION), "-o", str(first_profile)])
    for name, model, flags in predicted_plans:
        run(["plan", "--model", model, *COMMON, *flags, "--profile", str(first_profile),
             "-o", str(out / f"{name}.yaml")])
        launch(name, 0)
    for rnd in range(1, args.rounds):
        for name in names:
            launch(name, rnd)
    quietest = {name: min(runs_of(name), key=measured) for name in names}
    run(["calibrate", *(str(quietest[name]) for name, _, _ in CALIBRATION), "-o", str(final_profile)], quiet=False)

    profiles = Profile.load(first_profile), Profile.load(final_profile)
    for label, profile in zip(("round 1", "final"), profiles):
        cal = profile.calibration
        stream = f"{cal.weight_stream_gbps:.3g} GB/s" if cal.weight_stream_gbps is not None else "none"
        comm = "; ".join(f"{c.op} {c.latency_s * 1e6:.0f} us + bytes / {c.bandwidth_gbps:.3g} GB/s"
                         for c in profile.comm)
        print(f"{label} profile: compute scale {cal.compute_scale:.3f}, "
              f"per-op overhead {cal.op_overhead_s * 1e6:.2f} us, "
              f"step overhead {cal.step_overhead_s * 1e3:.2f} ms, weight stream {stream} "
              f"(fitted: {', '.join(cal.fitted)}); {comm or 'no comm fit'}")
    print("\n| plan | role | shape | analytic | calibrated (round 1) | calibrated (final) | measured (quietest run) "
          "| its raw median | other runs | error (round 1) | error (final) | schedule from measured stages |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        plan_path = out / f"{name}.yaml"
        plan = Plan.load(plan_path)
        real = measured(quietest[name])
        analytic, early, final = (predicted(plan_path, p) for p in (None, *profiles))
        from_phases = step_from_phases(load_run(quietest[name]), profiles[1])
        role = ("calibrated on" if name in {n for n, _, _ in CALIBRATION}
                else "predicted" if name in {n for n, _, _ in PREDICTED} else "extra")
        others = sorted(measured(d) for d in runs_of(name) if d != quietest[name])
        others_ms = ", ".join(f"{o * 1e3:.0f}" for o in others)
        print(f"| {name} | {role} | {shape(plan)} | {analytic * 1e3:.1f} ms | {early * 1e3:.1f} ms "
              f"| {final * 1e3:.1f} ms | {real * 1e3:.1f} ms | {raw(quietest[name]) * 1e3:.1f} ms | {others_ms} ms "
              f"| {(early / real - 1) * 100:+.1f} % | {(final / real - 1) * 100:+.1f} % "
              f"| {from_phases * 1e3:.1f} ms ({(from_phases / real - 1) * 100:+.1f} %) |")
    # The predicted plans were planned with the first round's profile; say whether the final one
    # would plan them alike.
    for name, model, flags in predicted_plans:
        again = out / f"{name}-final.yaml"
        run(["plan", "--model", model, *COMMON, *flags, "--profile", str(final_profile), "-o", str(again)])
        a, b = shape(Plan.load(out / f"{name}.yaml")), shape(Plan.load(again))
        print(f"- {name}: the final profile plans {'the same' if a == b else 'differently: ' + b}")


if __name__ == "__main__":
    main()
