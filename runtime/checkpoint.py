"""Checkpoints with ``torch.distributed.checkpoint``: every rank writes its shards of the model
and optimizer state (FSDP2 and tensor-parallel DTensors included; pipeline stages write
disjoint module names) into ``DIR/step-000012/``. ``.metadata`` is written last, so a
directory without it is an interrupted save and is skipped on resume.

The learning rate is a function of the step and batches are a function of (seed, step), so
the step number is the only training state besides the tensors.

Beside the shards, rank 0 writes ``partita.json`` (``CheckpointRecord``): the model's
fingerprint, the step, and the run's schedule and data. ``check_resume`` reads it before any rank
starts: another model's checkpoint is refused in one line (loading it would fail on every tensor's
shape), and a resume that changes the schedule or data says what changes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from partita import fileio
from partita.errors import PartitaError

log = logging.getLogger(__name__)
PREFIX = "step-"
RECORD = "partita.json"
# Flat optimizer keys ("state.layers.0.attention.wq.weight.exp_avg", "param_groups.<fqn>.lr"):
# the form torch.distributed.checkpoint reshards and restores whole, hyperparameters included.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:06d}"


def latest_step(root: str | Path) -> int | None:
    """The last completed checkpoint's step (the number of steps it holds), or None."""
    steps = [int(p.name[len(PREFIX):]) for p in Path(root).glob(f"{PREFIX}*")
             if p.name[len(PREFIX):].isdigit() and (p / ".metadata").is_file()]
    return max(steps) if steps else None


@dataclass(frozen=True, kw_only=True)
class CheckpointRecord:
    """What a checkpoint says about the run that wrote it (``partita.json`` beside the shards)."""

    schema_version: int = 1
    step: int  # steps the checkpoint holds
    model_name: str
    model_fingerprint: str
    steps: int  # the run's total steps: the cosine schedule's length
    lr: float
    warmup_steps: int
    min_lr_ratio: float
    data: str  # "synthetic" or the text file's path
    seed: int
    global_batch: int
    seq_len: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str) -> "CheckpointRecord":
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or names - {"schema_version"} - set(data) or set(data) - names:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise PartitaError(f"{where}: not a checkpoint record (has {keys}, expected {sorted(names)}); resume "
                               f"from another directory")
        return cls(**data)


def write_record(root: str | Path, record: CheckpointRecord) -> None:
    path = step_dir(root, record.step) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    fileio.write_text(path, json.dumps(record.to_dict(), indent=1, sort_keys=True) + "\n")


def read_record(root: str | Path, step: int) -> CheckpointRecord | None:
    """The record of the checkpoint at ``step``; None for a checkpoint saved without one."""
    path = step_dir(root, step) / RECORD
    if not path.is_file():
        return None
    try:
        data = fileio.load_json(path)
    except PartitaError as e:
        raise PartitaError(f"cannot read the checkpoint record: {e}; resume from another directory") from None
    return CheckpointRecord.from_dict(data, where=str(path))


# The settings a resumed run may change, with what a change means.
_SCHEDULE = (("steps", "--steps"), ("lr", "--lr"), ("warmup_steps", "--warmup-steps"), ("min_lr_ratio", "min_lr_ratio"))
_BATCHES = (("data", "--data"), ("seed", "--seed"), ("global_batch", "global_batch"), ("seq_len", "seq_len"))


# torch.distributed.checkpoint writes every item of a shard file with torch.save, a zip archive.
_ITEM_MAGIC = b"PK\x03\x04"


def damage(root: str | Path, step: int) -> str | None:
    """Why the checkpoint of ``step`` cannot be loaded, as far as its files tell without loading
    it (None: intact): its ``.metadata`` does not read, or an item it lists lies past the end of
    its shard file, or does not start as torch.save writes it (a truncated or overwritten shard)."""
    where = step_dir(root, step)
    try:
        metadata = dcp.FileSystemReader(str(where)).read_metadata()
        items = list(metadata.storage_data.values())
    except Exception as e:  # truncated or foreign bytes: pickle and torch raise many kinds
        return f"{where.name}/.metadata does not read ({type(e).__name__})"
    for name in sorted({i.relative_path for i in items}):
        path = where / name
        try:
            with open(path, "rb") as f:
                size = f.seek(0, 2)
                for item in (i for i in items if i.relative_path == name):
                    if item.offset + item.length > size:
                        return f"{where.name}/{name} is truncated ({size:,} bytes, its items need {item.offset + item.length:,})"
                    f.seek(item.offset)
                    if f.read(len(_ITEM_MAGIC)) != _ITEM_MAGIC:
                        return f"{where.name}/{name} is damaged (an item at byte {item.offset:,} is not torch.save's)"
        except OSError as e:
            return f"{where.name}/{name} does not read ({e.strerror or e})"
    return None


def intact_step(root: str | Path) -> tuple[int | None, list[str]]:
    """The newest checkpoint that is intact (``damage``), and one warning line for each newer
    one that is not, naming it."""
    warnings = []
    steps = sorted((int(p.name[len(PREFIX):]) for p in Path(root).glob(f"{PREFIX}*")
                    if p.name[len(PREFIX):].isdigit() and (p / ".metadata").is_file()), reverse=True)
    for step in steps:
        why = damage(root, step)
        if why is None:
            if warnings:
                warnings[-1] += f"; resuming from {step_dir(root, step).name}"
            return step, warnings
        warnings.append(f"--resume: checkpoint {step_dir(root, step).name} is damaged: {why}")
    if warnings:
        raise PartitaError(f"{warnings[-1]}; no intact checkpoint in {root}, give another --checkpoint-dir or drop "
                           f"--resume")
    return None, []


def check_resume(root: str | Path, want: CheckpointRecord) -> tuple[int | None, list[str]]:
    """The step a resume continues from (None: no checkpoint yet): the newest intact checkpoint,
    with a warning line naming each damaged newer one; and what the resumed run changes, as
    warning lines. Refuses another model's checkpoint, and ``want.steps`` at or below the
    checkpoint's step (nothing would be trained)."""
    step, damaged = intact_step(root)
    if step is None:
        return None, []
    where = step_dir(root, step)
    have = read_record(root, step)
    if have is None:
        return step, damaged + [f"{where} holds no {RECORD} (saved by an older partita): the model and schedule it "
                                f"was saved with cannot be checked"]
    if have.model_fingerprint != want.model_fingerprint:
        raise PartitaError(f"--resume: {where} holds model {have.model_name!r} (fingerprint "
                           f"{have.model_fingerprint}), the plan trains {want.model_name!r} "
                           f"({want.model_fingerprint}); give another --checkpoint-dir, or a plan for "
                           f"{have.model_name!r}")
    if want.steps <= step:
        raise PartitaError(f"--resume: {where} has already trained {step} steps and --steps is {want.steps}; give "
                           f"--steps above {step} to train more")
    warnings = damaged
    schedule = [f"{flag} {getattr(have, name)!r} -> {getattr(want, name)!r}" for name, flag in _SCHEDULE
                if getattr(have, name) != getattr(want, name)]
    if schedule:
        warnings.append(f"resuming {where} with {', '.join(schedule)}: the learning rate from step {step + 1} on "
                        f"follows the new schedule, not the one the checkpoint was trained on")
    batches = [f"{flag} {getattr(have, name)!r} -> {getattr(want, name)!r}" for name, flag in _BATCHES
               if getattr(have, name) != getattr(want, name)]
    if batches:
        warnings.append(f"resuming {where} with {', '.join(batches)}: the batches from step {step + 1} on differ "
                        f"from the ones the first run would have trained on")
    return step, warnings


def _train_state(step: int, scaler) -> dict[str, torch.Tensor]:
    state = {"step": torch.tensor(step)}
    if scaler is not None:  # fp16 loss scaling: the scale and how many good steps since it last grew
        scaler_state = scaler.state_dict()
        state["loss_scale"] = torch.tensor(scaler_state["scale"])
        state["growth_tracker"] = torch.tensor(scaler_state["_growth_tracker"])
    return state


def save(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scaler=None,
         record: CheckpointRecord | None = None) -> None:
    """Every rank writes its shards; rank 0 writes ``record`` first, so a checkpoint complete
    enough to resume from (``.metadata``, written last) always has one.

    A write that fails on any rank (a full disk) fails the save on every rank alike
    (torch.distributed.checkpoint gathers the ranks' errors and hands them to all): one
    ``PartitaError`` line, ``no space left on device writing DIR/step-000012``. The directory
    has no ``.metadata`` then, so a resume takes the step before it."""
    where = step_dir(root, step)
    if record is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        write_record(root, record)
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    state = {"model": model_state, "optim": optim_state, "train": _train_state(step, scaler)}
    try:
        dcp.save(state, checkpoint_id=str(where))
    except dcp.CheckpointException as e:  # the ranks' errors, by rank: a write error is the line
        written = next((exc for _, (exc, _) in sorted(e.failures.items()) if isinstance(exc, OSError)), None)
        if written is None:
            raise
        raise fileio.write_error(where, written) from None
    except OSError as e:
        raise fileio.write_error(where, e) from None
    log.info("saved checkpoint %s", where)


def load(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scaler=None) -> int:
    """Load the checkpoint of ``step`` in place; returns the step to continue from."""
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    state = {"model": model_state, "optim": optim_state, "train": _train_state(0, scaler)}
    dcp.load(state, checkpoint_id=str(step_dir(root, step)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=OPTIONS)
    if scaler is not None:
        scaler_state = scaler.state_dict()
        scaler_state.update(scale=float(state["train"]["loss_scale"]),
                            _growth_tracker=int(state["train"]["growth_tracker"]))
        scaler.load_state_dict(scaler_state)
    log.info("resumed from %s", step_dir(root, step))
    return int(state["train"]["step"])
