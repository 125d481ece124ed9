"""Hand-built plans and a multi-process harness for the runtime tests (CPU, gloo).

``make_plan`` writes the plan a person would write: stages with their ranks (dp-major), their
layers and per-layer choices. ``run_parallel`` trains a plan in ``world`` processes and returns
the losses and the full parameters; ``run_reference`` trains the same model on the same data in
one process with no parallelism at all, which is what the parallel run must reproduce.
"""

from __future__ import annotations

import dataclasses

import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from partita.cluster import parse_short
from partita.model import BUILTIN, ModelSpec
from partita.mesh import Mesh
from partita.plan import LayerStrategy, Plan, Stage


def make_plan(model: str | ModelSpec = "tiny-llama", *, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1,
              cp_variant: str = "all_to_all",
              boundaries: list[int] | None = None, micro_batch: int = 2, num_micro_batches: int = 2,
              seq_len: int = 16, cluster: str = "4xcpu", layer: dict | None = None,
              per_layer: dict[str, dict] | None = None, dtype: str = "fp32") -> Plan:
    """A plan; ``boundaries`` are the block indices where stages 1.. start (uneven allowed);
    ``layer`` sets every layer's strategy, ``per_layer`` overrides single layers by name;
    ``cp`` splits each sequence over that many ranks of every stage (dp x cp x tp a stage)."""
    spec = BUILTIN[model] if isinstance(model, str) else model
    clus = parse_short(cluster)
    names = spec.layer_names()
    if boundaries is None:
        per = spec.n_layers // pp
        boundaries = [per * i for i in range(1, pp)]
    cuts = [0] + [b + 1 for b in boundaries] + [len(names)]  # +1: embed comes first
    stages = []
    for s in range(pp):
        ranks = tuple(range(s * dp * cp * tp, (s + 1) * dp * cp * tp))
        layers = []
        for name in names[cuts[s]:cuts[s + 1]]:
            choice = dict(layer or {})
            choice.update((per_layer or {}).get(name, {}))
            if spec.role_of(name) != "block":
                choice.pop("recompute", None)
            layers.append(LayerStrategy(name=name, **choice))
        group = clus.groups[0]
        stages.append(Stage(index=s, group=group.name, device=group.device, ranks=ranks, layers=tuple(layers)))
    return Plan(model=spec.to_dict(), model_fingerprint=spec.fingerprint, cluster=clus.to_dict(),
                cluster_fingerprint=clus.fingerprint, profile_fingerprint="analytic",
                cost_sources={clus.groups[0].device: "analytic"}, dtype=dtype, seq_len=seq_len, global_batch=dp * micro_batch * num_micro_batches,
                micro_batch=micro_batch, num_micro_batches=num_micro_batches, mesh=Mesh(pp=pp, dp=dp, cp=cp, tp=tp),
                cp_variant=cp_variant, stages=tuple(stages))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, world: int, port: int, fn, args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, *args), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args) -> list:
    """``fn(rank, *args)`` in ``world`` forked processes joined by a gloo process group; the
    ranks' return values, in rank order."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank_entry, args=(world, free_port(), fn, args, out), nprocs=world, join=True,
                           start_method="fork")
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _train_rank(rank: int, plan_dict: dict, cfg) -> dict:
    from partita.runtime.train import Trainer

    trainer = Trainer(Plan.from_dict(plan_dict), cfg, device=torch.device("cpu"))
    summary = trainer.fit()
    return {"params": full_parameters(trainer.model), "summary": summary.to_dict() if summary else None}


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter this rank's stage holds, as a full tensor (a collective for DTensors)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        name = name.replace("._checkpoint_wrapped_module", "")
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).clone()
    return out


def run_parallel(plan: Plan, cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``plan`` in its world of processes; the losses (rank 0's) and all parameters."""
    params: dict[str, torch.Tensor] = {}
    losses = None
    for saved in run_ranks(_train_rank, plan.world_size, plan.to_dict(), cfg):
        params.update(saved["params"])
        if saved["summary"] is not None:
            losses = saved["summary"]["losses"]
    return losses, params


def run_reference(plan: Plan, cfg, grad_norms: list[float] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model, data, init and optimizer in one process, without any parallelism."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run with one thread each; so does the reference
    try:
        return _reference(plan, cfg, grad_norms if grad_norms is not None else [])
    finally:
        torch.set_num_threads(threads)


def _reference(plan: Plan, cfg, grad_norms: list[float]) -> tuple[list[float], dict[str, torch.Tensor]]:
    from partita.runtime.data import TokenSource
    from partita.runtime.models import build_model, materialize
    from partita.runtime.schedule import lm_loss
    from partita.runtime.train import lr_at, make_optimizer

    spec = plan.model_spec
    model = materialize(build_model(spec), device="cpu", seed=cfg.seed)
    if getattr(cfg, "init_from", None):
        from partita.runtime.hf_weights import load_into

        load_into(model, cfg.init_from, spec)
    optimizer = make_optimizer(model, cfg)
    data = TokenSource(cfg.data, vocab=spec.vocab, seq_len=plan.seq_len, global_batch=plan.global_batch, seed=cfg.seed)
    losses = []
    for step in range(cfg.steps):
        inputs, targets = data.batch(step)
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def interleaved(plan: Plan, chunks: list[list[int]], schedule: str = "interleaved-1f1b") -> Plan:
    """``plan`` under a schedule with several stages per rank (interleaved 1F1B by default):
    stage i's ranks run virtual stages of ``chunks[i]`` layers each, virtual stage c of stage i
    being the ``virtual_stage_index(i, c)``-th slice of the model in order (c * pp + i; the V
    under zbv)."""
    layers = plan.layer_strategies()
    placed = dataclasses.replace(plan, schedule=schedule)
    order = sorted((placed.virtual_stage_index(i, c), i, c) for i in range(plan.pp) for c in range(len(chunks[i])))
    per: dict[int, list] = {i: [] for i in range(plan.pp)}
    start = 0
    for _, i, c in order:  # chunk c of a stage comes after its chunks before c in both orders
        per[i].extend(layers[start:start + chunks[i][c]])
        start += chunks[i][c]
    assert start == len(layers), "the chunks must cover the model"
    stages = tuple(dataclasses.replace(s, layers=tuple(per[s.index]), chunks=tuple(chunks[s.index]))
                   for s in plan.stages)
    return dataclasses.replace(placed, stages=stages)


def assert_trains_like_one_process(plan: Plan, cfg, metrics_dir) -> None:
    """Train ``plan`` in its world of processes and in one process (``run_reference``): the
    losses, rank 0's gradient norms (before clipping) and every parameter agree, and training
    moved. ``cfg`` gets its metrics file in ``metrics_dir``."""
    import dataclasses

    path = Path(metrics_dir) / "metrics.jsonl"
    cfg = dataclasses.replace(cfg, metrics=str(path))
    losses, params = run_parallel(plan, cfg)
    assert_matches_one_process(plan, cfg, losses, params)


def assert_matches_one_process(plan: Plan, cfg, losses: list[float], params: dict) -> None:
    """What a parallel run of ``plan`` gave (its losses, every parameter by name, rank 0's
    gradient norms in ``cfg.metrics``) against one process (``run_reference``): they agree, and
    training moved."""
    import json

    import pytest

    ref_norms: list[float] = []
    ref_losses, ref_params = run_reference(plan, cfg, ref_norms)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    records = [json.loads(line) for line in Path(cfg.metrics).read_text().splitlines()]
    norms = [r["grad_norm"] for r in sorted(records, key=lambda r: r["step"]) if r["rank"] == 0]
    assert norms == pytest.approx(ref_norms, rel=1e-4)
    if "head.output.weight" in params and "head.output.weight" not in ref_params:  # a tied head's copy
        torch.testing.assert_close(params.pop("head.output.weight"), params["embed.tok.weight"], rtol=0, atol=0)
    assert set(params) == set(ref_params)
    for key, ref in ref_params.items():
        torch.testing.assert_close(params[key], ref, rtol=1e-4, atol=5e-5, msg=lambda m: f"{key}: {m}")
    assert losses[-1] != losses[0]  # training moved


def all_to_all_block_saved_bytes(rank: int, spec_dict: dict, batch: int, seq: int, layout: str = "contiguous",
                                 variant: str = "all_to_all") -> int:
    """On one of the world's ranks (``run_ranks``): the bytes autograd keeps for one block's
    backward when its attention runs all-to-all (or ``variant`` "all_gather", head_tail) over the
    world (a cp group), the rank holding ``seq / cp`` tokens of ``batch`` sequences."""
    from partita.model import ModelSpec
    from partita.profiler.memory import SavedTensors
    from partita.runtime import context
    from partita.runtime.models import build_layer, init_layer

    spec = ModelSpec.from_dict(spec_dict)
    holder = torch.nn.Module()
    block = build_layer(spec, "block", device="cpu")
    init_layer(block, "layers.0", seed=0, n_layers=spec.n_layers)
    holder.block = block
    if variant == "all_gather":
        context.apply_all_gather(holder, dist.group.WORLD)
    else:
        context.apply_all_to_all(holder, dist.group.WORLD, layout=layout)
    cp = dist.get_world_size()
    x = torch.randn(batch, seq // cp, spec.hidden, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    with SavedTensors(exclude=list(block.parameters())) as saved:
        y = block(x)
    y.sum().backward()
    return saved.nbytes
