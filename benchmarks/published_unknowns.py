"""The published rows' unknowns, varied, and the layouts ``partita plan`` refuses.

* ``--bloom``: BLOOM's three rows (``bloom-176b-*``) at several Omni-Path rates a GPU (the
  YAML assumes the links' nominal 6.25 GB/s; docs/published_runs.md, "What is still off").
* ``--mtnlg``: MT-NLG 530B's three rows at micro-batch 1, 2 and 4 (the paper gives none; the
  YAML takes 2, the one whose priced scaling from 2,240 to 3,360 GPUs matches the measured one).
* ``--megatron-readme``: Megatron-LM's 2024 H100 scaling study (``mlm2407-*``) at every micro-batch
  and virtual-stage split that fits (the README gives neither).
* ``--refusals``: every priced row's layout asked of the search itself (``make_plan`` on the
  uniform grid, its degrees, micro-batch, ZeRO level and recomputation pinned, its engine by
  name without the row's own options), and the ones it refuses with why.

    python benchmarks/published_unknowns.py [--bloom] [--mtnlg] [--megatron-readme] [--refusals]   (none: all)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import published_runs as pr  # noqa: E402

from partita.errors import PartitaError  # noqa: E402
from partita.search.planner import PlanRequest, make_plan  # noqa: E402
from partita.search.uniform import SearchSpace  # noqa: E402

BLOOM_RATES = (2.5, 3.0, 3.5, 4.0, 6.25)  # GB/s a GPU
MTNLG_MICRO_BATCHES = (1, 2, 4)


def measured_step_s(run: pr.PublishedRun) -> float:
    return run.global_batch * run.seq_len / (pr.measured_tokens_per_s_per_gpu(run) * run.gpus)


def error(run: pr.PublishedRun) -> float:
    return 100.0 * (measured_step_s(run) / pr.evaluate_run(run).step_time_s - 1)


def bloom(runs: list[pr.PublishedRun]) -> None:
    rows = [r for r in runs if r.id.startswith("bloom-176b")]
    print("| run | " + " | ".join(f"{g} GB/s" for g in BLOOM_RATES) + " |")
    print("|---|" + "---:|" * len(BLOOM_RATES))
    for run in rows:
        errors = []
        for rate in BLOOM_RATES:
            groups = tuple(dataclasses.replace(g, network_gbps=rate) for g in run.cluster.groups)
            errors.append(error(dataclasses.replace(run, cluster=dataclasses.replace(run.cluster, groups=groups))))
        print(f"| {run.id} | " + " | ".join(f"{e:+.1f} %" for e in errors) + " |")


def mtnlg(runs: list[pr.PublishedRun]) -> None:
    rows = sorted((r for r in runs if r.id.startswith("mtnlg-530b")), key=lambda r: r.gpus)
    print("| run | measured step | " + " | ".join(f"micro-batch {b}" for b in MTNLG_MICRO_BATCHES) + " |")
    print("|---|---:|" + "---:|" * len(MTNLG_MICRO_BATCHES))
    for run in rows:
        errors = [error(dataclasses.replace(run, micro_batch=b)) for b in MTNLG_MICRO_BATCHES]
        print(f"| {run.id} | {measured_step_s(run):.1f} s | " + " | ".join(f"{e:+.1f} %" for e in errors) + " |")
    # per-GPU throughput from the fewest GPUs to the most, measured and priced at each micro-batch
    def per_gpu(run: pr.PublishedRun, measured: bool) -> float:
        step = measured_step_s(run) if measured else pr.evaluate_run(run).step_time_s
        return run.global_batch * run.seq_len / (step * run.gpus)

    first, last = rows[0], rows[-1]
    change = lambda a, b: 100.0 * (b / a - 1)  # noqa: E731
    print(f"per-GPU throughput, {first.gpus} -> {last.gpus} GPUs: measured "
          f"{change(per_gpu(first, True), per_gpu(last, True)):+.1f} %; priced " + ", ".join(
              f"micro-batch {b} {change(per_gpu(dataclasses.replace(first, micro_batch=b), False), per_gpu(dataclasses.replace(last, micro_batch=b), False)):+.1f} %"  # noqa: E501
              for b in MTNLG_MICRO_BATCHES))


def megatron_readme(runs: list[pr.PublishedRun]) -> None:
    """Megatron-LM's July 2024 H100 scaling study (``mlm2407-*``) gives each run's degrees and batch,
    not its micro-batch nor its virtual stages: every row priced at each micro-batch that divides
    its sequences a data-parallel rank (up to 8) and, in a pipeline, each even split of a rank's
    layers into virtual stages, only where it fits; the YAML's split marked *."""
    rows = [r for r in runs if r.id.startswith("mlm2407-")]
    print("| run | at the YAML's split | lowest | highest | splits that fit |")
    print("|---|---:|---:|---:|---|")
    for run in rows:
        found = [(error(s), f"mb {s.micro_batch} v {s.virtual_stages}"
                  + ("*" if (s.micro_batch, s.virtual_stages) == (run.micro_batch, run.virtual_stages) else ""))
                 for s in pr.splits(run)]
        low, high = min(found), max(found)
        print(f"| {run.id} | {error(run):+.1f} % (mb {run.micro_batch} v {run.virtual_stages}) | {low[0]:+.1f} % ({low[1]}) | "
              f"{high[0]:+.1f} % ({high[1]}) | "
              f"{len(found)} |")


def refusals(runs: list[pr.PublishedRun]) -> None:
    counts: collections.Counter[str] = collections.Counter()
    for run in (r for r in runs if r.pricing != "not_expressible"):
        space = SearchSpace(zero_levels=(run.zero,), tensor_parallel=(run.tp,), pipeline=(run.pp,),
                            micro_batches=(run.micro_batch,), recompute=(run.recompute,),
                            sequence_parallel=(run.sequence_parallel,) if run.tp > 1 else (False, True))
        req = PlanRequest(model=run.model, cluster=run.cluster, seq_len=run.seq_len, global_batch=run.global_batch,
                          dtype=run.dtype, search="uniform", engine=run.engine.name, fp8=run.engine.matmul == "fp8", space=space,
                          context_parallel=(run.cp,), cp_variant=run.cp_variant if run.cp > 1 else None,
                          expert_parallel=(run.ep,) if run.model.is_moe else (), time_limit_s=30)
        try:
            with pr.catalog_with(run.devices):
                make_plan(req)
            counts["planned"] += 1
        except PartitaError as e:
            counts["refused"] += 1
            print(f"{run.id}: {' '.join(str(e).split())}")
    print(f"{counts['planned']} planned, {counts['refused']} refused")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag in ("--bloom", "--mtnlg", "--megatron-readme", "--refusals"):
        parser.add_argument(flag, action="store_true")
    args = parser.parse_args(argv)
    every = not (args.bloom or args.mtnlg or args.megatron_readme or args.refusals)
    runs = pr.load_runs()
    for wanted, section in ((args.bloom, bloom), (args.mtnlg, mtnlg), (args.megatron_readme, megatron_readme),
                            (args.refusals, refusals)):
        if wanted or every:
            section(runs)
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
