"""A plan as a torchtitan job TOML (``--job.config_file job.toml``).

Written for torchtitan 0.2.2 (PyPI), the last release whose ``ConfigManager`` reads a job TOML
(``torchtitan/config/manager.py``: ``_maybe_load_toml`` on ``--job.config_file``; unknown keys
are refused by ``_dict_to_dataclass``); every key is a field of ``torchtitan/config/job_config.py``
there. torchtitan 0.3 (pytorch/torchtitan main, 2026-09) dropped TOML files for Python config
registries (``--module``/``--config``) with command-line overrides of the same section.key
names; the file's header lists the ``[parallelism]`` and ``[training]`` values as such overrides.

What maps how:
  * ``[parallelism]``: ``tensor_parallel_degree`` = tp (torchtitan's llama TP plan splits every
    block, the embedding and the output, and always adds sequence parallelism, so a plan exports
    with SP on wherever tp > 1); ``pipeline_parallel_degree`` = pp with ``pipeline_parallel_schedule
    = "1F1B"``, ``pipeline_parallel_microbatch_size`` = the micro-batch and the split as
    ``module_fqns_per_model_part`` (torchtitan's module names: ``tok_embeddings``, ``layers.N``,
    ``norm``, ``output``), exact for uneven splits; an interleaved plan is ``"Interleaved1F1B"`` with
    one part per virtual stage; data parallelism by ZeRO level: 0 is
    ``data_parallel_replicate_degree`` = dp (DDP), 2 is ``data_parallel_shard_degree`` = dp with
    ``fsdp_reshard_after_forward = "never"`` (FSDP2 keeping parameters gathered from forward to
    backward), 3 the same with ``"always"``. torchtitan has no ZeRO-1, except inside a pipeline,
    where its FSDP is one: torch's pipelining keeps an FSDP stage's parameters gathered and its
    gradients unsharded until the last micro-batch's backward (``parallel.pipeline_zero_rule``),
    so a plan with pp > 1 exports at ZeRO 0 or 1, ZeRO 1 as FSDP with ``"never"``.
  * ``[activation_checkpoint]``: ``mode = "none"`` or ``"full"`` (every block), or ``"selective"``
    with ``selective_ac_option = "k"``: every k-th block of each stage fully recomputed (counted
    from 1 in ``torchtitan/distributed/activation_checkpoint.py``, ``_apply_layer_sac``), or
    with ``selective_ac_option = "op"``: every block selectively (``_apply_op_sac``: torchtitan
    keeps the outputs of its ``_op_sac_save_list`` in ``torchtitan/models/llama3/infra/parallelize.py``,
    every product's but every second ``mm``'s, and the attention kernel's and the
    sequence-parallel reduce-scatters'; the torchtitan engine prices that policy,
    ``selective_scope`` "alternate" in search/engines.py).
  * Context parallelism: torchtitan runs the ring (torch's ``context_parallel`` around SDPA,
    ``torchtitan/distributed/context_parallel.py``), not the all-to-all: ``context_parallel_degree``
    = cp with ``context_parallel_rotate_method = "alltoall"`` (K/V blocks passed one step at a
    time, as Partita's runtime sets it and prices it; torchtitan's default is "allgather") and
    its default ``context_parallel_load_balancer = "headtail"``, Partita's layout. An all-to-all
    plan exports as the ring at the same cp (where the sequence divides by 2 x cp), priced, and
    the change is listed. With cp > 1 torchtitan always shards parameters with FSDP over dp x cp
    (``ParallelDims.fsdp_enabled`` is ``dp_shard_enabled or cp_enabled``), so a cp plan exports
    at ZeRO 2 or 3 (ZeRO over dp x cp, as Partita's). Its mesh order (pp, dp_replicate,
    dp_shard, cp, tp) puts tp innermost and cp next, as Partita's stages do. torchtitan >= 0.3
    (pytorch/torchtitan b5bcd76c, ``torchtitan/config/configs.py``) keeps
    ``context_parallel_degree`` but has no rotate method (torch's default, "allgather").
  * ``[training]``: ``local_batch_size`` = micro-batch x micro-batches (per data-parallel rank),
    ``global_batch_size``, ``seq_len``, ``mixed_precision_param`` (bfloat16 or float32; torchtitan
    trains no fp16).
"""

from __future__ import annotations

import json
from typing import Iterator

from partita.cluster import ClusterSpec
from partita.cli.export import blocks_per_stage, context_variant, is_block, uniform
from partita.errors import PartitaError
from partita.model import ModelSpec
from partita.plan import Plan

FILE = "torchtitan.toml"
RESHARD = {1: "never", 2: "never", 3: "always"}  # ZeRO 1: FSDP inside a pipeline
MAX_SELECTIVE = 8  # every k-th block, k = 2..8
OP = -1  # ``recompute_rule``'s k for selective_ac_option "op"
# torchtitan 0.2.2's llama3 flavours (torchtitan/models/llama3/__init__.py, llama3_configs), with
# the fields of TransformerModelArgs (model/args.py) that set the model: the FFN width is derived
# (model.py, FeedForward: int(2 * 4 dim / 3), times ffn_dim_multiplier, rounded up to multiple_of);
# vocab_size 128256, norm_eps 1e-5 are the args' defaults.
FLAVOR_ARGS = {"8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024),
               "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096),
               "405B": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                            multiple_of=4096)}
FLAVOR_DEFAULTS = dict(vocab_size=128256, rope_theta=500000, norm_eps=1e-5)
# torchtitan main's config functions for those flavours (torchtitan/models/llama3/config_registry.py
# at b5bcd76c, the --module/--config interface that replaced the TOML).
CONFIG_MODULE = "torchtitan.models.llama3.config_registry"
CONFIGS = {"8B": "llama3_8b", "70B": "llama3_70b", "405B": "llama3_405b"}
VERSIONS = "torchtitan 0.2.2 (TOML) and pytorch/torchtitan b5bcd76c (2026-08-21, --module/--config)"


def ffn_width(dim: int, ffn_dim_multiplier: float | None, multiple_of: int) -> int:
    """torchtitan's SwiGLU width for a model dimension (FeedForward.__init__)."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def model_args(model: ModelSpec) -> dict:
    """The TransformerModelArgs that build ``model`` in torchtitan's llama3 (a flavour to register)."""
    hidden = int(2 * 4 * model.hidden / 3)
    multiplier = None if hidden <= model.ffn else model.ffn / hidden
    args = dict(dim=model.hidden, n_layers=model.n_layers, n_heads=model.heads, n_kv_heads=model.kv_heads,
                ffn_dim_multiplier=multiplier, multiple_of=model.ffn, vocab_size=model.vocab,
                rope_theta=model.rope_theta, norm_eps=model.norm_eps)
    assert ffn_width(model.hidden, multiplier, model.ffn) == model.ffn
    return args


def flavor(model: ModelSpec) -> str | None:
    """The torchtitan 0.2.2 llama3 flavour that is ``model`` exactly, if one is."""
    if model.family != "llama" or model.is_moe or model.qkv_bias or model.tie_embeddings:
        return None
    for name, args in FLAVOR_ARGS.items():
        built = dict(dim=model.hidden, n_layers=model.n_layers, n_heads=model.heads, n_kv_heads=model.kv_heads,
                     vocab_size=model.vocab, rope_theta=model.rope_theta, norm_eps=model.norm_eps)
        want = {k: v for k, v in (args | FLAVOR_DEFAULTS).items() if k in built}
        if built == want and ffn_width(args["dim"], args["ffn_dim_multiplier"], args["multiple_of"]) == model.ffn:
            return name
    return None


def registration(model: ModelSpec) -> str:
    """The line that registers ``model`` as a torchtitan 0.2.2 llama3 flavour."""
    args = ", ".join(f"{k}={v!r}" for k, v in model_args(model).items() if v is not None)
    return f'llama3_configs["{model.name}"] = TransformerModelArgs({args})'


def recompute_rule(k: int):
    """Each block's recompute mode in torchtitan's layer rule: none (k = 0), all full (1), or
    every k-th block of a stage full (k >= 2); "op" (k = -1): all selective."""
    def mode(stage: int, block: int) -> str:
        if k < 0:
            return "selective"
        return "full" if k == 1 or (k >= 2 and (block + 1) % k == 0) else "none"

    return mode


def variants(plan: Plan, model: ModelSpec) -> Iterator[Plan]:
    """The plans of this shape torchtitan runs: SP with TP, ZeRO 0/2/3, none/full/every k-th
    recomputed, or every block selectively."""
    if model.is_moe:
        raise PartitaError(f"--to torchtitan: torchtitan trains experts only in its own model flavours (deepseek_v3, "
                           f"llama4, qwen3 MoE), none of them {model.name}'s blocks, so a job TOML cannot train this "
                           f"model; export it --to megatron, or register a torchtitan flavour for it")
    plan = context_variant(plan, model, ("ring",), "torchtitan")
    # with cp, torchtitan always runs FSDP over dp x cp (ParallelDims.fsdp_enabled); in a pipeline
    # its FSDP runs as ZeRO 1 (parallel.pipeline_zero_rule)
    zeros = (2, 3) if plan.cp > 1 else (0, 2, 3) if plan.dp > 1 else (0,)
    if plan.pp > 1:
        zeros = tuple(sorted({min(z, 1) for z in zeros}))
    most = max(blocks_per_stage(plan))
    for zero in zeros:
        for k in [*range(0, min(MAX_SELECTIVE, most) + 1), OP]:
            yield uniform(plan, model, sequence_parallel=True, zero=zero, recompute=recompute_rule(k))


def ac_setting(plan: Plan) -> tuple[str, str]:
    """(mode, selective_ac_option) of the plan (one of ``variants``)."""
    for k in [*range(0, MAX_SELECTIVE + 1), OP]:
        rule = recompute_rule(k)
        if all(l.recompute == rule(s.index, b) for s in plan.stages
               for b, l in enumerate(x for x in s.layers if is_block(x))):
            return ("none", "") if k == 0 else ("full", "") if k == 1 else ("selective", "op" if k == OP else str(k))
    raise ValueError("the plan's recomputation is not one torchtitan expresses")


def config(plan: Plan, model: ModelSpec) -> dict:
    """The job config as nested sections (what the TOML holds)."""
    zero = plan.layer_strategies()[0].zero
    par: dict = {"tensor_parallel_degree": plan.tp, "pipeline_parallel_degree": plan.pp}
    if zero == 0:
        par |= {"data_parallel_replicate_degree": plan.dp, "data_parallel_shard_degree": 1}
    else:
        par |= {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": plan.dp,
                "fsdp_reshard_after_forward": RESHARD[zero]}
    if plan.cp > 1:
        par |= {"context_parallel_degree": plan.cp, "context_parallel_rotate_method": "alltoall"}
    if plan.pp > 1:
        par |= {"pipeline_parallel_schedule": SCHEDULES[plan.schedule],
                "pipeline_parallel_microbatch_size": plan.micro_batch,
                "module_fqns_per_model_part": module_names(plan)}
    mode, option = ac_setting(plan)
    ac: dict = {"mode": mode}
    if mode == "selective":
        ac["selective_ac_option"] = option
    training = {"local_batch_size": plan.micro_batch * plan.num_micro_batches, "global_batch_size": plan.global_batch,
                "seq_len": plan.seq_len, "mixed_precision_param": "float32" if plan.dtype == "fp32" else "bfloat16"}
    # A flavour torchtitan ships when one is the model; else the model's own name, to register
    # (the header says how): never another model's flavour, which would train another model.
    model_section = {"name": "llama3", "flavor": flavor(model) or model.name}
    cfg = {"model": model_section, "parallelism": par, "activation_checkpoint": ac, "training": training}
    if plan.fp8:
        # torchao's Float8Linear on every linear but the output layer, tensorwise dynamic scaling,
        # FSDP's float8 all-gather with scales precomputed once a step (where FSDP shards), under
        # torch.compile, which float8 needs to run well (the torchtitan engine's fp8_impl "torchao").
        model_section["converters"] = ["quantize.linear.float8"]
        cfg["quantize.linear.float8"] = {"enable_fsdp_float8_all_gather": zero >= 1,
                                         "precompute_float8_dynamic_scale_for_fsdp": zero >= 1,
                                         "recipe_name": "tensorwise", "filter_fqns": ["output"]}
        cfg["compile"] = {"enable": True, "components": ["model", "loss"]}
    return cfg


# Partita's schedules by torchtitan's names for them (its pipeline_parallel_schedule, which it
# looks up in torch.distributed.pipelining's schedule classes without their "Schedule" prefix).
SCHEDULES = {"1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B", "interleaved-zb": "InterleavedZeroBubble",
             "zbv": "ZBVZeroBubble"}


def module_names(plan: Plan) -> list[list[str]]:
    """One list of torchtitan module names per (virtual) stage, in pipeline order (torchtitan's
    looped schedules put part c * pp + i on rank i, as Partita numbers virtual stages)."""
    names = []
    for chunk in plan.virtual_stage_layers():
        part = []
        for l in chunk:
            part += ["tok_embeddings"] if l.name == "embed" else ["norm", "output"] if l.name == "head" else [l.name]
        names.append(part)
    return names


def overrides_0_3(plan: Plan, cfg: dict) -> list[str]:
    """The plan as torchtitan main's ``--section.option`` overrides (``ParallelismConfig`` and
    ``TrainingConfig`` in torchtitan/config/configs.py at b5bcd76c): the batch in tokens, the
    pipeline's micro-batches by count."""
    par = {k: v for k, v in cfg["parallelism"].items() if k not in NOT_IN_0_3}
    if plan.pp > 1:
        par["num_pp_microbatches"] = plan.num_micro_batches
    training = {"num_tokens_per_microbatch_per_dp_rank": plan.micro_batch * plan.seq_len,
                "num_tokens_per_train_step": plan.global_batch * plan.seq_len, "max_context_length": plan.seq_len,
                "mixed_precision_param": cfg["training"]["mixed_precision_param"]}
    return [f"--{sec}.{key} {_cli(v)}" for sec, values in (("parallelism", par), ("training", training))
            for key, v in values.items()]


def render(plan: Plan, model: ModelSpec) -> str:
    cfg = config(plan, model)
    name = flavor(model)
    lines = [f"# torchtitan job config for {model.name}: {plan.mesh.describe()} (from `partita export`; keys as in "
             f"{VERSIONS})",
             "# torchtitan 0.2.x: torchrun ... -m torchtitan.train --job.config_file THIS_FILE"]
    overrides = " ".join(overrides_0_3(plan, cfg))
    if name:
        lines.append(f"# torchtitan >= 0.3 (no TOML): --module {CONFIG_MODULE} --config {CONFIGS[name]} {overrides}")
    else:
        lines += [f"# [model]: torchtitan ships no flavour that is {model.name}; register it in "
                  f"torchtitan/models/llama3/__init__.py first:",
                  f"#   {registration(model)}",
                  f"# torchtitan >= 0.3 (no TOML): a config function (torchtitan_recipes) with that model, run with "
                  f"--module M --config F {overrides}"]
    for section, values in cfg.items():
        lines += ["", f"[{section}]"] + [f"{k} = {_toml(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


# Keys left out of the torchtitan >= 0.3 override line: the split (a list, no command-line form
# there), the rotate method (0.3 has none) and the micro-batch size (0.3 counts micro-batches,
# num_pp_microbatches, and sizes them in tokens).
NOT_IN_0_3 = ("module_fqns_per_model_part", "context_parallel_rotate_method", "pipeline_parallel_microbatch_size")


def _toml(value) -> str:
    """A TOML value: strings and lists of strings are JSON-quoted (valid TOML basic strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value)


def _cli(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def notes(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> list[str]:
    out = []
    missing = [what for what, has in (("tied input and output embeddings", model.tie_embeddings),
                                      ("q/k/v biases", model.qkv_bias)) if has]
    if model.family != "llama" or missing:
        out.append(f"not expressible in torchtitan's llama3 model: "
                   f"{', '.join(missing) if missing else 'a ' + model.family + ' block (learned positions, LayerNorm, GELU, biases)'}"
                   f"; the registered flavour trains a llama3 block without them")
    if flavor(model) is None:
        out.append(f"torchtitan ships no flavour that is {model.name}: the TOML names flavor \"{model.name}\", which "
                   f"torchtitan trains once registered as the file's header says ({registration(model)})")
    if plan.dtype == "fp16":
        out.append("torchtitan trains in bfloat16 or float32, not fp16: the TOML says bfloat16, which this plan's "
                   "devices may lack")
    if plan.fp8:
        out.append("FP8 products: the [model] converters and [quantize.linear.float8] keys are torchtitan 0.2.2's; "
                   "on torchtitan >= 0.3 set the same float8 converter in the config function")
    if plan.cp > 1:
        out.append("torchtitan >= 0.3 has no context_parallel_rotate_method: its ring all-gathers the K/V blocks "
                   "(torch's default) where this prediction passes them one step at a time")
    return out
