"""Multi-process runtime tests on CPU/gloo: every plan feature against a single-process run.

After k steps, the loss and every parameter of a plan run in 2-4 processes equal those of the
same model trained on the same data in one process without parallelism. Parameters are
compared at atol 5e-5: AdamW divides by the gradient's running RMS, so fp32 reordering noise
in a near-zero gradient moves a weight by a visible fraction of the learning rate (1e-3).
"""

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")

from partita.runtime.train import TrainConfig  # noqa: E402
from runtime_helpers import interleaved, make_plan, run_parallel, run_reference  # noqa: E402
from runtime_plans import CFG, PLANS, SMALL, TP2, assert_same_training  # noqa: E402


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_trains_like_one_process(name):
    assert_same_training(PLANS[name])


@pytest.mark.parametrize("plan", [
    make_plan("tiny-gpt2", pp=2, boundaries=[2], num_micro_batches=2),
    make_plan("tiny-gpt2", pp=2, dp=2, boundaries=[1], num_micro_batches=2,
              per_layer={"embed": dict(zero=2), "head": dict(zero=2)}, layer=dict(zero=1)),
], ids=["pp2", "pp2-dp2-zero2"])
def test_tied_embeddings_across_stages_train_like_one_process(plan):
    """The embedding on the first stage and the head on the last keep one logical weight: the
    last stage's copy gets the same summed gradient and step, and the gradient norm counts it
    once, so training matches one process with the weight shared."""
    losses, params = run_parallel(plan, CFG)
    ref_losses, ref_params = run_reference(plan, CFG)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    copy = params.pop("head.output.weight")
    torch.testing.assert_close(copy, params["embed.tok.weight"], rtol=0, atol=0)  # the copies stay equal
    assert set(params) == set(ref_params)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-4, atol=5e-5, msg=lambda m: f"{name}: {m}")
    assert losses[-1] != losses[0]


def run_reference_names(plan):
    """The parameter names of one whole model (a tied head's weight is the embedding's)."""
    from partita.runtime.models import build_model

    return build_model(plan.model_spec).named_parameters()


@pytest.mark.parametrize("plan", [
    interleaved(make_plan(SMALL, pp=2, num_micro_batches=4), [[2, 1], [1, 2]]),
    interleaved(make_plan(SMALL, pp=2, dp=2, num_micro_batches=2, layer=dict(zero=3),
                          per_layer={"layers.1": dict(zero=1), "layers.2": dict(zero=2, recompute="full")}),
                [[2, 1], [1, 2]]),
    interleaved(make_plan(SMALL, pp=2, tp=2, num_micro_batches=4, layer=dict(TP2, sequence_parallel=True)),
                [[2, 1], [1, 2]]),
    interleaved(make_plan("tiny-gpt2", pp=2, num_micro_batches=2), [[1, 2], [2, 1]]),
], ids=["pp2-v2", "pp2-v2-fsdp", "pp2-v2-tp-sp", "pp2-v2-tied"])
def test_interleaved_pipeline_trains_like_one_process(plan):
    """Two virtual stages per rank (torch's ScheduleInterleaved1F1B): the same losses and
    parameters as one process; the tied model's two copies stay equal."""
    losses, params = run_parallel(plan, CFG)
    if "head.output.weight" in params and "head.output.weight" not in dict(run_reference_names(plan)):
        torch.testing.assert_close(params.pop("head.output.weight"), params["embed.tok.weight"], rtol=0, atol=0)
    ref_losses, ref_params = run_reference(plan, CFG)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    assert set(params) == set(ref_params)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-4, atol=5e-5, msg=lambda m: f"{name}: {m}")


def test_gqa_with_qkv_bias_under_tp():
    spec = dataclasses.replace(SMALL, name="tiny-qwen", qkv_bias=True)
    assert_same_training(make_plan(spec, tp=2, layer=dict(TP2, sequence_parallel=True)))


def _layouts_after_forward(rank, plan_dict):
    """Which blocks hold gathered (plain) weights after a forward, and how they are sharded."""
    from torch.distributed.tensor import DTensor

    from partita.plan import Plan
    from partita.runtime.train import Trainer

    from partita.runtime.parallelize import set_gradient_sync

    plan = Plan.from_dict(plan_dict)
    trainer = Trainer(plan, TrainConfig(steps=1), device=torch.device("cpu"))
    blocks = trainer.model.layers
    before = {k: str(b.feed_forward.w1.weight.placements) for k, b in blocks.items()}
    set_gradient_sync(trainer.runner.units, last_micro_batch=False)
    out = trainer.model(torch.zeros(plan.micro_batch, plan.seq_len, dtype=torch.long))
    gathered = {k: not isinstance(b.feed_forward.w1.weight, DTensor) for k, b in blocks.items()}
    out.float().pow(2).mean().backward()
    # after a micro-batch that is not the last: which blocks hold full (unreduced) gradients
    full_grads = {k: not isinstance(b.feed_forward.w1.weight.grad, DTensor) for k, b in blocks.items()}
    return before, gathered, full_grads


def test_zero_levels_shard_and_reshard_as_planned():
    zeros = {"layers.0": 0, "layers.1": 1, "layers.2": 2, "layers.3": 3}
    plan = make_plan(SMALL, dp=2, per_layer={n: dict(zero=z) for n, z in zeros.items()})
    from runtime_helpers import run_ranks

    before, gathered, full_grads = run_ranks(_layouts_after_forward, 2, plan.to_dict())[0]
    assert before["0"] == "(Replicate(), Shard(dim=0))"  # hybrid over (dp, dp_shard=1): replicated
    assert before["1"] == before["2"] == before["3"] == "(Shard(dim=0),)"
    # ZeRO 0-2 keep the gathered weights from forward to backward; ZeRO 3 frees them after forward.
    assert gathered == {"0": True, "1": True, "2": True, "3": False}
    # Before the last micro-batch, ZeRO 0/1 accumulate full gradients locally (no reduction
    # yet); ZeRO 2/3 have reduce-scattered theirs into shards.
    assert full_grads == {"0": True, "1": True, "2": False, "3": False}


@pytest.mark.parametrize("plan", [
    make_plan(SMALL, pp=2, boundaries=[1], dtype="bf16"),
    make_plan(SMALL, pp=2, dp=2, boundaries=[2], layer=dict(zero=1), dtype="bf16"),
    make_plan(SMALL, dp=2, layer=dict(zero=3, recompute="full"), dtype="fp16"),
    make_plan(SMALL, pp=2, boundaries=[2], num_micro_batches=3, dtype="fp16"),
], ids=["bf16-pp", "bf16-pp-fsdp", "fp16-fsdp", "fp16-pp"])
def test_mixed_precision_tracks_fp32(plan, tmp_path):
    """The GPU paths (FSDP2 mixed precision, half-precision activations between stages, fp16
    loss scaling) run on CPU ranks (the validator keeps CPU plans in fp32; the Trainer does not
    ask): fp32 master weights, losses close to the fp32 run."""
    cfg = dataclasses.replace(CFG, steps=3, metrics=str(tmp_path / "metrics.jsonl"))
    losses, params = run_parallel(plan, cfg)
    ref_norms = []
    ref_losses, ref_params = run_reference(plan, cfg, ref_norms)
    assert losses == pytest.approx(ref_losses, rel=1e-3)
    # gradients come back at their true size (fp16 loss scaling undone before clipping)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    norms = [r["grad_norm"] for r in sorted(records, key=lambda r: r["step"]) if r["rank"] == 0]
    assert norms == pytest.approx(ref_norms, rel=2e-2)
    for name, ref in ref_params.items():
        assert params[name].dtype == torch.float32
        torch.testing.assert_close(params[name], ref, rtol=0, atol=2e-2)
