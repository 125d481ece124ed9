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
    synchronously and ``time.perf_counter`` brackets them.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

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
        start_s = time.perf_counter()
        fn()
        return time.perf_counter() - start_s


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))
