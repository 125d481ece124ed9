"""Which measured profiles a plan can use (``usable_profiles``), for ``plan``, ``check`` and
``export`` alike: one the cost model cannot use is named with the reason."""

from __future__ import annotations

from typing import Sequence

from partita.cli.output import warn
from partita.cluster import ClusterSpec
from partita.errors import PartitaError
from partita.model import ModelSpec
from partita.profile import Profile


def usable_profiles(paths: Sequence[str], model: ModelSpec, cluster: ClusterSpec, *, seq_len: int,
                    dtype: str) -> tuple[Profile, ...]:
    """The profiles the cost model can use for this model, sequence length and dtype. One that
    it cannot use is named with the reason (and left out); none usable at all is bad input."""
    profiles = tuple(Profile.load(p) for p in paths)
    kept, refused = [], []
    for path, prof in zip(paths, profiles):
        if prof.device not in cluster.device_types:
            raise PartitaError(f"--profile {path}: measured on {prof.device}, but the cluster has "
                               f"{', '.join(cluster.device_types)}; drop it or change the cluster")
        why_not = layer_costs_unusable(prof, model, seq_len=seq_len, dtype=dtype)
        if prof.calibration is not None and prof.dtype != dtype:
            refused.append(f"{path} (calibrated on {prof.dtype} runs, the plan trains in {dtype})")
            continue
        if why_not is not None and not prof.comm and prof.calibration is None:
            refused.append(f"{path} ({why_not})")
            continue
        if any(k.device == prof.device for _, k in kept):
            raise PartitaError(f"--profile {path}: a second profile for {prof.device}; give one per device type")
        if why_not is not None and (prof.layers or prof.calibration is None):
            warn(f"profile {path}: its layer costs are not used ({why_not}); its collective fits"
                 f"{' and calibration are' if prof.calibration else ' are'}")
        kept.append((path, prof))
    if refused and not kept:
        raise PartitaError(f"no profile given can be used: {'; '.join(refused)}; re-measure with `partita profile` "
                           f"or drop --profile for analytic costs")
    for text in refused:
        warn(f"profile {text} is not used; analytic costs stand in for it")
    return tuple(p for _, p in kept)


def layer_costs_unusable(prof: Profile, model: ModelSpec, *, seq_len: int, dtype: str) -> str | None:
    """Why the profile's layer costs cannot price this model, or None if some can."""
    if not prof.layers:
        return "it holds no layer costs"
    if prof.dtype != dtype:
        return f"measured in {prof.dtype}, the plan trains in {dtype}; --dtype {prof.dtype} would use it"
    kinds = set(model.kinds.values())
    same_model = [l for l in prof.layers if l.kind in kinds]
    if not same_model:
        other = prof.layers[0].kind
        return (f"measured on other layer shapes (hidden {other.hidden}, ffn {other.ffn}, vocab {other.vocab}), "
                f"not {model.name}'s (hidden {model.hidden}, ffn {model.ffn}, vocab {model.vocab})")
    if not any(l.seq_len == seq_len for l in same_model):
        lens = sorted({l.seq_len for l in same_model})
        return (f"measured at sequence length {', '.join(map(str, lens))}, the plan uses {seq_len}; "
                f"--seq-len {lens[-1]} would use it")
    return None
