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
