"""Clocks for one piece of device work: CUDA events on a GPU, a monotonic clock on the CPU."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch


class Clock:
    """``clock.time(fn)`` runs ``fn`` once and returns the seconds it took on ``device``.

    On CUDA the interval is between two events on the current stream, read after a
    synchronize, so it is the device's time for the kernels ``fn`` queued (plus any gap the
    host leaves between them, which eager training pays too). On the CPU, ops run
    synchronously and a monotonic clock brackets them: ``time.perf_counter`` (wall time), or,
    with ``cpu_time`` and one intra-op thread, ``time.thread_time`` -- the CPU time of the
    calling thread, which is where single-threaded ops run. It leaves out the time the thread
    spends descheduled, so a profile taken on a shared, busy machine measures the work and not
    the neighbours.
    """

    def __init__(self, device: torch.device, *, cpu_time: bool = False) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._cpu_clock = time.thread_time if cpu_time else time.perf_counter

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        start_s = self._cpu_clock()
        fn()
        return self._cpu_clock() - start_s


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def out_of_memory(e: BaseException) -> bool:
    """Whether a measurement failed for want of memory: CUDA's ``OutOfMemoryError``, or the CPU
    allocator's ``RuntimeError`` (it has no type of its own, only its message)."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))
