"""partita export --to megatron|torchtitan|deepspeed: exact where the target expresses the plan,
else the closest plan it runs with both predictions; the files loaded by the targets' own parsers
where they install (torchtitan 0.2.2, DeepSpeed 0.19.8), else checked against their source."""

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shlex
import sys
import tomllib

import pytest

from partita.cli import main
from partita.cli.export import blocks_per_stage, export_plan, resplit, uniform
from partita.cli.export_megatron import arguments, layout
from partita.model_io import load_model
from partita.plan import Plan
from partita.search.costs.model import CostModel
from partita.search.engines import ENGINES
from partita.search.evaluate import evaluate_plan

MIXED = "2x8xH100+2x8xA100-80GB"
# The experts' flags, declared in the same Megatron-LM source (TransformerConfig and
# ModelParallelConfig through ArgumentGroupFactory; --num-experts in _add_moe_args).
MEGATRON_MOE_FLAGS = {"--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--expert-model-parallel-size",
                      "--expert-tensor-parallel-size", "--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
                      "--moe-token-dispatcher-type", "--moe-shared-expert-intermediate-size",
                      "--moe-shared-expert-gate"}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    made = {}
    for name, argv in {"mixed": ["--model", "llama-3-8b", "--cluster", MIXED, "--global-batch", "64"],
                       "dense": ["--model", "llama-3-8b", "--cluster", "2x8xH100", "--global-batch", "64",
                                 "--pp", "2", "--tp", "4"]}.items():
        path = d / f"{name}.yaml"
        assert main(["plan", *argv, "-o", str(path)]) == 0
        made[name] = path
    return made


def _expressible_uneven(path):
    """The mixed plan made expressible by Megatron (one setting for all layers), its uneven split kept."""
    p = Plan.load(path)
    model = load_model("llama-3-8b")
    return uniform(p, model, sequence_parallel=p.tp > 1, zero=1, recompute=lambda s, b: "none"), model


def test_megatron_keeps_an_uneven_split_exactly(plans):
    p, model = _expressible_uneven(plans["mixed"])
    assert len(set(blocks_per_stage(p))) > 1  # the search put more blocks on the faster group
    ex = export_plan(p, "megatron")
    # The same plan, priced as Megatron runs it (its attention kernel, its overlaps).
    cm = CostModel(model, p.cluster_spec, seq_len=p.seq_len, dtype=p.dtype, engine=ENGINES["megatron"])
    assert ex.changes == () and ex.exported.engine == "megatron"
    assert ex.exported.prediction.step_time_s == pytest.approx(evaluate_plan(p, cm).step_time_s)
    args = arguments(ex.exported, model)
    value = args[args.index("--pipeline-model-parallel-layout") + 1]
    assert value == layout(blocks_per_stage(p))
    # unrolled as Megatron's PipelineParallelLayerLayout.parse_str_to_list does: x*n -> n x's, '|' splits stages
    stages = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), value).split("|")
    assert [s.count("t") for s in stages] == blocks_per_stage(p)
    assert stages[0].startswith("E") and stages[-1].endswith("L")


def test_a_plan_megatron_cannot_express_prints_the_closest_and_both_predictions(plans, tmp_path, capsys):
    p = Plan.load(plans["mixed"])
    first = p.stages[0]
    odd = dataclasses.replace(first.layers[1], zero=3 - first.layers[1].zero or 1)  # one block differs
    p = dataclasses.replace(p, stages=(dataclasses.replace(first, layers=(first.layers[0], odd, *first.layers[2:])),
                                       *p.stages[1:]))
    path = tmp_path / "odd.yaml"
    p.save(path)
    assert main(["export", str(path), "--to", "megatron", "-o", str(tmp_path / "m.args")]) == 0
    out = capsys.readouterr().out
    assert "cannot express" in out and "ZeRO level" in out
    assert re.search(r"^plan \(partita\): +step", out, re.M) and re.search(r"^megatron export: +step", out, re.M)
    assert re.search(r"the export, priced as megatron runs it, is predicted [\d.]+% (slower|faster) than the plan on "
                     r"partita", out)


def test_megatron_arguments_are_flags_megatron_declares(plans, tmp_path):
    assert main(["export", str(plans["dense"]), "--to", "megatron", "-o", str(tmp_path / "m.args")]) == 0
    lines = [l for l in (tmp_path / "m.args").read_text().splitlines() if not l.startswith("#")]
    argv = [tok for l in lines for tok in shlex.split(l)]
    flags = {a for a in argv if a.startswith("--")}
    # Declared in NVIDIA/Megatron-LM d98e8a64 (2026-08-22), megatron/training/arguments.py directly or through
    # ArgumentGroupFactory from ModelParallelConfig, TransformerConfig, TrainingConfig, TokenizerConfig and
    # common_config.py (see partita/export_megatron.py for each). megatron-core on PyPI ships megatron.core only,
    # without megatron/training/arguments.py, so its parser cannot be loaded here.
    declared = {"--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                "--group-query-attention", "--num-query-groups", "--seq-length", "--max-position-embeddings",
                "--vocab-size", "--position-embedding-type", "--normalization", "--swiglu", "--disable-bias-linear",
                "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size",
                "--pipeline-model-parallel-size", "--sequence-parallel", "--micro-batch-size", "--global-batch-size",
                "--bf16", "--fp16", "--use-distributed-optimizer", "--use-megatron-fsdp", "--overlap-grad-reduce",
                "--overlap-param-gather", "--tp-comm-overlap",
                "--data-parallel-sharding-strategy", "--ckpt-format", "--recompute-granularity", "--recompute-method",
                "--recompute-num-layers", "--recompute-modules", "--pipeline-model-parallel-layout",
                "--make-vocab-size-divisible-by", "--attention-dropout", "--hidden-dropout", "--norm-epsilon",
                "--rotary-base", "--add-qkv-bias"} | MEGATRON_MOE_FLAGS
    assert flags <= declared
    p = Plan.load(plans["dense"])
    value = lambda flag: argv[argv.index(flag) + 1]  # noqa: E731
    assert value("--tensor-model-parallel-size") == str(p.tp) and value("--pipeline-model-parallel-size") == str(p.pp)
    assert value("--micro-batch-size") == str(p.micro_batch) and value("--global-batch-size") == str(p.global_batch)
    # the sequence-parallel collectives beside the products, as the megatron engine prices them
    model = load_model("llama-3-8b")
    for sp in (True, False):
        args = arguments(uniform(p, model, sequence_parallel=sp, zero=1, recompute=lambda s, b: "none"), model)
        assert ("--tp-comm-overlap" in args) == (sp and p.tp > 1) == ("--sequence-parallel" in args)


def _selective(path, zero: int):
    """The plan as 1F1B (whatever schedule the search gave it: the zero-bubble ones take no
    recomputation), every block selectively recomputed, one SP setting and ZeRO level for all."""
    p = Plan.load(path)
    p = resplit(p, blocks_per_stage(p))
    return uniform(p, load_model("llama-3-8b"), sequence_parallel=p.tp > 1, zero=zero,
                   recompute=lambda s, b: "selective")


def test_selective_recomputation_exports_to_megatron_and_torchtitan_and_the_closest_to_deepspeed(
        plans, tmp_path, monkeypatch, capsys, torchtitan_config_manager):
    model = load_model("llama-3-8b")
    ex = export_plan(_selective(plans["dense"], zero=1), "megatron")
    assert ex.changes == ()
    args = arguments(ex.exported, model)
    at = args.index("--recompute-granularity")
    # TransformerConfig.recompute_modules (nargs "+"): its default, the attention core, as the
    # megatron engine prices it; no --recompute-method or --recompute-num-layers with selective
    # (Megatron's validate_args)
    assert args[at:at + 4] == ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]
    assert "--recompute-method" not in args and "--recompute-num-layers" not in args
    assert "--recompute-modules core_attn" in ex.text.splitlines()
    assert any("selective recomputation is Megatron's" in n for n in ex.notes)

    path = tmp_path / "selective.yaml"
    _selective(plans["dense"], zero=0).save(path)
    out = tmp_path / "job.toml"
    assert main(["export", str(path), "--to", "torchtitan", "-o", str(out)]) == 0
    assert "expresses the plan exactly" in capsys.readouterr().out
    ac = tomllib.loads(out.read_text())["activation_checkpoint"]
    assert ac == {"mode": "selective", "selective_ac_option": "op"}
    if importlib.util.find_spec("torchtitan") is not None:
        cfg = torchtitan_config_manager().ConfigManager().parse_args(["--job.config_file", str(out)])
        assert (cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option) == ("selective", "op")

    # DeepSpeed recomputes whole blocks or nothing: the closest plan, and the change said
    assert main(["export", str(path), "--to", "deepspeed", "-o", str(tmp_path / "ds.json")]) == 0
    text = capsys.readouterr().out
    assert "cannot express" in text
    assert re.search(r"recompute: none on 2, selective on 32 -> (none|full) on", text), text


def test_torchtitan_toml_loads_in_torchtitans_config_manager(plans, tmp_path, monkeypatch,
                                                            torchtitan_config_manager):
    out = tmp_path / "job.toml"
    assert main(["export", str(plans["dense"]), "--to", "torchtitan", "-o", str(out)]) == 0
    p = Plan.load(plans["dense"])
    data = tomllib.loads(out.read_text())
    par = data["parallelism"]
    assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"]) == (p.tp, p.pp)
    assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] == p.dp
    names = par["module_fqns_per_model_part"]
    assert names[0][0] == "tok_embeddings" and names[-1][-2:] == ["norm", "output"]
    assert data["training"]["global_batch_size"] == p.global_batch
    manager = torchtitan_config_manager()
    cfg = manager.ConfigManager().parse_args(["--job.config_file", str(out)])
    assert cfg.parallelism.tensor_parallel_degree == p.tp and cfg.parallelism.pipeline_parallel_degree == p.pp
    assert cfg.parallelism.module_fqns_per_model_part == names
    assert cfg.training.seq_len == p.seq_len and cfg.training.local_batch_size == p.micro_batch * p.num_micro_batches
    assert cfg.activation_checkpoint.mode == data["activation_checkpoint"]["mode"]
    assert cfg.model.flavor == "8B"


def test_deepspeed_json_loads_in_deepspeeds_config_parser(plans, tmp_path, capsys):
    out = tmp_path / "ds.json"
    assert main(["export", str(plans["mixed"]), "--to", "deepspeed", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    p = Plan.load(plans["mixed"])
    data = json.loads(out.read_text())
    assert data["train_micro_batch_size_per_gpu"] == p.micro_batch
    assert data["gradient_accumulation_steps"] == p.num_micro_batches
    assert data["zero_optimization"]["stage"] <= 1  # DeepSpeed's pipeline engine: ZeRO 0 or 1
    if len(set(blocks_per_stage(p))) > 1:
        assert "blocks per stage" in text  # the uneven split became DeepSpeed's even one, and said so
    config = pytest.importorskip("deepspeed.runtime.config", reason="deepspeed not installed")
    ds = config.DeepSpeedConfig(data)
    assert ds.train_micro_batch_size_per_gpu == p.micro_batch and ds.gradient_accumulation_steps == p.num_micro_batches
    assert ds.zero_optimization_stage == data["zero_optimization"]["stage"] and ds.bfloat16_config.enabled
    assert ds.pipeline["stages"] == p.pp


@pytest.mark.parametrize("argv,phrase", [
    (["export", "{plan}", "--to", "nemo"], "--to"),
    (["export", "{d}/missing.yaml", "--to", "megatron"], "missing.yaml"),
    (["export", "{plan}", "--to", "megatron", "-o", "{d}/no/such/dir/m.args"], "no such directory"),
])
def test_bad_export_input_is_one_line(argv, phrase, plans, tmp_path, capsys):
    argv = [a.format(plan=plans["dense"], d=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and phrase in err and "Traceback" not in err


def test_megatron_argument_parser_accepts_the_arguments(plans, tmp_path, monkeypatch):
    """Megatron's own parse_args, where a Megatron-LM checkout is named (megatron-core on PyPI lacks
    megatron.training; the checkout needs its own dependencies, triton among them)."""
    root = os.environ.get("PARTITA_MEGATRON_LM")
    if not root:
        pytest.skip("set PARTITA_MEGATRON_LM to a Megatron-LM checkout to parse with Megatron's own parser")
    monkeypatch.syspath_prepend(root)
    try:
        megatron_arguments = importlib.import_module("megatron.training.arguments")
    except ImportError as e:
        pytest.skip(f"megatron.training does not import here ({e})")
    p, model = _expressible_uneven(plans["mixed"])
    argv = arguments(export_plan(p, "megatron").exported, model)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv, "--tokenizer-type", "NullTokenizer", "--mock-data"])
    args = megatron_arguments.parse_args()
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (p.tp, p.pp)
    assert args.pipeline_model_parallel_layout == layout(blocks_per_stage(p))
    assert (args.micro_batch_size, args.global_batch_size) == (p.micro_batch, p.global_batch)


def _interleaved(path, v=2):
    """The plan with each stage's ranks running v virtual stages of equal blocks (chunk c of stage
    i is virtual stage c * pp + i), every layer's choices kept."""
    p = Plan.load(path)
    layers = p.layer_strategies()
    per = (len([l for l in layers if l.name.startswith("layers.")])) // (p.pp * v)
    blocks = [l for l in layers if l.name.startswith("layers.")]
    chunks = {}
    for k in range(p.pp * v):
        chunk = blocks[k * per:(k + 1) * per]
        chunk = ([layers[0]] if k == 0 else []) + chunk + ([layers[-1]] if k == p.pp * v - 1 else [])
        chunks[k] = chunk
    stages = tuple(dataclasses.replace(s, layers=tuple(l for c in range(v) for l in chunks[c * p.pp + s.index]),
                                       chunks=tuple(len(chunks[c * p.pp + s.index]) for c in range(v)))
                   for s in p.stages)
    return dataclasses.replace(p, stages=stages, schedule="interleaved-1f1b", prediction=None)


def test_an_interleaved_plan_exports_its_virtual_stages(plans, tmp_path, capsys, monkeypatch,
                                                       torchtitan_config_manager):
    p = _interleaved(plans["dense"])
    path = tmp_path / "interleaved.yaml"
    p.save(path)
    model = load_model("llama-3-8b")
    assert main(["export", str(path), "--to", "megatron", "-o", str(tmp_path / "m.args")]) == 0
    argv = [t for l in (tmp_path / "m.args").read_text().splitlines() if not l.startswith("#") for t in shlex.split(l)]
    value = argv[argv.index("--pipeline-model-parallel-layout") + 1]
    stages = value.split("|")
    assert len(stages) == p.pp * p.virtual_stages and stages[0].startswith("E") and stages[-1].endswith("L")
    assert "schedule interleaved" not in capsys.readouterr().out  # Megatron keeps the schedule
    assert main(["export", str(path), "--to", "torchtitan", "-o", str(tmp_path / "t.toml")]) == 0
    par = tomllib.loads((tmp_path / "t.toml").read_text())["parallelism"]
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert len(par["module_fqns_per_model_part"]) == p.pp * p.virtual_stages
    assert par["module_fqns_per_model_part"][1][0] == f"layers.{32 // 4}"  # virtual stage 1 sits on rank 1
    if importlib.util.find_spec("torchtitan") is not None:
        cfg = torchtitan_config_manager().ConfigManager().parse_args(
            ["--job.config_file", str(tmp_path / "t.toml")])
        assert cfg.parallelism.pipeline_parallel_schedule == "Interleaved1F1B"
        assert cfg.parallelism.module_fqns_per_model_part == par["module_fqns_per_model_part"]
    capsys.readouterr()
    assert main(["export", str(path), "--to", "deepspeed", "-o", str(tmp_path / "d.json")]) == 0
    out = capsys.readouterr().out
    assert "schedule interleaved-1f1b (2 virtual stages per rank) -> 1f1b" in out
    ex = export_plan(p, "deepspeed")
    assert ex.exported.virtual_stages == 1 and blocks_per_stage(ex.exported) == [16, 16]
    assert model.n_layers == 32


def test_zero_bubble_plans_export_to_each_targets_nearest_schedule(plans, tmp_path, capsys):
    """torchtitan runs both zero-bubble schedules by torch's names for them; Megatron has none:
    interleaved zero-bubble exports as interleaved 1F1B on the same virtual stages, ZB-V as 1F1B
    with the same blocks per stage, and the change list says so."""
    p = dataclasses.replace(_interleaved(plans["dense"]), schedule="interleaved-zb")
    assert export_plan(p, "torchtitan").exported.schedule == "interleaved-zb"
    path = tmp_path / "izb.yaml"
    p.save(path)
    assert main(["export", str(path), "--to", "torchtitan", "-o", str(tmp_path / "t.toml")]) == 0
    assert tomllib.loads((tmp_path / "t.toml").read_text())["parallelism"]["pipeline_parallel_schedule"] == \
        "InterleavedZeroBubble"
    ex = export_plan(p, "megatron")
    assert ex.exported.schedule == "interleaved-1f1b" and ex.exported.virtual_stages == 2
    assert any("schedule interleaved-zb" in c and "-> interleaved-1f1b" in c for c in ex.changes)
    # ZB-V: the same layers as a V over the ranks (stage 0 holds the first and the last chunk).
    v = _as_schedule(p, "zbv")
    assert v.stages[0].layers[0].name == "embed" and v.stages[0].layers[-1].name == "head"
    assert "ZBVZeroBubble" in export_plan(v, "torchtitan").text
    ex = export_plan(v, "megatron")
    assert ex.exported.schedule == "1f1b" and ex.exported.virtual_stages == 1
    assert blocks_per_stage(ex.exported) == blocks_per_stage(v)


def _as_schedule(p, schedule):
    """``p``'s layers, in the model's order, dealt to the virtual stages as ``schedule`` places
    them (each stage keeping its chunk sizes' order of virtual stages)."""
    placed = dataclasses.replace(p, schedule=schedule, prediction=None)
    layers = p.layer_strategies()
    sizes = {placed.virtual_stage_index(s.index, c): n for s in p.stages for c, n in enumerate(s.chunks)}
    start, chunk_layers = 0, {}
    for k in sorted(sizes):
        chunk_layers[k] = layers[start:start + sizes[k]]
        start += sizes[k]
    stages = tuple(dataclasses.replace(s, layers=tuple(l for c in range(len(s.chunks))
                                                       for l in chunk_layers[placed.virtual_stage_index(s.index, c)]))
                   for s in p.stages)
    return dataclasses.replace(placed, stages=stages)


# ---- the model the export trains (issue 28) ----------------------------------------------------
def _megatron_argv(path, tmp_path):
    out = tmp_path / "m.args"
    assert main(["export", str(path), "--to", "megatron", "-o", str(out)]) == 0
    return [tok for line in out.read_text().splitlines() if not line.startswith("#") for tok in shlex.split(line)]


def test_a_llama_3_megatron_export_trains_llama_3(plans, tmp_path):
    """Rotary base 500000 (Megatron's default is 10000), no dropout (its default is 0.1), the
    model's norm epsilon, the vocabulary unpadded."""
    argv = _megatron_argv(plans["dense"], tmp_path)
    value = lambda flag: argv[argv.index(flag) + 1]  # noqa: E731
    assert value("--rotary-base") == "500000"
    assert value("--attention-dropout") == value("--hidden-dropout") == "0.0"
    assert float(value("--norm-epsilon")) == load_model("llama-3-8b").norm_eps
    assert value("--make-vocab-size-divisible-by") == "1" and value("--vocab-size") == "128256"
    assert "--num-experts" not in argv
    assert "NVIDIA/Megatron-LM d98e8a64" in (tmp_path / "m.args").read_text().splitlines()[1]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "mixtral.yaml"
    assert main(["plan", "--model", "mixtral-8x7b", "--cluster", "4x8xH100", "-o", str(path)]) == 0
    return path


def test_a_mixtral_plan_exports_its_experts_to_megatron(mixtral, tmp_path):
    p = Plan.load(mixtral)
    assert p.ep > 1
    argv = _megatron_argv(mixtral, tmp_path)
    value = lambda flag: argv[argv.index(flag) + 1]  # noqa: E731
    assert (value("--num-experts"), value("--moe-router-topk"), value("--moe-ffn-hidden-size")) == ("8", "2", "14336")
    assert value("--expert-model-parallel-size") == str(p.ep) and value("--expert-tensor-parallel-size") == "1"
    assert value("--moe-router-load-balancing-type") == "seq_aux_loss" and float(value("--moe-aux-loss-coeff")) == 0.01
    assert value("--rotary-base") == "1000000"


@pytest.mark.parametrize("target", ["torchtitan", "deepspeed"])
def test_targets_that_cannot_train_the_experts_say_so(mixtral, target, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(mixtral), "--to", target, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "export it --to megatron" in err[0] and not out.exists()


def test_an_export_that_does_not_fit_exits_3_and_writes_nothing(tmp_path, capsys):
    """The issue's 70B plan on three device types: DeepSpeed (ZeRO 0-1 under a pipeline) cannot hold
    it in any plan of its shape (its A100-40GB stage needs 40.1 GiB). Megatron's closest plan fits
    since the plan runs tp 4 with sequence parallelism (its norms and adds on the sequence shard made
    that shape the fastest): written, exit 0."""
    path = tmp_path / "p.yaml"
    assert main(["plan", "--model", "llama-2-70b", "--cluster", "4x8xH100+8x8xA100-80GB+4x8xA100-40GB",
                 "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["export", str(path), "--to", "megatron", "-o", str(tmp_path / "out.megatron")]) == 0
    capsys.readouterr()
    for target in ("deepspeed",):
        out = tmp_path / f"out.{target}"
        assert main(["export", str(path), "--to", target, "-o", str(out)]) == 3
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "fits" in err[0] and f"--engine {target}" in err[0] and "nothing written" in err[0]
        assert not out.exists()


# Valid keys, recorded from the targets' source (the header names the versions): torchtitan
# 0.2.2's torchtitan/config/job_config.py (the TOML's sections) and torchtitan b5bcd76c's
# torchtitan/config/configs.py (TrainingConfig, ParallelismConfig: the --section.option overrides).
TORCHTITAN_0_2_KEYS = {
    "model": {"name", "flavor", "hf_assets_path", "tokenizer_path", "converters", "print_after_conversion"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "disable_loss_parallel", "enable_async_tensor_parallel",
                    "pipeline_parallel_degree", "module_fqns_per_model_part",
                    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
                    "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
                    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
                    "pipeline_parallel_expert_parallel_overlap", "context_parallel_degree",
                    "context_parallel_load_balancer", "context_parallel_rotate_method", "expert_parallel_degree",
                    "expert_tensor_parallel_degree", "expert_parallel_comm_backend"},
    "activation_checkpoint": {"mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns",
                              "early_stop", "memory_budget", "visualize_memory_budget_pareto", "preserve_rng_state",
                              "determinism_check", "debug"},
    "training": {"dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps",
                 "enable_cpu_offload", "dtype", "mixed_precision_param", "mixed_precision_reduce", "gc_freq",
                 "gc_debug", "dataloader"}}
TORCHTITAN_MAIN_KEYS = {
    "training": {"num_tokens_per_microbatch_per_dp_rank", "num_tokens_per_train_step", "max_context_length",
                 "max_norm", "steps", "enable_cpu_offload", "disable_cuda_graphs", "dtype", "mixed_precision_param",
                 "mixed_precision_reduce", "gc_freq", "gc_debug"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "enable_fsdp_symm_mem", "tensor_parallel_degree", "enable_sequence_parallel", "spmd_backend",
                    "pipeline_parallel_degree", "module_fqns_per_model_part",
                    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
                    "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
                    "pipeline_parallel_schedule_csv", "num_pp_microbatches", "context_parallel_degree",
                    "context_parallel_load_balancer", "context_parallel_ptrr_mask_key", "expert_parallel_degree"}}


def _toml_and_overrides(path, tmp_path):
    import tomllib

    out = tmp_path / "t.toml"
    assert main(["export", str(path), "--to", "torchtitan", "-o", str(out)]) == 0
    text = out.read_text()
    line = next(l for l in text.splitlines() if "torchtitan >= 0.3" in l)
    overrides = [tok[2:] for tok in line.split() if tok.startswith("--") and "." in tok]
    return text, tomllib.loads(text), overrides


def test_torchtitan_keys_exist_in_the_versions_the_header_names(plans, tmp_path):
    for path in plans.values():
        text, cfg, overrides = _toml_and_overrides(path, tmp_path)
        assert "torchtitan 0.2.2" in text.splitlines()[0] and "b5bcd76c" in text.splitlines()[0]
        for section, values in cfg.items():
            assert set(values) <= TORCHTITAN_0_2_KEYS[section], section
        for key in overrides:
            section, name = key.split(".")
            assert name in TORCHTITAN_MAIN_KEYS[section], key
        assert "--module torchtitan.models.llama3.config_registry --config llama3_8b" in text
        p = Plan.load(path)
        assert f"--training.num_tokens_per_train_step {p.global_batch * p.seq_len}" in text


def test_a_llama_2_70b_torchtitan_export_names_its_own_flavour_and_how_to_register_it(tmp_path, monkeypatch,
                                                                                    torchtitan_config_manager):
    """torchtitan ships no Llama 2 70B: its 70B flavour has Llama 3's vocabulary and rotary base,
    so the export names the model's own flavour with the line that registers it, never another
    model's."""
    from partita.cli.export_torchtitan import ffn_width, model_args

    path = tmp_path / "p.yaml"
    assert main(["plan", "--model", "llama-2-70b", "--cluster", "4x8xH100", "--engine", "torchtitan",
                 "-o", str(path)]) == 0
    text, cfg, _ = _toml_and_overrides(path, tmp_path)
    assert cfg["model"] == {"name": "llama3", "flavor": "llama-2-70b"}
    args = model_args(load_model("llama-2-70b"))
    assert (args["dim"], args["n_layers"], args["n_kv_heads"], args["vocab_size"], args["rope_theta"]) == (
        8192, 80, 8, 32000, 10000.0)
    assert ffn_width(args["dim"], args["ffn_dim_multiplier"], args["multiple_of"]) == 28672
    assert 'llama3_configs["llama-2-70b"] = TransformerModelArgs(dim=8192, n_layers=80' in text
    if importlib.util.find_spec("torchtitan") is not None:
        parsed = torchtitan_config_manager().ConfigManager().parse_args(["--job.config_file", str(tmp_path / "t.toml")])
        assert (parsed.model.name, parsed.model.flavor) == ("llama3", "llama-2-70b")
