"""One rank of a run: the entry point ``torchrun`` starts (``partita launch`` builds the command).

    torchrun --standalone --nproc-per-node=4 -m partita.runtime.worker plan.yaml --steps 20

Reads the plan, joins the process group (NCCL on GPUs, gloo on CPUs), trains, on rank 0
writes the run summary (``--summary``) that ``partita launch`` prints as a table, and tears the
process groups down before Python exits (``shut_down``). Under ``partita launch`` its output goes
to its log file (``partita.runtime.ranklog``) and a refusal is left there for the launcher's line.
"""

from __future__ import annotations

import signal

if __name__ == "__main__":
    # An interrupted rank ends at once and quietly, wherever it is (importing torch, or blocked
    # in a collective whose peers are gone): the default action of SIGINT, not Python's
    # KeyboardInterrupt and its traceback from every rank. torchrun hands the ranks the signal
    # and reports the interrupt; the launcher prints the one line.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

from partita.runtime import ranklog  # noqa: E402 -- no torch

# Under `partita launch`, this rank's own output goes to its log file from here on, before torch
# is imported, so that all torch prints goes there too; CONSOLE is the console it had.
CONSOLE = ranklog.to_log_file() if __name__ == "__main__" else None

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402

from partita import fileio  # noqa: E402
from partita.errors import PartitaError  # noqa: E402
from partita.plan import Plan  # noqa: E402
from partita.runtime.launch import add_launch_arguments, check_plan, plan_cluster, train_config  # noqa: E402
from partita.runtime.data import check_data  # noqa: E402
from partita.runtime.train import TrainConfig, Trainer, check_config  # noqa: E402

log = logging.getLogger("partita.runtime")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return train_config(args)


def quiet_known_warnings() -> None:
    """Silence two torch warnings that every rank of a tensor-parallel CPU run printed, each
    checked harmless here (and shown to a person once, in docs/runtime.md, not once per rank):

    * FSDP2's "FSDP2-wrapped module (...) returned a view tensor": a tensor-parallel module
      hands its output back with ``DTensor.to_local()`` (``use_local_output=True``), which is a
      view. The warning is about an in-place op on that view dropping FSDP's pre-backward hook;
      the runtime never changes a module's output in place (the parallel runs' gradients equal a
      single process's, tests/test_runtime_parallel.py).
    * DTensor's "While redistributing from (_NormPartial(2.0), _NormPartial(2.0)) to (Replicate(),
      Replicate()), 2 sequential all_reduce operations": the gradient norm of a parameter on a
      2-D (FSDP x TP) mesh reduces over each mesh dimension in turn. Two small all-reduces per
      step instead of one over a flattened mesh; the sum of squares is the same.
    """
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor",
                            category=UserWarning)
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_norm_partial_redistribute)


def _norm_partial_redistribute(record: logging.LogRecord) -> bool:
    """False (drop) for the sequential-all-reduce warning about a norm's partial placements only."""
    args = record.args if isinstance(record.args, tuple) else ()
    source = args[0] if args else ()
    return not ("sequential" in str(record.msg) and isinstance(source, (tuple, list)) and source
                and all(type(p).__name__ == "_NormPartial" for p in source))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m partita.runtime.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_arguments(parser)
    parser.add_argument("--summary", default=None, help="rank 0 writes the run summary (JSON) here")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    set_up_logging(rank, CONSOLE)
    quiet_known_warnings()
    try:
        plan = Plan.load(args.plan)
        cluster = plan_cluster(plan)
        model = plan.model_spec
        check_plan(plan, model, cluster)
        plan = plan.with_ranks_from_zero()  # torchrun numbers only the ranks the plan uses
        cpu = cluster.is_cpu
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != plan.world_size:
            raise PartitaError(f"plan needs world size {plan.world_size} ({plan.mesh.describe()}), "
                               f"torchrun started {world} ranks")
        cfg = config_from_args(args)
        check_config(cfg)
        check_data(cfg.data, vocab=model.vocab, seq_len=plan.seq_len)
    except PartitaError as e:
        return refuse(e)
    device = torch.device("cpu")
    if not cpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", device_id=None if cpu else device)
    finished = False
    try:
        if cfg.run_id is None:  # started by hand with torchrun: rank 0 names the run
            cfg = dataclasses.replace(cfg, run_id=_shared_run_id())
        run(plan, cfg, device, args.summary)
        finished = True
    except PartitaError as e:  # refused by every rank alike: before the first collective (Trainer), or a full disk
        return refuse(e)
    finally:
        shut_down(finished)
    return 0


def set_up_logging(rank: int, console) -> None:
    """Rank 0 logs its progress (INFO) to the console; the other ranks their warnings. Under
    ``partita launch`` (``console``: the console, the rank's own output going to its log file)
    every rank logs everything to its log file, and rank 0 its progress and warnings to the
    console as well: a failure is the launcher's one line, not a line from every rank."""
    fmt = logging.Formatter(f"[rank {rank}] %(message)s")
    if console is None:
        logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                            format=f"[rank {rank}] %(message)s", stream=sys.stderr)
        return
    to_file = logging.StreamHandler(sys.stderr)
    to_file.setFormatter(fmt)
    handlers: list[logging.Handler] = [to_file]
    if rank == 0:
        to_console = logging.StreamHandler(console)
        to_console.setFormatter(fmt)
        to_console.addFilter(lambda record: record.levelno < logging.ERROR)
        handlers.append(to_console)
    logging.basicConfig(level=logging.INFO, handlers=handlers)


def refuse(e: PartitaError) -> int:
    """A refusal: logged, left for the launcher's one line (``ranklog.record_error``), exit 2."""
    log.error("%s", e)
    ranklog.record_error(str(e))
    return 2


def _shared_run_id() -> str:
    run_id = [f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(run_id, src=0)
    return str(run_id[0])


def run(plan: Plan, cfg: TrainConfig, device: torch.device, summary_path: str | None) -> None:
    """Train, write the summary (rank 0), and wait until every rank is past its last collective."""
    trainer = Trainer(plan, cfg, device=device)
    summary = trainer.fit()
    if summary is not None and summary_path:
        fileio.write_text(summary_path, json.dumps(summary.to_dict()))
    dist.barrier()  # no rank tears its groups down while a peer is still in a collective with it
    forget_process_groups(trainer.meshes.world)


def forget_process_groups(world: DeviceMesh) -> None:
    """Drop the world mesh's references to its process groups, so that ``destroy_process_group``
    holds the last ones and really destroys the groups.

    torch's DTensor caches (``_redistribute``'s planner and transform caches,
    ``MeshTopoInfo.build_from_mesh``) keep meshes alive for the life of the process, and a mesh
    keeps its root's groups in ``DeviceMesh._pg_registry``."""
    registry = getattr(world, "_pg_registry", None)  # a torch without it does not hold the groups there
    if isinstance(registry, dict):
        registry.clear()


def shut_down(finished: bool) -> None:
    """Destroy the process groups, once, while the interpreter is fully alive.

    A gloo group has no ``shutdown``: its worker threads stop only in its destructor. A worker
    that drops its last work while Python finalizes must take the GIL to free the work's tensors;
    the interpreter ends it with ``pthread_exit``, whose unwinding through a ``noexcept``
    destructor calls ``std::terminate``: SIGABRT after a finished run. The trainer's reference
    cycles (FSDP states, the pipeline stage and its group) are collected first, so the groups'
    destructors run inside ``destroy_process_group`` and join their threads here. After a failure
    nothing is collected: a group's destructor would wait for work stuck on a peer that is gone."""
    if finished:
        gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
