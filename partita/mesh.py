"""The parallel layout as a type: a plan's named degrees and how they nest on its ranks.

A ``Mesh`` is the one place that multiplies degrees or spells them. Its axes, outermost first,
are ``pp`` (pipeline stages), ``dp`` (data-parallel replicas), ``cp`` (context parallelism:
each sequence split over cp ranks) and ``tp`` (tensor parallelism, innermost). Expert
parallelism (``ep``) does not add ranks: it cuts the dp axis into groups of ep consecutive
replicas (``d = r * ep + i``), so it divides dp.

Within a stage the rank at data-parallel index ``d``, context-parallel index ``c`` and
tensor-parallel index ``t`` is ``stage.ranks[(d * cp + c) * tp + t]`` (Llama 3's order: a cp
group spans ``cp * tp`` consecutive ranks, a tp group ``tp``).

    >>> Mesh(pp=2, dp=4, tp=8).describe()
    'dp 4 x tp 8 x pp 2 = 64 ranks'
    >>> Mesh(pp=1, dp=2, cp=4, tp=2, ep=2).describe()
    'dp 2 (ep 2) x cp 4 x tp 2 x pp 1 = 16 ranks'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from partita import specio
from partita.errors import PartitaError

AXES = ("pp", "dp", "cp", "tp")  # the axes that multiply to the world size, outermost first


@dataclass(frozen=True, kw_only=True)
class Mesh:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # groups of ep consecutive dp replicas share their experts (module docstring)

    def __post_init__(self) -> None:
        for name in AXES + ("ep",):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PartitaError(f"mesh: {name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage: dp x cp x tp."""
        return self.dp * self.cp * self.tp

    @property
    def shard_group(self) -> int:
        """The ranks a dense parameter is replicated over (and ZeRO shards it across): dp x cp."""
        return self.dp * self.cp

    def describe(self) -> str:
        """The degrees as a person reads them, every factor named (cp and ep only when above 1):
        ``dp 2 x cp 4 x tp 2 x pp 2 = 32 ranks``."""
        return f"{self.factors()} = {self.world_size} ranks"

    def factors(self) -> str:
        """``dp 2 x cp 4 x tp 2 x pp 2``: the factors of ``describe`` without the product."""
        dp = f"dp {self.dp}" + (f" (ep {self.ep})" if self.ep > 1 else "")
        parts = [dp] + ([f"cp {self.cp}"] if self.cp > 1 else []) + [f"tp {self.tp}", f"pp {self.pp}"]
        return " x ".join(parts)

    def stage_factors(self) -> str:
        """One stage's factors with their product: ``dp 2 x cp 4 x tp 2 = 16``."""
        parts = [f"dp {self.dp}"] + ([f"cp {self.cp}"] if self.cp > 1 else []) + [f"tp {self.tp}"]
        return f"{' x '.join(parts)} = {self.stage_size}"

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Any, where: str = "mesh") -> "Mesh":
        data = specio.require_mapping(data, where)
        specio.check_keys(data, cls, where, required=("pp", "dp", "tp"))
        return cls(**{k: specio.get_int(data, k, where, minimum=1, default=1) for k in data})
