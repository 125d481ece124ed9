"""Pipeline stage boundaries under tensor parallelism: what crosses them, measured on CPU ranks.

With tensor parallelism (tp > 1) each rank of a stage sends its sequence shard, b x s/tp x h,
to its peer on the next stage, and gets the gradient of that shard back (``Plan.boundary_split``;
whole hidden states where the sequence does not split tp ways). A stage's end layer that is
sequence-parallel takes or gives the shard as it is; one that is not all-gathers it: the
receiver's first layer in forward, the sender's last layer in backward
(``runtime.parallelize.apply_stage_ends``). The cost model prices exactly that
(``search.costs.stage.boundary_s``, ``boundary_gathers``, ``search.costs.memory.pipeline_memory``). Each gloo run here
trains a tp 2 x pp 2 plan (1F1B, interleaved, ZB-V; llama and gpt2; with and without sequence
parallelism; ends that differ) and checks, on every rank:

* training: the losses, rank 0's gradient norms and every parameter equal one process's
  (``runtime_helpers.run_reference``), at ``test_runtime_parallel``'s tolerances;
* sends: every tensor a rank's stages send (the schedule's ``P2POp``s, forward and backward)
  has b x s/tp x h elements, and there is one per micro-batch for each boundary the rank's
  stages send across (a ZB-V turn stays on its rank: no send);
* receive buffers: the bytes of the schedule's receive buffers (``PipelineRunner.receive_buffers``)
  equal the plan's ``pipeline_buffers`` exactly;
* all-gathers: each rank counts the all-gathers its steps dispatch (DTensor's collectives run
  the functional ``all_gather_into_tensor``; a dispatch mode counts them). Layers that are not
  sequence-parallel gather nothing else, so a plan without sequence parallelism gathers exactly
  the boundaries' gathers; with it, the pipeline gathers what one stage holding the same layers
  gathers, less its one conversion where the two ends' layouts differ, plus the boundary's
  gathers the cost model counts.

Nothing depends on timing: every comparison is of values or counts, and the schedules' orders
are fixed.
"""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from partita.cluster import parse_short  # noqa: E402
from partita.model import BUILTIN
from partita.plan import Plan, gives_whole  # noqa: E402
from partita.runtime.train import TrainConfig  # noqa: E402
from partita.search.costs.model import CostModel  # noqa: E402
from partita.search.costs.stage import boundary_gathers, choice_of  # noqa: E402
from partita.search.evaluate import evaluate_plan  # noqa: E402
from runtime_helpers import assert_matches_one_process, interleaved, make_plan, run_ranks  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

CFG = TrainConfig(steps=2, warmup_steps=1, lr=1e-3)
SMALL = dataclasses.replace(BUILTIN["tiny-llama"], name="tiny-llama-4", n_layers=4)
TP2 = dict(tensor_parallel=2)
SP = dict(tensor_parallel=2, sequence_parallel=True)
STAGE0 = ("embed", "layers.0", "layers.1")  # the first stage's layers at boundaries=[2]


def ends(first: dict, second: dict, extra: dict[str, dict] | None = None) -> Plan:
    """tp 2 x pp 2 with the first stage's layers (embed, blocks 0-1) at ``first``, the second
    stage's (blocks 2-3, head) at ``second``, and single layers at ``extra``."""
    per_layer = {name: first for name in STAGE0} | (extra or {})
    return make_plan(SMALL, pp=2, tp=2, boundaries=[2], layer=second, per_layer=per_layer)


PLANS = {
    # The four pairs of end layouts at the boundary (sender's last, receiver's first); the
    # receiver's first block recomputes: its gather runs once, outside the recomputation.
    "seq-seq": ends(SP, SP),
    "full-full": ends(TP2, TP2, {"layers.2": dict(TP2, recompute="full")}),
    "seq-full": ends(SP, TP2),
    "full-seq": ends(TP2, SP),
    # Layers not split inside a tensor-parallel stage: replicated over the tensor group, their
    # boundaries still carry shards (gathered on both sides).
    "replicated-layers": make_plan(SMALL, pp=2, tp=2, boundaries=[2]),
    # A sequence that does not split tp ways: whole hidden states, no gathers.
    "seq-15": make_plan(SMALL, pp=2, tp=2, boundaries=[2], seq_len=15, layer=TP2),
    # gpt2: learned positions added in the embedding, the tied embedding on another stage than
    # the head; a first stage holding only the embedding (a reduce to whole, then a slice).
    "gpt2-sp": make_plan("tiny-gpt2", pp=2, tp=2, boundaries=[2], layer=SP),
    "gpt2-embed-alone": make_plan("tiny-gpt2", pp=2, tp=2, boundaries=[0], layer=TP2),
    # Virtual stages: each ends at a boundary. Interleaved 1F1B without sequence parallelism,
    # gpt2's with it (its first virtual stage the embedding alone), and ZB-V, whose turn on the
    # last stage hands the shard over on the rank.
    "interleaved": interleaved(make_plan(SMALL, pp=2, tp=2, num_micro_batches=4, layer=TP2), [[2, 1], [1, 2]]),
    "gpt2-interleaved-sp": interleaved(make_plan("tiny-gpt2", pp=2, tp=2, num_micro_batches=2, layer=SP),
                                       [[1, 2], [2, 1]]),
    "zbv": interleaved(make_plan(SMALL, pp=2, tp=2, num_micro_batches=4, layer=TP2), [[2, 1], [1, 2]], "zbv"),
}


class AllGathers(TorchDispatchMode):
    """Counts the all-gathers dispatched while it is active, backward included (DTensor's
    redistributions and FSDP2 both dispatch one of these ops)."""

    OPS = ("_c10d_functional.all_gather_into_tensor", "_c10d_functional.all_gather_into_tensor_coalesced",
           "c10d._allgather_base_", "c10d.allgather_", "c10d.allgather_into_tensor_coalesced_")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket._qualified_op_name.replace("::", ".") in self.OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _train_and_watch(rank: int, plan_dict: dict, cfg: TrainConfig) -> dict:
    """Train the plan on this rank, recording the tensors its stages send, the all-gathers its
    steps run and its receive buffers; the parameters and summary as ``runtime_helpers``."""
    from partita.runtime.train import Trainer
    from runtime_helpers import full_parameters

    trainer = Trainer(Plan.from_dict(plan_dict), cfg, device=torch.device("cpu"))
    runner = trainer.runner
    sends = {"forward": [], "backward": []}  # the elements of each tensor sent
    for stage in getattr(runner, "stages", ()):  # a pipeline's (the one-stage runner sends nothing)
        for method, direction in (("get_fwd_send_ops", "forward"), ("get_bwd_send_ops", "backward")):
            def recorded(*args, _inner=getattr(stage, method), _sent=sends[direction], **kwargs):
                ops = _inner(*args, **kwargs)
                _sent.extend(op.tensor.numel() for op in ops)
                return ops

            setattr(stage, method, recorded)
    gathers = AllGathers()
    step = runner.run

    def counted(*args, **kwargs):
        with gathers:
            return step(*args, **kwargs)

    runner.run = counted
    summary = trainer.fit()
    buffers = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in runner.receive_buffers()}
    return {"stage": trainer.meshes.place.stage.index, "params": full_parameters(trainer.model),
            "summary": summary.to_dict() if summary else None, "sends": sends, "gathers": gathers.count,
            "buffer_bytes": sum(buffers.values()), "receive_peak": runner.receive_peak_bytes()}


def expected_sends(plan: Plan, stage: int) -> dict[str, int]:
    """Tensors a rank of ``stage`` sends a step, by direction: one per micro-batch for each
    of its virtual stages whose neighbour (the next in forward, the one before in backward) is
    on another rank."""
    n = plan.pp * plan.virtual_stages
    own = {plan.virtual_stage_index(stage, c) for c in range(plan.virtual_stages)}
    m = plan.num_micro_batches
    return {"forward": m * sum(k + 1 < n and k + 1 not in own for k in own),
            "backward": m * sum(k > 0 and k - 1 not in own for k in own)}


def predicted_gathers(plan: Plan) -> int:
    """The boundary all-gathers the cost model counts for one step, summed over the pipeline's
    (virtual) stages, per rank of a tensor group (``costs.stage.boundary_gathers``)."""
    cm = CostModel(plan.model_spec, parse_short(plan.cluster["name"]), seq_len=plan.seq_len)
    chunks = plan.virtual_stage_layers()
    total = 0
    for k, layers in enumerate(chunks):
        runs = tuple((choice_of(cm.model, l), 1, l.name) for l in layers)
        total += sum(boundary_gathers(cm, runs, tp=plan.tp, sends=k + 1 < len(chunks)))
    return plan.num_micro_batches * total


def one_stage(plan: Plan) -> Plan:
    """The same layers and batch on one stage of ``plan.tp`` ranks."""
    stage = dataclasses.replace(plan.stages[0], ranks=tuple(range(plan.tp)), layers=tuple(plan.layer_strategies()),
                                chunks=())
    return dataclasses.replace(plan.with_mesh(pp=1), schedule="1f1b", stages=(stage,))


def layout_changes(plan: Plan) -> int:
    """Where one stage holding ``plan``'s layers converts between them at the places the pipeline
    cuts: one all-gather each where the two layers' layouts differ (in forward from sequence
    shards to whole, in backward the other way)."""
    chunks = plan.virtual_stage_layers()
    whole = lambda l: gives_whole(l.tensor_parallel, l.sequence_parallel)  # noqa: E731
    return sum(whole(a[-1]) != whole(b[0]) for a, b in zip(chunks, chunks[1:]))


def watch(plan: Plan, tmp_path) -> list[dict]:
    """Train ``plan`` on its ranks (``_train_and_watch``), check it trains like one process, and
    return what each rank saw."""
    cfg = dataclasses.replace(CFG, metrics=str(tmp_path / "metrics.jsonl"))
    ranks = run_ranks(_train_and_watch, plan.world_size, plan.to_dict(), cfg)
    losses = next(r["summary"]["losses"] for r in ranks if r["summary"] is not None)
    assert_matches_one_process(plan, cfg, losses, {name: p for r in ranks for name, p in r["params"].items()})
    return ranks


@pytest.mark.parametrize("name", list(PLANS))
def test_a_boundary_carries_the_priced_shards_and_trains_like_one_process(name, tmp_path):
    plan = PLANS[name]
    spec = plan.model_spec
    cm = CostModel(spec, parse_short(plan.cluster["name"]), seq_len=plan.seq_len)
    buffers = {s.index: cost.pipeline_buffers for s, cost in zip(plan.stages, evaluate_plan(plan, cm).stages)}
    shard = plan.micro_batch * (plan.seq_len // plan.boundary_split) * spec.hidden
    assert plan.boundary_split == (1 if plan.seq_len % 2 else 2)
    ranks = watch(plan, tmp_path)
    for rank, seen in enumerate(ranks):
        stage = seen["stage"]
        for direction, want in expected_sends(plan, stage).items():
            assert seen["sends"][direction] == [shard] * (CFG.steps * want), f"rank {rank} (stage {stage}) {direction}"
        # Receive buffers hold memory while a transfer needs them, never between steps, and at
        # most what the model prices (one per direction and virtual stage: ``receive_buffers``).
        assert seen["buffer_bytes"] == 0, f"rank {rank} (stage {stage}) holds receive buffers after the step"
        receives = sum(expected_sends(plan, other)[d] for other in range(plan.pp) for d in ("forward", "backward")
                       if other != stage) > 0
        assert (seen["receive_peak"] > 0) == receives, f"rank {rank} (stage {stage}) receive buffers"
        assert seen["receive_peak"] <= buffers[stage], f"rank {rank} (stage {stage}) receive buffers"
    gathers = sum(seen["gathers"] for seen in ranks)
    boundary = CFG.steps * plan.tp * predicted_gathers(plan)  # the tensor groups' boundary gathers, by the model
    if not any(l.sequence_parallel for l in plan.layer_strategies()):
        assert gathers == boundary  # nothing but the boundaries gathers
    else:  # the layers gather too: as many as on one stage, less its conversions where the pipeline cuts
        alone = sum(seen["gathers"] for seen in run_ranks(_train_and_watch, plan.tp, one_stage(plan).to_dict(), CFG))
        changes = CFG.steps * plan.tp * plan.num_micro_batches * layout_changes(plan)
        assert gathers == alone - changes + boundary
