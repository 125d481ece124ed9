"""The pipeline schedules' step time and in-flight counts against torch's own action lists
(``search/schedules.py``: the closed forms the search prices, the simulation of the schedule
torch runs)."""

import itertools
import random

import pytest

from partita.errors import PartitaError
from partita.parallel import schedule_layers_rule as check_layers, schedule_rule as check
from partita.runtime.actions import torch_actions
from partita.search.schedules import (chunk_in_flight, closed_form_s, held_moments, in_flight_chunks,
                                      pending_weight_grads, simulate)

pytest.importorskip("torch")


def stages_of_rank(schedule: str, rank: int, pp: int, v: int) -> tuple[int, ...]:
    """The stages rank ``rank`` holds, in torch's numbering (a V under zbv, a loop otherwise)."""
    if schedule == "zbv":
        return (rank, 2 * pp - 1 - rank)
    return tuple(rank + i * pp for i in range(v))



def _equal_ranks(schedule: str, pp: int, v: int, times: list[float]) -> tuple[list[float], list[float]]:
    """Per-stage forward and backward times (backward = 2 x forward) from per-rank times."""
    n = pp * v
    f, b = [0.0] * n, [0.0] * n
    for r in range(pp):
        for s in stages_of_rank(schedule, r, pp, v):
            f[s], b[s] = times[r] / 3 / v, 2 * times[r] / 3 / v
    return f, b


@pytest.mark.parametrize("pp,m", [(pp, pp * k) for pp in (2, 3, 4, 8) for k in (1, 2, 3)] + [(4, 2), (8, 5)])
def test_1f1b_step_and_in_flight_are_the_schedules(pp, m):
    acts = torch_actions("1f1b", pp, 1, m)
    f, b = _equal_ranks("1f1b", pp, 1, [3.0] * pp)
    sim = simulate(acts, f, b)
    assert sim.makespan_s == pytest.approx(closed_form_s("1f1b", [3.0] * pp, m, 1))
    assert sim.in_flight == tuple(in_flight_chunks("1f1b", r, pp, 1, m) for r in range(pp))


def _valid_m(schedule: str, pp: int, v: int) -> list[int]:
    """Every micro-batch count from pp to 3 pp that torch's schedule runs (not only multiples of pp)."""
    return [m for m in range(pp, 3 * pp + 1) if not check(schedule, pp, v, m)]


@pytest.mark.parametrize("pp,v,m", [(pp, v, m) for pp, v in itertools.product((2, 3, 4, 8), (2, 3, 4))
                                    for m in _valid_m("interleaved-1f1b", pp, v)])
def test_interleaved_step_and_in_flight_are_the_schedules(pp, v, m):
    acts = torch_actions("interleaved-1f1b", pp, v, m)
    f, b = _equal_ranks("interleaved-1f1b", pp, v, [3.0] * pp)
    sim = simulate(acts, f, b)
    assert sim.makespan_s == pytest.approx(closed_form_s("interleaved-1f1b", [3.0] * pp, m, v))
    assert sim.makespan_s == pytest.approx(m * 3.0 + (pp - 1) * 3.0 / v)  # the bubble, v times smaller
    assert sim.in_flight == tuple(in_flight_chunks("interleaved-1f1b", r, pp, v, m) for r in range(pp))


ZERO_BUBBLE_GRID = ([("interleaved-zb", pp, v, m) for pp, v in itertools.product((2, 3, 4, 8), (2, 3, 4))
                     for m in _valid_m("interleaved-zb", pp, v)]
                    + [("zbv", pp, 2, m) for pp in (2, 3, 4, 5, 8) for m in _valid_m("zbv", pp, 2)])


def _pending(acts) -> tuple[int, ...]:
    """Per rank, the most (stage, micro-batch) pairs between their I and their W."""
    out = []
    for row in acts:
        now = most = 0
        for a in row:
            now += {"I": 1, "W": -1}.get(a.kind, 0)
            most = max(most, now)
        out.append(most)
    return tuple(out)


@pytest.mark.parametrize("schedule,pp,v,m", ZERO_BUBBLE_GRID)
def test_zero_bubble_step_bubble_and_in_flight_are_the_schedules(schedule, pp, v, m):
    """The split backward with F = I = W (``schedules.FORWARD_SHARE``): the closed form's step
    and bubble, and the in-flight counts (a forward until its W), equal the simulation of
    torch's own action lists; the micro-batches between I and W too (ZB-V with fewer than
    2 pp - 1 micro-batches: never more than the count priced)."""
    acts = torch_actions(schedule, pp, v, m)
    sim = simulate(acts, *_equal_ranks(schedule, pp, v, [3.0] * pp), weight_share=0.5)
    step = closed_form_s(schedule, [3.0] * pp, m, v)
    assert sim.makespan_s == pytest.approx(step)
    assert sim.bubble_s == pytest.approx(step - m * 3.0)
    assert sim.in_flight == tuple(in_flight_chunks(schedule, r, pp, v, m) for r in range(pp))
    priced = tuple(pending_weight_grads(schedule, r, pp, m) for r in range(pp))
    if schedule == "zbv" and m < 2 * pp - 1:
        assert all(a <= b for a, b in zip(_pending(acts), priced))
    else:
        assert _pending(acts) == priced


def test_zero_bubble_bubbles_are_a_third_of_interleaved():
    """On equal ranks F = I = W: interleaved zero-bubble's bubble is (pp - 1) T / 3v, a third of
    interleaved 1F1B's, and ZB-V's (with m >= 2 pp - 1) the same as interleaved zero-bubble's at
    v = 2 — both below 1F1B's (pp - 1) T."""
    pp, m, t = 4, 8, 3.0
    bubble = {s: closed_form_s(s, [t] * pp, m, v) - m * t
              for s, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 2), ("zbv", 2))}
    assert bubble["1f1b"] == pytest.approx((pp - 1) * t)
    assert bubble["interleaved-zb"] == pytest.approx(bubble["interleaved-1f1b"] / 3)
    assert bubble["zbv"] == pytest.approx(bubble["interleaved-zb"]) == pytest.approx((pp - 1) * t / 6)


def test_closed_forms_never_undercut_the_schedule_with_unequal_ranks():
    rng = random.Random(7)
    for _ in range(120):
        pp, v = rng.choice((2, 3, 4, 8)), rng.choice((2, 3, 4))
        schedule = rng.choice(("1f1b", "interleaved-1f1b", "interleaved-zb", "zbv"))
        v = {"1f1b": 1, "zbv": 2}.get(schedule, v)
        m = rng.choice([m for m in range(pp, 3 * pp + 1) if not check(schedule, pp, v, m)])
        times = [rng.uniform(1.0, 3.0) for _ in range(pp)]
        f, b = _equal_ranks(schedule, pp, v, times)
        sim = simulate(torch_actions(schedule, pp, v, m), f, b, weight_share=0.5)
        assert closed_form_s(schedule, times, m, v) >= sim.makespan_s - 1e-9, (schedule, pp, v, m)


def test_zbv_places_the_stages_in_a_v():
    """Rank r holds torch stages r and 2 pp - 1 - r: the plan's chunk 1 of stage i is stage
    2 pp - 1 - i, so the first stage's ranks hold both ends (embedding and head)."""
    from partita.search.interleaved import chunk_names

    acts = torch_actions("zbv", 4, 2, 8)
    assert [sorted({a.stage for a in row}) for row in acts] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stages_of_rank("zbv", r, 4, 2) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    names = chunk_names(8, 4, 2, "zbv")
    assert names[0][0][0] == "embed" and names[0][1][-1] == "head"
    flat = [n for i, c in [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1)] for n in names[i][c]]
    assert flat == ["embed"] + [f"layers.{j}" for j in range(8)] + ["head"]


def test_a_zbv_plan_lists_its_layers_in_the_v():
    import dataclasses

    from runtime_helpers import interleaved, make_plan

    from partita.model import BUILTIN

    small = dataclasses.replace(BUILTIN["tiny-llama"], name="tiny-llama-4", n_layers=4)
    plan = interleaved(make_plan(small, pp=2, num_micro_batches=4), [[2, 1], [1, 2]], "zbv")
    assert [s.layer_names for s in plan.stages] == [["embed", "layers.0", "head"], ["layers.1", "layers.2", "layers.3"]]
    assert [plan.virtual_stage_index(i, c) for i in range(2) for c in range(2)] == [0, 3, 1, 2]
    assert [l.name for l in plan.layer_strategies()] == small.layer_names()


@pytest.mark.parametrize("layer,why", [
    (dict(zero=2), "zero >= 2"),
    (dict(zero=3), "zero >= 2"),
    (dict(recompute="full"), "recompute"),
    (dict(recompute="selective"), "recompute"),
])
def test_zero_bubble_refuses_what_the_split_backward_breaks(layer, why):
    """ZeRO 2/3 reduce (and reshard) before the weight gradients exist, recomputation would run
    a third forward: the validator refuses both in one line; 1F1B and interleaved 1F1B take them."""
    import dataclasses

    from runtime_helpers import interleaved, make_plan

    from partita.cluster import parse_short
    from partita.model import BUILTIN
    from partita.validate import validate_plan

    small = dataclasses.replace(BUILTIN["tiny-llama"], name="tiny-llama-4", n_layers=4)
    base = make_plan(small, pp=2, dp=2, num_micro_batches=4, layer=layer)
    for schedule in ("interleaved-zb", "zbv"):
        with pytest.raises(PartitaError, match=why) as e:
            validate_plan(interleaved(base, [[2, 1], [1, 2]], schedule), small, parse_short("4xcpu"))
        assert "\n" not in str(e.value) and schedule in str(e.value)
    validate_plan(interleaved(base, [[2, 1], [1, 2]]), small, parse_short("4xcpu"))
    assert check_layers("zbv", [("layers.0", 1, "none")]) is None


@pytest.mark.parametrize("args,why", [
    (("interleaved-1f1b", 4, 1, 8), "at least two stages per rank"),
    (("1f1b", 4, 2, 8), "one stage per rank"),
    (("zbv", 4, 3, 8), "two stages per rank"),
    (("interleaved-1f1b", 4, 2, 3), "at least as many micro-batches as ranks"),
    (("interleaved-1f1b", 4, 2, 9), "multiple of the rounds"),
    (("gpipe", 4, 1, 8), "unknown pipeline schedule"),
])
def test_what_torch_does_not_run_is_said(args, why):
    assert why in check(*args)
    with pytest.raises(PartitaError, match=why):
        torch_actions(*args)


def test_virtual_stages_split_the_blocks_evenly_in_pipeline_order():
    from partita.search.interleaved import chunk_names

    names = chunk_names(10, 2, 2)  # 10 blocks over 4 virtual stages: 3/2/2/3 in the order 0, 1, 2, 3
    assert names[0][0][0] == "embed" and names[1][1][-1] == "head"
    flat = [n for c in range(2) for i in range(2) for n in names[i][c]]
    assert flat == ["embed"] + [f"layers.{j}" for j in range(10)] + ["head"]
    assert all(any(n.startswith("layers.") for n in chunk) for stage in names for chunk in stage)


def test_the_planner_takes_an_interleaved_pipeline_when_it_is_faster():
    """llama-2-70b forced to 8 stages with few micro-batches: the bubble is large, and two
    virtual stages per rank beat the 1F1B optimum. The proof covers 1F1B only, so the plan says
    feasible, with a bound below it that holds for both schedules."""
    from partita.cluster import parse_short
    from partita.model_io import load_model
    from partita.search.costs.model import CostModel
    from partita.search.evaluate import evaluate_plan
    from partita.search.planner import PlanRequest, make_plan
    from partita.search.uniform import SearchSpace

    model, cluster = load_model("llama-2-70b"), parse_short("8x8xH100")
    plan, uni = make_plan(PlanRequest(model=model, cluster=cluster, seq_len=4096, global_batch=64,
                                      space=SearchSpace(pipeline=(8,))))
    # (v = 2 before selective recomputation joined the space, v = 4 with it; interleaved 1F1B,
    # or its zero-bubble variant since the runtime's receive buffers stopped growing with the
    # micro-batches, or ZB-V since the runtime reduces its column-parallel input gradients
    # beside the weight gradients: any of them is the point)
    assert plan.schedule in ("interleaved-1f1b", "interleaved-zb", "zbv") and plan.pp == 8
    assert plan.virtual_stages in (2, 4)
    assert plan.solver.status == "feasible" and plan.solver.bound_us <= plan.solver.objective_us
    ev = evaluate_plan(plan, CostModel(model, cluster, seq_len=4096))
    assert ev.step_time_s == pytest.approx(plan.prediction.step_time_s)
    # against the best uniform 1F1B plan of the same grid: a smaller bubble, a faster step
    assert plan.prediction.step_time_s < uni.best_eval.step_time_s
    assert plan.prediction.breakdown["pipeline_bubble"] < uni.best_eval.breakdown["pipeline_bubble"]


def test_the_planner_takes_a_zero_bubble_pipeline_when_it_is_faster():
    """llama-2-7b forced to 8 stages on one node, 16 micro-batches: ZeRO 0 and no recompute fit,
    and interleaved zero-bubble beats both 1F1B and interleaved 1F1B. Its bound (m W / pp)
    still holds below it, and the summary line says the schedule, v and the bubble's share."""
    from partita.cluster import parse_short
    from partita.cli.printing import bubble_text
    from partita.model_io import load_model
    from partita.search.costs.model import CostModel
    from partita.search.evaluate import evaluate_plan
    from partita.search.planner import PlanRequest, make_plan
    from partita.parallel import ZERO_BUBBLE
    from partita.search.uniform import SearchSpace

    model, cluster = load_model("llama-2-7b"), parse_short("1x8xH100")
    plan, uni = make_plan(PlanRequest(model=model, cluster=cluster, seq_len=4096, global_batch=16,
                                      space=SearchSpace(pipeline=(8,))))
    assert plan.schedule in ZERO_BUBBLE and plan.pp == 8
    assert all(l.zero <= 1 and l.recompute == "none" for l in plan.layer_strategies())
    assert plan.solver.status == "feasible" and plan.solver.bound_us <= plan.solver.objective_us
    ev = evaluate_plan(plan, CostModel(model, cluster, seq_len=4096))
    assert ev.step_time_s == pytest.approx(plan.prediction.step_time_s)
    assert plan.prediction.step_time_s < uni.best_eval.step_time_s
    share = 100 * plan.prediction.breakdown["pipeline_bubble"] / plan.prediction.step_time_s
    assert bubble_text(plan) == f"; bubble {share:.1f}% of the step" and 0 < share < 10


def test_a_zbv_layout_becomes_a_priced_plan():
    """A ZB-V layout is priced once, as ZB-V: priced first as a 1F1B plan, its last stage (which
    holds the middle of the model, not the head) made the memory model fail."""
    from partita.cluster import parse_short
    from partita.model_io import load_model
    from partita.search.costs.model import CostModel
    from partita.search.interleaved import InterleavedLayout, chunk_names
    from partita.search.plans import interleaved_to_plan
    from partita.search.uniform import strategy

    model, cluster = load_model("tiny-llama"), parse_short("2xcpu")
    cm = CostModel(model, cluster, seq_len=16)
    names = chunk_names(model.n_layers, 2, 2, "zbv")
    layers = tuple(tuple(strategy(model, n, tp=1, sp=False, zero=0, recompute="none") for c in stage for n in c)
                   for stage in names)
    layout = InterleavedLayout(stage_groups=(cluster.groups[0],) * 2, stage_layers=layers, dp=1, tp=1, micro_batch=1,
                               num_micro_batches=4, chunk_sizes=tuple(tuple(len(c) for c in s) for s in names),
                               schedule="zbv")
    plan = interleaved_to_plan(cm, layout, global_batch=4, solver=None)
    assert plan.schedule == "zbv" and plan.virtual_stages == 2 and plan.prediction.step_time_s > 0
    assert "head" in plan.stages[0].layer_names


def test_optimal_says_what_it_proves():
    """CP-SAT proves 1F1B pipelines; the other schedules' plans are bounded by their memory-aware
    bound (``interleaved_bound``): where it reaches the plan, 'optimal' covers every schedule
    (the 7B on 8 H100, whose work bound m x W / pp alone is below the plan), where it does not,
    'optimal' is said among 1F1B plans only (the 70B on 16 H100, 64 sequences a step); without pipelines it needs
    no such word."""
    from partita.cluster import parse_short
    from partita.model_io import load_model
    from partita.search.costs.model import CostModel
    from partita.search.interleaved import interleaved_search
    from partita.search.planner import PlanRequest, make_plan
    from partita.search.uniform import SearchSpace

    model, cluster = load_model("llama-2-7b"), parse_short("1x8xH100")
    req = PlanRequest(model=model, cluster=cluster, seq_len=model.seq_len, global_batch=64)
    plan, _ = make_plan(req)
    assert plan.solver.status == "optimal" and plan.solver.proven_among == ""
    work = interleaved_search(CostModel(model, cluster, seq_len=model.seq_len), global_batch=64, space=SearchSpace(),
                              candidates=[])
    assert work.bound_us < plan.solver.objective_us  # the work bound alone would not prove it
    big = load_model("llama-2-70b")
    plan, _ = make_plan(PlanRequest(model=big, cluster=parse_short("2x8xH100"), seq_len=big.seq_len,
                                    global_batch=64))
    assert plan.solver.status == "optimal" and plan.solver.proven_among == "1f1b"
    assert plan.solver.to_dict()["proven_among"] == "1f1b"
    flat, _ = make_plan(PlanRequest(model=model, cluster=cluster, seq_len=model.seq_len, global_batch=64,
                                    space=SearchSpace(pipeline=(1,))))
    assert flat.solver.status == "optimal" and flat.solver.proven_among == ""
    assert "proven_among" not in flat.solver.to_dict()


def _held_per_chunk(schedule: str, acts, pp: int, v: int) -> list[tuple[int, ...]]:
    """Each rank's most in-flight pairs of each of its virtual stages at once, on torch's lists
    (a forward holds one until its whole backward B, or its weight gradient W)."""
    out = []
    for r, row in enumerate(acts):
        stages = stages_of_rank(schedule, r, pp, v)
        held, most = dict.fromkeys(stages, 0), dict.fromkeys(stages, 0)
        for a in row:
            if a.kind == "F":
                held[a.stage] += 1
                most[a.stage] = max(most[a.stage], held[a.stage])
            elif a.kind in ("B", "W"):
                held[a.stage] -= 1
        out.append(tuple(most[s] for s in stages))
    return out


CHUNK_GRID = [(s, pp, v, m) for s in ("interleaved-1f1b", "interleaved-zb", "zbv") for pp in (2, 3, 4, 8)
              for v in (2, 3, 4) for m in (2, 4, 6, 8, 12, 16)
              if (s != "zbv" or v == 2) and not check(s, pp, v, m)]


@pytest.mark.parametrize("schedule,pp,v,m", CHUNK_GRID)
def test_in_flight_per_virtual_stage_bounds_torchs_lists(schedule, pp, v, m):
    """``schedules.chunk_in_flight``: exactly torch's per-virtual-stage maxima under interleaved
    1F1B; never below them under the zero-bubble schedules, and exact for the virtual stage that
    holds the head (the last stage's last chunk; under ZB-V the first stage's second); the total
    the rank's fullest moment holds (``schedules.held_moments``) is ``in_flight_chunks``."""
    seen = _held_per_chunk(schedule, torch_actions(schedule, pp, v, m), pp, v)
    for r in range(pp):
        got = chunk_in_flight(schedule, r, pp, v, m)
        assert sum(got) >= in_flight_chunks(schedule, r, pp, v, m)
        if schedule == "interleaved-1f1b":
            assert got == seen[r]
        else:
            assert all(g >= s for g, s in zip(got, seen[r]))
    head_rank, head_chunk = (0, 1) if schedule == "zbv" else (pp - 1, v - 1)
    assert chunk_in_flight(schedule, head_rank, pp, v, m)[head_chunk] == seen[head_rank][head_chunk]


@pytest.mark.parametrize("pp,v,m", [(pp, v, m) for _, pp, v, m in CHUNK_GRID if _ == "interleaved-1f1b"])
def test_held_moments_are_the_moments_of_torchs_lists(pp, v, m):
    """``schedules.held_moments`` (the interleaved 1F1B memory's moments): every (running virtual
    stage, pairs held) moment of torch's own action list is at most one of them, each of them is
    one of torch's, the fullest holds ``in_flight_chunks`` pairs and each virtual stage's most is
    ``chunk_in_flight``'s; the tensors only their sends hold grow to every send of the step."""
    acts = torch_actions("interleaved-1f1b", pp, v, m)
    for r, row in enumerate(acts):
        stages = stages_of_rank("interleaved-1f1b", r, pp, v)
        held, torch_moments = dict.fromkeys(stages, 0), set()
        for a in row:
            if a.kind not in ("F", "B"):
                continue
            held[a.stage] += a.kind == "F"
            torch_moments.add((stages.index(a.stage), tuple(held[s] for s in stages)))
            held[a.stage] -= a.kind == "B"
        ours = held_moments(r, pp, v, m)
        assert {(c, vec) for c, vec, _ in ours} <= torch_moments
        for c, vec in torch_moments:
            assert any(d == c and all(a >= b for a, b in zip(x, vec)) for d, x, _ in ours), (r, c, vec)
        assert max(sum(vec) for _, vec, _ in ours) == in_flight_chunks("interleaved-1f1b", r, pp, v, m)
        assert tuple(max(vec[c] for _, vec, _ in ours) for c in range(v)) == chunk_in_flight(
            "interleaved-1f1b", r, pp, v, m)
        sends = sum((c * pp + r < pp * v - 1) + (c * pp + r > 0) for c in range(v)) * m
        last = max(dead for _, _, dead in ours)
        assert last <= sends and last >= sends - (v * pp > 1) * 2  # the last backward's own sends come after it
