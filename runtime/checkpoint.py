"""Checkpoints with ``torch.distributed.checkpoint``: every rank writes its shards of the model
and optimizer state (FSDP2 and tensor-parallel DTensors included; pipeline stages write
disjoint module names) into ``DIR/step-000012/``. ``.metadata`` is written last, so a
directory without it is an interrupted save and is skipped on resume.

The learning rate is a function of the step and batches are a function of (seed, step), so
the step number is the only training state besides the tensors.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

log = logging.getLogger(__name__)
PREFIX = "step-"
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


def _train_state(step: int, scaler) -> dict[str, torch.Tensor]:
    state = {"step": torch.tensor(step)}
    if scaler is not None:  # fp16 loss scaling: the scale and how many good steps since it last grew
        scaler_state = scaler.state_dict()
        state["loss_scale"] = torch.tensor(scaler_state["scale"])
        state["growth_tracker"] = torch.tensor(scaler_state["_growth_tracker"])
    return state


def save(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scaler=None) -> None:
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    state = {"model": model_state, "optim": optim_state, "train": _train_state(step, scaler)}
    dcp.save(state, checkpoint_id=str(step_dir(root, step)))
    log.info("saved checkpoint %s", step_dir(root, step))


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
