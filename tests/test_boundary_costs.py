"""What the cost model charges at a pipeline stage boundary under tensor parallelism (no torch).

Each rank sends and receives its b x s/tp x h sequence shard (``Plan.boundary_split``), and a
stage's end layer that is not sequence-parallel all-gathers it: the receiver's first layer in
forward, the sender's last in backward (``costs.stage.boundary_gathers``; the runtime's side is
measured in tests/test_runtime_boundary.py). The evaluator charges the transfers to both sides
and each gather to the stage that runs it; the schedule's receive buffers and kept outputs are
shards too. The CP-SAT model reads a stage's end blocks from its choices in the canonical order:
against the brute-force oracle of tests/test_search.py on a cluster whose slow tensor link makes
the gathers count, it finds the optimum and proves it ("optimal" only when the plan's evaluated
time is the model's).
"""

import itertools

import pytest

from partita.cluster import ClusterSpec, make_group, parse_short
from partita.devices import get_device
from partita.model import ModelSpec
from partita.model_io import load_model
from partita.plan import LayerStrategy, boundary_split
from partita.search.costs.memory import activation_message_bytes, receive_buffers
from partita.search.costs.model import CostModel
from partita.search.costs.stage import boundary_gather_s, boundary_gathers, boundary_s, choice_of
from partita.search.evaluate import evaluate_layout, evaluate_plan
from partita.search.uniform import SearchSpace
from partita.units import GiB
from search_helpers import brute_force_best, plan_small as _plan


def two_stages(model: ModelSpec, group, *, tp: int, sp_last: bool, sp_first: bool):
    """Two stages of tp-split layers, sequence-parallel but for the first stage's last block
    (``sp_last``) and the second stage's first block (``sp_first``)."""
    names = model.layer_names()
    half = len(names) // 2

    def layer(name: str, sp: bool) -> LayerStrategy:
        return LayerStrategy(name=name, tensor_parallel=tp, sequence_parallel=sp)

    first = [layer(n, True) for n in names[:half - 1]] + [layer(names[half - 1], sp_last)]
    second = [layer(names[half], sp_first)] + [layer(n, True) for n in names[half + 1:]]
    return [(group, first), (group, second)]


@pytest.mark.parametrize("sp_last,sp_first", list(itertools.product([True, False], repeat=2)))
def test_a_split_boundary_sends_shards_and_gathers_at_whole_ends(sp_last, sp_first):
    model, cluster = load_model("llama-2-7b"), parse_short("16xH100")
    cm = CostModel(model, cluster, seq_len=4096)
    g = cluster.groups[0]
    m = 4
    ev = evaluate_layout(cm, two_stages(model, g, tp=8, sp_last=sp_last, sp_first=sp_first), dp=1, tp=8,
                         micro_batch=1, num_micro_batches=m)
    shard = activation_message_bytes(cm, 1, 8)
    assert shard == activation_message_bytes(cm, 1) // 8 == 4096 // 8 * model.hidden * 2
    transfers = boundary_s(cm, g, g, dp=1, tp=8, micro_batch=1)
    gather = boundary_gather_s(cm, g, tp=8, micro_batch=1)
    assert transfers > 0 and gather > 0
    sender, receiver = ev.stages
    assert sender.send_s == transfers  # what the receiver pays as well
    assert sender.p2p_s == pytest.approx(transfers + (not sp_last) * gather)
    assert receiver.p2p_s == pytest.approx(transfers + (not sp_first) * gather)
    # the schedule's receive buffers (gradients on the first stage, activations on the second)
    # and the output the first keeps per micro-batch in flight: shards
    assert sender.pipeline_buffers == receiver.pipeline_buffers == receive_buffers(cm, m) * shard
    assert sender.output_per_mb == shard


def test_a_sequence_that_does_not_split_crosses_whole_and_gathers_nothing():
    model, cluster = load_model("llama-2-7b"), parse_short("16xH100")
    cm = CostModel(model, cluster, seq_len=4095)
    g = cluster.groups[0]
    assert boundary_split(4095, 8) == 1 and boundary_split(4096, 8) == 8 and boundary_split(4096, 1) == 1
    ev = evaluate_layout(cm, two_stages(model, g, tp=8, sp_last=False, sp_first=False), dp=1, tp=8, micro_batch=1,
                         num_micro_batches=4)
    whole = activation_message_bytes(cm, 1)
    assert activation_message_bytes(cm, 1, 8) == whole
    assert [s.p2p_s for s in ev.stages] == [boundary_s(cm, g, g, dp=1, tp=8, micro_batch=1)] * 2
    assert ev.stages[0].pipeline_buffers == receive_buffers(cm, 4) * whole


def test_boundary_gathers_by_end_layers():
    model = load_model("llama-2-7b")
    cm = CostModel(model, parse_short("16xH100"), seq_len=4096)

    def runs(*layers: LayerStrategy):
        return tuple((choice_of(model, l), 1, l.name) for l in layers)

    sp = dict(tensor_parallel=8, sequence_parallel=True)
    embed, head = LayerStrategy(name="embed", **sp), LayerStrategy(name="head", tensor_parallel=8)
    block = LayerStrategy(name="layers.0", tensor_parallel=8)
    replicated = LayerStrategy(name="layers.1")  # tensor_parallel 1 in a tp 8 stage: whole hidden states
    # the embedding receives tokens, the head sends nothing; a block that is not sequence-parallel gathers
    assert boundary_gathers(cm, runs(embed, block), tp=8, sends=True) == (0, 1)
    assert boundary_gathers(cm, runs(block, head), tp=8, sends=False) == (1, 0)
    assert boundary_gathers(cm, runs(replicated, block), tp=8, sends=True) == (1, 1)
    assert boundary_gathers(cm, runs(LayerStrategy(name="layers.0", **sp)), tp=8, sends=True) == (0, 0)
    assert boundary_gathers(cm, runs(embed, block, head), tp=8, sends=False) == (0, 0)  # no pipeline
    assert boundary_gathers(cm, runs(replicated, block), tp=1, sends=True) == (0, 0)  # nothing split


# A slow tensor link (PCIe at 4 GB/s) makes a boundary's gathers a visible part of a stage.
SMALL3 = ModelSpec(name="small3", family="llama", hidden=1024, n_layers=3, heads=8, kv_heads=4, ffn=4096, vocab=1024,
                   seq_len=512, default_global_batch=4)
SPACE = SearchSpace(zero_levels=(0,), recompute=("none", "full"), tensor_parallel=(2,))


def pcie_cluster(mem_gib: float) -> ClusterSpec:
    return ClusterSpec(name="pcie", groups=(make_group(name="h", device=get_device("H100"), nodes=1, gpus_per_node=4,
                                                       memory_bytes=int(mem_gib * GiB), intra_link="pcie",
                                                       intra_node_gbps=4.0),))


@pytest.mark.parametrize("mem_gib", [3.4, 3.6])
def test_cpsat_prices_the_end_gathers_as_the_evaluator(mem_gib):
    """Memory this tight takes tp 2 and two stages; the optimum has a block that is not
    sequence-parallel at a boundary, so its gathers are part of the objective the search must
    match (without them in the CP-SAT model, its proven optimum undercuts the plan returned and
    the report says "feasible")."""
    cluster = pcie_cluster(mem_gib)
    cm = CostModel(SMALL3, cluster, seq_len=SMALL3.seq_len)
    best = brute_force_best(cm, 4, SPACE)
    plan, _ = _plan(SMALL3, cluster, space=SPACE, global_batch=4)
    ev = evaluate_plan(plan, cm)
    assert plan.pp == 2 and plan.tp == 2
    assert sum(sum(boundary_gathers(cm, tuple((choice_of(SMALL3, l), 1, l.name) for l in s.layers), tp=2,
                                    sends=s.index == 0)) for s in plan.stages) >= 1
    assert ev.step_time_s == pytest.approx(best, rel=1e-9)
    assert plan.solver.status == "optimal"
