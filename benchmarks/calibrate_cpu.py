"""The calibration loop on CPU ranks: run one plan, calibrate, predict two other plans, run them.

    python benchmarks/calibrate_cpu.py [--steps 15] [--repeats 3] [--out runs/calibrate_cpu] [--extra]

1. ``partita plan`` (analytic costs) and ``partita launch`` one plan on ``2xcpu``: tiny-llama in
   two pipeline stages, eight micro-batches of one sequence; its time is mostly the host's
   per-op overhead.
2. ``partita calibrate`` that run into ``cpu-calibrated.yaml``.
3. ``partita plan --profile cpu-calibrated.yaml`` two other plans of a 16x wider model whose
   matrix products dominate (calib-llama, benchmarks/data/calib-llama.yaml; micro-batches of 2
   and of 1), and launch them.
4. Print, for every plan, the step time the analytic and the calibrated cost models predict for
   it against the measured one (the median of every step but the first).

Other work on a shared machine slows whole runs (on the 2-core development machine, by up to
1.7x while another session's tests ran). So every plan is launched ``--repeats`` times, the
plans after calibration in turn, and each plan's quietest run counts: the calibration is fitted
on plan A's quietest run, and the other plans are measured by theirs. ``--extra`` adds
data-parallel plans (FSDP2 over gloo), which the calibration is not expected to predict
(docs/calibration.md says why), to show how far off they are.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

from partita.cli import main as partita
from partita.cluster import ClusterSpec
from partita.model import ModelSpec
from partita.plan import Plan
from partita.profile import Profile
from partita.search.costs import CostModel
from partita.search.calibrate import load_run
from partita.search.evaluate import evaluate_plan

HERE = Path(__file__).parent
CALIB_MODEL = str(HERE / "data" / "calib-llama.yaml")
CLUSTER = "2xcpu"
# (name, model, plan flags); the first is the one calibrated on.
PLANS = [
    ("tiny-pp2-mb1", "tiny-llama", ["--pp", "2", "--micro-batch", "1", "--global-batch", "8"]),
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
    cm = CostModel(ModelSpec.from_dict(plan.model), ClusterSpec.from_dict(plan.cluster), seq_len=plan.seq_len,
                   dtype=plan.dtype, profiles=(profile,) if profile else ())
    return evaluate_plan(plan, cm).step_time_s


def measured(run_dir: Path) -> float:
    """The median step time, less the ranks' waits for a core (as ``partita calibrate`` counts it)."""
    return load_run(run_dir).step_s


def raw(run_dir: Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["measured_step_time_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=3, help="launches of every plan; the quietest counts")
    ap.add_argument("--out", default="runs/calibrate_cpu")
    ap.add_argument("--extra", action="store_true", help="also run data-parallel plans (not expected to fit)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile_path = out / "cpu-calibrated.yaml"
    plans = PLANS + (EXTRA if args.extra else [])
    quietest: dict[str, Path] = {}

    def launch_all(names: list[str]) -> None:
        for rep in range(args.repeats):
            for name in names:
                run_dir = out / f"{name}-{rep}"
                run(["launch", str(out / f"{name}.yaml"), "--steps", str(args.steps),
                     "--metrics", str(run_dir / "metrics.jsonl")])
        for name in names:
            quietest[name] = min((out / f"{name}-{rep}" for rep in range(args.repeats)), key=measured)

    first, model, flags = plans[0]
    run(["plan", "--model", model, *COMMON, *flags, "-o", str(out / f"{first}.yaml")])
    launch_all([first])
    run(["calibrate", str(quietest[first]), "-o", str(profile_path)], quiet=False)
    for name, model, flags in plans[1:]:
        run(["plan", "--model", model, *COMMON, *flags, "--profile", str(profile_path), "-o", str(out / f"{name}.yaml")])
    launch_all([name for name, _, _ in plans[1:]])
    rows = [(name, out / f"{name}.yaml", quietest[name]) for name, _, _ in plans]
    profile = Profile.load(profile_path)
    print("\n| plan | role | shape | analytic | calibrated | measured (quietest run) | its raw median | other runs "
          "| error (calibrated) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, (name, plan_path, run_dir) in enumerate(rows):
        plan = Plan.load(plan_path)
        shape = f"dp{plan.dp} tp{plan.tp} pp{plan.pp} mb{plan.micro_batch}x{plan.num_micro_batches}"
        analytic, calibrated, real = predicted(plan_path, None), predicted(plan_path, profile), measured(run_dir)
        role = "calibrated on" if i == 0 else "predicted" if i < len(PLANS) else "extra"
        others = sorted(measured(d) for d in out.glob(f"{name}-*") if d != run_dir)
        print(f"| {name} | {role} | {shape} | {analytic * 1e3:.1f} ms | {calibrated * 1e3:.1f} ms | {real * 1e3:.1f} ms "
              f"| {raw(run_dir) * 1e3:.1f} ms | {', '.join(f'{o * 1e3:.0f}' for o in others)} ms "
              f"| {(calibrated / real - 1) * 100:+.1f} % |")


if __name__ == "__main__":
    main()
