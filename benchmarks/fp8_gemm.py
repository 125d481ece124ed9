"""The share of its FP8 peak a GPU's FP8 matrix products reach, against bf16's share of its peak.

    python benchmarks/fp8_gemm.py --device cuda --out fp8_gemm.json
    python benchmarks/fp8_gemm.py --device cpu --shapes 256x256x256          # a dry run: no FP8

The time model prices a plan's FP8 products (``Plan.fp8``) at the part's FP8 peak times
``roofline.FP8_OVER_BF16_SHARE``, 0.883: the H100 SXM's Maximum Achievable Matmul FLOPS in FP8
over its bf16 one, each as a share of its datasheet peak (ml-engineering's table;
``docs/calibration.md``, "FP8 products"). This script measures that ratio on the device it runs on,
shape by shape, the way the kernel files were measured (the median of ten calls after three
warm-ups, CUDA events): ``a @ b`` in bf16, and ``torch._scaled_mm`` of the same shape with e4m3
operands scaled per tensor and a bf16 result (Transformer Engine's FP8 GEMM, cuBLASLt). The
shapes default to square products and a Llama 3 70B block's at 8,192 tokens. It prints a table
and writes every number to ``--out`` (JSON). ``benchmarks/gpu_session.sh`` runs it. Without a
CUDA device with FP8 tensor cores only the bf16 (on the CPU: fp32) products are timed, and the
FP8 columns say why they are empty.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# m x n x k: square products (8192^3 is also a Llama 3 70B block's wq and wo at 8,192 tokens and
# tp 1), then that block's MLP products (w1 and w3, then w2).
SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (8192, 28672, 8192), (8192, 8192, 28672))
REPEATS, WARMUPS = 10, 3


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is MxNxK, e.g. 8192x8192x8192; got {text!r}") from None
    if min(m, n, k) < 16 or any(d % 16 for d in (m, n, k)):
        raise argparse.ArgumentTypeError(f"FP8 products need each of M, N, K a multiple of 16; got {text!r}")
    return m, n, k


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shapes", type=lambda t: tuple(_shape(s) for s in t.split(",")), default=None,
                        help="products to time, MxNxK,... (default: 4096^3, 8192^3 and a Llama 3 70B block's)")
    parser.add_argument("--out", type=Path, default=None, help="write the measurements as JSON here")
    args = parser.parse_args(argv)
    args.shapes = tuple(dict.fromkeys(args.shapes or SHAPES))
    return args


def _median_s(torch, device: str, fn) -> float:
    """The median of REPEATS calls of ``fn`` after WARMUPS, on the profiler's clock."""
    from partita.profiler.timing import Clock, median

    clock = Clock(torch.device(device))
    for _ in range(WARMUPS):
        fn()
    return median([clock.time(fn) for _ in range(REPEATS)])


def fp8_unavailable(torch, device: str) -> str:
    """Why this device cannot run FP8 products ("" where it can)."""
    if device != "cuda":
        return "FP8 products need a CUDA device"
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no float8 products"
    if torch.cuda.get_device_capability(0) < (8, 9):
        return f"{torch.cuda.get_device_name(0)} has no FP8 tensor cores (compute capability 8.9 and up)"
    return ""


def measure(device: str, shapes) -> dict:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fp8_gemm: no CUDA device; run with --device cpu for a dry run")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    why = fp8_unavailable(torch, device)
    rows = []
    for m, n, k in shapes:
        flops = 2.0 * m * n * k
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        row = {"shape": [m, n, k], "dense_tflops": flops / _median_s(torch, device, lambda: a @ b) / 1e12,
               "fp8_tflops": None}
        if not why:
            a8 = a.to(torch.float8_e4m3fn)
            b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt's FP8 kernels take it
            one = torch.ones((), device=device, dtype=torch.float32)
            row["fp8_tflops"] = flops / _median_s(
                torch, device, lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)) / 1e12
        rows.append(row)
        del a, b
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "dense_dtype": str(dtype).removeprefix("torch."),
            "repeats": REPEATS, "warmups": WARMUPS, "fp8_unavailable": why, "rows": rows}


def with_shares(result: dict, bf16_peak: float | None, fp8_peak: float | None) -> dict:
    """Each row's FP8 share of its peak over the dense share of its (the catalog's datasheet
    peaks of the device: ``roofline.FP8_OVER_BF16_SHARE`` is this ratio on an H100), and their median."""
    shares = []
    for row in result["rows"]:
        share = None
        if row["fp8_tflops"] and bf16_peak and fp8_peak:
            share = (row["fp8_tflops"] / fp8_peak) / (row["dense_tflops"] / bf16_peak)
            shares.append(share)
        row["fp8_share_over_bf16"] = share
    return result | {"bf16_peak_tflops": bf16_peak, "fp8_peak_tflops": fp8_peak,
                     "median_fp8_share_over_bf16": statistics.median(shares) if shares else None}


def catalog_peaks(device_name: str) -> tuple[float | None, float | None]:
    """(bf16, fp8) datasheet peaks of the catalog's device whose name the CUDA name holds."""
    from partita.devices import CATALOG

    words = device_name.upper().replace("-", " ").split()
    for name in sorted(CATALOG, key=len, reverse=True):  # "H100-PCIe" before "H100"
        parts = name.upper().split("-")
        if parts[0] in words and all(p in words for p in parts[1:]):
            d = CATALOG[name]
            return d.bf16_tflops or None, d.fp8_tflops or None
    return None, None


def _write(path: Path, data: dict) -> None:
    """Whole or not at all (``fileio.write_text``: a temporary name beside the target, then a rename)."""
    from partita import fileio

    path.parent.mkdir(parents=True, exist_ok=True)
    fileio.write_text(path, json.dumps(data, indent=1))


def main(argv: list[str] | None = None) -> int:
    from partita.search.roofline import FP8_OVER_BF16_SHARE

    args = _parse(argv)
    measured = measure(args.device, args.shapes)
    result = with_shares(measured, *catalog_peaks(measured["device"]))
    if args.out is not None:
        _write(args.out, result)
    print(f"{result['device']}, torch {result['torch']}: median of {REPEATS} calls after {WARMUPS} warm-ups")
    print(f"{'M x N x K':>22} {result['dense_dtype'] + ' TFLOP/s':>16} {'fp8 TFLOP/s':>12} {'fp8 share / bf16 share':>23}")
    for row in result["rows"]:
        fp8 = f"{row['fp8_tflops']:.1f}" if row["fp8_tflops"] else "-"
        share = f"{row['fp8_share_over_bf16']:.3f}" if row["fp8_share_over_bf16"] else "-"
        print(f"{'x'.join(map(str, row['shape'])):>22} {row['dense_tflops']:16.4g} {fp8:>12} {share:>23}")
    if result["fp8_unavailable"]:
        print(f"FP8 not measured: {result['fp8_unavailable']}")
    elif result["median_fp8_share_over_bf16"] is not None:
        print(f"median {result['median_fp8_share_over_bf16']:.3f} (the time model's FP8_OVER_BF16_SHARE: "
              f"{FP8_OVER_BF16_SHARE:.3f}, an H100's MAMF pair)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
