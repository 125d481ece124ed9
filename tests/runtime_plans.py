"""The plans the runtime feature tests train (tests/test_runtime_parallel.py; the memory contract
of tests/test_runtime_memory.py measures the same ones) and the comparison they are held to:
after a few steps on CPU ranks, a plan's losses and parameters equal one process's
(``assert_same_training``; tests/test_runtime_schedules.py uses it for the zero-bubble plans)."""

import dataclasses

import torch

from partita.model import BUILTIN
from partita.runtime.train import TrainConfig
from runtime_helpers import make_plan, run_parallel, run_reference

CFG = TrainConfig(steps=2, warmup_steps=1, lr=1e-3)
# Four blocks are enough for uneven stages and keep the collectives few (the whole file should
# take well under three minutes on two cores); the mixed plans use the built-in six.
SMALL = dataclasses.replace(BUILTIN["tiny-llama"], name="tiny-llama-4", n_layers=4)

# The mixed plan: every per-layer choice, neighbours differing, on dp 2 x tp 2.
MIXED = {
    "embed": dict(tensor_parallel=2, sequence_parallel=True, zero=1),
    "layers.0": dict(tensor_parallel=2, sequence_parallel=True, zero=3, recompute="full"),
    "layers.1": dict(tensor_parallel=1, zero=0),
    "layers.2": dict(tensor_parallel=2, sequence_parallel=True, zero=2),
    "layers.3": dict(tensor_parallel=2, zero=1, recompute="full"),
    "layers.4": dict(tensor_parallel=1, zero=3, recompute="full"),
    "layers.5": dict(tensor_parallel=2, sequence_parallel=True, zero=0),
    "head": dict(tensor_parallel=2, sequence_parallel=True, zero=2),
}
TP2 = dict(tensor_parallel=2)

PLANS = {
    "dp-zero0": make_plan(SMALL, dp=2),
    "zero1": make_plan(SMALL, dp=2, layer=dict(zero=1)),
    "fsdp-zero2": make_plan(SMALL, dp=2, layer=dict(zero=2)),
    "fsdp-zero3": make_plan(SMALL, dp=2, layer=dict(zero=3)),
    "tp": make_plan(SMALL, tp=2, layer=TP2),
    "tp-sp": make_plan(SMALL, tp=2, layer=dict(TP2, sequence_parallel=True)),
    "recompute": make_plan(SMALL, dp=2, layer=dict(zero=3, recompute="full")),
    "pp-uneven": make_plan(SMALL, pp=2, boundaries=[1], num_micro_batches=4),
    "pp-tp": make_plan(SMALL, pp=2, tp=2, boundaries=[3], layer=dict(TP2, sequence_parallel=True), num_micro_batches=3,
                       per_layer={"layers.2": dict(TP2, sequence_parallel=True, recompute="full")}),
    "pp-fsdp": make_plan(SMALL, pp=2, dp=2, boundaries=[3], num_micro_batches=3,
                         layer=dict(zero=3), per_layer={"layers.1": dict(zero=1), "layers.3": dict(zero=3, recompute="full"),
                                                        "head": dict(zero=2)}),
    "mixed": make_plan(dp=2, tp=2, per_layer=MIXED),
    # Selective recomputation (the matrix products' outputs kept, the rest recomputed: the
    # sequence-parallel all-gathers and the TP reductions among it) under DP x TP+SP with FSDP2,
    # a block without SP beside the others; at ZeRO-3; and across a pipeline beside a block that
    # keeps everything.
    "selective": make_plan(SMALL, dp=2, tp=2, layer=dict(TP2, sequence_parallel=True, zero=1, recompute="selective"),
                           per_layer={"layers.2": dict(TP2, zero=1, recompute="selective")}),
    "selective-zero3": make_plan(SMALL, dp=2, tp=2, layer=dict(TP2, sequence_parallel=True, zero=3,
                                                               recompute="selective"),
                                 per_layer={"layers.2": dict(TP2, zero=3, recompute="selective")}),
    "pp-selective": make_plan(SMALL, pp=2, boundaries=[2], num_micro_batches=3, layer=dict(recompute="selective"),
                              per_layer={"layers.3": dict(recompute="none")}),
    "gpt2-mixed": make_plan("tiny-gpt2", dp=2, tp=2, per_layer={
        "embed": dict(tensor_parallel=2, sequence_parallel=True, zero=3),
        "layers.0": dict(tensor_parallel=2, sequence_parallel=True, zero=2, recompute="full"),
        "layers.1": dict(tensor_parallel=1, zero=0),
        "layers.2": dict(tensor_parallel=2, zero=1),
        "layers.3": dict(tensor_parallel=2, sequence_parallel=True, zero=3),
        "head": dict(tensor_parallel=2, sequence_parallel=True, zero=3)}),
}


def assert_same_training(plan, cfg=CFG):
    losses, params = run_parallel(plan, cfg)
    ref_losses, ref_params = run_reference(plan, cfg)
    if "head.output.weight" in params and "head.output.weight" not in ref_params:
        # a tied head on another stage than the embedding: its copy stays equal to the embedding
        torch.testing.assert_close(params.pop("head.output.weight"), params["embed.tok.weight"], rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    assert set(params) == set(ref_params)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-4, atol=5e-5, msg=lambda m: f"{name}: {m}")
    assert losses[-1] != losses[0]  # training moved
