"""Where a step's time goes on one rank: each micro-batch's forward and backward, and the
optimizer, recorded beside the step time in ``metrics.jsonl`` for ``partita calibrate``.

    timer = PhaseTimer(device)
    with timer.span("forward"):
        out = model(x)
    ...
    timer.take()   # {"forward_s": [...], "loss_s": [...], "backward_s": [...], "optimizer_s": [...]}

On CPU a span is two ``time.perf_counter`` reads, less the time the rank's thread waited for a
core meanwhile (Linux's per-thread run-queue delay, ``RunQueueDelay``): on a machine shared with
other work, a CPU rank's span is then what the plan's work took, not how long the scheduler kept
it off the cores (which slowed whole runs by up to 1.7x on the 2-core development machine).
On GPUs a span is a pair of CUDA events on the current stream, read once per step (``take``,
after the step clock has drained the device), so timing adds no synchronisation inside the step. A span measures what its phase queues on the
device: a micro-batch's forward includes the tensor-parallel collectives and the FSDP gathers
it waits for, not the pipeline's receives (those are waited for before the schedule calls the
stage) nor time spent waiting for other stages.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Iterator

import torch

# The loss is its own phase: the pipeline schedule computes it after the last stage's forward.
# The cost model counts it with the head's forward (``partita calibrate`` adds the two).
PHASES = ("forward", "loss", "backward", "optimizer")


class RunQueueDelay:
    """Seconds the calling thread has waited, runnable, for a core (the second field of Linux's
    ``/proc/thread-self/schedstat``); always 0 where the kernel does not report it. Create and
    read it on the same thread."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            self.seconds()
        except (OSError, ValueError, IndexError):
            self._fd = None

    def seconds(self) -> float:
        if self._fd is None:
            return 0.0
        return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._spans: dict[str, list] = {p: [] for p in PHASES}
        self.delay = RunQueueDelay()

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
            t0, d0 = time.perf_counter(), self.delay.seconds()
            try:
                yield
            finally:
                self._spans[phase].append(max(0.0, time.perf_counter() - t0 - (self.delay.seconds() - d0)))

    def take(self) -> dict[str, list[float]]:
        """The step's spans in seconds, by phase (``<phase>_s``), and a fresh start. Call after
        the device has drained (the step clock synchronises)."""
        out = {}
        for phase, spans in self._spans.items():
            out[f"{phase}_s"] = [s[0].elapsed_time(s[1]) / 1e3 if self.cuda else s for s in spans]
        self._spans = {p: [] for p in PHASES}
        return out
