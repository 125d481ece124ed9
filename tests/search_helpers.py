"""What the search tests share: a two-layer model, a small search space, a two-type cluster,
and the brute-force oracle the CP-SAT search is held to (tests/test_search.py,
test_search_exact.py, test_primal.py, test_boundary_costs.py)."""

from __future__ import annotations

import itertools
from collections import Counter

from partita.cluster import ClusterSpec, make_group
from partita.devices import get_device
from partita.errors import InfeasibleError
from partita.model import ModelSpec
from partita.search import cpsat_problem
from partita.search.costs.model import CostModel
from partita.search.costs.stage import choice_of
from partita.search.evaluate import evaluate_counts, evaluate_plan
from partita.search.planner import PlanRequest, make_plan
from partita.search.uniform import SearchSpace, layout_price
from partita.units import GiB

SMALL = ModelSpec(name="small", family="llama", hidden=1024, n_layers=2, heads=8, kv_heads=4, ffn=4096, vocab=1024,
                  seq_len=512, default_global_batch=4)
SPACE = SearchSpace(zero_levels=(0, 3), sequence_parallel=(False,))


def two_type_cluster(mem_a_gib: float, mem_b_gib: float, n_a: int = 2, n_b: int = 2) -> ClusterSpec:
    return ClusterSpec(name="test", groups=(
        make_group(name="h100", device=get_device("H100"), nodes=1, gpus_per_node=n_a, memory_bytes=int(mem_a_gib * GiB)),
        make_group(name="a100", device=get_device("A100-80GB"), nodes=1, gpus_per_node=n_b, memory_bytes=int(mem_b_gib * GiB))))


def plan_small(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace = SPACE, global_batch: int = 4,
               search: str = "cpsat"):
    """``make_plan`` at the model's own sequence length: (plan, uniform baseline)."""
    req = PlanRequest(model=model, cluster=cluster, seq_len=model.seq_len, global_batch=global_batch,
                      search=search, space=space)
    return make_plan(req)


def brute_force_best(cm: CostModel, global_batch: int, space: SearchSpace) -> float | None:
    """The fastest plan that fits, by enumerating every shape, pipeline degree, stage
    placement, block split and multiset of per-block choices (blocks are identical); under
    ``space.price_cap`` only the placements whose devices cost at most that an hour."""
    best = None
    for shape in cpsat_problem.shapes(cm, global_batch, space):
        groups = [g for g in cm.cluster.groups if g.gpus_per_node % shape.tp == 0 and g.size >= shape.stage_size]
        if not groups:
            continue
        cap = {g.name: g.size // shape.stage_size for g in groups}
        choices = {r: [choice_of(cm.model, s.__class__(**{**s.to_dict(), "name": {"block": "layers.0"}.get(r, r)}))
                       for s in cpsat_problem.strategies_for(cm, r, shape, space)] for r in ("embed", "block", "head")}
        n = cm.model.n_layers
        for pp in range(1, min(n, sum(cap.values()), shape.num_micro_batches) + 1):  # 1F1B: m >= pp
            for seq in itertools.product(groups, repeat=pp):
                if any(Counter(g.name for g in seq)[k] > v for k, v in cap.items()):
                    continue
                if space.price_cap is not None and layout_price(seq, shape.stage_size) > space.price_cap:
                    continue
                for split in _compositions(n, pp):
                    per_stage = [list(itertools.combinations_with_replacement(choices["block"], k)) for k in split]
                    for blocks in itertools.product(*per_stage):
                        for e in choices["embed"]:
                            for h in choices["head"]:
                                stages = []
                                for i, (g, bl) in enumerate(zip(seq, blocks)):
                                    c = Counter(bl)
                                    if i == 0:
                                        c[e] += 1
                                    if i == pp - 1:
                                        c[h] += 1
                                    stages.append((g, c))
                                ev = evaluate_counts(cm, stages, dp=shape.dp, tp=shape.tp, micro_batch=shape.micro_batch,
                                                     num_micro_batches=shape.num_micro_batches)
                                if ev.fits and (best is None or ev.step_time_s < best):
                                    best = ev.step_time_s
    return best


def _compositions(n: int, k: int):
    """Ways to split n blocks into k stages of at least one block each."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + cuts + (n,)
        yield [bounds[i + 1] - bounds[i] for i in range(k)]


def assert_matches_oracle(model, cluster, space, global_batch):
    """The search's plan is as fast as the brute-force optimum (or both find nothing). Both
    judge memory by the evaluator."""
    cm = CostModel(model, cluster, seq_len=model.seq_len)
    best = brute_force_best(cm, global_batch, space)
    try:
        plan, _ = plan_small(model, cluster, space=space, global_batch=global_batch)
    except InfeasibleError:
        assert best is None
        return None
    assert best is not None
    got = evaluate_plan(plan, CostModel(model, cluster, seq_len=model.seq_len)).step_time_s
    # The solver optimises integer microseconds: per-layer rounding, at most
    # (m - 1 + pp) * (layers per stage + 1) / 2 us in all.
    tol = (plan.num_micro_batches - 1 + plan.pp) * (model.n_layers + 3) * 0.5e-6
    assert best - 1e-12 <= got <= best + tol
    # "optimal" is a proof: the bound meets the plan (no other shape's optimum beats it)
    assert plan.solver.status != "optimal" or plan.solver.gap <= tol / got
    return plan
