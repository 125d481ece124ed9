"""The shape bound's shortcut (``cpsat_problem.fastest_candidates``): a layer's least time per
micro-batch over every strategy is reached at the lowest ZeRO level without recomputation, on
every cost model the search prices (dense, the engines, context and expert parallelism, CPU
ranks). If it were not, ``shape_bound_us`` could prune a shape holding the optimum."""

import itertools

import pytest

from partita import parallel
from partita.cluster import parse_short
from partita.model import BUILTIN
from partita.plan import LayerStrategy
from partita.search.costs.model import CostModel
from partita.search.cpsat_problem import fastest_candidates
from partita.search.engines import get_engine

VIEWS = {
    "dense": lambda: CostModel(BUILTIN["llama-2-70b"], parse_short("2x8xH100+2x8xA100-40GB"), seq_len=4096),
    "megatron": lambda: CostModel(BUILTIN["llama-2-13b"], parse_short("2x8xH100"), seq_len=4096, engine=get_engine("megatron")),
    "deepspeed": lambda: CostModel(BUILTIN["gpt3-175b"], parse_short("4x8xA100-80GB"), seq_len=2048,
                                   engine=get_engine("deepspeed")),
    "cp": lambda: CostModel(BUILTIN["llama-2-7b"], parse_short("2x8xH100"), seq_len=32768).at_cp(4, "all_gather"),
    "moe": lambda: CostModel(BUILTIN["mixtral-8x7b"], parse_short("4x8xH100"), seq_len=4096).at_ep(4, 1.3),
    "cpu": lambda: CostModel(BUILTIN["tiny-llama"], parse_short("4xcpu"), seq_len=64),
}


@pytest.mark.parametrize("view", list(VIEWS))
def test_the_fastest_strategy_is_among_the_candidates(view):
    cm = VIEWS[view]()
    for role, dp, tp, mb in itertools.product(("embed", "block", "head"), (1, 2, 8), (1, 2), (1, 2)):
        if parallel.tp_rule(cm.model.kinds[role], tp):
            continue
        strategies = [LayerStrategy(name=role, tensor_parallel=tp, sequence_parallel=sp, zero=z,
                                    recompute=rc if role == "block" else "none")
                      for sp in ((False, True) if tp > 1 else (False,)) for z in (0, 1, 2, 3)
                      for rc in ("none", "selective", "full")
                      if not (cm.model.is_moe and role == "block" and tp > 1 and not sp)]
        for subset in (strategies, [s for s in strategies if s.zero >= 2], [s for s in strategies
                                                                          if s.recompute != "none"]):
            if not subset:
                continue
            for g in cm.cluster.groups:
                time = lambda s: cm.layer_time(role, g, s, dp=dp, micro_batch=mb).total_s  # noqa: E731
                assert min(map(time, fastest_candidates(subset))) == min(map(time, subset)), (view, role, dp, tp, mb)
    assert fastest_candidates([]) == []
