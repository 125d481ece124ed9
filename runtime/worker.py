"""One rank of a run: the entry point ``torchrun`` starts (``partita launch`` builds the command).

    torchrun --standalone --nproc-per-node=4 -m partita.runtime.worker plan.yaml --steps 20

Reads the plan, joins the process group (NCCL on GPUs, gloo on CPUs), trains, on rank 0
writes the run summary (``--summary``) that ``partita launch`` prints as a table, and tears the
process groups down before Python exits (``shut_down``).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from partita.errors import PartitaError
from partita.model import ModelSpec
from partita.plan import Plan
from partita.runtime.launch import add_launch_arguments, check_plan, plan_cluster
from partita.runtime.train import TrainConfig, Trainer

log = logging.getLogger("partita.runtime")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(steps=args.steps, data=args.data, seed=args.seed, lr=args.lr, warmup_steps=args.warmup_steps,
                       checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                       resume=args.resume, metrics=args.metrics, memory_report=args.memory_report,
                       crash_after_step=args.crash_after_step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m partita.runtime.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_arguments(parser)
    parser.add_argument("--summary", default=None, help="rank 0 writes the run summary (JSON) here")
    parser.add_argument("--crash-after-step", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(message)s", stream=sys.stderr)
    try:
        plan = Plan.load(args.plan)
        cluster = plan_cluster(plan)
        check_plan(plan, ModelSpec.from_dict(plan.model), cluster)
        plan = plan.with_ranks_from_zero()  # torchrun numbers only the ranks the plan uses
        cpu = cluster.is_cpu
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != plan.world_size:
            raise PartitaError(f"plan needs world size {plan.world_size} (dp {plan.dp} x tp {plan.tp} x pp {plan.pp}), "
                               f"torchrun started {world} ranks")
    except PartitaError as e:
        log.error("%s", e)
        return 2
    device = torch.device("cpu")
    if not cpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", device_id=None if cpu else device)
    finished = False
    try:
        run(plan, config_from_args(args), device, args.summary)
        finished = True
    finally:
        shut_down(finished)
    return 0


def run(plan: Plan, cfg: TrainConfig, device: torch.device, summary_path: str | None) -> None:
    """Train, write the summary (rank 0), and wait until every rank is past its last collective."""
    trainer = Trainer(plan, cfg, device=device)
    summary = trainer.fit()
    if summary is not None and summary_path:
        Path(summary_path).write_text(json.dumps(summary.to_dict()))
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
