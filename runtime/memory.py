"""What a rank holds during a training step, measured, in the plan's memory categories.

    from partita.runtime.memory import StepMemory
    memory = StepMemory(model, optimizer, device)
    result = memory.run(one_step)  # forward, backward and optimizer of one training step
    memory.peak  # {"weights": ..., "gathered_weights": ..., ...} at the step's peak

torch's memory trackers (``torch.distributed._tools``) follow every tensor storage created
inside the context and label it by what holds it: ``FSDPMemTracker`` for a model under FSDP2
(sharded and unsharded parameters and gradients, all-gather and reduce-scatter buffers),
``MemTracker`` otherwise. They work on CPU tensors as on CUDA ones, so the CPU tests measure the
same categories a GPU run holds. The peak is the moment the rank's tracked total is largest,
with each category's bytes at that moment. Reserve (CUDA context, allocator caching and
fragmentation) is not a tensor and is not tracked; on GPUs the allocator's own peak
(``torch.cuda.max_memory_allocated``) is reported beside it.
"""

from __future__ import annotations

import re
from typing import Any, Callable, TypeVar

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType, _FSDPState
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule

T = TypeVar("T")
_STEP = "partita training step"
_LAYER = re.compile(r"(?:^|\.)(embed|head|layers\.\d+)$")  # a layer module's own FQN, not one inside it

# The plan's categories (``partita.plan.StageMemory``), reserve excluded.
CATEGORIES = ("weights", "gathered_weights", "gradients", "optimizer", "activations", "transient", "pipeline_buffers")

# The trackers' labels (their ``_RefType`` values) in the plan's categories.
_CATEGORY_OF = {
    # MemTracker
    "Parameter": "weights", "Buffer": "weights", "Gradient": "gradients", "Optstate": "optimizer",
    "Activation": "activations", "Temp": "transient", "Other": "transient",
    # FSDPMemTracker
    "Sharded Param": "weights", "Unsharded Param": "gathered_weights", "All Gather": "gathered_weights",
    "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "OptState": "optimizer",
    "Inputs": "activations", "Reduce Scatter": "transient",
}


class _FSDPStepTracker(FSDPMemTracker):
    """``FSDPMemTracker`` that also labels the fp32 gradients FSDP2 accumulates unsharded across
    micro-batches under mixed precision (``unsharded_accumulated_grad``, made in backward,
    which the tracker would otherwise count as a backward temporary), and the all-gather of an
    explicit backward prefetch (``set_modules_to_backward_prefetch``, run after the layer's own
    pre-backward, where the tracker would label it a temporary too)."""

    def _register_module_and_optimizer_hooks(self) -> None:
        super()._register_module_and_optimizer_hooks()
        self._prefetching_groups = []
        for module in self._root_mod.modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            if group is not None:
                group.unshard = self._labelled_unshard(group.unshard)
                self._prefetching_groups.append(group)

    def _deregister_module_and_optimizer_hooks(self) -> None:
        for group in self._prefetching_groups:
            del group.unshard  # the class's method again
        self._prefetching_groups = []
        super()._deregister_module_and_optimizer_hooks()

    def _labelled_unshard(self, unshard: Callable[..., Any]) -> Callable[..., Any]:
        def labelled(*args: Any, **kwargs: Any) -> Any:
            state = self._fsdp_state
            if state == _FSDPState.BW:  # not the layer's own unshard: a prefetch for the next layer
                self._fsdp_state = _FSDPState.PRE_BW
            try:
                return unshard(*args, **kwargs)
            finally:
                self._fsdp_state = state

        return labelled

    def _fsdp_param_group_post_backward(self, fsdp_mod: FSDPModule, orig: Callable[..., Any]) -> Callable[..., None]:
        inner = super()._fsdp_param_group_post_backward(fsdp_mod, orig)

        def labelled(*args: Any, **kwargs: Any) -> None:
            inner(*args, **kwargs)
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group else ():
                accumulated = getattr(param, "unsharded_accumulated_grad", None)
                if accumulated is not None:
                    self._update_and_maybe_create_winfos(accumulated, _FSDPRefType.UNSHARDED_GRAD,
                                                         update_existing=True)

        return labelled


class StepMemory:
    """Measures one training step: ``run(step)`` returns the step's result; ``peak`` and
    ``raw_peak`` (the tracker's own labels) hold the bytes at the step's peak; ``moments``
    the bytes at each layer's own forward and backward peak (``{"layers.4 backward": {...}}``,
    the largest over the step's micro-batches), to compare with the moment a plan names
    (``StageMemory.peak_at``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 buffers: list[torch.Tensor] = ()) -> None:
        self.device = device
        # Tensors allocated before the step and kept through it that the trackers do not know
        # (receive buffers a pipeline stage holds between steps: none in Partita's runtime,
        # ``schedule.ReceiveOnDemandStage``): counted here, whole.
        self.buffer_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in buffers}.values())
        if isinstance(model, FSDPModule):
            self.tracker: MemTracker = _FSDPStepTracker(model, optimizer)
        else:
            self.tracker = MemTracker()
            self.tracker.track_external(model, optimizer)
        self.raw_peak: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.moments: dict[str, dict[str, int]] = {}

    def run(self, step: Callable[[], T]) -> T:
        # The trackers refuse a model called again at the top level (they take it for the next
        # iteration); a step calls it once per micro-batch. Before every module call (this
        # global hook is registered ahead of the trackers' own), the step is marked as an
        # enclosing module, so those calls count as nested ones, which they allow. The module
        # tracker resets its set of enclosing modules after every backward, hence each time.
        modules = self.tracker._mod_tracker
        hook = register_module_forward_pre_hook(lambda module, args: modules.parents.add(_STEP))
        try:
            with self.tracker:
                result = step()
        finally:
            hook.remove()
        snapshot = self.tracker.get_tracker_snapshot("peak")
        self.raw_peak = {getattr(k, "value", str(k)): int(v) for k, v in _device_snapshot(snapshot, self.device).items()}
        self.peak = categorize(self.raw_peak) | {"pipeline_buffers": self.buffer_bytes}
        self.moments = self._layer_moments()
        return result

    def _layer_moments(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for stats in self.tracker.memory_tracking.values():
            match = _LAYER.search(stats.mod_fqn)
            if match is None:
                continue  # the stage or model around the layers, or a module inside one
            for state, snapshots in stats.snapshots.items():
                phase = str(getattr(state, "value", state)).lower()
                if "peak" not in phase:
                    continue
                phase = "forward" if "forward" in phase else "backward"
                raws = [{getattr(k, "value", str(k)): int(v) for k, v in _device_snapshot(snap, self.device).items()}
                        for snap in snapshots]
                raws = [r for r in raws if r]
                if raws:
                    top = max(raws, key=lambda r: r.get("Total", sum(r.values())))
                    out[f"{match.group(1)} {phase}"] = categorize(top) | {"pipeline_buffers": self.buffer_bytes}
        return out


def _device_snapshot(snapshot: dict, device: torch.device) -> dict:
    for dev, values in snapshot.items():
        if torch.device(dev).type == device.type:
            return values
    return {}


def categorize(raw: dict[str, int]) -> dict[str, int]:
    """Tracker labels to the plan's categories (the tracker's own total is dropped)."""
    out = dict.fromkeys(CATEGORIES, 0)
    for label, nbytes in raw.items():
        if label != "Total":
            out[_CATEGORY_OF.get(label, "transient")] += nbytes
    return out
