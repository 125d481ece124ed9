"""The plan: which ranks run which layers, how, and what that is predicted to cost.

A plan is versioned YAML that a person can read and write by hand; the search produces the
same type. It speaks the runtime's words: module names (``embed``, ``layers.3``, ``head``),
named mesh dimensions (``pp``, ``dp``, ``tp``) and named per-layer choices.

Mesh layout (``mesh``, a ``partita.mesh.Mesh``). Every stage has ``dp * cp * tp`` ranks, listed dp-major, then context-parallel,
then tensor-parallel: the rank at data-parallel index ``d``, context-parallel index ``c`` and
tensor-parallel index ``t`` is ``stage.ranks[(d * cp + c) * tp + t]`` (tp innermost, cp next:
Llama 3's order, so a cp group spans ``cp * tp`` consecutive ranks). Pipeline replica
``(d, c, t)`` runs through ``stages[s].ranks[(d * cp + c) * tp + t]`` for s = 0..pp-1.

Context parallelism (``cp``, ``cp_variant``). Each sequence is split over the ``cp`` ranks of a
group (``docs/context-parallel.md``): "all_to_all" (Ulysses: heads and kv heads divisible by
cp x tp), "ring" (torch's ``context_parallel``, CUDA only: the sequence divisible by 2 x cp) or
"all_gather" (Llama 3's: K and V gathered at their kv heads; the sequence divisible by 2 x cp).
Parameters are replicated over cp, so gradients and ZeRO shards span dp x cp ranks.

Expert parallelism (``ep``, mixture-of-experts models: docs/moe.md). Each data-parallel group
is cut into groups of ``ep`` consecutive data-parallel indices (d = r * ep + i): rank i of an ep
group holds experts i*E/ep .. (i+1)*E/ep - 1 of every block, tokens travel to their experts and
back by all-to-all, and each expert's weights, gradients and optimizer state are sharded (ZeRO)
over its dp/ep replicas only. ep divides dp and the experts.

Per-layer choices (``LayerStrategy``):
  * ``tensor_parallel``: 1 (the layer is replicated across the stage's tensor group) or the
    stage's ``tp`` (Megatron-style: attention heads and MLP columns split, vocab split for
    embed/head);
  * ``sequence_parallel``: with tensor parallelism, norms and the residual stream are split
    along the sequence, trading all-reduces for all-gather + reduce-scatter;
  * ``zero``: 0 = replicated weights, gradients all-reduced once per step; 1 = optimizer state
    sharded over dp; 2 = gradients too; 3 = parameters too (FSDP), gathered per micro-batch;
  * ``recompute``: what of a decoder block's activations is recomputed in backward instead of
    kept: ``"none"``; ``"selective"``, everything but the outputs of its matrix products (the
    norms, rotary, attention core, activation functions, residual adds and the tensor-parallel
    collectives are recomputed from them; ``runtime.parallelize.selective_context``);
    ``"full"``, everything (only the block's input is kept). (Schema-1 files' ``true`` and
    ``false`` are read as full and none: ``migrate``.)

Batch shares. By default every data-parallel replica (one whole pipeline) runs
``num_micro_batches`` micro-batches. ``batch_shares`` gives each replica its own count instead,
in dp-index order (``[3, 1]``: replica 0 runs three micro-batches, replica 1 one); replica ``d``
trains on the next ``batch_shares[d] * micro_batch`` rows of the global batch, so
``global_batch = micro_batch * sum(batch_shares)``, and ``num_micro_batches`` is the largest
share (the slowest replica's count, which sets the step). The loss is weighted by each
replica's share, so the averaged gradient is the full batch's mean gradient.

``micro_batch_sizes`` gives each replica its own micro-batch size instead (every replica runs
``num_micro_batches`` of them; ``micro_batch`` is the largest size): replica ``d`` trains on the
next ``num_micro_batches * micro_batch_sizes[d]`` rows, so ``global_batch = num_micro_batches *
sum(micro_batch_sizes)``. Replicas run the same micro-batch count, so every collective over dp
happens as often on each (any ZeRO level works), and 1024 sequences split over 80 replicas as
one micro-batch of 13 or 12 each. In general replica ``d`` trains on ``batch_shares[d] *
micro_batch_sizes[d]`` rows (either list may be empty: the plan's count or size on every
replica).

Replicas on different device types. A stage's replicas may sit on different node groups:
``Stage.replica_groups`` names the group of each replica, in dp-index order (``group`` is then
the first replica's; empty: every replica on ``group``). Every replica runs the same layers with
the same choices (so each layer's gradient is reduced over the same replicas); the replicas on
the faster devices take the larger shares, and the step is the slowest replica's.

FP8 (``fp8: true``): the blocks' linear layers multiply in FP8 (Transformer Engine's or torchao's
layers: ``parallel.FP8_ENGINES``), the rest in ``dtype`` (bf16).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

from partita import specio
from partita.cluster import ClusterSpec, recorded_cluster
from partita.errors import PartitaError
from partita.mesh import Mesh
from partita.model import ModelSpec
from partita.parallel import CP_VARIANTS, ENGINES, SCHEDULES

SCHEMA_VERSION = 2  # 1: degrees at the top level (``migrate`` reads it)
ZERO_LEVELS = (0, 1, 2, 3)
RECOMPUTE = ("none", "selective", "full")  # ``LayerStrategy.recompute``, least recomputed first


def boundary_split(tokens: int, tp: int) -> int:
    """How many ways a pipeline stage boundary splits a micro-batch's hidden states: tp when the
    ``tokens`` a rank holds of each sequence (seq_len / cp) split tp ways evenly (each rank of the
    tensor group sends and receives its sequence shard, sequence parallelism's split), else 1 (every
    rank sends the whole tensor). ``runtime.parallelize``, ``runtime.schedule`` and ``search.costs`` follow it."""
    return tp if tp > 1 and tokens % tp == 0 else 1


def gives_whole(tensor_parallel: int, sequence_parallel: bool) -> bool:
    """Whether a layer takes and gives whole hidden states (not sequence-parallel, or not tensor-parallel
    at all) rather than its sequence shard: ``runtime.parallelize``'s layouts, ``search.costs``' gathers."""
    return not (tensor_parallel > 1 and sequence_parallel)


@dataclass(frozen=True, kw_only=True)
class LayerStrategy:
    name: str
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    recompute: str = "none"  # one of RECOMPUTE

    def __post_init__(self) -> None:
        # A mode, never a bool: the truth of a string would read "none" as recomputing.
        if not isinstance(self.recompute, str) or self.recompute not in RECOMPUTE:
            raise PartitaError(f"layer {self.name}: recompute must be one of {', '.join(RECOMPUTE)}, "
                               f"got {self.recompute!r}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "LayerStrategy":
        data = specio.require_mapping(data, where)
        specio.check_keys(data, cls, where, required=("name",))
        return cls(name=specio.get_str(data, "name", where),
                   tensor_parallel=specio.get_int(data, "tensor_parallel", where, default=1),
                   sequence_parallel=specio.get_bool(data, "sequence_parallel", where, default=False),
                   zero=specio.get_int(data, "zero", where, minimum=0, default=0),
                   recompute=data.get("recompute", "none"))  # a mode's name (checked by the class)


@dataclass(frozen=True, kw_only=True)
class Stage:
    index: int
    group: str  # node group name in the cluster spec
    device: str  # device type, for reading; must match the group's
    ranks: tuple[int, ...]
    layers: tuple[LayerStrategy, ...]
    # Under an interleaved schedule the stage's ranks run v virtual stages: ``chunks`` gives how
    # many of ``layers`` (in order) each holds; empty: one stage, all of them.
    chunks: tuple[int, ...] = ()
    # The node group of each data-parallel replica's ranks, in dp-index order, when they differ
    # (``group`` is the first's); empty: every replica on ``group``.
    replica_groups: tuple[str, ...] = ()

    @property
    def layer_names(self) -> list[str]:
        return [l.name for l in self.layers]

    def replica_group(self, dp_index: int) -> str:
        """The node group replica ``dp_index`` of this stage runs on."""
        return self.replica_groups[dp_index] if self.replica_groups else self.group

    @property
    def groups(self) -> tuple[str, ...]:
        """The node groups the stage's ranks are on, each once, in order of first use."""
        return tuple(dict.fromkeys(self.replica_groups)) if self.replica_groups else (self.group,)

    def chunk_layers(self) -> list[tuple[LayerStrategy, ...]]:
        """The layers of each virtual stage this stage's ranks run, in order."""
        if not self.chunks:
            return [self.layers]
        out, start = [], 0
        for n in self.chunks:
            out.append(self.layers[start:start + n])
            start += n
        return out

    def to_dict(self) -> dict[str, Any]:
        d = {"index": self.index, "group": self.group, "device": self.device,
             "ranks": list(self.ranks), "layers": [l.to_dict() for l in self.layers]}
        if self.chunks:
            d["chunks"] = list(self.chunks)
        if self.replica_groups:
            d["replica_groups"] = list(self.replica_groups)
        return d

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "Stage":
        data = specio.require_mapping(data, where)
        specio.check_keys(data, cls, where, required=("index", "group", "device", "ranks", "layers"))
        ranks = data["ranks"]
        if not isinstance(ranks, list) or not ranks or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
            raise PartitaError(f"{where}: ranks must be a non-empty list of non-negative integers")
        layers = data["layers"]
        if not isinstance(layers, list) or not layers:
            raise PartitaError(f"{where}: layers must be a non-empty list")
        chunks = data.get("chunks") or []
        if not isinstance(chunks, list) or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1
                                                   for c in chunks):
            raise PartitaError(f"{where}: chunks must be a list of positive layer counts, one per virtual stage")
        if chunks and sum(chunks) != len(layers):
            raise PartitaError(f"{where}: chunks {chunks} add up to {sum(chunks)} layers, the stage has {len(layers)}")
        replica_groups = data.get("replica_groups") or []
        if not isinstance(replica_groups, list) or not all(isinstance(g, str) and g for g in replica_groups):
            raise PartitaError(f"{where}: replica_groups must be a list of node group names, one per data-parallel "
                               f"replica")
        return cls(index=specio.get_int(data, "index", where, minimum=0),
                   group=specio.get_str(data, "group", where), device=specio.get_str(data, "device", where),
                   ranks=tuple(ranks),
                   layers=tuple(LayerStrategy.from_dict(l, f"{where}: layers[{i}]") for i, l in enumerate(layers)),
                   chunks=tuple(chunks), replica_groups=tuple(replica_groups))


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """Predicted peak memory of one device of a stage, by what holds it."""

    stage: int
    device: str
    capacity_bytes: int
    weights_bytes: int  # the parameters as stored: fp32, sharded at ZeRO 1-3 (the optimizer's master copy)
    gradients_bytes: int  # fp32: accumulated unsharded over micro-batches at ZeRO 0-1, else sharded
    optimizer_bytes: int  # Adam's m and v, fp32, sharded at ZeRO 1-3
    activations_bytes: int  # micro-batches in flight, recompute, a last stage's retained logits
    transient_bytes: int  # ZeRO-2/3 gathers, gradient-reduce buffers, the loss's backward
    reserve_bytes: int  # CUDA context, allocator fragmentation, workspace
    gathered_weights_bytes: int = 0  # the compute-dtype copies FSDP2 keeps from forward to backward
    pipeline_buffers_bytes: int = 0  # the pipeline schedule's per-micro-batch receive buffers
    peak_at: str = ""  # the moment of the peak: a layer and its phase, e.g. "layers.4 backward"

    CATEGORIES = ("weights", "gathered_weights", "gradients", "optimizer", "activations", "transient",
                  "pipeline_buffers", "reserve")

    def category_bytes(self) -> dict[str, int]:
        """Every category the runtime holds, in bytes."""
        return {c: getattr(self, f"{c}_bytes") for c in self.CATEGORIES}

    @property
    def peak_bytes(self) -> int:
        return sum(self.category_bytes().values())

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if not self.peak_at:
            del d["peak_at"]
        d["peak_bytes"] = self.peak_bytes
        return d

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "StageMemory":
        data = dict(specio.require_mapping(data, where))
        data.pop("peak_bytes", None)
        optional = ("gathered_weights_bytes", "pipeline_buffers_bytes", "peak_at")
        specio.check_keys(data, cls, where, required=[f.name for f in dataclasses.fields(cls) if f.name not in optional])
        return cls(**{f.name: specio.get_str(data, f.name, where) if f.name in ("device", "peak_at")
                      else specio.get_int(data, f.name, where, minimum=0) for f in dataclasses.fields(cls)
                      if f.name in data})


@dataclass(frozen=True, kw_only=True)
class Prediction:
    step_time_s: float
    tokens_per_s: float
    mfu: float  # model FLOPs per second over the summed dense peak of the devices used
    stage_time_s: tuple[float, ...]  # one micro-batch's forward + backward per stage, comms included
    breakdown: Mapping[str, float]  # seconds per step by cause
    memory: tuple[StageMemory, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "stage_time_s": list(self.stage_time_s), "breakdown": dict(self.breakdown),
                "memory": [m.to_dict() for m in self.memory]}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "Prediction":
        data = specio.require_mapping(data, where)
        specio.check_keys(data, cls, where, required=[f.name for f in dataclasses.fields(cls)])
        seconds = lambda d, k: specio.get_float(d, k, where, strict_min=False)  # noqa: E731
        stage_time_s, breakdown, memory = data["stage_time_s"], data["breakdown"], data["memory"]
        if not isinstance(stage_time_s, list) or not isinstance(memory, list):
            raise PartitaError(f"{where}: stage_time_s and memory must be lists")
        breakdown = specio.require_mapping(breakdown, f"{where}: breakdown")
        if not all(isinstance(k, str) for k in breakdown):
            raise PartitaError(f"{where}: breakdown keys must be strings")
        return cls(step_time_s=seconds(data, "step_time_s"), tokens_per_s=seconds(data, "tokens_per_s"),
                   mfu=seconds(data, "mfu"),
                   stage_time_s=tuple(seconds({"stage_time_s": x}, "stage_time_s") for x in stage_time_s),
                   breakdown={k: seconds(breakdown, k) for k in breakdown},
                   memory=tuple(StageMemory.from_dict(m, f"{where}: memory[{i}]") for i, m in enumerate(memory)))


@dataclass(frozen=True, kw_only=True)
class ContextOption:
    """The best plan the search found at one context-parallel degree (``SolverReport.context_parallel``),
    so a summary can say why the plan's cp was chosen."""

    cp: int
    variant: str  # one of CP_VARIANTS
    fits: bool  # False: no plan at this degree fits (or none was found in time)
    objective_us: int = 0  # its step time, integer microseconds (0 when nothing fits)
    tp: int = 0
    activations_bytes: int = 0  # its fullest device's activations
    peak_bytes: int = 0  # its fullest device's peak
    capacity_bytes: int = 0
    recomputed_blocks: int = 0  # blocks that recompute (fully or selectively)
    status: str = ""  # its search's status ("optimal", "feasible", "infeasible", "timeout")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "ContextOption":
        data = specio.require_mapping(data, where)
        specio.check_keys(data, cls, where, required=("cp", "variant", "fits"))
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class SolverReport:
    method: str  # "uniform" or "cpsat"
    status: str  # "optimal", "feasible" (time ran out), or "exhaustive" for the uniform grid
    objective_us: int  # the step time the search minimised, integer microseconds
    bound_us: int  # proven lower bound on the objective over the search space
    gap: float  # (objective - bound) / objective
    wall_s: float
    workers: int = 1
    seed: int = 0
    ortools_version: str = ""
    uniform_objective_us: int = 0  # the best uniform plan's step time, for comparison
    candidates: int = 0  # plans the uniform grid evaluated
    # The best plan at each context-parallel degree searched (``planner.make_plan``); empty when
    # only cp 1 was (the field is then left out of the file).
    context_parallel: tuple[ContextOption, ...] = ()
    # What an "optimal" proves, when less than every plan the search tried: "1f1b" when CP-SAT's
    # proof covers 1F1B pipelines and the other schedules, priced after it, could not be ruled
    # out (their bound is below the plan). Empty: the whole space (left out of the file).
    proven_among: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.context_parallel:
            d["context_parallel"] = [o.to_dict() for o in self.context_parallel]
        else:
            del d["context_parallel"]
        if not self.proven_among:
            del d["proven_among"]
        return d

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "SolverReport":
        data = dict(specio.require_mapping(data, where))
        specio.check_keys(data, cls, where, required=("method", "status", "objective_us", "bound_us", "gap", "wall_s"))
        options = data.get("context_parallel") or []
        if not isinstance(options, list):
            raise PartitaError(f"{where}: context_parallel must be a list")
        data["context_parallel"] = tuple(ContextOption.from_dict(o, f"{where}: context_parallel[{i}]")
                                         for i, o in enumerate(options))
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class Plan:
    schema_version: int = SCHEMA_VERSION
    model: Mapping[str, Any]  # the full model spec, so a plan is self-contained
    model_fingerprint: str
    cluster: Mapping[str, Any]  # the full cluster spec
    cluster_fingerprint: str
    profile_fingerprint: str
    cost_sources: Mapping[str, str]  # device type -> "measured" | "analytic" | "mixed"
    dtype: str  # bf16 on GPUs, fp32 on CPU
    seq_len: int
    global_batch: int  # sequences per optimizer step = dp * micro_batch * num_micro_batches (or the shares' sum)
    micro_batch: int
    num_micro_batches: int  # per replica; with batch_shares, the largest share
    batch_shares: tuple[int, ...] = ()  # micro-batches per dp replica; empty: num_micro_batches each
    micro_batch_sizes: tuple[int, ...] = ()  # micro-batch size per dp replica; empty: micro_batch each
    mesh: Mesh  # the degrees pp, dp, cp, tp, ep and how they nest (partita/mesh.py)
    cp_variant: str = "all_to_all"  # one of CP_VARIANTS; meaningful when mesh.cp > 1
    # A mixture of experts' routing the plan is priced at: the busiest expert-parallel rank's
    # tokens over the balanced share (docs/moe.md; ``partita plan --moe-imbalance``).
    moe_imbalance: float = 1.0
    schedule: str = "1f1b"
    engine: str = "partita"  # the engine the plan is priced for (search/engines.py)
    fp8: bool = False  # the blocks' linear products in FP8 (the engine's matmul, search/engines.py)
    stages: tuple[Stage, ...]
    prediction: Prediction | None = None
    solver: SolverReport | None = None

    # The degrees, read from the mesh (the one thing that multiplies or spells them).
    dp = property(lambda self: self.mesh.dp)
    tp = property(lambda self: self.mesh.tp)
    pp = property(lambda self: self.mesh.pp)
    cp = property(lambda self: self.mesh.cp)
    ep = property(lambda self: self.mesh.ep)

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @cached_property
    def model_spec(self) -> ModelSpec:
        """The model the plan records, as a spec (the file keeps it whole: a plan is self-contained)."""
        return ModelSpec.from_dict(self.model, where="plan: model")

    @cached_property
    def cluster_spec(self) -> ClusterSpec:
        """The cluster the plan records, as a spec with the fingerprint it was planned for."""
        return recorded_cluster(self.cluster)

    def with_mesh(self, **degrees: int) -> "Plan":
        """The same plan with some degrees changed (``with_mesh(dp=80)``)."""
        return dataclasses.replace(self, mesh=dataclasses.replace(self.mesh, **degrees))

    @property
    def ranks(self) -> list[int]:
        return [r for s in self.stages for r in s.ranks]

    def stage_of_rank(self, rank: int) -> Stage:
        for s in self.stages:
            if rank in s.ranks:
                return s
        raise PartitaError(f"rank {rank} is in no stage of this plan")

    def with_ranks_from_zero(self) -> "Plan":
        """The same plan with its ranks renumbered 0..world-1 in order: what torchrun calls
        them when only the plan's ranks are started (a plan may leave some of a cluster idle)."""
        new = {r: i for i, r in enumerate(sorted(self.ranks))}
        stages = tuple(dataclasses.replace(s, ranks=tuple(new[r] for r in s.ranks)) for s in self.stages)
        return dataclasses.replace(self, stages=stages)

    def replica_micro_batches(self) -> tuple[int, ...]:
        """How many micro-batches each data-parallel replica runs, in dp-index order."""
        return self.batch_shares or (self.num_micro_batches,) * self.dp

    def replica_micro_batch_sizes(self) -> tuple[int, ...]:
        """Each data-parallel replica's micro-batch size, in dp-index order."""
        return self.micro_batch_sizes or (self.micro_batch,) * self.dp

    def replica_batch_rows(self) -> tuple[int, ...]:
        """How many rows (sequences) of the global batch each replica trains on."""
        return tuple(n * b for n, b in zip(self.replica_micro_batches(), self.replica_micro_batch_sizes()))

    def replica_path(self, dp_index: int) -> tuple[str, ...]:
        """The node group of each stage of replica ``dp_index``, in pipeline order."""
        return tuple(s.replica_group(dp_index) for s in self.stages)

    def replica_kinds(self) -> dict[tuple[tuple[str, ...], int, int], list[int]]:
        """The replicas by kind: (node group of each stage, micro-batch size, micro-batch count)
        -> dp indices, in order of first appearance. Replicas of one kind run alike."""
        counts, sizes = self.replica_micro_batches(), self.replica_micro_batch_sizes()
        kinds: dict[tuple[tuple[str, ...], int, int], list[int]] = {}
        for d in range(self.dp):
            kinds.setdefault((self.replica_path(d), sizes[d], counts[d]), []).append(d)
        return kinds

    def rank_groups(self) -> list[tuple[int, str]]:
        """Every rank of the plan with the node group it is on, stage by stage."""
        width = self.cp * self.tp
        return [(s.ranks[d * width + i], s.replica_group(d)) for s in self.stages for d in range(self.dp)
                for i in range(width)]

    @property
    def mixed_replicas(self) -> bool:
        """Do some stages' replicas sit on different node groups?"""
        return any(s.replica_groups for s in self.stages)

    def replica_rows(self, dp_index: int) -> slice:
        """The rows of the global batch that replica ``dp_index`` trains on: its share, after
        the shares of the replicas before it."""
        rows = self.replica_batch_rows()
        start = sum(rows[:dp_index])
        return slice(start, start + rows[dp_index])

    def layer_strategies(self) -> list[LayerStrategy]:
        """Every layer, in the model's order (with virtual stages, virtual stage by virtual
        stage in pipeline order: ``virtual_stage_index``)."""
        return [l for chunk in self.virtual_stage_layers() for l in chunk]

    @property
    def virtual_stages(self) -> int:
        """Stages per rank: 1, or v under an interleaved schedule."""
        return max(1, len(self.stages[0].chunks)) if self.stages else 1

    def virtual_stage_index(self, stage: int, chunk: int) -> int:
        """Torch's stage number of chunk ``chunk`` of plan stage ``stage``: c * pp + i under
        1F1B and the interleaved schedules (a loop), and under zbv (two chunks, a V) i for
        chunk 0 and 2 pp - 1 - i for chunk 1, so the last stage's ranks hold the middle two
        and the first stage's the pipeline's two ends."""
        if self.schedule == "zbv" and chunk == 1:
            return 2 * self.pp - 1 - stage
        return chunk * self.pp + stage

    @property
    def boundary_split(self) -> int:
        """How many ways a stage boundary splits a micro-batch's hidden states (``boundary_split``)."""
        return boundary_split(self.seq_len // self.cp, self.tp)

    def virtual_stage_layers(self) -> list[tuple[LayerStrategy, ...]]:
        """The layers of every virtual stage in pipeline order (``virtual_stage_index``)."""
        placed = {self.virtual_stage_index(s.index, c): chunk
                  for s in self.stages for c, chunk in enumerate(s.chunk_layers())}
        return [placed[k] for k in sorted(placed)]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "stages":
                v = [s.to_dict() for s in v]
            elif f.name in ("prediction", "solver"):
                v = v.to_dict() if v is not None else None
            elif f.name == "mesh":
                v = v.to_dict()
            elif f.name in ("batch_shares", "micro_batch_sizes"):
                if not v:
                    continue  # equal shares: the field is left out
                v = list(v)
            elif f.name == "cp_variant" and self.cp == 1:
                continue  # meaningful under context parallelism only
            elif (f.name, v) in (("moe_imbalance", 1.0), ("engine", "partita"), ("fp8", False)):
                continue  # balanced routing (and every dense model); Partita's own runtime; bf16 products
            elif isinstance(v, Mapping):
                v = dict(v)
            d[f.name] = v
        return d

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan") -> "Plan":
        data = migrate(specio.require_mapping(data, where), where)
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        specio.check_keys(data, cls, where, required=required)
        stages = data["stages"]
        if not isinstance(stages, list) or not stages:
            raise PartitaError(f"{where}: stages must be a non-empty list")
        kwargs: dict[str, Any] = dict(data)
        kwargs["stages"] = tuple(Stage.from_dict(s, f"{where}: stages[{i}]") for i, s in enumerate(stages))
        kwargs["mesh"] = Mesh.from_dict(data["mesh"], f"{where}: mesh")
        for key in ("seq_len", "global_batch", "micro_batch", "num_micro_batches"):
            kwargs[key] = specio.get_int(data, key, where)
        for key in ("model", "cluster", "cost_sources"):
            kwargs[key] = dict(specio.require_mapping(data[key], f"{where}: {key}"))
        kwargs["dtype"] = specio.get_str(data, "dtype", where, choices=("bf16", "fp16", "fp32"))
        kwargs["schedule"] = specio.get_str(data, "schedule", where, default="1f1b", choices=SCHEDULES)
        kwargs["cp_variant"] = specio.get_str(data, "cp_variant", where, default="all_to_all", choices=CP_VARIANTS)
        kwargs["engine"] = specio.get_str(data, "engine", where, default="partita", choices=ENGINES)
        kwargs["fp8"] = specio.get_bool(data, "fp8", where, default=False)
        kwargs["moe_imbalance"] = specio.get_float(data, "moe_imbalance", where, default=1.0)
        if kwargs["moe_imbalance"] < 1.0:
            raise PartitaError(f"{where}: moe_imbalance is the busiest rank's tokens over the balanced share: >= 1, "
                               f"got {kwargs['moe_imbalance']:g}")
        kwargs["batch_shares"] = _batch_shares(data.get("batch_shares"), where)
        kwargs["micro_batch_sizes"] = _batch_shares(data.get("micro_batch_sizes"), where, "micro_batch_sizes", "micro-batch sizes")
        if data.get("prediction") is not None:
            kwargs["prediction"] = Prediction.from_dict(data["prediction"], f"{where}: prediction")
        if data.get("solver") is not None:
            kwargs["solver"] = SolverReport.from_dict(data["solver"], f"{where}: solver")
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise PartitaError(f"{where}: {e}") from None

    def save(self, path: str | Path) -> None:
        specio.save_yaml(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_dict(specio.load_yaml(path), where=str(path))


def migrate(data: Mapping[str, Any], where: str = "plan") -> dict[str, Any]:
    """A plan file's fields as this schema reads them. Schema 1 (plans written before the mesh)
    gave the degrees at the top level (``dp``, ``tp``, ``pp``, and ``cp``, ``ep`` when above 1)
    and a block's recompute as ``true`` (full) or ``false`` (none); schema 2 nests the degrees
    in ``mesh`` and names every recompute mode."""
    data = dict(data)
    version = data.get("schema_version", SCHEMA_VERSION)
    if version == SCHEMA_VERSION:
        return data
    if version != 1:
        raise PartitaError(f"{where}: schema_version {version!r} is not supported; this Partita reads 1 and {SCHEMA_VERSION}")
    valid = [f.name for f in dataclasses.fields(Plan) if f.name != "mesh"] + ["dp", "tp", "pp", "cp", "ep"]
    for key in data:
        if key not in valid:
            raise PartitaError(f"{where}: unknown key {key!r} in a schema-1 plan; valid keys: {', '.join(valid)}")
    for key in ("dp", "tp", "pp"):
        if key not in data:
            raise PartitaError(f"{where}: missing key {key!r}")
    data["mesh"] = {key: data.pop(key) for key in ("pp", "dp", "cp", "tp", "ep") if key in data}
    stages = data.get("stages")
    if isinstance(stages, list):
        data["stages"] = [_migrate_stage(s) for s in stages]
    data["schema_version"] = SCHEMA_VERSION
    return data


def _migrate_stage(stage: Any) -> Any:
    """A schema-1 stage: its layers' ``recompute: true/false`` as "full"/"none"."""
    if not isinstance(stage, Mapping) or not isinstance(stage.get("layers"), list):
        return stage
    layers = [dict(l, recompute="full" if l["recompute"] else "none")
              if isinstance(l, Mapping) and isinstance(l.get("recompute"), bool) else l for l in stage["layers"]]
    return dict(stage, layers=layers)


def _batch_shares(value: Any, where: str, key: str = "batch_shares", what: str = "micro-batch counts") -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not value or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                                           for n in value):
        raise PartitaError(f"{where}: {key} must be a non-empty list of {what} >= 1, one per replica; got {value!r}")
    return tuple(value)
