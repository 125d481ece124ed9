"""The memory contract on one GPU: what a one-rank bf16 plan holds, measured, against the plan.

    python benchmarks/memory_gpu.py --out /tmp/gpu/memory.json              # llama-1b on one H200
    python benchmarks/memory_gpu.py --device cpu --model tiny-llama --seq-len 64   # the same on CPU

Trains a few steps of a one-rank plan (FSDP2 mixed precision, as `partita launch` runs it) with
the memory report on, and prints, by category, the tensors torch's memory trackers saw at the
peak of the second step against the plan's breakdown; on a GPU also the allocator's peak
(``max_memory_allocated``: tensors only) and reserved bytes (what the caching allocator holds,
which the plan's reserve must cover beside the CUDA context). Needs no ortools: the plan is
built by hand and priced with the cost model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from partita.cluster import parse_short
from partita.model_io import load_model
from partita.mesh import Mesh
from partita.plan import LayerStrategy, Plan, Stage
from partita.runtime.train import TrainConfig, Trainer
from partita.search.costs.model import CostModel
from partita.search.plans import attach_prediction
from partita.units import fmt_bytes


def one_rank_plan(model: str, device: str, gpu: str, seq_len: int, micro_batch: int, num_micro_batches: int,
                  recompute: bool) -> Plan:
    spec = load_model(model)
    cluster = parse_short("1xcpu" if device == "cpu" else f"1x{gpu}")
    dtype = "fp32" if device == "cpu" else "bf16"
    layers = tuple(LayerStrategy(name=n, recompute="full" if recompute and spec.role_of(n) == "block" else "none")
                   for n in spec.layer_names())
    stage = Stage(index=0, group=cluster.groups[0].name, device=cluster.groups[0].device, ranks=(0,), layers=layers)
    plan = Plan(model=spec.to_dict(), model_fingerprint=spec.fingerprint, cluster=cluster.to_dict(),
                cluster_fingerprint=cluster.fingerprint, profile_fingerprint="analytic", cost_sources={},
                dtype=dtype, seq_len=seq_len, global_batch=micro_batch * num_micro_batches, micro_batch=micro_batch,
                num_micro_batches=num_micro_batches, mesh=Mesh(), stages=(stage,))
    return attach_prediction(plan, CostModel(spec, cluster, seq_len=seq_len, dtype=dtype))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="configs/models/llama-1b.yaml")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--gpu", default="H200", help="the catalog name of this GPU")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--num-micro-batches", type=int, default=2)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the comparison here (JSON)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu", file=sys.stderr)
        return 2
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    plan = one_rank_plan(args.model, args.device, args.gpu, args.seq_len, args.micro_batch, args.num_micro_batches,
                         args.recompute)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        trainer = Trainer(plan, TrainConfig(steps=args.steps, memory_report=True), device=device)
        trainer.fit()
        measured = trainer.measured_memory or {}
    finally:
        dist.destroy_process_group()
    predicted = plan.prediction.memory[0].category_bytes()
    rows = [(c, measured.get(c), predicted.get(c)) for c in predicted]
    result = {"plan": {"model": plan.model["name"], "seq_len": plan.seq_len, "micro_batch": plan.micro_batch,
                       "num_micro_batches": plan.num_micro_batches, "recompute": args.recompute, "dtype": plan.dtype},
              "measured": measured, "predicted": predicted}
    if device.type == "cuda":
        result["allocator_peak_allocated"] = int(torch.cuda.max_memory_allocated(device))
        result["allocator_peak_reserved"] = int(torch.cuda.max_memory_reserved(device))
        result["device_total"] = int(torch.cuda.get_device_properties(device).total_memory)
    print(f"{'category':<18}{'measured':>12}{'predicted':>12}{'error':>9}")
    for category, got, want in rows:
        err = f"{(got - want) / want * 100:+.1f}%" if got is not None and want else "-"
        print(f"{category:<18}{fmt_bytes(got) if got is not None else '-':>12}{fmt_bytes(want):>12}{err:>9}")
    total_want = sum(v for k, v in predicted.items() if k != "reserve")
    print(f"{'tracked total':<18}{fmt_bytes(sum(measured.values())):>12}{fmt_bytes(total_want):>12}"
          f"{(sum(measured.values()) - total_want) / total_want * 100:+8.1f}%")
    if device.type == "cuda":
        print(f"allocator: peak allocated {fmt_bytes(result['allocator_peak_allocated'])}, "
              f"peak reserved {fmt_bytes(result['allocator_peak_reserved'])} "
              f"(predicted with reserve {fmt_bytes(sum(predicted.values()))})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
