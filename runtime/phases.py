"""Where a step's time goes on one rank: each micro-batch's forward and backward, and the
optimizer, recorded beside the step time in ``metrics.jsonl`` for ``partita calibrate``.

    timer = PhaseTimer(device)
    with timer.span("forward"):
        out = model(x)
    ...
    timer.take()   # {"forward_s": [...], "loss_s": [...], "backward_s": [...], "optimizer_s": [...]}

On CPU a span is two ``time.perf_counter`` reads. On GPUs it is a pair of CUDA events on the
current stream, read once per step (``take``, after the step clock has drained the device), so
timing adds no synchronisation inside the step. A span measures what its phase queues on the
device: a micro-batch's forward includes the tensor-parallel collectives and the FSDP gathers
it waits for, not the pipeline's receives (those are waited for before the schedule calls the
stage) nor time spent waiting for other stages.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

# The loss is its own phase: the pipeline schedule computes it after the last stage's forward.
# The cost model counts it with the head's forward (``partita calibrate`` adds the two).
PHASES = ("forward", "loss", "backward", "optimizer")


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._spans: dict[str, list] = {p: [] for p in PHASES}

    @contextmanager
    def span(self, phase: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._spans[phase].append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._spans[phase].append(time.perf_counter() - t0)

    def take(self) -> dict[str, list[float]]:
        """The step's spans in seconds, by phase (``<phase>_s``), and a fresh start. Call after
        the device has drained (the step clock synchronises)."""
        out = {}
        for phase, spans in self._spans.items():
            out[f"{phase}_s"] = [s[0].elapsed_time(s[1]) / 1e3 if self.cuda else s for s in spans]
        self._spans = {p: [] for p in PHASES}
        return out
