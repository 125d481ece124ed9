"""Re-fit the roofline efficiency curves of ``partita.search.roofline`` to measured kernels.

Run from the repository root::

    python benchmarks/calibrate_roofline.py                  # ../shared/data/h200
    python benchmarks/calibrate_roofline.py path/to/h200     # a folder with gemm.jsonl, attn.jsonl, copy.jsonl

It fits each curve by least squares on log time (Levenberg-Marquardt, numpy only), prints
measured against predicted time per point, the median and largest relative error of time for
GEMM and attention, the same for the constants committed in ``roofline.py``, the rate the products
measured last and longest keep against the curve (the sustained-load fraction on Hopper), and
the fitted constants to paste there. The committed constants are what the library uses; this script
never changes them.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from partita.search import roofline
from partita.search.roofline import KernelCurve

H200_PEAK_FLOPS = 989e12  # catalog bf16 dense peak (partita.devices, H200)
H200_BANDWIDTH = 4800e9  # catalog HBM bandwidth
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "h200"


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass(frozen=True)
class GemmPoints:
    shapes: np.ndarray  # (n, 3): m, n, k
    flops: np.ndarray
    nbytes: np.ndarray
    seconds: np.ndarray


@dataclass(frozen=True)
class AttentionPoints:
    shapes: np.ndarray  # (n, 4): batch, heads, seq, head_dim
    flops: np.ndarray  # forward
    nbytes: np.ndarray  # forward
    forward_s: np.ndarray
    forward_backward_s: np.ndarray


def load_gemm(folder: Path) -> GemmPoints:
    rows = read_jsonl(folder / "gemm.jsonl")
    shapes = np.array([(r["m"], r["n"], r["k"]) for r in rows], dtype=float)
    fb = [roofline.matmul_flops_bytes(int(m), int(n), int(k), "bf16") for m, n, k in shapes]
    return GemmPoints(shapes, np.array([f for f, _ in fb]), np.array([b for _, b in fb]),
                      np.array([r["s"] for r in rows]))


def load_attention(folder: Path) -> AttentionPoints:
    rows = read_jsonl(folder / "attn.jsonl")
    shapes = np.array([(r["b"], r["heads"], r["seq"], r["head_dim"]) for r in rows], dtype=float)
    fb = [roofline.attention_flops_bytes(int(b), int(h), int(s), int(d), causal=bool(r.get("causal", True)),
                                         dtype="bf16") for (b, h, s, d), r in zip(shapes, rows)]
    return AttentionPoints(shapes, np.array([f for f, _ in fb]), np.array([b for _, b in fb]),
                           np.array([r["fwd_s"] for r in rows]), np.array([r["fwd_bwd_s"] for r in rows]))


def fit_log_least_squares(predict: Callable[[np.ndarray], np.ndarray], start: np.ndarray,
                          measured: np.ndarray, iterations: int = 500) -> np.ndarray:
    """Levenberg-Marquardt on r(p) = log predict(p) - log measured; ``p`` are log-parameters,
    which keeps every constant positive. Forward-difference Jacobian: the models are cheap."""
    params = np.array(start, dtype=float)

    def residual(p: np.ndarray) -> np.ndarray:
        return np.log(predict(np.exp(p))) - np.log(measured)

    r = residual(params)
    cost = r @ r
    damping = 1e-2
    for _ in range(iterations):
        jac = np.empty((len(measured), len(params)))
        for i in range(len(params)):
            step = np.zeros_like(params)
            step[i] = 1e-6
            jac[:, i] = (residual(params + step) - r) / 1e-6
        normal, gradient = jac.T @ jac, jac.T @ r
        while damping < 1e10:
            delta = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12), -gradient)
            r_new = residual(params + delta)
            if r_new @ r_new < cost:
                break
            damping *= 4
        else:
            break  # no step lowers the cost: converged
        converged = cost - r_new @ r_new < 1e-14
        params, r, cost = params + delta, r_new, r_new @ r_new
        damping = max(damping / 3, 1e-9)
        if converged:
            break
    return np.exp(params)


def curve(p: np.ndarray) -> KernelCurve:
    floor_s, efficiency, memory_weight, sharpness = p
    return KernelCurve(floor_s=floor_s, efficiency=efficiency, memory_weight=memory_weight, sharpness=sharpness)


def gemm_seconds(c: KernelCurve, pts: GemmPoints) -> np.ndarray:
    return c.time_s(pts.flops, pts.nbytes, H200_PEAK_FLOPS, H200_BANDWIDTH)


def attention_seconds(fwd: KernelCurve, bwd: KernelCurve, pts: AttentionPoints) -> tuple[np.ndarray, np.ndarray]:
    forward = fwd.time_s(pts.flops, pts.nbytes, H200_PEAK_FLOPS, H200_BANDWIDTH)
    backward = bwd.time_s(roofline.ATTENTION_BWD_FLOPS_RATIO * pts.flops, 2 * pts.nbytes, H200_PEAK_FLOPS,
                          H200_BANDWIDTH)
    return forward, forward + backward


def fit(gemm: GemmPoints, attn: AttentionPoints) -> tuple[KernelCurve, KernelCurve, KernelCurve]:
    # Start points: a ~30 µs floor, ~70% of peak, all memory traffic exposed, a quadratic blend.
    gemm_curve = curve(fit_log_least_squares(lambda p: gemm_seconds(curve(p), gemm),
                                             np.log([3e-5, 0.75, 0.5, 2.0]), gemm.seconds))
    fwd_curve = curve(fit_log_least_squares(
        lambda p: curve(p).time_s(attn.flops, attn.nbytes, H200_PEAK_FLOPS, H200_BANDWIDTH),
        np.log([3e-5, 0.7, 1.0, 2.0]), attn.forward_s))
    # The backward is fitted on forward+backward (what was measured), the forward curve held.
    bwd_curve = curve(fit_log_least_squares(lambda p: attention_seconds(fwd_curve, curve(p), attn)[1],
                                            np.log([2.5e-4, 0.5, 1.0, 2.0]), attn.forward_backward_s))
    return gemm_curve, fwd_curve, bwd_curve


def sustained_fraction(gemm: GemmPoints, c: KernelCurve, m: int = roofline.SUSTAINED_SERIES_M) -> float:
    """The median rate of the products with ``m`` rows over the curve's: at the largest m, the
    series measured last and longest, what a Hopper part keeps under sustained load
    (``roofline.HOPPER_SUSTAINED_TENSOR``)."""
    at = gemm.shapes[:, 0] == m
    if not at.any():
        raise SystemExit(f"no products with m = {m} in the GEMM data")
    return float(np.median(gemm_seconds(c, gemm)[at] / gemm.seconds[at]))


def errors(predicted: np.ndarray, measured: np.ndarray) -> tuple[float, float]:
    """Median and largest |predicted / measured - 1|."""
    rel = np.abs(predicted / measured - 1)
    return float(np.median(rel)), float(rel.max())


def print_tables(gemm: GemmPoints, attn: AttentionPoints, gemm_curve: KernelCurve, fwd: KernelCurve,
                 bwd: KernelCurve) -> None:
    print("GEMM (bf16)                        measured            predicted")
    print(f"{'m':>6} {'n':>6} {'k':>6}  {'us':>9} {'TFLOP/s':>8}  {'us':>9} {'TFLOP/s':>8}  {'error':>6}")
    pred = gemm_seconds(gemm_curve, gemm)
    for (m, n, k), f, t, p in zip(gemm.shapes, gemm.flops, gemm.seconds, pred):
        print(f"{m:6.0f} {n:6.0f} {k:6.0f}  {t * 1e6:9.1f} {f / t / 1e12:8.0f}  {p * 1e6:9.1f} {f / p / 1e12:8.0f}"
              f"  {p / t - 1:+6.1%}")
    print()
    print("Attention (causal, bf16)           forward (us)               forward+backward (us)")
    print(f"{'b':>3} {'heads':>5} {'seq':>5} {'hd':>4}  {'meas':>8} {'pred':>8} {'error':>6}   "
          f"{'meas':>8} {'pred':>8} {'error':>6}")
    pf, pfb = attention_seconds(fwd, bwd, attn)
    for (b, h, s, d), tf, tfb, a, ab in zip(attn.shapes, attn.forward_s, attn.forward_backward_s, pf, pfb):
        print(f"{b:3.0f} {h:5.0f} {s:5.0f} {d:4.0f}  {tf * 1e6:8.1f} {a * 1e6:8.1f} {a / tf - 1:+6.1%}   "
              f"{tfb * 1e6:8.1f} {ab * 1e6:8.1f} {ab / tfb - 1:+6.1%}")
    print()


def summary(label: str, gemm: GemmPoints, attn: AttentionPoints, gemm_curve: KernelCurve, fwd: KernelCurve,
            bwd: KernelCurve) -> None:
    pf, pfb = attention_seconds(fwd, bwd, attn)
    print(f"{label}: |relative error of time|, median / max")
    for name, (med, top) in (("GEMM", errors(gemm_seconds(gemm_curve, gemm), gemm.seconds)),
                             ("attention forward", errors(pf, attn.forward_s)),
                             ("attention forward+backward", errors(pfb, attn.forward_backward_s))):
        print(f"  {name:28s} {med:6.1%} / {top:6.1%}  ({len(gemm.seconds) if name == 'GEMM' else len(pf)} points)")
    print()


def print_attention_by_length(attn: AttentionPoints) -> None:
    """The measured SDPA kernel's causal throughput by sequence length (its best batch x heads at
    each length) beside the published Hopper kernels' curves that ``roofline.HOPPER_ATTENTION``
    prices (FlashAttention-3 paper, H100 SXM5; the causal backward by its rule)."""
    kernels = list(roofline.HOPPER_ATTENTION)
    print("Attention by sequence length, causal, TFLOP/s (SDPA: H200 measured, best batch x heads; others: curves)")
    print(f"{'seq':>6} {'sdpa fwd':>9} {'sdpa bwd':>9}  " + "  ".join(f"{k + ' fwd':>11} {k + ' bwd':>11}" for k in kernels))
    for seq in sorted(set(attn.shapes[:, 2])):
        at = attn.shapes[:, 2] == seq
        fwd = attn.flops[at] / attn.forward_s[at]
        bwd = roofline.ATTENTION_BWD_FLOPS_RATIO * attn.flops[at] / (attn.forward_backward_s[at] - attn.forward_s[at])
        curves = "  ".join(
            f"{roofline.HOPPER_ATTENTION[k].efficiency(int(seq), causal=True, backward=False) * H200_PEAK_FLOPS / 1e12:11.0f} "
            f"{roofline.HOPPER_ATTENTION[k].efficiency(int(seq), causal=True, backward=True) * H200_PEAK_FLOPS / 1e12:11.0f}"
            for k in kernels)
        print(f"{seq:6.0f} {fwd.max() / 1e12:9.0f} {bwd.max() / 1e12:9.0f}  {curves}")
    print()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="?", type=Path, default=DEFAULT_DATA,
                        help=f"folder with gemm.jsonl, attn.jsonl, copy.jsonl (default {DEFAULT_DATA})")
    args = parser.parse_args(argv)
    gemm, attn = load_gemm(args.data), load_attention(args.data)
    copy = read_jsonl(args.data / "copy.jsonl")

    gemm_curve, fwd_curve, bwd_curve = fit(gemm, attn)
    print_tables(gemm, attn, gemm_curve, fwd_curve, bwd_curve)
    print_attention_by_length(attn)
    summary("fitted now", gemm, attn, gemm_curve, fwd_curve, bwd_curve)
    summary("committed in roofline.py", gemm, attn, roofline.GEMM_CURVE, roofline.ATTENTION_FWD_CURVE,
            roofline.ATTENTION_BWD_CURVE)
    bandwidth = np.median([r["bytes"] / r["s"] for r in copy])
    print(f"copy: {bandwidth / 1e9:.0f} GB/s, MEMORY_EFFICIENCY = {bandwidth / H200_BANDWIDTH:.3f}")
    rates = {int(m): sustained_fraction(gemm, roofline.GEMM_CURVE, int(m)) for m in sorted(set(gemm.shapes[:, 0]))}
    print("GEMM rate over the committed curve's, median by m (the largest m measured last): "
          + ", ".join(f"m={m} {r:.3f}" for m, r in rates.items()))
    print(f"  HOPPER_SUSTAINED_TENSOR = {rates[roofline.SUSTAINED_SERIES_M]:.3f}"
          f"  (committed: {roofline.HOPPER_SUSTAINED_TENSOR})")
    print("fitted constants:")
    for name, c in (("GEMM_CURVE", gemm_curve), ("ATTENTION_FWD_CURVE", fwd_curve),
                    ("ATTENTION_BWD_CURVE", bwd_curve)):
        print(f"  {name} = KernelCurve(floor_s={c.floor_s:.3e}, efficiency={c.efficiency:.4f}, "
              f"memory_weight={c.memory_weight:.4g}, sharpness={c.sharpness:.4g})")


if __name__ == "__main__":
    main()
