"""``partita launch plan.yaml``: check the plan against the world it is given, then run it
under ``torchrun``.

    partita launch plan.yaml --steps 20                      # one node: starts the ranks itself
    partita launch plan.yaml --steps 20 --data input.txt --checkpoint-dir ckpt --checkpoint-every 5
    partita launch plan.yaml --steps 20 --checkpoint-dir ckpt --resume

On one node the ranks are started here (``torchrun --standalone``) and the table of measured
against predicted step time and memory is printed at the end (and kept as ``summary.json``
beside ``metrics.jsonl``; ``partita launch`` draws it per stage beside them, ``RUN_CHART``). A
plan for several nodes is not started: the exact ``torchrun`` command for every node is printed
instead (static rendezvous, so node ranks, hence global ranks, are the plan's), each running the
same entry point, ``python -m partita.runtime.worker``.

Everything the launcher can check is checked before a rank starts (``check_launch``): the plan,
the numbers, ``--data``'s length, that ``--metrics`` and ``--checkpoint-dir`` can be written, and
that a ``--resume`` checkpoint is this model's. Bad input is one line and exit code 2.

The ranks run under ``python -m partita.runtime.launch`` (``torchrun`` in this process, so that
an interrupted run ends with the launcher's one line "interrupted" and exit code 130 instead of
torchrun's traceback). Their own output goes to ``logs/rank-R.log`` beside the metrics
(``partita.runtime.ranklog``; rank 0's progress to the console too), and a failed run is one line
naming the rank, how it ended and its log, or the refusal it left (``failure_line``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from partita.cluster import ClusterSpec, load_cluster, recorded_cluster, same_hardware
from partita import fileio
from partita.errors import PartitaError
from partita.model import ModelSpec
from partita.model_io import load_model
from partita.plan import Plan
from partita.runtime import checkpoint, ranklog
from partita.runtime.data import check_data
from partita.runtime.train import TrainConfig, check_config, checkpoint_record

log = logging.getLogger(__name__)
WORKER = "partita.runtime.worker"
# An environment variable naming a file where a failed run's torchrun records its first failed
# rank and exit code (JSON), for ``partita launch --elastic``.
FAILURE_RECORD = "PARTITA_FAILURE_RECORD"
REFUSED = 2  # a rank's exit code when it refused: its input, or a full disk (one line, ``ranklog``)
RUN_CHART = "measured_vs_predicted.png"  # the run's picture, drawn by the caller's ``draw_chart``


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", help="plan.yaml written by `partita plan` (or by hand)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train in all (default 20)")
    parser.add_argument("--data", default="synthetic",
                        help="'synthetic' tokens, a token folder (`partita tokenize`; llm.c or nanoGPT .bin files), "
                             "or a local text file (bytes as tokens)")
    parser.add_argument("--init-from", default=None, metavar="HF_DIR",
                        help="start from a Hugging Face model folder's weights (config.json + *.safetensors; the "
                             "plan's model) instead of random ones")
    parser.add_argument("--checkpoint-dir", default=None, help="directory for torch.distributed.checkpoint saves")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="save every K steps (0: at the end only)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --checkpoint-dir")
    parser.add_argument("--metrics", default=None, help="metrics.jsonl path, written by all ranks "
                                                        "(default runs/<plan name>/metrics.jsonl)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks to start on this node (default: the plan's world size)")
    parser.add_argument("--model", default=None, help="the model you mean to train; refused if the plan was made for another")
    parser.add_argument("--cluster", default=None, help="the cluster you run on; refused if the plan was made for another")
    parser.add_argument("--seed", type=int, default=0, help="model init and data seed")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, warm-up + cosine)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: a tenth of --steps")
    parser.add_argument("--min-lr-ratio", type=float, default=TrainConfig.min_lr_ratio,
                        help=f"the cosine decays to --lr x this at the last step (default {TrainConfig.min_lr_ratio})")
    parser.add_argument("--weight-decay", type=float, default=TrainConfig.weight_decay,
                        help=f"AdamW's decoupled weight decay on matrices and embeddings, not norms or biases "
                             f"(default {TrainConfig.weight_decay})")
    parser.add_argument("--betas", type=_betas, default=TrainConfig.betas, metavar="B1,B2",
                        help=f"AdamW's betas (default {','.join(map(str, TrainConfig.betas))})")
    parser.add_argument("--grad-clip", type=float, default=TrainConfig.grad_clip,
                        help=f"clip the global gradient L2 norm to this (default {TrainConfig.grad_clip})")
    parser.add_argument("--memory-report", action="store_true",
                        help="measure one step's memory per rank by category (torch's memory trackers) and print it "
                             "against the plan's breakdown")
    parser.add_argument("--run-id", default=None,
                        help="tag of this run's metrics records (default: the start time and the launcher's pid)")
    parser.add_argument("--master-addr", default="$MASTER_ADDR", help="rendezvous host for multi-node commands")
    parser.add_argument("--master-port", type=int, default=29500, help="rendezvous port for multi-node commands")
    parser.add_argument("--elastic", action="store_true",
                        help="when a rank dies, re-plan on the ranks left and resume from the last checkpoint "
                             "(needs --checkpoint-dir; docs/runtime.md, 'Elastic training')")
    parser.add_argument("--min-ranks", type=int, default=None,
                        help="with --elastic: stop (exit 3, checkpoint kept) when fewer ranks than this remain")
    # tests: the ranks (or rank --crash-rank alone, by SIGKILL) die after this many steps
    parser.add_argument("--crash-after-step", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--crash-rank", type=int, default=None, help=argparse.SUPPRESS)


def launch_command(args: argparse.Namespace,
                   draw_chart: Callable[[Plan, dict, str, Path], bool] | None = None,
                   report_failure: bool = True) -> int:
    """Run the plan; on one node, print the run's summary and, with ``draw_chart`` (the CLI
    passes ``partita.cli.launch.draw_run_chart``), draw it into the run directory as
    ``RUN_CHART``: ``draw_chart(plan, summary, metrics, path)`` says whether it drew it.

    The ranks' own output goes to ``rank-R.log`` in ``args.log_dir`` (default ``logs`` beside the
    metrics; ``partita.runtime.ranklog``), rank 0's progress to the console too. A failed rank is
    one line (``failure_line``; ``report_failure=False``: the caller prints it) and exit code 2
    where it refused (a full disk, say), 1 where it died or crashed."""
    plan = Plan.load(args.plan)
    metrics = args.metrics or str(Path("runs") / Path(args.plan).stem / "metrics.jsonl")
    args.run_id = args.run_id or f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    cluster, warnings = check_launch(plan, args, metrics)
    for warning in warnings:
        print(f"partita: warning: {warning}", file=sys.stderr)
    if _nodes(plan, cluster) > 1:
        for line in torchrun_commands(plan, cluster, args, metrics):
            print(line)
        return 0
    # The run summary (measured against predicted) lands beside the metrics, for calibration.
    summary_path = run_directory(args.plan, metrics) / "summary.json"
    log_dir = Path(getattr(args, "log_dir", None) or summary_path.parent / "logs")
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise fileio.write_error(log_dir, e) from None
    summary_path.unlink(missing_ok=True)
    chart_path = summary_path.parent / RUN_CHART
    chart_path.unlink(missing_ok=True)  # a picture of an earlier run must not pass for this one's
    ranklog.clear(log_dir)  # and no earlier run's log for this one's
    record = Path(os.environ.get(FAILURE_RECORD) or log_dir / "failure.json")
    record.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "partita.runtime.launch", "--standalone", "--nnodes=1",
           f"--nproc-per-node={plan.world_size}", "-m", WORKER,
           *worker_arguments(args, metrics), "--summary", str(summary_path)]
    log.info("running %s", shlex.join(cmd))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({ranklog.LOG_DIR: str(log_dir), FAILURE_RECORD: str(record)})
    rc = run_until_done(cmd, env)
    if rc != 0:
        failure = read_failure(record)
        if failure is None:  # torchrun itself failed, before or around the ranks
            print(f"partita: error: training failed (torchrun exited with status {rc}; the ranks' logs are in "
                  f"{log_dir})", file=sys.stderr)
            return 1
        if report_failure:
            print(f"partita: error: {failure_line(failure)}", file=sys.stderr)
        return REFUSED if failure["exitcode"] == REFUSED else 1
    if summary_path.is_file():
        from partita.runtime.metrics import RunSummary

        recorded = fileio.load_json(summary_path)
        summary = RunSummary.from_dict(recorded)
        print(f"run {summary.run_id}: {summary.steps} steps, final loss {summary.losses[-1]:.4f}")
        print(summary.table())
        if args.memory_report:
            from partita.runtime.metrics import memory_table

            print("memory at the peak of one step, by category (torch's memory trackers):")
            print(memory_table(summary))
        if draw_chart is not None and draw_chart(plan, recorded, metrics, chart_path):
            print(f"measured against predicted, per stage: {chart_path}")
        analytic = sorted(d for d, src in plan.cost_sources.items() if src != "measured")
        predicted = summary.predicted_step_time_s
        if analytic and predicted and abs(summary.measured_step_time_s / predicted - 1) > 0.5:
            print(f"the prediction used datasheet (analytic) costs for {', '.join(analytic)}; measure this machine "
                  f"with `partita profile` and plan with --profile for a closer one")
    return 0


def run_directory(plan_path: str, metrics: str) -> Path:
    """Where a run's summary, chart and rank logs go: beside its metrics, or, for metrics sent
    to a device or FIFO (``--metrics /dev/null``), ``runs/<plan name>``, not the device's folder."""
    p = Path(metrics)
    if p.exists() and not p.is_file():
        return Path("runs") / Path(plan_path).stem
    return p.parent


def run_until_done(cmd: list[str], env: dict[str, str]) -> int:
    """Run torchrun and wait for it. It runs in its own session, so a Ctrl-C reaches the launcher
    alone; the launcher hands torchrun one SIGINT (it stops its ranks, which exit at once and
    quietly: ``worker.main``), waits until it has, and then raises KeyboardInterrupt (the CLI
    prints "interrupted", exit 130). SIGTERM is handed on the same way (exit 143)."""
    received: list[int] = []
    state = {"proc": None, "sent": False}

    def hand_on(signum: int = 0, frame=None) -> None:
        if signum:
            received.append(signum)
        proc = state["proc"]
        if received and not state["sent"] and proc is not None and proc.poll() is None:
            state["sent"] = True
            proc.send_signal(received[0])

    # The handlers are in place before torchrun starts, so no signal can leave it running alone.
    previous = {sig: signal.signal(sig, hand_on) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        state["proc"] = proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        hand_on()  # a signal that came while it started
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received and received[0] == signal.SIGINT:
        raise KeyboardInterrupt
    if received:
        print(f"partita: stopped by {signal.Signals(received[0]).name}", file=sys.stderr)
        raise SystemExit(128 + received[0])
    return rc


def _betas(text: str) -> tuple[float, float]:
    try:
        b1, b2 = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"two numbers B1,B2 such as 0.9,0.95, got {text!r}") from None
    return b1, b2


def train_config(args: argparse.Namespace, metrics: str | None = None) -> TrainConfig:
    """The training settings the flags give (the worker builds the same from the same flags)."""
    optim = {k: getattr(args, k) for k in ("min_lr_ratio", "weight_decay", "betas", "grad_clip") if hasattr(args, k)}
    return TrainConfig(steps=args.steps, data=args.data, seed=args.seed, lr=args.lr, warmup_steps=args.warmup_steps,
                       **optim,
                       checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                       resume=args.resume, metrics=metrics if metrics is not None else args.metrics,
                       memory_report=args.memory_report, run_id=args.run_id,
                       init_from=getattr(args, "init_from", None),
                       crash_after_step=getattr(args, "crash_after_step", None),
                       crash_rank=getattr(args, "crash_rank", None))


def check_launch(plan: Plan, args: argparse.Namespace, metrics: str | None = None) -> tuple[ClusterSpec, list[str]]:
    """Everything that can be refused before a rank starts; each refusal is one PartitaError line.
    Returns the cluster to run on and warnings to print (what a resume changes)."""
    model = ModelSpec.from_dict(plan.model, where=f"{args.plan}: model")
    cluster = plan_cluster(plan, where=f"{args.plan}: cluster")
    if args.model is not None:
        model = load_model(args.model)
    if args.cluster is not None:
        given = load_cluster(args.cluster)
        # The same hardware listed in another order or under other names is the plan's cluster
        # (as `partita check` accepts it); the plan's own spec numbers the ranks.
        if not (cluster.fingerprint == plan.cluster_fingerprint and same_hardware(cluster, given)):
            cluster = given
    check_plan(plan, model, cluster)
    cfg = train_config(args, metrics)
    check_config(cfg)
    if not 0 < args.master_port < 65536:
        raise PartitaError(f"--master-port must be between 1 and 65535, got {args.master_port}")
    check_data(cfg.data, vocab=model.vocab, seq_len=plan.seq_len)
    if cfg.metrics is not None:
        check_writable_file(cfg.metrics, "--metrics")
        for given in (args.plan, args.model, args.cluster, None if cfg.data == "synthetic" else cfg.data):
            if given and fileio.same_file(cfg.metrics, given):
                raise PartitaError(f"--metrics {cfg.metrics}: is the input {given}; the ranks would append to it, "
                                   f"choose another path")
    if cfg.init_from:
        from partita.runtime.hf_weights import check_folder

        check_folder(cfg.init_from, model)
    warnings = []
    if cfg.checkpoint_dir:
        check_writable_dir(cfg.checkpoint_dir, "--checkpoint-dir")
        warnings = check_checkpoints(plan, cfg)
    if _nodes(plan, cluster) == 1:
        _check_local_world(plan, cluster, args.nproc)
    return cluster, warnings


def check_checkpoints(plan: Plan, cfg: TrainConfig) -> list[str]:
    """A resume must find this model's checkpoint and train past it; a fresh run must not mix its
    checkpoints with another run's (a later --resume would take the newest of either)."""
    assert cfg.checkpoint_dir
    if not cfg.resume:
        last = checkpoint.latest_step(cfg.checkpoint_dir) if Path(cfg.checkpoint_dir).is_dir() else None
        if last is not None:
            raise PartitaError(f"--checkpoint-dir {cfg.checkpoint_dir} already holds a checkpoint "
                               f"({checkpoint.step_dir(cfg.checkpoint_dir, last).name}); add --resume to continue it, "
                               f"or give an empty directory")
        return []
    step, warnings = checkpoint.check_resume(cfg.checkpoint_dir, checkpoint_record(plan, cfg, 0))
    if step is None:
        warnings.append(f"--resume: no checkpoint in {cfg.checkpoint_dir} yet; starting from step 0")
    return warnings


def check_writable_file(path: str, flag: str) -> None:
    """``path`` is a file this process can append to, or can create (with its folders), on a
    file system with space left. An existing file is opened as the ranks open it (append) and
    written nothing: that is how a device such as ``/dev/full`` says it is full."""
    p = Path(path)
    if p.is_dir():
        raise PartitaError(f"{flag} {path} is a directory; give a file path, e.g. {p / 'metrics.jsonl'}")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise PartitaError(f"{flag} {path}: not writable; give a path you can write")
        _check_appendable(p, flag)
        _check_space(p, flag, path)
        return
    _check_space(_check_creatable(p.parent, flag, path), flag, path)


def check_writable_dir(path: str, flag: str) -> None:
    """``path`` is a directory this process can write into, or can create, on a file system
    with space left."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise PartitaError(f"{flag} {path} is a file, not a directory; give a directory")
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise PartitaError(f"{flag} {path}: directory not writable; give one you can write")
        _check_space(p, flag, path)
        return
    _check_space(_check_creatable(p.parent, flag, path), flag, path)


def _check_creatable(folder: Path, flag: str, path: str) -> Path:
    """The nearest existing ancestor of ``folder`` is a directory this process can write into;
    returns it."""
    folder = Path(os.path.abspath(folder))
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise PartitaError(f"{flag} {path}: {folder} is a file, so it cannot hold a folder; give another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PartitaError(f"{flag} {path}: cannot create it, {folder} is not writable; give a path you can write")
    return folder


def _check_appendable(p: Path, flag: str) -> None:
    """Open ``p`` as the ranks do (``MetricsWriter``: write-only, append) and write zero bytes;
    non-blocking, so a FIFO without a reader is refused instead of waiting."""
    try:
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
        try:
            os.write(fd, b"")
        finally:
            os.close(fd)
    except OSError as e:
        raise fileio.write_error(f"{flag} {p}", e) from None


def _check_space(p: Path, flag: str, path: str) -> None:
    """A file system with no block left for this process (root may use the reserved ones) is
    full: the ranks' first write would fail."""
    try:
        if not (p.is_file() or p.is_dir()):
            return  # a device or FIFO: its write said all there is to say
        fs = os.statvfs(p)
    except OSError:
        return
    free = fs.f_bfree if os.geteuid() == 0 else fs.f_bavail
    if fs.f_blocks and free == 0:
        raise PartitaError(f"no space left on device writing {flag} {path}")


def plan_cluster(plan: Plan, where: str = "plan: cluster") -> ClusterSpec:
    """The cluster the plan holds (``partita.cluster.recorded_cluster``)."""
    return recorded_cluster(plan.cluster, where)


def check_plan(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> None:
    """The plan validator; it also refuses what the runtime cannot run (partita.validate), and
    FP8 products, which it does not run (``partita launch``, ``partita slurm``, the worker)."""
    from partita.validate import validate_plan

    validate_plan(plan, model, cluster)
    if plan.fp8:
        raise PartitaError("the plan runs its products in FP8 (fp8: true), which Partita's runtime does not; "
                           "run it with Megatron-LM: partita export PLAN --to megatron")


def _check_local_world(plan: Plan, cluster: ClusterSpec, nproc: int | None) -> None:
    if nproc is not None and nproc != plan.world_size:
        raise PartitaError(f"plan needs world size {plan.world_size} ({plan.mesh.describe()}) "
                           f"but --nproc is {nproc}")
    devices = {cluster.group(name).device for _, name in plan.rank_groups()}
    if devices == {"cpu"}:
        return
    if "cpu" in devices:
        raise PartitaError(f"plan mixes CPU and GPU stages ({', '.join(sorted(devices))}); the runtime needs one backend")
    import torch

    if not torch.cuda.is_available():
        raise PartitaError(f"plan runs on {', '.join(sorted(devices))} but this machine has no CUDA device")
    if torch.cuda.device_count() < plan.world_size:
        raise PartitaError(f"plan needs {plan.world_size} GPUs on this node, it has {torch.cuda.device_count()}")
    for rank, name in plan.rank_groups():
        want, have = cluster.group(name).device, torch.cuda.get_device_name(rank)
        if not _same_device(want, have):
            raise PartitaError(f"stage {plan.stage_of_rank(rank).index} expects {want} but rank {rank} is a {have!r}; "
                               f"plan for this cluster with `partita plan --cluster ...`")


def _same_device(catalog_name: str, torch_name: str) -> bool:
    """'H100' ~ 'NVIDIA H100 80GB HBM3'; 'A100-80GB' ~ 'NVIDIA A100-SXM4-80GB'."""
    have = torch_name.upper().replace(" ", "-")
    return all(part in have for part in catalog_name.upper().split("-"))


def _used_nodes(plan: Plan, cluster: ClusterSpec) -> list[tuple[str, str, int, int]]:
    """(group, device, node index in group, ranks used on it) for every node the plan uses."""
    used = set(plan.ranks)
    nodes: dict[tuple[str, int], int] = {}
    devices = {}
    start = 0
    for g in cluster.groups:
        devices[g.name] = g.device
        for r in range(start, start + g.size):
            if r in used:
                key = (g.name, (r - start) // g.gpus_per_node)
                nodes[key] = nodes.get(key, 0) + 1
        start += g.size
    return [(name, devices[name], i, n) for (name, i), n in nodes.items()]


def _nodes(plan: Plan, cluster: ClusterSpec) -> int:
    return len(_used_nodes(plan, cluster))


def worker_arguments(args: argparse.Namespace, metrics: str) -> list[str]:
    out = [args.plan, "--steps", str(args.steps), "--data", args.data, "--metrics", metrics,
           "--seed", str(args.seed), "--lr", repr(args.lr), "--checkpoint-every", str(args.checkpoint_every)]
    if args.run_id:
        out += ["--run-id", args.run_id]
    if args.checkpoint_dir:
        out += ["--checkpoint-dir", args.checkpoint_dir]
    if args.resume:
        out.append("--resume")
    if args.warmup_steps is not None:
        out += ["--warmup-steps", str(args.warmup_steps)]
    for flag, default in (("min_lr_ratio", TrainConfig.min_lr_ratio), ("weight_decay", TrainConfig.weight_decay),
                          ("grad_clip", TrainConfig.grad_clip)):
        if getattr(args, flag, default) != default:
            out += [f"--{flag.replace('_', '-')}", repr(getattr(args, flag))]
    if tuple(getattr(args, "betas", TrainConfig.betas)) != TrainConfig.betas:
        out += ["--betas", ",".join(map(repr, args.betas))]
    if getattr(args, "init_from", None):
        out += ["--init-from", args.init_from]
    if args.memory_report:
        out.append("--memory-report")
    for flag in ("crash_after_step", "crash_rank"):
        if getattr(args, flag, None) is not None:
            out += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return out


def torchrun_commands(plan: Plan, cluster: ClusterSpec, args: argparse.Namespace, metrics: str) -> list[str]:
    """One command per node the plan uses, in rank order. Static rendezvous keeps node ranks,
    hence the plan's global ranks (node by node, GPU by GPU), fixed."""
    nodes = _used_nodes(plan, cluster)
    worker = shlex.join(worker_arguments(args, metrics))
    lines = [f"# {plan.world_size} ranks on {len(nodes)} nodes; run each command on its node "
             f"(MASTER_ADDR: the host of node-rank 0)"]
    for node_rank, (group, device, index, nproc) in enumerate(nodes):
        lines.append(f"# node-rank {node_rank}: group {group} ({device}) node {index}")
        lines.append(f"torchrun --nnodes={len(nodes)} --node-rank={node_rank} --nproc-per-node={nproc} "
                     f"--rdzv-backend=static --master-addr={args.master_addr} --master-port={args.master_port} "
                     f"-m {WORKER} {worker}")
    return lines


def torchrun(argv: list[str]) -> int:
    """``torchrun`` itself, but quiet: torch's agent turns SIGINT/SIGTERM into
    ``SignalException`` after stopping the ranks, and a failed rank into ``ChildFailedError``;
    both would end in a traceback of torchrun's own. A failed rank is recorded in the file
    ``FAILURE_RECORD`` names (``failure_record``), for the launcher's one line, and the exit
    code is 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    # An interrupt is reported once, by the launcher: not as the agent's "Received 2 death
    # signal" and one "Sending process ... closing signal SIGINT" line per rank; a failed rank
    # once too, not also as "failed (exitcode: -9) local_rank: 1 ...". The ranks torchrun stops
    # itself after a failure are noted from its "closing signal" lines: their deaths are not the cause.
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.errors"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    stopped: set[int] = set()

    def note_stopped(record: logging.LogRecord) -> bool:
        if "closing signal" in str(record.msg) and isinstance(record.args, tuple) and record.args:
            stopped.add(record.args[0])
        return False  # none of its lines is shown

    processes = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    processes.setLevel(logging.WARNING)
    processes.addFilter(note_stopped)
    try:
        main(argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        record = failure_record({rank: (f.exitcode, f.timestamp, f.pid in stopped) for rank, f in e.failures.items()},
                                os.environ.get(ranklog.LOG_DIR))
        path = os.environ.get(FAILURE_RECORD)
        if path:
            fileio.write_text(path, json.dumps(record))
        else:  # torchrun started by hand: nobody reads a record, say it here
            print(f"partita: error: {failure_line(record)}", file=sys.stderr)
        return 1
    return 0


def failure_record(failures: dict[int, tuple[int, float, bool]], log_dir: str | None) -> dict:
    """Which rank's failure caused the run's, from torchrun's failures (rank: exit code, time,
    whether torchrun stopped it itself): ``rank``, ``exitcode`` and ``ranks`` (all it lists),
    the rank's one-line refusal if it left one, and its log file.

    The cause is a rank torchrun did not stop; among those one that refused with a line
    (``ranklog.record_error``), else one killed by a signal (its peers fail after it, with errors
    of their own), else the first to fail. torchrun's own first failure goes by whole-second
    times, so it may name a peer, or a rank it stopped."""
    def cause(rank: int) -> tuple:
        exitcode, timestamp, stopped = failures[rank]
        refused = bool(log_dir) and ranklog.read_error(log_dir, rank) is not None
        return (stopped, not refused, exitcode >= 0, timestamp, rank)

    rank = min(failures, key=cause)
    exitcode = failures[rank][0]
    return {"rank": rank, "exitcode": exitcode, "ranks": sorted(failures),
            "signal": _signal_name(-exitcode) if exitcode < 0 else None,
            "message": ranklog.read_error(log_dir, rank) if log_dir else None,
            "log": str(ranklog.log_path(log_dir, rank)) if log_dir else None}


def read_failure(path: str | Path) -> dict | None:
    """The failure ``torchrun`` recorded (``failure_record``), or None."""
    if not Path(path).is_file():
        return None
    data = fileio.load_json(path)
    return data if isinstance(data, dict) and isinstance(data.get("rank"), int) else None


def failure_line(record: dict) -> str:
    """The one line for a failed run: the refusal a rank left, or the rank and how it ended, with
    its log file."""
    log_file = f"; its log: {record['log']}" if record.get("log") else ""
    if record.get("message"):
        return f"{record['message']} (rank {record['rank']}{log_file})"
    how = (f"was killed by {record['signal']}" if record.get("signal")
           else f"failed with exit code {record['exitcode']}")
    return f"rank {record['rank']} {how}{log_file}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


if __name__ == "__main__":
    sys.exit(torchrun(sys.argv[1:]))
