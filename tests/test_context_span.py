"""Context-parallel groups that span nodes (issue 25): cp x tp a multiple of the node, each tp
group inside one node, the K/V passes priced on the network."""

import subprocess
import sys

import pytest

from partita import parallel
from partita.cluster import parse_short
from partita.errors import PartitaError
from partita.model_io import load_model
from partita.search import context
from partita.search.costs.model import CostModel
from partita.search.evaluate import evaluate_plan
from partita.search.planner import PlanRequest, make_plan
from partita.search.uniform import SearchSpace
from partita.validate import _check_context_parallel, validate_plan


@pytest.mark.parametrize("cp, tp, gpn, ok", [
    (2, 4, 8, True), (2, 8, 8, True), (16, 8, 8, True), (4, 4, 8, True), (8, 1, 8, True),
    (3, 2, 8, False), (2, 8, 12, False), (4, 3, 8, False), (16, 3, 8, False)])
def test_a_cp_group_sits_in_a_node_or_spans_whole_nodes(cp, tp, gpn, ok):
    assert (parallel.cp_locality_rule(cp, tp, gpn) is None) == ok


def test_the_view_of_groups_across_nodes_merges_their_nodes():
    """tp 8 x cp 2 on nodes of 8: two nodes are one node of the view, holding one cp group's 8
    ranks (each two devices); a third node is left over."""
    view = context.cluster_view(parse_short("3x8xH100"), 2, span_tp=8)
    (g,) = view.groups
    assert (g.nodes, g.gpus_per_node) == (1, 8)
    assert g.price == 2 * parse_short("3x8xH100").groups[0].price
    inside = context.cluster_view(parse_short("3x8xH100"), 2)
    assert (inside.groups[0].nodes, inside.groups[0].gpus_per_node) == (3, 4)
    with pytest.raises(PartitaError, match="spans 4 nodes"):
        context.cluster_view(parse_short("2x8xH100"), 4, span_tp=8)


def _plan(cluster: str, **kw):
    model = load_model("llama-3-8b")
    req = PlanRequest(model=model, cluster=parse_short(cluster), seq_len=8192, global_batch=64,
                      context_parallel=(2,), space=SearchSpace(tensor_parallel=(8,)), **kw)
    plan, _ = make_plan(req)
    return model, req, plan


def test_tp8_cp2_on_two_nodes_plans_and_prices_the_ring_on_the_network():
    model, req, plan = _plan("2x8xH100")
    assert (plan.cp, plan.tp, plan.dp, plan.pp) == (2, 8, 1, 1)
    assert [len(s.ranks) for s in plan.stages] == [16]
    validate_plan(plan, model, req.cluster)
    fresh = evaluate_plan(plan, CostModel(model, req.cluster, seq_len=8192))
    assert fresh.step_time_s == pytest.approx(plan.prediction.step_time_s, rel=1e-9)
    # The same degrees inside one 16-GPU NVLink node: the K/V passes are cheaper there.
    _, _, one_node = _plan("16xH100")
    assert one_node.prediction.breakdown["context_parallel_comm"] < plan.prediction.breakdown["context_parallel_comm"]


def test_the_validator_refuses_a_cp_group_over_part_of_a_node():
    model, _, plan = _plan("2x8xH100")
    with pytest.raises(PartitaError, match="span whole nodes"):
        _check_context_parallel(plan, model, parse_short("2x12xH100"))


@pytest.mark.parametrize("flags, code, phrase", [
    (["--tp", "8", "--cp", "3"], 2, "spans whole nodes"),
    (["--tp", "8", "--cp", "4"], 3, "spans 4 nodes and no node group has more than 2")])
def test_cp_that_cannot_sit_is_one_line(flags, code, phrase):
    out = subprocess.run([sys.executable, "-m", "partita.cli", "plan", "--model", "llama-3-8b", "--cluster",
                          "2x8xH100", "--seq-len", "8192", *flags], capture_output=True, text=True, timeout=120)
    assert out.returncode == code, out.stderr
    assert phrase in out.stderr and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_llama3_128k_layout_plans_with_its_own_degrees_and_fits():
    """Llama 3 405B at 128K tokens: tp 8 x cp 16 x pp 16 on 16,384 H100 (a cp group of 128 GPUs
    over 16 nodes), as Llama 3 trained it."""
    model = load_model("llama-3-405b")
    req = PlanRequest(model=model, cluster=parse_short("2048x8xH100"), seq_len=131072, global_batch=128,
                      context_parallel=(16,), space=SearchSpace(tensor_parallel=(8,), pipeline=(16,)))
    plan, _ = make_plan(req)
    assert (plan.tp, plan.cp, plan.pp) == (8, 16, 16) and all(m.peak_bytes <= m.capacity_bytes for m in plan.prediction.memory)
    assert plan.prediction.breakdown["context_parallel_comm"] > 0


def test_a_global_batch_too_small_for_the_cluster_searches_cp_over_nodes():
    """The free search of a long sequence adds, for each tp, the least cp over nodes that lets
    global batch x tp x cp reach every device (``planner._reaching_degrees``), and no others."""
    from partita.search import planner

    model = load_model("llama-3-405b")
    req = PlanRequest(model=model, cluster=parse_short("2048x8xH100"), seq_len=131072, global_batch=128)
    assert planner._reaching_degrees(req) == [16, 32, 64, 128]
    spans = {(o.cp, o.span_tp) for o in planner.dimension_options(req, CostModel(model, req.cluster, seq_len=131072))
             if o.span_tp}
    assert spans == {(16, 8), (32, 4), (64, 2), (128, 1)}
    enough = PlanRequest(model=model, cluster=parse_short("128x8xH100"), seq_len=131072, global_batch=128)
    assert planner._reaching_degrees(enough) == []  # global batch x 8 already fills 1,024 GPUs
