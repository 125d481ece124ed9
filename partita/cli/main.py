"""The ``partita`` command's arguments and its dispatch to the commands (``partita.cli``).

Exit codes: 0 ok; 2 bad input (one line on stderr); 3 no plan fits (with the reason).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Sequence

from partita.errors import InfeasibleError, PartitaError
from partita.parallel import ENGINES


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers separated by commas, got {text!r}")
    return values


def _schedules(text: str) -> tuple[str, ...]:
    """``1f1b,zbv``: the pipeline schedules a plan may run (``partita.parallel.SCHEDULES``)."""
    from partita.parallel import SCHEDULES

    names = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    wrong = [n for n in names if n not in SCHEDULES]
    if not names or wrong:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(SCHEDULES)}, got {text!r}")
    return names


def _recompute_modes(text: str) -> tuple[str, ...]:
    """``none,selective``: the recompute modes a block may take (``partita.plan.RECOMPUTE``)."""
    from partita.plan import RECOMPUTE

    values = {v.strip() for v in text.split(",") if v.strip()}
    if not values or not values <= set(RECOMPUTE):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(RECOMPUTE)} separated by commas, got {text!r}")
    return tuple(m for m in RECOMPUTE if m in values)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _percent(text: str) -> float:
    """A percentage (``1`` or ``1%``) as a fraction in [0, 1)."""
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage such as 1 or 0.5, got {text!r}") from None
    if not 0 <= value < 100:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 100 (%), got {text}")
    return value / 100


def _memory_margin(text: str) -> tuple[str, float]:
    """``4`` or ``4GiB``: GiB per device; ``0.1`` or ``10%``: a fraction of each device's memory."""
    t = text.strip().lower()
    unit = "gib" if t.endswith(("gib", "gb", "g")) else "%" if t.endswith("%") else ""
    number = t.rstrip("gib%").strip()
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GiB like 4 or a fraction like 0.1, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    if unit == "%":
        value, unit = value / 100, "fraction"
    elif not unit:
        unit = "fraction" if value < 1 else "gib"
    if unit == "fraction" and value >= 1:
        raise argparse.ArgumentTypeError(f"a fraction of the device must be < 1 (100%), got {text!r}")
    return unit, value


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("partita")
    except Exception:  # not installed (run from a checkout)
        from partita import __version__

        return __version__


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line and exit 2 like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"partita: error: {message} (see `{self.prog} --help`)\n")


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout instead of tables (schema: docs/json-schema.json)")


def _add_tokens(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", default=None, metavar="N",
                        help="tokens to train on (2T, 500B, 1e12): print time to train, GPU-hours and cost "
                             "per device type")


def _add_emit(launch: argparse.ArgumentParser) -> None:
    """``partita launch PLAN --emit slurm``: write an sbatch script instead of starting ranks."""
    launch.add_argument("--emit", choices=("slurm",), default=None,
                        help="write a batch script that runs the plan instead of running it (slurm: sbatch)")
    launch.add_argument("-o", "--output", default=None, help="with --emit: the script to write (default job.sbatch)")
    launch.add_argument("--partition", default=None, help="with --emit slurm: the SLURM partition (all components)")
    launch.add_argument("--walltime", default=None, help="with --emit slurm: the job's time limit, e.g. 24:00:00")


def build_parser(with_torch_commands: bool = False) -> argparse.ArgumentParser:
    """The argument parser. The torch-backed commands' flags load only when one of them runs,
    so planning never pays for importing torch."""
    p = _Parser(prog="partita", description="Plan and run large-model training across (mixed) GPU clusters.")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress and details")
    p.add_argument("--version", action="version", version=f"partita {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    plan = sub.add_parser("plan", help="search for the fastest plan that fits and write it")
    plan.add_argument("--model", required=True, help="built-in name (partita models), model YAML, or HF config.json")
    plan.add_argument("--cluster", required=True, help="short form like 4x8xA100-80GB+2x8xH100, or a cluster YAML")
    plan.add_argument("--profile", action="append", default=[], metavar="P",
                      help="measured profile (one per device type; repeat); analytic costs elsewhere")
    plan.add_argument("--seq-len", type=_positive_int, help="tokens per sequence (default: the model's)")
    plan.add_argument("--global-batch", type=_positive_int, help="sequences per step (default: the model's recipe)")
    plan.add_argument("--search", choices=("cpsat", "uniform"), default="cpsat",
                      help="cpsat: exact per-layer search (default); uniform: every layer alike, the grid of "
                           "degrees (with --schedule 1f1b the Megatron-style grid alone)")
    plan.add_argument("--schedule", type=_schedules, metavar="S",
                      help="pipeline schedules a plan may run, e.g. 1f1b or interleaved-1f1b,zbv (default: any of "
                           "1f1b, interleaved-1f1b, interleaved-zb, zbv the model trains under); without 1f1b the "
                           "plan is a pipeline of at least two stages")
    plan.add_argument("--time-limit", type=_positive_float, default=None,
                      help="wall-clock bound on the whole search, s; the best plan found by then is kept, "
                           "marked feasible with its gap (default: none; the search stops after a fixed amount "
                           "of solver work, so the same input gives the same plan); with --search uniform it "
                           "bounds the grid")
    plan.add_argument("--gap", type=_percent, default=0.0, metavar="PCT",
                      help="stop once the plan is proven within PCT %% of the optimum (e.g. 1); it is then marked "
                           "feasible with its gap (default 0: prove it optimal)")
    plan.add_argument("--workers", type=_positive_int, default=None, help="CP-SAT workers (default 1: deterministic)")
    plan.add_argument("--seed", type=int, default=None, help="CP-SAT random seed (default 0)")
    plan.add_argument("--engine", choices=ENGINES, default="partita",
                      help="the engine that will run the plan, priced as it runs it (its overlaps, ZeRO-3 gathers, "
                           "loss memory): partita (partita launch, the default), or torchtitan, megatron, deepspeed "
                           "as partita export configures them (docs/engines.md); for those the plan is one the engine "
                           "runs as it is, so its export is the plan itself")
    plan.add_argument("--fp8", action="store_true",
                      help="run the blocks' linear layers' products in FP8 (Transformer Engine's hybrid format; "
                           "everything else in bf16): --engine megatron on Hopper parts (docs/engines.md)")
    plan.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                      help="training dtype (default: bf16 on GPUs, fp16 where a device has no bf16, fp32 on CPU ranks)")
    plan.add_argument("--memory-margin", type=_memory_margin, default=None, metavar="M",
                      help="memory to keep free on every device: GiB (4) or a fraction of the device (0.1)")
    plan.add_argument("--tp", type=_int_list, help="allowed tensor-parallel degrees, e.g. 4,8 (default: any that fits)")
    plan.add_argument("--cp", type=_int_list,
                      help="context-parallel degrees to search, e.g. 1,4,8: each sequence split over cp devices "
                           "of a node (default: 1, and for sequences of 16384 tokens or more every degree that "
                           "divides the node; 1 alone turns it off)")
    plan.add_argument("--cp-variant", choices=("all_to_all", "ring", "all_gather"), default=None,
                      help="context parallelism's attention: all_to_all (Ulysses; heads and kv heads divisible by "
                           "cp x tp), all_gather (Llama 3's: K and V gathered at their kv heads) or ring (CUDA "
                           "only); default: all_to_all where the heads allow it, else all_gather, else ring")
    plan.add_argument("--ep", type=_int_list,
                      help="expert-parallel degrees to search for a mixture-of-experts model, e.g. 1,8 (default: "
                           "every degree dividing the experts and the GPUs per node)")
    plan.add_argument("--moe-imbalance", type=float, default=None, metavar="F",
                      help="mixture of experts: the busiest expert-parallel rank's tokens over the balanced share "
                           "(default 1: balanced routing)")
    plan.add_argument("--pp", type=_int_list, help="allowed pipeline degrees, e.g. 1,2,4 (default: any)")
    plan.add_argument("--micro-batch", type=_int_list,
                      help="allowed micro-batch sizes, e.g. 1,2 (default: any); fixing them also turns off the "
                           "search for replicas of different micro-batch sizes on different device types, whose "
                           "lever is the size")
    plan.add_argument("--zero", type=_int_list, help="allowed ZeRO levels, e.g. 1,3 (default: 0,1,2,3)")
    plan.add_argument("--recompute", type=_recompute_modes, metavar="MODES",
                      help="recompute modes a block may take, e.g. none,selective (default: none,selective,full; "
                           "selective keeps the matrix products' outputs and recomputes the rest)")
    plan.add_argument("--no-recompute", action="store_true", help="never recompute activations (--recompute none)")
    plan.add_argument("--no-sequence-parallel", action="store_true", help="never use sequence parallelism")
    plan.add_argument("-o", "--output", default="plan.yaml", help="where to write the plan (default plan.yaml)")
    plan.add_argument("--top", type=_positive_int, default=1, metavar="K",
                      help="also list the best plans of K-1 other shapes (written as plan-2.yaml, ...)")
    plan.add_argument("--objective", choices=("time", "cost"), default="time",
                      help="time: the fastest plan (default); cost: the fewest dollars per token, at each device "
                           "type's price per GPU-hour (catalog, or price_per_gpu_hour in a cluster YAML)")
    plan.add_argument("--release-idle", action="store_true",
                      help="with --objective cost: devices the plan leaves idle cost nothing (they can be released); "
                           "without it the whole cluster is paid for and the cheapest plan is the fastest")
    _add_tokens(plan)
    _add_json(plan)

    check = sub.add_parser("check", help="validate a plan against a cluster and re-price it")
    check.add_argument("plan")
    check.add_argument("--cluster", required=True)
    check.add_argument("--profile", action="append", default=[], metavar="P")
    _add_json(check)

    show = sub.add_parser("show", help="print a plan")
    show.add_argument("plan")
    show.add_argument("--timeline", metavar="FILE", help="draw one step's pipeline timeline per stage (.svg or .png)")
    show.add_argument("--report", metavar="FILE",
                      help="write one self-contained HTML page: summary, timeline, memory per device, placement")
    _add_tokens(show)
    _add_json(show)

    _add_json(sub.add_parser("models", help="list the built-in models, with the context-parallel (--cp) degrees each allows"))
    _add_json(sub.add_parser("devices", help="list the device catalog"))

    export = sub.add_parser("export", help="write a plan as Megatron-LM arguments, a torchtitan TOML or a "
                                           "DeepSpeed JSON (the closest plan the target runs, both priced)")
    export.add_argument("plan")
    export.add_argument("--to", required=True, choices=("megatron", "torchtitan", "deepspeed"))
    export.add_argument("-o", "--output", default=None,
                        help="file to write (default: megatron.args, torchtitan.toml or deepspeed.json beside the plan)")
    export.add_argument("--profile", action="append", default=[], metavar="P",
                        help="measured profile to price both plans with (as for partita check)")

    calibrate = sub.add_parser("calibrate", help="fit a device type's time constants to measured runs "
                                                 "(partita launch's run directories) into a profile")
    calibrate.add_argument("runs", nargs="+", metavar="RUN_DIR",
                           help="run directories (metrics.jsonl + summary.json), all on one device type")
    calibrate.add_argument("-o", "--output", required=True, help="the calibrated profile to write (YAML)")
    calibrate.add_argument("--check", nargs="+", default=[], metavar="RUN_DIR",
                           help="runs of other plans on the same device type, not fitted on: print what the new "
                                "profile predicts for them against what they measured")

    from partita.cli.export_weights import add_export_weights_arguments
    from partita.cli.replan import add_replan_arguments
    from partita.cli.tokenize import add_tokenize_arguments

    add_replan_arguments(sub)
    add_tokenize_arguments(sub)
    add_export_weights_arguments(sub)

    launch = sub.add_parser("launch", help="train a plan with torch.distributed (torchrun)")
    profile = sub.add_parser("profile", help="measure layer and collective costs on this machine's devices")
    if with_torch_commands:
        _add_torch_commands(launch, profile)
        if launch.get_default("_missing") is None:
            _add_emit(launch)
    return p


def _add_torch_commands(launch: argparse.ArgumentParser, profile: argparse.ArgumentParser) -> None:
    """Their flags live with their code; without torch installed they say so when run."""
    for parser, module, adder in ((launch, "partita.runtime.launch", "add_launch_arguments"),
                                  (profile, "partita.cli.profile", "add_profile_arguments")):
        try:
            add_arguments = getattr(importlib.import_module(module), adder)
        except ImportError as e:
            parser.set_defaults(_missing=f"`partita {parser.prog.split()[-1]}` needs torch ({e})")
            parser.add_argument("rest", nargs=argparse.REMAINDER)
        else:
            add_arguments(parser)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    torch_command = next((a for a in argv if not a.startswith("-")), None) in ("launch", "profile")
    try:
        args = build_parser(torch_command).parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error (already printed as one line)
        return e.code if isinstance(e.code, int) else 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        build_parser().print_help()
        return 2
    try:
        return _dispatch(args)
    except InfeasibleError as e:
        print(f"partita: infeasible: {e}", file=sys.stderr)
        return e.exit_code
    except PartitaError as e:
        print(f"partita: error: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:
        # The reader went away (`partita plan ... | head -1`). Files are written before anything
        # is printed, so nothing is lost; stop printing quietly, as Unix tools do.
        _silence_stdout()
        return 0
    except KeyboardInterrupt:
        print("partita: interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again
    (the recipe of Python's `signal` documentation, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (tests)
        pass


def _dispatch(args: argparse.Namespace) -> int:
    if getattr(args, "_missing", None):
        raise PartitaError(args._missing)
    if args.command == "plan":
        from partita.cli.plan import plan

        return plan(args)
    if args.command in ("check", "show", "models", "devices"):
        from partita.cli import check

        return getattr(check, args.command)(args)
    if args.command == "export":
        from partita.cli.export import export_command

        return export_command(args)
    if args.command == "calibrate":
        from partita.cli.calibrate import calibrate

        return calibrate(args)
    if args.command == "export-weights":
        from partita.cli.export_weights import export_weights_command

        return export_weights_command(args)
    if args.command == "tokenize":
        from partita.cli.tokenize import tokenize_command

        return tokenize_command(args)
    if args.command == "replan":
        from partita.cli.replan import replan_command

        return replan_command(args)
    if args.command == "launch":
        from partita.cli.launch import launch

        return launch(args)
    if args.command == "profile":
        from partita.cli.profile import profile_command

        return profile_command(args)
    raise PartitaError(f"unknown command {args.command!r}")
