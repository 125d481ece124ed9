"""The engine terms on three cases (docs/engines.md, issue 23): prints each as a table.

    python benchmarks/engines.py

1. A 175B GPT under ZeRO-3 alone (full recompute, global batch 1536, A100-80GB) at 384, 768 and
   1,536 GPUs: tokens/s a GPU as FSDP gathers (partita) and as DeepSpeed gathers (deepspeed).
2. GPT-2's head at micro-batch 40 x 2048 tokens: what the loss keeps and its transient, fp32 loss
   (torchtitan) against the chunked loss (partita).
3. Llama 3 405B on 1024x8xH100, seq 8192, global batch 2048, in Meta's layout (tp 8 x pp 16,
   interleaved 1F1B, the uniform grid's plan): its step under each engine, without recompute,
   and with FP8 products (``Plan.fp8``, the megatron engine).
"""

from __future__ import annotations

import dataclasses

from rich.console import Console
from rich.table import Table

from partita.cluster import parse_short
from partita.model import BUILTIN
from partita.search.costs.model import CostModel
from partita.search.engines import ENGINES, get_engine
from partita.search.evaluate import evaluate_layout, evaluate_plan
from partita.search.planner import PlanRequest, make_plan
from partita.search.plans import attach_prediction
from partita.search.uniform import SearchSpace, stage_layer_names, strategy

GiB = 2**30


def zero3_scaling(console: Console) -> None:
    model = BUILTIN["gpt3-175b"]
    names = stage_layer_names(model, [model.n_layers])[0]
    layers = [strategy(model, n, tp=1, sp=False, zero=3, recompute="full") for n in names]
    t = Table(title="175B GPT, ZeRO-3 alone, global batch 1536, A100-80GB: tokens/s a GPU")
    t.add_column("GPUs")
    for engine in ("partita", "deepspeed"):
        t.add_column(engine, justify="right")
    for gpus in (384, 768, 1536):
        cluster = parse_short(f"{gpus // 8}x8xA100-80GB")
        row = []
        for engine in ("partita", "deepspeed"):
            cm = CostModel(model, cluster, seq_len=2048, engine=ENGINES[engine])
            ev = evaluate_layout(cm, [(cluster.groups[0], layers)], dp=gpus, tp=1, micro_batch=1,
                                 num_micro_batches=1536 // gpus)
            row.append(f"{1536 * 2048 / ev.step_time_s / gpus:.0f}")
        t.add_row(str(gpus), *row)
    console.print(t)


def loss_memory(console: Console) -> None:
    model, cluster = BUILTIN["gpt2"], parse_short("1x8xA100-80GB")
    head = strategy(model, "head", tp=1, sp=False, zero=0, recompute="none")
    t = Table(title="GPT-2's head, micro-batch 40 x 2048 tokens (GiB)")
    for col in ("engine (loss)", "kept for the backward", "transient"):
        t.add_column(col, justify="right")
    for engine in ("torchtitan", "partita"):
        m = CostModel(model, cluster, seq_len=2048, engine=ENGINES[engine]).layer_memory(
            "head", "A100-80GB", head, dp=8, micro_batch=40, num_micro_batches=1)
        t.add_row(f"{engine} ({ENGINES[engine].loss})", f"{m.activations / GiB:.1f}", f"{m.transient / GiB:.1f}")
    console.print(t)


def llama3_layout(console: Console) -> None:
    model, cluster = BUILTIN["llama-3-405b"], parse_short("1024x8xH100")
    req = PlanRequest(model=model, cluster=cluster, seq_len=8192, global_batch=2048, search="uniform",
                      space=dataclasses.replace(SearchSpace(), tensor_parallel=(8,), pipeline=(16,),
                                                schedules=("interleaved-1f1b",)))
    plan, _ = make_plan(req)
    bare = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, layers=tuple(
        dataclasses.replace(l, recompute="none") for l in st.layers)) for st in plan.stages))
    t = Table(title=f"llama-3-405b on 1024x8xH100, {plan.mesh.describe()}, {plan.schedule} v {plan.virtual_stages}")
    for col in ("engine", "recompute", "step (s)", "peak / capacity (GiB)"):
        t.add_column(col, justify="right")
    exposed_tp = ENGINES["megatron"].with_options({"tp_overlap": False})
    for label, engine, p in (("partita", ENGINES["partita"], plan), ("megatron, tp exposed", exposed_tp, plan),
                             ("megatron", ENGINES["megatron"], plan), ("megatron", ENGINES["megatron"], bare),
                             ("megatron, FP8 products", get_engine("megatron", fp8=True), plan)):
        cm = CostModel(model, cluster, seq_len=8192, engine=engine)
        pred = attach_prediction(dataclasses.replace(p, engine=engine.name, fp8=engine.matmul == "fp8"), cm).prediction
        peak = max(pred.memory, key=lambda m: m.peak_bytes)
        recompute = "as planned" if p is plan else "none"
        t.add_row(label, recompute, f"{pred.step_time_s:.2f}",
                  f"{peak.peak_bytes / GiB:.1f} / {peak.capacity_bytes / GiB:.1f}")
    console.print(t)


def main() -> int:
    console = Console()
    zero3_scaling(console)
    loss_memory(console)
    llama3_layout(console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
