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


def test_the_engines_plan_stays_inside_the_request_s_options(tmp_path):
    """DeepSpeed sets one ZeRO level and one recomputation for all layers: Llama 3 8B on 16 A100 at
    --zero 1 searched to ZeRO 1 with 5 blocks selectively recomputed, which DeepSpeed cannot run;
    without recomputation it does not fit at ZeRO 1, and the closest plan used to be ZeRO 2 on
    every layer, a level the request left out. The engine's plan keeps to --zero (and every
    other option): here another shape at ZeRO 1."""
    import yaml

    from partita.cli import main
    from partita.search.uniform import SearchSpace

    out = tmp_path / "plan.yaml"
    args = ["plan", "--model", "llama-3-8b", "--cluster", "2x8xA100-80GB", "--seq-len", "4096",
            "--global-batch", "256", "--engine", "deepspeed", "-o", str(out)]
    assert main(args + ["--zero", "1"]) == 0
    layers = [layer for stage in yaml.safe_load(out.read_text())["stages"] for layer in stage["layers"]]
    assert {layer["zero"] for layer in layers} == {1}
    assert main(args) == 0  # unrestricted, the fastest plan DeepSpeed runs takes ZeRO 2
    assert {layer["zero"] for stage in yaml.safe_load(out.read_text())["stages"] for layer in stage["layers"]} == {2}
    from partita.plan import Plan
    plan = Plan.load(out)
    assert SearchSpace(zero_levels=(0, 1)).leaves(plan) == "ZeRO 2, which --zero leaves out"
    assert SearchSpace(zero_levels=(2,), tensor_parallel=(2,)).leaves(plan) == "tp 1, which --tp leaves out"
    assert SearchSpace().leaves(plan) is None


def test_deepspeed_s_plan_is_never_slower_than_the_best_uniform_plan_deepspeed_runs():
    """The uniform grid's best may recompute selectively, which DeepSpeed cannot (every block or
    none): the best uniform plan inside DeepSpeed's own options (``engine_uniform``, its export
    module's ``UNIFORM_SPACE``) is a candidate too. Llama 2 13B on 8 A100-40GB: the other
    candidates mapped to 42.76 s, the uniform plan DeepSpeed runs is 40.25 s (2026-12-07)."""
    from partita.cli.engine_fit import engine_uniform, uniform_candidate
    from partita.search.planner import cost_model

    model = load_model("llama-2-13b")
    req = PlanRequest(model=model, cluster=parse_short("1x8xA100-40GB"), seq_len=4096, global_batch=128,
                      engine="deepspeed", dtype="bf16")
    best, uni = make_plan(req)
    mine = engine_uniform(req, best)
    assert mine is not None and export_plan(mine, "deepspeed").changes == ()
    assert {l.recompute for l in mine.layer_strategies()} <= {"none", "full"}
    others = [p for p in [uniform_candidate(cost_model(req), best, uni)] if p is not None]
    without, _ = restrict_to_engine(best, "deepspeed", lambda k: others + _alternatives(req, best, k))
    chosen, _ = restrict_to_engine(best, "deepspeed", lambda k: others + [mine] + _alternatives(req, best, k))
    assert chosen.prediction.step_time_s <= mine.prediction.step_time_s * (1 + 1e-9)
    assert chosen.prediction.step_time_s < 0.97 * without.prediction.step_time_s


def test_megatron_and_deepspeed_run_a_1f1b_pipeline_on_fewer_micro_batches_than_stages(tmp_path):
    """torch's Schedule1F1B refuses fewer micro-batches than stages (Partita's runtime,
    torchtitan); Megatron-LM's 1F1B warms up min(pp - rank - 1, m) and DeepSpeed's TrainSchedule
    takes any m, as BLOOM's ramp-up ran one micro-batch on 12 stages. The rule book says so
    (``parallel.SHORT_PIPELINES``), the validator and the search follow it: at global batch 16
    on 12 stages of dp 2, Megatron and DeepSpeed plan 8 micro-batches of 1, torchtitan keeps
    16 on one replica."""
    import yaml

    from partita import parallel
    from partita.cli import main

    assert parallel.schedule_rule("1f1b", 12, 1, 1, "deepspeed") is None
    assert parallel.schedule_rule("1f1b", 12, 1, 8, "megatron") is None
    assert "at least as many micro-batches as ranks: 8 < 12" in parallel.schedule_rule("1f1b", 12, 1, 8, "torchtitan")
    assert parallel.schedule_rule("interleaved-1f1b", 12, 2, 8, "megatron") is not None  # 1F1B's only
    counts = {}
    for engine in ("deepspeed", "megatron", "torchtitan"):
        out = tmp_path / f"{engine}.yaml"
        assert main(["plan", "--model", "llama-2-70b", "--cluster", "12x8xA100-80GB", "--seq-len", "2048",
                     "--global-batch", "16", "--engine", engine, "--pp", "12", "--tp", "4", "-o", str(out)]) == 0
        plan = yaml.safe_load(out.read_text())
        counts[engine] = plan["num_micro_batches"]
    assert counts["deepspeed"] < 12 and counts["megatron"] < 12 and counts["torchtitan"] >= 12


def test_the_summary_says_when_the_uniform_yardstick_is_not_one_the_engine_runs(capsys, tmp_path):
    """The search's gain is measured against the uniform grid's best in Partita's space; after an
    engine's fit that plan may be faster than any the engine runs, and the line says so instead
    of reading as a search beaten by its own baseline."""
    from partita.cli import main

    assert main(["plan", "--model", "llama-3-8b", "--cluster", "2x8xA100-80GB", "--seq-len", "4096",
                 "--global-batch", "256", "--engine", "deepspeed", "-o", str(tmp_path / "p.yaml")]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("search:"))
    assert "the best uniform plan" in line and "which deepspeed does not run as it is" in line
