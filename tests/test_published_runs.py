"""benchmarks/published_runs.yaml is well formed and every run Partita can express gets a finite
prediction from the cost model. The yardstick does not move with the cost model it measures: the
file's numbers are the sources', and one test holds the cost model to issue 10's target on them."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import yaml

from partita.errors import PartitaError
from partita.search.engines import ENGINES

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load_module():
    spec = importlib.util.spec_from_file_location("published_runs", BENCHMARKS / "published_runs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


pr = _load_module()
RUNS = pr.load_runs(BENCHMARKS / "published_runs.yaml")
RAW = yaml.safe_load((BENCHMARKS / "published_runs.yaml").read_text())


def test_the_file_holds_between_8_and_400_runs_with_unique_ids():
    assert 8 <= len(RUNS) <= 400
    assert len({r.id for r in RUNS}) == len(RUNS)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.id)
def test_every_run_names_its_source(run):
    for key in ("title", "where", "url"):
        assert run.source[key].strip()
    assert run.source["url"].startswith("https://")


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.id)
def test_every_run_is_one_consistent_layout(run):
    assert run.tp * run.cp * run.pp * run.dp == run.cluster.world_size
    assert run.global_batch % (run.dp * run.micro_batch) == 0
    assert run.measured.value > 0
    assert run.pricing in pr.PRICINGS
    assert (run.pricing == "closest") == bool(run.differences)
    assert (run.pricing == "not_expressible") == bool(run.why)


@pytest.mark.parametrize("run", [r for r in RUNS if r.pricing != "not_expressible"], ids=lambda r: r.id)
def test_every_expressible_run_gets_a_finite_prediction(run):
    row = pr.price(run)
    for value in (row.predicted_tokens_per_s_per_gpu, row.predicted_step_time_s, row.error_pct, row.predicted_mfu,
                  row.measured_tokens_per_s_per_gpu):
        assert value is not None and math.isfinite(value)
    assert row.predicted_tokens_per_s_per_gpu > 0 and row.predicted_step_time_s > 0


@pytest.mark.parametrize("run", [r for r in RUNS if r.pricing == "not_expressible"], ids=lambda r: r.id)
def test_a_run_partita_cannot_express_is_listed_not_priced(run):
    row = pr.price(run)
    assert row.predicted_tokens_per_s_per_gpu is None and row.error_pct is None
    assert row.remark.startswith("not expressible: ")


def test_the_three_published_metrics_become_tokens_per_second_per_gpu():
    by_id = {r.id: r for r in RUNS}
    bloom = by_id["bloom-176b-384xA100"]  # 104.70 s per step of 2048 x 2048 tokens on 384 GPUs
    assert pr.measured_tokens_per_s_per_gpu(bloom) == pytest.approx(2048 * 2048 / (104.70 * 384))
    tt = by_id["tt-llama3-70b-64xA100-fsdp"]
    assert pr.measured_tokens_per_s_per_gpu(tt) == 331
    # Megatron's 1T row: 96 l h^2 (1 + s/6h + V/16lh) FLOPs per token at 163 TFLOP/s
    one_t = by_id["megatron-1t-3072xA100"]
    per_token = 96 * 128 * 25600**2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600))
    assert pr.measured_tokens_per_s_per_gpu(one_t) == pytest.approx(163e12 / per_token)


def test_a_palm_flops_figure_counts_six_n_and_attention_over_the_whole_sequence():
    """Llama 3's TFLOP/s (PaLM's model FLOPs, 6 N + 12 L H s a token) give back the paper's own
    MFU column over the H100's 989 TFLOP/s: 43 % and 38 % at 8,192 and 131,072 tokens."""
    by_id = {r.id: r for r in RUNS}
    run = by_id["llama3-405b-8192xH100-3d"]
    m = run.model
    per_token = 6 * m.n_params + 12 * m.n_layers * m.hidden * run.seq_len
    assert pr.measured_tokens_per_s_per_gpu(run) == pytest.approx(430e12 / per_token)
    for rid, paper in (("llama3-405b-8192xH100-3d", 0.43), ("llama3-405b-16384xH100-cp16", 0.38)):
        r = by_id[rid]
        assert pr.mfu(r, pr.measured_tokens_per_s_per_gpu(r)) == pytest.approx(paper, abs=0.006)


def test_an_interleaved_run_is_priced_with_its_virtual_stages():
    """A run's schedule and virtual stages reach the evaluator: Llama 3's 8,192-GPU layout with
    eight one-block slices a rank (the embedding alone in the first, the head alone in the last)
    has a smaller bubble than the same layout with two, and than plain 1F1B."""
    run = {r.id: r for r in RUNS}["llama3-405b-8192xH100-3d"]
    assert (run.schedule, run.virtual_stages) == ("interleaved-1f1b", 8)
    bubbles = [pr.evaluate_run(dataclasses.replace(run, schedule=s, virtual_stages=v)).breakdown["pipeline_bubble"]
               for s, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 8))]
    assert bubbles[0] > bubbles[1] > bubbles[2] > 0
    assert "interleaved-1f1b v8" in run.config


def test_a_mixture_of_experts_run_is_priced_with_its_expert_parallelism():
    """Mixtral 8x7B under Megatron-Core at ep 8: its TFLOP/s as Megatron counts them (the two routed
    experts of every token) give back its 44 % of the H100's peak, the all-to-alls reach the
    prediction, and an ep that does not divide dp or the experts is refused."""
    run = {r.id: r for r in RUNS}["mcore-mixtral-8x7b-64xH100-ep8"]
    assert run.ep == 8 and "ep8" in run.config
    m = run.model
    per_token = (12 * m.n_layers * m.hidden ** 2 * (1 + m.kv_heads / m.heads + run.seq_len / m.hidden
                                                    + m.ffn / m.hidden * m.experts_per_token * 1.5)
                 + 6 * m.vocab * m.hidden)
    assert pr.measured_tokens_per_s_per_gpu(run) == pytest.approx(438e12 / per_token)
    assert pr.measured_tokens_per_s_per_gpu(run) * per_token / 989e12 == pytest.approx(0.443, abs=0.001)
    at_ep = pr.evaluate_run(run).step_time_s
    at_one = pr.evaluate_run(dataclasses.replace(run, ep=1)).step_time_s
    assert at_ep != at_one
    index = next(i for i, r in enumerate(RAW["runs"]) if r["id"] == run.id)
    # the plan validator's rule (parallel.ep_rule): ep divides the experts and dp
    for changes, message in ((dict(ep=16), r"experts \(8\) are not divisible by expert-parallel degree 16"),
                             (dict(ep=3), r"experts \(8\) are not divisible by expert-parallel degree 3"),
                             (dict(ep=8, pp=16, dp=4, virtual_stages=2),
                              r"data-parallel degree 4 is not divisible by expert-parallel degree 8")):
        data = _with(index, **changes)
        with pytest.raises(PartitaError, match=message):
            pr.run_from_dict(data["runs"][0], "runs[0]")


def test_a_context_parallel_run_is_priced_on_its_cp_view():
    """Llama 3 405B at 131,072 tokens (Table 4): tp 8 x cp 16 spans 16 nodes, each cp rank holds
    8,192 tokens, and its K/V all-gathers are priced (search/context.py); the GPUs count cp, and
    a cp the sequence or the node layout cannot take is said, with the rule's words, beside its price."""
    run = {r.id: r for r in RUNS}["llama3-405b-16384xH100-cp16"]
    assert (run.cp, run.cp_variant, run.gpus) == (16, "all_gather", 16384)
    assert "tp8 cp16 all-gather pp16 dp8" in run.config
    ev = pr.evaluate_run(run)
    assert ev.breakdown["context_parallel_comm"] > 0
    # a step of 16M tokens: the measured 380 TFLOP/s as PaLM counts them, over 16,384 GPUs
    assert run.global_batch * run.seq_len == 128 * 131072
    assert pr.measured_tokens_per_s_per_gpu(run) * run.gpus * pr.palm_flops_per_token(run.model, run.seq_len) \
        == pytest.approx(380e12 * 16384)
    index = next(i for i, r in enumerate(RAW["runs"]) if r["id"] == run.id)
    for changes, message in ((dict(cp=3), r"tp 8 x cp 3 x pp 16 x dp 8 = 3072 GPUs"),
                             (dict(cp=6, cluster="96x8xH100", dp=1), r"not divisible by context-parallel degree 6"),
                             (dict(cp=1, dp=128), r"cp_variant all_gather needs cp of 2 or more")):
        with pytest.raises(PartitaError, match=message):
            pr.run_from_dict(_with(index, **changes)["runs"][0], "runs[0]")


def test_gpt_neox_s_teraflops_are_counted_as_its_2022_log_counted_them():
    """GPT-NeoX-20B's 117 TFLOP/s a GPU: 6 N + 60 s h l a token (megatron/logging.py at the 20B
    release), N the model's 20.6 B parameters; not Megatron's recompute count, which is 8 % more."""
    run = {r.id: r for r in RUNS}["neox-20b-96xA100-3d"]
    assert 20.4e9 < run.model.n_params < 20.7e9  # the paper's 20,554,567,680, LayerNorms aside
    per_token = 6 * run.model.n_params + 60 * 2048 * 6144 * 44
    assert pr.measured_tokens_per_s_per_gpu(run) == pytest.approx(117e12 / per_token)
    assert pr.megatron_flops_per_token(run.model, run.seq_len) / per_token == pytest.approx(1.087, abs=0.005)


def test_mfu_of_a_published_row_matches_the_figure_its_source_prints():
    """torchtitan prints MFU beside tokens/s for the 70B A100 run (51.7 %) over the A100's 312
    TFLOP/s bf16 peak; its FLOPs per token then also counted the embedding table's parameters
    (6 x 1.05e9 more, 1.3 %), which Partita's model FLOPs leave out (a lookup)."""
    tt = {r.id: r for r in RUNS}["tt-llama3-70b-64xA100-fsdp"]
    assert pr.mfu(tt, 331) == pytest.approx(0.517, rel=0.015)


def _with(run_index: int, **changes) -> dict:
    data = copy.deepcopy(RAW)
    data["runs"] = [data["runs"][run_index]]
    data["runs"][0].update(changes)
    return data


@pytest.mark.parametrize("changes, message", [
    ({"tp": 2}, "GPUs, but the cluster"),
    ({"global_batch": 17}, "not a multiple"),
    ({"pricing": "closest", "differences": []}, "must list its differences"),
    ({"pricing": "fuzzy"}, "is not one of"),
    ({"source": {"title": "t", "where": "w"}}, "source needs"),
    ({"speed": 3}, "unknown key 'speed'"),
    ({"devices": []}, "unknown key 'devices'"),  # device types are declared once, at the top of the file
    ({"measured": {"metric": "tflops_per_gpu", "value": 100}}, "needs flops"),
    ({"model": "not-a-model"}, "not built in"),
    ({"cluster_overrides": {"hbm_gbps": 2400}}, "unknown key 'hbm_gbps'"),
    ({"blocks_per_stage": [1, 2]}, "blocks_per_stage"),
    ({"engine_options": {"attention": "xformers"}}, "engine_options: unknown attention"),
    ({"engine_options": {"overlap": True}}, "engine_options: unknown option 'overlap'"),
    ({"engine_options": {"tp_overlap": "yes"}}, "engine_options: tp_overlap must be true or false"),
    ({"engine": "colossal"}, "engine 'colossal' is not one of partita, torchtitan"),
    ({"schedule": "interleaved-1f1b"}, "needs virtual_stages of 2 or more"),
    ({"virtual_stages": 2}, "schedule 1f1b runs 1 virtual"),
    ({"schedule": "gpipe"}, "is not one of"),
    ({"ep": 2}, r"expert parallelism \(ep 2\) needs a mixture-of-experts model"),
    ({"measured_memory": {"gib": 80}}, "measured_memory takes gib and metric"),
    ({"measured_memory": {"gib": 80, "metric": "max_allocated"}}, "is not one of"),
])
def test_bad_entries_are_refused_with_what_to_change(tmp_path, changes, message):
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump(_with(2, **changes)))
    with pytest.raises(PartitaError, match=message):
        pr.load_runs(path)


@pytest.mark.parametrize("device, message", [
    ({"name": "H100", "like": "H100", "source": "s"}, "is a catalog device"),
    ({"name": "H100-x", "like": "H100", "source": "s", "clock_mhz": 1500}, "unknown key 'clock_mhz'"),
    ({"name": "H100-x", "like": "H100"}, "source"),
])
def test_bad_device_types_are_refused(tmp_path, device, message):
    data = _with(2)
    data["devices"] = [device]
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PartitaError, match=message):
        pr.load_runs(path)


def test_a_devices_figures_reach_the_cost_model_only_while_its_runs_are_priced():
    from partita.devices import CATALOG

    run = next(r for r in RUNS if r.cluster.groups[0].device == "H100-HBM2e-500W")
    assert "H100-HBM2e-500W" not in CATALOG
    (variant,) = run.devices
    assert (variant.hbm_gbps, variant.bf16_tflops) == (2400, 989)
    slower = pr.price(run)
    assert "H100-HBM2e-500W" not in CATALOG
    as_sxm = pr.price(dataclasses.replace(run, devices=(dataclasses.replace(variant, hbm_gbps=3350),)))
    assert slower.predicted_step_time_s > as_sxm.predicted_step_time_s  # 2.4 TB/s against 3.35


# Rows with a known gap of the cost model (``gap``: a measurement no cost that grows with the
# ranks can price; docs/published_runs.md) are priced and printed but kept out of issue 10's
# regression line; the DeepSpeed rows are also held to their own tests below.
DEEPSPEED_ZERO3 = [r for r in RUNS if r.engine.name == "deepspeed" and r.zero == 3]


def test_the_cost_model_meets_issue_10s_target_on_the_published_runs():
    """The cost model, not the file: over the rows Partita can express, the median |error| of
    predicted throughput is at most 10 % and none is off by more than 25 % (ZeRO-3 rows included).
    A change to the cost model that breaks this has made its predictions worse. Rows whose source
    does not give the micro-batch and schedule (``split_published`` false) are held to their own
    test below: an assumed split moves them by tens of percent."""
    assert sum(1 for r in DEEPSPEED_ZERO3 if r.gap) <= 1
    rows = [pr.price(r) for r in RUNS if not r.gap and r.split_published]
    overall, _, zero3, *_ = pr.summaries(rows)
    assert overall.count >= 12 and zero3.count >= 6
    assert overall.median_abs_error_pct <= 10
    assert overall.max_abs_error_pct <= 25 and zero3.max_abs_error_pct <= 25


def test_the_megatron_engine_meets_issue_23s_target_and_nemo_s_recipes_fit():
    """Issue 23's per-engine line on the megatron engine's rows: median |error| at most 5 %, none
    beyond 15 %. NVIDIA's DGX Cloud Benchmarking recipes give every setting (the ``dgxc-*`` rows,
    8 to 2,304 H100, and the 405B recipe cut to 7-42 layers): each fits its 80 GB; the dense models in BF16
    each within 10 %, with FP8 products (the same recipes, ``-fp8``) within 15 %. The mixture of
    experts (Grok-1 314B, 8 to 2,048 H100, ``dgxc-grok1-*``, its experts split over tp as the
    2024 recipe's Megatron-Core ran them, engine option expert_tp split, and whole on folded
    expert ranks in the 2025 one) within 15 %: the 2024 recipe's 2-layer proxy on one node is
    the farthest."""
    rows = [pr.price(r) for r in RUNS if r.engine.name == "megatron" and r.pricing != "not_expressible"
            and r.split_published]  # the rows of an assumed split: test_megatron_lm_s_own_scaling_study_...
    errors = sorted(abs(r.error_pct) for r in rows)
    assert len(rows) >= 40
    assert statistics.median(errors) <= 5
    # One row misses the 15 % line since Transformer Engine's FP8 all-gathers are priced at a
    # byte an element (search/costs/layer_time.py, tp_pass, and the distributed optimizer's
    # --fp8-param-gather, CostModel.step_gather_bytes): dgxc-gpt3-175b-1024xH100-fp8, +16.3 %.
    # The recipe's weak-scaling series measured 5.92, 5.96, 6.44, 6.72 and 6.24 s a step on 128
    # to 2,048 GPUs for the same work a GPU, which the model prices flat (5.74-5.81 s); its BF16
    # twin measured 8.91-9.09 s. Named here so that any other row crossing the line fails; the
    # odd row itself is held to 20 %.
    odd = "dgxc-gpt3-175b-1024xH100-fp8"
    assert [r.id for r in rows if abs(r.error_pct) > 15] in ([], [odd])
    assert all(abs(r.error_pct) <= 20 for r in rows)
    recipes = [r for r in rows if r.id.startswith("dgxc-")]
    moe = [r for r in recipes if r.id.startswith("dgxc-grok1-")]
    dense_bf16 = [r for r in recipes if not r.id.endswith("-fp8") and r not in moe]
    assert len(dense_bf16) == 35 and len(moe) == 10 and len(recipes) == 80
    assert all(r.fits for r in recipes)
    assert all(abs(r.error_pct) <= 10 for r in dense_bf16)
    assert all(abs(r.error_pct) <= 15 for r in moe)


def test_nemos_long_sequence_table_holds_from_4k_to_1m_tokens():
    """NeMo's long-sequence table (Llama 2 7B, FP8, 4k to 1M tokens on 4 to 1,024 H100, cp up to
    32; FlashAttention-2 as the launcher of the container's release set it): every row within
    10 %, and the longest no worse than the shortest by more than 5 points: attention's share of
    the step grows from a fifth to nearly all of it, so a wrong attention rate, or a ring priced
    as cp masked blocks, shows as a trend along the table."""
    rows = [pr.price(r) for r in RUNS if r.id.startswith("nemo-llama2-7b-")]
    assert len(rows) == 9 and all(r.fits for r in rows)
    assert all(abs(r.error_pct) <= 10 for r in rows)
    by_length = sorted(rows, key=lambda r: int(r.id.split("-")[3][:-1]))
    assert abs(by_length[-1].error_pct - by_length[0].error_pct) <= 5


def test_nemos_24_07_performance_table_holds_for_every_model():
    """NeMo's 24.07 pre-training table (FP8, 8 to 512 H100: GPT-3 5B-175B, Llama 2 7B-70B,
    Llama 3 8B and 70B with cp 2, Nemotron 8B-340B; FlashAttention-2 as the launcher of that
    release set it): every row fits and is within 10 %."""
    rows = [pr.price(r) for r in RUNS if r.id.startswith("nemo2407-")]
    assert len(rows) == 12 and all(r.fits for r in rows)
    assert all(abs(r.error_pct) <= 10 for r in rows)


def test_fp8_products_speed_each_recipe_up_as_much_as_it_measured():
    """Each DGX Cloud recipe ran twice, in BF16 and with FP8 products, on the same layout and
    GPUs: the measured speedup is 1.32-1.55x, never the 2x of the datasheet's peaks. The FP8 term
    (the part's FP8 peak at the share of it FP8 products reach on an H100, a measurement apart
    from these runs: roofline.FP8_OVER_BF16_SHARE, and the casts it adds) predicts each pair's
    speedup within 10 %, half of them within 5 % (at twice bf16's rate, the datasheets' ratio,
    up to 17 % off; without the casts, 12 %)."""
    by_id = {r.id: r for r in RUNS}
    ratios = []
    for run in RUNS:
        if run.id.startswith("dgxc-") and run.id.endswith("-fp8"):
            assert run.engine.matmul == "fp8"
            fp8, bf16 = pr.price(run), pr.price(by_id[run.id.removesuffix("-fp8")])
            measured = fp8.measured_tokens_per_s_per_gpu / bf16.measured_tokens_per_s_per_gpu
            predicted = fp8.predicted_tokens_per_s_per_gpu / bf16.predicted_tokens_per_s_per_gpu
            assert 1.3 < measured < 1.6
            ratios.append((run.id, abs(predicted / measured - 1)))
    assert len(ratios) == 35
    assert statistics.median(r for _, r in ratios) <= 0.05
    # One pair off by 11.9 %: GPT-3 175B on 1,024 GPUs, whose FP8 run measured 1.34x its BF16 one
    # where the same recipe measured 1.49-1.51x on 128 and 256 GPUs and 1.45x on 2,048 (the FP8
    # series' step is not flat in weak scaling; the megatron target test above says more). The
    # odd pair itself is held to 15 %.
    assert [i for i, r in ratios if r > 0.10] in ([], ["dgxc-gpt3-175b-1024xH100-fp8"])
    assert max(r for _, r in ratios) <= 0.15


def test_deepspeed_s_zero3_gathers_carry_the_loss_of_throughput_with_the_ranks():
    """At micro-batch 1 a GPU (the same gathered bytes a step at every size), DeepSpeed's 175B
    ZeRO-3 lost 47 % of its throughput a GPU from 128 to 1,024 A100. Priced with the deepspeed
    engine (a ring a linear layer) the prediction falls at least as much; priced as FSDP's one
    gather a block it barely falls, and the error nearly doubles."""
    series = sorted((r for r in DEEPSPEED_ZERO3 if r.model.hidden == 12288 and r.seq_len == 1024 and r.micro_batch == 1),
                    key=lambda r: r.dp)
    assert [r.dp for r in series] == [128, 256, 512, 1024]
    errors = [pr.price(r).error_pct for r in series]
    as_fsdp = [pr.price(dataclasses.replace(r, engine=ENGINES["partita"].with_options({"attention": "unfused"}))).error_pct
               for r in series]
    assert errors[-1] <= errors[0] and max(abs(e) for e in errors) < 25
    assert as_fsdp[-1] > 1.5 * as_fsdp[0]
    first, last = pr.price(series[0]), pr.price(series[-1])
    measured_drop = first.measured_tokens_per_s_per_gpu / last.measured_tokens_per_s_per_gpu
    assert first.predicted_tokens_per_s_per_gpu / last.predicted_tokens_per_s_per_gpu >= 0.8 * measured_drop


def test_deepspeed_s_zero3_traffic_runs_after_the_compute_at_every_micro_batch():
    """DeepSpeed 0.6.2's published sweep (175B at sequence 1024, micro-batches 1-16 on 128-1,024
    A100, and at sequence 512, 1-32 on 128-512; 530B at 1-8 on 512 and 1,024): at each GPU count
    the step exceeds its compute by about the same seconds whatever the micro-batch, so the
    traffic does not hide behind a compute sixteen times longer (search/engines.py,
    ``zero3_overlap``). Priced so, the 45 rows' median error is under 8 % and none is off by more
    than 30 %; priced beside the compute, as FSDP's prefetch runs, the median is more than twice
    that and the large micro-batches' rows are all predicted fast."""
    assert len(DEEPSPEED_ZERO3) == 45 and not ENGINES["deepspeed"].zero3_overlap
    serial = [pr.price(r).error_pct for r in DEEPSPEED_ZERO3]
    beside = [pr.price(dataclasses.replace(r, engine=dataclasses.replace(r.engine, zero3_overlap=True))).error_pct
              for r in DEEPSPEED_ZERO3]
    assert statistics.median(abs(e) for e in serial) < 8 and max(abs(e) for e in serial) < 30
    assert statistics.median(abs(e) for e in beside) > 2 * statistics.median(abs(e) for e in serial)
    large = [e for r, e in zip(DEEPSPEED_ZERO3, beside) if r.micro_batch >= 4]
    assert len(large) >= 12 and min(large) > 0


def test_published_peak_memory_is_priced_for_the_rank_that_holds_the_most():
    """torchtitan's 8B FSDP runs publish their peak reserved memory (Tables 1 and 3): the priced
    peak of the fullest rank stays within 15 % of it (priced as full recomputation, which those
    runs did not run, it was 42-50 % under)."""
    # (torchtitan's 405B 3D rows, compiled with Float8 and async TP, publish theirs too and are
    # priced 42-55 % under it: docs/published_runs.md, "What is still off, and why".)
    rows = [pr.price(r) for r in RUNS if r.measured_memory_gib is not None and r.id.startswith("tt-llama3.1-8b")]
    assert len(rows) >= 4 and all(r.memory_error_pct is not None for r in rows)
    assert all(abs(r.memory_error_pct) <= 15 for r in rows)


def test_the_script_writes_json_rows_and_the_summary(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert pr.main(["--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["id"] for r in data["rows"]] == [r.id for r in RUNS]
    assert {s["label"] for s in data["summary"]} >= {"priced (exact + closest)", "exact only", "ZeRO-3 / FSDP rows",
                                                     "engine torchtitan", "engine megatron"}
    printed = capsys.readouterr().out
    assert "median |error|" in printed
    assert ("not expressible" in printed) == any(r.pricing == "not_expressible" for r in RUNS)
    assert "memory against published peaks" in printed
    assert any(r["measured_memory_gib"] and r["predicted_peak_gib"] for r in data["rows"])


def test_a_free_plans_config_names_its_context_parallelism():
    """``--free`` prints each free plan's layout (``plan_config``): a plan that splits sequences
    says so, or its degrees would not multiply to the cluster's GPUs."""
    from partita.cluster import parse_short
    from partita.model import BUILTIN
    from partita.search.planner import PlanRequest, make_plan

    model = BUILTIN["llama-2-7b"]
    plan, _ = make_plan(PlanRequest(model=model, cluster=parse_short("1x8xH100"), seq_len=32768, global_batch=8,
                                    context_parallel=(2,)))
    assert plan.cp == 2
    assert pr.plan_config(plan).startswith(f"tp{plan.tp} cp2 {plan.cp_variant.replace('_', '-')} pp{plan.pp} dp{plan.dp},")
    assert plan.tp * plan.cp * plan.pp * plan.dp == 8


def test_the_overlap_sweep_prices_the_rows_at_each_value_and_restores_the_constant():
    """benchmarks/overlap_sweep.py, the check behind ``timing.HOPPER_GEMM_OVERLAP_SLOWDOWN``: at
    the committed value it prices a row as the benchmark does; at the average slowdown (the term
    off) an H100 FSDP row reads faster, an A100 row the same; the module constant is restored."""
    from partita.search import timing

    spec = importlib.util.spec_from_file_location("overlap_sweep", BENCHMARKS / "overlap_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    rows = [r for r in RUNS if r.id in ("mpt-13b-2k-8xH100-fsdp", "tt-llama3-70b-64xA100-fsdp")]
    assert len(rows) == 2
    committed = timing.HOPPER_GEMM_OVERLAP_SLOWDOWN
    at_value = sweep.errors(rows, committed)
    off = sweep.errors(rows, timing.OVERLAP_SLOWDOWN_GPU)
    assert timing.HOPPER_GEMM_OVERLAP_SLOWDOWN == committed
    assert at_value == {r.id: pr.price(r).error_pct for r in rows}
    assert off["mpt-13b-2k-8xH100-fsdp"] > at_value["mpt-13b-2k-8xH100-fsdp"] + 1.0
    assert off["tt-llama3-70b-64xA100-fsdp"] == at_value["tt-llama3-70b-64xA100-fsdp"]


def test_the_zero3_overlap_check_prints_every_deepspeed_row_and_both_medians(capsys):
    """benchmarks/zero3_overlap.py, the check behind ``Engine.zero3_overlap``: a line for each of
    DeepSpeed's 45 ZeRO-3 rows and the two summaries, the one after the compute the priced rows'."""
    spec = importlib.util.spec_from_file_location("zero3_overlap", BENCHMARKS / "zero3_overlap.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert check.main([]) == 0
    out = capsys.readouterr().out
    assert sum(1 for line in out.splitlines() if line.startswith("| ds-azure-")) == len(DEEPSPEED_ZERO3) == 45
    after = statistics.median(abs(pr.price(r).error_pct) for r in DEEPSPEED_ZERO3)
    assert f"after the compute: 45 rows, median |error| {after:.1f} %" in out
    assert "beside it: 45 rows" in out


def test_torchtitan_s_float8_runs_hold_from_8_to_512_gpus_and_at_32k_tokens():
    """torchtitan's Float8 runs (torchao's Float8Linear under torch.compile, the torchtitan
    engine's fp8_impl: Dec 2024's on H100 from 8 to 512 GPUs, FSDP, 2D and 3D, and at 32k tokens;
    June 2025's FSDP + TP, vanilla and async, on 64 and 256 H100; Trainy's FSDP on 32 and 64
    H200) are none beyond 15 %, median within 6 % (issue 23's line is 5 % over an engine's rows:
    the 8B at tp 8 inherits its bf16 rows' +6.5 to +8.0 %), and the speedup Float8 gave the
    compiled 8B run on 8 and 128 GPUs (Tables 1 and 3: 1.28, 1.29) is priced within 10 %."""
    # (Tables 2 and 6 at 64k-262k tokens run torch's context parallelism of December 2024, which
    # measured slower than priced by more the larger cp: docs/published_runs.md, "What is still
    # off, and why".)
    fp8 = {r.id: pr.price(r) for r in RUNS if r.engine.name == "torchtitan" and r.engine.matmul == "fp8" and r.cp == 1}
    assert len(fp8) == 14
    errors = [abs(row.error_pct) for row in fp8.values()]
    assert statistics.median(errors) <= 6 and max(errors) <= 15, {k: r.error_pct for k, r in fp8.items()}
    by_id = {r.id: r for r in RUNS}
    for gpus in (8, 128):
        bf16, f8 = (by_id[f"tt-llama3.1-8b-{gpus}xH100-fsdp-compile{s}"] for s in ("", "-fp8"))
        measured = pr.measured_tokens_per_s_per_gpu(f8) / pr.measured_tokens_per_s_per_gpu(bf16)
        predicted = pr.price(f8).predicted_tokens_per_s_per_gpu / pr.price(bf16).predicted_tokens_per_s_per_gpu
        assert abs(predicted / measured - 1) <= 0.10


def test_a_row_is_priced_only_on_an_engine_that_runs_its_layout():
    """The rule book the search and the validator obey holds for the benchmark's rows too: Llama
    3's ZeRO-2 under pp 16 is a layout Megatron-LM refuses (its ZeRO 2 and 3 are Megatron-FSDP,
    parallel.PIPELINE_ZERO_AT_MOST_1), so the row is priced on Partita's runtime with Megatron's
    kernels, which gives the figures the megatron engine gave, and asking it of megatron or
    DeepSpeed is said, with the rule's words, beside its price."""
    index = next(i for i, r in enumerate(RAW["runs"]) if r["id"] == "llama3-405b-8192xH100-3d")
    row = RAW["runs"][index]
    assert (row["engine"], row["zero"], row["pp"]) == ("partita", 2, 16)
    options = dict(row["engine_options"])
    as_partita = pr.run_from_dict(row, "runs[0]")
    assert pr.engine_refusal(as_partita) == ""
    for engine, message in (("megatron", "engine megatron refuses ZeRO 2 and 3 in a pipeline"),
                            ("deepspeed", "engine deepspeed refuses ZeRO 2 and 3 in a pipeline")):
        other = pr.run_from_dict(_with(index, engine=engine)["runs"][0], "runs[0]")
        assert message in pr.engine_refusal(other)
        assert message in pr.price(other).engine_refuses  # priced still (another runs file may hold one), and said
    # the same terms priced under the megatron engine's name
    megatron = dataclasses.replace(as_partita, engine=ENGINES["megatron"].with_options(
        {k: v for k, v in options.items() if k in ("tp_overlap", "attention", "zero2_gather")}, "test"))
    assert pr.evaluate_run(megatron).step_time_s == pytest.approx(pr.evaluate_run(as_partita).step_time_s, rel=1e-9)
    assert pr.engine_refusal(dataclasses.replace(megatron, zero=1)) == ""  # ZeRO 1 it runs
    # and no row of the project's file is priced on an engine that refuses its layout
    assert [r.id for r in RUNS if r.pricing != "not_expressible" and pr.engine_refusal(r)] == []


MLM = [r for r in RUNS if r.id.startswith("mlm2407-")]


def test_megatron_lm_s_own_scaling_study_is_priced_at_an_assumed_split_and_said_so():
    """Megatron-LM's July 2024 H100 scaling study (its README's model table, 1.7B to 462B on 48 to
    6,144 GPUs, and the 177B strong-scaling ends at 96 and 4,608) gives degrees and batch, not the
    micro-batch or the virtual stages. The rows assume micro-batch 1 (Megatron-LM's own GPT-3
    example) and, in a pipeline, one layer a virtual stage (the only interleaving the 119B's and
    462B's 23 and 7 layers a rank admit), are marked so and summarised on their own line. The
    architecture assumed (GPT, 4h GELU MLP, untied embeddings) gives the table's model sizes; the
    TFLOP/s convert with the formula of Megatron-LM at that commit. At the assumed split the 11
    rows read a median 9 % (a regression bound: 10 %) and at worst 31 % (the 32B, tp 8 without a
    pipeline, whose four micro-batches a rank leave its fp32 gradient reduction exposed; at
    micro-batch 4 it reads +7 %); for 8 of the 11, some split that fits brackets the measurement."""
    assert len(MLM) == 11 and not any(r.split_published for r in MLM)
    sizes = {"1.7b": 1.7e9, "7.1b": 7.1e9, "16b": 16e9, "32b": 32e9, "70b": 70e9, "119b": 119e9, "177b": 177e9,
             "314b": 314e9, "462b": 462e9}
    for r in MLM:
        assert r.micro_batch == 1 and r.virtual_stages == (r.model.n_layers // r.pp if r.pp > 1 else 1)
        # the table rounds (1.75 billion reads 1.7B); tied embeddings would give 1.49 billion there
        assert r.model.n_params == pytest.approx(sizes[r.model.name.removeprefix("mlm-gpt-")], rel=0.04)
    small = {r.id: r for r in MLM}["mlm2407-gpt-1.7b-48xH100"]
    per_token = 12 * 24 * 2048 ** 2 * (1 + 1 + 4096 / 2048 + 4) + 6 * 131072 * 2048
    assert pr.measured_tokens_per_s_per_gpu(small) == pytest.approx(408.8e12 / per_token)
    rows = [pr.price(r) for r in MLM]
    assert all(r.fits for r in rows)
    errors = sorted(abs(r.error_pct) for r in rows)
    assert statistics.median(errors) <= 10 and errors[-1] <= 35
    summary = {s.label: s for s in pr.summaries(rows)}
    assert summary["rows whose micro-batch and schedule the source does not give (assumed)"].count == 11
    bracketed = 0
    for r in MLM:
        fitting = list(pr.splits(r))
        assert (r.micro_batch, r.virtual_stages) in {(s.micro_batch, s.virtual_stages) for s in fitting}
        found = [pr.price(split).error_pct for split in fitting]
        bracketed += min(found) <= 0 <= max(found)
    assert bracketed >= 8


def test_the_unknowns_script_prints_the_scaling_study_s_splits(capsys):
    """``python benchmarks/published_unknowns.py --megatron-readme``: a line for each of the study's
    11 rows, the YAML's split marked, its error the table's."""
    spec = importlib.util.spec_from_file_location("published_unknowns", BENCHMARKS / "published_unknowns.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--megatron-readme"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| mlm2407-")]
    assert len(lines) == 11
    error = pr.price({r.id: r for r in MLM}["mlm2407-gpt-32b-384xH100"]).error_pct
    assert any(line.startswith(f"| mlm2407-gpt-32b-384xH100 | {error:+.1f} % (mb 1 v 1) |") for line in lines)


def test_the_summary_shows_each_engine_on_the_rows_its_target_is_held_on():
    """Beside each engine's line over all its rows, the summary gives its rows of a published
    split and no known gap (the rows issue 23's per-engine line is read on), where they differ."""
    rows = [pr.price(r) for r in RUNS]
    by_label = {s.label: s for s in pr.summaries(rows)}
    for name in ("megatron", "torchtitan", "deepspeed"):
        kept = [r for r in rows if r.engine == name and r.split_published and not r.gap and r.error_pct is not None]
        line = by_label[f"engine {name}, split published, no known gap"]
        assert line.count == len(kept) < by_label[f"engine {name}"].count
        assert line.max_abs_error_pct == max(abs(r.error_pct) for r in kept)
    assert "engine partita, split published, no known gap" not in by_label  # the same rows as its own line


def test_the_torchtitan_engine_meets_issue_23s_target_on_its_rows_without_a_known_gap():
    """Issue 23's per-engine line on the torchtitan engine's rows (FSDP2 stacks: torchtitan,
    llm-foundry's Composer, fms-fsdp) whose split is published and that carry no known gap of the
    cost model: median |error| at most 5 %, none beyond 15 %. The gap rows are torch's context
    parallelism of December 2024 (docs/published_runs.md, "What is still off")."""
    rows = [pr.price(r) for r in RUNS if r.engine.name == "torchtitan" and r.pricing != "not_expressible"
            and r.split_published and not r.gap]
    errors = sorted(abs(r.error_pct) for r in rows)
    assert len(rows) >= 70
    assert statistics.median(errors) <= 5 and errors[-1] <= 15
    gaps = [r for r in RUNS if r.engine.name == "torchtitan" and r.gap]
    assert gaps and all(r.cp > 1 for r in gaps)
