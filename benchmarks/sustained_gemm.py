"""How much of its burst matrix-product rate a GPU keeps under sustained load.

    python benchmarks/sustained_gemm.py --device cuda --seconds 30 --out sustained.json
    python benchmarks/sustained_gemm.py --device cpu --seconds 0.5 --shape 256 256 256   # a dry run

The time model prices a Hopper part's tensor cores at ``HOPPER_SUSTAINED_TENSOR`` of the burst
curve fitted to the H200 kernel file (``search/roofline.py``; ``docs/calibration.md``, "Sustained
load"): the constant comes from the products that file measured last and longest, a proxy. This
script measures the thing itself on the device it runs on: the same bf16 product (8192^3 by
default) timed first as the kernel file timed it (the median of ten calls after three warm-ups:
the burst), then back to back for ``--seconds``, in one-second windows timed with CUDA events.
The steady rate is the median of the last half of the windows; their ratio is the fraction the
device keeps. It prints a table of the windows and writes every number to ``--out`` (JSON), for
``docs/calibration.md`` and for re-deriving the constant. ``benchmarks/gpu_session.sh`` runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the sustained run (default 30)")
    parser.add_argument("--shape", type=int, nargs=3, default=(8192, 8192, 8192), metavar=("M", "N", "K"),
                        help="the product C[m,n] = A[m,k] @ B[k,n] (default 8192 8192 8192)")
    parser.add_argument("--window", type=float, default=1.0, help="seconds per timed window (default 1)")
    parser.add_argument("--out", type=Path, default=None, help="write the measurements as JSON here")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.window <= 0 or args.window > args.seconds or min(args.shape) < 1:
        parser.error("--seconds and --window must be positive with --window <= --seconds, and the shape positive")
    return args


class _Timer:
    """Wall time of queued work on the device: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, torch, device: str):
        self.torch, self.cuda = torch, device == "cuda"

    def start(self):
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds_since(self, start) -> float:
        if self.cuda:
            end = self.torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return time.perf_counter() - start


def measure(device: str, shape: tuple[int, int, int], seconds: float, window: float) -> dict:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("sustained_gemm: no CUDA device; run with --device cpu for a dry run")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    m, n, k = shape
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    flops = 2.0 * m * n * k
    timer = _Timer(torch, device)
    for _ in range(3):  # warm-ups, as the kernel file's
        a @ b
    burst_calls = []
    for _ in range(10):
        t0 = timer.start()
        a @ b
        burst_calls.append(timer.seconds_since(t0))
    burst = flops / statistics.median(burst_calls)
    # Back to back: each window queues products until its wall time passes, then times them.
    windows = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0, calls, wall0 = timer.start(), 0, time.perf_counter()
        while time.perf_counter() - wall0 < window:
            a @ b
            calls += 1
        windows.append(calls * flops / timer.seconds_since(t0))
    steady = statistics.median(windows[len(windows) // 2:])
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
            "shape": list(shape), "seconds": seconds, "window_s": window,
            "burst_tflops": burst / 1e12, "window_tflops": [w / 1e12 for w in windows],
            "steady_tflops": steady / 1e12, "kept": steady / burst}


def _write(path: Path, data: dict) -> None:
    """Whole or not at all (``fileio.write_text``: a temporary name beside the target, then a rename)."""
    from partita import fileio

    path.parent.mkdir(parents=True, exist_ok=True)
    fileio.write_text(path, json.dumps(data, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    result = measure(args.device, tuple(args.shape), args.seconds, args.window)
    if args.out is not None:
        _write(args.out, result)
    print(f"{result['device']}, {result['dtype']} {'x'.join(map(str, result['shape']))}: "
          f"burst {result['burst_tflops']:.1f} TFLOP/s (median of 10 after 3 warm-ups)")
    for i, w in enumerate(result["window_tflops"]):
        print(f"  window {i:3d}: {w:8.1f} TFLOP/s")
    print(f"steady (median of the last half) {result['steady_tflops']:.1f} TFLOP/s: "
          f"{result['kept']:.3f} of the burst (the time model's Hopper constant: 0.944 of its burst curve)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
