"""Where this rank sits in the plan, and the one device mesh every parallelism is cut from.

The world mesh has five named dimensions, ``("pp", "dp", "dp_shard", "cp", "tp")``, built from
the plan's stages (``stages[s].ranks[(d * cp + c) * tp + t]`` sits at ``[s, d, 0, c, t]``), so
on a mixed cluster each stage lands on the ranks of the device group the plan gives it.
``dp_shard`` always has size 1: ZeRO-0 layers use FSDP2's hybrid mode over ``("dp", "dp_shard")``,
i.e. weights replicated over ``dp`` and gradients all-reduced, while ZeRO-1/2/3 layers shard
over ``dp``. Under context parallelism (cp > 1) the parameters are replicated over cp as well
and each cp rank's gradient covers its tokens only, so the data-parallel meshes are ``dp`` and
``cp`` flattened (``"dp_cp"``, torchtitan's ``dp_shard_cp``): gradients are averaged and ZeRO
shards span dp x cp ranks. Under expert parallelism (ep > 1) ``dp`` is itself the flattening of
``("dp_rep", "ep")``: ``ep`` consecutive data-parallel indices form an ep group (the experts'
all-to-alls) and ``dp_rep`` strides over the groups (each expert's replicas: its gradients are
reduced and its ZeRO shards split there only). Every sub-mesh is a slice of this one mesh (FSDP2
over tensor parallelism requires that).

A mixture-of-experts block under tensor or context parallelism runs its MoE on this rank's
sequence shard with whole (unsplit) experts, so the cp x tp ranks of a sequence are data
replicas of the MoE's weights (docs/moe.md): they are sharded and reduced over ``moe_dp``, the
data-parallel dims and ``cp`` and ``tp`` flattened, and an ep rank's experts over ``expert_dp``,
(``dp_rep``, ``cp``, ``tp``) flattened; the balancing loss's per-sequence statistics are summed
over ``seq`` (``cp`` x ``tp``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from partita.plan import Plan, Stage

MESH_DIMS = ("pp", "dp", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class RankPlace:
    """This rank's coordinates in the plan."""

    rank: int
    stage: Stage
    dp_index: int
    tp_index: int
    cp_index: int = 0

    @classmethod
    def of(cls, plan: Plan, rank: int) -> "RankPlace":
        stage = plan.stage_of_rank(rank)
        position = stage.ranks.index(rank)
        return cls(rank=rank, stage=stage, dp_index=position // (plan.cp * plan.tp), tp_index=position % plan.tp,
                   cp_index=position // plan.tp % plan.cp)

    @property
    def is_first_stage(self) -> bool:
        return self.stage.index == 0


@dataclass(frozen=True)
class Meshes:
    """The world mesh and the slices this rank uses (passed explicitly; no globals)."""

    world: DeviceMesh
    place: RankPlace

    @property
    def pp(self) -> DeviceMesh:
        return self.world["pp"]

    @property
    def dp(self) -> DeviceMesh:
        """The mesh gradients are reduced and ZeRO shards over: ``dp``, or under context
        parallelism ``dp`` x ``cp`` flattened (``build_meshes``)."""
        return self.world["dp_cp"] if self.context_parallel else self.world["dp"]

    @property
    def dp_replicate(self) -> DeviceMesh:
        """("dp", "dp_shard"): FSDP2's hybrid mode with one-rank shards, i.e. plain replication
        (over ``dp_cp`` under context parallelism)."""
        return self.world["dp_cp" if self.context_parallel else "dp", "dp_shard"]

    @property
    def tp(self) -> DeviceMesh:
        return self.world["tp"]

    @property
    def cp(self) -> DeviceMesh:
        return self.world["cp"]

    @property
    def context_parallel(self) -> bool:
        return self.world["cp"].size() > 1

    @property
    def expert_parallel(self) -> bool:
        return "ep" in (self.world.mesh_dim_names or ())

    @property
    def ep(self) -> DeviceMesh:
        """The ep group: the ranks whose tokens meet in the experts' all-to-alls."""
        return self.world["ep"]

    @property
    def sequence_split(self) -> bool:
        """Whether a rank holds part of each sequence's tokens in a MoE (cp x tp > 1)."""
        return self.world["cp"].size() * self.world["tp"].size() > 1

    @property
    def expert_dp(self) -> DeviceMesh:
        """The replicas of this rank's experts (``dp_rep``, x cp x tp when the sequence is split):
        their ZeRO shards and gradient reductions."""
        return self.world["expert_dp" if self.sequence_split else "dp_rep"]

    @property
    def expert_dp_replicate(self) -> DeviceMesh:
        """(``expert_dp``, ``dp_shard``): FSDP2's hybrid mode for ZeRO-0 experts (plain replication)."""
        return self.world["expert_dp" if self.sequence_split else "dp_rep", "dp_shard"]

    @property
    def moe_dp(self) -> DeviceMesh:
        """The replicas of a MoE's weights when the sequence is split (``moe_dp``: dp x cp x tp)."""
        return self.world["moe_dp"]

    @property
    def moe_dp_replicate(self) -> DeviceMesh:
        return self.world["moe_dp", "dp_shard"]

    @property
    def seq(self) -> DeviceMesh:
        """The cp x tp ranks that hold one sequence's tokens between them (``seq``)."""
        return self.world["seq"]


def rank_grid(plan: Plan) -> torch.Tensor:
    """Global ranks laid out as [pp, dp, 1, cp, tp], from the plan's stage rank lists."""
    grid = torch.tensor([list(s.ranks) for s in sorted(plan.stages, key=lambda s: s.index)], dtype=torch.int64)
    return grid.view(plan.pp, plan.dp, 1, plan.cp, plan.tp)


def build_meshes(plan: Plan, device_type: str) -> Meshes:
    """Build the world mesh for an initialised default process group (and its flattened
    dimensions: ``dp_cp`` under context parallelism; a mixture of experts' ``moe_dp``,
    ``expert_dp`` and ``seq`` when the sequence is split, module docstring)."""
    if plan.ep > 1:  # dp = (dp_rep, ep), ep innermost: an ep group is ep consecutive dp indices
        grid = rank_grid(plan).view(plan.pp, plan.dp // plan.ep, plan.ep, 1, plan.cp, plan.tp)
        world = DeviceMesh(device_type, grid, mesh_dim_names=("pp", "dp_rep", "ep", "dp_shard", "cp", "tp"))
        world["dp_rep", "ep"]._flatten("dp")
        data_dims = ("dp_rep", "ep")
    else:
        world = DeviceMesh(device_type, rank_grid(plan), mesh_dim_names=MESH_DIMS)
        data_dims = ("dp",)
    if plan.cp > 1:
        world[(*data_dims, "cp")]._flatten("dp_cp")
    if plan.model_spec.is_moe and plan.cp * plan.tp > 1:
        world[(*data_dims, "cp", "tp")]._flatten("moe_dp")
        world["cp", "tp"]._flatten("seq")
        if plan.ep > 1:
            world["dp_rep", "cp", "tp"]._flatten("expert_dp")
    return Meshes(world=world, place=RankPlace.of(plan, dist.get_rank()))
