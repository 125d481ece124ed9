"""Price published, measured training runs with Partita's cost model and print predicted
against measured throughput, with the source of every number.

    python benchmarks/published_runs.py [--runs benchmarks/published_runs.yaml] [--json rows.json] [--free]

Each run in the YAML (its header documents the fields) is built as Partita's layout at the
published configuration -- model, cluster, tensor/pipeline/data-parallel degrees, ZeRO level,
micro-batch, global batch, sequence length, recomputation -- and priced with the analytic cost
model (no measured profile) through ``partita.search.evaluate.evaluate_layout``, as the engine
that ran it runs it (``engine``: torchtitan, megatron, deepspeed; search/engines.py), with what
the run's own configuration changed from that engine's defaults (``engine_options``: its
attention kernel, when it reduces gradients, what it overlaps); a machine the device catalog lacks is declared under
``devices`` (a catalog entry with the source's own figures), added to the catalog only while its
runs are read and priced.

Both sides are compared in one metric, tokens per second per GPU:

* predicted: global_batch * seq_len / (predicted step time * GPUs);
* measured, as published: tokens/s per GPU as is; a step time the same way as the prediction;
  teraFLOP/s per GPU divided by the FLOPs per token of the formula the source counted with
  (Megatron-LM's 96 B s l h^2 (1 + s/6h + V/16lh) per step of B sequences, which counts the
  recomputed forward).

The MFU columns put both through one formula: Partita's model FLOPs per token
(``ModelSpec.train_flops_per_token``: 3x the forward, no recomputation) times tokens/s over the
catalog's dense peak of the device for the run's dtype. Error is (predicted - measured) /
measured. Runs marked ``closest`` are priced at the nearest configuration Partita can express
(their differences are printed); ``not_expressible`` runs are listed, not priced.

``--free`` adds the free search: ``partita plan`` (``search.planner.make_plan``, CP-SAT, its
default work limit) for each priced run's model, cluster, sequence length, dtype and global
batch, on Partita's runtime; its predicted gain over the published configuration as the run's
framework ran it (the row's prediction), and over the same published layout on Partita's runtime
(the layout's gain alone, without the engine's); and, where the free plan is more than
``GAIN_TO_EXPLAIN`` faster, the two plans' step times term by term (``FreeRow.terms``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from rich.console import Console
from rich.table import Table

from partita import parallel
from partita import specio
from partita.cluster import ClusterSpec, parse_short
from partita.devices import CATALOG, DeviceType, get_device
from partita.errors import PartitaError
from partita.model import BUILTIN, ModelSpec
from partita.plan import RECOMPUTE, Plan
from partita.search import context
from partita.search.costs.model import CostModel
from partita.search.evaluate import Evaluation, evaluate_interleaved, evaluate_layout, evaluate_plan
from partita.search.interleaved import chunk_names
from partita.search.engines import ENGINES, Engine
from partita.search.uniform import split_blocks, stage_layer_names, strategy

DEFAULT_RUNS = Path(__file__).with_name("published_runs.yaml")
PRICINGS = ("exact", "closest", "not_expressible")
METRICS = ("tokens_per_s_per_gpu", "tflops_per_gpu", "step_time_s")
FLOPS_FORMULAS = ("megatron_recompute", "palm", "megatron_core", "neox")
# What a published peak memory counts: torch's caching allocator's peak reserved bytes
# (torch.cuda.memory_stats()["reserved_bytes.all.peak"], which torchtitan logs as max_reserved).
MEMORY_METRICS = ("max_reserved",)
OVERRIDES = ("memory_gib", "intra_node_gbps", "network_gbps")
SOURCE_KEYS = ("title", "where", "url")
DEVICE_FIGURES = ("memory_gib", "bf16_tflops", "fp16_tflops", "fp32_tflops", "fp8_tflops", "hbm_gbps", "tdp_w", "power_limit_w",
                  "intra_node_gbps", "network_gbps")


@dataclass(frozen=True, kw_only=True)
class Measured:
    metric: str
    value: float
    flops: str | None = None  # the FLOP-count convention of a tflops_per_gpu figure


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    """One published run at its configuration, as the YAML gives it."""

    id: str
    source: Mapping[str, str]
    model: ModelSpec
    cluster: ClusterSpec
    seq_len: int
    dtype: str
    tp: int
    pp: int
    dp: int
    zero: int
    sequence_parallel: bool
    micro_batch: int
    global_batch: int
    recompute: str  # "none", "selective" or "full" (the YAML's true / false: full / none)
    measured: Measured
    pricing: str
    devices: tuple[DeviceType, ...] = ()  # the runs file's own device types (``devices``), for its cluster
    engine: Engine = ENGINES["partita"]  # the engine that ran it, with the run's own options
    blocks_per_stage: tuple[int, ...] | None = None
    # The pipeline schedule (partita.parallel.SCHEDULES) and, under an interleaved one, the
    # virtual stages a rank runs (the blocks split evenly over pp x virtual_stages slices).
    schedule: str = "1f1b"
    virtual_stages: int = 1
    # Expert parallelism of a mixture-of-experts model: ep consecutive data-parallel ranks split
    # the experts (search/experts.py), priced with balanced routing as ``partita plan`` does.
    ep: int = 1
    # Context parallelism: cp consecutive ranks (tp innermost, then cp) split each sequence, its
    # attention run as ``cp_variant`` (partita.parallel.CP_VARIANTS; search/context.py), priced
    # on the cost model's cp view as ``partita plan --cp`` prices it. dp counts replicas only.
    cp: int = 1
    cp_variant: str = "all_to_all"
    differences: tuple[str, ...] = ()
    why: str = ""
    assumed: tuple[str, ...] = ()
    notes: str = ""
    # A known gap of the cost model on this row: what it does not price and why the row stays
    # (priced and printed like every row; the issue-10 regression test leaves it out).
    gap: str = ""
    # Whether the source gives the run's micro-batch and schedule (False: Megatron-LM's 2024 scaling
    # study gives the degrees and the batch only, and the row prices an assumed split, which moves
    # its prediction by tens of percent: benchmarks/published_unknowns.py --megatron-readme).
    split_published: bool = True
    # The run's published peak device memory (GiB), where the source gives it, and what it
    # counts (``MEMORY_METRICS``): compared with the priced peak of the fullest rank.
    measured_memory_gib: float | None = None
    memory_metric: str = ""

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def config(self) -> str:
        cp = f" cp{self.cp} {self.cp_variant.replace('_', '-')}" if self.cp > 1 else ""
        parts = [f"tp{self.tp}{cp} pp{self.pp} dp{self.dp}" + (f" ep{self.ep}" if self.ep > 1 else ""),
                 f"ZeRO-{self.zero}" if self.zero else "DDP"]
        if self.sequence_parallel:
            parts.append("SP")
        parts.append(f"mb{self.micro_batch}x{self.num_micro_batches} gbs{self.global_batch} seq{self.seq_len}")
        parts.append({"none": "no recompute", "full": "recompute"}.get(self.recompute, f"{self.recompute} recompute"))
        if self.virtual_stages > 1:
            parts.append(f"{self.schedule} v{self.virtual_stages}")
        dtype = f"{self.dtype}, fp8 products" if self.engine.matmul == "fp8" else self.dtype
        return f"{self.model.name} on {self.cluster.short}: " + ", ".join(parts) + f", {dtype}"


@dataclass(frozen=True, kw_only=True)
class Row:
    """One line of the table (and of --json)."""

    id: str
    source: str
    url: str
    config: str
    pricing: str
    zero: int
    engine: str
    measured_as_published: str
    measured_tokens_per_s_per_gpu: float
    measured_mfu: float
    predicted_tokens_per_s_per_gpu: float | None = None
    predicted_mfu: float | None = None
    predicted_step_time_s: float | None = None
    error_pct: float | None = None
    fits: bool | None = None
    breakdown: dict[str, float] = dataclasses.field(default_factory=dict)
    remark: str = ""  # the differences of a closest row, the reason of a not-expressible one
    gap: str = ""  # a known gap of the cost model on the row (``PublishedRun.gap``)
    engine_refuses: str = ""  # why the row's engine does not run its layout (``engine_refusal``), if so
    split_published: bool = True  # ``PublishedRun.split_published``
    # The published peak memory and the priced peak of the fullest rank (GiB), where published.
    measured_memory_gib: float | None = None
    predicted_peak_gib: float | None = None

    @property
    def memory_error_pct(self) -> float | None:
        if self.measured_memory_gib is None or self.predicted_peak_gib is None:
            return None
        return 100.0 * (self.predicted_peak_gib - self.measured_memory_gib) / self.measured_memory_gib


# ---- reading the YAML ------------------------------------------------------------------------
def load_runs(path: str | Path = DEFAULT_RUNS) -> list[PublishedRun]:
    data = specio.require_mapping(specio.load_yaml(path), str(path))
    specio.check_version(data, 1, str(path))
    extra = [k for k in data if k not in ("schema_version", "devices", "runs")]
    if extra:
        raise PartitaError(f"{path}: unknown key {extra[0]!r}; valid keys: schema_version, devices, runs")
    devices = _devices(data.get("devices"), str(path))
    runs = data.get("runs")
    if not isinstance(runs, list) or not runs:
        raise PartitaError(f"{path}: 'runs' must be a non-empty list")
    with catalog_with(devices):
        out = [run_from_dict(r, f"{path}: runs[{i}]", devices) for i, r in enumerate(runs)]
    ids = [r.id for r in out]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise PartitaError(f"{path}: run ids must be unique; repeated: {', '.join(dupes)}")
    return out


@contextmanager
def catalog_with(devices: Sequence[DeviceType]) -> Iterator[None]:
    """The device catalog with the runs file's own device types in it, for as long as a run is
    read or priced (cluster short forms and the cost model look devices up by name)."""
    added = [d for d in devices if d.name not in CATALOG]
    CATALOG.update({d.name: d for d in added})
    try:
        yield
    finally:
        for d in added:
            CATALOG.pop(d.name, None)


def _devices(data: Any, where: str) -> tuple[DeviceType, ...]:
    """Device types a published machine has that the catalog lacks: a catalog entry (``like``)
    with the figures the source gives instead, and the source of those figures."""
    if data is None:
        return ()
    if not isinstance(data, list):
        raise PartitaError(f"{where}: 'devices' must be a list of device types")
    out = []
    for i, d in enumerate(data):
        w = f"{where}: devices[{i}]"
        d = specio.require_mapping(d, w)
        valid = ("name", "like", "source") + DEVICE_FIGURES
        bad = [k for k in d if k not in valid]
        if bad:
            raise PartitaError(f"{w}: unknown key {bad[0]!r}; valid keys: {', '.join(valid)}")
        name, like, source = (specio.get_str(d, k, w) for k in ("name", "like", "source"))
        if name in CATALOG:
            raise PartitaError(f"{w}: {name!r} is a catalog device; give the variant its own name")
        changes: dict[str, Any] = {k: specio.get_float(d, k, w) for k in DEVICE_FIGURES if k in d and k != "memory_gib"}
        if "memory_gib" in d:
            changes["memory_bytes"] = int(specio.get_float(d, "memory_gib", w) * 2**30)
        out.append(dataclasses.replace(get_device(like), name=name, source=source, **changes))
    return tuple(out)


def run_from_dict(data: Any, where: str, devices: Sequence[DeviceType] = ()) -> PublishedRun:
    data = specio.require_mapping(data, where)
    fields = ([f.name for f in dataclasses.fields(PublishedRun)
               if f.name not in ("devices", "measured_memory_gib", "memory_metric")]
              + ["cluster_overrides", "engine_options", "measured_memory", "fp8"])
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise PartitaError(f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(fields)}")
    required = ("id", "source", "model", "cluster", "engine", "seq_len", "dtype", "tp", "pp", "dp", "zero",
                "sequence_parallel", "micro_batch", "global_batch", "recompute", "measured", "pricing")
    missing = [k for k in required if k not in data]
    if missing:
        raise PartitaError(f"{where}: missing {', '.join(missing)}")
    run_id = specio.get_str(data, "id", where)
    where = f"{where} ({run_id})"
    source = _source(data["source"], where)
    model = _model(data["model"], where)
    cluster = _cluster(data["cluster"], data.get("cluster_overrides") or {}, where)
    ints = {k: specio.get_int(data, k, where) for k in ("seq_len", "tp", "pp", "dp", "micro_batch", "global_batch")}
    zero = specio.get_int(data, "zero", where, minimum=0)
    if zero > 3:
        raise PartitaError(f"{where}: zero must be 0, 1, 2 or 3, got {zero}")
    pricing = specio.get_str(data, "pricing", where, choices=PRICINGS)
    run = PublishedRun(
        id=run_id, source=source, model=model, cluster=cluster, zero=zero, pricing=pricing, devices=tuple(devices),
        dtype=specio.get_str(data, "dtype", where, choices=("bf16", "fp16")),
        sequence_parallel=specio.get_bool(data, "sequence_parallel", where),
        recompute=_recompute(data, where),
        measured=_measured(data["measured"], where), engine=_engine(data, where),
        blocks_per_stage=tuple(data["blocks_per_stage"]) if data.get("blocks_per_stage") else None,
        schedule=specio.get_str(data, "schedule", where, choices=parallel.SCHEDULES) if "schedule" in data else "1f1b",
        virtual_stages=specio.get_int(data, "virtual_stages", where) if "virtual_stages" in data else 1,
        ep=specio.get_int(data, "ep", where) if "ep" in data else 1,
        cp=specio.get_int(data, "cp", where) if "cp" in data else 1,
        cp_variant=(specio.get_str(data, "cp_variant", where, choices=parallel.CP_VARIANTS)
                    if "cp_variant" in data else "all_to_all"),
        differences=tuple(_strings(data, "differences", where)), assumed=tuple(_strings(data, "assumed", where)),
        why=_optional_str(data, "why", where), notes=_optional_str(data, "notes", where),
        gap=_optional_str(data, "gap", where),
        split_published=specio.get_bool(data, "split_published", where) if "split_published" in data else True,
        **_measured_memory(data, where), **ints)
    _check_run(run, where)
    return run


def _recompute(data: Mapping[str, Any], where: str) -> str:
    """The blocks' recomputation: true (full) or false (none), or a mode by name."""
    value = data["recompute"]
    if isinstance(value, bool):
        return "full" if value else "none"
    return specio.get_str(data, "recompute", where, choices=RECOMPUTE)


def _source(data: Any, where: str) -> dict[str, str]:
    data = specio.require_mapping(data, f"{where}: source")
    for key in SOURCE_KEYS:
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise PartitaError(f"{where}: source needs a non-empty {key!r} ({', '.join(SOURCE_KEYS)})")
    extra = [k for k in data if k not in SOURCE_KEYS]
    if extra:
        raise PartitaError(f"{where}: source: unknown key {extra[0]!r}; valid keys: {', '.join(SOURCE_KEYS)}")
    return {k: data[k] for k in SOURCE_KEYS}


def _model(data: Any, where: str) -> ModelSpec:
    if isinstance(data, str):
        if data not in BUILTIN:
            raise PartitaError(f"{where}: model {data!r} is not built in; give its ModelSpec fields instead")
        return BUILTIN[data]
    return ModelSpec.from_dict(data, f"{where}: model")


def _cluster(text: Any, overrides: Any, where: str) -> ClusterSpec:
    if not isinstance(text, str):
        raise PartitaError(f"{where}: cluster must be a short form like 16x8xH100")
    cluster = parse_short(text)
    if len(cluster.groups) != 1:
        raise PartitaError(f"{where}: a published run here is one node group, got {text!r}")
    overrides = specio.require_mapping(overrides, f"{where}: cluster_overrides")
    bad = [k for k in overrides if k not in OVERRIDES]
    if bad:
        raise PartitaError(f"{where}: cluster_overrides: unknown key {bad[0]!r}; valid keys: {', '.join(OVERRIDES)}")
    group = cluster.groups[0]
    changes: dict[str, Any] = {}
    if "memory_gib" in overrides:
        changes["memory_bytes"] = int(specio.get_float(overrides, "memory_gib", where) * 2**30)
    for key in ("intra_node_gbps", "network_gbps"):
        if key in overrides:
            changes[key] = specio.get_float(overrides, key, where)
    return dataclasses.replace(cluster, groups=(dataclasses.replace(group, **changes),))


def _engine(data: Mapping, where: str) -> Engine:
    """The engine that ran the row, with its options; ``fp8: true`` (as a plan's ``fp8``): its
    blocks' products in FP8 (``Engine.matmul``)."""
    name = specio.get_str(data, "engine", where, choices=tuple(ENGINES))
    options = dict(specio.require_mapping(data.get("engine_options") or {}, f"{where}: engine_options"))
    if "fp8" in data and specio.get_bool(data, "fp8", where):
        options["matmul"] = "fp8"
    return ENGINES[name].with_options(options, f"{where}: engine_options")


def _measured(data: Any, where: str) -> Measured:
    data = specio.require_mapping(data, f"{where}: measured")
    metric = specio.get_str(data, "metric", where, choices=METRICS)
    value = specio.get_float(data, "value", where)
    flops = data.get("flops")
    if metric == "tflops_per_gpu" and flops not in FLOPS_FORMULAS:
        raise PartitaError(f"{where}: a tflops_per_gpu figure needs flops: one of {', '.join(FLOPS_FORMULAS)}")
    extra = [k for k in data if k not in ("metric", "value", "flops")]
    if extra:
        raise PartitaError(f"{where}: measured: unknown key {extra[0]!r}; valid keys: metric, value, flops")
    return Measured(metric=metric, value=value, flops=flops)


def _measured_memory(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``measured_memory: {gib: 82.4, metric: max_reserved}``, or nothing."""
    if "measured_memory" not in data:
        return {}
    memory = specio.require_mapping(data["measured_memory"], f"{where}: measured_memory")
    extra = [k for k in memory if k not in ("gib", "metric")]
    if extra or "gib" not in memory or "metric" not in memory:
        raise PartitaError(f"{where}: measured_memory takes gib and metric (one of {', '.join(MEMORY_METRICS)}), "
                           f"got {', '.join(map(str, memory)) or 'nothing'}")
    return dict(measured_memory_gib=specio.get_float(memory, "gib", f"{where}: measured_memory"),
                memory_metric=specio.get_str(memory, "metric", f"{where}: measured_memory", choices=MEMORY_METRICS))


def _optional_str(data: Mapping[str, Any], key: str, where: str) -> str:
    return specio.get_str(data, key, where) if key in data else ""


def _strings(data: Mapping[str, Any], key: str, where: str) -> list[str]:
    value = data.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise PartitaError(f"{where}: {key} must be a list of sentences")
    return value


def _check_run(run: PublishedRun, where: str) -> None:
    """The numbers must make one layout; say which do not."""
    if run.gpus != run.cluster.world_size:
        cp = f" x cp {run.cp}" if run.cp > 1 else ""
        raise PartitaError(f"{where}: tp {run.tp}{cp} x pp {run.pp} x dp {run.dp} = {run.gpus} GPUs, but the "
                           f"cluster {run.cluster.short} has {run.cluster.world_size}")
    if run.global_batch % (run.dp * run.micro_batch):
        raise PartitaError(f"{where}: global batch {run.global_batch} is not a multiple of dp {run.dp} x micro-batch "
                           f"{run.micro_batch}")
    if run.pricing == "closest" and not run.differences:
        raise PartitaError(f"{where}: a closest pricing must list its differences")
    if run.pricing == "not_expressible" and not run.why:
        raise PartitaError(f"{where}: a not_expressible run must say why")
    if run.pricing == "exact" and run.differences:
        raise PartitaError(f"{where}: an exact pricing has no differences; call it closest")
    if run.blocks_per_stage is not None:
        if len(run.blocks_per_stage) != run.pp or sum(run.blocks_per_stage) != run.model.n_layers:
            raise PartitaError(f"{where}: blocks_per_stage {list(run.blocks_per_stage)} must have pp = {run.pp} "
                               f"entries summing to the model's {run.model.n_layers} blocks")
    if run.schedule in ("interleaved-1f1b", "interleaved-zb") and run.virtual_stages < 2:
        raise PartitaError(f"{where}: schedule {run.schedule} needs virtual_stages of 2 or more")
    if run.schedule in ("1f1b", "zbv") and run.virtual_stages != (2 if run.schedule == "zbv" else 1):
        raise PartitaError(f"{where}: schedule {run.schedule} runs {2 if run.schedule == 'zbv' else 1} virtual "
                           f"stage(s) a rank, got virtual_stages {run.virtual_stages}")
    if run.virtual_stages > 1 and run.blocks_per_stage is not None:
        raise PartitaError(f"{where}: blocks_per_stage is for one virtual stage a rank; an interleaved run splits "
                           "its blocks evenly over pp x virtual_stages")
    if run.virtual_stages > 1 and run.model.n_layers + 2 < run.pp * run.virtual_stages:
        # the first slice may hold the embedding alone and the last the head alone (Llama 3's layout)
        raise PartitaError(f"{where}: {run.model.n_layers} blocks cannot fill pp {run.pp} x virtual_stages "
                           f"{run.virtual_stages} slices")
    block = run.model.kinds["block"]
    cp_rules = (parallel.cp_rule(block, run.cp, tp=run.tp, variant=run.cp_variant, seq_len=run.seq_len),
                parallel.cp_locality_rule(run.cp, run.tp, run.cluster.groups[0].gpus_per_node))
    if run.cp == 1 and run.cp_variant != "all_to_all":
        raise PartitaError(f"{where}: cp_variant {run.cp_variant} needs cp of 2 or more")
    for why in (parallel.ep_rule(block, run.ep, run.dp), parallel.tp_rule(block, run.tp)) + cp_rules:
        if why:
            raise PartitaError(f"{where}: {why}")
    if run.sequence_parallel and run.tp == 1:
        raise PartitaError(f"{where}: sequence parallelism needs tp > 1")


def engine_refusal(run: PublishedRun) -> str:
    """Why the row's engine, by the rule book the search and the validator obey, does not run the
    row's layout ("" where it does): a pipeline's ZeRO level, the schedule's micro-batches, FP8.
    Such a row is still priced (a runs file of someone else's may hold one) and says so."""
    with catalog_with(run.devices):
        rules = (parallel.pipeline_zero_rule(run.engine.name, run.pp, [("blocks", run.zero)]),
                 parallel.schedule_rule(run.schedule, run.pp, run.virtual_stages, run.num_micro_batches,
                                        run.engine.name),
                 parallel.fp8_rule(run.engine.name, run.dtype, run.cluster.groups, moe=run.model.is_moe)
                 if run.engine.matmul == "fp8" else None)
    return "; ".join(why for why in rules if why)


def splits(run: PublishedRun) -> Iterator[PublishedRun]:
    """The run at each split of its batch its source leaves open (``split_published`` false): each
    micro-batch up to 8 that divides its sequences a data-parallel rank and, in a pipeline, each
    even split of a rank's layers into virtual stages (interleaved 1F1B), where its engine runs it
    and it fits."""
    per_rank, layers = run.global_batch // run.dp, run.model.n_layers // run.pp
    for mb in (b for b in (1, 2, 4, 8) if per_rank % b == 0):
        for v in (d for d in range(1, layers + 1) if layers % d == 0) if run.pp > 1 else (1,):
            split = dataclasses.replace(run, micro_batch=mb, virtual_stages=v,
                                        schedule="interleaved-1f1b" if v > 1 else "1f1b")
            if not engine_refusal(split) and evaluate_run(split).fits:
                yield split


# ---- the common metric -----------------------------------------------------------------------
def palm_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """PaLM's model FLOPs a token (Chowdhery et al. 2022, Appendix B): 6 N + 12 L H Q T, every
    parameter's products forward and backward and attention's score products over the whole
    sequence (causal masking not subtracted), recomputation not counted."""
    return 6.0 * model.n_params + 12.0 * model.n_layers * model.hidden * seq_len


def neox_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """FLOPs a token GPT-NeoX's training log counted with in 2022 (megatron/logging.py,
    ``get_flops``, at the commit of the 20B release): 6 N + 60 s h l, N every parameter of the
    model (``model.total_params``), recomputation not counted."""
    return 6.0 * model.n_params + 60.0 * seq_len * model.hidden * model.n_layers


def megatron_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """FLOPs per token Megatron-LM counts with full recomputation (Narayanan et al. 2021,
    Appendix): 96 B s l h^2 (1 + s/6h + V/16lh) per step of B sequences of s tokens."""
    l, h, s, v = model.n_layers, model.hidden, seq_len, model.vocab
    return 96.0 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def megatron_core_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """FLOPs a token as Megatron-LM counts them since 2024 (megatron/training/training.py,
    ``num_floating_point_operations``): 12 l h^2 ((1 + g + s/h) + f/h x k x 3/2 if gated) + 6 V h,
    the attention's projections (g: kv heads over heads) and its scores over the whole sequence,
    the MLP (k experts a token, f each), the output layer once; recomputation not counted."""
    l, h, s, v = model.n_layers, model.hidden, seq_len, model.vocab
    gated = 1.5 if model.family == "llama" else 1.0
    routed = model.experts_per_token if model.is_moe else 1
    attention = 1 + model.kv_heads / model.heads + s / h
    return 12.0 * l * h * h * (attention + model.ffn / h * routed * gated) + 6.0 * v * h


def measured_tokens_per_s_per_gpu(run: PublishedRun) -> float:
    m = run.measured
    if m.metric == "tokens_per_s_per_gpu":
        return m.value
    if m.metric == "step_time_s":
        return run.global_batch * run.seq_len / (m.value * run.gpus)
    if m.flops == "megatron_recompute":
        return m.value * 1e12 / megatron_flops_per_token(run.model, run.seq_len)
    if m.flops == "palm":
        return m.value * 1e12 / palm_flops_per_token(run.model, run.seq_len)
    if m.flops == "neox":
        return m.value * 1e12 / neox_flops_per_token(run.model, run.seq_len)
    if m.flops == "megatron_core":
        return m.value * 1e12 / megatron_core_flops_per_token(run.model, run.seq_len)
    raise PartitaError(f"{run.id}: no conversion for {m.metric} counted as {m.flops}")


def mfu(run: PublishedRun, tokens_per_s_per_gpu: float) -> float:
    with catalog_with(run.devices):
        peak = get_device(run.cluster.groups[0].device).peak_tflops(run.dtype) * 1e12
    return tokens_per_s_per_gpu * run.model.train_flops_per_token(run.seq_len) / peak


def as_published(m: Measured) -> str:
    if m.metric == "tokens_per_s_per_gpu":
        return f"{m.value:,.1f} tok/s/GPU"
    if m.metric == "step_time_s":
        return f"{m.value:.2f} s/step"
    return f"{m.value:g} TFLOP/s/GPU"


# ---- pricing ----------------------------------------------------------------------------------
def evaluate_run(run: PublishedRun) -> Evaluation:
    """The published layout, priced by the analytic cost model."""
    with catalog_with(run.devices):
        return _evaluate(run)


def _evaluate(run: PublishedRun) -> Evaluation:
    cm = CostModel(run.model, run.cluster, seq_len=run.seq_len, dtype=run.dtype, engine=run.engine)
    if run.cp > 1:  # priced on its view, a rank of it a cp group (search/context.py), as evaluate_plan does
        cm = cm.at_cp(run.cp, run.cp_variant, context.span_tp_of(run.cluster, run.cp, run.tp))
    if run.model.is_moe:
        cm = cm.at_ep(run.ep)
    group = cm.cluster.groups[0]
    def layers(names: Sequence[str]) -> list:
        return [strategy(run.model, name, tp=run.tp, sp=run.sequence_parallel, zero=run.zero,
                         recompute=run.recompute) for name in names]

    if run.virtual_stages > 1:
        chunks = chunk_names(run.model.n_layers, run.pp, run.virtual_stages, run.schedule)
        return evaluate_interleaved(cm, [(group, [layers(c) for c in stage]) for stage in chunks], dp=run.dp,
                                    tp=run.tp, micro_batch=run.micro_batch, num_micro_batches=run.num_micro_batches,
                                    schedule=run.schedule)
    blocks = list(run.blocks_per_stage or split_blocks(run.model.n_layers, run.pp))
    stages = [(group, layers(names)) for names in stage_layer_names(run.model, blocks)]
    return evaluate_layout(cm, stages, dp=run.dp, tp=run.tp, micro_batch=run.micro_batch,
                           num_micro_batches=run.num_micro_batches)


def price(run: PublishedRun) -> Row:
    with catalog_with(run.devices):
        return _price(run)


def _price(run: PublishedRun) -> Row:
    measured = measured_tokens_per_s_per_gpu(run)
    base = dict(id=run.id, source=f"{run.source['title']} -- {run.source['where']}", url=run.source["url"],
                config=run.config, pricing=run.pricing, zero=run.zero, engine=run.engine.name, gap=run.gap,
                split_published=run.split_published,
                measured_as_published=as_published(run.measured),
                measured_tokens_per_s_per_gpu=measured, measured_mfu=mfu(run, measured),
                measured_memory_gib=run.measured_memory_gib)
    if run.pricing == "not_expressible":
        return Row(**base, remark=f"not expressible: {run.why}")
    ev = evaluate_run(run)
    predicted = run.global_batch * run.seq_len / (ev.step_time_s * run.gpus)
    return Row(**base, predicted_tokens_per_s_per_gpu=predicted, predicted_mfu=mfu(run, predicted),
               predicted_step_time_s=ev.step_time_s, error_pct=100.0 * (predicted - measured) / measured,
               fits=ev.fits, breakdown={k: round(v, 6) for k, v in ev.breakdown.items()},
               remark="; ".join(run.differences), engine_refuses=engine_refusal(run),
               predicted_peak_gib=max(s.peak_bytes for s in ev.stages) / 2**30)


# ---- summary ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Summary:
    label: str
    count: int
    median_abs_error_pct: float | None
    max_abs_error_pct: float | None
    worst: str | None


def summarise(label: str, rows: Sequence[Row]) -> Summary:
    priced = [r for r in rows if r.error_pct is not None]
    if not priced:
        return Summary(label, 0, None, None, None)
    errors = [abs(r.error_pct) for r in priced]  # type: ignore[arg-type]
    worst = max(priced, key=lambda r: abs(r.error_pct))  # type: ignore[arg-type]
    return Summary(label, len(priced), statistics.median(errors), max(errors), worst.id)


def summaries(rows: Sequence[Row]) -> list[Summary]:
    out = [summarise("priced (exact + closest)", rows),
           summarise("exact only", [r for r in rows if r.pricing == "exact"]),
           summarise("ZeRO-3 / FSDP rows", [r for r in rows if r.zero == 3]),
           summarise("rows without a known gap", [r for r in rows if not r.gap]),
           summarise("rows whose micro-batch and schedule the source does not give (assumed)",
                     [r for r in rows if not r.split_published])]
    by_engine = {name: [r for r in rows if r.engine == name] for name in ENGINES}
    out += [summarise(f"engine {name}", own) for name, own in by_engine.items() if own]
    # Where the two differ, the engine's rows of a published split and no known gap of the cost
    # model: the rows issue 23's per-engine line is read on (tests/test_published_runs.py holds
    # the megatron and torchtitan engines' lines; the deepspeed engine's does not meet it yet).
    for name, own in by_engine.items():
        kept = [r for r in own if r.split_published and not r.gap]
        if kept and len(kept) < len(own):
            out.append(summarise(f"engine {name}, split published, no known gap", kept))
    return out


# ---- output -----------------------------------------------------------------------------------
def render(rows: Sequence[Row], console: Console) -> None:
    """The table, then what each priced-at-closest or unpriced row differs by, then the summary."""
    table = Table(title="Published runs: predicted (analytic cost model) against measured", show_lines=True)
    for name, kw in (("run", {}), ("source", {"max_width": 48}), ("config", {"max_width": 40}),
                     ("measured", {"justify": "right"}), ("predicted", {"justify": "right"}),
                     ("error %", {"justify": "right"})):
        table.add_column(name, **kw)
    for r in rows:
        measured = (f"{r.measured_as_published}\n= {r.measured_tokens_per_s_per_gpu:,.1f} tok/s/GPU\n"
                    f"MFU {100 * r.measured_mfu:.1f} %")
        if r.predicted_tokens_per_s_per_gpu is None:
            predicted, error = "not expressible", "-"
        else:
            predicted = (f"{r.predicted_tokens_per_s_per_gpu:,.1f} tok/s/GPU\nMFU {100 * (r.predicted_mfu or 0):.1f} %\n"
                         f"step {r.predicted_step_time_s:.2f} s" + ("" if r.fits else "\n(over memory)")
                         + ("\n(engine refuses)" if r.engine_refuses else ""))
            error = f"{r.error_pct:+.1f}"
        run = r.id + ("" if r.pricing == "exact" else f"\n[{r.pricing.replace('_', ' ')}]")
        table.add_row(run, r.source, r.config, measured, predicted, error)
    console.print(table)
    for r in rows:
        if r.remark:
            label = "closest, differs by" if r.pricing == "closest" else "not priced"
            console.print(f"- {r.id} ({label}): {r.remark.removeprefix('not expressible: ')}")
    for r in rows:
        if r.engine_refuses:
            console.print(f"- {r.id} (priced, but its engine does not run the layout): {r.engine_refuses}")
    console.print()
    for s in summaries(rows):
        if s.count:
            console.print(f"{s.label}: {s.count} rows, median |error| {s.median_abs_error_pct:.1f} %, "
                          f"max |error| {s.max_abs_error_pct:.1f} % ({s.worst})")
        else:
            console.print(f"{s.label}: no rows")
    refused = [r.id for r in rows if r.engine_refuses]
    console.print(f"rows whose engine does not run the layout (the rule book, partita.parallel): {len(refused)}"
                  + (f" ({', '.join(refused)})" if refused else ""))
    with_memory = [r for r in rows if r.memory_error_pct is not None]
    if with_memory:
        console.print()
        for r in with_memory:
            console.print(f"memory, {r.id}: published {r.measured_memory_gib:.1f} GiB, priced peak "
                          f"{r.predicted_peak_gib:.1f} GiB ({r.memory_error_pct:+.1f} %)")
        errors = [abs(r.memory_error_pct) for r in with_memory]  # type: ignore[arg-type]
        console.print(f"memory against published peaks: {len(with_memory)} rows, median |error| "
                      f"{statistics.median(errors):.1f} %, max |error| {max(errors):.1f} %")


# ---- the free search ------------------------------------------------------------------------------
# A free plan more than this much faster than a published configuration is explained term by term.
GAIN_TO_EXPLAIN = 1.2
# The step's terms, in the order of ``costs.step_time_s``'s breakdown, with the recomputed
# forward taken out of compute (``_terms``).
TERMS = ("compute", "recompute", "tensor_parallel_comm", "zero_exposed", "pipeline_send", "pipeline_bubble",
         "data_parallel_exposed", "tied_embedding_sync", "optimizer", "step_overhead")


@dataclass(frozen=True, kw_only=True)
class FreeRow:
    """Partita's own plan for a run's model, cluster, sequence length and global batch, against
    the run's published layout (seconds per step)."""

    id: str
    plan: str  # the free plan's layout, in the words of ``PublishedRun.config``
    status: str  # the search's status and gap
    step_time_s: float
    published_step_time_s: float  # the published layout as the run's framework ran it (the row's prediction)
    runtime_step_time_s: float  # the published layout on Partita's runtime (the free plan's software)
    terms: dict[str, float]  # the free plan's step by term (``TERMS``)
    published_terms: dict[str, float]  # the published layout's on Partita's runtime
    peak_fraction: float  # the free plan's largest predicted peak over its device's memory
    published_peak_fraction: float  # the published layout's, on Partita's runtime

    @property
    def gain(self) -> float:
        """Over the published configuration as it ran."""
        return self.published_step_time_s / self.step_time_s

    @property
    def layout_gain(self) -> float:
        """Over the published layout on the same software as the free plan."""
        return self.runtime_step_time_s / self.step_time_s


def free_search(run: PublishedRun, margin: float = 0.0, work_limit: float | None = None) -> FreeRow:
    """``margin``: the fraction of each device's memory the free plan keeps free (``partita plan
    --memory-margin``); the gains of plans that fill the memory rest on the memory prediction."""
    with catalog_with(run.devices):
        return _free_search(run, margin, work_limit)


def _free_search(run: PublishedRun, margin: float, work_limit: float | None) -> FreeRow:
    from partita.search.planner import PlanRequest, make_plan

    groups = tuple(dataclasses.replace(g, memory_bytes=int(g.memory_bytes * (1 - margin))) for g in run.cluster.groups)
    plan, _ = make_plan(PlanRequest(model=run.model, cluster=dataclasses.replace(run.cluster, groups=groups),
                                    seq_len=run.seq_len, global_batch=run.global_batch, dtype=run.dtype,
                                    work_limit=work_limit))
    cm = CostModel(run.model, run.cluster, seq_len=run.seq_len, dtype=run.dtype)  # the whole device's memory
    free = evaluate_plan(plan, cm)
    no_recompute = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(st, layers=tuple(dataclasses.replace(l, recompute="none") for l in st.layers))
        for st in plan.stages))
    on_runtime = dataclasses.replace(run, engine=ENGINES["partita"])
    published = _evaluate(on_runtime)
    solver = plan.solver
    status = f"{solver.status}, gap {100 * solver.gap:.1f} %" if solver is not None else "-"
    return FreeRow(id=run.id, plan=plan_config(plan), status=status, step_time_s=free.step_time_s,
                   published_step_time_s=_evaluate(run).step_time_s, runtime_step_time_s=published.step_time_s,
                   terms=_terms(free, evaluate_plan(no_recompute, cm)),
                   published_terms=_terms(published, _evaluate(dataclasses.replace(on_runtime, recompute="none"))),
                   peak_fraction=free.peak_over_capacity, published_peak_fraction=published.peak_over_capacity)


def _terms(ev: Evaluation, without_recompute: Evaluation) -> dict[str, float]:
    """The step's breakdown with the recomputed forward (and its TP collectives) out of compute
    and tensor-parallel communication: what the same layout spends there without recomputation
    (its memory aside). The terms add up to the step."""
    out = {t: ev.breakdown.get(t, 0.0) for t in TERMS if t != "recompute"}
    recompute_compute = ev.breakdown["compute"] - without_recompute.breakdown["compute"]
    recompute_tp = ev.breakdown["tensor_parallel_comm"] - without_recompute.breakdown["tensor_parallel_comm"]
    out["compute"] -= recompute_compute
    out["tensor_parallel_comm"] -= recompute_tp
    out["recompute"] = recompute_compute + recompute_tp
    return {t: out[t] for t in TERMS}


def plan_config(plan: Plan) -> str:
    """A plan's layout in short: degrees, the ZeRO levels and recomputation of its blocks, SP,
    micro-batching, schedule."""
    blocks = [l for st in plan.stages for l in st.layers if l.name.startswith("layers.")]
    zeros = sorted({l.zero for l in blocks})
    cp = f" cp{plan.cp} {plan.cp_variant.replace('_', '-')}" if plan.cp > 1 else ""
    parts = [f"tp{plan.tp}{cp} pp{plan.pp} dp{plan.dp}", "/".join(f"ZeRO-{z}" if z else "DDP" for z in zeros)]
    if any(l.sequence_parallel for l in blocks):
        parts.append("SP")
    parts.append(f"mb{plan.micro_batch}x{plan.num_micro_batches}")
    for mode in ("full", "selective"):
        recomputed = sum(l.recompute == mode for l in blocks)
        if recomputed:
            label = "recompute" if mode == "full" else "selective recompute"
            parts.append(label if recomputed == len(blocks) else f"{label} {recomputed}/{len(blocks)} blocks")
    if all(l.recompute == "none" for l in blocks):
        parts.append("no recompute")
    if plan.schedule != "1f1b":
        parts.append(f"{plan.schedule} v{plan.virtual_stages}")
    if plan.pp > 1:
        parts.append("blocks " + "+".join(str(sum(l.name.startswith("layers.") for l in st.layers))
                                          for st in plan.stages))
    return ", ".join(parts)


def render_free(rows: Sequence[FreeRow], console: Console) -> None:
    """The free plans against the published layouts, then the terms of each gain to explain."""
    table = Table(title="Free search on each run's cluster (Partita's runtime): predicted step time", show_lines=True)
    for name, kw in (("run", {}), ("published layout", {"justify": "right"}),
                     ("same layout, Partita's runtime", {"justify": "right"}), ("free plan", {"max_width": 48}),
                     ("free step", {"justify": "right"}), ("gain", {"justify": "right"}),
                     ("layout gain", {"justify": "right"}), ("peak memory, published -> free", {"justify": "right"})):
        table.add_column(name, **kw)
    for r in rows:
        table.add_row(r.id, f"{r.published_step_time_s:.2f} s", f"{r.runtime_step_time_s:.2f} s",
                      f"{r.plan}\n({r.status})", f"{r.step_time_s:.2f} s", f"{r.gain:.2f}x", f"{r.layout_gain:.2f}x",
                      f"{100 * r.published_peak_fraction:.0f} % -> {100 * r.peak_fraction:.0f} %")
    console.print(table)
    for r in rows:
        if max(r.gain, r.layout_gain) <= GAIN_TO_EXPLAIN:
            continue
        console.print(f"\n{r.id}: gain {r.gain:.2f}x, layout gain {r.layout_gain:.2f}x; seconds per step on "
                      f"Partita's runtime, published layout -> free plan")
        for t in TERMS:
            a, b = r.published_terms[t], r.terms[t]
            if a or b:
                console.print(f"  {t:22s} {a:9.3f} -> {b:9.3f}  ({b - a:+.3f})")
        console.print(f"  {'step':22s} {r.runtime_step_time_s:9.3f} -> {r.step_time_s:9.3f}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=str(DEFAULT_RUNS), help="the runs file (default: %(default)s)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows and the summary as JSON")
    ap.add_argument("--free", action="store_true",
                    help="also plan each priced run's model and cluster freely (CP-SAT: a minute) and compare")
    ap.add_argument("--free-margin", type=float, default=0.0, metavar="FRACTION",
                    help="with --free: the fraction of device memory the free plans keep free (default 0)")
    args = ap.parse_args(argv)
    try:
        runs = load_runs(args.runs)
        rows = [price(run) for run in runs]
        free = ([free_search(run, args.free_margin) for run in runs  # Partita's runtime multiplies in bf16
                 if run.pricing != "not_expressible" and run.engine.matmul == "compute"]
                if args.free else [])
    except PartitaError as e:
        print(f"published_runs: {e}", file=sys.stderr)
        return 2
    if args.json:
        payload = {"rows": [dataclasses.asdict(r) for r in rows],
                   "summary": [dataclasses.asdict(s) for s in summaries(rows)]}
        if args.free:
            payload["free"] = [dataclasses.asdict(r) | {"gain": r.gain, "layout_gain": r.layout_gain} for r in free]
        Path(args.json).write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    render(rows, console)
    if free:
        console.print()
        render_free(free, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
