"""The runtime's step time against a plain hand-written PyTorch loop of the same model, in one
process, on the same data, micro-batching and optimizer: what does the runtime cost?

    OMP_NUM_THREADS=1 python benchmarks/runtime_vs_plain.py --model tiny-llama --device cpu
    # on one GPU: the ~1.1B llama (hidden 2048, 16 blocks, 16/8 heads, ffn 8192,
    # vocab 32000), seq 2048, micro-batch 8; a plain loop measured 0.245 s/step on one H200
    python benchmarks/runtime_vs_plain.py --model configs/models/llama-1b.yaml --device cuda \\
        --seq-len 2048 --micro-batch 8 --num-micro-batches 1

The runtime runs a one-rank plan (dp = tp = pp = 1) through ``Trainer`` exactly as
``partita launch`` would (process group, meshes, metrics, loss reduction, clipping); the plain
loop is model + AdamW + ``clip_grad_norm_`` + gradient accumulation and nothing else. In bf16
(GPU) the runtime computes through FSDP2's mixed precision and the plain loop through autocast.
Both are run alternately, ``--repeats`` times each; the table shows the median step time over
all timed steps (the first ``--warmup`` steps of every run are dropped).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist

from partita.cluster import parse_short
from partita.model_io import load_model
from partita.mesh import Mesh
from partita.plan import LayerStrategy, Plan, Stage
from partita.runtime.data import TokenSource
from partita.runtime.models import build_model, materialize
from partita.runtime.schedule import lm_loss
from partita.runtime.train import TrainConfig, Trainer, lr_at, make_optimizer


def one_rank_plan(spec, device: str, dtype: str, seq_len: int, micro_batch: int, num_micro_batches: int) -> Plan:
    # The device type only sets the MFU denominator here; the catalog name of this GPU, or H100.
    gpu = os.environ.get("PARTITA_GPU", "H100")
    cluster = parse_short("1xcpu" if device == "cpu" else f"1x{gpu}")
    layers = tuple(LayerStrategy(name=n) for n in spec.layer_names())
    stage = Stage(index=0, group=cluster.groups[0].name, device=cluster.groups[0].device, ranks=(0,), layers=layers)
    return Plan(model=spec.to_dict(), model_fingerprint=spec.fingerprint, cluster=cluster.to_dict(),
                cluster_fingerprint=cluster.fingerprint, profile_fingerprint="benchmark", cost_sources={},
                dtype=dtype, seq_len=seq_len, global_batch=micro_batch * num_micro_batches, micro_batch=micro_batch,
                num_micro_batches=num_micro_batches, mesh=Mesh(), stages=(stage,))


def runtime_steps(plan: Plan, cfg: TrainConfig, device: torch.device) -> tuple[list[float], float]:
    """Wall time of each step, and the process CPU time of the whole ``fit``."""
    trainer = Trainer(plan, cfg, device=device)
    cpu0 = time.process_time()
    trainer.fit()
    return trainer.step_times, time.process_time() - cpu0


def plain_steps(plan: Plan, cfg: TrainConfig, device: torch.device) -> tuple[list[float], float]:
    """Wall time of each step, and the process CPU time of the whole loop."""
    spec = plan.model_spec
    model = materialize(build_model(spec), device=device, seed=cfg.seed)
    optimizer = make_optimizer(model, cfg)
    data = TokenSource(cfg.data, vocab=spec.vocab, seq_len=plan.seq_len, global_batch=plan.global_batch, seed=cfg.seed)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=plan.dtype == "bf16")
    n = plan.num_micro_batches
    times = []
    cpu0 = time.process_time()
    for step in range(cfg.steps):
        inputs, targets = data.batch(step)
        inputs, targets = inputs.to(device), targets.to(device)
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, cfg)
        _sync(device)
        t0 = time.perf_counter()
        total = 0.0
        for x, y in zip(inputs.chunk(n), targets.chunk(n)):
            with autocast:
                loss = lm_loss(model(x), y)
            (loss / n).backward()
            total += loss.detach().item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times, time.process_time() - cpu0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--layers", type=int, default=None, help="override the number of blocks (big models on one GPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--num-micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "runtime_vs_plain: no CUDA device here; use --device cpu, or run on a GPU machine\n")
    spec = load_model(args.model)
    if args.layers:
        spec = dataclasses.replace(spec, n_layers=args.layers)
    dtype = "fp32" if args.device == "cpu" else "bf16"
    plan = one_rank_plan(spec, args.device, dtype, args.seq_len or spec.seq_len, args.micro_batch,
                         args.num_micro_batches)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl", rank=0, world_size=1)
    cfg = TrainConfig(steps=args.steps)
    runs = {"plain loop": plain_steps, "partita runtime": runtime_steps}
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, float] = {name: 0.0 for name in runs}
    for _ in range(args.repeats):  # alternate, so drifting machine load hits both alike
        for name, run in runs.items():
            times, cpu_s = run(plan, cfg, device)
            wall[name] += times[args.warmup:]
            cpu[name] += cpu_s / args.steps / args.repeats
    dist.destroy_process_group()

    tokens = plan.global_batch * plan.seq_len
    base_wall, base_cpu = statistics.median(wall["plain loop"]), cpu["plain loop"]
    print(f"{spec.name} ({spec.n_layers} blocks), {args.device} {dtype}, global batch {plan.global_batch} x seq "
          f"{plan.seq_len} in {plan.num_micro_batches} micro-batches, torch {torch.__version__}, "
          f"{args.repeats} runs x {args.steps} steps each")
    print(f"{'':18}{'median step (wall)':>20}{'tokens/s':>10}{'overhead':>10}{'CPU s/step':>12}{'overhead':>10}")
    for name in runs:
        median = statistics.median(wall[name])
        print(f"{name:18}{median * 1e3:>18.2f}ms{tokens / median:>10.0f}{(median - base_wall) / base_wall * 100:>+9.1f}%"
              f"{cpu[name] * 1e3:>10.2f}ms{(cpu[name] - base_cpu) / base_cpu * 100:>+9.1f}%")


if __name__ == "__main__":
    main()
