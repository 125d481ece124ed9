"""The zero-bubble schedules' split backward: what torch does (one weight-gradient call per
parameter tensor), the host term the cost model charges for it (``timing.split_backward_host_s``)
and the recorded measurement its constants come from (benchmarks/split_backward.py). Nothing
here times anything."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from partita.cluster import load_cluster
from partita.model_io import load_model
from partita.search import timing
from partita.search.costs.model import CostModel
from partita.search.costs.stage import choice_of
from partita.search.evaluate import evaluate_interleaved
from partita.search.interleaved import _counts, chunk_names
from partita.search.timing import layer_ops, param_tensors, split_backward_host_s, weight_groups
from partita.search.uniform import strategy

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "benchmarks" / "data" / "split_backward_cpu.json"


def test_the_committed_constants_are_the_recorded_fit():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import split_backward
    finally:
        sys.path.pop(0)
    data = json.loads(RECORDED.read_text())
    a, b = split_backward.fit(data["rows"], data["op_overhead_s"])
    assert (timing.SPLIT_GROUP_OPS, timing.SPLIT_NODE_OPS) == (pytest.approx(a, rel=0.01), pytest.approx(b, rel=0.01))
    for row in data["rows"]:  # the two constants describe every stack measured, 1 to 16 blocks
        modelled = split_backward_host_s(row["groups"], row["nodes"], data["op_overhead_s"])
        assert modelled == pytest.approx(row["extra_s"], rel=0.15), row["blocks"]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_torch_makes_one_weight_gradient_call_per_parameter_group(name):
    """``stage_backward_input`` groups the parameters by the intermediates their gradients come
    from: in the runtime's layers a module's weight and bias together (gpt2), what the cost
    model counts (``weight_groups``); llama's modules have no biases: a group per tensor."""
    from torch.distributed.pipelining._backward import stage_backward_input

    from partita.runtime.models import build_layer, init_layer

    spec = load_model(name)
    for role in ("block", "head"):
        layer = build_layer(spec, role, device="cpu")
        init_layer(layer, role, 0, n_layers=spec.n_layers)
        x = torch.randn(1, 8, spec.hidden, requires_grad=True)
        y = layer(x)
        _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], layer.parameters())
        assert len(groups) == weight_groups(spec.kinds[role]), role
        assert sum(len(g["params"]) for g in groups) == param_tensors(spec.kinds[role]), role


def _evaluate(cm, group_name: str, schedule: str, *, pp: int = 2, v: int = 2, mb: int = 1, m: int = 8):
    model = cm.model
    group = next(g for g in cm.cluster.groups if g.name == group_name)
    choice = {n: choice_of(model, strategy(model, n, tp=1, sp=False, zero=0, recompute="none"))
              for n in ("embed", "layers.0", "head")}
    names = chunk_names(model.n_layers, pp, v, schedule)
    stages = [(group, [_counts(chunk, choice) for chunk in stage]) for stage in names]
    return evaluate_interleaved(cm, stages, dp=1, tp=1, micro_batch=mb, num_micro_batches=m, schedule=schedule), stages


def _chunk_terms(cm, chunk) -> tuple[float, float]:
    """(split host term, host time of the backward's ops) of one virtual stage's counts."""
    k = cm.time_constants("cpu" if cm.cluster.is_cpu else cm.cluster.groups[0].device)
    groups = sum(n * weight_groups(cm.model.kinds[c[0]]) for c, n in chunk.items())
    nodes = sum(n * layer_ops(cm.model.kinds[c[0]])[0] for c, n in chunk.items())
    host = sum(n * layer_ops(cm.model.kinds[c[0]])[1] for c, n in chunk.items()) * k.op_overhead_s
    return split_backward_host_s(groups, nodes, k.op_overhead_s), host


def test_a_cpu_rank_adds_the_split_to_every_virtual_stage_but_torchs_first():
    cm = CostModel(load_model(str(ROOT / "benchmarks" / "data" / "calib-llama.yaml")), load_cluster("2xcpu"),
                   seq_len=128, dtype="fp32")
    plain, _ = _evaluate(cm, "cpu", "interleaved-1f1b")
    split, stages = _evaluate(cm, "cpu", "interleaved-zb")
    for i, (stage, (_, chunks)) in enumerate(zip(split.stages, stages)):
        extra = sum(_chunk_terms(cm, chunk)[0] for c, chunk in enumerate(chunks) if i or c)
        assert extra > 0
        assert stage.backward_s - plain.stages[i].backward_s == pytest.approx(extra)
        assert stage.time_s - plain.stages[i].time_s == pytest.approx(extra)
    assert split.step_time_s > plain.step_time_s * 0.9  # no longer the 0-cost split it was


def test_on_a_gpu_the_split_hides_behind_the_device_unless_the_host_binds():
    """A GPU's host runs ahead: a large model's backward is device-bound with the split's host
    work too, a tiny one's becomes the host's ops plus the split."""
    big = CostModel(load_model("llama-2-7b"), load_cluster("1x4xH100"), seq_len=4096, dtype="bf16")
    plain, _ = _evaluate(big, "h100", "interleaved-1f1b", pp=4)
    split, stages = _evaluate(big, "h100", "interleaved-zb", pp=4)
    for i, (_, chunks) in enumerate(stages):
        extra = sum(_chunk_terms(big, chunk)[0] for c, chunk in enumerate(chunks) if i or c)
        # the split's host ops at the mean op's cost (timing.OP_OVERHEAD_S): well under the device time
        assert 0 < extra < 0.3 * plain.stages[i].backward_s
        assert split.stages[i].backward_s == pytest.approx(plain.stages[i].backward_s)
    tiny = CostModel(load_model("tiny-llama"), load_cluster("1x2xH100"), seq_len=128, dtype="bf16")
    plain, _ = _evaluate(tiny, "h100", "interleaved-1f1b")
    split, stages = _evaluate(tiny, "h100", "interleaved-zb")
    _, chunks = stages[1]
    terms = [_chunk_terms(tiny, chunk) for chunk in chunks]
    host = sum(h for _, h in terms) + sum(e for e, _ in terms)
    assert host > plain.stages[1].backward_s
    assert split.stages[1].backward_s == pytest.approx(host)
