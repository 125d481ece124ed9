"""``partita launch PLAN --emit slurm [-o job.sbatch]``: an sbatch script that runs the plan.

    partita launch plan.yaml --steps 1000 --emit slurm -o job.sbatch --partition gpu --walltime 24:00:00
    sbatch job.sbatch

The script runs the same ``torchrun`` commands ``partita launch`` prints for a multi-node plan
(``partita.runtime.launch.torchrun_commands``): one per node the plan uses, static rendezvous, node
ranks in the plan's rank order, each node starting as many ranks as the plan puts on it. A plan
on one node group is one job; a plan on several node groups (a mixed cluster) is a heterogeneous
job with one component per node group, in rank order (``#SBATCH hetjob`` between them), each
started by its own ``srun --het-group=N`` and all waited for together. Every node finds its node
rank from its place in its component's node list (``scontrol show hostnames``), so nothing
depends on how SLURM numbers nodes across components. Rank 0's host (the first node of the first
component) is the rendezvous address.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path

from partita import fileio
from partita.cluster import ClusterSpec
from partita.errors import PartitaError
from partita.plan import Plan

WORKER = "partita.runtime.worker"
_WALLTIME = "0123456789:-"


@dataclass(frozen=True)
class Component:
    """The nodes of one node group the plan uses, in rank order, and the ranks on each."""

    group: str
    device: str
    gpus_per_node: int
    first_node_rank: int
    ranks_per_node: tuple[int, ...]

    @property
    def nodes(self) -> int:
        return len(self.ranks_per_node)


def components(plan: Plan, cluster: ClusterSpec) -> list[Component]:
    """One component per node group the plan uses; nodes it leaves wholly idle are not asked for."""
    used = set(plan.ranks)
    out, start, node_rank = [], 0, 0
    for g in cluster.groups:
        per_node = [sum(1 for r in range(start + n * g.gpus_per_node, start + (n + 1) * g.gpus_per_node) if r in used)
                    for n in range(g.nodes)]
        start += g.size
        busy = tuple(n for n in per_node if n)
        if busy:
            out.append(Component(g.name, g.device, g.gpus_per_node, node_rank, busy))
            node_rank += len(busy)
    return out


def sbatch_script(plan: Plan, cluster: ClusterSpec, worker_args: list[str], *, job_name: str,
                  partition: str | None = None, walltime: str | None = None, master_port: int = 29500) -> str:
    comps = components(plan, cluster)
    nnodes = sum(c.nodes for c in comps)
    het = len(comps) > 1
    lines = ["#!/bin/bash",
             f"# {plan.model.get('name', '?')} on {cluster.short}: {plan.mesh.describe()} on {nnodes} "
             f"node{'s' if nnodes > 1 else ''}"
             + (f", a heterogeneous job of {len(comps)} components (one per node group)" if het else ""),
             "# written by `partita launch --emit slurm`; submit with: sbatch THIS_FILE"]
    for i, c in enumerate(comps):
        if i:
            lines.append("#SBATCH hetjob")
        lines.append(f"# component {i}: node group {c.group}, {c.nodes} x {c.device}, node ranks "
                     f"{c.first_node_rank}-{c.first_node_rank + c.nodes - 1}")
        if i == 0:
            lines.append(f"#SBATCH --job-name={job_name}")
            if walltime:
                lines.append(f"#SBATCH --time={walltime}")
        if partition:
            lines.append(f"#SBATCH --partition={partition}")
        lines += [f"#SBATCH --nodes={c.nodes}", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive"]
        if c.device != "cpu":
            lines.append(f"#SBATCH --gpus-per-node={c.gpus_per_node}")
    nodelist = [f"$SLURM_JOB_NODELIST_HET_GROUP_{i}" if het else "$SLURM_JOB_NODELIST" for i in range(len(comps))]
    lines += ["", "set -euo pipefail",
              f'MASTER_ADDR=$(scontrol show hostnames "{nodelist[0]}" | head -n 1)',
              f"MASTER_PORT={master_port}", f"NNODES={nnodes}", "export MASTER_ADDR MASTER_PORT NNODES",
              "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}", "",
              "# run_node NODELIST FIRST_NODE_RANK \"RANKS_PER_NODE...\": start this node's torchrun",
              "run_node() {",
              '  local nodes=($(scontrol show hostnames "$1")) nprocs=($3) i',
              '  for i in "${!nodes[@]}"; do',
              '    if [ "${nodes[$i]}" = "$SLURMD_NODENAME" ]; then',
              '      exec torchrun --nnodes="$NNODES" --node-rank=$(($2 + i)) --nproc-per-node="${nprocs[$i]}" \\',
              '        --rdzv-backend=static --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \\',
              f"        -m {WORKER} {shlex.join(worker_args)} --run-id \"slurm-$SLURM_JOB_ID\"",
              "    fi",
              "  done",
              '  echo "partita: node $SLURMD_NODENAME is not in $1" >&2',
              "  exit 1",
              "}",
              "export -f run_node", "", "pids=()"]
    for i, (c, nl) in enumerate(zip(comps, nodelist)):
        het_flag = f" --het-group={i}" if het else ""
        per_node = " ".join(map(str, c.ranks_per_node))
        lines.append(f"srun{het_flag} --nodes={c.nodes} --ntasks-per-node=1 "
                     f"bash -c 'run_node \"{nl}\" {c.first_node_rank} \"{per_node}\"' & pids+=($!)")
    lines += ["status=0", 'for pid in "${pids[@]}"; do wait "$pid" || status=$?; done', "exit $status", ""]
    return "\n".join(lines)


def emit_command(args: argparse.Namespace) -> int:
    """Check what ``partita launch`` checks that does not need this machine's devices, then write."""
    from partita.cli.export import plan_cluster
    from partita.cli.output import writable_output
    from partita.cluster import load_cluster, same_hardware
    from partita.model import ModelSpec
    from partita.model_io import load_model
    from partita.runtime.launch import check_plan, train_config, worker_arguments
    from partita.runtime.train import check_config

    output = writable_output(args.output or "job.sbatch", inputs=[args.plan, args.cluster, args.model, args.data])
    if args.walltime is not None and (not args.walltime or any(ch not in _WALLTIME for ch in args.walltime)):
        raise PartitaError(f"--walltime {args.walltime!r}: write SLURM's form, e.g. 24:00:00 or 2-00:00:00")
    if args.partition is not None and (not args.partition or any(ch.isspace() for ch in args.partition)):
        raise PartitaError(f"--partition {args.partition!r}: one partition name, without spaces")
    plan = Plan.load(args.plan)
    model = ModelSpec.from_dict(plan.model, where=f"{args.plan}: model")
    cluster = plan_cluster(plan)
    if args.model is not None:
        model = load_model(args.model)
    if args.cluster is not None:
        given = load_cluster(args.cluster)
        if not same_hardware(cluster, given):
            cluster = given
    check_plan(plan, model, cluster)
    metrics = args.metrics or str(Path("runs") / Path(args.plan).stem / "metrics.jsonl")
    args.run_id = None  # each job tags its records with its SLURM job id
    check_config(train_config(args, metrics))
    if not 0 < args.master_port < 65536:
        raise PartitaError(f"--master-port must be between 1 and 65535, got {args.master_port}")
    text = sbatch_script(plan, cluster, worker_arguments(args, metrics), job_name=f"partita-{Path(args.plan).stem}",
                         partition=args.partition, walltime=args.walltime, master_port=args.master_port)
    fileio.write_text(output, text)
    comps = components(plan, cluster)
    print(f"wrote {output}: {plan.world_size} ranks on {sum(c.nodes for c in comps)} nodes"
          + (f", {len(comps)} heterogeneous components" if len(comps) > 1 else "") + f"; submit with: sbatch {output}")
    return 0
