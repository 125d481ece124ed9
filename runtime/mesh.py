"""Where this rank sits in the plan, and the one device mesh every parallelism is cut from.

The world mesh has four named dimensions, ``("pp", "dp", "dp_shard", "tp")``, built from the
plan's stages (``stages[s].ranks[d * tp + t]`` sits at ``[s, d, 0, t]``), so on a mixed cluster
each stage lands on the ranks of the device group the plan gives it. ``dp_shard`` always has
size 1: ZeRO-0 layers use FSDP2's hybrid mode over ``("dp", "dp_shard")``, i.e. weights
replicated over ``dp`` and gradients all-reduced, while ZeRO-1/2/3 layers shard over ``dp``.
Every sub-mesh is a slice of this one mesh (FSDP2 over tensor parallelism requires that).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from partita.plan import Plan, Stage

MESH_DIMS = ("pp", "dp", "dp_shard", "tp")


@dataclass(frozen=True)
class RankPlace:
    """This rank's coordinates in the plan."""

    rank: int
    stage: Stage
    dp_index: int
    tp_index: int

    @classmethod
    def of(cls, plan: Plan, rank: int) -> "RankPlace":
        stage = plan.stage_of_rank(rank)
        position = stage.ranks.index(rank)
        return cls(rank=rank, stage=stage, dp_index=position // plan.tp, tp_index=position % plan.tp)

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
        return self.world["dp"]

    @property
    def dp_replicate(self) -> DeviceMesh:
        """("dp", "dp_shard"): FSDP2's hybrid mode with one-rank shards, i.e. plain replication."""
        return self.world["dp", "dp_shard"]

    @property
    def tp(self) -> DeviceMesh:
        return self.world["tp"]


def rank_grid(plan: Plan) -> torch.Tensor:
    """Global ranks laid out as [pp, dp, 1, tp], from the plan's stage rank lists."""
    grid = torch.tensor([list(s.ranks) for s in sorted(plan.stages, key=lambda s: s.index)], dtype=torch.int64)
    return grid.view(plan.pp, plan.dp, 1, plan.tp)


def build_meshes(plan: Plan, device_type: str) -> Meshes:
    """Build the world mesh for an initialised default process group."""
    world = DeviceMesh(device_type, rank_grid(plan), mesh_dim_names=MESH_DIMS)
    return Meshes(world=world, place=RankPlace.of(plan, dist.get_rank()))
