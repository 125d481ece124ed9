"""`partita plan --engine X`: the plan is one X runs as it is, so its export is the plan itself."""

import pytest

from partita.cli.engine_fit import restrict_to_engine
from partita.cli.export import export_plan
from partita.cli.plan import _alternatives
from partita.cluster import parse_short
from partita.model_io import load_model
from partita.search.planner import PlanRequest, make_plan


@pytest.mark.parametrize("engine", ["megatron", "torchtitan", "deepspeed"])
def test_the_engines_plan_exports_unchanged_and_keeps_a_true_bound(engine):
    model = load_model("llama-3-8b")
    req = PlanRequest(model=model, cluster=parse_short("2x8xH100"), seq_len=model.seq_len, global_batch=64,
                      engine=engine, dtype="bf16")
    best, _ = make_plan(req)
    chosen, note = restrict_to_engine(best, engine, lambda k: _alternatives(req, best, k))
    ex = export_plan(chosen, engine)
    assert ex.changes == () and ex.fits
    assert chosen.engine == engine
    assert chosen.prediction.step_time_s >= best.prediction.step_time_s * (1 - 1e-9)
    report = chosen.solver
    assert report.bound_us <= report.objective_us == round(chosen.prediction.step_time_s * 1e6)
    assert report.gap == pytest.approx((report.objective_us - report.bound_us) / report.objective_us)
    if note:  # the search's best used per-layer choices the engine cannot express
        assert report.status == "feasible" and f"--engine {engine}" in note


def test_the_engines_plan_is_never_slower_than_the_search_s_best_uniform_plan():
    """Megatron sets ZeRO and recomputation once for all layers, so the search's best (a per-layer
    mix) and the best plans of three other shapes may all map to slower plans; the uniform grid's
    best is a plan Megatron runs as it is and is a candidate too (``uniform_candidate``).
    Mixtral 8x7B on 32 H100: the mapped shapes gave 22.29 s where the uniform tp 2 x pp 2 plan is
    21.15 s (2026-12-07)."""
    from partita.cli.engine_fit import uniform_candidate
    from partita.search.planner import cost_model

    model = load_model("mixtral-8x7b")
    req = PlanRequest(model=model, cluster=parse_short("4x8xH100"), seq_len=4096, global_batch=1024,
                      engine="megatron", dtype="bf16")
    best, uni = make_plan(req)
    uniform = uniform_candidate(cost_model(req), best, uni)
    assert uniform is not None and uniform.prediction.step_time_s == pytest.approx(uni.best_eval.step_time_s)
    chosen, note = restrict_to_engine(best, "megatron", lambda k: [uniform] + _alternatives(req, best, k))
    assert export_plan(chosen, "megatron").changes == ()
    assert chosen.prediction.step_time_s <= uniform.prediction.step_time_s * (1 + 1e-9)
    assert chosen.prediction.step_time_s >= best.prediction.step_time_s * (1 - 1e-9)
